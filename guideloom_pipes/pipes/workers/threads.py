"""Worker threads of :class:`~guideloom_pipes.pipes.ReadSamples`: ordered batches, no
polling, the calling thread running a job itself when every worker is busy; and what the
thread and process pools share (timeouts, waking, jobs of closed pools)."""

from __future__ import annotations

import atexit
import collections
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from guideloom_pipes.pipes.errors import DataLoaderTimeoutError

# -- orphaned jobs ------------------------------------------------------------------------------
# A thread pool closed while its workers run jobs does not wait for them: each such worker
# finishes its job in the background (its result is dropped) and then exits. Closing what
# those jobs may still use (the dataset's reader) waits for them: see after_orphaned_jobs.
# The interpreter's exit waits for those workers too (see _join_orphans_at_exit).
_orphans_lock = threading.Lock()
_orphans = 0  # jobs of closed pools still running
_after_orphans: list[Callable[[], None]] = []
#: the workers of closed pools that were running a job (until they end)
_orphan_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
#: how long the interpreter's exit waits for them
EXIT_WAIT_SECONDS = 30.0


def after_orphaned_jobs(fn: Callable[[], None]) -> None:
    """Call ``fn`` now if no job of a closed thread pool is still running, else as soon as
    the last one ends (in the worker thread that ran it)."""
    with _orphans_lock:
        if _orphans:
            _after_orphans.append(fn)
            return
    fn()


def _orphaned(threads: set[threading.Thread]) -> None:
    global _orphans
    with _orphans_lock:
        _orphans += len(threads)
        _orphan_threads.update(threads)


def _join_orphans_at_exit(timeout: float | None = None) -> None:
    """Wait (up to ``timeout``, default EXIT_WAIT_SECONDS) for the workers of closed pools
    still finishing a job. At exit, before the interpreter finalizes: a daemon thread that
    is still running then is stopped wherever it next waits for the GIL, and where that is
    inside a C++ library (torch freeing a tensor, pyarrow) the process aborts
    (``terminate called without an active exception``) after the script has succeeded."""
    wait = EXIT_WAIT_SECONDS if timeout is None else timeout
    deadline = time.monotonic() + wait
    with _orphans_lock:
        threads = list(_orphan_threads)
    current = threading.current_thread()
    for thread in threads:
        if thread is not current:
            thread.join(max(0.0, deadline - time.monotonic()))
    left = sum(thread.is_alive() for thread in threads if thread is not current)
    if left:
        print(
            f"guideloom_pipes: {left} reader thread(s) of a closed loader still running a "
            f"read after {wait:g} s; exiting without them",
            file=sys.stderr,
        )


atexit.register(_join_orphans_at_exit)


def _orphan_ended() -> None:
    """One job of a closed pool ended; run what waited for the last of them."""
    global _orphans
    with _orphans_lock:
        _orphans -= 1
        if _orphans:
            return
        callbacks = _after_orphans[:]
        _after_orphans.clear()
    for fn in callbacks:
        fn()


class _Job:
    """One job (a chunk of batches): its argument, then its result or the exception it
    raised, the seconds it took, and its CPU time over them when it ran alone (no other
    job of the pool running meanwhile; else None). While it runs: when it started, and the
    CPU clock of the thread running it (where the platform has one) with its start value."""

    __slots__ = (
        "arg",
        "clock",
        "cpu_share",
        "cpu_started",
        "done",
        "elapsed",
        "error",
        "result",
        "started",
    )

    def __init__(self, arg: Any) -> None:
        self.arg = arg
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.elapsed = 0.0
        self.cpu_share: float | None = None
        self.started = 0.0  # 0: not started
        self.clock: int | None = None
        self.cpu_started = 0.0

    def running_for(self) -> float | None:
        """Seconds the job has been running (None: not started)."""
        started = self.started
        return time.perf_counter() - started if started else None

    def running_share(self) -> float | None:
        """The share of its time so far the running job spent on the CPU (None: not
        started, or no per-thread CPU clock here)."""
        started, clock = self.started, self.clock
        if not started or clock is None:
            return None
        elapsed = time.perf_counter() - started
        if elapsed <= 0:
            return None
        return min(1.0, (time.clock_gettime(clock) - self.cpu_started) / elapsed)


def _thread_clock() -> int | None:
    """The calling thread's CPU-time clock, readable from other threads (None where the
    platform has none)."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def _run(fn: Callable[[Any], Any], job: _Job, clock: int | None = None) -> float:
    """Run ``job``; return the CPU seconds of this thread it took."""
    cpu = time.thread_time()
    job.clock = clock
    if clock is not None:
        job.cpu_started = time.clock_gettime(clock)
    job.started = started = time.perf_counter()
    try:
        job.result = fn(job.arg)
    except BaseException as error:
        job.error = error
    job.elapsed = time.perf_counter() - started
    return time.thread_time() - cpu


#: The longest a waiting caller sleeps at once: a KeyboardInterrupt that arrives while it
#: sleeps (``_thread.interrupt_main()``, or a Ctrl-C just before the wait began) is raised
#: within this time. Waiting itself never polls: a finished batch wakes the caller at once.
WAKE_SECONDS = 0.25


def seconds_text(seconds: float) -> str:
    """``seconds`` as a user wrote it: ``2`` for 2.0, ``0.5`` for 0.5."""
    return str(int(seconds)) if float(seconds).is_integer() else repr(float(seconds))


def together_text(batches: int) -> str:
    """What a timeout message says of a job of several batches."""
    if batches <= 1:
        return ""
    return (
        f" (read in one job with the next {batches - 1} batch" + "es" * (batches > 2) + ": the "
        "one that hangs may be any of them)"
    )


def timed_out(timeout: float) -> DataLoaderTimeoutError:
    # ReadSamples and the loader replace the message with one that names the batch.
    return DataLoaderTimeoutError(f"DataLoader timed out after {seconds_text(timeout)} seconds")


class ThreadPool:
    """Threads that run ``fn`` on submitted jobs, oldest first; the caller collects in order.

    The caller waits for the job it needs, except when no worker has started it yet (all are
    busy, or none has woken up since it was submitted): then the caller runs it itself
    rather than wait for a worker to come free. So ``N`` workers read like ``N`` readers,
    and the caller adds itself only when they are all busy. With ``caller_runs=False`` (a
    timeout: a job the caller ran could not be timed out) the caller only ever waits. With
    ``caller_as``, a job the caller runs runs as one of the workers (what the user's code
    in it can ask, e.g. ``guideloom_pipes.get_worker_info()``, answers as in that worker).

    Wake-ups are what a handoff costs (tens of microseconds of CPU each on a small VM), so
    there are as few as the work allows: a job wakes a worker only if one is asleep, and a
    finished job wakes the caller only if it is the job the caller sleeps on. For the same
    reason the threads start (and run ``init``) with the first job, not with the pool,
    unless ``start_now``.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        num_workers: int,
        caller_runs: bool = True,
        init: Callable[[int], None] | None = None,
        caller_as: Callable[[int], Any] | None = None,
        start_now: bool = False,
    ):
        self._fn = fn
        self._init = init
        self._init_error: BaseException | None = None  # what an ``init`` raised, first one
        self._inits_left = num_workers if init is not None else 0  # workers still in init
        self._caller_runs = caller_runs
        # a context manager factory: the calling thread runs a job inside caller_as(index),
        # standing in for worker ``index`` (the workers take turns: index = starts % N)
        self._caller_as = caller_as
        self._num_workers = num_workers
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._finished = threading.Condition(self._lock)
        self._queue: collections.deque[_Job] = collections.deque()  # unclaimed, oldest first
        self._awaited: _Job | None = None  # the job the caller sleeps on
        self._idle = 0  # workers asleep on _work
        self._limit = num_workers  # most jobs running at once (see set_limit)
        self._running = 0  # jobs running (the caller's included)
        self._starts = 0  # jobs started so far
        self._busy: set[threading.Thread] = set()  # workers running a job
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"guideloom-read-{i}", daemon=True)
            for i in range(num_workers)
        ]
        # The workers start with the first job (a pool whose jobs the calling thread reads
        # itself, quick batches, never starts them: a thread's start and join cost a
        # scheduling round each, milliseconds on a busy machine, at every epoch), or now
        # with ``start_now`` (a user's worker_init_fn: torch runs it as an epoch starts).
        self._launched = False
        if start_now:
            self._launch()

    def _launch(self) -> None:
        """Start the worker threads (once; only the calling thread submits jobs)."""
        self._launched = True
        for thread in self._threads:
            thread.start()

    def _start(self) -> int:
        """Count a job starting (under the lock); its start number, or 0 if others run."""
        self._running += 1
        self._starts += 1
        return self._starts if self._running == 1 else 0

    def _end(self, job: _Job, alone: int, cpu: float) -> None:
        """Count a job ending (under the lock); keep its CPU share if it ran alone."""
        self._running -= 1
        if alone and alone == self._starts and job.elapsed > 0:
            job.cpu_share = min(1.0, cpu / job.elapsed)

    def _loop(self, index: int) -> None:
        if self._init is not None:
            error: BaseException | None = None
            try:
                self._init(index)
            except BaseException as raised:  # raised to the caller at its next result()
                error = raised
            with self._lock:
                self._inits_left -= 1
                if error is not None and self._init_error is None:
                    self._init_error = error
                self._finished.notify_all()
            if error is not None:
                return
        fn = self._fn
        clock = _thread_clock()
        lock, queue, busy = self._lock, self._queue, self._busy
        me = threading.current_thread()
        job: _Job | None = None
        alone, cpu = 0, 0.0
        while True:
            with lock:
                orphan = False
                if job is not None:
                    self._end(job, alone, cpu)
                    job.done = True
                    busy.discard(me)
                    orphan = self._stopping  # the pool was closed while it ran
                    if self._awaited is job:
                        self._finished.notify()
                    # Let go of it before the caller can see it done: a result holding an
                    # error (its traceback, once raised, holds the caller's frames) would
                    # otherwise live on as long as this thread waits for its next job.
                    job = None
                while (not queue or self._running >= self._limit) and not self._stopping:
                    self._idle += 1
                    self._work.wait()
                    self._idle -= 1
                stop = self._stopping
                if not stop:
                    job = queue.popleft()
                    busy.add(me)
                    alone = self._start()
            if orphan:
                _orphan_ended()
            if stop:
                return
            assert job is not None
            cpu = _run(fn, job, clock)

    def submit(self, arg: Any) -> _Job:
        """Queue a job; wake a sleeping worker for it if fewer than the limit are running."""
        job = _Job(arg)
        with self._lock:
            self._queue.append(job)
            if self._idle and self._running < self._limit:
                self._work.notify()
        if not self._launched:
            self._launch()
        return job

    def set_limit(self, limit: int) -> None:
        """Let at most ``limit`` (>= 1) jobs run at once (the caller's own included); the
        other workers sleep, and queued jobs wait for a running one. Raising it wakes
        sleepers for queued jobs. Setting the limit it has already costs nothing."""
        limit = max(1, limit)
        if limit == self._limit:  # only the caller's thread sets it: no lock needed to look
            return
        with self._lock:
            self._limit = limit
            wake = min(self._idle, len(self._queue), self._limit - self._running)
            if wake > 0:
                self._work.notify(wake)

    def wait_done(self, job: _Job, seconds: float) -> bool:
        """Wait up to ``seconds`` for a worker to finish ``job``; whether it has."""
        deadline = time.monotonic() + seconds
        with self._lock:
            self._awaited = job
            try:
                while not job.done:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._finished.wait(min(left, WAKE_SECONDS))
            finally:
                self._awaited = None
        return True

    def result(self, job: _Job, timeout: float | None) -> tuple[Any, float, float | None]:
        """``(fn(arg), seconds it took, its CPU share if it ran alone)`` of ``job``;
        re-raises what ``fn`` raised (and what a worker's ``init`` raised, before anything)."""
        if self._inits_left:
            self._wait_for_inits(timeout)
        if self._init_error is not None:
            raise self._init_error
        with self._lock:
            mine = self._caller_runs and bool(self._queue) and self._queue[0] is job
            if mine:
                self._queue.popleft()
                alone = self._start()
            elif not job.done:
                deadline = None if timeout is None else time.monotonic() + timeout
                self._awaited = job
                try:
                    while not job.done:
                        if self._stopping:
                            raise RuntimeError("the read workers were stopped (closed)")
                        if self._init_error is not None:
                            raise self._init_error
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            raise timed_out(timeout)  # type: ignore[arg-type]
                        self._finished.wait(
                            WAKE_SECONDS if left is None else min(left, WAKE_SECONDS)
                        )
                finally:
                    self._awaited = None
        if mine:
            # no worker has started it: run it here
            if self._caller_as is None:
                cpu = _run(self._fn, job, _thread_clock())
            else:
                with self._caller_as(self._starts % self._num_workers):
                    cpu = _run(self._fn, job, _thread_clock())
            with self._lock:
                self._end(job, alone, cpu)
                if self._idle and self._queue and self._running < self._limit:
                    self._work.notify()  # a worker kept asleep by the limit takes the next
        if job.error is not None:
            failure, job.error = job.error, None
            raise failure
        return job.result, job.elapsed, job.cpu_share

    def _wait_for_inits(self, timeout: float | None) -> None:
        """Wait until every worker has run its ``init``: no batch is read (by the caller
        either) before, so a failing ``init`` fails the first batch, whatever the timing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._inits_left and not self._stopping:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise timed_out(timeout)  # type: ignore[arg-type]
                self._finished.wait(WAKE_SECONDS if left is None else min(left, WAKE_SECONDS))

    def close(self) -> None:
        """Stop the workers without waiting for the jobs they run: idle workers exit now,
        busy ones once their job ends (its result is dropped). A caller waiting in
        :meth:`result` (another thread) gets a ``RuntimeError``."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._queue.clear()
            self._work.notify_all()
            self._finished.notify_all()
            busy = set(self._busy)
            if busy:
                _orphaned(busy)  # under the pool's lock: before any of them can end
        current = threading.current_thread()
        for thread in self._threads:
            # (one not alive was never started, has ended, or is being started by a submit
            # racing this close: it then sees _stopping and exits by itself)
            if thread is not current and thread not in busy and thread.is_alive():
                thread.join()
