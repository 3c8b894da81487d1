"""Datasets, collate functions and reference orders for the loader and pipes tests.

numpy only: process workers unpickle these, and a worker that needs no torch starts in a
fraction of the time.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import numpy as np

from guideloom_pipes.shuffle import FeistelPermutation


class Ids:
    """A map-style dataset of ``n`` samples; sample ``i`` is ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(f"sample {index} out of range")
        return int(index)


def ids_collate(samples: list[Any]) -> list[int]:
    """Collate to the plain list of sample ids (works for ``[]`` too)."""
    return [int(sample) for sample in samples]


def stream_ids_collate(samples: list[dict[str, np.ndarray]]) -> list[int]:
    """Sample ids of ``StreamDataset(fixture, 5)`` windows: token ``k`` is ``k``."""
    return [int(sample["tokens"][0]) // 5 for sample in samples]


class ReadError(Exception):
    """What :class:`FailsAt` raises."""


class FailsAt(Ids):
    """Raises :class:`ReadError` when sample ``bad`` is read."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            raise ReadError(f"cannot read sample {index}")
        return super().__getitem__(index)


class KillsItsWorker(Ids):
    """SIGKILLs the worker process that reads sample ``bad`` (never the parent)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad
        self.parent = os.getpid()

    def __getitem__(self, index: int) -> int:
        if index == self.bad and os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


class HangsInWorker(Ids):
    """Blocks forever when a worker process reads sample ``bad`` (a hung file system)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad
        self.parent = os.getpid()

    def __getitem__(self, index: int) -> int:
        if index == self.bad and os.getpid() != self.parent:
            threading.Event().wait()
        return super().__getitem__(index)


def expected_batches(
    n: int,
    *,
    world_size: int,
    local_batch_size: int,
    rank: int,
    drop_last: bool,
    shuffle_seed: int | None,
    epoch: int = 0,
    offset: int = 0,
) -> list[list[int]]:
    """SPEC §5's order written out plainly: one rank's batches of one epoch from ``offset``."""
    global_batch = world_size * local_batch_size
    left = n - offset
    if left <= 0:
        steps = 0
    elif drop_last:
        steps = left // global_batch
    else:
        steps = -(-left // global_batch)
    perm = None if shuffle_seed is None else FeistelPermutation.for_epoch(n, shuffle_seed, epoch)
    batches = []
    for step in range(steps):
        positions = [
            offset + step * global_batch + rank + world_size * j for j in range(local_batch_size)
        ]
        ids = [p if perm is None else int(perm(p)) for p in positions if p < n]
        batches.append(ids)
    return batches


class _FailingReader:
    def __init__(self, n: int, parent: int) -> None:
        self.n = n
        self.parent = parent

    def open(self) -> None:
        if os.getpid() != self.parent:
            raise ReadError("cannot open the dataset in a worker")

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        return self.n

    def read_batch(self, ids: np.ndarray) -> list[int]:
        return [int(i) for i in ids]


class OpensOnlyInTheParent(Ids):
    """A dataset with a reader whose ``open()`` raises :class:`ReadError` in a worker."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.parent = os.getpid()

    def sync_reader(self) -> _FailingReader:
        return _FailingReader(self.n, self.parent)


def lock_collate(samples: list[Any]) -> Any:
    """A batch that cannot be pickled (a lock)."""
    return threading.Lock()


def big_collate(samples: list[Any]) -> np.ndarray:
    """A 2 MiB batch (more than a pipe holds)."""
    return np.full(1 << 18, int(samples[0]), dtype=np.int64)
