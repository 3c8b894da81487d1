"""Worker processes of :class:`~guideloom_pipes.pipes.ReadSamples`, the parent side: a
pipe and a result ring per worker, jobs sent to the least busy one (or round robin), answers
read in order."""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import pickle
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal

from guideloom_pipes.pipes.workers.process_main import (
    ITERATE,
    IterateRequest,
    WorkerSetup,
    _process_worker,
    pack_ids,
)
from guideloom_pipes.pipes.workers.tasks import Failed
from guideloom_pipes.pipes.workers.threads import WAKE_SECONDS, timed_out
from guideloom_pipes.pipes.workers.transport import ResultRing, load_result

_START_METHODS = ("spawn", "forkserver", "fork")
#: How :meth:`ProcessPool.submit` picks a job's worker.
_DEALS = ("least_busy", "round_robin")


def _default_start_method() -> str:
    """``forkserver`` where the platform has it (workers start in milliseconds), else spawn."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def start_context(value: Any) -> multiprocessing.context.BaseContext:
    """The multiprocessing context of ``multiprocessing_context=``: a start method's name,
    a context, or None (``forkserver`` where there is one, else ``spawn``)."""
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


def _how_it_ended(code: int | None) -> str:
    """`` (killed by SIGKILL)``, `` (exit code 1)``, or nothing for an unknown exit code."""
    if code is not None and code < 0:
        try:
            return f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f" (killed by signal {-code})"
    return "" if code is None else f" (exit code {code})"


def _broken(start_method: str, worker: _Worker) -> BrokenProcessPool:
    if worker.process.exitcode is None:
        worker.process.join(1.0)  # its pipe closed: it is exiting, for the exit code
    how = _how_it_ended(worker.process.exitcode)
    guard = (
        "With the 'forkserver' and 'spawn' start methods each worker imports your main "
        'module, so a script must guard its top-level code with `if __name__ == "__main__":`.'
    )
    return BrokenProcessPool(
        f"a worker process of the loader (start method {start_method!r}) exited "
        f"unexpectedly{how}. Workers end so when a signal kills them (SIGKILL, the "
        f"out-of-memory killer) or when they fail to start (see the error above). {guard} "
        "The batches delivered so far are intact: resume from the last state_dict()"
    )


def _module_of(obj: Any) -> list[str]:
    """Modules a worker imports to unpickle ``obj`` (by its class or function)."""
    module = getattr(obj, "__module__", None)
    if not isinstance(obj, type) and not callable(obj):
        module = type(obj).__module__
    if not isinstance(module, str) or module == "builtins":
        return []
    if module != "__main__":
        return [module]
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and isinstance(getattr(spec, "name", None), str):
        return [spec.name]  # run with ``python -m name``
    # A script: Python 3.11 cannot preload it (its fork server ignores "__main__"), so
    # preload the heavy imports a script that builds batches for torch has made.
    return [name for name in ("numpy", "torch") if name in sys.modules]


def _preload_forkserver(
    context: multiprocessing.context.BaseContext, dataset: Any, collate_fn: Any
) -> None:
    """Have Python's fork server import what the workers need before it forks them.

    Without it every worker imports the dataset's and ``collate_fn``'s modules itself (torch:
    a second or more per iterator); with it a worker is a fork of a process that has them
    (milliseconds). Only possible before the fork server starts; a preload list already set
    is kept and added to.
    """
    if context.get_start_method() != "forkserver":
        return
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        return  # running already: its preloads are fixed
    current = list(getattr(server, "_preload_modules", None) or ["__main__"])
    wanted = [
        "guideloom_pipes.pipes.workers.process_main",
        *_module_of(dataset),
        *_module_of(collate_fn),
    ]
    added = [name for name in dict.fromkeys(wanted) if name not in current]
    if added:
        context.set_forkserver_preload(current + added)


class _ProcessJob:
    """A job sent to one worker process; done once its answer is read."""

    __slots__ = ("abandoned", "done", "id", "result", "size", "worker")

    def __init__(self, job_id: int, worker: _Worker, size: int) -> None:
        self.id = job_id
        self.worker = worker
        self.size = size
        self.done = False
        self.abandoned = size == 0  # nobody reads its answer (a new dataset, a closed epoch)
        self.result: tuple[list[Any], float] = ([], 0.0)


class _Worker:
    """A worker process, the pipe to it, its result ring and its jobs in flight, in order."""

    __slots__ = ("_poller", "broken", "conn", "jobs", "process", "ring")

    def __init__(self, process: Any, conn: Any, ring: ResultRing | None) -> None:
        self.process = process
        self.conn = conn
        self.ring = ring
        self.broken = False  # its pipe ended while no iterator waited (replaced at begin())
        self.jobs: collections.deque[_ProcessJob] = collections.deque()
        self._poller: Any = None

    def wait(self, seconds: float) -> tuple[bool, bool]:
        """Wait up to ``seconds`` (0: only look) for an answer on the pipe: ``(an answer, or
        the pipe's end, can be read; the process has ended)``.

        One ``poll`` object per worker, registered once: ``Connection.poll`` and
        ``multiprocessing.connection.wait`` build a selector on every call (7-8 us each
        here, against 0.7 us), and the parent looks at a worker once or twice per job.
        """
        poller = self._poller
        if poller is None:
            if _POLL is None:  # (no poll(2): Windows)
                return self._wait_each_time(seconds)
            poller = self._poller = _POLL()
            poller.register(self.conn.fileno(), select.POLLIN)
            poller.register(self.process.sentinel, select.POLLIN)
        try:
            events = poller.poll(seconds * 1000.0)
        except RuntimeError:  # another thread polls this worker (a close racing a read)
            return self._wait_each_time(seconds)
        readable = ended = False
        for fd, _ in events:
            if fd == self.process.sentinel:
                ended = True
            else:
                readable = True
        return readable, ended

    def _wait_each_time(self, seconds: float) -> tuple[bool, bool]:
        ready = multiprocessing.connection.wait([self.conn, self.process.sentinel], seconds)
        return self.conn in ready, self.process.sentinel in ready


#: ``select.poll`` where the platform has it.
_POLL = getattr(select, "poll", None)


class ProcessPool:
    """Worker processes, each with its own reader of the dataset, a pipe and a result ring.

    The calling thread does all the work of the parent side (no feeder or result threads,
    so no thread wake-ups): it sends each job to the worker with the fewest in flight and
    reads a worker's answers in order when it needs them. Large buffers of the results
    (tensors, numpy arrays) come back through the worker's shared-memory result ring
    (:mod:`guideloom_pipes.pipes.workers.transport`), one copy out on this side.

    A pool can serve several epochs (one per :meth:`begin`): jobs of an epoch left unread
    (an iterator closed early) are answered and dropped on the way to the next epoch's.
    ``persistent=False`` hands every worker a fresh copy of the dataset at each epoch after
    the first (torch's ``persistent_workers=False``: changes made to the dataset in the main
    process are seen, ``worker_init_fn`` runs again); ``True`` keeps the workers' copies.
    With ``base_seed`` each worker knows itself (torch's ``get_worker_info()``, which
    ``guideloom_pipes.get_worker_info()`` answers with there, seed ``base_seed +
    worker_id``) and runs ``worker_init_fn(worker_id)`` first.

    ``deal="round_robin"`` sends the ``k``-th job of an epoch to worker ``k % num_workers``
    whatever their load, as torch's ``DataLoader`` deals batches (so a batch's random draws
    come from its worker's stream as there); ``torch_seeding`` seeds the workers exactly as
    torch does (:func:`~guideloom_pipes.pipes.seeding.seed_globals_as_torch`).
    """

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[Any], Any] | None,
        num_workers: int,
        context: multiprocessing.context.BaseContext,
        *,
        base_seed: int | None = None,
        worker_init_fn: Callable[[int], Any] | None = None,
        persistent: bool = True,
        deal: Literal["least_busy", "round_robin"] = "least_busy",
        torch_seeding: bool = False,
    ) -> None:
        if deal not in _DEALS:
            raise ValueError(f"deal must be one of {_DEALS}, got {deal!r}")
        self._round_robin = deal == "round_robin"
        self._turn = 0  # jobs dealt this epoch (round robin)
        self._torch_seeding = bool(torch_seeding)
        self._workers: list[_Worker] = []
        self._next_id = 0
        self._epochs = 0  # begin() calls so far
        self._persistent = persistent
        self.closed = False
        self._context = context
        self._num_workers = num_workers
        self._start_method = str(context.get_start_method())
        self._base_seed = base_seed
        self._worker_init_fn = worker_init_fn
        # what the workers hold now: a replacement of a dead one starts with the same
        self._payload: tuple[Any, Callable[[Any], Any] | None] = (dataset, collate_fn)
        _preload_forkserver(context, dataset, collate_fn)
        try:
            for index in range(num_workers):
                self._workers.append(self._start_worker(index))
        except BaseException:
            self.close()
            raise

    def _start_worker(self, index: int) -> _Worker:
        """Start worker ``index`` with the dataset and ``collate_fn`` the workers hold."""
        ring = ResultRing.create_if_supported()
        try:
            conn, child_conn = self._context.Pipe()
        except BaseException:
            if ring is not None:
                ring.close()
            raise
        setup = (
            None
            if self._base_seed is None
            else WorkerSetup(
                index,
                self._num_workers,
                self._base_seed,
                self._worker_init_fn,
                self._torch_seeding,
            )
        )
        handle = None if ring is None else ring.handle()
        dataset, collate_fn = self._payload
        process = self._context.Process(  # type: ignore[attr-defined]
            target=_process_worker,
            args=(dataset, collate_fn, child_conn, handle, setup),
            name=f"guideloom-read-{index}",
            daemon=True,
        )
        worker = _Worker(process, conn, ring)
        try:
            process.start()
        except BaseException:
            conn.close()
            if ring is not None:
                ring.close()
            raise
        finally:
            child_conn.close()
        return worker

    def _replace(self, index: int) -> None:
        """Put a new worker in the place of worker ``index``, which has ended (or whose pipe
        broke): its jobs in flight are dropped (nobody waits for them between epochs)."""
        old = self._workers[index]
        process = old.process
        if process.exitcode is None:  # (its pipe broke: it is ending; make sure)
            process.kill()
            process.join(_EXIT_SECONDS)
        how = _how_it_ended(process.exitcode)
        new = self._start_worker(index)  # (if it fails, close() ends the old one as usual)
        self._workers[index] = new
        if process.exitcode is not None:
            process.close()
        old.conn.close()
        if old.ring is not None:
            old.ring.close()
        warnings.warn(
            f"worker process {index} of the loader had exited{how}; a new one replaces it, "
            "with a fresh copy of the dataset",
            RuntimeWarning,
            stacklevel=4,
        )

    def begin(self, dataset: Any, collate_fn: Callable[[Any], Any] | None) -> None:
        """Start an epoch: replace workers that have died since the last one (killed by a
        signal, the out-of-memory killer), then, after the first epoch, without
        ``persistent``, send every other worker a new copy of ``dataset`` and
        ``collate_fn`` (pickled once), ahead of the epoch's jobs."""
        self._epochs += 1
        self._turn = 0
        fresh = self._epochs > 1 and not self._persistent
        if fresh:
            self._payload = (dataset, collate_fn)
        replaced = set()
        for index, worker in enumerate(self._workers):
            if worker.broken or worker.process.exitcode is not None:
                self._replace(index)  # (started with the current copy)
                replaced.add(index)
        if not fresh:
            return
        payload = pickle.dumps((dataset, collate_fn), protocol=5)
        for index, worker in enumerate(self._workers):
            if index in replaced:
                continue
            job = _ProcessJob(self._next_id, worker, 0)
            self._next_id += 1
            try:
                worker.conn.send_bytes(pickle.dumps((job.id, None, payload), protocol=5))
            except OSError:  # it died since the look above
                self._replace(index)
                continue
            worker.jobs.append(job)

    def _send(self, worker: _Worker, message: Any) -> None:
        try:
            worker.conn.send_bytes(pickle.dumps(message, protocol=5))
        except OSError as error:
            raise _broken(self._start_method, worker) from error

    def submit(self, arg: Any) -> _ProcessJob:
        """Send a job: a list of id arrays, or ``(batches, seeds)`` with a seed per batch."""
        batches, seeds = arg if isinstance(arg, tuple) else (arg, None)
        workers = self._workers
        if self._round_robin:
            worker = workers[self._turn % len(workers)]
            self._turn += 1
        else:
            worker = min(workers, key=lambda w: len(w.jobs))
        job = _ProcessJob(self._next_id, worker, len(batches))
        self._next_id += 1
        self._send(worker, (job.id, pack_ids(batches), seeds))
        worker.jobs.append(job)
        return job

    @property
    def num_workers(self) -> int:
        return self._num_workers

    def submit_iteration(self, index: int, request: IterateRequest) -> _ProcessJob:
        """Ask worker ``index`` for the next batch of its pass over an iterable dataset
        (its answer: one :class:`~.iteration.IterationStep`)."""
        worker = self._workers[index]
        job = _ProcessJob(self._next_id, worker, 1)
        self._next_id += 1
        self._send(worker, (job.id, ITERATE, request))
        worker.jobs.append(job)
        return job

    def release(self) -> None:
        """The epoch's reader is done with the pool (an iterator ended or closed early):
        answers of its jobs that have come are read and dropped; the rest are dropped as
        they come, before the next epoch's. A worker found dead here is replaced by the next
        :meth:`begin` (closing an iterator never fails for it)."""
        for worker in self._workers:
            try:
                while worker.jobs and worker.wait(0)[0]:
                    self._receive(worker)
            except BrokenProcessPool:  # it died: nobody needs its answers, begin() replaces it
                worker.broken = True
                worker.jobs.clear()
            for job in worker.jobs:
                job.abandoned = True

    def result(
        self, job: _ProcessJob, timeout: float | None
    ) -> tuple[list[Any], float, float | None]:
        """``(outcomes, seconds the worker took, None)`` of a chunk (workers have a core
        each: how much of the time a job spends on the CPU does not matter here)."""
        worker = job.worker
        deadline = None if timeout is None else time.monotonic() + timeout
        while not job.done:
            if not worker.wait(0)[0]:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise timed_out(timeout)  # type: ignore[arg-type]
                readable, ended = worker.wait(
                    WAKE_SECONDS if left is None else min(left, WAKE_SECONDS)
                )
                if not readable:
                    if ended:
                        raise _broken(self._start_method, worker)  # it exited, no answer
                    continue
            self._receive(worker)
        outcomes, elapsed = job.result
        return outcomes, elapsed, None

    def _receive(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv_bytes()
        except (EOFError, OSError) as error:
            raise _broken(self._start_method, worker) from error
        job_id, elapsed, places, data = pickle.loads(message)
        if job_id < 0:  # the worker could not start
            failed = load_result(data, [], None)[0]
            raise failed.raised()
        job = worker.jobs.popleft()
        assert job.id == job_id, (job.id, job_id)
        if job.abandoned:
            job.done = True
            load_result(data, places, worker.ring)  # (frees its space in the ring)
            return
        try:
            outcomes = load_result(data, places, worker.ring)
        except Exception as error:
            outcomes = [Failed(error) for _ in range(job.size)]
        job.result = (outcomes, elapsed)
        job.done = True

    def close(self) -> None:
        # Reads have no side effects, so workers still busy (a hung read, an early close)
        # are terminated rather than waited for: no process outlives its pool. One that
        # ignores SIGTERM gets SIGKILL; one that not even that ends at once (stuck in the
        # kernel, such as a read of a hung network file system) is left to the system.
        self.closed = True
        workers = self._workers
        alive = [w.process for w in workers if w.process.pid is not None]
        for process in alive:
            if process.exitcode is None:
                process.terminate()
        alive = _wait_for_exit(alive, _EXIT_SECONDS)
        for process in alive:
            process.kill()
        _wait_for_exit(alive, _EXIT_SECONDS)
        while workers:  # (an interrupted close leaves the rest for the next)
            worker = workers[0]
            process = worker.process
            if process.pid is not None and process.exitcode is not None:
                process.close()
            worker.conn.close()
            if worker.ring is not None:
                worker.ring.close()
            workers.pop(0)


#: How long a worker process has to exit after SIGTERM, and then after SIGKILL.
_EXIT_SECONDS = 2.0


def _wait_for_exit(processes: list[Any], seconds: float) -> list[Any]:
    """Wait up to ``seconds`` for ``processes`` to exit; those still running."""
    deadline = time.monotonic() + seconds
    alive = [p for p in processes if p.exitcode is None]
    while alive:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        multiprocessing.connection.wait([p.sentinel for p in alive], left)
        alive = [p for p in alive if p.exitcode is None]
    return alive
