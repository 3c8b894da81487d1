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

Where CPython counts references under its GIL (not a free-threaded build), buffers that
need no lease of their own (see ``leased``) are not given leases at all: the pool keeps each
buffer and hands out a view of it, and a buffer is lent again once only the pool refers to
it (every view of it, and every tensor or array made from one, refers to it). The same
rule, read from the reference count when a buffer is wanted instead of acted on when it
dies: no lease object, no ``__array_interface__`` to parse and no ``__del__`` per batch
(1.3 -> 0.3 us a batch).

:class:`Lease` is the package's one owner of lent memory: the pinned ring of CUDA copies
(``pipes/ring.py``) and the result ring of process workers (``pipes/workers/transport.py``)
lend theirs under it too, each with its own way back.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

#: Released memory a pool keeps for reuse, in bytes, all shapes together (beyond it,
#: released buffers are freed).
POOL_BYTES = 32 << 20


class Lease:
    """The owner of a block of memory lent to the arrays of a batch, and its way back.

    Arrays made with ``np.asarray(lease)`` have the lease as their base, and so does every
    view of them and every tensor made from one (``torch.from_numpy``): numpy stops
    collapsing bases at an object that is not an array. The lease therefore dies with the
    last of them, and then calls ``back(lease)``, in whichever thread drops that last view
    (the garbage collector's included). What the lenders differ in is data, not code:

    - ``buffer``: the memory (kept alive by the lease: a buffer of a pool's shelf, a
      pinned ring's buffer, a slice of a worker's shared-memory result ring);
    - ``__array_interface__``: what ``np.asarray`` makes of it (its address, shape and
      dtype; read by numpy, never changed);
    - ``back``: what gives the memory back (a :class:`BufferPool` shelf keeps the buffer for
      the next batch of its shape, a :class:`~guideloom_pipes.pipes.PinnedRing` queues its
      buffer, a result ring frees its space);
    - ``place``: where the buffer lies in its lender, for ``back`` (a result ring's
      position; None elsewhere);
    - ``note``: what the borrower remembers of the batch, in its own form (a packed read's
      sequence bounds); None until it sets one.
    """

    __slots__ = ("__array_interface__", "back", "buffer", "note", "place")

    def __init__(
        self,
        buffer: np.ndarray,
        interface: dict[str, Any],
        back: Callable[[Lease], object],
        place: Any = None,
    ) -> None:
        self.buffer = buffer
        self.__array_interface__ = interface
        self.back = back
        self.place = place
        self.note: Any = None

    def __del__(self) -> None:
        self.back(self)


class _Shelf(deque[tuple[np.ndarray, Any]]):
    """The released buffers of one shape and dtype, and how many of them to keep. A pool's
    :meth:`BufferPool.clear` closes its shelves: buffers lent before are then freed."""

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep
        self.open = True

    def back(self, lease: Lease) -> None:
        """A lease of this shelf's is gone: keep its buffer, unless closed or full."""
        if self.open and len(self) < self.keep:
            self.append((lease.buffer, lease.__array_interface__))


def _count(arrays: list[np.ndarray], index: int) -> int:
    """The references to ``arrays[index]``, counted as :func:`_lend` counts them."""
    candidate = arrays[index]
    return sys.getrefcount(candidate)


#: What :func:`_count` counts for a buffer that only its stock's list refers to.
_FREE = _count([np.empty(0)], 0)


def _lend(arrays: list[np.ndarray], index: int) -> np.ndarray | None:
    """A view of ``arrays[index]`` if nothing but ``arrays`` refers to it, else None.

    No lock is needed under the GIL: the buffer is held here from before its count is
    read until the view exists, so a second thread looking at it meanwhile counts this
    reference too, and finds it taken."""
    candidate = arrays[index]
    if sys.getrefcount(candidate) == _FREE:
        return candidate[...]
    return None


def _lending_works() -> bool:
    """Whether :func:`_lend` tells a buffer in use from a free one on this interpreter."""
    arrays = [np.empty(1)]
    held = arrays[0][1:]
    if _lend(arrays, 0) is not None:
        return False
    del held
    return _lend(arrays, 0) is not None


#: Whether buffers are lent by counting references (see the module docstring): CPython
#: with its GIL (in a free-threaded build another thread may change a count as it is read).
_COUNTS = (
    sys.implementation.name == "cpython"
    and bool(getattr(sys, "_is_gil_enabled", lambda: True)())
    and _lending_works()
)


#: How many of a stock's buffers are looked at first, lowest first (see :class:`_Stock`).
_HOT = 4


class _Stock:
    """The buffers of one shape and dtype lent by counting references: each one is lent
    as a view, and lent again once only :attr:`arrays` refers to it. At most ``keep`` are
    kept; beyond them a buffer is the caller's alone (freed when its arrays are).

    The first :data:`_HOT` buffers are looked at first, lowest first: a loop that holds a
    few batches at a time reuses the same few buffers, whose memory is still in the CPU's
    caches. A burst of batches held together (a worker's chunk) makes more buffers; the
    rest are then lent in turn (:attr:`next`: the one lent longest ago first), so a burst
    finds a free one without counting the held ones again, and a steady loop after it
    goes back to the first few instead of cycling through them all (64 buffers of a
    64 KiB batch cycled through 4 MiB: every batch's copy then wrote memory out of the
    caches, 20% slower)."""

    __slots__ = ("arrays", "dtype", "keep", "next", "shape")

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype[Any], keep: int) -> None:
        self.shape, self.dtype, self.keep = shape, dtype, keep
        self.arrays: list[np.ndarray] = []
        self.next = _HOT  # where the search past the first _HOT starts

    def take(self) -> np.ndarray:
        arrays = self.arrays  # (close() replaces the list: this one stays whole)
        count = len(arrays)
        hot = _HOT if count > _HOT else count
        for index in range(hot):
            lent = _lend(arrays, index)
            if lent is not None:
                return lent
        index = self.next
        for _ in range(count - hot):
            if index >= count:
                index = hot
            lent = _lend(arrays, index)
            if lent is not None:
                self.next = index + 1
                return lent
            index += 1
        buffer = np.empty(self.shape, dtype=self.dtype)
        if count >= self.keep:
            return buffer
        arrays.append(buffer)
        return buffer[...]

    def close(self) -> None:
        """Keep nothing more: buffers lent are the borrowers' from now on."""
        self.keep = 0
        self.arrays = []

    def free_bytes(self) -> int:
        arrays = self.arrays
        return sum(arrays[i].nbytes for i in range(len(arrays)) if _count(arrays, i) == _FREE)


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
        self._shelves: dict[tuple[Any, ...], _Shelf | _Stock] = {}
        self._limit = limit
        self._most = shelves

    def take(
        self, shape: tuple[int, ...], dtype: np.dtype[Any], leased: bool = False
    ) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` (contents undefined) that nothing
        else uses: where references are counted, a view of a buffer the pool keeps; else,
        or with ``leased`` (a reader that keeps a :attr:`Lease.note` of the batch), owned by
        a new :class:`Lease` (its base)."""
        shelf = self._shelves.get((shape, dtype, leased))
        if shelf is None:
            shelf = self._new_shelf(shape, dtype, leased)
        if isinstance(shelf, _Stock):
            return shelf.take()
        try:
            buffer, interface = shelf.pop()
        except IndexError:
            buffer = np.empty(shape, dtype=dtype)
            interface = buffer.__array_interface__
        return np.asarray(Lease(buffer, interface, shelf.back))

    def _new_shelf(
        self, shape: tuple[int, ...], dtype: np.dtype[Any], leased: bool
    ) -> _Shelf | _Stock:
        shelves = self._shelves
        while len(shelves) >= self._most:
            oldest = next(iter(shelves))
            closed = shelves.pop(oldest, None)
            if closed is not None:
                _close(closed)
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        keep = max(1, self._limit // self._most // max(size, 1))
        shelf = _Stock(shape, dtype, keep) if _COUNTS and not leased else _Shelf(keep)
        return shelves.setdefault((shape, dtype, leased), shelf)

    def clear(self) -> None:
        """Drop the released buffers; buffers lent before are freed when they die."""
        shelves, self._shelves = self._shelves, {}
        for shelf in shelves.values():
            _close(shelf)

    @property
    def kept_bytes(self) -> int:
        """Bytes of released buffers waiting to be lent again."""
        total = 0
        for shelf in list(self._shelves.values()):
            if isinstance(shelf, _Stock):
                total += shelf.free_bytes()
            else:
                total += sum(buffer.nbytes for buffer, _ in shelf)
        return total


def _close(shelf: _Shelf | _Stock) -> None:
    if isinstance(shelf, _Stock):
        shelf.close()
    else:
        shelf.open = False
        shelf.clear()


__all__ = ["POOL_BYTES", "BufferPool", "Lease"]
