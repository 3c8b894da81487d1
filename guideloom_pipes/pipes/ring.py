"""A ring of (pinned) host buffers that batches are read into, each reused only once nothing
refers to it any more and its device copy has completed.

With ``pin_memory=True`` on a CUDA device, a loader reads each batch's windows straight into
one of these buffers (page-locked memory: the copy to the device runs asynchronously, with no
pinning copy first), :class:`~guideloom_pipes.pipes.ToDevice` copies the batch to the device
and records an event after the copy, and the buffer goes back to the ring.

When a buffer is free again is decided by two things, never by a guess about timing:

- *Nothing refers to it.* A buffer is handed out as an array whose base is a
  :class:`~guideloom_pipes.storage.recycle.Lease`; numpy views, ``torch.from_numpy`` tensors
  and views of those all keep the lease alive, so the lease dies (and gives the buffer back
  to the ring) only once no array or tensor over the buffer is left anywhere, user code
  included. A batch that failed, or a host tensor someone kept, simply keeps its buffer out
  of the ring.
- *Its device copy has completed.* The event recorded after the copy must report completion
  (``query()``) before the buffer is handed out again; where every free buffer's copy is
  still running and the ring has its full size, the oldest one is waited for
  (``synchronize()``).

The ring's size is the number of batches in flight that its owner plans for (batches read
ahead, the batch being copied, the one whose copy may still be running): buffers are
allocated on demand up to that size; past it, a buffer is allocated only when every buffer
is held (more batches in flight than planned), so the ring never blocks a reader on its
consumer. Allocation and the completion signal are injectable (``allocate``, ``event``),
so the whole logic runs on a CPU with plain buffers and events whose completion a test
controls.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.storage.recycle import Lease

__all__ = ["CopyEvent", "PinnedRing", "cuda_event", "pinned_allocate"]


class CopyEvent(Protocol):
    """What the ring needs of a copy's completion signal (``torch.cuda.Event`` has it)."""

    def record(self) -> Any:
        """Mark the point, on the current stream, that completion means."""

    def query(self) -> bool:
        """Whether the work before the recorded point has completed (without waiting)."""

    def synchronize(self) -> Any:
        """Wait until the work before the recorded point has completed."""


def pinned_allocate(nbytes: int) -> np.ndarray:
    """``nbytes`` of page-locked host memory (torch's pinned allocator) as a uint8 array."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def cuda_event() -> CopyEvent:
    """A new CUDA event (recorded on the current stream by the ring's owner)."""
    import torch

    return torch.cuda.Event()


class _Slot:
    """One buffer of the ring and what the ring knows of it."""

    __slots__ = ("buffer", "end", "event", "index", "interfaces", "release", "start")

    def __init__(self, index: int, buffer: np.ndarray, returned: collections.deque[_Slot]) -> None:
        self.index = index
        self.buffer = buffer
        self.start = int(buffer.ctypes.data)
        self.end = self.start + buffer.nbytes
        self.event: CopyEvent | None = None  # recorded after its last device copy
        # numpy's __array_interface__ of each (shape, dtype) lent so far
        self.interfaces: dict[tuple[tuple[int, ...], np.dtype[Any]], dict[str, Any]] = {}

        def release(_: Lease) -> None:  # the lease's way back
            returned.append(self)

        #: Called when the lease dies: the buffer goes back to the ring (any thread).
        self.release = release

    def interface(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> dict[str, Any]:
        key = (shape, dtype)
        interface = self.interfaces.get(key)
        if interface is None:
            interface = self.interfaces[key] = {
                "data": (self.start, False),
                "shape": shape,
                "typestr": dtype.str,
                "descr": dtype.descr,
                "version": 3,
            }
        return interface


class PinnedRing:
    """Host buffers of ``nbytes`` each, reused in a ring (see the module's description).

    Thread-safe: worker threads take buffers while the training thread copies batches out
    of them.

    Args:
        nbytes: The size of each buffer: the largest batch read into it.
        size: Buffers planned (the batches in flight); allocated on demand.
        allocate: ``nbytes -> array`` of at least that many bytes; by default pinned memory
            (:func:`pinned_allocate`, needs a CUDA build of torch and a GPU).
        event: ``() -> event`` with ``record()``, ``query()``, ``synchronize()``; by default
            a CUDA event (:func:`cuda_event`).
    """

    def __init__(
        self,
        nbytes: int,
        size: int,
        *,
        allocate: Callable[[int], np.ndarray] | None = None,
        event: Callable[[], CopyEvent] | None = None,
    ) -> None:
        for name, value, least in (("nbytes", nbytes, 1), ("size", size, 1)):
            check_int(f"PinnedRing {name}", value, minimum=least)
        self.nbytes = int(nbytes)
        self.size = int(size)
        self._allocate = allocate if allocate is not None else pinned_allocate
        self._event = event if event is not None else cuda_event
        self._lock = threading.Lock()
        self._slots: list[_Slot] = []
        self._by_start: list[tuple[int, int]] = []  # (start address, slot index), sorted
        self._free: list[_Slot] = []  # oldest released first
        # released by weak-reference callbacks (any thread, any time): moved to _free under
        # the lock by the next take(); deque appends are atomic
        self._returned: collections.deque[_Slot] = collections.deque()
        #: Buffers handed out again (``reused``), after waiting for a copy (``waited``),
        #: allocated past ``size`` because all were held (``grown``).
        self.counts = {"reused": 0, "waited": 0, "grown": 0}

    @property
    def allocated(self) -> int:
        """Buffers allocated so far."""
        return len(self._slots)

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any] | Any) -> np.ndarray:
        """An empty C-contiguous array of ``shape`` and ``dtype`` over a free buffer (the
        ``buffers`` / ``out`` function of a read). A request larger than ``nbytes`` gets
        ordinary memory instead (never one of the ring's)."""
        dtype = np.dtype(dtype)
        shape = tuple(map(int, shape))
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.nbytes:
            return np.empty(shape, dtype=dtype)
        wait: CopyEvent | None = None
        with self._lock:
            free = self._free
            while self._returned:
                free.append(self._returned.popleft())
            slot = None
            for position, candidate in enumerate(free):  # oldest first
                if candidate.event is None or candidate.event.query():
                    slot = free.pop(position)
                    self.counts["reused"] += 1
                    break
            if slot is None:
                if free and len(self._slots) >= self.size:
                    slot = free.pop(0)  # every free copy still runs: wait for the oldest
                    wait = slot.event
                    self.counts["reused"] += 1
                    self.counts["waited"] += 1
                else:
                    if len(self._slots) >= self.size:
                        self.counts["grown"] += 1  # all held: more in flight than planned
                    slot = self._new_slot()
            lease = Lease(slot.buffer, slot.interface(shape, dtype), slot.release)
        if wait is not None:
            wait.synchronize()
        slot.event = None
        return np.asarray(lease)

    def _new_slot(self) -> _Slot:
        buffer = self._allocate(self.nbytes)
        if (
            not isinstance(buffer, np.ndarray)
            or buffer.nbytes < self.nbytes
            or not buffer.flags.c_contiguous
            or not buffer.flags.writeable
        ):
            raise ValueError(
                f"PinnedRing's allocate({self.nbytes}) must return a writable C-contiguous "
                f"numpy array of at least {self.nbytes} bytes, got {buffer!r:.80}"
            )
        slot = _Slot(
            len(self._slots), buffer.reshape(-1).view(np.uint8)[: self.nbytes], self._returned
        )
        self._slots.append(slot)
        bisect.insort(self._by_start, (slot.start, slot.index))
        return slot

    def slot_of(self, address: int) -> int | None:
        """The index of the buffer that holds ``address``, or None."""
        by_start = self._by_start
        position = bisect.bisect_right(by_start, (address, len(self._slots))) - 1
        if position < 0:
            return None
        slot = self._slots[by_start[position][1]]
        return slot.index if address < slot.end else None

    def copied(self, addresses: Iterable[int]) -> int:
        """The copies of the memory at ``addresses`` (host tensors' data pointers) have been
        issued on the current stream: record an event after them and attach it to every
        buffer they lie in, so none of those is handed out before it completes. Returns how
        many buffers it concerned (0: no event recorded)."""
        with self._lock:
            slots = {index for index in map(self.slot_of, addresses) if index is not None}
            if not slots:
                return 0
            event = self._event()
            event.record()
            for index in slots:
                self._slots[index].event = event
        return len(slots)

    def close(self) -> None:
        """Wait for every copy still running out of the ring's buffers, then let go of them
        (a buffer an array still refers to lives on with that array). Its memory may then
        go back to torch's pinned allocator and be handed out again: no device copy may
        still be reading it. The ring can be used again (it allocates anew)."""
        with self._lock:
            slots, self._slots, self._by_start = self._slots, [], []
            self._free = []
            # buffers still lent go back to the old queue, never to this ring again
            self._returned = collections.deque()
        for event in {id(slot.event): slot.event for slot in slots if slot.event}.values():
            if not event.query():
                event.synchronize()
        for slot in slots:
            slot.event = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    def __repr__(self) -> str:
        return (
            f"PinnedRing(nbytes={self.nbytes}, size={self.size}, allocated={self.allocated}, "
            f"counts={self.counts})"
        )
