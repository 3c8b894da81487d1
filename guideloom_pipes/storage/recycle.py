"""Output memory that comes back: the arrays a reader fills for each batch, reused once the
batch is gone.

A fresh allocation per batch is often memory the C allocator has just given back to the
kernel (glibc trims the top of its heap once more than 128 KiB there is free), so every
page of it is faulted in again: 16 faults for a 64 KiB batch of 8 windows of 2048 tokens,
which made such a batch take 30-40 us instead of 12 in whole epochs where the heap's layout
put the batch at its top. A :class:`BufferPool` hands out arrays owned by a :class:`Lease`:
every view of the array (a batch's columns, its samples, tensors made with
``torch.from_numpy``) holds the lease through its base, so the lease dies with the last of
them, and only then does its buffer go back to the pool, for the next batch of that shape.
Nothing handed out is ever written again while anything refers to it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

#: Released memory a pool keeps for reuse, in bytes, all shapes together (beyond it,
#: released buffers are freed).
POOL_BYTES = 32 << 20


class Lease:
    """The owner of one buffer lent by a :class:`BufferPool`; hands it back when it dies.

    Subclasses may add slots for what a reader wants to remember of the batch.
    """

    __slots__ = ("__array_interface__", "_buffer", "_shelf")

    def __init__(self, buffer: np.ndarray, interface: dict[str, Any], shelf: _Shelf) -> None:
        self._buffer = buffer
        self.__array_interface__ = interface
        self._shelf = shelf

    def __del__(self) -> None:
        shelf = self._shelf
        if shelf.open and len(shelf) < shelf.keep:
            shelf.append((self._buffer, self.__array_interface__))


class _Shelf(deque[tuple[np.ndarray, Any]]):
    """The released buffers of one shape and dtype, and how many of them to keep. A pool's
    :meth:`BufferPool.clear` closes its shelves: buffers lent before are then freed."""

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep
        self.open = True


class BufferPool:
    """Arrays of a shape and dtype, recycled once nothing refers to them (see the module
    docstring). The last one released is lent first (the most likely still in a cache).

    Released buffers wait on one *shelf* per shape and dtype; a pool has at most ``shelves``
    of them (a new shape closes the oldest shelf: its buffers are freed), and each keeps at
    most ``limit / shelves`` bytes (at least one buffer), so at most about ``limit`` bytes
    wait in all. :meth:`clear` drops them, and buffers lent before no longer come back.
    Thread-safe: a buffer comes back in whichever thread drops the batch's last array (a
    shelf's ``append`` and ``pop`` are atomic).
    """

    def __init__(self, limit: int = POOL_BYTES, shelves: int = 8) -> None:
        self._shelves: dict[tuple[tuple[int, ...], np.dtype[Any]], _Shelf] = {}
        self._limit = limit
        self._most = shelves

    def take(
        self, shape: tuple[int, ...], dtype: np.dtype[Any], lease: type[Lease] = Lease
    ) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` (contents undefined) that nothing
        else uses, owned by a new ``lease``."""
        shelf = self._shelves.get((shape, dtype))
        if shelf is None:
            shelf = self._new_shelf(shape, dtype)
        try:
            buffer, interface = shelf.pop()
        except IndexError:
            buffer = np.empty(shape, dtype=dtype)
            interface = buffer.__array_interface__
        return np.asarray(lease(buffer, interface, shelf))

    def _new_shelf(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> _Shelf:
        shelves = self._shelves
        while len(shelves) >= self._most:
            oldest = next(iter(shelves))
            closed = shelves.pop(oldest, None)
            if closed is not None:
                closed.open = False
                closed.clear()
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        keep = max(1, self._limit // self._most // max(size, 1))
        return shelves.setdefault((shape, dtype), _Shelf(keep))

    def clear(self) -> None:
        """Drop the released buffers; buffers lent before are freed when they die."""
        shelves, self._shelves = self._shelves, {}
        for shelf in shelves.values():
            shelf.open = False
            shelf.clear()

    @property
    def kept_bytes(self) -> int:
        """Bytes of released buffers waiting to be lent again."""
        return sum(buffer.nbytes for shelf in self._shelves.values() for buffer, _ in shelf)


__all__ = ["POOL_BYTES", "BufferPool", "Lease"]
