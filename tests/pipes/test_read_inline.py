"""While the caller waits for the batches, batches that compute are read by the calling
thread, not handed to a worker thread (``ReadSamples``' schedule, see
``ReadSchedule.reads_inline``; tests/pipes/test_schedule.py drives the policy alone).

The policy follows measured figures (a batch's read time and CPU share, the caller's time
between batches); these tests replace the clock the stage measures with, advance it by a
set time per read and between batches, and have the schedule adopt what the workers' first
job taught, so they do not depend on how fast or how loaded the machine is.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
from loader_helpers import closed_at_the_end
from torchdata.nodes import BaseNode

from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage, StreamWithMetaStorage
from guideloom_pipes.datasets import open_reader
from guideloom_pipes.pipes import Prefetcher, ReadSamples, Shuffle, get_worker_info
from guideloom_pipes.pipes import delivery as delivery_module
from guideloom_pipes.pipes.collate import default_collate
from guideloom_pipes.pipes.delivery import Delivery
from guideloom_pipes.pipes.positions import RankPositions
from guideloom_pipes.pipes.workers import schedule as schedule_module
from guideloom_pipes.pipes.workers.schedule import INLINE_SAMPLE, ReadFigures
from guideloom_pipes.pipes.workers.threads import ThreadPool

TOKENS = np.dtype([("tokens", "<i4")])
LENGTH = 4
BATCH = 2
WINDOWS = 1000  # 500 batches: more than the workers' jobs hold ahead (at most 2 x 64)


@pytest.fixture(autouse=True)
def _stages_closed_whatever_happens(monkeypatch: pytest.MonkeyPatch) -> Any:
    with closed_at_the_end(monkeypatch, (ReadSamples, Prefetcher, ThreadPool)):
        yield


class FakeClock:
    """Stands in for ``time`` where the stage measures (pipes/delivery.py). It stands still
    except when a read advances it by ``read`` seconds a batch, or the test by
    :meth:`advance` (the caller's own work); the thread's CPU clock moves with the reads
    unless ``waiting``."""

    def __init__(self) -> None:
        self.read = 0.45e-3  # chunks of 2 ms: 4 batches
        self.waiting = False
        self.now = 0.0
        self.cpu = 0.0

    def perf_counter(self) -> float:
        return self.now

    def thread_time(self) -> float:
        return self.cpu

    def reading(self, batches: int) -> None:
        self.now += self.read * batches
        if not self.waiting:
            self.cpu += self.read * batches

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(delivery_module, "time", fake)
    # and the workers' jobs teach 0.45 ms batches that compute, however loaded the machine is
    result = ThreadPool.result

    def taught(self: ThreadPool, job: Any, timeout: float | None) -> Any:
        outcomes, _, _ = result(self, job, timeout)
        return outcomes, 0.45e-3 * len(outcomes), 1.0

    monkeypatch.setattr(ThreadPool, "result", taught)
    return fake


class Readers:
    """Our dataset's reader, opened here, whose reads note the thread that runs them (and
    can be told to fail)."""

    def __init__(self, root: Path, clock: FakeClock | None = None) -> None:
        self.clock = clock
        storage = StreamStorage(root, StreamNumpyFormat(TOKENS))
        with storage.sync_writer() as writer:
            writer.append(0, {"tokens": np.arange(WINDOWS * LENGTH // 2)})
            writer.append(1, {"tokens": np.arange(WINDOWS * LENGTH // 2, WINDOWS * LENGTH)})
        self.dataset = StreamDataset(storage, LENGTH)
        self.reader, _ = open_reader(self.dataset)
        self.threads: list[str] = []
        self.reads: list[tuple[str, int]] = []  # (thread, ids) of each read call
        self.fail_on: int | None = None
        self.interrupt_on: int | None = None
        # (read_column: a one-field stream's batches for default_collate, read in one step)
        for name in ("read_batch", "read_arrays", "read_column"):
            setattr(self.reader, name, self._noting(getattr(self.reader, name)))

    def _noting(self, read: Any) -> Any:
        def noted(ids: Any) -> Any:
            self.threads.extend([threading.current_thread().name] * (len(ids) // BATCH))
            self.reads.append((threading.current_thread().name, len(ids)))
            if self.clock is not None and threading.current_thread() is threading.main_thread():
                self.clock.reading(len(ids) // BATCH)
            if self.fail_on is not None and self.fail_on in ids.tolist():
                raise ValueError(f"sample {self.fail_on} cannot be read")
            if self.interrupt_on is not None and self.interrupt_on in ids.tolist():
                raise KeyboardInterrupt
            return read(ids)

        return noted

    def close(self) -> None:
        self.reader.close()


@pytest.fixture
def readers(tmp_path: Path, clock: FakeClock) -> Any:
    made = Readers(tmp_path / "tokens", clock)
    yield made
    made.close()


def _ids() -> Shuffle:
    return Shuffle(RankPositions(WINDOWS, BATCH), 11)


def _stage(readers: Readers, collate_fn: Any = default_collate, **kw: Any) -> ReadSamples:
    return ReadSamples(
        _ids(), readers.dataset, num_workers=2, reader=readers.reader, collate_fn=collate_fn, **kw
    )


def _reference(readers: Readers, collate_fn: Any = default_collate) -> list[Any]:
    node = ReadSamples(_ids(), readers.dataset, reader=readers.reader, collate_fn=collate_fn)
    node.reset()
    out = list(node)
    node.close()
    readers.threads.clear()
    return out


def _tokens(batch: Any) -> list[list[int]]:
    if isinstance(batch, dict):
        return batch["tokens"].tolist()
    return [sample["tokens"].tolist() for sample in batch]


def _first_id(batch: Any) -> int:
    return _tokens(batch)[0][0] // LENGTH


#: Collates of the tests below: ours (batches of columns, read one at a time by the calling
#: thread) and a user's (lists of samples, read a chunk at a time with one read).
COLLATES = pytest.mark.parametrize(
    "collate", [default_collate, lambda samples: samples], ids=["ours", "user chunks"]
)


def _taught_quick(node: ReadSamples) -> None:
    """What the workers' first job would teach of batches that compute (0.45 ms each, as
    the fake clock's reads take), and a caller that waits for them."""
    node.schedule.adopt(ReadFigures(0.45e-3, 1.0, 0.0))


def _teach_batch_seconds(node: ReadSamples, seconds: float) -> None:
    """The schedule goes on from what it learned, with batches of ``seconds`` each."""
    learned = node.schedule.learned()
    learned.batch_seconds = seconds
    node.schedule.adopt(learned)


def _drained_quick(node: ReadSamples) -> list[Any]:
    """Reset ``node``, take its first batch (a worker's job, timed), teach it quick batches
    (:func:`_taught_quick`) and take the batches of the jobs already submitted: the batches
    taken so far; the calling thread reads the next one."""
    node.reset()
    got = [next(node)]
    _taught_quick(node)
    while node._delivery._pending or node._workers.job is not None:
        got.append(next(node))
    return got


def test_quick_batches_of_our_code_are_read_by_the_calling_thread(
    readers: Readers, clock: FakeClock
) -> None:
    expected = _reference(readers)
    node = _stage(readers)
    node.reset()
    # nothing learned yet: the first batches go to the pool as a job (a worker runs it, or
    # the calling thread when no worker has started it yet: that is the pool's scheduling)
    assert node._delivery._pending and node.schedule.probing
    got = [next(node)]
    _taught_quick(node)
    got += list(node)
    node.close()

    assert list(map(_tokens, got)) == list(map(_tokens, expected))
    main = threading.current_thread().name
    # jobs submitted before the figures were known drain first (at most 2 x 64 batches)
    assert len(readers.threads) == len(expected)
    assert readers.threads[-300:] == [main] * 300


@pytest.mark.parametrize("told", [False, True], ids=["workers not told", "told who they are"])
def test_a_stage_given_learned_figures_reads_in_the_calling_thread_from_its_first_batch(
    readers: Readers, clock: FakeClock, told: bool
) -> None:
    expected = _reference(readers)
    figures = ReadFigures()
    first = _stage(readers, figures=figures)
    first.reset()
    assert first._delivery._pending  # nothing learned yet: the first job is submitted and timed
    next(first)
    next(first)  # (the caller came back at once: its gap is known too)
    assert figures.known() and figures.batch_seconds == pytest.approx(0.45e-3)
    assert figures.gap == 0
    first.close()

    readers.threads.clear()
    # the next epoch's stage, the same figures (its workers told who they are, for our
    # get_worker_info(), or not: either way they would only read batches)
    second = _stage(readers, figures=figures, base_seed=5 if told else None)
    second.reset()
    assert not second._delivery._pending and not second.schedule.probing  # no job, no timing alone
    got = [next(second) for _ in range(3)]
    # and its worker threads never started (a start and a join at every epoch, for nothing)
    assert second._workers.pool is not None and second._workers.pool._threads
    assert all(thread.ident is None for thread in second._workers.pool._threads)
    second.close()
    main = threading.current_thread().name
    assert readers.threads == [main] * 3
    assert list(map(_tokens, got)) == list(map(_tokens, expected[:3]))


def test_figures_that_say_the_batches_wait_keep_the_workers_reading_ahead(
    readers: Readers, clock: FakeClock
) -> None:
    figures = ReadFigures()
    figures.batch_seconds, figures.cpu_share, figures.gap = 0.45e-3, 0.05, 0.0  # I/O-bound
    node = _stage(readers, figures=figures)
    node.reset()
    assert node._delivery._pending and not node.schedule.probing and node.schedule.side_by_side()
    node.close()
    with pytest.raises(TypeError, match="figures must be a ReadFigures"):
        _stage(readers, figures={"batch_seconds": 1})


def test_a_loader_hands_each_epochs_read_stage_the_same_figures(readers: Readers) -> None:
    from guideloom_pipes import StatefulDataLoader

    loader = StatefulDataLoader(readers.dataset, local_batch_size=BATCH, prefetch=2)
    stages = []
    with loader:
        for _ in range(2):
            iterator = iter(loader)
            node = iterator._root
            while not isinstance(node, ReadSamples):
                node = node.source
            stages.append(node)
            assert sum(1 for _ in iterator) == WINDOWS // BATCH
    assert stages[0] is not stages[1]
    assert stages[0].schedule.figures is stages[1].schedule.figures is loader._read_figures
    assert loader._read_figures.known()


def user_collate(samples: list[Any]) -> list[Any]:
    return samples


def test_a_user_collate_stays_on_workers_that_a_worker_init_fn_set_up(
    readers: Readers, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    inline = []
    monkeypatch.setattr(
        Delivery, "_next_inline", lambda self: inline.append(1) or pytest.fail("inline")
    )
    node = _stage(readers, user_collate, base_seed=5, worker_init_fn=lambda index: None)
    node.reset()
    next(node)
    _taught_quick(node)
    assert not node.schedule.reads_inline()
    rest = list(node)
    node.close()
    assert len(rest) == WINDOWS // BATCH - 1 and not inline


def test_a_user_collate_on_told_workers_is_read_by_the_calling_thread_as_a_worker(
    readers: Readers, clock: FakeClock
) -> None:
    asked: list[tuple[str, Any]] = []

    def asking_collate(samples: list[Any]) -> list[Any]:
        info = get_worker_info()
        asked.append((threading.current_thread().name, info and (info.id, info.seed)))
        return samples

    expected = _reference(readers, user_collate)
    node = _stage(readers, asking_collate, base_seed=5)
    node.reset()
    got = [next(node)]
    _taught_quick(node)
    got += list(node)
    node.close()
    assert list(map(_tokens, got)) == list(map(_tokens, expected))
    main = threading.current_thread().name
    here = [info for name, info in asked if name == main]
    assert len(here) > len(asked) // 2  # most batches read by the calling thread ...
    # ... each collated as worker delivered % 2 would be, with that worker's seed
    assert all(info in ((0, 5), (1, 6)) for _, info in asked)
    assert {info for info in here} == {(0, 5), (1, 6)}
    assert get_worker_info() is None  # and not outside the batches


class UserTokens(StreamNumpyFormat):
    """A user's format: its ``unpack`` runs inside our reader's reads."""


def test_any_format_or_collate_is_read_as_a_worker_reads_it_where_workers_are_told(
    tmp_path: Path, clock: FakeClock
) -> None:
    # Whose code a batch runs (ours, a user's format, the benchmark's collate) does not
    # matter: where the workers are told who they are, the calling thread reads, and runs
    # a job no worker has started, standing in for a worker.
    from guideloom_pipes.bench.data import collate_tokens

    def stage(format: Any, collate_fn: Any) -> ReadSamples:
        storage = StreamStorage(tmp_path / type(format).__name__, format)
        if not storage.dir.exists():
            with storage.sync_writer() as writer:
                writer.append(0, {"tokens": np.arange(WINDOWS * LENGTH)})
        return ReadSamples(
            _ids(),
            StreamDataset(storage, LENGTH),
            num_workers=2,
            collate_fn=collate_fn,
            base_seed=5,
        )

    ours = stage(StreamNumpyFormat(TOKENS), default_collate)
    users = stage(UserTokens(TOKENS), default_collate)
    bench = stage(StreamNumpyFormat(TOKENS), collate_tokens)
    for node in (ours, users, bench):
        node.reset()
    try:
        for node in (ours, users, bench):
            assert [info.id for info in node._delivery._stand_in] == [0, 1]  # type: ignore[union-attr]
        assert all(node._delivery._may_inline for node in (ours, users, bench))
        # the calling thread runs a job no worker has started as a worker too
        for node in (ours, users, bench):
            assert node._workers.pool._caller_as is not None  # type: ignore[union-attr]
        assert all(n._workers.pool._caller_runs for n in (ours, users, bench))  # type: ignore[union-attr]
        torch = pytest.importorskip("torch")
        for node in (ours, users, bench):
            with node._workers.pool._caller_as(1):  # type: ignore[union-attr,misc]
                info = get_worker_info()
                assert info is not None
                assert (info.id, info.num_workers, info.seed) == (1, 2, 6)
                assert torch.utils.data.get_worker_info() is None  # torch's: one per process
            assert get_worker_info() is None
    finally:
        for node in (ours, users, bench):
            node.close()
    # with a worker_init_fn (it may set up the worker threads), never
    initialised = stage(UserTokens(TOKENS), default_collate)
    initialised.worker_init_fn = lambda index: None
    initialised.reset()
    try:
        assert not initialised._workers.pool._caller_runs  # type: ignore[union-attr]
        assert not initialised._delivery._may_inline and initialised._delivery._stand_in is None
    finally:
        initialised.close()


def test_a_user_collate_is_read_inline_where_workers_are_not_told_who_they_are(
    readers: Readers, clock: FakeClock
) -> None:
    # (the prefetch thread of num_workers=0: get_worker_info() is None in it too)
    threads: list[str] = []

    def noting_collate(samples: list[Any]) -> list[Any]:
        threads.append(threading.current_thread().name)
        return samples

    expected = _reference(readers, user_collate)
    node = _stage(readers, noting_collate)
    node.reset()
    got = [next(node)]
    _taught_quick(node)
    got += list(node)
    node.close()
    assert list(map(_tokens, got)) == list(map(_tokens, expected))
    main = threading.current_thread().name
    assert threads[-300:] == [main] * 300
    # read a chunk at a time (the fake clock's 0.45 ms batches: chunks of 2 ms of them)
    assert {ids for name, ids in readers.reads[-50:-1]} == {4 * BATCH}  # (-1: the epoch's end)


@pytest.mark.parametrize("change", ["the caller slows", "the reads wait"])
def test_a_caller_that_slows_or_reads_that_wait_go_back_to_the_workers(
    readers: Readers, clock: FakeClock, change: str
) -> None:
    expected = _reference(readers)
    node = _stage(readers)
    got = _drained_quick(node)
    for _ in range(20):
        got.append(next(node))
    assert node.schedule.reads_inline() and not node._delivery._pending
    turned = len(got)
    if change == "the reads wait":
        clock.waiting = True  # reads that take no CPU time: they wait on I/O
    # told at the timed batches (one in _INLINE_SAMPLE): a slow caller at the third in a row
    # (one late call is not enough, see the test below); waiting, after a few of them
    for _ in range(8 * INLINE_SAMPLE):
        if change == "the caller slows":
            clock.advance(1.0)  # a training step of its own before it asks for a batch
        got.append(next(node))
        if not node.schedule.reads_inline():
            break
    assert not node.schedule.reads_inline()
    assert change == "the reads wait" or len(got) - turned <= 3 * INLINE_SAMPLE
    got.append(next(node))  # through the workers again
    assert node._workers.jobs > 0 or node._workers.job is not None
    got += list(node)
    node.close()
    assert list(map(_tokens, got)) == list(map(_tokens, expected))


@COLLATES
def test_a_failed_inline_batch_counts_as_delivered_and_the_next_follows(
    readers: Readers, clock: FakeClock, collate: Any
) -> None:
    expected = _reference(readers, collate)
    node = _stage(readers, collate)
    got = _drained_quick(node)
    failing = len(got) + 3
    readers.fail_on = _first_id(expected[failing])
    while True:
        try:
            got.append(next(node))
        except ValueError as error:
            assert "cannot be read" in str(error)
            break
    assert len(got) == failing
    readers.fail_on = None
    got.append(next(node))
    assert _tokens(got[-1]) == _tokens(expected[failing + 1])


@COLLATES
def test_ctrl_c_inside_an_inline_batch_delivers_nothing_and_a_resume_reads_it(
    readers: Readers, clock: FakeClock, collate: Any
) -> None:
    expected = _reference(readers, collate)
    node = _stage(readers, collate)
    got = _drained_quick(node)
    state = node.state_dict()
    readers.interrupt_on = _first_id(expected[len(got)])
    with pytest.raises(KeyboardInterrupt):
        next(node)
    assert node.state_dict() == state
    readers.interrupt_on = None
    node.close()

    resumed = _stage(readers, collate)
    resumed.reset(state)
    got += list(resumed)
    resumed.close()
    assert list(map(_tokens, got)) == list(map(_tokens, expected))


@COLLATES
def test_a_state_taken_between_inline_batches_resumes_there(
    readers: Readers, clock: FakeClock, collate: Any
) -> None:
    expected = _reference(readers, collate)
    node = _stage(readers, collate)
    node.reset()
    got = [next(node)]
    _taught_quick(node)
    while len(got) < 300:
        got.append(next(node))
    assert node.schedule.reads_inline() and not node._delivery._pending
    if collate is not default_collate:
        while not node._delivery._ready:  # a state between two batches of one chunk
            got.append(next(node))
    state = node.state_dict()
    node.reset()  # no state: the epoch restarts where the delivered batches leave it
    again = next(node)
    node.close()
    resumed = _stage(readers, collate)
    resumed.reset(state)
    rest = list(resumed)
    resumed.close()
    assert list(map(_tokens, got + rest)) == list(map(_tokens, expected))
    assert _tokens(again) == _tokens(expected[0])  # a partly read epoch restarts (SPEC)


def test_a_chunk_read_inline_is_delivered_whole_when_untimed_calls_follow(
    readers: Readers, clock: FakeClock
) -> None:
    # Batches that were slow (one per read, timed: the next _INLINE_SAMPLE - 1 calls read
    # without a clock) and then turn quick (a chunk per read): the chunk's batches are
    # delivered before another chunk is read, and none is left behind at the epoch's end.
    expected = _reference(readers, user_collate)
    node = _stage(readers, user_collate)
    clock.read = 3e-3  # more than chunk_seconds (2 ms): one batch per read
    node.reset()
    got = [next(node)]
    node.schedule.adopt(ReadFigures(clock.read, 1.0, 0.0))
    while node._delivery._pending or node._workers.job is not None:  # the jobs already submitted
        got.append(next(node))
    got.append(next(node))  # read by this thread, timed: the next calls are not
    assert node._delivery._inline_left == INLINE_SAMPLE - 1
    clock.read = 0.45e-3  # quick from now on: chunks of 4 batches
    _teach_batch_seconds(node, clock.read)
    most_waiting = 0
    while True:
        try:
            got.append(next(node))
        except StopIteration:
            break
        most_waiting = max(most_waiting, len(node._delivery._ready))
    node.close()
    assert 0 < most_waiting < 4  # at most the rest of one chunk waits
    assert list(map(_tokens, got)) == list(map(_tokens, expected))


class _CountingMeta:
    """A stream-with-metadata format (a payload per 3 elements) that counts its unpacks."""

    stream_dtype = np.dtype("<i4")

    def __init__(self) -> None:
        self.unpacked = 0

    def size(self, data: np.ndarray) -> int:
        return len(data)

    def pack(self, data: np.ndarray) -> Any:
        for position in range(len(data)):
            yield position // 3, (b"%d" % (position // 3) if position % 3 == 0 else None)
        return np.asarray(data, dtype=self.stream_dtype)

    def unpack(self, stream: Any, shards: Any, index: Any, data: Any) -> dict[str, Any]:
        self.unpacked += 1
        return {"tokens": np.array(stream), "payloads": data}


class _MetaReaders:
    """A stream with metadata of WINDOWS windows (a payload per 3 elements), its dataset and
    an open reader whose reads advance the fake clock."""

    def __init__(self, root: Path, clock: FakeClock) -> None:
        self.format = _CountingMeta()
        storage = StreamWithMetaStorage(root, self.format)
        with storage.sync_writer() as writer:
            writer.append(0, np.arange(WINDOWS * LENGTH, dtype="<i4"))
        self.dataset = StreamDataset(storage, LENGTH)
        self.reader, _ = open_reader(self.dataset)
        read_rows = self.reader.read_rows

        def timed_rows(ids: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                clock.reading(len(ids) // BATCH)
            return read_rows(ids)

        self.reader.read_rows = timed_rows

    def stage(self, collate_fn: Any = user_collate, workers: int = 2) -> ReadSamples:
        return ReadSamples(
            _ids(), self.dataset, num_workers=workers, reader=self.reader, collate_fn=collate_fn
        )

    def reference(self) -> list[Any]:
        node = self.stage(workers=0)
        node.reset()
        out = list(node)
        node.close()
        return out


@pytest.fixture
def meta(tmp_path: Path, clock: FakeClock) -> Any:
    made = _MetaReaders(tmp_path / "meta", clock)
    yield made
    made.reader.close()


def _same_meta_batches(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert [s["tokens"].tolist() for s in mine] == [s["tokens"].tolist() for s in theirs]
        assert [[bytes(p) for p in s["payloads"]] for s in mine] == [
            [bytes(p) for p in s["payloads"]] for s in theirs
        ]
        assert all(type(p) is memoryview for s in mine for p in s["payloads"])


def test_a_chunk_of_payload_windows_read_inline_makes_each_batch_when_delivered(
    meta: _MetaReaders, clock: FakeClock
) -> None:
    # Windows of a stream with metadata read a chunk at a time by the calling thread: the
    # chunk's read is done at once, but each batch's samples (their payload memoryviews,
    # unpack) are made only when the batch is delivered, so the batches waiting hold no
    # sample of their own; delivered, they are the samples a plain read gives.
    expected = meta.reference()
    node = meta.stage()
    got = _drained_quick(node)
    meta.format.unpacked = 0
    got.append(next(node))  # reads a chunk of 4 batches, delivers the first
    assert len(node._delivery._ready) == 3
    assert meta.format.unpacked == BATCH  # only the delivered batch's windows are decoded
    got.append(next(node))
    assert meta.format.unpacked == 2 * BATCH
    got += list(node)
    node.close()
    _same_meta_batches(got, expected)


def test_ctrl_c_in_the_collate_of_a_batch_made_at_delivery_delivers_nothing(
    meta: _MetaReaders, clock: FakeClock
) -> None:
    interrupt_on: list[int] = []

    def collate(samples: list[Any]) -> list[Any]:
        if int(samples[0]["tokens"][0]) in interrupt_on:
            raise KeyboardInterrupt
        return samples

    expected = meta.reference()
    node = meta.stage(collate)
    got = _drained_quick(node)
    got.append(next(node))  # a chunk read: the rest of it waits, made at delivery
    assert len(node._delivery._ready) == 3
    state = node.state_dict()
    interrupt_on.append(int(expected[len(got)][0]["tokens"][0]))
    with pytest.raises(KeyboardInterrupt):
        next(node)
    assert node.state_dict() == state and len(node._delivery._ready) == 3
    interrupt_on.clear()
    got.append(next(node))  # the same batch, now made
    node.close()
    resumed = meta.stage(collate)
    resumed.reset(state)
    rest = list(resumed)
    resumed.close()
    _same_meta_batches(got + rest[1:], expected)
    _same_meta_batches(rest[:1], got[-1:])


def test_a_batch_made_at_delivery_that_fails_counts_as_delivered_and_the_next_follows(
    meta: _MetaReaders, clock: FakeClock
) -> None:
    fail_on: list[int] = []

    def collate(samples: list[Any]) -> list[Any]:
        if int(samples[0]["tokens"][0]) in fail_on:
            raise ValueError("this batch cannot be collated")
        return samples

    expected = meta.reference()
    node = meta.stage(collate)
    got = _drained_quick(node)
    got.append(next(node))
    assert len(node._delivery._ready) == 3
    failing = len(got)
    fail_on.append(int(expected[failing][0]["tokens"][0]))
    with pytest.raises(ValueError, match="cannot be collated"):
        next(node)
    assert len(node._delivery._ready) == 2
    got += list(node)
    node.close()
    _same_meta_batches(got, expected[:failing] + expected[failing + 1 :])


def test_batches_read_one_by_one_skip_the_policy_between_timed_calls(
    readers: Readers, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Batches of columns that the calling thread reads one at a time: after a timed call
    # decided so, the next _INLINE_SAMPLE - 2 go straight to the read (next() -> _read_next),
    # not through _next_here's checks; the batches and the states are the same.
    expected = _reference(readers)
    node = _stage(readers)
    got = _drained_quick(node)
    policy: list[int] = []
    here = Delivery._next_here

    def counted(self: Delivery) -> Any:
        policy.append(self._delivered)
        return here(self)

    monkeypatch.setattr(Delivery, "_next_here", counted)
    states = []
    while True:
        try:
            got.append(next(node))
        except StopIteration:
            break
        states.append(node.get_state())
    node.close()
    assert list(map(_tokens, got)) == list(map(_tokens, expected))
    reference = ReadSamples(_ids(), readers.dataset, reader=readers.reader)
    reference.reset()
    for _ in range(len(got) - len(states)):
        next(reference)
    for state in states:
        next(reference)
        assert state == reference.get_state()
    reference.close()
    taken = len(states) + 1  # (the end, too)
    # per _INLINE_SAMPLE batches: the timed one and the last untimed one decide again
    assert len(policy) <= 2 * (taken // INLINE_SAMPLE + 1) + 1, len(policy)


class _IdsFailingAt(BaseNode[Any]):
    """The ids of :func:`_ids`, and a ``ValueError`` in place of batch ``at``."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.source = _ids()
        self.at = at
        self.taken = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state["source"])
        self.taken = 0 if initial_state is None else initial_state["taken"]

    def next(self) -> Any:
        if self.taken == self.at:
            self.taken += 1
            raise ValueError(f"the ids of batch {self.at} cannot be made")
        self.taken += 1
        return next(self.source)

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "taken": self.taken}


def test_a_source_error_while_the_calling_thread_reads_follows_the_batches_before_it(
    readers: Readers, clock: FakeClock
) -> None:
    expected = _reference(readers)
    at = 300  # past the jobs submitted before the figures were known (at most 2 x 64)
    node = ReadSamples(
        _IdsFailingAt(at),
        readers.dataset,
        num_workers=2,
        reader=readers.reader,
        collate_fn=default_collate,
    )
    got = _drained_quick(node)
    with pytest.raises(ValueError, match=f"batch {at} cannot be made"):
        while True:
            got.append(next(node))
    assert readers.threads[-100:] == [threading.current_thread().name] * 100
    assert list(map(_tokens, got)) == list(map(_tokens, expected[:at]))
    with pytest.raises(StopIteration):
        next(node)
    node.close()


@pytest.mark.parametrize("late", [1e-3, 10.0])
def test_one_late_call_keeps_the_calling_thread_reading(
    readers: Readers, clock: FakeClock, late: float
) -> None:
    # A caller the machine paused once (or that was away once: another loader's turn, an
    # evaluation) is waiting for the batches again right after: they are not handed to the
    # workers (whose chunks it would wait for), however long the pause.
    expected = _reference(readers)
    node = _stage(readers)
    got = _drained_quick(node)
    for _ in range(2 * INLINE_SAMPLE):
        got.append(next(node))
    while node._delivery._inline_left:  # (calls between timed ones measure nothing)
        got.append(next(node))
    clock.advance(late)
    got.append(next(node))  # timed: it measures the caller's time since the last call
    assert (
        node.schedule.learned().gap > 0
        and node.schedule.reads_inline()
        and not node._delivery._pending
        and node._workers.jobs == 0
    )
    got += list(node)
    node.close()
    assert list(map(_tokens, got)) == list(map(_tokens, expected))
    assert readers.threads[-300:] == [threading.current_thread().name] * 300


def test_a_caller_back_within_the_gap_floor_keeps_reading_quicker_batches(
    readers: Readers, clock: FakeClock
) -> None:
    # Batches quicker than twice the caller's time between them (10 us each, a caller's
    # loop of 8 us): a worker thread's handoff would cost more than the gap holds.
    node = _stage(readers)
    got = _drained_quick(node)
    clock.read = 10e-6
    _teach_batch_seconds(node, clock.read)
    for _ in range(8 * INLINE_SAMPLE):
        clock.advance(8e-6)
        got.append(next(node))
        assert node.schedule.reads_inline() and node._workers.jobs == 0
    learned = node.schedule.learned()
    assert learned.gap > schedule_module.GAP_SHARE * learned.batch_seconds
    node.close()
