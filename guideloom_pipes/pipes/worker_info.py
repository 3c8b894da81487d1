"""Who runs this code: :func:`get_worker_info` answers in the loader's worker threads and
worker processes (numpy-only: importing it never imports torch)."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.data._utils.worker import WorkerInfo

__all__ = ["get_worker_info", "standing_in", "thread_worker_info", "thread_worker_infos"]

#: What each worker thread was told of itself (``info``; absent or ``None`` elsewhere).
_thread_info = threading.local()


def get_worker_info() -> WorkerInfo | None:
    """The worker that runs this code: torch's ``WorkerInfo``, or ``None`` outside workers.

    Ask it in a dataset's ``__getitem__``, a ``collate_fn``, a format or a
    ``worker_init_fn`` to learn which worker reads, as torch's
    ``torch.utils.data.get_worker_info()`` is asked in torch's workers:

    - **In a worker thread** (``parallel_method="thread"``, the default) it answers for that
      thread: ``id``, ``num_workers``, ``seed`` (``base_seed + id``), ``dataset`` (the
      loader's own, shared by the threads) and ``worker_method="thread"``. The training
      thread, while it reads a batch standing in for worker ``k``, gets worker ``k``'s info.
      torch's own function returns ``None`` in worker threads: its answer is one value per
      process, and threads share the process.
    - **In a worker process** (``parallel_method="process"``) it returns what torch's
      function returns there: the loader sets torch's value the way torch's ``DataLoader``
      does (the worker's copy of the dataset, ``seed = base_seed + id``), once torch is
      imported in that process (before a ``worker_init_fn`` runs). So torch's function and
      this one agree in worker processes.
    - **Anywhere else** (the training thread between batches, the prefetch thread of
      ``num_workers=0``, a program that never imported torch) it returns ``None``, or
      whatever torch's function answers where torch is imported (inside one of torch's
      own ``DataLoader`` workers, its ``WorkerInfo``).

    It never imports torch: without torch imported, and outside a worker thread, the
    answer is ``None``.
    """
    info = getattr(_thread_info, "info", None)
    if info is not None:
        return info
    if "torch" not in sys.modules:
        return None
    from torch.utils.data import get_worker_info as torch_get_worker_info

    return torch_get_worker_info()


def thread_worker_info(info: Any) -> None:
    """Set (or with ``None`` clear) what :func:`get_worker_info` answers in this thread; the
    read stage calls it in each worker thread it starts (and around a batch the calling
    thread reads as a worker)."""
    _thread_info.info = info


def thread_worker_infos(dataset: Any, num_workers: int, base_seed: int) -> list[WorkerInfo]:
    """torch's ``WorkerInfo`` of each of ``num_workers`` worker threads reading ``dataset``
    (``seed = base_seed + id``, ``worker_method="thread"`` where torch's has the field)."""
    from torch.utils.data._utils import worker as torch_worker

    fields: dict[str, Any] = {"worker_method": "thread"}
    if "worker_method" not in getattr(torch_worker.WorkerInfo, "__dataclass_fields__", {}):
        fields = {}
    return [
        torch_worker.WorkerInfo(
            id=index, num_workers=num_workers, seed=base_seed + index, dataset=dataset, **fields
        )
        for index in range(num_workers)
    ]


@contextlib.contextmanager
def standing_in(info: Any) -> Iterator[None]:
    """This thread stands in for the worker ``info`` names (a batch it reads in a worker's
    place): :func:`get_worker_info` answers ``info`` inside, then as before."""
    before = getattr(_thread_info, "info", None)
    _thread_info.info = info
    try:
        yield
    finally:
        _thread_info.info = before
