"""The jobs of a :class:`~guideloom_pipes.pipes.ReadSamples` stage on its workers: the pool
of one epoch (worker threads, told who they are, or worker processes), chunks of batches
submitted from the stage's source as its :class:`~.schedule.ReadSchedule` says, and their
outcomes handed back in order, one batch at a time."""

from __future__ import annotations

import collections
import multiprocessing.context
from collections.abc import Callable
from typing import Any, Protocol

from guideloom_pipes.pipes.errors import DataLoaderTimeoutError
from guideloom_pipes.pipes.worker_info import standing_in, thread_worker_info, thread_worker_infos
from guideloom_pipes.pipes.workers.processes import ProcessPool
from guideloom_pipes.pipes.workers.schedule import ReadSchedule
from guideloom_pipes.pipes.workers.threads import ThreadPool

__all__ = ["WorkerJobs"]


class BatchSource(Protocol):
    """Where jobs come from: the read stage's source, a batch of ids at a time."""

    #: Whether the source has ended (or raised).
    done: bool

    def take(self, size: int) -> tuple[list[Any], list[Any], list[int]]:
        """Up to ``size`` batches of ids, the source's state after each and their seeds
        (fewer where the source ends or raises)."""
        ...


class WorkerJobs:
    """A read stage's jobs on its workers, epoch after epoch (:meth:`start_threads` or
    :meth:`start_processes`, then :meth:`stop`).

    Args:
        schedule: Says how many batches a job holds, how many jobs are in flight and how
            many thread workers run at once; told each job's time.
        source: Where the batches of ids come from (:class:`BatchSource`).
        seeded: Whether batches come with seeds (jobs are then ``(batches, seeds)``).
    """

    def __init__(
        self,
        schedule: ReadSchedule,
        source: BatchSource,
        seeded: bool,
    ) -> None:
        self.schedule = schedule
        self._source = source
        self._seeded = seeded
        self.pool: ThreadPool | ProcessPool | None = None
        self.timeout: float | None = None
        self._shared: ProcessPool | None = None  # released, not stopped (see start_processes)
        # One entry per batch submitted and not yet delivered, oldest first:
        # (job, index in the job, last of its job, source state after the batch).
        self.pending: collections.deque[tuple[Any, int, bool, Any]] = collections.deque()
        self.jobs = 0  # jobs with batches in pending
        self.job: Any = None  # the job whose outcomes are being delivered
        self._outcomes: list[Any] = []

    # -- starting -----------------------------------------------------------------------

    def start_threads(
        self,
        run: Callable[[Any], Any],
        workers: int,
        dataset: Any,
        *,
        timeout: float | None,
        base_seed: int | None,
        worker_init_fn: Callable[[int], Any] | None,
        caller_reads: bool,
    ) -> list[Any] | None:
        """Worker threads running ``run`` on each job (started with the first job, or now
        for a ``worker_init_fn``). Where they are told who they are (``base_seed`` or a
        ``worker_init_fn``), each thread's ``get_worker_info()`` answers for it. With
        ``caller_reads`` the calling thread runs a job no worker has started, standing in
        for a worker where they are told who they are. Returns each worker's ``WorkerInfo``
        for the calling thread to stand in with when it reads batches, or None (workers not
        told, or a ``worker_init_fn`` that may have set their threads up: the calling thread
        is then no stand-in)."""
        told = base_seed is not None or worker_init_fn is not None
        infos = thread_worker_infos(dataset, workers, base_seed or 0) if told else None
        stand_in = infos if worker_init_fn is None else None

        def init(index: int) -> None:
            assert infos is not None
            thread_worker_info(infos[index])
            if worker_init_fn is not None:
                worker_init_fn(index)

        def as_worker(index: int) -> Any:
            assert stand_in is not None
            return standing_in(stand_in[index])

        self.timeout = timeout
        self.pool = ThreadPool(
            run,
            workers,
            caller_runs=caller_reads,
            init=init if told else None,
            caller_as=None if stand_in is None else as_worker,
            # (only a user's init is seen before a job runs: ours only tells the thread
            # who it is)
            start_now=worker_init_fn is not None,
        )
        return stand_in

    def start_processes(
        self,
        dataset: Any,
        collate_fn: Any,
        workers: int,
        context: multiprocessing.context.BaseContext | None,
        *,
        timeout: float | None,
        shared: ProcessPool | None,
        base_seed: int | None,
        worker_init_fn: Callable[[int], Any] | None,
    ) -> None:
        """Worker processes: ``shared`` ones that outlive the stage (a loader's, shared by
        its epochs: on stop only released, not stopped; a failure of the pool stops it),
        else new ones in ``context``."""
        self.timeout = timeout
        self._shared = shared
        if shared is None:
            assert context is not None
            self.pool = ProcessPool(
                dataset,
                collate_fn,
                workers,
                context,
                base_seed=base_seed,
                worker_init_fn=worker_init_fn,
            )
            return
        if shared.closed:
            raise RuntimeError(
                "the worker processes given to this ReadSamples were stopped: a failed "
                "pool is not reused (the loader starts new ones at its next iter())"
            )
        self.pool = shared
        try:
            shared.begin(dataset, collate_fn)
        except BaseException:
            self.pool = None
            shared.close()
            raise

    # -- jobs ---------------------------------------------------------------------------

    def fill(self) -> None:
        """Submit jobs from the source until enough batches are in flight, as many batches
        to a job and as many jobs as the schedule says (:meth:`ReadSchedule.chunk_size`,
        :meth:`ReadSchedule.enough_in_flight`); on thread workers, one at a time or side by
        side as it says (:meth:`ReadSchedule.workers_at_once`)."""
        pool = self.pool
        schedule = self.schedule
        source = self._source
        if pool is None or source.done or schedule.reads_inline():
            return
        pending = self.pending
        if isinstance(pool, ThreadPool):
            pool.set_limit(schedule.workers_at_once())
        size = schedule.chunk_size()
        seeded = self._seeded
        while not schedule.enough_in_flight(len(pending), self.jobs, size):
            batches, snapshots, seeds = source.take(size)
            if not batches:
                return
            job = pool.submit((batches, seeds) if seeded else batches)
            last = len(batches) - 1
            for index, snapshot in enumerate(snapshots):
                pending.append((job, index, index == last, snapshot))
            self.jobs += 1
            if len(batches) < size:
                return  # the source ended (or raised)

    def next(self) -> tuple[Any, Any] | None:
        """The next batch's outcome (its result or ``Failed``) and the source's state after
        it, after submitting what the schedule asks for; None when no batch is pending (the
        source's end, or its error, is next). A job that failed as a whole (a timeout, a
        dead worker process) raises (a timeout as ``DataLoaderTimeoutError`` whose
        ``batches`` counts the job's batches)."""
        self.fill()
        if not self.pending:
            return None
        job, index, last, snapshot = self.pending.popleft()
        if job is not self.job:
            self._await(job, last)
        outcomes = self._outcomes
        result, outcomes[index] = outcomes[index], None  # the caller's from now on
        if last:
            self.jobs -= 1
            self.job, self._outcomes = None, []
        return result, snapshot

    def _await(self, job: Any, last: bool) -> None:
        """Wait for ``job``'s outcomes (the next batch's job) and tell the schedule its time."""
        pool = self.pool
        assert pool is not None
        probing = self.schedule.probing
        if probing:
            self.probe(job)
        try:
            outcomes, elapsed, cpu_share = pool.result(job, self.timeout)
        except BaseException as failure:
            together = 1 + sum(entry[0] is job for entry in self.pending)
            if pool is self._shared:
                pool.close()  # (a timeout, a dead worker: not one to reuse)
            if self.pool is pool:  # (else closed meanwhile, by another thread)
                self._drop(job, last)
            if isinstance(failure, DataLoaderTimeoutError):
                failure.batches = together
            raise
        self.job, self._outcomes = job, outcomes
        self.schedule.batches_read(elapsed / len(outcomes), cpu_share)
        if probing:
            self.fill()  # the workers read ahead from now on

    def probe(self, job: Any) -> None:
        """Wait for the first job, which runs alone, up to ``chunk_seconds``; if it still
        runs, tell the schedule what share of its time it has spent on the CPU
        (:meth:`ReadSchedule.lone_job_running`) and fill. A job done by then tells by its
        result."""
        schedule = self.schedule
        schedule.probe_over()
        pool = self.pool
        seconds = schedule.chunk_seconds
        if not isinstance(pool, ThreadPool) or pool.wait_done(job, seconds):
            return
        # Judge the job once it has itself run for chunk_seconds: a worker may have started
        # it late (a loaded machine), and the first moments of a job that waits are spent
        # computing (setting up its read). One not started at all is taken to wait.
        running = job.running_for()
        while running is not None and running < seconds:
            if pool.wait_done(job, seconds - running):
                return  # done: its result tells
            running = job.running_for()
        schedule.lone_job_running(job.running_share())
        self.fill()

    def _drop(self, job: Any, last: bool) -> None:
        """Forget the rest of a job that failed as a whole (its batches were not delivered)."""
        pending = self.pending
        while not last and pending and pending[0][0] is job:
            last = pending.popleft()[2]
        self.jobs -= 1

    def stop(self) -> None:
        """Forget the jobs and stop the workers (shared processes are only released)."""
        pool, self.pool = self.pool, None
        self.pending.clear()
        self.jobs = 0
        self.schedule.probe_over()
        self.job, self._outcomes = None, []
        if pool is None:
            return
        if pool is not self._shared:
            pool.close()
            return
        try:
            pool.release()
        except BaseException:
            pool.close()
            raise
