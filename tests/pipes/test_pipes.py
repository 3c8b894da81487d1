"""The ``guideloom_pipes.pipes`` stages: each alone, mixed with torchdata's nodes, checkpointed."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import types
import weakref
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import numpy as np
import torch
import torchdata.nodes as tn
from loader_helpers import (
    BlocksAt,
    FailsAt,
    Gate,
    Ids,
    ReadError,
    closed_at_the_end,
    expected_batches,
    ids_collate,
    our_threads,
    threads_end,
    watchdog,
)

from guideloom_pipes import pipes
from guideloom_pipes.pipes import (
    Collate,
    DataLoaderTimeoutError,
    PinMemory,
    Positions,
    Prefetcher,
    RankPositions,
    ReadSamples,
    Shuffle,
    ToDevice,
    close_pipeline,
)
from guideloom_pipes.pipes.workers import threads as _pool
from guideloom_pipes.pipes.workers.threads import ThreadPool
from guideloom_pipes.shuffle import FeistelPermutation


@pytest.fixture(autouse=True)
def _stages_closed_whatever_happens(monkeypatch):
    with closed_at_the_end(monkeypatch, (ReadSamples, Prefetcher, ThreadPool)):
        yield


@pytest.fixture
def cpu_clock_is_the_wall_clock(monkeypatch):
    """Threads' CPU clocks read the wall clock: a job seems to compute all the time it runs.

    Thread workers decide whether jobs run side by side from the share of its time a job
    spends on the CPU: jobs that compute run one at a time. On a loaded machine a thread
    that computes also waits for a core, so that share drops and computing jobs can look
    like jobs that wait; tests of what the pool does *with* the decision fix it this way.
    """
    clocks = types.SimpleNamespace(
        **{name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    )
    clocks.thread_time = time.perf_counter
    clocks.clock_gettime = lambda clock: time.perf_counter()
    monkeypatch.setattr(_pool, "time", clocks)


def _positions(node: Any) -> list[list[int]]:
    return [item.positions.tolist() for item in node]


def _pipeline(n: int = 22, *, seed: int | None = 7, workers: int = 0, prefetch: int = 0, **kw):
    node: Any = RankPositions(n, kw.pop("local_batch_size", 3), **{"world_size": 2, **kw})
    if seed is not None:
        node = Shuffle(node, seed)
    node = ReadSamples(node, Ids(n), num_workers=workers, collate_fn=ids_collate)
    if prefetch:
        node = Prefetcher(node, prefetch)
    return node


# -- RankPositions ----------------------------------------------------------------------------


def test_rank_positions_stride_by_world_size_a_local_batch_at_a_time():
    node = RankPositions(22, 3, rank=1, world_size=2)
    assert _positions(node) == [[1, 3, 5], [7, 9, 11], [13, 15, 17]]


def test_rank_positions_emit_int64_arrays_with_their_epoch_size_and_stride():
    item = next(RankPositions(22, 3, rank=1, world_size=2, epoch=4))
    assert isinstance(item, Positions)
    assert item.positions.dtype == np.int64
    assert (item.epoch, item.num_samples, item.stride) == (4, 22, 2)


def test_rank_positions_drop_padding_so_last_batches_are_short_or_empty():
    per_rank = [
        _positions(RankPositions(22, 2, rank=r, world_size=3, drop_last=False)) for r in (0, 1, 2)
    ]
    assert [len(batches) for batches in per_rank] == [4, 4, 4]
    assert [batches[-1] for batches in per_rank] == [[18, 21], [19], [20]]
    per_rank = [
        _positions(RankPositions(22, 4, rank=r, world_size=3, drop_last=False)) for r in (0, 1, 2)
    ]
    assert [batches[-1] for batches in per_rank] == [[12, 15, 18, 21], [13, 16, 19], [14, 17, 20]]
    assert (
        _positions(
            RankPositions(22, 1, rank=2, world_size=3, drop_last=False, observation_offset=12)
        )[-1]
        == []
    )


def test_rank_positions_state_counts_global_batches_including_padding():
    node = RankPositions(22, 4, rank=0, world_size=3, drop_last=False)
    offsets = []
    for _ in node:
        offsets.append(node.state_dict()["observation_offset"])
    assert offsets == [12, 24]


def test_rank_positions_exhausted_epoch_keeps_its_end_state_and_a_reset_starts_the_next():
    node = RankPositions(10, 2)
    assert len(list(node)) == 5
    end = node.state_dict()
    assert end == {"epoch": 0, "observation_offset": 10, "num_samples": 10}  # "exhausted"
    with pytest.raises(StopIteration):
        next(node)  # does not run into the next epoch without a reset
    node.reset()
    first = next(node)
    assert first.epoch == 1 and first.positions.tolist() == [0, 1]
    node.reset(end)
    assert list(node) == []  # a state saved at the end yields nothing more
    node.reset()
    assert next(node).epoch == 1


def test_rank_positions_reset_without_state_restarts_a_partly_consumed_epoch():
    node = RankPositions(10, 2, epoch=3, observation_offset=4)
    assert next(node).positions.tolist() == [4, 5]  # a fresh node starts where it was built
    node.reset()
    assert node.state_dict()["epoch"] == 3
    assert next(node).positions.tolist() == [0, 1]  # GuideLoom: closing early zeroes the offset


def test_rank_positions_reset_to_a_state_resumes_there():
    node = RankPositions(22, 3, rank=0, world_size=2)
    node.reset({"epoch": 2, "observation_offset": 12})
    item = next(node)
    assert (item.epoch, item.positions.tolist()) == (2, [12, 14, 16])


def test_rank_positions_offset_past_the_end_gives_an_empty_epoch():
    node = RankPositions(22, 4, drop_last=False)
    node.reset({"epoch": 0, "observation_offset": 24})
    assert list(node) == []
    assert node.state_dict()["epoch"] == 0
    node.reset()
    assert node.state_dict()["epoch"] == 1


def test_rank_positions_warn_on_a_state_from_another_dataset_size():
    node = RankPositions(22, 3)
    with pytest.warns(UserWarning, match="30 samples"):
        node.reset({"epoch": 0, "observation_offset": 0, "num_samples": 30})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"local_batch_size": 0}, ValueError, "local_batch_size must be >= 1, got 0"),
        ({"world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
        ({"rank": 2, "world_size": 2}, ValueError, "rank must be < world_size"),
        ({"rank": -1}, ValueError, "rank must be >= 0, got -1"),
        ({"observation_offset": -3}, ValueError, "-3"),
        ({"local_batch_size": 2.5}, TypeError, "2.5"),
    ],
)
def test_rank_positions_reject_bad_arguments(kwargs, error, match):
    args = {"num_samples": 10, "local_batch_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        RankPositions(**args)


def test_num_steps_follows_the_spec():
    assert pipes.num_steps(22, 0, 6, True) == 3
    assert pipes.num_steps(22, 0, 6, False) == 4
    assert pipes.num_steps(22, 12, 4, False) == 3
    assert pipes.num_steps(22, 24, 4, False) == 0


# -- Shuffle ----------------------------------------------------------------------------------


def test_shuffle_maps_positions_through_the_epoch_permutation():
    node = Shuffle(RankPositions(22, 3, rank=1, world_size=2, epoch=1), seed=7)
    perm = FeistelPermutation.for_epoch(22, 7, 1)
    expected = [perm(np.array(p)).tolist() for p in [[1, 3, 5], [7, 9, 11], [13, 15, 17]]]
    assert [ids.tolist() for ids in node] == expected


def test_shuffle_computes_blocks_ahead_not_one_call_per_batch(monkeypatch):
    sizes: list[int] = []
    call = FeistelPermutation.__call__

    def counting(self, positions):
        sizes.append(np.size(positions))
        return call(self, positions)

    monkeypatch.setattr(FeistelPermutation, "__call__", counting)
    node = Shuffle(RankPositions(100_000, 8, rank=1, world_size=4), seed=3, block_size=1000)
    batches = [next(node) for _ in range(300)]
    assert sizes == [1000, 1000, 1000]  # 2400 positions of this rank in three calls
    perm = FeistelPermutation.for_epoch(100_000, 3, 0)
    assert np.array_equal(np.concatenate(batches), call(perm, 1 + 4 * np.arange(2400)))


def test_shuffle_batches_are_read_only_views():
    ids = next(Shuffle(RankPositions(50, 4), seed=1))
    with pytest.raises(ValueError, match="read-only"):
        ids[0] = 3


class _TheirPositions(RankPositions):
    """RankPositions as a node of another kind: Shuffle takes its Positions from next()."""


@settings(deadline=None, max_examples=60)
@given(
    n=st.integers(1, 300),
    batch=st.integers(1, 9),
    world=st.integers(1, 4),
    drop_last=st.booleans(),
    offset=st.integers(0, 320),
    block=st.integers(1, 40),
    resume_after=st.integers(0, 12),
    data=st.data(),
)
def test_shuffle_reads_our_positions_as_spans_as_it_reads_any_positions(
    n, batch, world, drop_last, offset, block, resume_after, data
):
    """Over RankPositions the stage takes each step as (first, count) (next_span); the
    batches, states and resumes are those it makes from any source's Positions."""
    rank = data.draw(st.integers(0, world - 1))

    def make(kind: type[RankPositions]) -> Shuffle:
        positions = kind(
            n, batch, rank=rank, world_size=world, drop_last=drop_last, observation_offset=offset
        )
        return Shuffle(positions, seed=11, block_size=block)

    ours, theirs = make(RankPositions), make(_TheirPositions)
    for _epoch in range(2):
        got, want = [], []
        for node, out in ((ours, got), (theirs, want)):
            while True:
                state = node.state_dict()
                try:
                    out.append((next(node).tolist(), state))
                except StopIteration:
                    out.append((None, node.state_dict()))
                    break
        assert got == want
        ours.reset()
        theirs.reset()
    state = want[min(resume_after, len(want) - 1)][1]
    resumed, again = make(RankPositions), make(_TheirPositions)
    resumed.reset(state)
    again.reset(state)
    assert [ids.tolist() for ids in resumed] == [ids.tolist() for ids in again]


def test_shuffle_takes_our_positions_without_making_their_arrays(monkeypatch):
    def no_positions(self):
        raise AssertionError("Positions made for a Shuffle of RankPositions")

    monkeypatch.setattr(RankPositions, "next", no_positions)
    node = Shuffle(RankPositions(22, 3, rank=1, world_size=2, drop_last=False), seed=7)
    perm = FeistelPermutation.for_epoch(22, 7, 0)
    want = [perm(1 + 2 * np.arange(i, min(i + 3, 11))).tolist() for i in range(0, 11, 3)]
    assert [ids.tolist() for ids in node] == want


def test_shuffle_accepts_positions_that_are_not_evenly_spaced():
    class Odd(tn.BaseNode):
        def reset(self, initial_state=None):
            super().reset(initial_state)

        def next(self):
            return Positions(0, 22, np.array([5, 1, 9], dtype=np.int64), 1)

        def get_state(self):
            return {}

    perm = FeistelPermutation.for_epoch(22, 7, 0)
    assert next(Shuffle(Odd(), seed=7)).tolist() == perm(np.array([5, 1, 9])).tolist()


def test_shuffle_without_a_seed_draws_one_and_adopts_a_saved_one():
    first, second = Shuffle(RankPositions(22, 3)), Shuffle(RankPositions(22, 3))
    assert isinstance(first.seed, int) and first.seed != second.seed
    first.reset({"source": {"epoch": 0, "observation_offset": 0}, "shuffle_seed": 7})
    assert first.seed == 7
    assert (
        next(first).tolist()
        == expected_batches(
            22, world_size=1, local_batch_size=3, rank=0, drop_last=True, shuffle_seed=7
        )[0]
    )


def test_shuffle_with_a_seed_warns_on_a_state_with_another():
    node = Shuffle(RankPositions(22, 3), seed=1)
    with pytest.warns(UserWarning, match="shuffle_seed=7"):
        node.reset({"source": {"epoch": 0, "observation_offset": 0}, "shuffle_seed": 7})
    assert node.seed == 1


@pytest.mark.parametrize(("seed", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_shuffle_rejects_bad_seeds(seed, error):
    with pytest.raises(error, match="shuffle_seed"):
        Shuffle(RankPositions(22, 3), seed)


# -- ReadSamples and Collate ------------------------------------------------------------------


class _BatchReader:
    """A dataset with a reader of its own, recording what it is asked for."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.events: list[str] = []
        self.requests: list[np.ndarray] = []

    def __len__(self) -> int:
        return self.n

    def sync_reader(self) -> _BatchReader:
        return self

    def open(self) -> None:
        self.events.append("open")

    def close(self) -> None:
        self.events.append("close")

    def read_batch(self, ids: np.ndarray) -> list[int]:
        self.requests.append(ids)
        return [int(i) * 10 for i in ids]


def test_read_samples_uses_read_batch_once_per_batch_with_an_int64_array():
    dataset = _BatchReader(12)
    node = ReadSamples(RankPositions(12, 4), dataset)
    assert list(node) == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90, 100, 110]]
    assert all(r.dtype == np.int64 and len(r) == 4 for r in dataset.requests)
    assert dataset.events == ["open"]
    node.close()
    assert dataset.events == ["open", "close"]


def test_read_samples_leaves_a_reader_it_was_given_open():
    dataset = _BatchReader(12)
    node = ReadSamples(RankPositions(12, 4), dataset, reader=dataset)
    list(node)
    node.close()
    assert dataset.events == []


def test_read_samples_uses_getitems_when_the_dataset_has_it():
    class Batched(Ids):
        def __getitems__(self, indices: list[int]) -> list[str]:
            assert isinstance(indices, list)
            return [f"s{i}" for i in indices]

    assert next(ReadSamples(RankPositions(6, 3), Batched(6))) == ["s0", "s1", "s2"]


def test_read_samples_takes_id_arrays_positions_and_lists():
    source = tn.IterableWrapper([np.array([4, 2]), [1, 3], (5,)])
    assert list(ReadSamples(source, list("abcdef"))) == [["e", "c"], ["b", "d"], ["f"]]


@pytest.mark.parametrize("workers", [0, 1])
def test_read_samples_takes_our_shuffles_ids_from_its_own_next(monkeypatch, workers):
    """Reset with the stage, our Shuffle is asked for ids with its next() (no
    BaseNode.__next__ check, no conversion); any other source through next()."""

    def wrapper_used(self):
        raise AssertionError("BaseNode.__next__ of the Shuffle was called")

    node = ReadSamples(Shuffle(RankPositions(23, 3), seed=7), list(range(23)), num_workers=workers)
    monkeypatch.setattr(Shuffle, "__next__", wrapper_used)
    got = list(node)
    close_pipeline(node)
    assert got == expected_batches(
        23, world_size=1, local_batch_size=3, rank=0, drop_last=True, shuffle_seed=7
    )


def test_read_samples_never_reads_an_empty_batch():
    dataset = _BatchReader(22)
    node = ReadSamples(RankPositions(22, 1, rank=2, world_size=3, drop_last=False), dataset)
    assert list(node)[-1] == []
    assert all(len(r) for r in dataset.requests)


@pytest.mark.parametrize("workers", [1, 3])
def test_read_samples_with_thread_workers_keeps_the_order(workers):
    node = _pipeline(
        101, workers=workers, local_batch_size=2, world_size=3, rank=1, drop_last=False
    )
    assert list(node) == expected_batches(
        101, world_size=3, local_batch_size=2, rank=1, drop_last=False, shuffle_seed=7
    )
    close_pipeline(node)
    assert threads_end() == []


@pytest.mark.timeout(60)
def test_read_samples_reads_several_batches_at_once():
    together = threading.Barrier(4, timeout=30)  # breaks, failing the test, if reads serialise

    class Meets(Ids):
        def __getitem__(self, index):
            if index < 4:
                together.wait()
            return super().__getitem__(index)

    node = ReadSamples(RankPositions(40, 1), Meets(40), num_workers=4)
    assert list(node) == [[i] for i in range(40)]
    node.close()


def test_read_samples_state_counts_only_delivered_batches():
    parallel, reference = _pipeline(60, workers=2), _pipeline(60)
    for _ in range(4):
        next(reference)
        next(parallel)  # the workers have read further ahead
        assert parallel.state_dict() == reference.state_dict()
    close_pipeline(parallel)


def test_read_samples_reraises_a_worker_exception_with_its_type_and_traceback():
    node = ReadSamples(RankPositions(20, 2), FailsAt(20, 5), num_workers=2)
    assert next(node) == [0, 1]
    assert next(node) == [2, 3]
    with pytest.raises(ReadError, match="cannot read sample 5") as info:
        next(node)
    assert "__getitem__" in "".join(traceback.format_tb(info.value.__traceback__))
    node.close()
    assert threads_end() == []


def test_read_samples_close_stops_its_threads_and_reset_restarts_them():
    node = _pipeline(200, workers=3)
    next(node)
    assert our_threads()
    close_pipeline(node)
    assert threads_end() == []
    node.reset()
    assert (
        next(node)
        == expected_batches(
            200, world_size=2, local_batch_size=3, rank=0, drop_last=True, shuffle_seed=7
        )[0]
    )
    close_pipeline(node)
    assert threads_end() == []


class _Requests(Ids):
    """Ids with ``read_batch``, recording how many ids each call asked for."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        super().__init__(n)
        self.delay = delay
        self.sizes: list[int] = []

    def read_batch(self, ids: np.ndarray) -> list[int]:
        self.sizes.append(len(ids))
        if self.delay:
            time.sleep(self.delay)
        return [int(i) for i in ids]


def _chunked(dataset: Any, n: int, **kw: Any) -> ReadSamples:
    source = Shuffle(RankPositions(n, 2, world_size=3, rank=1, drop_last=False), 7)
    return ReadSamples(source, dataset, collate_fn=ids_collate, **kw)


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("max_chunk", [2, 5, 64])
def test_chunked_jobs_keep_the_order_and_an_exact_state_at_every_batch(workers, max_chunk):
    dataset = _Requests(203)
    reference = _chunked(Ids(203), 203)
    node = _chunked(dataset, 203, num_workers=workers, chunk_seconds=10.0, max_chunk=max_chunk)
    steps = 0
    for expected in reference:
        assert next(node) == expected
        assert node.state_dict() == reference.state_dict()
        steps += 1
    with pytest.raises(StopIteration):
        next(node)
    assert node.state_dict() == reference.state_dict()
    assert steps == 34 and max(dataset.sizes) > 2  # batches were read together
    node.close()
    assert threads_end() == []


@pytest.mark.parametrize("stop", [0, 1, 6, 17, 33])
def test_chunked_jobs_resume_at_any_batch_to_the_identical_rest(stop):
    expected = expected_batches(
        203, world_size=3, local_batch_size=2, rank=1, drop_last=False, shuffle_seed=7
    )
    node = _chunked(_Requests(203), 203, num_workers=2, chunk_seconds=10.0, max_chunk=8)
    assert [next(node) for _ in range(stop)] == expected[:stop]
    state = node.state_dict()
    node.close()
    resumed = _chunked(_Requests(203), 203, num_workers=2, chunk_seconds=10.0, max_chunk=8)
    resumed.reset(state)
    assert list(resumed) == expected[stop:]
    resumed.close()


def test_a_failing_batch_in_a_chunk_fails_alone_and_the_rest_is_delivered():
    node = ReadSamples(
        RankPositions(40, 2),
        FailsAt(40, 9),
        num_workers=1,
        collate_fn=ids_collate,
        chunk_seconds=10.0,
        max_chunk=8,
    )
    assert [next(node) for _ in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ReadError, match="cannot read sample 9"):
        next(node)
    assert list(node) == [[i, i + 1] for i in range(10, 40, 2)]
    node.close()


@pytest.mark.timeout(120)
def test_a_timeout_says_which_batches_were_read_in_one_job_with_the_awaited_one():
    gate = Gate()
    node = ReadSamples(
        RankPositions(40, 2),
        BlocksAt(40, 9, gate),
        num_workers=1,
        collate_fn=ids_collate,
        timeout=0.5,
        chunk_seconds=10.0,
        max_chunk=8,
    )
    with watchdog(gate):
        assert next(node) == [0, 1]  # the first job: one batch
        with pytest.raises(DataLoaderTimeoutError) as info:
            next(node)  # batches 1 to 8 in one job, sample 9 (batch 4) hangs
        assert str(info.value).startswith(
            "DataLoader timed out after 0.5 seconds waiting for batch 1 (counting from 0 at "
            "the last reset) from 1 thread worker (read in one job with the next 7 batches: "
            "the one that hangs may be any of them)"
        )
        assert info.value.batches == 8
        close_pipeline(node)
    assert threads_end() == []


def test_slow_batches_go_one_per_job_so_workers_read_them_side_by_side():
    dataset = _Requests(48, delay=0.01)  # 10 ms per batch: far above chunk_seconds
    node = ReadSamples(RankPositions(48, 2), dataset, num_workers=4, collate_fn=ids_collate)
    assert list(node) == [[i, i + 1] for i in range(0, 48, 2)]
    assert set(dataset.sizes) == {2}
    node.close()


def test_chunking_can_be_turned_off():
    dataset = _Requests(60)
    node = ReadSamples(RankPositions(60, 2), dataset, num_workers=2, chunk_seconds=0)
    assert len(list(node)) == 30 and set(dataset.sizes) == {2}
    node.close()


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_a_reset_without_state_acts_on_what_was_delivered_not_on_what_was_read_ahead(workers):
    # A tiny epoch: the workers' first chunk reads the source to its end.
    def run() -> list[Any]:
        node = _chunked(_Requests(40), 40, num_workers=workers, chunk_seconds=10.0)
        seen = [next(node), next(node)]
        node.reset()  # partly read: the same epoch again, from its start
        seen.append(list(node))  # drained
        node.reset()  # the next epoch
        seen.append(next(node))
        node.close()
        return seen

    epoch0 = expected_batches(
        40, world_size=3, local_batch_size=2, rank=1, drop_last=False, shuffle_seed=7
    )
    epoch1 = expected_batches(
        40, world_size=3, local_batch_size=2, rank=1, drop_last=False, shuffle_seed=7, epoch=1
    )
    assert run() == [epoch0[0], epoch0[1], epoch0, epoch1[0]]


class _Concurrency(Ids):
    """``read_batch`` that waits on I/O (sleeps) or computes (holds the GIL), counting
    reads at once; for ``seconds`` a batch, or by default 0.2 ms (waits) or 0.05 ms
    (computes) per id."""

    def __init__(self, n: int, wait: bool, seconds: float | None = None) -> None:
        super().__init__(n)
        self.wait = wait
        self.seconds = seconds
        self.lock = threading.Lock()
        self.now = self.most = 0

    def read_batch(self, ids: np.ndarray) -> list[int]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        per_id = 0.0002 if self.wait else 0.00005
        seconds = per_id * len(ids) if self.seconds is None else self.seconds
        if self.wait:
            time.sleep(seconds)
        else:
            deadline = time.thread_time() + seconds
            while time.thread_time() < deadline:
                pass
        with self.lock:
            self.now -= 1
        return [int(i) for i in ids]


def test_quick_jobs_that_wait_run_side_by_side():
    waits = _Concurrency(4000, wait=True)
    node = ReadSamples(RankPositions(4000, 2), waits, num_workers=4, max_in_flight=12)
    assert len(list(node)) == 2000
    assert node.schedule.side_by_side()
    assert node._workers.pool is not None and node._workers.pool._limit == 4  # all workers may run
    node.close()


def test_quick_jobs_that_compute_run_one_at_a_time(cpu_clock_is_the_wall_clock):
    computes = _Concurrency(4000, wait=False)
    node = ReadSamples(RankPositions(4000, 2), computes, num_workers=4, max_in_flight=12)
    assert len(list(node)) == 2000
    assert not node.schedule.side_by_side()
    assert node._workers.pool is not None and node._workers.pool._limit == 1
    assert computes.most == 1  # counted inside the reads
    node.close()


def test_the_first_job_is_judged_after_running_for_chunk_seconds_itself_not_from_its_start():
    """A worker that starts the first job late (a loaded machine) leaves the probe a
    glimpse of the job's first moments, spent computing even in a job that then waits."""
    waited: list[float] = []

    class Job:  # started 1.5 ms into the probe; computes for 0.5 ms, then waits
        now, start, busy = 0.0, 0.0015, 0.0005

        def running_for(self) -> float | None:
            return self.now - self.start if self.now > self.start else None

        def running_share(self) -> float | None:
            running = self.running_for()
            return min(running, self.busy) / running if running else None

    class Pool(ThreadPool):  # no threads: time passes only in wait_done
        def wait_done(self, job: Any, seconds: float) -> bool:
            waited.append(round(seconds, 6))
            job.now += seconds
            return False

    node = ReadSamples(RankPositions(40, 2), Ids(40), num_workers=2, chunk_seconds=0.002)
    node._workers.pool = Pool(str, 0)
    node._workers.probe(Job())
    assert waited == [0.002, 0.0015]  # then 1.5 ms more, for 2 ms of its own
    assert node.schedule.side_by_side()  # judged by its share over those 2 ms (1/4): it waits
    node._workers.pool = None


def _idle_pool(fn: Any, workers: int) -> ThreadPool:
    pool = ThreadPool(fn, workers)
    pool._launch()  # (they start with the first job otherwise)
    deadline = time.monotonic() + 30
    while pool._idle < workers:  # every worker asleep, waiting for work
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return pool


class _Token:
    """An object a weak reference can follow."""


def test_a_worker_thread_keeps_no_reference_to_a_job_it_finished():
    """A finished job's result (a batch, or a failed batch's error, whose traceback once
    raised holds the caller's frames and through them the loader's iterator) is the
    caller's alone once it sees the job done: the worker let go of it under the same lock."""
    pool = ThreadPool(lambda arg: _Token(), 1, caller_runs=False)
    job = pool.submit(0)
    result, _, _ = pool.result(job, 30)
    gone = weakref.ref(result)
    del result, job
    assert gone() is None
    pool.close()
    assert threads_end() == []


def test_a_pools_threads_start_with_its_first_job():
    pool = ThreadPool(lambda arg: threading.current_thread().name, 2, caller_runs=False)
    assert len(pool._threads) == 2
    assert all(thread.ident is None for thread in pool._threads)  # nothing started yet
    job = pool.submit("first")
    assert pool.result(job, 30)[0].startswith("guideloom-read-")  # a worker ran it
    assert all(thread.ident is not None for thread in pool._threads)
    pool.close()
    assert not any(thread.is_alive() for thread in pool._threads)


def test_a_pool_never_given_a_job_closes_without_starting_threads():
    pool = ThreadPool(str, 2, init=lambda index: None)
    pool.close()
    assert all(thread.ident is None for thread in pool._threads)


def test_the_interpreters_exit_waits_for_a_closed_pools_worker_to_finish_its_job():
    """A pool closed while a worker runs a job does not wait for it, but the interpreter's
    exit does: a daemon thread still running at finalization is stopped where it next takes
    the GIL, which inside torch or pyarrow (a tensor freed) aborts the process after the
    script succeeded. The job here is let go by the script's own exit handler (those run
    last registered, first), and ends after a pause: its output shows it ran to its end."""
    script = textwrap.dedent(
        """
        import atexit, threading, time
        from guideloom_pipes.pipes.workers.threads import ThreadPool

        started, release = threading.Event(), threading.Event()

        def job(arg):
            started.set()
            release.wait()
            time.sleep(0.2)
            print("the job ended", flush=True)

        pool = ThreadPool(job, 1, caller_runs=False)
        pool.submit(0)
        started.wait()
        pool.close()  # (the worker is busy: not waited for here)
        atexit.register(release.set)
        print("closed", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["closed", "the job ended"]


def test_the_exit_wait_for_closed_pools_workers_is_bounded():
    release = threading.Event()
    pool = ThreadPool(lambda arg: release.wait(), 1, caller_runs=False)
    job = pool.submit(0)
    deadline = time.monotonic() + 30
    while not pool._busy:  # (the worker took the job)
        assert time.monotonic() < deadline
        time.sleep(0.001)
    pool.close()
    (worker,) = pool._threads
    started = time.monotonic()
    _pool._join_orphans_at_exit(timeout=0.05)
    assert worker.is_alive() and time.monotonic() - started < 30
    release.set()
    _pool._join_orphans_at_exit(timeout=30)
    assert not worker.is_alive() and job.done


def test_workers_started_by_a_job_run_their_init_before_it():
    ran: list[tuple[str, int]] = []

    def init(index: int) -> None:
        ran.append(("init", index))

    def fn(arg: int) -> int:
        ran.append(("job", arg))
        return arg

    pool = ThreadPool(fn, 1, caller_runs=False, init=init)
    assert ran == []
    assert pool.result(pool.submit(7), 30)[0] == 7
    assert ran == [("init", 0), ("job", 7)]
    pool.close()


def test_workers_started_now_run_their_init_before_any_job():
    ran: list[int] = []
    lock = threading.Lock()

    def init(index: int) -> None:
        with lock:
            ran.append(index)

    pool = ThreadPool(str, 2, init=init, start_now=True)
    pool._wait_for_inits(30)  # no job submitted: each worker ran its init all the same
    assert sorted(ran) == [0, 1]
    pool.close()


def test_a_job_the_caller_runs_runs_inside_caller_as_standing_in_for_a_worker():
    started, release = threading.Event(), threading.Event()
    seen: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def as_worker(index: int) -> Any:
        seen.append(("as", index))
        yield
        seen.append(("back", index))

    def fn(arg: str) -> str:
        if arg == "first":
            started.set()
            release.wait(30)
        return threading.current_thread().name

    pool = ThreadPool(fn, 1, caller_as=as_worker)
    try:
        first = pool.submit("first")
        assert started.wait(30)  # the only worker is busy: nobody else can take the second
        second = pool.submit("second")
        assert pool.result(second, 30)[0] == threading.current_thread().name
        assert seen == [("as", 0), ("back", 0)]
        release.set()
        assert pool.result(first, 30)[0] != threading.current_thread().name
        assert seen == [("as", 0), ("back", 0)]  # the worker's own job: no stand-in
    finally:
        release.set()
        pool.close()


@pytest.mark.parametrize("limit", [2, 1])
def test_queued_jobs_wait_for_the_running_worker_when_the_limit_is_reached(limit):
    started, release = threading.Event(), threading.Event()

    def fn(arg: str) -> str:
        if arg == "first":
            started.set()
            release.wait(30)
        return threading.current_thread().name

    pool = _idle_pool(fn, 2)
    pool.set_limit(limit)
    first = pool.submit("first")
    assert started.wait(30)
    second = pool.submit("second")
    if limit == 2:  # the sleeping worker takes it while the first is still busy
        deadline = time.monotonic() + 30
        while pool._queue:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert pool.result(second, 30)[0] != threading.current_thread().name
        release.set()
        assert pool.result(first, 30)[0] != pool.result(second, 30)[0]
    else:  # left for the running worker (the other sleeps on)
        time.sleep(0.05)
        assert pool._queue and pool._idle == 1
        release.set()
        assert pool.result(first, 30)[0] == pool.result(second, 30)[0]
    pool.close()


def test_raising_the_limit_wakes_sleeping_workers_for_queued_jobs():
    release = threading.Event()
    running = threading.Semaphore(0)

    def fn(arg: int) -> str:
        running.release()
        release.wait(30)
        return threading.current_thread().name

    pool = _idle_pool(fn, 3)
    pool.set_limit(1)
    jobs = [pool.submit(i) for i in range(3)]
    assert running.acquire(timeout=30)
    assert not running.acquire(timeout=0.05)  # one runs, two wait in the queue
    pool.set_limit(3)
    assert running.acquire(timeout=30) and running.acquire(timeout=30)  # all three run
    release.set()
    assert len({pool.result(job, 30)[0] for job in jobs}) == 3
    pool.close()


def test_slow_batches_that_compute_run_on_one_worker_at_a_time(cpu_clock_is_the_wall_clock):
    dataset = _Concurrency(60, wait=False, seconds=0.003)  # 3 ms a batch
    # chunk_seconds=1: the first job, which runs alone to tell computing from waiting, is
    # judged by its own CPU share even where a loaded machine starts its worker late (a job
    # not started within chunk_seconds is taken to wait, and jobs would then run side by side)
    node = ReadSamples(
        RankPositions(60, 2), dataset, num_workers=3, collate_fn=ids_collate, chunk_seconds=1.0
    )
    assert list(node) == [[i, i + 1] for i in range(0, 60, 2)]
    assert not node.schedule.side_by_side()
    assert node._workers.pool is not None and node._workers.pool._limit == 1
    assert dataset.most == 1  # counted inside the reads: never two at once
    node.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_workers": -1}, ValueError, "num_workers must be >= 0, got -1"),
        ({"method": "fiber"}, ValueError, "'fiber'"),
        ({"max_in_flight": 0}, ValueError, "max_in_flight must be >= 1, got 0"),
        ({"timeout": 0}, ValueError, "timeout"),
        ({"collate_fn": 3}, TypeError, "collate_fn must be callable"),
        ({"method": "process", "multiprocessing_context": "clone"}, ValueError, "'clone'"),
        ({"chunk_seconds": -1}, ValueError, "chunk_seconds must be >= 0"),
        ({"chunk_seconds": "1"}, TypeError, "chunk_seconds must be a number"),
        ({"max_chunk": 0}, ValueError, "max_chunk must be >= 1, got 0"),
        ({"max_chunk": 2.0}, TypeError, "max_chunk must be an int"),
    ],
)
def test_read_samples_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ReadSamples(RankPositions(10, 2), Ids(10), **kwargs)


def test_collate_defaults_to_torch_default_collate_and_keeps_empty_batches_empty():
    node = Collate(
        ReadSamples(RankPositions(22, 4, rank=2, world_size=3, drop_last=False), Ids(22))
    )
    batches = list(node)
    assert torch.equal(batches[0], torch.tensor([2, 5, 8, 11]))
    assert batches[-1] == [] or torch.equal(batches[-1], torch.tensor([14, 17, 20]))
    node = Collate(
        ReadSamples(
            RankPositions(22, 1, rank=2, world_size=3, drop_last=False, observation_offset=12),
            Ids(22),
        )
    )
    assert list(node)[-1] == []


def test_collate_hands_empty_batches_to_a_given_collate_fn():
    seen = []
    node = Collate(
        ReadSamples(
            RankPositions(22, 1, rank=2, world_size=3, drop_last=False, observation_offset=12),
            Ids(22),
        ),
        lambda samples: seen.append(list(samples)) or len(samples),
    )
    assert list(node) == [1, 1, 1, 0]
    assert seen[-1] == []


def test_collate_with_batch_seeds_collates_each_batch_under_its_seed_from_each_reset():
    from guideloom_pipes.pipes import batch_rng

    def draw(samples: list[Any]) -> tuple[int, float]:
        rng = batch_rng()
        assert rng is not None
        return len(samples), float(rng.numpy.random())

    def node(seeding: Any) -> Collate:
        source = ReadSamples(RankPositions(12, 3, rank=0, world_size=1), Ids(12))
        return Collate(source, draw, batch_seeds=lambda k: 100 + k, seeding=seeding)

    expected = [(3, np.random.Generator(np.random.PCG64(100 + k)).random()) for k in range(4)]
    for seeding in ("globals", "local"):
        stage = node(seeding)
        assert list(stage) == expected
        stage.reset()  # counts batches from the reset again
        assert list(stage) == expected
    random_state = np.random.get_state()[1].copy()
    list(node("local"))
    assert (np.random.get_state()[1] == random_state).all()  # "local" leaves the globals


def test_collate_with_batch_seeds_fails_a_batch_alone():
    def fail_second(samples: list[Any]) -> int:
        if samples and samples[0] == 3:
            raise KeyError("this batch")
        return len(samples)

    source = ReadSamples(RankPositions(9, 3, rank=0, world_size=1), Ids(9))
    stage = Collate(source, fail_second, batch_seeds=lambda k: k)
    it = iter(stage)
    assert next(it) == 3
    with pytest.raises(KeyError):
        next(it)
    assert next(it) == 3


# -- Prefetcher, PinMemory, ToDevice ----------------------------------------------------------


def test_prefetcher_keeps_order_and_counts_only_delivered_batches():
    node, reference = _pipeline(60, prefetch=3), _pipeline(60)
    for _ in range(3):
        assert next(node) == next(reference)
        assert node.state_dict()["source"] == reference.state_dict()
    assert list(node) == list(reference)
    assert node.state_dict()["source"] == reference.state_dict()  # the next epoch's start
    close_pipeline(node)
    assert threads_end() == []


def test_prefetcher_reraises_source_exceptions_with_their_type():
    node = Prefetcher(ReadSamples(RankPositions(20, 2), FailsAt(20, 2)), 2)
    assert next(node) == [0, 1]
    with pytest.raises(ReadError) as info:
        next(node)
    assert "__getitem__" in "".join(traceback.format_tb(info.value.__traceback__))
    assert next(node) == [4, 5]  # a read error fails its batch alone
    assert node.state_dict()["source"]["source"]["observation_offset"] == 6
    node.close()
    assert threads_end() == []


def test_the_prefetch_thread_holds_no_batch_it_handed_over():
    """While the thread pulls the next batch (here: blocked in it), the batch it handed over
    is the caller's alone: a batch dropped by the caller is freed (and a failed batch's
    error with the caller's frames in its traceback, so the loader's iterator with them)."""
    second_pull = threading.Event()

    class Tokens(tn.BaseNode):
        def reset(self, initial_state=None):
            super().reset(initial_state)
            self.calls = 0

        def next(self):
            self.calls += 1
            if self.calls == 2:
                second_pull.wait(60)
            return _Token()

        def get_state(self):
            return {}

    node = Prefetcher(Tokens(), 1)
    first = next(node)
    gone = weakref.ref(first)
    del first
    try:
        assert gone() is None
    finally:
        second_pull.set()
        node.close()
    assert threads_end() == []


def test_prefetcher_stops_after_an_error_that_is_not_one_batch_failing():
    class Broken(tn.BaseNode):
        def reset(self, initial_state=None):
            super().reset(initial_state)
            self.calls = 0

        def next(self):
            self.calls += 1
            if self.calls == 2:
                raise OSError("the source broke")
            return self.calls

        def get_state(self):
            return {}

    node = Prefetcher(Broken(), 2)
    assert next(node) == 1
    with pytest.raises(OSError, match="the source broke"):
        next(node)
    with pytest.raises(StopIteration):
        next(node)
    assert threads_end() == []


def test_prefetcher_close_joins_its_thread_even_when_blocked_on_a_full_queue():
    node = Prefetcher(ReadSamples(RankPositions(1000, 2), Ids(1000)), 1)
    next(node)
    node.close()
    assert threads_end() == []


@pytest.mark.timeout(120)
def test_prefetcher_close_does_not_wait_for_a_batch_being_pulled():
    gate = Gate()
    node = Prefetcher(ReadSamples(RankPositions(20, 2), BlocksAt(20, 2, gate)), 2)
    with watchdog(gate) as timer:
        assert next(node) == [0, 1]
        gate.wait_blocked()  # the prefetch thread reads sample 2, blocked
        close_pipeline(node)
        assert not timer.finished.is_set()  # returned with the batch still blocked
    assert threads_end() == []  # the thread drops that batch and ends


def test_prefetcher_rejects_zero():
    with pytest.raises(ValueError, match="prefetch must be >= 1"):
        Prefetcher(RankPositions(10, 2), 0)


@dataclasses.dataclass
class _Pair:
    x: torch.Tensor
    label: str


class _Named(NamedTuple):
    a: torch.Tensor
    b: list


def test_apply_to_tensors_walks_dicts_lists_tuples_named_tuples_and_dataclasses():
    batch = {
        "p": _Pair(torch.ones(2), "k"),
        "n": _Named(torch.zeros(1), [torch.ones(1), 3]),
        "t": (torch.ones(3),),
    }
    out = pipes.apply_to_tensors(batch, lambda t: t * 2)
    assert isinstance(out["p"], _Pair) and out["p"].label == "k"
    assert torch.equal(out["p"].x, torch.full((2,), 2.0))
    assert isinstance(out["n"], _Named) and out["n"].b[1] == 3
    assert torch.equal(out["n"].b[0], torch.full((1,), 2.0))
    assert isinstance(out["t"], tuple) and torch.equal(out["t"][0], torch.full((3,), 2.0))


def test_to_device_moves_nested_tensors():
    source = tn.IterableWrapper([{"x": torch.ones(2), "y": [_Pair(torch.zeros(1), "a")]}])
    batch = next(ToDevice(source, "meta"))
    assert batch["x"].device.type == "meta"
    assert batch["y"][0].x.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pin_memory_then_to_device_on_cuda():
    source = tn.IterableWrapper([{"x": torch.arange(4)}])
    pinned = next(PinMemory(source))
    assert pinned["x"].is_pinned()
    moved = next(ToDevice(PinMemory(tn.IterableWrapper([{"x": torch.arange(4)}])), "cuda"))
    assert moved["x"].device.type == "cuda" and moved["x"].tolist() == [0, 1, 2, 3]


# -- with torchdata's own nodes ---------------------------------------------------------------


def _custom(n: int = 50) -> Any:
    node: Any = Shuffle(RankPositions(n, 4, rank=1, world_size=2), seed=11)
    node = ReadSamples(node, Ids(n), num_workers=2)
    node = tn.Mapper(node, lambda samples: [s * 100 for s in samples])
    return tn.Prefetcher(node, 2)


def test_a_pipeline_mixed_with_torchdata_nodes_resumes_at_the_identical_next_batch():
    loader = tn.Loader(_custom())
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = list(it)
    resumed = tn.Loader(_custom())
    resumed.load_state_dict(state)
    assert list(resumed) == rest
    expected = [
        [s * 100 for s in b]
        for b in expected_batches(
            50, world_size=2, local_batch_size=4, rank=1, drop_last=True, shuffle_seed=11
        )
    ]
    assert head + rest == expected
    close_pipeline(loader.root)
    close_pipeline(resumed.root)


def test_a_torchdata_loader_runs_epoch_after_epoch():
    loader = tn.Loader(_custom(40))
    epochs = [list(loader) for _ in range(3)]
    assert epochs == [
        [
            [s * 100 for s in b]
            for b in expected_batches(
                40,
                world_size=2,
                local_batch_size=4,
                rank=1,
                drop_last=True,
                shuffle_seed=11,
                epoch=e,
            )
        ]
        for e in range(3)
    ]
    assert epochs[0] != epochs[1]
    close_pipeline(loader.root)


def test_close_pipeline_calls_close_down_the_source_chain():
    closed = []

    class Closing(tn.BaseNode):
        def __init__(self, source, name):
            super().__init__()
            self.source, self.name = source, name

        def close(self):
            closed.append(self.name)

    close_pipeline(Closing(tn.Mapper(Closing(None, "inner"), str), "outer"))
    assert closed == ["outer", "inner"]


def test_close_pipeline_closes_every_source_of_a_multi_node_weighted_sampler():
    sources = {
        name: ReadSamples(RankPositions(400, 2), Ids(400), num_workers=2, collate_fn=ids_collate)
        for name in ("a", "b")
    }
    sampler = tn.MultiNodeWeightedSampler(sources, {"a": 0.5, "b": 0.5}, rank=0, world_size=1)
    loader = tn.Loader(tn.Mapper(sampler, len))
    try:
        it = iter(loader)
        assert [next(it) for _ in range(20)] == [2] * 20
        assert len(our_threads()) == 4  # two workers of each source
        close_pipeline(loader.root)
        assert threads_end() == []
    finally:
        close_pipeline(loader.root)


def test_close_pipeline_closes_each_node_once_and_all_of_them_when_one_fails():
    closed = []

    class Closing(tn.BaseNode):
        def __init__(self, name, *sources, fails=False):
            super().__init__()
            self.name, self.fails = name, fails
            self.parts = list(sources)
            self.by_name = {source.name: source for source in sources}

        def close(self):
            closed.append(self.name)
            if self.fails:
                raise OSError(f"cannot close {self.name}")

    shared = Closing("shared")
    root = Closing("root", Closing("left", shared, fails=True), Closing("right", shared))
    with pytest.raises(OSError, match="cannot close left"):
        close_pipeline(root)
    assert closed == ["root", "left", "shared", "right"]


def test_process_workers_import_no_torch_unless_the_dataset_or_collate_fn_does():
    code = (
        "import sys, guideloom_pipes, guideloom_pipes.pipes.workers.process_main, loader_helpers; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    tests = Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
