"""How a process worker hands large results back: through shared memory, not a pipe.

Each worker has a *result ring*: an anonymous shared-memory file (``memfd``; nothing with a
name, so nothing can leak: the memory goes when the last process holding it exits) mapped by
the worker and by the parent. The worker pickles a chunk's results with protocol 5; every
large buffer (a numpy array's data, a CPU tensor's data: tensors travel as numpy arrays) is
copied into the ring instead of into the pickle, and only the small pickle and the buffers'
places in the ring go through the pipe. The parent hands each buffer on where it lies: the
arrays and tensors of the batch the user gets are views of the ring, and a buffer's space is
free again once the last of them is gone, in whatever order batches are dropped. Nothing is
ever written over memory a batch still refers to, so batches stay valid as long as they are
held, also after the loader is closed (the mapping lives as long as a view of it). Beyond
``VIEW_BYTES`` of buffers held as views (a user keeping many batches), the parent copies
buffers out into memory of its own and frees their space at once.

Each buffer sits in a *slot*: a word that says whether the slot is in use (the worker sets
it when it places the buffer, the parent clears it when the buffer is free), then the
buffer. The worker places each buffer in the first gap from the front that is large enough
(a batch held for good leaves a hole, not a wall), so the memory it touches stays near the
size of the results in flight and held. A buffer that does not fit goes the old way: in the
pickle (numpy arrays) or as torch's own shared-memory tensor (tensors).

This module is torch-free: workers that do not need torch never import it.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import copyreg
import io
import mmap
import multiprocessing.reduction
import os
import pickle
import sys
import tempfile
from typing import Any

import numpy as np

from guideloom_pipes.storage.recycle import BufferPool, Lease

_ALIGN = 64
#: Bytes before each buffer in the ring: its in-use word (1: in use, 0: free), aligned.
_SLOT = 64
#: Buffers smaller than this stay inside the pickle (the ring's bookkeeping costs more).
MIN_RING_BUFFER = 16 * 1024
#: Bytes of a ring's buffers that batches held by the user may keep as views; beyond them
#: buffers are copied out (see the module docstring).
VIEW_BYTES = 64 * 1024 * 1024
#: Buffers copied out of a ring come from a pool of sizes rounded up to this many bytes...
_TAKE_ROUNDING = 64 * 1024
#: ... that keeps at most this many bytes of released buffers (per ring, parent side).
TAKE_POOL_BYTES = 64 * 1024 * 1024
_BYTES = np.dtype(np.uint8)
#: Default ring size per worker. Address space only: the pages touched follow the results
#: in flight (see the module docstring).
RING_BYTES = 256 * 1024 * 1024


#: Incremented in a child forked from this process (``os.register_at_fork``): a ring
#: frees buffers only in the process that took them, so a forked child that drops its copy
#: of a batch leaves the parent's space alone.
_forks = [0]


def _forked() -> None:
    _forks[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _anonymous_file() -> int:
    """A descriptor of shared memory with no name: ``memfd`` (Linux), else a file in
    ``/dev/shm`` (or the temp directory) unlinked at once. Nothing is left to clean up."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        try:
            return int(memfd_create("guideloom-results", os.MFD_CLOEXEC))
        except OSError:
            pass
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="guideloom-results-", dir=directory)
    os.unlink(path)
    return fd


def _aligned(size: int) -> int:
    return (size + _ALIGN - 1) & ~(_ALIGN - 1)


class _RingFd:
    """A ring's file descriptor as a process argument: the child gets its own copy of it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        # While a child process is being started, DupFd hands the descriptor to it.
        return (_rebuild_fd, (multiprocessing.reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> _RingFd:
    return _RingFd(dup.detach())


class ResultRing:
    """One worker's result ring, as the parent (:meth:`create`) or the worker sees it.

    The worker places each buffer in a slot whose first word it sets (in use); the parent
    takes the buffers in the order placed and clears a slot's word when its buffer is free
    (at once for a copy, when the batch is gone for a view), which is all the worker needs
    to know what space is free again.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._map = mmap.mmap(fd, size)
        self._data = np.frombuffer(self._map, dtype=np.uint8, count=size)
        # the ring as int64 words: a slot's in-use word is word slot // 8
        self._words = np.frombuffer(self._map, dtype=np.int64, count=size // 8)
        # Worker side: the (number, slot, end) of the buffers placed that were not yet seen
        # free, sorted by slot (so a placement is one scan from the front); how many were
        # placed.
        self._placed: list[tuple[int, int, int]] = []
        self._count = 0
        # Parent side: bytes lent as views, and bytes of views gone (appended in whatever
        # thread drops a batch, summed by take); the memory copies go into (see take).
        self._lent_bytes = 0
        self._back_bytes = 0
        self._returned: collections.deque[int] = collections.deque()
        self._fork = _forks[0]
        self._pool = BufferPool(limit=TAKE_POOL_BYTES)
        # what the leases of views call as they die (made once: a bound method a batch cost
        # ~50 ns; the cycle it makes is broken by close)
        self._back: Any = self._gone
        # Worker side: the pickler of the results placed here (see dump_result).
        self._dumper: _ResultDumper | None = None

    @classmethod
    def create(cls, size: int = RING_BYTES) -> ResultRing:
        """A new ring (parent side)."""
        fd = _anonymous_file()
        try:
            os.ftruncate(fd, size)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def create_if_supported(cls, size: int = RING_BYTES) -> ResultRing | None:
        """A new ring, or None where descriptors cannot be handed to child processes
        (Windows) or shared memory cannot be had: results then go the way
        ``multiprocessing`` sends them."""
        if sys.platform == "win32":
            return None
        try:
            return cls.create(size)
        except OSError:
            return None

    def handle(self) -> tuple[_RingFd, int]:
        """What a worker process needs to map the ring (pass it as a process argument)."""
        return _RingFd(self.fd), self.size

    @classmethod
    def attach(cls, handle: tuple[_RingFd, int]) -> ResultRing:
        """The worker's view of the ring."""
        ring_fd, size = handle
        return cls(ring_fd.fd, size)

    def close(self) -> None:
        """Unmap and close (the memory is freed once every process has closed it)."""
        self._pool.clear()
        self._back = None  # (leases still alive hold their own)
        # (views alive keep the mapping; nothing is freed in it any more)
        self._words = self._data = None  # type: ignore[assignment]
        if not self._map.closed:
            # A batch still held keeps the mapping until its views are gone.
            with contextlib.suppress(BufferError):
                self._map.close()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    # -- worker side ------------------------------------------------------------------------

    def room(self, size: int) -> bool:
        """Whether a buffer of ``size`` bytes fits now."""
        return self._place(_SLOT + _aligned(size)) is not None

    def _place(self, need: int) -> int | None:
        """The slot for ``need`` (aligned) bytes: the first gap from the front between the
        slots still in use that holds them; None when none does now."""
        if need > self.size:
            return None
        words, placed = self._words, self._placed
        position = index = 0
        while index < len(placed):
            _, slot, end = placed[index]
            if not words[slot >> 3]:  # freed since: forgotten
                del placed[index]
                continue
            if slot - position >= need:
                return position
            position = end
            index += 1
        return position if self.size - position >= need else None

    def put(self, raw: memoryview) -> int | None:
        """Copy ``raw`` (contiguous bytes) into the ring: its position, or None if full."""
        size = raw.nbytes
        need = _SLOT + _aligned(size)
        slot = self._place(need)
        if slot is None:
            return None
        self._words[slot >> 3] = 1  # in use until the parent frees it
        position = slot + _SLOT
        self._data[position : position + size] = np.frombuffer(raw, dtype=np.uint8)
        bisect.insort(self._placed, (self._count, slot, slot + need), key=_slot_of)
        self._count += 1
        return position

    def mark(self) -> int:
        """The worker's position, to :meth:`rollback` to if a result cannot be sent."""
        return self._count

    def rollback(self, mark: int) -> None:
        """Forget the buffers placed since ``mark`` (the parent will never take them)."""
        self._placed = [entry for entry in self._placed if entry[0] < mark]
        self._count = mark

    # -- parent side ------------------------------------------------------------------------

    def take(self, position: int, size: int) -> np.ndarray:
        """The buffer at ``position``, as a view of the ring whose space is freed when the
        view is gone (see the module docstring: its base is a
        :class:`~guideloom_pipes.storage.recycle.Lease` that holds the slice of the ring,
        which holds the mapping, and calls :meth:`_gone` as it dies); a copy in memory of
        the parent's own (its space freed at once) where views of more than ``VIEW_BYTES``
        would be held. Copies come from a :class:`~guideloom_pipes.storage.recycle.
        BufferPool` of sizes rounded up to ``_TAKE_ROUNDING`` (batches of padded documents
        differ a little in size), rather than fresh pages faulted in for each batch."""
        returned = self._returned
        while returned:
            self._back_bytes += returned.popleft()
        if self._lent_bytes - self._back_bytes + size <= VIEW_BYTES:
            self._lent_bytes += size
            buffer = self._data[position : position + size]
            return np.asarray(Lease(buffer, buffer.__array_interface__, self._back, position))
        rounded = -(-size // _TAKE_ROUNDING) * _TAKE_ROUNDING
        out = self._pool.take((rounded,), _BYTES)
        if rounded != size:
            out = out[:size]
        out[:] = self._data[position : position + size]
        self._free(position)
        return out

    def _free(self, position: int) -> None:
        """The buffer at ``position`` is free: clear its slot's in-use word (one store, from
        any thread; nothing after the ring is closed, nor in a forked child)."""
        words = self._words
        if words is not None and self._fork == _forks[0]:
            words[(position - _SLOT) >> 3] = 0

    def _gone(self, lease: Lease) -> None:
        """The last view of a buffer lent by :meth:`take` is gone (called by its lease, in
        whichever thread drops that view, the garbage collector's included)."""
        self._free(lease.place)
        self._returned.append(lease.buffer.nbytes)  # (atomic; take sums them)


def _slot_of(entry: tuple[int, int, int]) -> int:
    return entry[1]


# -- pickling ---------------------------------------------------------------------------------

_TORCH_VIEWS: dict[Any, Any] | None = None


def _torch_views(torch: Any) -> dict[Any, Any]:
    """torch dtypes without a numpy equivalent -> the integer dtype of their size."""
    global _TORCH_VIEWS
    if _TORCH_VIEWS is None:
        views = {torch.bfloat16: torch.int16}
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
            dtype = getattr(torch, name, None)
            if dtype is not None:
                views[dtype] = torch.uint8
        _TORCH_VIEWS = views
    return _TORCH_VIEWS


def _tensor_from_array(array: np.ndarray, dtype: str | None, requires_grad: bool) -> Any:
    """Rebuild a CPU tensor sent as a numpy array (sharing the array's memory)."""
    import torch

    tensor = torch.from_numpy(array)
    if dtype is not None:
        tensor = tensor.view(getattr(torch, dtype))
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _with_grad(tensor: Any, requires_grad: bool) -> Any:
    return tensor.requires_grad_(True) if requires_grad else tensor


class _ResultPickler(pickle.Pickler):
    """Protocol 5 with CPU tensors as numpy arrays, so their data can go out of band.

    Tensors that are not plain dense CPU tensors, or that do not fit the ring, fall back to
    torch's reductions (shared memory of its own), as ``multiprocessing`` pickles them.
    """

    def __init__(self, file: Any, ring: ResultRing | None, buffer_callback: Any) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        # multiprocessing's reductions too (ForkingPickler's), torch's tensors among them.
        table = copyreg.dispatch_table.copy()
        table.update(multiprocessing.reduction.ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
        self.dispatch_table = table
        self._ring = ring
        self._torch = sys.modules.get("torch")

    def reducer_override(self, obj: Any) -> Any:
        torch = self._torch
        if torch is None or type(obj) is not torch.Tensor:
            return NotImplemented
        if obj.layout != torch.strided or not obj.is_cpu or obj.is_quantized:
            return NotImplemented
        ring = self._ring
        nbytes = obj.nbytes
        source = obj.detach() if obj.requires_grad else obj
        lazy = source.is_conj() or source.is_neg()
        if lazy:  # a lazy conjugate or negative view: torch's own pickling drops the bit
            source = source.resolve_conj().resolve_neg()
        if nbytes >= MIN_RING_BUFFER and (ring is None or not ring.room(nbytes)):
            # Too big for the ring: torch's shared memory.
            if lazy:
                return (_with_grad, (source, obj.requires_grad))
            return NotImplemented
        view = _torch_views(torch).get(source.dtype)
        if view is not None:
            source = source.view(view)
        try:
            array = source.numpy()
        except (TypeError, RuntimeError):
            return NotImplemented
        dtype = str(obj.dtype).removeprefix("torch.") if view is not None else None
        return (_tensor_from_array, (array, dtype, obj.requires_grad))


class _ResultDumper:
    """Pickles results for :func:`dump_result` with one pickler, made once per ring.

    Making a pickler copies a dispatch table of ~90 reductions (copyreg's, multiprocessing's,
    torch's); in a worker, whose caches are cold after each batch's decoding, that took 30-40
    us a result, about a tenth of pickling a batch of 32 padded documents (1 MB). The memo is
    cleared after each result, so the pickler keeps no reference to one; a pickler stopped by
    an error is not used again, nor one made before torch was imported or before more
    reductions were registered with ``multiprocessing`` (torch registers its own on import,
    which a worker may do with its first batch).
    """

    __slots__ = ("_pickler", "_places", "_reductions", "_ring", "_stream")

    def __init__(self, ring: ResultRing | None) -> None:
        self._ring = ring
        self._stream = io.BytesIO()
        self._places: list[tuple[int, int]] = []
        self._pickler: _ResultPickler | None = None
        self._reductions = -1

    def _out_of_band(self, buffer: pickle.PickleBuffer) -> bool:
        ring = self._ring
        if ring is None:
            return True
        raw = buffer.raw()
        if raw.nbytes < MIN_RING_BUFFER:
            return True  # in band
        position = ring.put(raw)
        if position is None:
            return True
        self._places.append((position, raw.nbytes))
        return False

    def dump(self, result: Any) -> tuple[bytes, list[tuple[int, int]]]:
        stream = self._stream
        stream.seek(0)
        stream.truncate()
        places: list[tuple[int, int]] = []
        self._places = places
        pickler = self._pickler
        reductions = len(multiprocessing.reduction.ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
        if (
            pickler is None
            or reductions != self._reductions
            or (pickler._torch is None and "torch" in sys.modules)
        ):
            pickler = self._pickler = _ResultPickler(stream, self._ring, self._out_of_band)
            self._reductions = reductions
        ring = self._ring
        mark = ring.mark() if ring is not None else None
        try:
            pickler.dump(result)
        except BaseException:
            self._pickler = None
            if ring is not None and mark is not None:
                ring.rollback(mark)
            raise
        finally:
            pickler.clear_memo()
        return stream.getvalue(), places


def dump_result(result: Any, ring: ResultRing | None) -> tuple[bytes, list[tuple[int, int]]]:
    """Pickle ``result``; large buffers go into ``ring``. Returns the pickle and the
    ``(position, size)`` of each buffer placed in the ring, in order."""
    if ring is None:
        return _ResultDumper(None).dump(result)
    dumper = ring._dumper
    if dumper is None:
        dumper = ring._dumper = _ResultDumper(ring)
    return dumper.dump(result)


def load_result(data: bytes, places: list[tuple[int, int]], ring: ResultRing | None) -> Any:
    """Unpickle what :func:`dump_result` made, copying the buffers out of ``ring``."""
    if not places:
        return pickle.loads(data)
    assert ring is not None
    buffers = [ring.take(position, size) for position, size in places]
    return pickle.loads(data, buffers=buffers)
