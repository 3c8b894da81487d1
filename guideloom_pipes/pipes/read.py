"""Sample reading: batches of sample ids -> lists of samples (or collated batches), in order."""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.context
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch.utils.data._utils.worker as _torch_worker
from torchdata.nodes import BaseNode

from guideloom_pipes.checks import check_int
from guideloom_pipes.datasets import WindowBuffers, open_reader, reader_code
from guideloom_pipes.pipes.collate import collated_read_fn
from guideloom_pipes.pipes.errors import DataLoaderTimeoutError, mark_batch_failure
from guideloom_pipes.pipes.positions import Positions
from guideloom_pipes.pipes.shuffle import Shuffle, state_marks
from guideloom_pipes.pipes.worker_info import _thread_info, thread_worker_info
from guideloom_pipes.pipes.workers.processes import ProcessPool
from guideloom_pipes.pipes.workers.tasks import (
    Deferred,
    Failed,
    ReadTask,
    RemoteTraceback,
    keep_batch_arrays,
    read_fn_for,
    read_many_fn_for,
)
from guideloom_pipes.pipes.workers.threads import ThreadPool, after_orphaned_jobs, seconds_text

__all__ = ["ReadSamples"]

_I64 = npt.NDArray[np.int64]
_METHODS = ("thread", "process")
#: A job that spends less than this share of its time on the CPU (running alone) waits on
#: I/O: such jobs run side by side even when quick. Measured here: 0.10-0.19 for reads
#: that wait, 0.8-1.0 for memory-mapped tokens and documents.
_WAITING = 0.35
_START_METHODS = ("spawn", "forkserver", "fork")
#: A worker's time per job of quick batches to aim for (``chunk_seconds``' default).
CHUNK_SECONDS = 0.002
#: The calling thread reads the batches itself while it comes back for the next one within
#: this share of a batch's read time: it is waiting for the data, and a worker thread reading
#: ahead under the same GIL only adds a handoff (and colder memory) to every batch (8 windows
#: of 2048 tokens: 16 us of CPU read by the calling thread, 24 us through a worker thread).
_GAP_SHARE = 0.5
#: ... and always while it comes back within this many seconds, however quick the batches:
#: a handoff to a worker thread costs more CPU than such a gap holds, and the workers'
#: chunks (up to 128 batches in flight) made a caller whose loop took 10 us between 18 us
#: batches wait for them.
_GAP_FLOOR = 50e-6
#: One late call counts as at most this many times the gap that keeps the calling thread
#: reading (:meth:`ReadSamples._gap_bound`): a caller that the machine paused once, or that
#: was away once (another loader's turn, an evaluation), keeps reading; one that is late
#: at two or three timed calls in a row is handed the workers' batches.
_GAP_OUTLIER = 2.0
#: One in this many batches read one at a time by the calling thread is timed (its time and
#: CPU share, the caller's time before it) and decides whether the calling thread goes on.
_INLINE_SAMPLE = 16
#: Batches of columns that one read packs together (``read_arrays_many``: packed windows)
#: are read by the calling thread this many at a time at most: the chunk's arrays, written
#: together and held until delivered, stay in the caches.
_COLUMN_CHUNK = 8


def _ours(obj: Any) -> bool:
    """Whether ``obj`` (a reader, a format, a function) is defined by this library. The
    benchmark's datasets, formats and collates play a user's: they are not."""
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        return False
    top, _, rest = module.partition(".")
    return top == "guideloom_pipes" and rest.partition(".")[0] != "bench"


def _to_ids(item: Any) -> _I64:
    """Sample ids of one batch: an int64 array, :class:`Positions` (unshuffled) or ints."""
    if type(item) is np.ndarray and item.dtype == np.int64:
        return item
    if isinstance(item, Positions):
        return item.positions
    return np.asarray(item, dtype=np.int64).reshape(-1)


def _failed_error(failed: Failed) -> BaseException:
    """A failed batch's error, marked as its batch's own, to raise. The caller drops its
    references to it and to ``failed`` as it raises it (``try: raise error finally: del
    error``): a frame of the stage that still held it would make a cycle (error ->
    traceback -> that frame -> error) that keeps the stage, its iterator and its worker
    threads alive until the garbage collector runs, after a loop that stopped at it."""
    error = failed.error
    if failed.remote is not None:
        error.__cause__ = RemoteTraceback(failed.remote)
    mark_batch_failure(error)
    return error


def together_text(batches: int) -> str:
    """What a timeout message says of a job of several batches."""
    if batches <= 1:
        return ""
    return (
        f" (read in one job with the next {batches - 1} batch" + "es" * (batches > 2) + ": the "
        "one that hangs may be any of them)"
    )


def _default_start_method() -> str:
    """``forkserver`` where the platform has it (workers start in milliseconds), else spawn."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def start_context(value: Any) -> multiprocessing.context.BaseContext:
    if value is None:
        return multiprocessing.get_context(_default_start_method())
    if isinstance(value, str):
        if value not in _START_METHODS:
            raise ValueError(
                f"multiprocessing_context must be one of {_START_METHODS} or a context "
                f"object, got {value!r}"
            )
        return multiprocessing.get_context(value)
    if isinstance(value, multiprocessing.context.BaseContext):
        return value
    raise TypeError(
        f"multiprocessing_context must be a start method name {_START_METHODS} or a "
        f"multiprocessing context, got {value!r}"
    )


class ReadFigures:
    """What a read stage has learned of its batches and of its caller: a batch's read time
    and the share of it spent on the CPU, and the caller's time between batches (moving
    averages; see :class:`ReadSamples`). A loader hands one such object to the read stage
    of each of its epochs, so that a new epoch starts from what the last one learned instead
    of learning again (its first job timed alone, the first chunks read ahead on workers)."""

    __slots__ = ("batch_seconds", "cpu_share", "gap")

    def __init__(self) -> None:
        self.batch_seconds = 0.0  # 0: unknown
        self.cpu_share = -1.0  # -1: unknown
        self.gap = -1.0  # -1: unknown

    def known(self) -> bool:
        """Whether a job has been timed (its time and CPU share)."""
        return self.batch_seconds > 0 and self.cpu_share >= 0

    def __repr__(self) -> str:
        return (
            f"ReadFigures(batch_seconds={self.batch_seconds:.3g}, "
            f"cpu_share={self.cpu_share:.2f}, gap={self.gap:.3g})"
        )


class ReadSamples(BaseNode[Any]):
    """Reads the samples of each batch of ids from ``dataset``, optionally collating them.

    Items from ``source`` are int64 id arrays (from :class:`~guideloom_pipes.pipes.Shuffle`),
    :class:`~guideloom_pipes.pipes.Positions` (an unshuffled order: position = id) or
    sequences of ints. Each becomes the list of its samples, read with the reader's
    ``read_batch(ids)`` when it has one (our datasets), else ``__getitems__`` or ``[i]`` per
    id, so any map-style dataset works. With ``collate_fn`` the result is
    ``collate_fn(samples)``, computed in the same worker.

    With ``num_workers > 0`` whole batches are read in parallel, in worker threads (one
    shared reader, whose ``read_batch`` must be thread-safe) or in worker processes (each
    opens its own reader of the pickled ``dataset``), and delivered in order. Workers take
    jobs oldest first; with threads, a job that no worker has started when it is needed (all
    busy) is run by the calling thread itself rather than waited for. Workers start on
    ``reset()`` and stop on :meth:`close` or the next ``reset()``. An exception raised by a
    read or ``collate_fn`` reaches the caller with its type, when the batch that raised it
    is due (and, for threads, its traceback; processes attach the remote traceback as the
    cause); a worker process that dies raises ``BrokenProcessPool``. Such an error fails its
    batch alone: the batch counts as delivered, and the next ``next()`` delivers the batch
    after it (as torch's ``DataLoader`` does).

    A job is a *chunk* of consecutive batches, sized to about ``chunk_seconds`` of a
    worker's time (measured as it goes): slow batches (storage latency, heavy decoding) go
    one per job, at most ``max_in_flight`` ahead, so ``N`` workers keep ``N`` in flight;
    quick ones go up to ``max_chunk`` per job, read with one call of the reader (each batch
    collated on its own), so a handoff between threads, which costs tens of microseconds
    of CPU, is paid per chunk instead of per batch.

    While the caller waits for the batches (it comes back for the next one within half a
    batch's read time) and they compute rather than wait on I/O, the calling thread reads
    them itself: thread workers run computing jobs one at a time anyway, and a thread reading
    ahead under the same GIL only adds a handoff and colder memory to each batch. It reads
    them as a worker would: batches of columns one at a time, others a chunk at a time with
    one read (a mixture's routing, for one, costs the same for 8 ids as for 500). A caller
    with work of its own between batches (a training step) keeps the workers reading ahead.
    Only where user code cannot tell: the batches run only this library's code (one of our
    datasets, no ``collate_fn`` or one of ours), or the workers are not told who they are
    (no ``base_seed``, no ``worker_init_fn``: :func:`~guideloom_pipes.get_worker_info` is
    ``None`` in both threads). The figures are kept current as batches go, so batches that start to
    wait, or a caller that slows down, go back to the workers.

    Thread workers run jobs that compute one at a time: threads running them side by side
    only take the GIL from each other. Jobs run side by side on all workers once they are
    known to wait (on I/O): a job running alone that spends under a third of its time on
    the CPU tells, and so does the first job after ``reset()`` if it is still running after
    ``chunk_seconds`` with little CPU time used. Quick chunks that compute are kept two in
    flight (one being delivered, one being read); chunks that wait, and process workers'
    chunks, one per worker plus the one being delivered. More are in flight when
    ``max_in_flight`` asks for more batches ahead.

    Process workers hand results back through shared memory: a CPU tensor or numpy
    array travels as one copy into the worker's result ring and is delivered as that memory
    (freed for the worker when the batch is gone), not as a pickle through a pipe (see
    :mod:`guideloom_pipes.pipes.workers.transport`). The default start method
    is ``forkserver`` (``spawn`` where there is none), and the fork server preloads the
    modules of ``dataset`` and ``collate_fn``, so workers start in milliseconds per
    iterator after the first.

    The state is that of ``source`` as of the last batch delivered: batches read ahead do
    not count.

    Args:
        source: Emits batches of sample ids.
        dataset: A map-style dataset (``len`` and ``[i]``; or ours, with ``sync_reader()``).
        num_workers: Worker threads or processes; 0 reads in the calling thread.
        method: ``"thread"`` or ``"process"``.
        multiprocessing_context: Start method (``"forkserver"`` default where available,
            else ``"spawn"``; or ``"fork"``) or a context object, for ``method="process"``.
        collate_fn: Applied to each batch's samples in the worker; ``None`` returns them.
        max_in_flight: Batches submitted to workers ahead of the caller (``2 *
            num_workers`` by default); chunks of quick batches may exceed it (see above).
        timeout: Seconds to wait for a worker's batch before raising
            :class:`~guideloom_pipes.pipes.DataLoaderTimeoutError` (a ``RuntimeError`` and a
            ``TimeoutError``); ``None`` waits forever. With a timeout the calling thread
            never reads a batch itself (it could not be interrupted), it only waits. With
            process workers the first batch's wait includes starting them.
        reader: An already open reader of ``dataset`` to use in this process (not closed by
            this stage); by default the stage opens one on first use and closes it in
            :meth:`close`.
        chunk_seconds: A worker's time per job to aim for when batches are quick; 0 sends
            one batch per job.
        max_chunk: The most batches in one job.
        batch_seeds: ``k -> seed`` of the ``k``-th batch taken from ``source`` since the last
            reset: each batch is then read and collated under its seed (worker processes
            seed the global generators of ``random``, numpy and torch; reading inline seeds
            them and puts the caller's states back; worker threads, which share them, leave
            them alone), and ``batch_rng()`` gives the batch's own generators in every mode.
        base_seed: Seed of the workers (``base_seed + worker_id``) as
            :func:`~guideloom_pipes.get_worker_info` reports it in worker threads and
            processes (torch's ``get_worker_info()`` in worker processes); without it
            (and without ``worker_init_fn``) workers are not told who they are.
        worker_init_fn: Called with the worker's id once in each worker thread, and in each
            worker process whenever it takes a copy of the dataset, before it reads.
        process_pool: Worker processes that outlive this stage (a loader's, shared by its
            epochs): used instead of starting new ones for ``method="process"``, and on
            close or reset only released, not stopped (a failure of the pool stops it).
        arrays: With ``collate_fn=None``: deliver each batch as the reader's
            :class:`~guideloom_pipes.batch.Batch` of arrays where it makes one (windows of
            the built-in formats), for a collate further on that takes it; else the list.
            A ``collate_fn`` gets a ``Batch`` when it takes one (``accepts_batch_arrays``,
            as our collates do), whatever this says; any other gets the list of samples.
        buffers: ``(shape, dtype) -> empty array``: where a read of arrays puts each batch's
            windows (:meth:`StreamDatasetReader.read_arrays`'s ``out``), e.g. the pinned
            buffers of a :class:`~guideloom_pipes.pipes.PinnedRing`. Reading in this process
            only (inline or thread workers): a worker process cannot fill them.
        figures: Where this stage keeps what it learns of its batches and its caller, and
            starts from at a reset (see :class:`ReadFigures`): a loader passes one to each
            epoch's stage. None: each reset learns again.
    """

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode[Any],
        dataset: Any,
        *,
        num_workers: int = 0,
        method: Literal["thread", "process"] = "thread",
        multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
        collate_fn: Callable[[Any], Any] | None = None,
        max_in_flight: int | None = None,
        timeout: float | None = None,
        reader: Any = None,
        chunk_seconds: float = CHUNK_SECONDS,
        max_chunk: int = 64,
        batch_seeds: Callable[[int], int] | None = None,
        base_seed: int | None = None,
        worker_init_fn: Callable[[int], Any] | None = None,
        process_pool: ProcessPool | None = None,
        arrays: bool = False,
        buffers: WindowBuffers | None = None,
        figures: ReadFigures | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        # the next batch's ids: our Shuffle's own next() gives them as an int64 array (it is
        # reset with this stage, so BaseNode.__next__'s check is not needed, nor _to_ids)
        self._next_ids: Callable[[], _I64] = (
            source.next if type(source) is Shuffle else lambda: _to_ids(next(source))
        )
        self.dataset = dataset
        self.num_workers = check_int("num_workers", num_workers, minimum=0)
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
        self.method = method
        if buffers is not None and not callable(buffers):
            raise TypeError(f"buffers must be callable or None, got {buffers!r}")
        if buffers is not None and method == "process" and self.num_workers:
            raise ValueError(
                "buffers= fill memory of this process: they apply to reading inline or on "
                "worker threads, not to method='process' (drop buffers= or use threads)"
            )
        self.buffers = buffers
        if figures is not None and not isinstance(figures, ReadFigures):
            raise TypeError(f"figures must be a ReadFigures or None, got {figures!r}")
        self._figures = figures
        self._mp = start_context(multiprocessing_context) if method == "process" else None
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        self.collate_fn = collate_fn
        self.arrays = bool(arrays)
        # What the workers run: with arrays and no collate_fn, a pass-through that takes them.
        self._worker_collate = keep_batch_arrays if arrays and collate_fn is None else collate_fn
        in_flight = check_int("max_in_flight", max_in_flight, minimum=1, allow_none=True)
        self.max_in_flight = 2 * self.num_workers if in_flight is None else in_flight
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self.timeout = timeout
        if isinstance(chunk_seconds, bool) or not isinstance(chunk_seconds, (int, float)):
            raise TypeError(f"chunk_seconds must be a number, got {chunk_seconds!r}")
        if not chunk_seconds >= 0:
            raise ValueError(f"chunk_seconds must be >= 0, got {chunk_seconds!r}")
        self.chunk_seconds = float(chunk_seconds)
        self.max_chunk = check_int("max_chunk", max_chunk, minimum=1)
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise TypeError(f"worker_init_fn must be callable or None, got {worker_init_fn!r}")
        self.batch_seeds = batch_seeds
        self.base_seed = base_seed
        self.worker_init_fn = worker_init_fn
        self._process_pool = process_pool
        self._taken = 0  # batches taken from the source since reset (see batch_seeds)
        self._reader = reader
        self._owns_reader = False
        self._task: ReadTask | None = None
        self._pool: ThreadPool | ProcessPool | None = None
        # One entry per batch submitted and not yet delivered, oldest first:
        # (job, index in the job, last of its job, source state after the batch).
        self._pending: collections.deque[tuple[Any, int, bool, Any]] = collections.deque()
        self._jobs = 0  # jobs with batches in _pending
        self._job: Any = None  # the job whose outcomes are being delivered
        self._outcomes: list[Any] = []
        self._batch_seconds = 0.0  # a worker's time per batch (moving average; 0: unknown)
        self._cpu_share = -1.0  # a lone job's share of its time on the CPU (-1: unknown)
        self._probing = False  # the first job runs alone (threads), see _side_by_side
        self._may_inline = False  # batches may be read by the calling thread (_quick_to_inline)
        # the WorkerInfo of each worker thread, when the calling thread stands in for them
        self._stand_in: list[Any] | None = None
        self._gap = -1.0  # the caller's time between next() calls (moving average; -1: unknown)
        self._inline_left = 0  # calls the calling thread reads without a clock (_next_inline)
        self._solo = False  # ... each batch by itself (no chunk): next() goes to _read_next
        # batches the calling thread read as a chunk, not delivered yet: (result, source
        # state after it), oldest first
        self._ready: collections.deque[tuple[Any, Any]] = collections.deque()
        self._returned = 0.0  # when next() last returned (0: not since reset)
        self._delivered = 0  # batches delivered since reset
        # the source's state after the last delivered batch, and before it (None: none
        # delivered since reset); each a state or, where the source gives marks (ours, see
        # state_marks), a mark of one (_state() makes the state)
        self._snapshot: Any = None
        self._previous: Any = None
        self._mark: Callable[[], Any] = self.source.state_dict
        self._state_at: Callable[[Any], Any] | None = None
        self._drained = False  # the source's end was delivered
        self._read_ahead = False  # workers may have read the source ahead of the caller
        self._end_snapshot: Any = None
        self._source_done = False
        self._source_error: BaseException | None = None

    # -- reader ---------------------------------------------------------------------------

    def open(self) -> None:
        """Open this process's reader of the dataset now (otherwise the first reset does)."""
        if self._reader is None:
            self._reader, self._owns_reader = open_reader(self.dataset)
        if self._task is None:
            collate = self._worker_collate
            reader = self._reader
            self._task = ReadTask(
                read_fn_for(reader, collate, out=self.buffers),
                collate,
                read_many=read_many_fn_for(reader, collate, out=self.buffers),
                read_collated=collated_read_fn(reader, collate, out=self.buffers),
                read_is_ours=callable(getattr(reader, "read_batch", None)),
                seeding="globals" if self.num_workers == 0 else "local",
            )

    def close(self) -> None:
        """Stop the workers and close the reader this stage opened (it can be reset again).

        It does not wait for batches being read: worker processes are terminated, and a
        worker thread finishes its batch in the background (the result is dropped) and
        exits; the reader closes once no such batch is left.
        """
        self._stop_workers()
        if self._owns_reader and self._reader is not None:
            reader, self._reader, self._task = self._reader, None, None
            self._owns_reader = False
            after_orphaned_jobs(reader.close)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._stop_workers()

    # -- BaseNode -------------------------------------------------------------------------

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._stop_workers()
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
        elif self._read_ahead:
            self._reset_source_as_delivered()
        else:
            self.source.reset()
        self._read_ahead = False
        self._delivered = 0
        self._taken = 0
        if self.num_workers == 0 or self.method == "thread":
            self.open()
        if self.num_workers == 0:
            return
        marks = state_marks(self.source)
        if marks is None:
            self._mark, self._state_at = self.source.state_dict, None
        else:
            self._mark, self._state_at = marks
        self._snapshot = self.source.state_dict()
        self._previous = None
        self._drained = False
        self._read_ahead = True
        self._end_snapshot = None
        self._source_done = False
        self._source_error = None
        capable = self.method == "thread" and self.chunk_seconds > 0
        figures = self._figures
        learned = capable and figures is not None and figures.known()
        if learned:
            assert figures is not None
            self._batch_seconds, self._cpu_share = figures.batch_seconds, figures.cpu_share
            self._gap = figures.gap
        # the first job runs alone to be timed, unless an earlier epoch timed its jobs
        self._probing = capable and not learned
        # user code may tell who reads it only where workers are told who they are
        told = self.base_seed is not None or self.worker_init_fn is not None
        unseen = not told or self._library_only()
        # where a user's code can ask who runs it (workers told who they are), the calling
        # thread may still read batches, standing in for a worker (get_worker_info()
        # answers as in worker delivered % N), unless a worker_init_fn set the workers up
        stand_in = not unseen and self.worker_init_fn is None and self.method == "thread"
        self._stand_in = (
            [self._worker_info(index) for index in range(self.num_workers)] if stand_in else None
        )
        self._may_inline = capable and self.timeout is None and (unseen or stand_in)
        self._returned = 0.0
        if self.method == "thread":
            assert self._task is not None
            self._pool = ThreadPool(
                self._task.run,
                self.num_workers,
                # the calling thread helps with jobs no worker has started: as a worker
                # (get_worker_info() answers as in it) where a user's code can ask, never
                # where a worker_init_fn may have set up the workers' threads
                caller_runs=self.timeout is None and (unseen or self.worker_init_fn is None),
                init=self._init_thread if told else None,
                caller_as=None if self._stand_in is None else self._as_worker,
                # (only a user's init is seen before a job runs: ours only tells the thread
                # who it is)
                start_now=self.worker_init_fn is not None,
            )
        elif self._process_pool is not None:
            if self._process_pool.closed:
                raise RuntimeError(
                    "the worker processes given to this ReadSamples were stopped: a failed "
                    "pool is not reused (the loader starts new ones at its next iter())"
                )
            self._pool = self._process_pool
            try:
                self._process_pool.begin(self.dataset, self.collate_fn)
            except BaseException:
                self._pool = None
                self._process_pool.close()
                raise
        else:
            assert self._mp is not None
            self._pool = ProcessPool(
                self.dataset,
                self._worker_collate,
                self.num_workers,
                self._mp,
                base_seed=self._worker_base_seed(),
                worker_init_fn=self.worker_init_fn,
            )
        if not self._quick_to_inline():
            self._fill()  # (else the calling thread reads from the first batch on)

    def _worker_base_seed(self) -> int | None:
        if self.base_seed is not None:
            return self.base_seed
        return 0 if self.worker_init_fn is not None else None

    def _worker_info(self, index: int) -> Any:
        """torch's ``WorkerInfo`` of worker thread ``index``."""
        seed = (self._worker_base_seed() or 0) + index
        fields: dict[str, Any] = {"worker_method": "thread"}
        if "worker_method" not in getattr(_torch_worker.WorkerInfo, "__dataclass_fields__", {}):
            fields = {}
        return _torch_worker.WorkerInfo(
            id=index, num_workers=self.num_workers, seed=seed, dataset=self.dataset, **fields
        )

    def _init_thread(self, index: int) -> None:
        """Tell worker thread ``index`` who it is (our ``get_worker_info()``), then run
        ``worker_init_fn``."""
        thread_worker_info(self._worker_info(index))
        if self.worker_init_fn is not None:
            self.worker_init_fn(index)

    @contextlib.contextmanager
    def _as_worker(self, index: int) -> Iterator[None]:
        """The calling thread stands in for worker thread ``index`` (a batch it reads, a
        job no worker has started): ``get_worker_info()`` answers as in it, then as before."""
        assert self._stand_in is not None
        before = getattr(_thread_info, "info", None)
        thread_worker_info(self._stand_in[index])
        try:
            yield
        finally:
            thread_worker_info(before)

    def _reset_source_as_delivered(self) -> None:
        """``source.reset()`` as if the source had given only the batches delivered.

        The workers read ahead, and what a source does on a reset without a state can
        depend on how far it was read (``RankPositions`` restarts an epoch it was partly
        read through, and moves on from one it ran out of). So first put it where the last
        delivered batch left it, by the state from before that batch and one ``next()``.
        """
        source = self.source
        if self._drained:
            # The end was delivered: the source itself ran out (a node following torchdata's
            # contract then starts its next epoch), nothing was read past what was delivered.
            source.reset()
            return
        if self._previous is None:
            source.reset(self._state(self._snapshot))  # nothing delivered
        else:
            source.reset(self._state(self._previous))
            next(source)
        source.reset()

    def next(self) -> Any:
        if self.num_workers == 0:
            task = self._task
            assert task is not None
            ids = self._next_ids()
            try:
                seeds = self.batch_seeds
                if seeds is None:
                    return task._plain(ids)
                self._taken += 1
                return task(ids, seeds(self._taken - 1))
            except Exception as failed:
                mark_batch_failure(failed)  # the source has moved past it: the next batch follows
                raise
        if not self._may_inline:
            return self._next_from_workers()
        infos = self._stand_in
        if infos is None:
            left = self._inline_left
            if left > 1 and self._solo and not self._ready:
                # the calling thread reads batch after batch by itself, as decided at the
                # last timed call: _next_here's way without its checks (1-2 us a batch)
                self._inline_left = left - 1
                return self._read_next()
            return self._next_here()
        # (as _as_worker does, without a context manager's ~1.5 us per batch: this is the
        # path of every quick batch that runs a user's code)
        local = _thread_info
        before = getattr(local, "info", None)
        local.info = infos[self._delivered % len(infos)]
        try:
            return self._next_here()
        finally:
            local.info = before

    def _next_here(self) -> Any:
        """:meth:`next` where the calling thread may read the batch itself."""
        left = self._inline_left
        if left:
            # The calling thread reads, as decided at the last measured call: one call in
            # _INLINE_SAMPLE is timed and decides again (the clocks cost as much as the rest
            # of the bookkeeping of a quick batch).
            self._inline_left = left - 1
            if left > 1:
                return self._next_inline(timed=False)
            try:
                return self._next_inline(timed=False)
            finally:
                self._returned = time.perf_counter()  # the next call measures the gap
        now = time.perf_counter()
        if self._returned:
            gap = now - self._returned
            if self._batch_seconds > 0:
                gap = min(gap, _GAP_OUTLIER * self._gap_bound())
            self._gap = gap if self._gap < 0 else 0.75 * self._gap + 0.25 * gap
            if self._figures is not None:
                self._figures.gap = self._gap
        try:
            if self._ready:
                return self._deliver_ready()
            if self._quick_to_inline() and not self._pending:
                return self._next_inline(timed=True)
            return self._next_from_workers()
        finally:
            self._returned = time.perf_counter()

    def _next_from_workers(self) -> Any:
        self._fill()
        if not self._pending:
            if self._source_error is not None:
                error, self._source_error = self._source_error, None
                try:
                    raise error
                finally:
                    del error  # (see _failed_error)
            if self._end_snapshot is not None:
                self._snapshot = self._end_snapshot
                self._drained = True
            raise StopIteration()
        job, index, last, snapshot = self._pending.popleft()
        if job is not self._job:
            pool = self._pool
            assert pool is not None
            probing = self._probing
            if probing:
                self._probe(job)
            try:
                outcomes, elapsed, cpu_share = pool.result(job, self.timeout)
            except BaseException as failure:
                together = 1 + sum(entry[0] is job for entry in self._pending)
                if pool is self._process_pool:
                    pool.close()  # (a timeout, a dead worker: not one to reuse)
                if self._pool is pool:  # (else closed meanwhile, by another thread)
                    self._drop_job(job, last)
                if isinstance(failure, DataLoaderTimeoutError):
                    timed_out = DataLoaderTimeoutError(self._timeout_message(together))
                    timed_out.batches = together
                    raise timed_out from None
                raise
            self._job, self._outcomes = job, outcomes
            self._learn(elapsed / len(outcomes), cpu_share)
            if probing:
                self._fill()  # the workers read ahead from now on
        outcomes = self._outcomes
        result, outcomes[index] = outcomes[index], None  # the caller's from now on
        if last:
            self._jobs -= 1
            self._job, self._outcomes = None, []
        # A failed batch counts as delivered too: the next call delivers the batch after it.
        self._previous, self._snapshot = self._snapshot, snapshot
        self._delivered += 1
        if type(result) is Failed:
            error = _failed_error(result)
            del result, outcomes
            try:
                raise error
            finally:
                del error
        return result

    def _library_only(self) -> bool:
        """Whether a batch runs only this library's code: one of our dataset readers over
        our formats (a format's ``unpack`` runs in the read) and components, and no
        ``collate_fn`` or one of ours."""
        return all(_ours(part) for part in reader_code(self._reader)) and (
            self._worker_collate is None or _ours(self._worker_collate)
        )

    def _quick_to_inline(self) -> bool:
        """Whether the calling thread reads the next batch itself rather than a worker
        thread: the batches compute (they do not wait on I/O), and the caller comes back for
        the next one within ``_GAP_SHARE`` of a batch's read time (or ``_GAP_FLOOR``), so it is
        waiting for them. Thread workers run computing jobs one at a time (see
        :meth:`_side_by_side`), so reading ahead in a thread only adds a handoff under the
        same GIL. A caller with work of its own between batches (a training step) keeps the
        workers reading ahead. Only where nothing can tell: the batches run only this
        library's code, or the workers are not told who they are
        (:func:`~guideloom_pipes.get_worker_info`, with no ``base_seed`` or
        ``worker_init_fn``). The calling
        thread takes over once the jobs already submitted are delivered; the batches it
        reads keep the figures current, so batches that start to wait, or a caller that
        slows, go back to the workers."""
        return (
            self._may_inline
            and not self._probing
            and not self._source_done
            and self._batch_seconds > 0
            and self._cpu_share >= _WAITING
            and 0 <= self._gap < self._gap_bound()
        )

    def _gap_bound(self) -> float:
        """The caller's time between batches under which the calling thread reads them."""
        return max(_GAP_SHARE * self._batch_seconds, _GAP_FLOOR)

    def _next_inline(self, timed: bool) -> Any:
        """The next batch, read by the calling thread (see :meth:`_quick_to_inline`): one at
        a time where a read gives batches of columns (each read into memory the allocator
        just freed, see :meth:`ReadTask.run`) unless the reader packs several together
        (``read_arrays_many``: up to ``_COLUMN_CHUNK``), else a chunk of them with one read,
        as a worker would; a chunk is delivered one by one. ``timed``: measure the batch
        (its time and CPU share) and read the next ``_INLINE_SAMPLE - 1`` batches without a
        clock."""
        if self._ready:
            # the rest of a chunk this thread read comes first (a chunk read now would only
            # pile up behind it, and at the source's end the batches left in it were lost)
            return self._deliver_ready()
        chunk = self._inline_chunk()
        if chunk > 1:
            return self._read_chunk_inline(chunk)
        return self._read_next(timed)

    def _inline_chunk(self) -> int:
        """How many batches the calling thread reads with one read (see :meth:`_next_inline`):
        1 where a read gives batches of columns (or may: not known before the first read),
        unless the reader packs several together (``read_many``: up to ``_COLUMN_CHUNK``);
        else a chunk, as a worker would read it."""
        task = self._task
        assert task is not None
        if task.columns is False:
            return self._chunk_size()
        if task.packs_chunks and task.columns:
            return min(self._chunk_size(), _COLUMN_CHUNK)
        return 1

    def _read_next(self, timed: bool = False) -> Any:
        """The source's next batch, read by the calling thread by itself; ``timed``: measured
        (see :meth:`_next_inline`)."""
        try:
            ids = self._next_ids()
        except StopIteration:
            return self._source_ended(None)
        except Exception as error:
            return self._source_ended(error)
        task = self._task
        assert task is not None
        if not timed:
            return self._read_inline(task, ids, self._mark())
        snapshot = self._mark()
        cpu = time.thread_time()
        started = time.perf_counter()
        try:
            return self._read_inline(task, ids, snapshot)
        finally:
            elapsed = time.perf_counter() - started
            share = min(1.0, (time.thread_time() - cpu) / elapsed) if elapsed > 0 else None
            self._learn(elapsed, share)
            if self._quick_to_inline():
                self._inline_left = _INLINE_SAMPLE - 1
                self._solo = self._inline_chunk() == 1

    def _source_ended(self, error: Exception | None) -> Any:
        """The source ran out (``error`` None) or raised ``error`` as the calling thread took
        the next batch's ids: delivered as the workers' path delivers it, after any batches
        before it still to deliver."""
        self._inline_left = 0
        self._source_done = True
        if error is None:
            self._end_snapshot = self.source.state_dict()
            return self._next_from_workers()  # delivers the end
        self._source_error = error
        del error  # (see _failed_error)
        return self._next_from_workers()  # raises it

    def _read_inline(self, task: ReadTask, ids: _I64, snapshot: Any) -> Any:
        """One batch read by the calling thread; it counts as delivered, also when it fails
        (the next call reads the next one; a ``KeyboardInterrupt`` delivers nothing)."""
        seeds = self.batch_seeds
        try:
            if seeds is None:
                result = task._plain(ids)
            else:
                self._taken += 1
                result = task(ids, seeds(self._taken - 1))
        except Exception as error:
            self._previous, self._snapshot = self._snapshot, snapshot
            self._delivered += 1
            mark_batch_failure(error)
            raise
        self._previous, self._snapshot = self._snapshot, snapshot
        self._delivered += 1
        return result

    def _read_chunk_inline(self, size: int) -> Any:
        """Read a chunk of ``size`` batches in the calling thread (``ReadTask.run``, one
        read for them all), keep them in ``_ready`` and deliver the first."""
        task = self._task
        assert task is not None
        batch_seeds = self.batch_seeds
        batches, snapshots, seeds = self._take(size)
        if not batches:
            return self._next_from_workers()
        cpu = time.thread_time()
        started = time.perf_counter()
        # (Ctrl-C inside the read propagates: nothing of the chunk is delivered). Batches
        # whose samples the read leaves to slices (LazyRows) are made and collated as each
        # is delivered: only the batch being delivered holds objects the garbage collector
        # tracks, not the chunk (Deferred; this thread would run their collates anyway).
        job = (batches, seeds) if batch_seeds is not None else batches
        outcomes = task.run(job, defer=True)
        elapsed = time.perf_counter() - started
        share = min(1.0, (time.thread_time() - cpu) / elapsed) if elapsed > 0 else None
        self._learn(elapsed / len(outcomes), share)
        self._ready.extend(zip(outcomes, snapshots))
        return self._deliver_ready()

    def _deliver_ready(self) -> Any:
        """The next batch of a chunk read by the calling thread (a failed one raises; a
        deferred one is made and collated now: if that raises an ``Exception`` the batch
        has failed, and counts as delivered; a ``KeyboardInterrupt`` delivers nothing, the
        batch stays next)."""
        ready = self._ready
        result, snapshot = ready[0]
        if type(result) is Deferred:
            try:
                result = result.finish()
            except Exception as error:
                result = Failed(error)
        ready.popleft()
        self._previous, self._snapshot = self._snapshot, snapshot
        self._delivered += 1
        if type(result) is Failed:
            raised = _failed_error(result)
            del result
            try:
                raise raised
            finally:
                del raised
        return result

    def _timeout_message(self, together: int) -> str:
        workers = f"{self.num_workers} {self.method} worker" + "s" * (self.num_workers > 1)
        return (
            f"DataLoader timed out after {seconds_text(self.timeout or 0)} seconds waiting for "
            f"batch {self._delivered} (counting from 0 at the last reset) from {workers}"
            f"{together_text(together)}: a read or collate_fn took longer than the timeout, or "
            "hangs; raise timeout= or find what blocks"
        )

    def _probe(self, job: Any) -> None:
        """Wait for the first job, which runs alone, up to ``chunk_seconds``. A job that
        takes longer is worth a job of its own anyway; if it has spent most of that time
        waiting rather than computing (or that cannot be told), the jobs wait on I/O: read
        side by side from then on. Otherwise the next jobs queue for one worker at a time
        until a finished job tells more."""
        self._probing = False
        pool = self._pool
        if not isinstance(pool, ThreadPool) or pool.wait_done(job, self.chunk_seconds):
            return
        # Judge the job once it has itself run for chunk_seconds: a worker may have started
        # it late (a loaded machine), and the first moments of a job that waits are spent
        # computing (setting up its read). One not started at all is taken to wait.
        running = job.running_for()
        while running is not None and running < self.chunk_seconds:
            if pool.wait_done(job, self.chunk_seconds - running):
                return  # done: its result tells (see next)
            running = job.running_for()
        share = job.running_share()
        if share is None or share < _WAITING:
            self._cpu_share = 0.0 if share is None else share
        self._fill()

    def _drop_job(self, job: Any, last: bool) -> None:
        """Forget the rest of a job that failed as a whole (its batches were not delivered)."""
        pending = self._pending
        while not last and pending and pending[0][0] is job:
            last = pending.popleft()[2]
        self._jobs -= 1

    def get_state(self) -> dict[str, Any]:
        if self.num_workers == 0:
            return {self.SOURCE_KEY: self.source.state_dict()}
        return {self.SOURCE_KEY: self._state(self._snapshot)}

    def _state(self, snapshot: Any) -> Any:
        """The source's state kept as ``snapshot`` (a state, or a mark of one)."""
        if self._state_at is None or type(snapshot) is not tuple:
            return snapshot
        return self._state_at(snapshot)

    # -- workers --------------------------------------------------------------------------

    def _learn(self, seconds: float, cpu_share: float | None) -> None:
        """Fold a job's time per batch (and, if it ran alone, the share of it spent on the
        CPU) into the moving averages that chunk sizes and the thread policy follow."""
        average = self._batch_seconds
        self._batch_seconds = seconds if average == 0 else 0.75 * average + 0.25 * seconds
        if cpu_share is not None:
            share = self._cpu_share
            self._cpu_share = cpu_share if share < 0 else 0.75 * share + 0.25 * cpu_share
        figures = self._figures
        if figures is not None:
            figures.batch_seconds, figures.cpu_share = self._batch_seconds, self._cpu_share

    def _side_by_side(self) -> bool:
        """Whether jobs of several batches should run on several workers at once.

        Processes: always (each has a core). Threads: when the jobs mostly *wait* (I/O: a
        job running alone spends under ``_WAITING`` of its time on the CPU), since quick jobs that
        compute would only take the GIL from each other. The first job after ``reset()``
        runs alone to find out (for up to ``chunk_seconds``: a slower job is worth a job of
        its own in any case); later jobs that happen to run alone refine it.
        """
        if self.method == "process":
            return True
        return 0 <= self._cpu_share < _WAITING

    def _chunk_size(self) -> int:
        """Batches per job: about ``chunk_seconds`` of a worker's time, at most ``max_chunk``.

        Slow batches (storage latency, heavy decoding) go one per job, so ``N`` workers keep
        ``N`` of them in flight; quick ones are grouped, so a handoff between threads (or a
        trip through a process pipe) is paid per chunk instead of per batch.
        """
        per_batch = self._batch_seconds
        if per_batch <= 0 or self.chunk_seconds <= 0:
            return 1
        return max(1, min(self.max_chunk, int(self.chunk_seconds / per_batch)))

    def _fill(self) -> None:
        """Submit jobs from the source until enough batches are in flight.

        Jobs of one batch: until ``max_in_flight`` batches are pending. Jobs of ``k > 1``
        batches: until ``max(m, ceil(max_in_flight / k))`` jobs are, more when
        ``max_in_flight`` asks for more batches ahead: ``m = num_workers + 1`` (one being
        delivered, one being read by each worker) for processes and for threads whose jobs
        mostly wait, else ``m = 2`` (one being delivered, one being read: threads that
        compute share the GIL, so quick jobs gain nothing from running side by side).
        """
        pool = self._pool
        if pool is None or self._source_done or self._quick_to_inline():
            return
        pending = self._pending
        side_by_side = self._side_by_side()
        least = self.num_workers + 1 if side_by_side else 2
        if isinstance(pool, ThreadPool):
            # Jobs that compute, and jobs not yet known to wait, run on one worker at a time:
            # threads running them side by side only take the GIL from each other (two
            # threads decoding 0.3 ms batches side by side took 0.85 ms a batch, one after
            # the other 0.3 ms).
            pool.set_limit(self.num_workers if side_by_side else 1)
        while not self._source_done:
            if self._probing and self._jobs:
                return
            size = self._chunk_size()
            if size == 1:
                if len(pending) >= self.max_in_flight:
                    return
            elif self._jobs >= max(least, -(-self.max_in_flight // size)):
                return
            batch_seeds = self.batch_seeds
            batches, snapshots, seeds = self._take(size)
            if not batches:
                return
            job = pool.submit((batches, seeds) if batch_seeds is not None else batches)
            last = len(batches) - 1
            for index, snapshot in enumerate(snapshots):
                pending.append((job, index, index == last, snapshot))
            self._jobs += 1

    def _take(self, size: int) -> tuple[list[_I64], list[Any], list[int]]:
        """Up to ``size`` batches of ids from the source, each with the source's state after
        it and (with ``batch_seeds``) its seed. The source's end or error is kept, to be
        raised once the batches before it are delivered."""
        source, batch_seeds, mark = self.source, self.batch_seeds, self._mark
        next_ids = self._next_ids
        batches: list[_I64] = []
        snapshots: list[Any] = []
        seeds: list[int] = []
        while len(batches) < size:
            try:
                ids = next_ids()
            except StopIteration:
                self._source_done = True
                self._end_snapshot = source.state_dict()
                break
            except Exception as error:
                self._source_done = True
                self._source_error = error
                break
            batches.append(ids)
            snapshots.append(mark())
            if batch_seeds is not None:
                seeds.append(batch_seeds(self._taken))
                self._taken += 1
        return batches, snapshots, seeds

    def _stop_workers(self) -> None:
        pool, self._pool = self._pool, None
        self._pending.clear()
        self._ready.clear()
        self._inline_left = 0
        self._jobs = 0
        self._probing = False
        self._job, self._outcomes = None, []
        if pool is None:
            return
        if pool is not self._process_pool:
            pool.close()
            return
        try:
            pool.release()
        except BaseException:
            pool.close()
            raise
