"""Datasets and worker_init_fns that draw random numbers or ask who their worker is, for the
worker randomness tests (module level, so process workers can unpickle them)."""

from __future__ import annotations

import os
import random
import threading
from typing import Any

import numpy as np
import torch

from guideloom_pipes.pipes import batch_rng, get_worker_info


class Draws(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample ``i`` is ``(i, a torch draw, a numpy draw, a random draw)`` from the global
    generators, as random crops and noise in ``__getitem__`` draw."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, float, float, float]:
        return (index, float(torch.rand(())), float(np.random.rand()), random.random())


class BatchDraws(Draws):
    """Like :class:`Draws`, from the batch's own generators (exact with threads too)."""

    def __getitem__(self, index: int) -> tuple[int, float, float, float]:
        rng = batch_rng()
        assert rng is not None
        return (
            index,
            float(torch.rand((), generator=rng.torch)),
            float(rng.numpy.random()),
            rng.random.random(),
        )


def draws_collate(samples: list[Any]) -> list[Any]:
    """The samples as they are, plus one draw of the collate itself."""
    return [*samples, ("collate", float(torch.rand(())))]


class WhoReads(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample ``i`` is ``(i, worker info fields, pid, epoch, tag)``: ``epoch`` is set in the
    main process (``set_epoch``), ``tag`` by :func:`tag_worker` in the worker's copy. The
    fields are what ``guideloom_pipes.get_worker_info()`` answers (in threads and processes)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0
        self.tag: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        info = get_worker_info()
        fields = None
        if info is not None:
            same = info.dataset is self
            fields = (info.id, info.num_workers, info.seed, same, info.worker_method)
        return (index, fields, os.getpid(), self.epoch, tuple(self.tag))


def _fields(info: Any) -> tuple[int, int, int] | None:
    return None if info is None else (info.id, info.num_workers, info.seed)


class BothAsk(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample ``i`` is ``(i, torch's worker info fields, ours)``: what
    ``torch.utils.data.get_worker_info()`` and ``guideloom_pipes.get_worker_info()`` answer
    (``(id, num_workers, seed)`` or ``None``) where the sample is read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return (index, _fields(torch.utils.data.get_worker_info()), _fields(get_worker_info()))


def tag_worker(worker_id: int) -> None:
    """A worker_init_fn: appends the worker id to its copy of the dataset's ``tag``."""
    info = get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.tag.append(worker_id)


class InitCalls:
    """A worker_init_fn for thread workers that records ``(worker_id, thread, info)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        with self._lock:
            self.calls.append((worker_id, threading.get_ident(), info))


def failing_init(worker_id: int) -> None:
    """A worker_init_fn that fails."""
    raise ValueError(f"worker {worker_id} cannot start")
