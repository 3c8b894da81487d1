"""``guideloom_pipes.DataLoader`` over an ``IterableDataset``: each worker's own pass,
interleaved as torch interleaves them (checked against torch's ``DataLoader`` with the same
arguments: batches and random draws), and ``state_dict()`` / ``load_state_dict()`` resuming
at the next batch from each worker's dataset state, its iterator's, or a replay."""

from __future__ import annotations

import warnings
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
import torch.utils.data as tud
from random_helpers import Draws
from torch_loader_helpers import (
    Counted,
    DiesOnce,
    EpochCounting,
    FailsAt,
    IterableDiesOnce,
    IteratorState,
    OwnIterator,
    Uneven,
    plain,
    seed_all,
    seed_random_by_worker,
    stop_and_resume,
    with_generators,
)

from guideloom_pipes import DataLoader

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:This DataLoader will create"),
]

WORKERS = [0, 2]


def _run(cls: type, dataset: Any, epochs: int = 2, **kw: Any) -> list[Any]:
    """Every batch of ``epochs`` epochs, then one draw of torch's global generator (the
    loader's own draws from it, the base seeds, are compared too)."""
    seed_all()
    loader = cls(dataset, **kw)
    out: list[Any] = []
    for _ in range(epochs):
        out += [plain(batch) for batch in loader]
    out.append(float(torch.rand(())))
    return out


_OPTIONS = {
    "batched": {"batch_size": 3},
    "drop_last": {"batch_size": 3, "drop_last": True},
    "unbatched": {"batch_size": None},
    "generator": {"batch_size": 2, "generator": "seeded"},
}
#: (torch refuses these keywords without workers)
_WORKER_OPTIONS = {
    "persistent": {"batch_size": 3, "persistent_workers": True},
    "prefetch-1": {"batch_size": 3, "prefetch_factor": 1},
}
_CASES = [(w, name, o) for w in WORKERS for name, o in _OPTIONS.items()] + [
    (2, name, o) for name, o in _WORKER_OPTIONS.items()
]


@pytest.mark.parametrize(
    ("workers", "options"),
    [(w, o) for w, _, o in _CASES],
    ids=[f"{name}-{w}" for w, name, _ in _CASES],
)
def test_batches_and_draws_equal_torchs_with_the_same_arguments(
    workers: int, options: dict[str, Any]
) -> None:
    def run(cls: type) -> list[Any]:
        return _run(cls, Uneven(17), num_workers=workers, **with_generators(options))

    ours = run(DataLoader)
    assert ours == run(tud.DataLoader)
    assert len(ours) > 5


def test_spawned_persistent_workers_and_worker_init_fn_give_torchs_batches_and_draws() -> None:
    options = {
        "batch_size": 3,
        "num_workers": 2,
        "multiprocessing_context": "spawn",
        "persistent_workers": True,
        "worker_init_fn": seed_random_by_worker,
    }
    ours = _run(DataLoader, Uneven(11), **options)
    assert ours == _run(tud.DataLoader, Uneven(11), **options)


def test_in_order_false_delivers_every_batch_of_torchs() -> None:
    def run(cls: type) -> list[str]:
        batches = _run(cls, Uneven(13), epochs=1, batch_size=2, num_workers=2, in_order=False)
        return sorted(map(str, batches))

    assert run(DataLoader) == run(tud.DataLoader)


def test_three_workers_that_end_at_different_batches_interleave_as_torchs() -> None:
    # worker 1 ends first, halfway through its share; workers 0 and 2 go on in turn
    dataset = Uneven(29, draws=False)
    ours = _run(DataLoader, dataset, epochs=1, batch_size=2, num_workers=3)
    assert ours == _run(tud.DataLoader, dataset, epochs=1, batch_size=2, num_workers=3)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_read_error_fails_its_batch_and_the_next_one_follows_as_in_torch(workers: int) -> None:
    def run(cls: type) -> list[Any]:
        loader = cls(FailsAt(12, bad=4), batch_size=2, num_workers=workers)
        out: list[Any] = []
        iterator = iter(loader)
        while True:
            try:
                out.append(plain(next(iterator)))
            except StopIteration:
                return out
            except ValueError as error:
                assert "sample 4 is bad" in str(error)
                out.append("error")

    ours = run(DataLoader)
    assert "error" in ours
    assert ours == run(tud.DataLoader)


class _Longer(Uneven):
    def __len__(self) -> int:
        return 2  # (it gives 6)


def test_a_length_it_overruns_is_warned_of_as_torch_warns() -> None:
    dataset = _Longer(6, draws=False)

    def warned(cls: type) -> list[str]:
        loader = cls(dataset, batch_size=1)
        assert len(loader) == 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert len(list(loader)) == 6
        return [str(w.message) for w in caught]

    ours = warned(DataLoader)
    assert len(ours) == 4 and "was reported to be 2" in ours[0], ours  # (batches 3 to 6)
    assert ours == warned(tud.DataLoader)


# -- checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize(
    "kind",
    ["replayed", "dataset-state", "iterator-state", "unbatched", "drop_last"],
)
def test_a_stop_at_every_step_resumes_with_the_rest_of_the_run(kind: str, workers: int) -> None:
    n = 6 if kind == "unbatched" else 9  # (worker 1 of 2 ends first, a partial batch last)

    def make() -> Any:
        if kind == "dataset-state":
            return Counted(n)
        if kind == "iterator-state":
            return IteratorState(n)
        return Uneven(n, draws=False)

    options: dict[str, Any] = {"batch_size": None if kind == "unbatched" else 2}
    options.update(num_workers=workers, drop_last=kind == "drop_last")
    epochs = 2
    seed_all()
    loader = DataLoader(make(), **options)
    whole = [plain(batch) for _ in range(epochs) for batch in loader]
    assert len(whole) >= 6
    for k in range(len(whole) + 1):
        got, state = stop_and_resume(k, lambda: DataLoader(make(), **options), epochs)
        assert got == whole, k
        records = state["workers"]
        assert len(records) == max(workers, 1)
        if kind == "dataset-state" and 0 < k < len(whole) // 2:
            assert any(r["dataset_state"] is not None for r in records), state
        if kind == "iterator-state" and 0 < k < len(whole) // 2:
            assert any(r["iterator_state"] is not None for r in records), state


def test_persistent_workers_resume_from_a_stop_at_every_step_of_three_epochs() -> None:
    options = {"batch_size": 2, "num_workers": 2, "persistent_workers": True}

    def make() -> Any:
        return Uneven(9, draws=False)

    seed_all()
    loader = DataLoader(make(), **options)
    whole = [plain(batch) for _ in range(3) for batch in loader]
    for k in range(len(whole) + 1):
        assert stop_and_resume(k, lambda: DataLoader(make(), **options), 3)[0] == whole, k


def test_the_state_names_each_workers_samples_given_and_whose_turn_is_next() -> None:
    loader = DataLoader(Uneven(20, draws=False), batch_size=2, num_workers=2)
    iterator = iter(loader)
    assert plain(next(iterator)) == [0, 2]  # worker 0
    assert plain(next(iterator)) == [1, 3]  # worker 1
    assert plain(next(iterator)) == [4, 6]  # worker 0
    state = loader.state_dict()
    assert (state["epoch"], state["batches"], state["turn"]) == (0, 3, 1)
    assert [r["yielded"] for r in state["workers"]] == [4, 2]
    assert not any(r["ended"] for r in state["workers"])
    iterator.close()


def test_a_resume_with_another_number_of_workers_is_refused_with_the_fix() -> None:
    loader = DataLoader(Uneven(12, draws=False), batch_size=2, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    iterator.close()
    for workers in (0, 1, 3):
        other = DataLoader(Uneven(12, draws=False), batch_size=2, num_workers=workers)
        with pytest.raises(
            ValueError, match=r"taken with num_workers=2.*Resume with num_workers=2"
        ):
            other.load_state_dict(state)
    # at an epoch's start there is no pass to go on with: any number of workers takes it
    fresh = DataLoader(Uneven(12, draws=False), batch_size=2, num_workers=2).state_dict()
    inline = DataLoader(Uneven(12, draws=False), batch_size=2)
    inline.load_state_dict(fresh)
    assert plain(next(iter(inline))) == [0, 1]


def test_states_of_the_other_order_or_changed_are_refused_by_name() -> None:
    mapped = DataLoader(list(range(6)), batch_size=2)
    iterable = DataLoader(Uneven(6, draws=False), batch_size=2)
    with pytest.raises(ValueError, match="over an IterableDataset"):
        iterable.load_state_dict(mapped.state_dict())
    with pytest.raises(ValueError, match="over a map-style dataset"):
        mapped.load_state_dict(iterable.state_dict())
    state = iterable.state_dict()
    state["workers"] = [{"yielded": -1}]
    with pytest.raises(ValueError, match=r"state_dict\['workers'\]\[0\]"):
        iterable.load_state_dict(state)
    state = iterable.state_dict()
    state["turn"] = 1
    with pytest.raises(ValueError, match=r"state_dict\['turn'\] = 1 names no worker of 1"):
        iterable.load_state_dict(state)


def test_a_replay_past_the_datasets_end_says_the_state_is_of_another_dataset() -> None:
    loader = DataLoader(Uneven(12, draws=False), batch_size=2)
    iterator = iter(loader)
    next(iterator), next(iterator)
    state = loader.state_dict()
    iterator.close()
    shorter = DataLoader(Uneven(3, draws=False), batch_size=2)
    shorter.load_state_dict(state)
    with pytest.raises(ValueError, match=r"had given 4 samples.*ended after 3"):
        next(iter(shorter))


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_a_state_after_an_epochs_last_batch_is_the_next_epochs_start(
    kind: str, workers: int
) -> None:
    # (a trainer that saves after the last batch, before the loop sees the end, resumes
    # with the next epoch, not with an empty rest of this one)
    def make() -> Any:
        if kind == "map-style":
            return DataLoader(list(range(9)), batch_size=2, shuffle=True, num_workers=workers)
        return DataLoader(Uneven(9, draws=False), batch_size=2, num_workers=workers)

    seed_all()
    loader = make()
    first = [plain(batch) for batch in loader]
    state_at_end = None
    second = []
    for batch in loader:
        second.append(plain(batch))
        if state_at_end is None and len(second) == len(first):
            state_at_end = loader.state_dict()
    iterator = iter(loader)
    for _ in first:
        next(iterator)
    state = loader.state_dict()
    iterator.close()
    assert (state["epoch"], state["batches"]) == (3, 0)
    assert state_at_end is not None
    assert (state_at_end["epoch"], state_at_end["batches"]) == (2, 0)
    seed_all()
    resumed = make()
    for _ in range(2):
        list(resumed)  # (the two epochs' draws of torch's global generator)
    resumed.load_state_dict(state_at_end)
    assert [plain(batch) for batch in resumed] != []


@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_after_a_worker_dies_the_next_iter_goes_on_with_the_batch_it_lost(
    kind: str, tmp_path: Any
) -> None:
    # (an error that is not a batch's own ends the iterator; the loader stands after the
    # last batch delivered, so the state and the next iter() agree)
    marker = str(tmp_path / "died")
    make = DiesOnce if kind == "map-style" else IterableDiesOnce
    loader = DataLoader(make(12, 6, marker), batch_size=2, num_workers=2)
    open(marker + "-never", "w").close()
    never = make(12, 6, marker + "-never")
    whole = [plain(b) for b in DataLoader(never, batch_size=2, num_workers=2)]
    got = []
    with pytest.raises(BrokenProcessPool, match="exited unexpectedly"):
        for batch in loader:
            got.append(plain(batch))
    assert 0 < len(got) < len(whole)
    assert loader.state_dict()["batches"] == len(got)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (a new worker replaces the dead)
        got += [plain(batch) for batch in loader]
    assert got == whole  # (an iterable's worker passes go on from their records)


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_a_state_taken_after_a_loops_break_is_the_one_at_its_last_batch(
    kind: str, workers: int
) -> None:
    # (as torchdata's loader: a loop that breaks, then checkpoints; the next iter() still
    # starts the epoch over, as torch's does)
    def make() -> Any:
        if kind == "map-style":
            return DataLoader(list(range(12)), batch_size=2, shuffle=True, num_workers=workers)
        return DataLoader(Uneven(12, draws=False), batch_size=2, num_workers=workers)

    seed_all()
    loader = make()
    whole = [plain(batch) for batch in loader]
    got = []
    for batch in loader:
        got.append(plain(batch))
        if len(got) == 2:
            inside = loader.state_dict()
            break
    after = loader.state_dict()
    assert after["batches"] == inside["batches"] == 2
    assert after["epoch"] == inside["epoch"] == 1
    resumed = make()
    resumed.load_state_dict(after)
    assert len(got) + len([plain(batch) for batch in resumed]) == len(whole)
    again = [plain(batch) for batch in loader]  # (a new pass of that epoch, from its start)
    assert len(again) == len(whole)


@pytest.mark.parametrize(
    ("kind", "workers"), [("map-style", 0), ("map-style", 2), ("iterable", 0), ("iterable", 2)]
)
def test_a_state_taken_before_a_started_passs_first_batch_repeats_its_draws(
    kind: str, workers: int
) -> None:
    # (torchdata's order of calls: iter(), state_dict(), the batches; the state holds the
    # pass's own base seed and draws, not the next ones)
    def make() -> Any:
        draws = workers > 0  # (inline, draws come from the caller's global generator)
        if kind == "map-style":
            dataset = Draws(10) if draws else list(range(10))
            return DataLoader(dataset, batch_size=3, shuffle=True, num_workers=workers)
        return DataLoader(Uneven(10, draws=draws), batch_size=3, num_workers=workers)

    seed_all()
    loader = make()
    iterator = iter(loader)
    state = loader.state_dict()
    assert state["started"] and state["batches"] == 0
    expected = [plain(batch) for batch in iterator]
    seed_all(99)
    resumed = make()
    resumed.load_state_dict(state)
    assert [plain(batch) for batch in resumed] == expected


@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_a_state_loaded_into_a_loader_with_persistent_workers_reseeds_them(kind: str) -> None:
    # (its workers were seeded from its own run's base seed; the state's run had another)
    def make() -> Any:
        options = {"batch_size": 3, "num_workers": 2, "persistent_workers": True}
        if kind == "map-style":
            return DataLoader(Draws(10), shuffle=True, **options)
        return DataLoader(Uneven(10), **options)

    seed_all()
    loader = make()
    iterator = iter(loader)
    state = loader.state_dict()
    expected = [plain(batch) for batch in iterator]
    loader.load_state_dict(state)  # (the same loader: its workers have drawn since)
    assert [plain(batch) for batch in loader] == expected


@pytest.mark.parametrize("workers", WORKERS)
def test_a_dataset_that_is_its_own_iterator_resumes_at_every_step_from_its_one_state(
    workers: int,
) -> None:
    # (its state is the pass's, kept once, as the iterator's, and loaded after iter())
    options = {"batch_size": 2, "num_workers": workers}
    seed_all()
    whole = [plain(b) for _ in range(2) for b in DataLoader(OwnIterator(9), **options)]
    assert len(whole) >= 6
    for k in range(len(whole) + 1):
        got, state = stop_and_resume(k, lambda: DataLoader(OwnIterator(9), **options), 2)
        assert got == whole, k
        for record in state["workers"]:
            assert record["dataset_state"] is None, state
        if 0 < k < len(whole) // 2:
            assert any(r["iterator_state"] is not None for r in state["workers"]), state


def test_a_state_taken_before_the_first_batch_holds_where_the_pass_starts() -> None:
    # the first loader's pass uses the dataset object up (it is its own iterator); the
    # state taken before its first batch starts the pass over on the same object
    dataset = OwnIterator(7)
    loader = DataLoader(dataset, batch_size=2)
    iterator = iter(loader)
    state = loader.state_dict()
    assert state["workers"][0]["iterator_state"] == {"at": 0}
    whole = [plain(batch) for batch in iterator]
    assert whole == [[0, 1], [2, 3], [4, 5], [6]]
    resumed = DataLoader(dataset, batch_size=2)
    resumed.load_state_dict(state)
    assert [plain(batch) for batch in resumed] == whole
    assert dataset.iters == 2  # (one iter() per pass: the state loaded after it)


def _samples(batch: list[Any]) -> list[Any]:
    return [list(sample) for sample in batch]


@pytest.mark.parametrize(
    "options",
    [{"num_workers": 0}, {"num_workers": 2, "persistent_workers": True}, {"num_workers": 2}],
    ids=["inline", "persistent", "new-workers"],
)
@pytest.mark.parametrize("where", ["between-epochs", "after-the-last-batch"])
def test_a_datasets_own_state_at_an_epochs_end_resumes_the_next_epoch_as_the_run_went_on(
    options: dict[str, Any], where: str
) -> None:
    # EpochCounting counts its own passes: the same dataset objects (the training
    # process's, persistent workers') go on with it; new workers get new copies (torch)
    def make() -> Any:
        return DataLoader(EpochCounting(6), batch_size=2, collate_fn=_samples, **options)

    loader = make()
    first = [plain(batch) for batch in loader]
    state = loader.state_dict()
    if where == "after-the-last-batch":
        loader, batches = make(), len(first)
        first = []
        for batch in loader:
            first.append(plain(batch))
            if len(first) == batches:
                state = loader.state_dict()
    second = [plain(batch) for batch in loader]
    third = [plain(batch) for batch in loader]
    carried = options["num_workers"] == 0 or options.get("persistent_workers")
    assert {epoch for batch in second for _, epoch in batch} == {1 if carried else 0}
    resumed = make()
    resumed.load_state_dict(state)
    if state["batches"]:  # (a pass's end not seen yet: it is, when asked, with no batch)
        assert where == "after-the-last-batch" and options["num_workers"] == 0
        assert [plain(batch) for batch in resumed] == []
    assert [plain(batch) for batch in resumed] == second
    assert [plain(batch) for batch in resumed] == third
    if carried and where == "between-epochs":
        assert {str(r["dataset_state"]) for r in state["workers"]} == {"{'epoch': 1, 'next': 0}"}
        with pytest.raises(ValueError, match="num_workers"):
            DataLoader(EpochCounting(6), batch_size=2, num_workers=3).load_state_dict(state)
