"""``guideloom_pipes.DataLoader``: torch's ``DataLoader`` (its class, signature, order and
draws, checked against torch's own with the same arguments), read by our stages, with
``state_dict()`` / ``load_state_dict()`` resuming at the next batch."""

from __future__ import annotations

import signal
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
import torch.utils.data as tud
from random_helpers import Draws
from torch_loader_helpers import NoteSigterm, Uneven, stop_and_resume, with_generators
from torch_loader_helpers import plain as _plain
from torch_loader_helpers import seed_all as _seed_all

from guideloom_pipes import DataLoader

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:This DataLoader will create"),
]

WORKERS = [0, 2]


def _run(cls: type, epochs: int = 2, make: Any = None, **kw: Any) -> list[Any]:
    """Every batch of ``epochs`` epochs, then one draw of torch's global generator (so the
    loader's own draws from it are compared too)."""
    _seed_all()
    loader = cls(**(make() if make else {}), **kw)
    out: list[Any] = []
    for _ in range(epochs):
        out += [_plain(batch) for batch in loader]
    out.append(float(torch.rand(())))
    return out


def _draws(n: int = 11) -> dict[str, Any]:
    return {"dataset": Draws(n)}


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 3, "shuffle": True},
        {"batch_size": 3, "shuffle": True, "drop_last": True},
        {"batch_size": 4},
        {"batch_size": None, "shuffle": True},
        {"batch_size": 3, "shuffle": True, "generator": "seeded"},
    ],
    ids=["shuffle", "drop_last", "sequential", "unbatched", "generator"],
)
def test_batches_and_draws_equal_torchs_with_the_same_arguments(
    workers: int, options: dict[str, Any]
) -> None:
    def run(cls: type) -> list[Any]:
        return _run(cls, make=_draws, num_workers=workers, **with_generators(options))

    assert run(DataLoader) == run(tud.DataLoader)


def test_persistent_workers_give_torchs_batches_and_draws() -> None:
    kw = {"batch_size": 3, "shuffle": True, "num_workers": 2, "persistent_workers": True}
    assert _run(DataLoader, 3, _draws, **kw) == _run(tud.DataLoader, 3, _draws, **kw)


def _samplers() -> dict[str, Any]:
    n = 13
    return {
        "distributed": lambda: {
            "sampler": tud.DistributedSampler(range(n), num_replicas=2, rank=1, seed=5)
        },
        "weighted": lambda: {
            "sampler": tud.WeightedRandomSampler([1.0] * 10 + [5.0] * 3, 9, replacement=True)
        },
        "subset": lambda: {"sampler": tud.SubsetRandomSampler([1, 3, 5, 7, 9, 11])},
        "batch_sampler": lambda: {
            "batch_sampler": tud.BatchSampler(tud.RandomSampler(range(n)), 4, False),
            "batch_size": 1,
        },
    }


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("name", sorted(_samplers()))
def test_samplers_give_torchs_batches(workers: int, name: str) -> None:
    def make() -> dict[str, Any]:
        kw = _samplers()[name]()
        if "batch_sampler" in kw:
            kw.pop("batch_size")
            return {"dataset": Draws(13), **kw}
        return {"dataset": Draws(13), "batch_size": 2, **kw}

    ours = _run(DataLoader, make=make, num_workers=workers)
    assert ours == _run(tud.DataLoader, make=make, num_workers=workers)


def test_it_is_torchs_class_with_torchs_attributes() -> None:
    loader = DataLoader(Draws(5), batch_size=2, shuffle=True)
    assert isinstance(loader, tud.DataLoader)
    assert isinstance(loader.sampler, tud.RandomSampler)
    assert isinstance(loader.batch_sampler, tud.BatchSampler)
    assert (loader.batch_size, loader.drop_last, loader.num_workers) == (2, False, 0)
    assert len(loader) == 3
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        DataLoader(Draws(5), shuffle=True, sampler=tud.SequentialSampler(range(5)))


@pytest.mark.parametrize("workers", WORKERS)
def test_torchs_iterator_is_never_built(workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Any) -> Any:
        raise AssertionError("torch's _get_iterator was called")

    monkeypatch.setattr(tud.DataLoader, "_get_iterator", refuse)
    loader = DataLoader(Draws(6), batch_size=2, num_workers=workers)
    assert [_plain(batch)[0] for batch in loader] == [[0, 1], [2, 3], [4, 5]]


class _EveryOther(tud.Sampler[int]):
    """A user's sampler: every other index of a permutation drawn from torch's global
    generator at each pass."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(torch.randperm(self.n).tolist()[::2])

    def __len__(self) -> int:
        return (self.n + 1) // 2


def _resume_kinds() -> dict[str, Any]:
    """Loader arguments over 10 samples that draw nothing (read inline, ``__getitem__``'s
    draws would move torch's global generator, which the next epoch's order comes from, as
    in torch), one entry per kind of index sampler."""
    data = list(range(10))
    return {
        "shuffle": lambda: {"dataset": data, "batch_size": 3, "shuffle": True},
        "generator": lambda: {
            "dataset": data,
            "batch_size": 3,
            "shuffle": True,
            "generator": torch.Generator().manual_seed(4),
        },
        "distributed": lambda: {
            "dataset": data,
            "batch_size": 2,
            "sampler": tud.DistributedSampler(range(10), num_replicas=2, rank=0, seed=1),
        },
        "weighted": lambda: {
            "dataset": data,
            "batch_size": 2,
            "sampler": tud.WeightedRandomSampler([1.0] * 7 + [4.0] * 3, 7, replacement=True),
        },
        "subset": lambda: {
            "dataset": data,
            "batch_size": 2,
            "sampler": tud.SubsetRandomSampler([0, 2, 3, 5, 8, 9]),
        },
        "batch_sampler": lambda: {
            "dataset": data,
            "batch_sampler": tud.BatchSampler(tud.RandomSampler(range(10)), 4, False),
        },
        "unbatched": lambda: {"dataset": data, "batch_size": None, "shuffle": True},
        "users_sampler": lambda: {"dataset": data, "batch_size": 2, "sampler": _EveryOther(10)},
    }


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [({}, {}), ({"num_workers": 2}, {"num_workers": 2}), ({"num_workers": 2}, {})],
    ids=["inline", "2-workers", "2-workers-into-inline"],
)
@pytest.mark.parametrize("kind", sorted(_resume_kinds()))
def test_a_stop_at_every_step_resumes_with_the_rest_of_the_run(
    kind: str, saved: dict[str, Any], resumed: dict[str, Any]
) -> None:
    make = _resume_kinds()[kind]

    epochs = 2
    _seed_all()
    loader = DataLoader(**make(), **saved)
    whole = [_plain(batch) for _ in range(epochs) for batch in loader]
    # inline: a stop at every step; with workers (new processes at every epoch of both
    # loaders): the start, the first batches (both workers' turns), the middle of the first
    # epoch, the first epoch's end and the next batch, the last batch and the end
    n = len(whole) // epochs
    stops = sorted({0, 1, 2, n // 2, n, n + 1, 2 * n - 1, 2 * n})
    for k in range(len(whole) + 1) if not saved else stops:
        got, _ = stop_and_resume(
            k,
            lambda: DataLoader(**make(), **saved),
            epochs,
            lambda: DataLoader(**make(), **resumed),
        )
        assert got == whole, k


def test_a_state_of_another_kind_is_refused_by_name() -> None:
    loader = DataLoader(Draws(5), batch_size=2)
    with pytest.raises(ValueError, match="state_dict\\['kind'\\] = 'x'"):
        loader.load_state_dict({"kind": "x"})
    state = loader.state_dict()
    state["batches"] = 7
    with pytest.raises(ValueError, match="past the end of this loader's epoch \\(3 batches\\)"):
        loader.load_state_dict(state)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_sampler_with_its_own_state_resumes_from_that_state(workers: int) -> None:
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    def make(num_workers: int = 0) -> DataLoader[Any]:
        sampler = StatefulDistributedSampler(range(12), num_replicas=2, rank=1, seed=3)
        return DataLoader(list(range(12)), None, sampler=sampler, num_workers=num_workers)

    whole = [int(sample) for sample in make()]
    for k in range(1, len(whole) + 1):
        loader = make(workers)
        got: list[int] = []
        for sample in loader:
            got.append(int(sample))
            if len(got) == k:
                state = loader.state_dict()
                break
        resumed = make()
        resumed.load_state_dict(state)
        rest = [int(sample) for sample in resumed]
        if k == len(whole):  # the next epoch's start (the same order: no set_epoch)
            assert (state["epoch"], state["batches"], state["sampler_state"]) == (1, 0, None)
            assert rest == whole
            continue
        # the sampler's own state as of the k-th sample delivered (torchdata's protocol)
        assert state["sampler_state"] == make().sampler.state_dict() | {"yielded": k}
        assert got + rest == whole, k


@pytest.mark.parametrize("workers", WORKERS)
def test_set_epoch_between_iter_and_the_first_batch_counts_as_in_torch(workers: int) -> None:
    # (torch's sampler starts its pass at the first next(): Lightning calls set_epoch()
    # after iter(), also on a loader it has just resumed)
    def make(cls: type = DataLoader) -> Any:
        sampler = tud.DistributedSampler(range(12), num_replicas=2, rank=0, seed=1)
        return cls(list(range(12)), batch_size=2, sampler=sampler, num_workers=workers)

    def epoch_one(loader: Any) -> list[Any]:
        iterator = iter(loader)
        loader.sampler.set_epoch(1)
        return [_plain(batch) for batch in iterator]

    whole = epoch_one(make(tud.DataLoader))
    assert epoch_one(make()) == whole
    loader = make()
    iterator = iter(loader)
    loader.sampler.set_epoch(1)
    first = _plain(next(iterator))
    state = loader.state_dict()
    iterator.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert [first, *epoch_one(resumed)] == whole


@pytest.mark.parametrize("workers", WORKERS)
def test_a_resumed_pass_is_drawn_with_its_saved_epoch_whenever_set_epoch_comes(
    workers: int,
) -> None:
    # (Lightning asks a resumed loader for its first batch before it calls set_epoch)
    def make() -> Any:
        sampler = tud.DistributedSampler(range(12), num_replicas=2, rank=1, seed=2)
        return DataLoader(list(range(12)), batch_size=2, sampler=sampler, num_workers=workers)

    loader = make()
    loader.sampler.set_epoch(3)
    whole = [_plain(batch) for batch in loader]
    iterator = iter(loader)
    first = _plain(next(iterator))
    state = loader.state_dict()
    iterator.close()
    assert state["sampler_epoch"] == 3
    resumed = make()  # (its sampler at epoch 0)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    second = _plain(next(iterator))
    resumed.sampler.set_epoch(3)  # (late: the pass was drawn already)
    assert [first, second, *map(_plain, iterator)] == whole
    state = resumed.state_dict()
    assert (state["epoch"], state["batches"]) == (2, 0)  # (the loader's second epoch ended)


def test_worker_processes_end_at_sigterm_whatever_handler_the_trainer_set(
    tmp_path: Any,
) -> None:
    noted = tmp_path / "sigterm"
    before = signal.signal(signal.SIGTERM, NoteSigterm(str(noted)))
    try:
        loader = DataLoader(
            list(range(8)), batch_size=2, num_workers=2, multiprocessing_context="fork"
        )
        assert len(list(loader)) == 4  # (its workers are stopped with SIGTERM at the end)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not noted.exists(), noted.read_text()


def test_torchdatas_snapshot_every_n_steps_is_taken_and_the_state_stays_exact() -> None:
    # (torchdata's StatefulDataLoader's keyword: its callers run unchanged)
    loader = DataLoader(list(range(6)), batch_size=2, snapshot_every_n_steps=5)
    assert loader.snapshot_every_n_steps == 5
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict()["batches"] == 1
    # 0 (torchdata's "only when asked") is taken too; the state is exact after every batch
    never = DataLoader(list(range(6)), batch_size=2, snapshot_every_n_steps=0)
    iterator = iter(never)
    next(iterator)
    assert never.state_dict()["batches"] == 1
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        DataLoader(list(range(6)), snapshot_every_n_steps=-1)


@pytest.mark.parametrize("workers", WORKERS)
def test_a_state_goes_through_json_and_resumes(workers: int) -> None:
    """``json.dumps(loader.state_dict())`` works (the generator states are text), and the
    state read back resumes as the state itself does (torchdata's suites save it so)."""
    import json

    def make() -> DataLoader[Any]:
        return DataLoader(list(range(20)), batch_size=3, shuffle=True, num_workers=workers)

    _seed_all()
    loader = make()
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    text = json.dumps(loader.state_dict())
    rest = [_plain(batch) for batch in iterator]
    resumed = make()
    resumed.load_state_dict(json.loads(text))
    assert [_plain(batch) for batch in resumed] == rest and len(rest) == 4


@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_a_loaded_state_is_the_state_until_the_next_iter(kind: str) -> None:
    # (taken before any iter(), or from another run: state_dict() gives back what the
    # next iter() resumes from, not the generators as they stand now)
    def make() -> Any:
        if kind == "map-style":
            return DataLoader(list(range(10)), batch_size=2, shuffle=True)
        return DataLoader(Uneven(10, draws=False), batch_size=2)

    _seed_all()
    first = make()
    state0 = first.state_dict()
    torch.rand(5)  # (the global generator moves on)
    loaded = make()
    loaded.load_state_dict(state0)
    assert loaded.state_dict() == state0
    torch.manual_seed(7)
    assert loaded.state_dict() == state0
