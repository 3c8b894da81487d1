"""What runs inside a worker process: its dataset copy and reader, the jobs read from its
pipe, the results written to its ring, the small-object memory it keeps.

A worker process imports this module first, so it stays free of torch: a worker whose
dataset and ``collate_fn`` do not need torch starts without importing it.
"""

from __future__ import annotations

import importlib
import multiprocessing.util
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from guideloom_pipes.datasets import open_reader
from guideloom_pipes.pipes.seeding import seed_globals, seed_globals_as_torch
from guideloom_pipes.pipes.workers.iteration import DatasetIteration, WorkerRecord
from guideloom_pipes.pipes.workers.tasks import Failed, Ids, ReadTask
from guideloom_pipes.pipes.workers.transport import ResultRing, dump_result


class WorkerSetup(NamedTuple):
    """What a worker process is told of itself: torch's ``WorkerInfo`` fields and the user's
    ``worker_init_fn``."""

    worker_id: int
    num_workers: int
    #: The loader's base seed: the worker's seed is ``base_seed + worker_id``, as in torch.
    base_seed: int
    worker_init_fn: Callable[[int], Any] | None = None
    #: Seed the global generators exactly as torch's workers are seeded
    #: (:func:`seed_globals_as_torch`), not from independent keys of the seed.
    torch_seeding: bool = False


def _set_torch_worker_info(setup: WorkerSetup, dataset: Any) -> bool:
    """Make ``torch.utils.data.get_worker_info()`` describe this worker process, if torch is
    imported here (a worker whose dataset needs no torch never imports it); whether it is.

    Set as torch's own workers set it (its module global), so torch's function answers
    here, and ``guideloom_pipes.get_worker_info()`` answers with it."""
    if "torch" not in sys.modules:
        return False
    worker = importlib.import_module("torch.utils.data._utils.worker")
    worker._worker_info = worker.WorkerInfo(  # type: ignore[attr-defined]
        id=setup.worker_id,
        num_workers=setup.num_workers,
        seed=setup.base_seed + setup.worker_id,
        dataset=dataset,
    )
    return True


class _ProcessWorkerState:
    """A worker process's dataset copy, its reader and the read task built on them."""

    def __init__(self, setup: WorkerSetup | None) -> None:
        self.setup = setup
        self.dataset: Any = None
        self.collate_fn: Callable[..., Any] | None = None
        self.task: ReadTask | None = None
        #: The pass over an iterable dataset being read, and the token of its epoch.
        self.iteration: DatasetIteration | None = None
        self.iteration_token: Any = None
        self.info_set = False
        self._close_reader: Callable[[], Any] | None = None

    def start(self, dataset: Any, collate_fn: Callable[..., Any] | None) -> None:
        """Take a (new) copy of the dataset: close the previous reader, tell torch, run
        ``worker_init_fn``, open this process's reader."""
        if self._close_reader is not None:
            close, self._close_reader = self._close_reader, None
            self.task = None
            close()
        torch = sys.modules.get("torch")
        if torch is not None:
            # As torch's DataLoader does: workers share the cores, one intra-op thread each.
            torch.set_num_threads(1)
        setup = self.setup
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.iteration = self.iteration_token = None
        if setup is not None:
            if setup.worker_init_fn is not None:
                importlib.import_module("torch")  # the function may ask get_worker_info()
            if setup.torch_seeding:
                seed_globals_as_torch(setup.base_seed, setup.worker_id)
            else:
                seed_globals(setup.base_seed + setup.worker_id)  # as torch seeds a worker
            self.info_set = _set_torch_worker_info(setup, dataset)
            if setup.worker_init_fn is not None:
                setup.worker_init_fn(setup.worker_id)
        reader, opened = open_reader(dataset)
        if opened:
            self._close_reader = multiprocessing.util.Finalize(
                reader, reader.close, exitpriority=10
            )
        self.task = ReadTask.of_reader(reader, collate_fn, seeding="globals")

    def _tell_torch(self) -> None:
        """Tell torch who this worker is if torch was imported since the start (by the
        dataset's first read)."""
        if not self.info_set and self.setup is not None:
            self.info_set = _set_torch_worker_info(self.setup, self.dataset)

    def run(self, batches: list[Ids], seeds: list[int] | None) -> list[Any]:
        self._tell_torch()
        assert self.task is not None
        return self.task.run((batches, seeds))

    def iterate(self, request: IterateRequest) -> list[Any]:
        """The next batch of this worker's pass over its (iterable) dataset copy: a new pass
        where the request's token is a new one (it then holds where to start).

        Answers ``[IterationStep]``; ``[Failed, record]`` where reading or collating the batch
        raised (a failure of that batch alone); a failure to start the pass is raised."""
        self._tell_torch()
        if self.iteration is None or self.iteration_token != request.token:
            if request.start is None:
                raise RuntimeError(
                    f"a worker was asked for a batch of pass {request.token!r} without its "
                    "start (a job of an earlier pass was lost)"
                )
            self.iteration_token = request.token
            self.iteration = DatasetIteration(
                self.dataset,
                self.collate_fn,
                request.batch_size,
                request.drop_last,
                request.start,
                prepare=request.prepare,
            )
        iteration = self.iteration
        try:
            return [iteration.step()]
        except BaseException as error:  # this batch's: the pass goes on after it
            return [Failed(error), iteration.record]


#: A job's second field that makes it an :class:`IterateRequest` (a batch of ids otherwise).
ITERATE = "iterate"


class IterateRequest(NamedTuple):
    """A job asking a worker for the next batch of its pass over an iterable dataset."""

    #: Which pass (one per epoch): a new token starts a new ``iter(dataset)``.
    token: int
    #: Where the pass starts: sent with its first job only (None after).
    start: WorkerRecord | None
    batch_size: int | None
    drop_last: bool
    #: Applied to the dataset copy before the pass (with ``start``: the pass's first job).
    prepare: Callable[[Any], Any] | None = None


# -- a worker process's small-object memory -------------------------------------------------
#: Small-object memory a worker process keeps mapped for its batches (see
#: :func:`reserve_small_object_memory`): about three batches of 32 documents' worth (~1.3 MB
#: of ints each). 16 MiB read no faster (the documents rows, and 0.34 faults a batch
#: inline either way) and left a ``DataLoader``'s process tree 13% above torch's in PSS.
SMALL_OBJECT_RESERVE = 4 << 20
#: One block is kept alive in each region of this many bytes of the reserve: at least one
#: in every arena (CPython's arenas are 1 MiB, 256 KiB before 3.10).
_ARENA_REGION = 256 << 10
#: The largest block of CPython's small-object allocator: a ``bytes`` object of this size
#: (``sys.getsizeof``) is one block, so the reserve takes few objects to fill.
_BLOCK = 512
_BYTES_HEADER = sys.getsizeof(b"")


def reserve_small_object_memory(nbytes: int = SMALL_OBJECT_RESERVE) -> list[bytes]:
    """Keep about ``nbytes`` of CPython's small-object memory mapped in this process, free
    for any later objects; returns the few blocks that hold it (keep them alive).

    CPython takes small objects (ints, floats, short lists and dicts) from *arenas* it maps
    from the system, and unmaps an arena as soon as it is empty, keeping at most one empty
    arena. A worker whose batches decode into many small objects that die after the collate
    (32 documents that are lists of ints: ~32,000 ints, ~1.3 MB) so maps fresh arenas for
    every batch, and the kernel faults in and zeroes each of their pages again: measured,
    ~270 page faults and ~0.4 ms of a 2.5 ms batch. This fills ``nbytes`` of new arenas with
    512-byte blocks and keeps one block in every ``_ARENA_REGION`` bytes of them: those
    arenas never empty, and their free pools serve every later batch (a pool freed by one
    size of object is reused for any other). Where objects do not come from such arenas
    (another allocator, ``PYTHONMALLOC=malloc``) it only costs the time to make the blocks
    (a few milliseconds).
    """
    blocks = [bytes(_BLOCK - _BYTES_HEADER) for _ in range(nbytes // _BLOCK)]
    addresses = np.fromiter(map(id, blocks), dtype=np.int64, count=len(blocks))
    _, first = np.unique(addresses // _ARENA_REGION, return_index=True)
    return [blocks[index] for index in first.tolist()]


_reserve_lock = threading.Lock()
_reserve_holders = 0
_reserve: list[bytes] | None = None


def hold_small_object_reserve() -> Callable[[], None]:
    """Keep :func:`reserve_small_object_memory`'s reserve in this process until the function
    returned is called (once; later calls do nothing). One reserve serves every holder:
    loaders that read in the training process hold it while they are open."""
    global _reserve, _reserve_holders
    with _reserve_lock:
        if _reserve is None:
            _reserve = reserve_small_object_memory()
        _reserve_holders += 1
    released = False

    def release() -> None:
        global _reserve, _reserve_holders
        nonlocal released
        with _reserve_lock:
            if released:
                return
            released = True
            _reserve_holders -= 1
            if _reserve_holders == 0:
                _reserve = None

    return release


def _dump_outcomes(outcomes: list[Any], ring: ResultRing | None) -> tuple[bytes, list[Any]]:
    """Pickle a chunk's outcomes; an outcome that cannot be pickled fails its batch."""
    try:
        return dump_result(outcomes, ring)
    except Exception as error:
        try:
            failed = [Failed(error) for _ in outcomes]
            return pickle.dumps(failed, protocol=5), []
        except Exception:
            replacement = RuntimeError(f"{type(error).__name__}: {error}")
            failed = [Failed(replacement) for _ in outcomes]
            return pickle.dumps(failed, protocol=5), []


def pack_ids(batches: list[Ids]) -> tuple[bytes, list[int]]:
    """A job's batches of ids as they travel to a process worker: the int64 ids of all of
    them as bytes, and each batch's length. (Pickling the arrays themselves costs 10 us a
    job here, and 7 us to load; the bytes 1 us each way.)"""
    flat = batches[0] if len(batches) == 1 else np.concatenate(batches)
    return flat.astype(np.int64, copy=False).tobytes(), [len(ids) for ids in batches]


def unpack_ids(data: bytes, sizes: list[int]) -> list[Ids]:
    """The batches :func:`pack_ids` packed: writable int64 arrays of their own."""
    flat = np.frombuffer(data, dtype=np.int64).copy()
    if len(sizes) == 1:
        return [flat]
    out = []
    start = 0
    for size in sizes:
        out.append(flat[start : start + size])
        start += size
    return out


def _receive_jobs(conn: Any, jobs: queue.SimpleQueue[bytes | None]) -> None:
    """A worker's job reader: takes job messages off the pipe as soon as they come.

    So the parent's writes never wait on the worker's main thread, which may itself be
    waiting to write an answer the parent has not read yet: neither side can block the other.
    """
    try:
        while True:
            jobs.put(conn.recv_bytes())
    except (EOFError, OSError):
        jobs.put(None)  # the parent closed its end (or is gone)


def _end_at_sigterm() -> None:
    """A forked worker inherits the parent's Python signal handlers: a trainer's SIGTERM
    handler (Lightning's notes the signal and goes on) would keep it alive through the
    pool's terminate() until the SIGKILL after it. A worker ends at SIGTERM."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _answer(
    conn: Any, ring: ResultRing | None, job_id: int, started: float, outcomes: list[Any]
) -> None:
    """Send a job's answer: the seconds since ``started`` and its outcomes (see
    :func:`_process_worker`)."""
    elapsed = time.perf_counter() - started
    data, places = _dump_outcomes(outcomes, ring)
    conn.send_bytes(pickle.dumps((job_id, elapsed, places, data), protocol=5))


def _answer_iteration(
    conn: Any, ring: ResultRing | None, state: _ProcessWorkerState, job_id: int, request: Any
) -> None:
    """Answer an :class:`IterateRequest`: the next batch of the worker's pass."""
    started = time.perf_counter()
    try:
        outcomes = state.iterate(request)
    except BaseException as error:  # (a failure to start the pass; user code's Ctrl-C)
        outcomes = [Failed(error)]
    _answer(conn, ring, job_id, started, outcomes)


def _process_worker(
    dataset: Any,
    collate_fn: Callable[..., Any] | None,
    conn: Any,
    ring_handle: Any,
    setup: WorkerSetup | None = None,
) -> None:
    """Main function of a process worker: jobs in from ``conn``, results out through it.

    A job is ``(job_id, pack_ids([ids, ...]), seeds)`` (``seeds``: one per batch, or
    ``None``); its answer ``(job_id, seconds, places, pickle)``, the chunk's outcomes pickled by
    :func:`dump_result` (large buffers in the result ring). ``(job_id, None, payload)`` hands
    the worker a new copy of the dataset (``payload`` pickles ``(dataset, collate_fn)``: a new
    epoch without persistent workers); it is answered with no outcomes. ``(job_id, ITERATE,
    IterateRequest)`` asks for the next batch of the worker's pass over an iterable dataset,
    answered with one outcome, an :class:`~.iteration.IterationStep`. A failure to start
    (or to take a new dataset) is answered once with job id -1 and the error, and the worker
    exits. A thread of the worker reads the jobs (see :func:`_receive_jobs`). The worker ends
    when the parent closes its end of ``conn`` (or terminates it).
    """
    _end_at_sigterm()
    ring = None
    state = _ProcessWorkerState(setup)
    # held for the worker's life: its batches' small objects reuse this memory (a worker
    # forked from a process that holds one keeps that one: a second would only add 16 MiB)
    release_reserve = hold_small_object_reserve()
    try:
        try:
            state.start(dataset, collate_fn)
            ring = ResultRing.attach(ring_handle) if ring_handle is not None else None
        except Exception as error:
            data, _ = _dump_outcomes([Failed(error)], None)
            conn.send_bytes(pickle.dumps((-1, 0.0, [], data), protocol=5))
            return
        del dataset
        jobs: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(
            target=_receive_jobs, args=(conn, jobs), name="guideloom-jobs", daemon=True
        ).start()
        while True:
            message = jobs.get()
            if message is None:
                return
            job_id, packed, extra = pickle.loads(message)
            if packed == ITERATE:
                _answer_iteration(conn, ring, state, job_id, extra)
                continue
            if packed is None:  # a new copy of the dataset
                try:
                    state.start(*pickle.loads(extra))
                except Exception as error:
                    data, _ = _dump_outcomes([Failed(error)], None)
                    conn.send_bytes(pickle.dumps((-1, 0.0, [], data), protocol=5))
                    return
                data, _ = _dump_outcomes([], None)
                conn.send_bytes(pickle.dumps((job_id, 0.0, [], data), protocol=5))
                continue
            started = time.perf_counter()
            batches = unpack_ids(*packed)
            try:
                outcomes = state.run(batches, extra)
            except BaseException as error:  # a KeyboardInterrupt or SystemExit of user code
                outcomes = [Failed(error) for _ in batches]
            _answer(conn, ring, job_id, started, outcomes)
            del outcomes
    except (KeyboardInterrupt, BrokenPipeError, ConnectionResetError):
        return  # interrupted, or the parent is gone
    finally:
        release_reserve()
        if ring is not None:
            ring.close()
