"""Reading samples from a map-style dataset a batch of ids at a time (numpy only).

This module is what a process worker of :class:`guideloom_pipes.pipes.ReadSamples` imports,
so it must stay free of torch: a worker whose dataset and ``collate_fn`` do not need torch
starts without importing it.
"""

from __future__ import annotations

import multiprocessing.util
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

_Ids = npt.NDArray[np.int64]


def _open_reader(dataset: Any) -> tuple[Any, bool]:
    """Open ``dataset`` for reading; return ``(reader, opened_here)``.

    Datasets with a ``sync_reader()`` factory (ours) get an opened reader that the caller must
    close; any other map-style dataset is its own reader.
    """
    factory = getattr(dataset, "sync_reader", None)
    if callable(factory):
        reader = factory()
        reader.open()
        return reader, True
    return dataset, False


def _batch_read_fn(reader: Any) -> Callable[[_Ids], list[Any]]:
    """The fastest way ``reader`` offers to turn an int64 id array into a list of samples."""
    read_batch = getattr(reader, "read_batch", None)
    if callable(read_batch):
        return read_batch
    getitems = getattr(reader, "__getitems__", None)
    if callable(getitems):
        return lambda ids: list(getitems(ids.tolist()))
    getitem = reader.__getitem__
    return lambda ids: [getitem(i) for i in ids.tolist()]


class _ReadTask:
    """ids -> samples (-> ``collate_fn(samples)`` when one is given): one batch of work."""

    __slots__ = ("_collate", "_read")

    def __init__(self, read: Callable[[_Ids], list[Any]], collate_fn: Callable[..., Any] | None):
        self._read = read
        self._collate = collate_fn

    def __call__(self, ids: _Ids) -> Any:
        samples = self._read(ids) if len(ids) else []
        if self._collate is None:
            return samples
        return self._collate(samples)


#: The task of this process when it is a process worker (set by ``_init_process_worker``).
_PROCESS_TASK: _ReadTask | None = None


def _init_process_worker(dataset: Any, collate_fn: Callable[..., Any] | None) -> None:
    """Initializer of a process worker: open this process's own reader of ``dataset``."""
    global _PROCESS_TASK
    torch = sys.modules.get("torch")
    if torch is not None:
        # As torch's DataLoader does: workers share the cores, one intra-op thread each.
        torch.set_num_threads(1)
    reader, opened = _open_reader(dataset)
    if opened:
        multiprocessing.util.Finalize(reader, reader.close, exitpriority=10)
    _PROCESS_TASK = _ReadTask(_batch_read_fn(reader), collate_fn)


def _process_read(ids: _Ids) -> Any:
    """Task function of a process worker."""
    if _PROCESS_TASK is None:  # pragma: no cover - the initializer always runs first
        raise RuntimeError("process worker used before its initializer ran")
    return _PROCESS_TASK(ids)
