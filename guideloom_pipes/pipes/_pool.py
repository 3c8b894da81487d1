"""Worker pools of :class:`~guideloom_pipes.pipes.ReadSamples`: ordered batches, no polling."""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing.context
import threading
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from guideloom_pipes._reading import _init_process_worker, _process_read


class _Job:
    """One batch of work: its argument, then its result or the exception it raised."""

    __slots__ = ("arg", "done", "error", "result")

    def __init__(self, arg: Any) -> None:
        self.arg = arg
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None


def _run(fn: Callable[[Any], Any], job: _Job) -> None:
    try:
        job.result = fn(job.arg)
    except BaseException as error:
        job.error = error


def _timed_out(what: str, timeout: float) -> RuntimeError:
    return RuntimeError(
        f"no batch came from the {what} workers within timeout={timeout} seconds; raise the "
        "timeout or find what blocks the dataset's reads"
    )


def _broken() -> BrokenProcessPool:
    return BrokenProcessPool(
        "a worker process of the loader exited unexpectedly: killed by a signal (such as "
        "SIGKILL, or the out-of-memory killer), or it failed to start (see its error above; "
        "with spawn, the main module must be importable and guarded by "
        "`if __name__ == '__main__':`). The batches delivered so far are intact: resume "
        "from the last state_dict()"
    )


class _ThreadPool:
    """Threads that run ``fn`` on submitted jobs, oldest first; the caller collects in order.

    The caller waits for the job it needs, except when no worker has started it yet (all are
    busy, or none has woken up since it was submitted): then the caller runs it itself
    rather than wait for a worker to come free. So ``N`` workers read like ``N`` readers,
    and the caller adds itself only when they are all busy.
    """

    def __init__(self, fn: Callable[[Any], Any], num_workers: int) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._finished = threading.Condition(self._lock)
        self._queue: collections.deque[_Job] = collections.deque()  # unclaimed, oldest first
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._loop, name=f"guideloom-read-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self) -> None:
        fn = self._fn
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._work.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
            _run(fn, job)
            with self._lock:
                job.done = True
                self._finished.notify_all()

    def submit(self, arg: Any) -> _Job:
        job = _Job(arg)
        with self._lock:
            self._queue.append(job)
            self._work.notify()
        return job

    def result(self, job: _Job, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            mine = bool(self._queue) and self._queue[0] is job
            if mine:
                self._queue.popleft()
            else:
                while not job.done:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise _timed_out("thread", timeout)  # type: ignore[arg-type]
                    self._finished.wait(left)
        if mine:
            return self._fn(job.arg)  # no worker has started it: run it here
        if job.error is not None:
            failure, job.error = job.error, None
            raise failure
        return job.result

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._queue.clear()
            self._work.notify_all()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join()


class _ProcessPool:
    """Worker processes (each with its own reader of the dataset), via ProcessPoolExecutor."""

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[Any], Any] | None,
        num_workers: int,
        context: multiprocessing.context.BaseContext,
    ) -> None:
        self._executor = concurrent.futures.ProcessPoolExecutor(
            num_workers,
            mp_context=context,
            initializer=_init_process_worker,
            initargs=(dataset, collate_fn),
        )

    def submit(self, arg: Any) -> concurrent.futures.Future[Any]:
        try:
            return self._executor.submit(_process_read, arg)
        except BrokenProcessPool as error:
            raise _broken() from error

    def result(self, future: concurrent.futures.Future[Any], timeout: float | None) -> Any:
        try:
            return future.result(timeout=timeout)
        except BrokenProcessPool as error:
            raise _broken() from error
        except TimeoutError:
            if future.done():
                raise  # the read itself raised TimeoutError
            raise _timed_out("process", timeout) from None  # type: ignore[arg-type]

    def close(self) -> None:
        # Reads have no side effects, so workers still busy (a hung read, an early close)
        # are terminated rather than waited for: no process outlives its iterator.
        executor = self._executor
        # shutdown() forgets both, so take them first (CPython 3.10-3.13 attribute names).
        processes = list((getattr(executor, "_processes", None) or {}).values())
        manager = getattr(executor, "_executor_manager_thread", None)
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join()
        if manager is not None and manager is not threading.current_thread():
            manager.join()
