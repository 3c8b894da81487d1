"""Reading samples from a map-style dataset a batch of ids at a time (numpy only).

What a worker of :class:`guideloom_pipes.pipes.ReadSamples` runs; a process worker imports it,
so it must stay free of torch: a worker whose dataset and ``collate_fn`` do not need torch
starts without importing it.
"""

from __future__ import annotations

import multiprocessing.util
import pickle
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.batch import Batch, accepts_batch_arrays, batch_arrays
from guideloom_pipes.datasets import batch_read_fn, open_reader
from guideloom_pipes.pipes._transport import ResultRing, dump_result

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


def read_fn_for(reader: Any, collate_fn: Callable[..., Any] | None) -> Callable[[_Ids], Any]:
    """``reader``'s batch read for ``collate_fn``: arrays (``read_arrays``) when it takes
    a :class:`~guideloom_pipes.batch.Batch`, else the list of samples."""
    return batch_read_fn(reader, arrays=accepts_batch_arrays(collate_fn))


class _ReadTask:
    """ids -> samples (-> ``collate_fn(samples)`` when one is given): one batch of work.

    :meth:`run` does a *chunk* of consecutive batches: one read of all their ids, then
    ``collate_fn`` per batch. An ``Exception`` fails its batch alone; a ``KeyboardInterrupt``
    (Ctrl-C, when the training thread runs the job) or ``SystemExit`` stops the whole job
    at once and propagates. A :class:`~guideloom_pipes.batch.Batch` from the read reaches
    ``collate_fn`` as it is when ``collate_fn`` takes arrays, else as its list of samples.
    """

    __slots__ = ("_arrays", "_collate", "_columns", "_read")

    def __init__(self, read: Callable[[_Ids], Any], collate_fn: Callable[..., Any] | None):
        self._read = read
        self._collate = collate_fn
        self._arrays = accepts_batch_arrays(collate_fn)
        # whether the read gives batches of columns (None: not known before the first read)
        self._columns: bool | None = None if self._arrays else False

    def _input(self, samples: Any) -> Any:
        if type(samples) is Batch and not self._arrays:
            return samples.samples()
        return samples

    def __call__(self, ids: _Ids) -> Any:
        if not len(ids):
            samples: Any = []
        else:
            samples = self._read(ids)
            if self._columns is None:
                self._columns = type(samples) is Batch and samples.columns is not None
            samples = self._input(samples)
        if self._collate is None:
            return samples
        return self._collate(samples)

    def _one(self, ids: _Ids) -> Any:
        try:
            return self(ids)
        except Exception as error:
            return _Failed(error)

    def run(self, batches: list[_Ids]) -> list[Any]:
        """Each batch's result, or a :class:`_Failed` for a batch whose read or collate raised.

        The ids of all batches are read with one call; if that raises (or returns the wrong
        number of samples), each batch is read alone, so an error belongs to the batch that
        caused it and the batches around it are intact. Batches of columns (a collate that
        takes arrays, a reader that makes them) are read one by one instead: arrays the size
        of one batch come from the allocator's free memory, where a chunk's arrays are fresh
        pages that the kernel faults in (a chunk of 35 batches of 8 x 2048 tokens spent 0.4
        ms in ``np.empty`` alone, more than 35 reads of one batch cost). Until the first read
        tells, batches are read one by one. Other reads (packed windows: one large
        allocation per chunk, backed by huge pages) stay one per chunk.
        """
        if len(batches) == 1 or self._columns is not False:
            return [self._one(ids) for ids in batches]
        sizes = [len(ids) for ids in batches]
        total = sum(sizes)
        try:
            samples = self._read(np.concatenate(batches)) if total else []
            if len(samples) != total:
                raise ValueError("a read returned the wrong number of samples")
        except Exception:
            return [self._one(ids) for ids in batches]
        collate = self._collate
        out: list[Any] = []
        start = 0
        for size in sizes:
            part = samples[start : start + size]
            start += size
            if type(part) is Batch:
                part = self._input(part)
            elif not isinstance(part, list):
                part = list(part)
            if collate is None:
                out.append(part)
                continue
            try:
                out.append(collate(part))
            except Exception as error:
                out.append(_Failed(error))
        return out


def _init_process_worker(dataset: Any, collate_fn: Callable[..., Any] | None) -> _ReadTask:
    """Set up a process worker: one intra-op torch thread, this process's own reader."""
    torch = sys.modules.get("torch")
    if torch is not None:
        # As torch's DataLoader does: workers share the cores, one intra-op thread each.
        torch.set_num_threads(1)
    reader, opened = open_reader(dataset)
    if opened:
        multiprocessing.util.Finalize(reader, reader.close, exitpriority=10)
    return _ReadTask(read_fn_for(reader, collate_fn), collate_fn)


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
) -> None:
    """Main function of a process worker: jobs in from ``conn``, results out through it.

    A job is ``(job_id, [ids, ...])``; its answer ``(job_id, seconds, places, pickle)``, the
    chunk's outcomes pickled by :func:`dump_result` (large buffers in the result ring). A
    failure to start is answered once with job id -1 and the error. A thread of the worker
    reads the jobs (see :func:`_receive_jobs`). The worker ends when the parent closes its end
    of ``conn`` (or terminates it).
    """
    ring = None
    try:
        try:
            task = _init_process_worker(dataset, collate_fn)
            ring = ResultRing.attach(ring_handle) if ring_handle is not None else None
        except Exception as error:
            data, _ = _dump_outcomes([_Failed(error)], None)
            conn.send_bytes(pickle.dumps((-1, 0.0, [], data), protocol=5))
            return
        jobs: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(
            target=_receive_jobs, args=(conn, jobs), name="guideloom-jobs", daemon=True
        ).start()
        while True:
            message = jobs.get()
            if message is None:
                return
            job_id, batches = pickle.loads(message)
            started = time.perf_counter()
            try:
                outcomes = task.run(batches)
            except BaseException as error:  # a KeyboardInterrupt or SystemExit of user code
                outcomes = [_Failed(error)] * len(batches)
            elapsed = time.perf_counter() - started
            data, places = _dump_outcomes(outcomes, ring)
            conn.send_bytes(pickle.dumps((job_id, elapsed, places, data), protocol=5))
            del outcomes, data
    except (KeyboardInterrupt, BrokenPipeError, ConnectionResetError):
        return  # interrupted, or the parent is gone
    finally:
        if ring is not None:
            ring.close()
