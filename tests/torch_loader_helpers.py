"""Helpers of the ``guideloom_pipes.DataLoader`` tests: batches as plain values, the global
generators seeded, and iterable datasets (module level, so worker processes can unpickle
them), each worker reading its own share, found with ``torch.utils.data.get_worker_info()``
as torch's documentation shows."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


def plain(batch: Any) -> Any:
    """A batch as nested Python lists (tensors and tuples compared by value)."""
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [plain(item) for item in batch]
    if isinstance(batch, dict):
        return {key: plain(value) for key, value in batch.items()}
    return batch


def seed_all(seed: int = 7) -> None:
    """Seed torch's, numpy's and ``random``'s global generators."""
    torch.manual_seed(seed)
    random.seed(seed + 1)
    np.random.seed(seed + 2)


def _share() -> tuple[int, int]:
    """``(this worker's id, the number of workers)``: ``(0, 1)`` outside workers."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class Uneven(IterableDataset):  # type: ignore[type-arg]
    """Samples ``0 .. n-1``, worker ``w`` of ``k`` taking ``w, w + k, ...``, except that
    worker 1 stops halfway through its share (so the workers end at different batches).
    With ``draws`` each sample is ``(i, a torch draw, a numpy draw, a random draw)`` from
    the worker's global generators; without, ``i``. No state: a resume replays."""

    def __init__(self, n: int, draws: bool = True) -> None:
        self.n = n
        self.draws = draws

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Any]:
        worker, workers = _share()
        mine = list(range(worker, self.n, workers))
        if worker == 1:
            mine = mine[: len(mine) // 2]
        for i in mine:
            if self.draws:
                yield (i, float(torch.rand(())), float(np.random.rand()), random.random())
            else:
                yield i


class Counted(IterableDataset):  # type: ignore[type-arg]
    """Samples ``0 .. n-1`` shared as :class:`Uneven` shares them (no halving), with a
    state of its own (``state_dict`` / ``load_state_dict``: the index of the next sample of
    its share). ``iter()`` starts where a loaded state says; a replay on top of the state
    would skip samples, so an exact resume shows the state was used alone."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.next = 0

    def __iter__(self) -> Iterator[int]:
        worker, workers = _share()
        for j in range(self.next, len(range(worker, self.n, workers))):
            self.next = j + 1
            yield worker + j * workers
        self.next = 0  # (the next pass starts over)

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


class _StatefulIterator:
    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.at = 0

    def __iter__(self) -> _StatefulIterator:
        return self

    def __next__(self) -> int:
        if self.at >= len(self.items):
            raise StopIteration
        self.at += 1
        return self.items[self.at - 1]

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


class IteratorState(IterableDataset):  # type: ignore[type-arg]
    """Samples ``0 .. n-1`` shared as :class:`Counted`; the state is its iterator's
    (``iter(dataset)`` returns an object with ``state_dict`` / ``load_state_dict``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> _StatefulIterator:
        worker, workers = _share()
        return _StatefulIterator(list(range(worker, self.n, workers)))


class OwnIterator(IterableDataset):  # type: ignore[type-arg]
    """Samples ``0 .. n-1`` shared as :class:`Counted`, from a dataset that is its own
    iterator (``iter()`` returns it). ``iter()`` sets up the pass (its share, the next
    index), so a state can only be loaded after it; ``iters`` counts the calls."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.iters = 0

    def __iter__(self) -> OwnIterator:
        self.iters += 1
        worker, workers = _share()
        self.share = list(range(worker, self.n, workers))
        self.at = 0
        return self

    def __next__(self) -> int:
        if self.at >= len(self.share):
            raise StopIteration
        self.at += 1
        return self.share[self.at - 1]

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]  # (the share comes from iter(), which ran before)
        assert hasattr(self, "share"), "load_state_dict() before iter()"


class EpochCounting(IterableDataset):  # type: ignore[type-arg]
    """Samples ``(i, epoch)`` for ``i`` of the worker's share of ``0 .. n-1``, shared as
    :class:`Counted` and with its state (the next index of the share), plus the dataset's
    own count of its passes (``epoch`` goes up when a pass ends)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0
        self.next = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        worker, workers = _share()
        share = range(worker, self.n, workers)
        for j in range(self.next, len(share)):
            self.next = j + 1
            yield (share[j], self.epoch)
        self.next = 0
        self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.next = state["epoch"], state["next"]


class _FailingIterator:
    def __init__(self, items: list[int], bad: int) -> None:
        self.items = iter(items)
        self.bad = bad

    def __iter__(self) -> _FailingIterator:
        return self

    def __next__(self) -> int:
        item = next(self.items)
        if item == self.bad:
            raise ValueError(f"sample {item} is bad")
        return item


class FailsAt(IterableDataset):  # type: ignore[type-arg]
    """Samples ``0 .. n-1`` shared as :class:`Counted`; sample ``bad`` raises ``ValueError``
    when drawn, and the iterator goes on after it (it is not a generator)."""

    def __init__(self, n: int, bad: int) -> None:
        self.n = n
        self.bad = bad

    def __iter__(self) -> _FailingIterator:
        worker, workers = _share()
        return _FailingIterator(list(range(worker, self.n, workers)), self.bad)


def _dies_once(marker: str) -> None:
    """End this worker process abruptly the first time (``marker`` is then made)."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)


class DiesOnce(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Samples ``0 .. n-1``; the worker process reading sample ``bad`` exits abruptly, the
    first time only (a marker file remembers), as a worker killed by a signal would."""

    def __init__(self, n: int, bad: int, marker: str) -> None:
        self.n, self.bad, self.marker = n, bad, marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            _dies_once(self.marker)
        return index


class IterableDiesOnce(IterableDataset):  # type: ignore[type-arg]
    """:class:`DiesOnce` as an iterable dataset, shared as :class:`Counted` shares it."""

    def __init__(self, n: int, bad: int, marker: str) -> None:
        self.n, self.bad, self.marker = n, bad, marker

    def __iter__(self) -> Iterator[int]:
        worker, workers = _share()
        for index in range(worker, self.n, workers):
            if index == self.bad:
                _dies_once(self.marker)
            yield index


def seed_random_by_worker(worker_id: int) -> None:
    """A ``worker_init_fn``: reseed ``random`` from the worker's id (its draws show it ran)."""
    random.seed(1000 + worker_id)


class NoteSigterm:
    """A SIGTERM handler that notes the signal in a file and goes on, as a trainer's does
    (Lightning's): a process that inherits it outlives a ``terminate()``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, signum: int, frame: Any) -> None:
        with open(self.path, "a") as file:
            file.write(f"{os.getpid()}\n")


def stop_and_resume(
    k: int, build: Any, epochs: int, rebuild: Any = None
) -> tuple[list[Any], dict[str, Any]]:
    """Batches of a run of ``build()``'s loader stopped after its ``k``-th batch, its state
    (with torch's global RNG state, as a checkpoint keeps it) loaded into a new loader
    (``rebuild()``, else ``build()``), which goes on to the end of ``epochs``; and the state."""
    seed_all()
    loader = build()
    got: list[Any] = []
    state = None
    for _ in range(epochs):
        for batch in loader:
            got.append(plain(batch))
            if len(got) == k:
                state = loader.state_dict()
                break
        if state is not None:
            break
    if state is None:
        state = loader.state_dict()
    rng = torch.get_rng_state()
    del loader
    seed_all(99)  # a new process's own start
    loader = (rebuild or build)()
    loader.load_state_dict(state)
    torch.set_rng_state(rng)
    for _ in range(state["epoch"], epochs):
        got += [plain(batch) for batch in loader]
    return got, state


def with_generators(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``generator="seeded"`` made a new generator seeded 3 (one per run:
    each loader draws from its own)."""
    kw = dict(options)
    if kw.get("generator") == "seeded":
        kw["generator"] = torch.Generator().manual_seed(3)
    return kw
