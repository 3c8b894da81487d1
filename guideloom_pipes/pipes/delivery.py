"""How a :class:`~guideloom_pipes.pipes.ReadSamples` stage with workers delivers its batches,
in order: each read by the calling thread itself (where its
:class:`~guideloom_pipes.pipes.workers.schedule.ReadSchedule` says so: one at a time, or a
chunk with one read delivered batch by batch) or taken from the workers' jobs
(:class:`~guideloom_pipes.pipes.workers.jobs.WorkerJobs`), and where the source stands as of
the last batch delivered (the stage's state)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.pipes.errors import DataLoaderTimeoutError, mark_batch_failure
from guideloom_pipes.pipes.shuffle import state_marks
from guideloom_pipes.pipes.worker_info import _thread_info
from guideloom_pipes.pipes.workers.jobs import WorkerJobs
from guideloom_pipes.pipes.workers.schedule import INLINE_SAMPLE, ReadSchedule
from guideloom_pipes.pipes.workers.tasks import Deferred, Failed, ReadTask
from guideloom_pipes.pipes.workers.threads import seconds_text, together_text

__all__ = ["Delivery", "SourceBatches", "failed_batch_error"]

_I64 = npt.NDArray[np.int64]


def failed_batch_error(failed: Failed) -> BaseException:
    """A failed batch's error, marked as its batch's own, to raise. The caller drops its
    references to it and to ``failed`` as it raises it (``try: raise error finally: del
    error``): a frame of the stage that still held it would make a cycle (error ->
    traceback -> that frame -> error) that keeps the stage, its iterator and its worker
    threads alive until the garbage collector runs, after a loop that stopped at it."""
    error = failed.raised()
    mark_batch_failure(error)
    return error


class SourceBatches:
    """The stage's source as batches of ids, each taken with the source's state after it (a
    mark, see ``state_marks``) and, with ``batch_seeds``, its seed; the source's end or error
    is kept (``done``, ``end_state``, ``error``), to be delivered once the batches before it
    are. Shared by the calling thread's reads and the workers' jobs."""

    __slots__ = ("batch_seeds", "done", "end_state", "error", "mark", "next_ids", "source", "taken")

    def __init__(
        self, source: Any, next_ids: Callable[[], _I64], batch_seeds: Callable[[int], int] | None
    ) -> None:
        self.source = source
        self.next_ids = next_ids
        self.batch_seeds = batch_seeds
        self.mark: Callable[[], Any] = source.state_dict
        self.taken = 0  # batches taken from the source since reset (see batch_seeds)
        self.done = False
        self.end_state: Any = None
        self.error: BaseException | None = None

    def restart(self, mark: Callable[[], Any]) -> None:
        """A reset: nothing taken, the source not ended; ``mark`` marks its state."""
        self.mark = mark
        self.taken = 0
        self.done = False
        self.end_state = None
        self.error = None

    def take(self, size: int) -> tuple[list[_I64], list[Any], list[int]]:
        """Up to ``size`` batches of ids from the source, each with the source's state after
        it and (with ``batch_seeds``) its seed; fewer where the source ends or raises."""
        batch_seeds, mark, next_ids = self.batch_seeds, self.mark, self.next_ids
        batches: list[_I64] = []
        snapshots: list[Any] = []
        seeds: list[int] = []
        while len(batches) < size:
            try:
                ids = next_ids()
            except StopIteration:
                self.done = True
                self.end_state = self.source.state_dict()
                break
            except Exception as error:
                self.done = True
                self.error = error
                break
            batches.append(ids)
            snapshots.append(mark())
            if batch_seeds is not None:
                seeds.append(batch_seeds(self.taken))
                self.taken += 1
        return batches, snapshots, seeds


class Delivery:
    """The batches of a read stage with workers, delivered in order (:meth:`next`), each by
    the calling thread or from the workers' jobs, and the source's state after the last
    one delivered (:meth:`state`), from one :meth:`start` (a reset) to :meth:`stop`.

    Args:
        source: The stage's source (its states, and its resets).
        ids: The source as batches of ids (shared with ``workers``).
        schedule: Whether the calling thread reads the next batch, and how many at once.
        workers: The stage's jobs on its workers.
        num_workers, method: The workers (for a timeout's message).
    """

    def __init__(
        self,
        source: Any,
        ids: SourceBatches,
        schedule: ReadSchedule,
        workers: WorkerJobs,
        num_workers: int,
        method: str,
    ) -> None:
        self.source = source
        self._ids = ids
        self._next_ids = ids.next_ids
        self.batch_seeds = ids.batch_seeds
        self.schedule = schedule
        self._workers = workers
        self._pending = workers.pending  # (the same deque: batches on the workers)
        self.num_workers = num_workers
        self.method = method
        self.timeout: float | None = None
        self._task: ReadTask | None = None
        self._may_inline = False  # batches may be read by the calling thread (schedule.start)
        # each worker's WorkerInfo where the calling thread stands in for them, else None
        self._stand_in: list[Any] | None = None
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
        self._mark: Callable[[], Any] = source.state_dict
        self._state_at: Callable[[Any], Any] | None = None
        self._drained = False  # the source's end was delivered

    def start(
        self,
        task: ReadTask | None,
        timeout: float | None,
        may_inline: bool,
        stand_in: list[Any] | None,
    ) -> None:
        """A reset (the source just reset): nothing delivered. ``may_inline``: the calling
        thread may read batches (with ``task``), standing in for the workers of
        ``stand_in``'s infos, in turn, where it is not None."""
        self._task, self.timeout = task, timeout
        self._may_inline, self._stand_in = may_inline, stand_in
        marks = state_marks(self.source)
        if marks is None:
            self._mark, self._state_at = self.source.state_dict, None
        else:
            self._mark, self._state_at = marks
        self._delivered = 0
        self._snapshot = self.source.state_dict()
        self._previous = None
        self._drained = False
        self._ids.restart(self._mark)
        self._returned = 0.0

    def stop(self) -> None:
        """Drop what was read and not delivered, and stop the workers."""
        self._ready.clear()
        self._inline_left = 0
        self._workers.stop()

    def state(self) -> Any:
        """The source's state after the last batch delivered."""
        return self._state(self._snapshot)

    def next(self) -> Any:
        """The next batch (see :meth:`ReadSamples.next`), with workers."""
        if not self._may_inline:
            return self._next_from_workers()
        # The calling thread reads batch after batch by itself, as decided at the last timed
        # call: _next_here's way without its checks (1-2 us a batch).
        left = self._inline_left
        solo = left > 1 and self._solo and not self._ready
        infos = self._stand_in
        if infos is None:
            if solo:
                self._inline_left = left - 1
                return self._read_next()
            return self._next_here()
        # Standing in for worker delivered % N (as worker_info.standing_in does, without a
        # context manager's ~1.5 us per batch: this is the path of every quick batch)
        local = _thread_info
        before = getattr(local, "info", None)
        local.info = infos[self._delivered % len(infos)]
        try:
            if solo:
                self._inline_left = left - 1
                return self._read_next()
            return self._next_here()
        finally:
            local.info = before

    def reset_source_as_delivered(self) -> None:
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

    def _next_here(self) -> Any:
        """:meth:`next` where the calling thread may read the batch itself."""
        left = self._inline_left
        if left:
            # The calling thread reads, as decided at the last measured call: one call in
            # INLINE_SAMPLE is timed and decides again (the clocks cost as much as the rest
            # of the bookkeeping of a quick batch).
            self._inline_left = left - 1
            if left > 1:
                return self._next_inline(timed=False)
            try:
                return self._next_inline(timed=False)
            finally:
                self._returned = time.perf_counter()  # the next call measures the gap
        now = time.perf_counter()
        schedule = self.schedule
        if self._returned:
            schedule.caller_back(now - self._returned)
        try:
            if self._ready:
                return self._deliver_ready()
            if not self._ids.done and not self._pending and schedule.reads_inline():
                return self._next_inline(timed=True)
            return self._next_from_workers()
        finally:
            self._returned = time.perf_counter()

    def _next_from_workers(self) -> Any:
        try:
            got = self._workers.next()
        except DataLoaderTimeoutError as timed_out:  # (the message names the batch)
            raise self._timed_out(timed_out.batches) from None
        if got is None:
            return self._source_end()
        result, snapshot = got
        # A failed batch counts as delivered too: the next call delivers the batch after it.
        self._previous, self._snapshot = self._snapshot, snapshot
        self._delivered += 1
        if type(result) is Failed:
            error = failed_batch_error(result)
            del result, got
            try:
                raise error
            finally:
                del error
        return result

    def _source_end(self) -> Any:
        """Nothing is pending: the source's error, kept until the batches before it were
        delivered, or its end."""
        source = self._ids
        if source.error is not None:
            error, source.error = source.error, None
            try:
                raise error
            finally:
                del error  # (see failed_batch_error)
        if source.end_state is not None:
            self._snapshot = source.end_state
            self._drained = True
        raise StopIteration()

    def _next_inline(self, timed: bool) -> Any:
        """The next batch, read by the calling thread (see :meth:`ReadSchedule.reads_inline`):
        as many with one read as :meth:`ReadSchedule.inline_chunk` says (one at a time
        where a read gives batches of columns, each read into memory the allocator just
        freed, see :meth:`ReadTask.run`), a chunk delivered one by one. ``timed``: measure the
        batch (its time and CPU share) and read the next ``INLINE_SAMPLE - 1`` batches
        without a clock."""
        if self._ready:
            # the rest of a chunk this thread read comes first (a chunk read now would only
            # pile up behind it, and at the source's end the batches left in it were lost)
            return self._deliver_ready()
        task = self._task
        assert task is not None
        chunk = self.schedule.inline_chunk(task.columns, task.packs_chunks)
        if chunk > 1:
            return self._read_chunk_inline(chunk)
        return self._read_next(timed)

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
            schedule = self.schedule
            schedule.batches_read(elapsed, share)
            if not self._ids.done and schedule.reads_inline():
                self._inline_left = INLINE_SAMPLE - 1
                self._solo = schedule.inline_chunk(task.columns, task.packs_chunks) == 1

    def _source_ended(self, error: Exception | None) -> Any:
        """The source ran out (``error`` None) or raised ``error`` as the calling thread took
        the next batch's ids: delivered as the workers' path delivers it, after any batches
        before it still to deliver."""
        self._inline_left = 0
        source = self._ids
        source.done = True
        if error is None:
            source.end_state = self.source.state_dict()
            return self._next_from_workers()  # delivers the end
        source.error = error
        del error  # (see failed_batch_error)
        return self._next_from_workers()  # raises it

    def _read_inline(self, task: ReadTask, ids: _I64, snapshot: Any) -> Any:
        """One batch read by the calling thread; it counts as delivered, also when it fails
        (the next call reads the next one; a ``KeyboardInterrupt`` delivers nothing)."""
        seeds = self.batch_seeds
        try:
            if seeds is None:
                result = task._plain(ids)
            else:
                source = self._ids
                source.taken += 1
                result = task(ids, seeds(source.taken - 1))
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
        batches, snapshots, seeds = self._ids.take(size)
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
        self.schedule.batches_read(elapsed / len(outcomes), share)
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
            raised = failed_batch_error(result)
            del result
            try:
                raise raised
            finally:
                del raised
        return result

    def _timed_out(self, together: int) -> DataLoaderTimeoutError:
        """The timeout waiting for a job of ``together`` batches, naming the batch."""
        workers = f"{self.num_workers} {self.method} worker" + "s" * (self.num_workers > 1)
        timed_out = DataLoaderTimeoutError(
            f"DataLoader timed out after {seconds_text(self.timeout or 0)} seconds waiting for "
            f"batch {self._delivered} (counting from 0 at the last reset) from {workers}"
            f"{together_text(together)}: a read or collate_fn took longer than the timeout, or "
            "hangs; raise timeout= or find what blocks"
        )
        timed_out.batches = together
        return timed_out

    def _state(self, snapshot: Any) -> Any:
        """The source's state kept as ``snapshot`` (a state, or a mark of one)."""
        if self._state_at is None or type(snapshot) is not tuple:
            return snapshot
        return self._state_at(snapshot)

    # -- workers --------------------------------------------------------------------------
