"""torch's DataPipes (``IterDataPipe``, ``MapDataPipe``) in a
:class:`~guideloom_pipes.DataLoader`, treated as torch's own ``DataLoader`` treats them:

- an ``IterDataPipe``'s random operations (``shuffle()``) are seeded at each epoch from one
  shared seed, drawn from the loader's ``generator`` (else torch's global generator) before
  the epoch's base seed, and broadcast from rank 0 where ``torch.distributed`` is initialized,
  so every worker and every rank shuffles alike;
- its ``sharding_filter()`` keeps, in each worker, that worker's share: worker ``k`` of ``W``
  on rank ``r`` of ``R`` is instance ``k * R + r`` of ``W * R`` (without workers, instance
  ``r`` of ``R``), applied before the user's ``worker_init_fn`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.graph_settings import apply_random_seed, apply_sharding

__all__ = [
    "SeedDataPipe",
    "distributed_settings",
    "draw_shared_seed",
    "is_datapipe",
    "shard_in_worker",
    "shard_inline",
]


def is_datapipe(dataset: Any) -> bool:
    """Whether ``dataset`` is a DataPipe (sharded in workers, as torch shards them)."""
    return isinstance(dataset, (IterDataPipe, MapDataPipe))


def distributed_settings() -> tuple[int, int]:
    """``(world size, rank)`` of ``torch.distributed`` where it is initialized, else ``(1, 0)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def draw_shared_seed(generator: torch.Generator | None, group: Any = None) -> int:
    """torch's draw of an epoch's shared DataPipe seed from ``generator`` (None: torch's
    global one), rank 0's on every rank of ``group`` (a gloo process group) where given."""
    seed = torch.empty((), dtype=torch.int64).random_(generator=generator)
    if group is not None:
        dist.broadcast(seed, src=0, group=group)
    return int(seed.item())


def shard_inline(datapipe: Any) -> None:
    """Without workers: ``datapipe`` sharded to this rank's share, as torch shards it."""
    apply_sharding(datapipe, *distributed_settings())


class SeedDataPipe:
    """Seeds an ``IterDataPipe``'s random operations from ``seed`` before a pass (as torch
    does at each epoch), in the training process or a worker's copy; picklable."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, datapipe: Any) -> Any:
        generator = torch.Generator()
        generator.manual_seed(self.seed)
        return apply_random_seed(datapipe, generator)

    def __repr__(self) -> str:
        return f"SeedDataPipe({self.seed})"


def shard_in_worker(
    worker_init_fn: Callable[[int], Any] | None, world_size: int, rank: int, worker_id: int
) -> None:
    """A worker's start for a DataPipe (``functools.partial`` of the first three): its copy
    sharded to the worker's share across workers and ranks, then ``worker_init_fn``."""
    info = torch.utils.data.get_worker_info()
    if info is None:  # (set before a worker's init, always)
        raise RuntimeError("shard_in_worker runs in a DataLoader worker process only")
    datapipe: Any = info.dataset
    apply_sharding(datapipe, info.num_workers * world_size, worker_id * world_size + rank)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)
