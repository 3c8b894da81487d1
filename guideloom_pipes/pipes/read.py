"""Sample reading: batches of sample ids -> lists of samples (or collated batches), in order."""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.context
import operator
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from torchdata.nodes import BaseNode

from guideloom_pipes._reading import _batch_read_fn, _open_reader, _ReadTask
from guideloom_pipes.pipes._pool import _ProcessPool, _ThreadPool
from guideloom_pipes.pipes.positions import Positions

__all__ = ["ReadSamples"]

_I64 = npt.NDArray[np.int64]
_METHODS = ("thread", "process")
_START_METHODS = ("spawn", "forkserver", "fork")


def _to_ids(item: Any) -> _I64:
    """Sample ids of one batch: an int64 array, :class:`Positions` (unshuffled) or ints."""
    if type(item) is np.ndarray and item.dtype == np.int64:
        return item
    if isinstance(item, Positions):
        return item.positions
    return np.asarray(item, dtype=np.int64).reshape(-1)


def _mp_context(value: Any) -> multiprocessing.context.BaseContext:
    if value is None:
        return multiprocessing.get_context("spawn")
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
    opens its own reader of the pickled ``dataset``), at most ``max_in_flight`` ahead, and
    delivered in order. Workers take batches oldest first; with threads, a batch that no
    worker has started when it is needed (all busy) is read by the calling thread itself
    rather than waited for. Workers start on ``reset()`` and stop on :meth:`close` or the
    next ``reset()``. An exception raised by a read or ``collate_fn`` reaches the caller with its
    type (and, for threads, its traceback; processes attach the remote traceback as the
    cause); a worker process that dies raises ``BrokenProcessPool``.

    The state is that of ``source`` as of the last batch delivered: batches read ahead do
    not count.

    Args:
        source: Emits batches of sample ids.
        dataset: A map-style dataset (``len`` and ``[i]``; or ours, with ``sync_reader()``).
        num_workers: Worker threads or processes; 0 reads in the calling thread.
        method: ``"thread"`` or ``"process"``.
        multiprocessing_context: Start method (``"spawn"`` default, ``"forkserver"``,
            ``"fork"``) or a context object, for ``method="process"``.
        collate_fn: Applied to each batch's samples in the worker; ``None`` returns them.
        max_in_flight: Batches submitted to workers ahead of the caller (``2 *
            num_workers`` by default).
        timeout: Seconds to wait for a worker's batch before raising ``RuntimeError``;
            ``None`` waits forever.
        reader: An already open reader of ``dataset`` to use in this process (not closed by
            this stage); by default the stage opens one on first use and closes it in
            :meth:`close`.
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
    ) -> None:
        super().__init__()
        self.source = source
        self.dataset = dataset
        if isinstance(num_workers, bool):
            raise TypeError(f"num_workers must be an int, got {num_workers!r}")
        self.num_workers = operator.index(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
        self.method = method
        self._mp = _mp_context(multiprocessing_context) if method == "process" else None
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        self.collate_fn = collate_fn
        if max_in_flight is None:
            max_in_flight = 2 * self.num_workers
        elif isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int):
            raise TypeError(f"max_in_flight must be an int or None, got {max_in_flight!r}")
        elif max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self.timeout = timeout
        self._reader = reader
        self._owns_reader = False
        self._task: _ReadTask | None = None
        self._pool: _ThreadPool | _ProcessPool | None = None
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()
        self._snapshot: Any = None
        self._end_snapshot: Any = None
        self._source_done = False
        self._source_error: BaseException | None = None

    # -- reader ---------------------------------------------------------------------------

    def open(self) -> None:
        """Open this process's reader of the dataset now (otherwise the first reset does)."""
        if self._reader is None:
            self._reader, self._owns_reader = _open_reader(self.dataset)
        if self._task is None:
            self._task = _ReadTask(_batch_read_fn(self._reader), self.collate_fn)

    def close(self) -> None:
        """Stop the workers and close the reader this stage opened (it can be reset again)."""
        self._stop_workers()
        if self._owns_reader and self._reader is not None:
            reader, self._reader, self._task = self._reader, None, None
            self._owns_reader = False
            reader.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._stop_workers()

    # -- BaseNode -------------------------------------------------------------------------

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._stop_workers()
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
        else:
            self.source.reset()
        if self.num_workers == 0 or self.method == "thread":
            self.open()
        if self.num_workers == 0:
            return
        self._snapshot = self.source.state_dict()
        self._end_snapshot = None
        self._source_done = False
        self._source_error = None
        if self.method == "thread":
            assert self._task is not None
            self._pool = _ThreadPool(self._task, self.num_workers)
        else:
            assert self._mp is not None
            self._pool = _ProcessPool(self.dataset, self.collate_fn, self.num_workers, self._mp)
        self._fill()

    def next(self) -> Any:
        if self.num_workers == 0:
            task = self._task
            assert task is not None
            return task(_to_ids(next(self.source)))
        self._fill()
        if not self._pending:
            if self._source_error is not None:
                error, self._source_error = self._source_error, None
                raise error
            if self._end_snapshot is not None:
                self._snapshot = self._end_snapshot
            raise StopIteration()
        handle, snapshot = self._pending.popleft()
        assert self._pool is not None
        result = self._pool.result(handle, self.timeout)
        self._snapshot = snapshot
        return result

    def get_state(self) -> dict[str, Any]:
        if self.num_workers == 0:
            return {self.SOURCE_KEY: self.source.state_dict()}
        return {self.SOURCE_KEY: self._snapshot}

    # -- workers --------------------------------------------------------------------------

    def _fill(self) -> None:
        """Submit batches from the source until ``max_in_flight`` are pending."""
        pool = self._pool
        if pool is None:
            return
        pending = self._pending
        source = self.source
        while not self._source_done and len(pending) < self.max_in_flight:
            try:
                ids = _to_ids(next(source))
            except StopIteration:
                self._source_done = True
                self._end_snapshot = source.state_dict()
                break
            except Exception as error:
                # Raised once the batches before it are delivered.
                self._source_done = True
                self._source_error = error
                break
            pending.append((pool.submit(ids), source.state_dict()))

    def _stop_workers(self) -> None:
        pool, self._pool = self._pool, None
        self._pending.clear()
        if pool is not None:
            pool.close()
