"""Sample reading: batches of sample ids -> lists of samples (or collated batches), in order."""

from __future__ import annotations

import contextlib
import multiprocessing.context
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from torchdata.nodes import BaseNode

from guideloom_pipes.checks import check_int
from guideloom_pipes.datasets import WindowBuffers, open_reader
from guideloom_pipes.pipes.delivery import Delivery, SourceBatches
from guideloom_pipes.pipes.errors import mark_batch_failure
from guideloom_pipes.pipes.positions import Positions
from guideloom_pipes.pipes.shuffle import Shuffle
from guideloom_pipes.pipes.workers.jobs import WorkerJobs
from guideloom_pipes.pipes.workers.processes import ProcessPool, start_context
from guideloom_pipes.pipes.workers.schedule import (
    CHUNK_SECONDS,
    ReadFigures,
    ReadSchedule,
)
from guideloom_pipes.pipes.workers.tasks import (
    ReadTask,
    keep_batch_arrays,
)
from guideloom_pipes.pipes.workers.threads import (
    after_orphaned_jobs,
    together_text,
)

# (CHUNK_SECONDS, ReadFigures, start_context and together_text are imported from here too)
__all__ = ["CHUNK_SECONDS", "ReadFigures", "ReadSamples", "start_context", "together_text"]

_I64 = npt.NDArray[np.int64]
_METHODS = ("thread", "process")


def _to_ids(item: Any) -> _I64:
    """Sample ids of one batch: an int64 array, :class:`Positions` (unshuffled) or ints."""
    if type(item) is np.ndarray and item.dtype == np.int64:
        return item
    if isinstance(item, Positions):
        return item.positions
    return np.asarray(item, dtype=np.int64).reshape(-1)


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

    A job is a *chunk* of consecutive batches, read with one call of the reader (each batch
    collated on its own), so a handoff between threads, which costs tens of microseconds of
    CPU, is paid per chunk instead of per batch. The stage's :attr:`schedule` (a
    :class:`~guideloom_pipes.pipes.workers.schedule.ReadSchedule`) decides, from what it
    measures as batches go, how many batches a job holds (about ``chunk_seconds`` of a
    worker's time, at most ``max_chunk``: slow batches go one per job), how many jobs are in
    flight (``max_in_flight`` batches ahead at least), whether thread workers run them side
    by side (only jobs that wait on I/O: threads that compute take the GIL from each other)
    and whether the calling thread reads the next batches itself: while the caller waits for
    them and they compute, a worker thread reading ahead under the same GIL only adds a
    handoff and colder memory to each batch. The calling thread reads them as a worker
    would: batches of columns one at a time, others a chunk at a time with one read and,
    where the workers are told who they are (``base_seed``), standing in for one
    (:func:`~guideloom_pipes.get_worker_info` answers as in worker ``k % num_workers`` for
    the ``k``-th batch since the reset); never where a ``worker_init_fn`` may have set up the
    workers' threads, nor with a ``timeout``. Batches that start to wait, or a caller that
    slows down, go back to the workers.

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
            starts from at a reset (a
            :class:`~guideloom_pipes.pipes.workers.schedule.ReadFigures`): a loader passes
            one to each epoch's stage. None: each reset learns again.
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
        self.num_workers = _checked_workers(num_workers, method, buffers)
        self.method = method
        self.buffers = buffers
        if figures is not None and not isinstance(figures, ReadFigures):
            raise TypeError(f"figures must be a ReadFigures or None, got {figures!r}")
        self._mp = start_context(multiprocessing_context) if method == "process" else None
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        self.collate_fn = collate_fn
        self.arrays = bool(arrays)
        # What the workers run: with arrays and no collate_fn, a pass-through that takes them.
        self._worker_collate = keep_batch_arrays if arrays and collate_fn is None else collate_fn
        self.max_in_flight, self.timeout, self.chunk_seconds, self.max_chunk = _checked_limits(
            max_in_flight, 2 * self.num_workers, timeout, chunk_seconds, max_chunk
        )
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise TypeError(f"worker_init_fn must be callable or None, got {worker_init_fn!r}")
        self.batch_seeds = batch_seeds
        self.base_seed = base_seed
        self.worker_init_fn = worker_init_fn
        self._process_pool = process_pool
        #: The scheduling policy: who reads the next batch, chunk sizes, jobs in flight.
        self.schedule = ReadSchedule(
            threads=method == "thread",
            workers=self.num_workers,
            chunk_seconds=self.chunk_seconds,
            max_chunk=self.max_chunk,
            max_in_flight=self.max_in_flight,
            figures=figures,
        )
        self._ids = SourceBatches(source, self._next_ids, batch_seeds)
        self._reader = reader
        self._owns_reader = False
        self._task: ReadTask | None = None
        self._workers = WorkerJobs(self.schedule, self._ids, seeded=batch_seeds is not None)
        self._delivery = Delivery(
            source, self._ids, self.schedule, self._workers, self.num_workers, method
        )
        self._read_ahead = False  # workers may have read the source ahead of the caller

    # -- reader ---------------------------------------------------------------------------

    def open(self) -> None:
        """Open this process's reader of the dataset now (otherwise the first reset does)."""
        if self._reader is None:
            self._reader, self._owns_reader = open_reader(self.dataset)
        if self._task is None:
            collate = self._worker_collate
            reader = self._reader
            self._task = ReadTask.of_reader(
                reader,
                collate,
                out=self.buffers,
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
            self._delivery.reset_source_as_delivered()
        else:
            self.source.reset()
        self._read_ahead = False
        self._ids.taken = 0
        if self.num_workers == 0 or self.method == "thread":
            self.open()
        if self.num_workers == 0:
            return
        self._read_ahead = True
        self._start_workers()
        if not self.schedule.reads_inline():
            self._workers.fill()  # (else the calling thread reads from the first batch on)

    def _start_workers(self) -> None:
        """Start this epoch's workers and tell the schedule whether the calling thread may
        read: as a worker would, standing in for one where they are told who they are;
        never where a ``worker_init_fn`` may have set up the workers' threads, nor with a
        timeout (a read in the calling thread could not be interrupted)."""
        caller_reads = self.timeout is None and self.worker_init_fn is None
        may_inline = self.schedule.start(caller_reads)
        base_seed = self.base_seed
        if base_seed is None and self.worker_init_fn is not None:
            base_seed = 0
        if self.method == "thread":
            assert self._task is not None
            stand_in = self._workers.start_threads(
                self._task.run,
                self.num_workers,
                self.dataset,
                timeout=self.timeout,
                base_seed=base_seed,
                worker_init_fn=self.worker_init_fn,
                caller_reads=caller_reads,
            )
            self._delivery.start(self._task, self.timeout, may_inline, stand_in)
            return
        self._delivery.start(None, self.timeout, may_inline, None)
        self._workers.start_processes(
            self.dataset,
            self.collate_fn if self._process_pool is not None else self._worker_collate,
            self.num_workers,
            self._mp,
            timeout=self.timeout,
            shared=self._process_pool,
            base_seed=base_seed,
            worker_init_fn=self.worker_init_fn,
        )

    def next(self) -> Any:
        if self.num_workers == 0:
            task = self._task
            assert task is not None
            ids = self._next_ids()
            try:
                seeds = self.batch_seeds
                if seeds is None:
                    return task._plain(ids)
                source = self._ids
                source.taken += 1
                return task(ids, seeds(source.taken - 1))
            except Exception as failed:
                mark_batch_failure(failed)  # the source has moved past it: the next batch follows
                raise
        return self._delivery.next()

    def get_state(self) -> dict[str, Any]:
        if self.num_workers == 0:
            return {self.SOURCE_KEY: self.source.state_dict()}
        return {self.SOURCE_KEY: self._delivery.state()}

    def _stop_workers(self) -> None:
        self._delivery.stop()


def _checked_workers(num_workers: Any, method: Any, buffers: Any) -> int:
    """``num_workers``, checked with ``method`` and ``buffers``."""
    count = check_int("num_workers", num_workers, minimum=0)
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if buffers is not None and not callable(buffers):
        raise TypeError(f"buffers must be callable or None, got {buffers!r}")
    if buffers is not None and method == "process" and count:
        raise ValueError(
            "buffers= fill memory of this process: they apply to reading inline or on "
            "worker threads, not to method='process' (drop buffers= or use threads)"
        )
    return count


def _checked_limits(
    max_in_flight: Any, default_in_flight: int, timeout: Any, chunk_seconds: Any, max_chunk: Any
) -> tuple[int, float | None, float, int]:
    """``max_in_flight`` (None: ``default_in_flight``), ``timeout``, ``chunk_seconds`` and
    ``max_chunk``, checked."""
    in_flight = check_int("max_in_flight", max_in_flight, minimum=1, allow_none=True)
    max_in_flight = default_in_flight if in_flight is None else in_flight
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    if isinstance(chunk_seconds, bool) or not isinstance(chunk_seconds, (int, float)):
        raise TypeError(f"chunk_seconds must be a number, got {chunk_seconds!r}")
    if not chunk_seconds >= 0:
        raise ValueError(f"chunk_seconds must be >= 0, got {chunk_seconds!r}")
    max_chunk = check_int("max_chunk", max_chunk, minimum=1)
    return max_in_flight, timeout, float(chunk_seconds), max_chunk
