"""Reading samples from a map-style dataset a batch of ids at a time (numpy only).

What a worker of :class:`guideloom_pipes.pipes.ReadSamples` runs; a process worker imports it,
so it must stay free of torch: a worker whose dataset and ``collate_fn`` do not need torch
starts without importing it.
"""

from __future__ import annotations

import importlib
import multiprocessing.util
import pickle
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from guideloom_pipes.batch import Batch, LazyRows, accepts_batch_arrays, batch_arrays
from guideloom_pipes.datasets import (
    DatasetReaderBase,
    WindowBuffers,
    batch_read_fn,
    open_reader,
)
from guideloom_pipes.pipes._transport import ResultRing, dump_result
from guideloom_pipes.pipes.seeding import Seeding, seed_globals, seeded

_Ids = npt.NDArray[np.int64]


class _Failed:
    """A batch's outcome when reading or collating it raised ``error``.

    ``remote`` is the formatted traceback when the error happened in a worker process
    (its traceback object does not survive pickling).
    """

    __slots__ = ("error", "remote")

    def __init__(self, error: BaseException, remote: str | None = None) -> None:
        self.error = error
        self.remote = remote

    def __reduce__(self) -> tuple[Any, ...]:
        remote = self.remote
        if remote is None:
            remote = "".join(
                traceback.format_exception(type(self.error), self.error, self.error.__traceback__)
            )
        return (_Failed, (self.error, remote))


class _RemoteTraceback(Exception):
    """The cause attached to an error re-raised from a worker process: its traceback there."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


@batch_arrays
def keep_batch_arrays(samples: Any) -> Any:
    """The collate of a stage that hands batches on uncollated, as arrays where the reader
    gives them (a :class:`~guideloom_pipes.batch.Batch`), for a collate further on."""
    return samples


def read_fn_for(
    reader: Any, collate_fn: Callable[..., Any] | None, out: WindowBuffers | None = None
) -> Callable[[_Ids], Any]:
    """``reader``'s batch read for ``collate_fn``: arrays (``read_arrays``) when it takes
    a :class:`~guideloom_pipes.batch.Batch`, else the samples (``read_rows``: possibly
    :class:`~guideloom_pipes.batch.LazyRows`, which :class:`_ReadTask` slices per batch).
    ``out``: where the arrays read their windows (a loader's pinned ring), for arrays only."""
    return batch_read_fn(reader, arrays=accepts_batch_arrays(collate_fn), out=out, rows=True)


def read_many_fn_for(
    reader: Any, collate_fn: Callable[..., Any] | None, out: WindowBuffers | None = None
) -> Callable[[list[_Ids]], list[Any]] | None:
    """One of our readers' ``read_arrays_many`` (a chunk of batches read and packed
    together, each a :class:`~guideloom_pipes.batch.Batch` of its own) where ``collate_fn``
    takes arrays and no ``out`` buffers are given, else None."""
    if out is not None or not accepts_batch_arrays(collate_fn):
        return None
    if not isinstance(reader, DatasetReaderBase):
        return None
    read_many = getattr(reader, "read_arrays_many", None)
    return read_many if callable(read_many) else None


class _Deferred:
    """A batch of a chunk read whose samples are made, and collated, only when the batch
    is delivered (:meth:`_ReadTask.run` with ``defer=True``): rows ``begin .. end - 1`` of
    the chunk's :class:`~guideloom_pipes.batch.LazyRows`, under the batch's seed if any."""

    __slots__ = ("begin", "end", "rows", "seed", "task")

    def __init__(
        self, task: _ReadTask, rows: LazyRows, begin: int, end: int, seed: int | None
    ) -> None:
        self.task = task
        self.rows = rows
        self.begin = begin
        self.end = end
        self.seed = seed

    def finish(self) -> Any:
        """The batch's result (raises what its decode or collate raises)."""
        return self.task._collated_under(self.rows[self.begin : self.end], self.seed)


class _ReadTask:
    """ids -> samples (-> ``collate_fn(samples)`` when one is given): one batch of work.

    :meth:`run` does a *chunk* of consecutive batches: one read of all their ids, then
    ``collate_fn`` per batch. An ``Exception`` fails its batch alone; a ``KeyboardInterrupt``
    (Ctrl-C, when the training thread runs the job) or ``SystemExit`` stops the whole job
    at once and propagates. A :class:`~guideloom_pipes.batch.Batch` from the read reaches
    ``collate_fn`` as it is when ``collate_fn`` takes arrays, else as its list of samples.

    With a seed per batch (``seeds`` of :meth:`run`, ``seed`` of a call) each batch is read
    and collated under its seed (see :func:`seeded`, ``seeding`` says how). A reader with
    ``read_batch`` (ours: it draws no random numbers) still reads a chunk with one call and
    only the collates run under the seeds; any other reader (a user's ``__getitem__``) reads
    each batch under its seed.
    """

    __slots__ = (
        "_arrays",
        "_collate",
        "_columns",
        "_read",
        "_read_collated",
        "_read_is_ours",
        "_read_many",
        "seeding",
    )

    def __init__(
        self,
        read: Callable[[_Ids], Any],
        collate_fn: Callable[..., Any] | None,
        *,
        read_many: Callable[[list[_Ids]], list[Any]] | None = None,
        read_collated: Callable[[_Ids], Any] | None = None,
        read_is_ours: bool = True,
        seeding: Seeding = "local",
    ):
        self._read = read
        self._read_many = read_many
        # read and collate in one step, where that applies (None for a batch it does not
        # read: the read and collate above take it); see pipes.collate.collated_read_fn
        self._read_collated = read_collated
        self._collate = collate_fn
        self._arrays = accepts_batch_arrays(collate_fn)
        # whether the read gives batches of columns (None: not known before the first read)
        self._columns: bool | None = None if self._arrays else False
        self._read_is_ours = read_is_ours
        self.seeding: Seeding = seeding

    def _input(self, samples: Any) -> Any:
        if type(samples) is Batch and not self._arrays:
            return samples.samples()
        if type(samples) is LazyRows:
            return samples[:]
        return samples

    def _collated(self, samples: list[Any]) -> Any:
        return samples if self._collate is None else self._collate(samples)

    def __call__(self, ids: _Ids, seed: int | None = None) -> Any:
        if seed is not None:
            with seeded(seed, self.seeding):
                return self._plain(ids)
        return self._plain(ids)

    def _plain(self, ids: _Ids) -> Any:
        read_collated = self._read_collated
        if read_collated is not None:
            batch = read_collated(ids)
            if batch is not None:
                return batch
        if not len(ids):
            samples: Any = []
        else:
            samples = self._read(ids)
            if self._columns is None:
                self._columns = type(samples) is Batch and samples.columns is not None
            samples = self._input(samples)
        return self._collated(samples)

    @property
    def reads_many(self) -> bool:
        """Whether a chunk of batches of columns is read with one call (see :meth:`run`)."""
        return bool(self._columns) and self._read_many is not None

    def _one(self, ids: _Ids, seed: int | None = None) -> Any:
        try:
            return self(ids, seed)
        except Exception as error:
            return _Failed(error)

    def run(
        self, job: list[_Ids] | tuple[list[_Ids], list[int] | None], defer: bool = False
    ) -> list[Any]:
        """Each batch's result, or a :class:`_Failed` for a batch whose read or collate raised.

        ``job`` is the list of the batches' id arrays, or ``(batches, seeds)`` with a seed
        per batch (or ``None``). The ids of all batches are read with one call (unless each
        batch must be read under its seed); if that raises (or returns the wrong number of
        samples), each batch is read alone, so an error belongs to the batch that caused it
        and the batches around it are intact. Batches of columns (a collate that takes
        arrays, a reader that makes them) are read one by one instead: arrays the size of one
        batch come from the allocator's free memory, where a chunk's arrays are fresh pages
        that the kernel faults in (a chunk of 35 batches of 8 x 2048 tokens spent 0.4 ms in
        ``np.empty`` alone, more than 35 reads of one batch cost). Until the first read
        tells, batches are read one by one. A reader that packs batches of columns together
        (``read_many``: packed windows, each batch in a block of its own recycled memory)
        reads the chunk with one call (:meth:`_run_many`). Other reads stay one per chunk.

        A read that gives :class:`~guideloom_pipes.batch.LazyRows` (windows of a stream
        with metadata) makes each batch's samples from its slice, just before its collate;
        with ``defer=True`` not even then: the batch is a :class:`_Deferred`, made and
        collated by its :meth:`_Deferred.finish` when the caller delivers it (for the
        calling thread's own chunks: the batches held waiting then keep only the read's
        arrays and bytes, no objects that the garbage collector tracks).
        """
        batches, seeds = job if isinstance(job, tuple) else (job, None)
        if len(batches) > 1 and self.reads_many and (seeds is None or self._read_is_ours):
            return self._run_many(batches, seeds)
        if (
            len(batches) == 1
            or self._columns is not False
            or (seeds is not None and not self._read_is_ours)
        ):
            return self._each_alone(batches, seeds)
        sizes = [len(ids) for ids in batches]
        total = sum(sizes)
        try:
            samples = self._read(np.concatenate(batches)) if total else []
            if len(samples) != total:
                raise ValueError("a read returned the wrong number of samples")
        except Exception:
            return self._each_alone(batches, seeds)
        collate = self._collate
        out: list[Any] = []
        start = 0
        lazy = samples if type(samples) is LazyRows and defer else None
        for index, size in enumerate(sizes):
            begin, start = start, start + size
            if lazy is not None:
                seed = None if seeds is None else seeds[index]
                out.append(_Deferred(self, lazy, begin, start, seed))
                continue
            try:
                part = samples[begin:start]  # (rows of LazyRows are decoded here)
            except Exception as error:
                out.append(_Failed(error))
                continue
            if type(part) is Batch:
                part = self._input(part)
            elif not isinstance(part, list):
                part = list(part)
            if collate is None:
                out.append(part)
                continue
            out.append(self._collate_one(part, None if seeds is None else seeds[index]))
        return out

    def _run_many(self, batches: list[_Ids], seeds: list[int] | None) -> list[Any]:
        """:meth:`run` for batches of columns read together (``read_many``: one read of
        their windows, each batch its own arrays); only the collates run under the seeds.
        If the read raises, each batch is read alone (its error then belongs to it)."""
        reads: list[Any] | None = None
        if all(len(ids) for ids in batches):
            try:
                reads = self._read_many(batches)  # type: ignore[misc]
                if len(reads) != len(batches):
                    reads = None
            except Exception:
                reads = None
        if reads is None:
            return self._each_alone(batches, seeds)
        if seeds is None:
            return [self._collate_one(samples, None) for samples in reads]
        return [self._collate_one(samples, seed) for samples, seed in zip(reads, seeds)]

    def _each_alone(self, batches: list[_Ids], seeds: list[int] | None) -> list[Any]:
        """Each batch read and collated by itself (under its seed): an error is its own."""
        if seeds is None:
            return [self._one(ids) for ids in batches]
        return [self._one(ids, seed) for ids, seed in zip(batches, seeds, strict=True)]

    def _collated_under(self, samples: Any, seed: int | None) -> Any:
        """:meth:`_collated` under ``seed`` (see :func:`seeded`), if one is given."""
        if seed is None:
            return self._collated(samples)
        with seeded(seed, self.seeding):
            return self._collated(samples)

    def _collate_one(self, samples: Any, seed: int | None) -> Any:
        """:meth:`_collated_under`, or a :class:`_Failed` for the ``Exception`` it raises."""
        try:
            return self._collated_under(samples, seed)
        except Exception as error:
            return _Failed(error)


class WorkerSetup(NamedTuple):
    """What a worker process is told of itself: torch's ``WorkerInfo`` fields and the user's
    ``worker_init_fn``."""

    worker_id: int
    num_workers: int
    #: The loader's base seed: the worker's seed is ``base_seed + worker_id``, as in torch.
    base_seed: int
    worker_init_fn: Callable[[int], Any] | None = None


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
        self.task: _ReadTask | None = None
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
        if setup is not None:
            if setup.worker_init_fn is not None:
                importlib.import_module("torch")  # the function may ask get_worker_info()
            seed_globals(setup.base_seed + setup.worker_id)  # as torch seeds a worker
            self.info_set = _set_torch_worker_info(setup, dataset)
            if setup.worker_init_fn is not None:
                setup.worker_init_fn(setup.worker_id)
        reader, opened = open_reader(dataset)
        if opened:
            self._close_reader = multiprocessing.util.Finalize(
                reader, reader.close, exitpriority=10
            )
        read_is_ours = callable(getattr(reader, "read_batch", None))
        self.task = _ReadTask(
            read_fn_for(reader, collate_fn),
            collate_fn,
            read_many=read_many_fn_for(reader, collate_fn),
            read_is_ours=read_is_ours,
            seeding="globals",
        )

    def run(self, batches: list[_Ids], seeds: list[int] | None) -> list[Any]:
        if not self.info_set and self.setup is not None:
            # torch imported since the start (by the dataset's first read): tell it now
            self.info_set = _set_torch_worker_info(self.setup, self.dataset)
        assert self.task is not None
        return self.task.run((batches, seeds))


# -- a worker process's small-object memory -------------------------------------------------
#: Small-object memory a worker process keeps mapped for its batches (see
#: :func:`reserve_small_object_memory`).
SMALL_OBJECT_RESERVE = 16 << 20
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
            failed = [_Failed(error)] * len(outcomes)
            return pickle.dumps(failed, protocol=5), []
        except Exception:
            replacement = RuntimeError(f"{type(error).__name__}: {error}")
            return pickle.dumps([_Failed(replacement)] * len(outcomes), protocol=5), []


def pack_ids(batches: list[_Ids]) -> tuple[bytes, list[int]]:
    """A job's batches of ids as they travel to a process worker: the int64 ids of all of
    them as bytes, and each batch's length. (Pickling the arrays themselves costs 10 us a
    job here, and 7 us to load; the bytes 1 us each way.)"""
    flat = batches[0] if len(batches) == 1 else np.concatenate(batches)
    return flat.astype(np.int64, copy=False).tobytes(), [len(ids) for ids in batches]


def unpack_ids(data: bytes, sizes: list[int]) -> list[_Ids]:
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
    epoch without persistent workers); it is answered with no outcomes. A failure to start
    (or to take a new dataset) is answered once with job id -1 and the error, and the worker
    exits. A thread of the worker reads the jobs (see :func:`_receive_jobs`). The worker ends
    when the parent closes its end of ``conn`` (or terminates it).
    """
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
            data, _ = _dump_outcomes([_Failed(error)], None)
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
            if packed is None:  # a new copy of the dataset
                try:
                    state.start(*pickle.loads(extra))
                except Exception as error:
                    data, _ = _dump_outcomes([_Failed(error)], None)
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
                outcomes = [_Failed(error)] * len(batches)
            elapsed = time.perf_counter() - started
            data, places = _dump_outcomes(outcomes, ring)
            conn.send_bytes(pickle.dumps((job_id, elapsed, places, data), protocol=5))
            del outcomes, data
    except (KeyboardInterrupt, BrokenPipeError, ConnectionResetError):
        return  # interrupted, or the parent is gone
    finally:
        release_reserve()
        if ring is not None:
            ring.close()
