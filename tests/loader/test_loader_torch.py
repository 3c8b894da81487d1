"""The loader as torch code uses it: errors in one batch, attributes, torchdata's keywords,
torch's warnings (docs/stateful-dataloader.md)."""

from __future__ import annotations

import multiprocessing
import warnings
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
from loader_helpers import (
    CollateFailsAt,
    FailsAt,
    Ids,
    KillsItsWorker,
    ReadError,
    closed_at_the_end,
    expected_batches,
    ids_collate,
    threads_end,
)

from guideloom_pipes import StatefulDataLoader
from guideloom_pipes.loader import torch_keywords
from guideloom_pipes.pipes import ReadSamples, default_collate
from guideloom_pipes.pipes.workers.threads import ThreadPool

MODES: dict[str, dict[str, Any]] = {
    "inline": {},
    "prefetch-thread": {"prefetch": 1},
    "read-thread-for-a-timeout": {"timeout": 60},
    "2-threads": {"num_workers": 2, "prefetch": 2},
    "2-processes": {"num_workers": 2, "parallel_method": "process", "prefetch": 2},
}


@pytest.fixture(autouse=True)
def _loaders_closed_whatever_happens(monkeypatch):
    with closed_at_the_end(monkeypatch, (StatefulDataLoader, ReadSamples, ThreadPool)):
        yield


def _loader(dataset: Any = None, collate_fn: Any = ids_collate, **kw: Any) -> StatefulDataLoader:
    kw.setdefault("device", "cpu")
    return StatefulDataLoader(Ids(22) if dataset is None else dataset, collate_fn, **kw)


def _batches(n: int, **kw: Any) -> list[list[int]]:
    spec = {"world_size": 1, "local_batch_size": 2, "rank": 0, "drop_last": True}
    spec.update(kw)
    return expected_batches(n, shuffle_seed=spec.pop("shuffle_seed", None), **spec)


def _skipping_errors(it: Any, loader: StatefulDataLoader) -> tuple[list[Any], list[Any]]:
    """Drain ``it`` as a loop that skips bad batches does: the batches, and for each error
    its message with the state's offset right after it."""
    batches: list[Any] = []
    errors: list[Any] = []
    while True:
        try:
            batches.append(next(it))
        except StopIteration:
            return batches, errors
        except ReadError as error:
            errors.append((str(error), loader.state_dict()["observation_offset"]))


# -- an error in one batch (issue 14, point 4) ------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["read", "collate_fn"])
@pytest.mark.parametrize("mode", MODES)
def test_after_a_batch_raises_the_next_batch_follows(mode, where):
    if where == "read":
        loader = _loader(FailsAt(22, 9), local_batch_size=2, **MODES[mode])
        message = "cannot read sample 9"
    else:
        loader = _loader(Ids(22), CollateFailsAt(9), local_batch_size=2, **MODES[mode])
        message = "cannot collate sample 9"
    expected = _batches(22)
    bad = next(i for i, batch in enumerate(expected) if 9 in batch)
    batches, errors = _skipping_errors(iter(loader), loader)
    assert batches == expected[:bad] + expected[bad + 1 :]
    assert errors == [(message, (bad + 1) * 2)]  # the failed batch counts as delivered
    assert loader.state_dict()["epoch"] == 1  # the epoch ended as usual
    loader.close()  # worker processes live as long as the loader
    assert threads_end() == [] and multiprocessing.active_children() == []


@pytest.mark.parametrize("mode", ["inline", "2-threads"])
def test_a_state_taken_after_a_failed_batch_resumes_after_it(mode):
    loader = _loader(FailsAt(22, 4), local_batch_size=2, shuffle=True, **MODES[mode])
    order = _batches(22, shuffle_seed=loader.shuffle_seed)
    bad = next(i for i, batch in enumerate(order) if 4 in batch)
    it = iter(loader)
    for _ in range(bad):
        next(it)
    with pytest.raises(ReadError):
        next(it)
    state = loader.state_dict()
    rest = list(it)
    assert rest == order[bad + 1 :]
    resumed = _loader(FailsAt(22, 4), local_batch_size=2, shuffle=True, **MODES[mode])
    resumed.load_state_dict(state)
    assert list(resumed) == rest


def test_steps_stop_at_a_failed_batch_and_the_next_call_goes_on_after_it():
    loader = _loader(FailsAt(22, 5), local_batch_size=2)
    expected = _batches(22) + _batches(22, epoch=1)
    bad = next(i for i, batch in enumerate(expected) if 5 in batch)
    got = []
    with pytest.raises(ReadError):
        for batch in loader.steps(12):
            got.append(batch)
    assert got == expected[:bad]
    left = 12 - bad - 1
    assert list(loader.steps(left)) == expected[bad + 1 : bad + 1 + left]


def test_a_loop_that_ended_with_a_batch_error_goes_on_after_that_batch():
    loader = _loader(FailsAt(22, 9), local_batch_size=2)
    expected = _batches(22)
    bad = next(i for i, batch in enumerate(expected) if 9 in batch)
    it = iter(loader)
    seen = []
    with pytest.raises(ReadError):
        for batch in it:
            seen.append(batch)
    it.close()  # what dropping it does too
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not an early close: no warning, no restart
        assert loader.state_dict()["observation_offset"] == (bad + 1) * 2
    assert seen + list(loader) == expected[:bad] + expected[bad + 1 :]


def test_a_new_iterator_after_a_batch_error_closes_the_one_that_raised():
    loader = _loader(FailsAt(22, 9), local_batch_size=2, num_workers=2, prefetch=1)
    expected = _batches(22)
    bad = next(i for i, batch in enumerate(expected) if 9 in batch)
    seen = []
    with pytest.raises(ReadError) as info:
        for batch in loader:
            seen.append(batch)
    # The exception (alive here) holds the iterator that raised: iter() closes it.
    assert info.value is not None
    assert seen + list(loader) == expected[:bad] + expected[bad + 1 :]
    assert loader.state_dict()["epoch"] == 1


def test_load_state_dict_and_steps_after_a_batch_error_close_the_one_that_raised():
    loader = _loader(FailsAt(22, 3), local_batch_size=2)
    it = iter(loader)
    next(it)
    with pytest.raises(ReadError):
        next(it)
    loader.load_state_dict({**loader.state_dict(), "observation_offset": 0})
    with pytest.raises(StopIteration):
        next(it)  # closed by load_state_dict
    it = iter(loader)
    next(it)
    with pytest.raises(ReadError):
        next(it)
    assert list(loader.steps(2)) == [[4, 5], [6, 7]]  # steps() closed it
    with pytest.raises(StopIteration):
        next(it)
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match="still active"):
        iter(loader)  # an iterator that did not fail stays the only one
    with pytest.raises(RuntimeError, match="while an iterator"):
        loader.load_state_dict(loader.state_dict())
    it.close()


def test_the_last_batch_of_an_epoch_failing_ends_the_epoch():
    loader = _loader(FailsAt(22, 21), local_batch_size=2, drop_last=False)
    batches, errors = _skipping_errors(iter(loader), loader)
    assert batches == _batches(22)[:-1]
    assert errors == [("cannot read sample 21", 22)]
    assert loader.state_dict()["epoch"] == 1
    assert next(iter(loader)) == [0, 1]  # the next epoch


@pytest.mark.timeout(120)
def test_a_worker_process_that_died_still_ends_the_iterator():
    loader = _loader(
        KillsItsWorker(22, 6),
        local_batch_size=2,
        num_workers=1,
        parallel_method="process",
        prefetch=1,
    )
    it = iter(loader)
    with pytest.raises(BrokenProcessPool):
        for _ in it:
            pass
    with pytest.raises(StopIteration):
        next(it)
    assert loader.state_dict()["observation_offset"] <= 6  # the dead batch is retried
    assert multiprocessing.active_children() == []


# -- attributes torch code reads and sets (point 6) ------------------------------------------


def test_torch_attributes_report_what_was_passed():
    generator = torch.Generator().manual_seed(3)
    loader = _loader(shuffle=True, generator=generator, num_workers=2, prefetch_factor=3)
    assert loader.generator is generator
    assert loader.prefetch_factor == 3
    assert (loader.persistent_workers, loader.worker_init_fn) == (False, None)
    assert (loader.in_order, loader.pin_memory_device) == (True, "")
    plain = _loader()
    assert plain.generator is None and plain.prefetch_factor is None


def test_collate_fn_is_the_function_batches_go_through():
    assert _loader().collate_fn is ids_collate
    loader = _loader(collate_fn=None, local_batch_size=3)
    assert loader.collate_fn is default_collate
    first = next(iter(loader))
    assert torch.equal(first, loader.collate_fn([0, 1, 2]))


@pytest.mark.parametrize(
    "name", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"]
)
def test_setting_what_torch_freezes_raises_torchs_value_error(name):
    torch_loader = torch.utils.data.DataLoader(list(range(4)))
    with pytest.raises(ValueError) as torch_error:
        setattr(torch_loader, name, getattr(torch_loader, name))
    loader = _loader()
    before = getattr(loader, name)
    with pytest.raises(ValueError) as ours:
        setattr(loader, name, before)
    assert str(ours.value) == str(torch_error.value).replace("DataLoader", "StatefulDataLoader")
    assert getattr(loader, name) is before


def test_local_batch_size_is_frozen_too_and_other_attributes_are_not():
    loader = _loader(local_batch_size=2)
    with pytest.raises(ValueError, match="local_batch_size attribute should not be set"):
        loader.local_batch_size = 4
    assert loader.batch_size == 2 and len(loader) == 11
    loader.timeout = 5.0  # torch lets it be set too
    assert loader.timeout == 5.0


@pytest.mark.parametrize(
    "kw",
    [
        {"local_batch_size": 3},
        {"local_batch_size": 2, "world_size": 3, "rank": 2, "drop_last": False, "shuffle": True},
        {"local_batch_size": 4, "world_size": 2, "rank": 1, "shuffle": True},
    ],
)
def test_sampler_and_batch_sampler_describe_this_ranks_epoch(kw):
    loader = _loader(**kw)
    assert isinstance(loader.sampler, torch.utils.data.Sampler)
    assert isinstance(loader.batch_sampler, torch.utils.data.Sampler)
    planned = list(loader.batch_sampler)
    assert len(loader.batch_sampler) == len(loader) == len(planned)
    ids = list(loader.sampler)
    assert len(loader.sampler) == len(ids) == sum(len(batch) for batch in planned)
    assert ids == [i for batch in planned for i in batch]
    assert list(loader) == planned  # what the epoch delivered
    assert list(loader.batch_sampler) == list(loader)  # now: the next epoch's
    if kw.get("shuffle"):
        assert list(loader.batch_sampler) != planned


def test_torchs_loader_reads_our_batch_sampler_to_the_same_batches():
    loader = _loader(local_batch_size=3, world_size=2, rank=1, shuffle=True, drop_last=False)
    torch_loader = torch.utils.data.DataLoader(
        Ids(22), batch_sampler=loader.batch_sampler, collate_fn=ids_collate
    )
    assert list(torch_loader) == list(loader)


def test_sampler_set_epoch_moves_to_that_epoch_and_keeps_a_resumed_position():
    loader = _loader(local_batch_size=2, shuffle=True)
    loader.sampler.set_epoch(3)
    assert loader.sampler.epoch == 3
    assert list(loader) == _batches(22, shuffle_seed=loader.shuffle_seed, epoch=3)
    loader.load_state_dict({**loader.state_dict(), "epoch": 5, "observation_offset": 8})
    loader.batch_sampler.set_epoch(5)  # the epoch it is in: the position stays
    assert list(loader) == _batches(22, shuffle_seed=loader.shuffle_seed, epoch=5)[4:]
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match=r"set_epoch\(9\) while an iterator"):
        loader.sampler.set_epoch(9)
    loader.sampler.set_epoch(6)  # the epoch being read: nothing changes
    assert len(list(it)) == len(loader) - 1


def test_len_of_an_iterator_is_the_batches_it_delivers():
    loader = _loader(local_batch_size=2, drop_last=False, world_size=2)
    assert len(iter(loader)) == len(loader)
    loader.load_state_dict({**loader.state_dict(), "epoch": 0, "observation_offset": 8})
    it = iter(loader)
    assert len(it) == len(list(it)) == len(loader) - 2


# -- torchdata's snapshot_every_n_steps (point 8) ---------------------------------------------


def test_snapshot_every_n_steps_is_accepted_with_a_note_once(monkeypatch):
    monkeypatch.setattr(torch_keywords, "snapshot_note_given", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loader = _loader(snapshot_every_n_steps=10)
        _loader(snapshot_every_n_steps=5)
    notes = [w for w in record if "snapshot_every_n_steps" in str(w.message)]
    assert len(notes) == 1
    assert "snapshot_every_n_steps=10 is ignored" in str(notes[0].message)
    assert "exact after every batch" in str(notes[0].message)
    assert len(list(loader)) == len(loader)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), ("10", TypeError)])
def test_snapshot_every_n_steps_must_be_a_positive_int(value, error):
    with pytest.raises(error, match="snapshot_every_n_steps"):
        _loader(snapshot_every_n_steps=value)


# -- torch's excessive-worker warning (point 10) ---------------------------------------------


def test_more_worker_processes_than_cpus_gives_torchs_warning(monkeypatch):
    monkeypatch.setattr(torch.utils.data.dataloader.torch._utils, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch_keywords, "cpu_count", lambda: 2)
    with pytest.warns(UserWarning) as torch_record:
        torch.utils.data.DataLoader(Ids(22), num_workers=3)
    torch_text = str(torch_record[0].message)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _loader(num_workers=3, parallel_method="process", prefetch=2)
        _loader(num_workers=2, parallel_method="process", prefetch=2)  # as many as CPUs
        _loader(num_workers=8, prefetch=4)  # threads: reads that wait on I/O want many
    texts = [str(w.message) for w in record if "excessive worker" in str(w.message)]
    assert texts == [torch_text]


# -- drop_last's default with torch's batch_size= ---------------------------------------------


def _tail_warnings(make: Any, epochs: int = 2) -> tuple[list[str], list[int]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loader = make()
        lengths = [len(list(loader)) for _ in range(epochs)]
    return [str(w.message) for w in record if "drop_last defaults" in str(w.message)], lengths


def test_torch_keywords_that_drop_a_tail_warn_once():
    texts, lengths = _tail_warnings(lambda: _loader(Ids(100), batch_size=3))
    assert lengths == [33, 33]
    assert len(texts) == 1
    assert "100 samples at batch_size=3 make 33 batches" in texts[0]
    assert "torch would deliver 34 batches" in texts[0]
    assert "drop_last=False" in texts[0]


@pytest.mark.parametrize(
    "kw",
    [
        {"batch_size": 3, "drop_last": True},
        {"batch_size": 3, "drop_last": False},
        {"local_batch_size": 3},  # GuideLoom's keywords never warn
        {"batch_size": 4},  # nothing dropped
        {"batch_size": 5, "world_size": 2},  # 100 = 10 global batches of 10
    ],
)
def test_no_tail_warning_when_drop_last_is_passed_guideloom_keywords_or_nothing_drops(kw):
    texts, lengths = _tail_warnings(lambda: _loader(Ids(100), **kw))
    assert texts == []
    spec = {
        "local_batch_size": kw.get("batch_size", kw.get("local_batch_size")),
        "world_size": kw.get("world_size", 1),
        "drop_last": kw.get("drop_last", True),
    }
    assert lengths[0] == len(_batches(100, **spec))


def test_the_tail_warning_counts_every_rank():
    texts, _ = _tail_warnings(lambda: _loader(Ids(101), batch_size=5, world_size=2), epochs=1)
    assert len(texts) == 1 and "batch_size=5 * world_size 2 make 10 batches" in texts[0]


def test_guideloom_keywords_get_guideloom_s_idle_worker_warning_and_torch_s_do_not():
    from guideloom_pipes import StatefulDataLoader

    data = list(range(40))
    with pytest.warns(UserWarning, match=r"prefetch \* local_batch_size = 0 < num_workers = 4"):
        StatefulDataLoader(data, local_batch_size=2, num_workers=4, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StatefulDataLoader(data, batch_size=2, num_workers=4, drop_last=True, device="cpu")
