"""Read backends: byte-range readers for one file each.

A backend is a factory: ``backend.sync_reader(path)`` / ``backend.async_reader(path)``
return readers with ``open()``, ``close()``, ``filesize()`` and ``read(offset, size)``.
The local backends also implement ``list_dir(path)`` so that shard discovery can list a
directory (and so detect a missing shard) instead of probing ids.

- :class:`MmapIO` (our default): maps the file and closes its descriptor at once, so any
  number of open shards cost no file descriptors; reads are memory slices, no syscall.
- :class:`PosixPreadIO`: ``os.pread`` on a descriptor held while open; thread-safe, no seek.
- :class:`SeekIO`: ``seek`` + ``read`` on a buffered file under a lock (GuideLoom's default).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import PurePath
from typing import Any

from guideloom_pipes.types import Buffer, SyncByteReader


def _not_open(path: PurePath) -> RuntimeError:
    return RuntimeError(
        f"reader of {os.fspath(path)} is not open; call open() or use it in a `with` block"
    )


class _AsyncAdapter:
    """Runs a sync byte reader's calls in a worker thread so an event loop never blocks."""

    def __init__(self, reader: SyncByteReader) -> None:
        self._reader = reader

    async def open(self) -> None:
        await asyncio.to_thread(self._reader.open)

    async def close(self) -> None:
        self._reader.close()

    async def filesize(self) -> int:
        return self._reader.filesize()

    async def read(self, offset: int, size: int) -> Buffer:
        return await asyncio.to_thread(self._reader.read, offset, size)

    async def __aenter__(self) -> _AsyncAdapter:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _LocalBackend:
    """Shared parts of the local-file backends: listing, async adapters, equality."""

    #: Whether an open reader holds a file descriptor (the storage bounds how many stay open).
    holds_fd = True

    def sync_reader(self, path: PurePath) -> SyncByteReader:  # pragma: no cover - abstract
        raise NotImplementedError

    def async_reader(self, path: PurePath) -> _AsyncAdapter:
        """An ``async`` reader of ``path`` (calls run in a worker thread)."""
        return _AsyncAdapter(self.sync_reader(path))

    def list_dir(self, path: PurePath) -> Iterable[str]:
        """Names of the entries in directory ``path``."""
        return os.listdir(os.fspath(path))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash(type(self))


def _load_libc() -> Any:
    """libc's ``mmap``/``munmap`` through ctypes, or None where they are not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


#: Python >= 3.13 can map a file without keeping a duplicate of its descriptor.
_TRACKFD = sys.version_info >= (3, 13)
_LIBC: Any = None if _TRACKFD or os.name != "posix" else _load_libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Unmapper:
    """Owns one ``libc.mmap`` mapping; unmaps it when the last view of it is gone."""

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size
        self._munmap = _LIBC.munmap  # bound now: module globals may be gone at shutdown

    def __del__(self) -> None:
        self._munmap(self.address, self.size)


def _map_file(fd: int, size: int) -> Any:
    """A read-only mapping of the open file ``fd`` that keeps no file descriptor.

    ``mmap.mmap`` duplicates the descriptor and holds the duplicate as long as the map lives
    (before Python 3.13, always): a dataset of thousands of mapped shards would run out of
    descriptors. So: ``trackfd=False`` where Python has it, else libc's ``mmap`` directly,
    else (not POSIX) a plain ``mmap.mmap``.
    """
    if _TRACKFD:
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ, trackfd=False)  # type: ignore[call-arg,unused-ignore]
    if _LIBC is None:
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        error = ctypes.get_errno()
        raise OSError(error, f"mmap failed: {os.strerror(error)}")
    array = (ctypes.c_ubyte * size).from_address(address)
    array._unmapper = _Unmapper(address, size)  # type: ignore[attr-defined]  # lives with views
    return array


class _MmapReader:
    def __init__(self, path: PurePath) -> None:
        self.path = path
        self._map: Any = None  # an mmap.mmap, or a ctypes array over a libc mapping
        self._size = -1

    def open(self) -> None:
        if self._size >= 0:
            return
        fd = os.open(os.fspath(self.path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            self._map = _map_file(fd, size) if size else None
        finally:
            os.close(fd)  # the mapping keeps the file; no descriptor stays open
        self._size = size

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap):
            # A view may still be alive somewhere; the map is then freed with it.
            with contextlib.suppress(BufferError):
                self._map.close()
        self._map = None  # a libc mapping is unmapped when its last view is gone
        self._size = -1

    def filesize(self) -> int:
        if self._size < 0:
            raise _not_open(self.path)
        return self._size

    def buffer(self) -> memoryview:
        """The whole file as a read-only memoryview (stays valid while it is referenced)."""
        if self._size < 0:
            raise _not_open(self.path)
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map).cast("B").toreadonly()

    def read(self, offset: int, size: int) -> Buffer:
        if self._size < 0:
            raise _not_open(self.path)
        if self._map is None:
            return b""
        return bytes(self.buffer()[offset : offset + size])


class MmapIO(_LocalBackend):
    """Memory-mapped reads (the default backend).

    Opening a file maps it and closes the descriptor immediately, so thousands of open shards
    need no file descriptors; a read is a slice of the mapping with no system call.
    """

    holds_fd = False

    def sync_reader(self, path: PurePath) -> _MmapReader:
        """A reader of ``path``."""
        return _MmapReader(path)


class _PreadReader:
    def __init__(self, path: PurePath, advice: bool) -> None:
        self.path = path
        self.advice = advice
        self._fd = -1
        self._size = -1

    def open(self) -> None:
        if self._fd >= 0:
            return
        fd = os.open(os.fspath(self.path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._size = os.fstat(fd).st_size
        if self.advice and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._fd = fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1

    def filesize(self) -> int:
        if self._fd < 0:
            raise _not_open(self.path)
        return self._size

    def read(self, offset: int, size: int) -> Buffer:
        if self._fd < 0:
            raise _not_open(self.path)
        data = os.pread(self._fd, size, offset)
        while len(data) < size:  # pread may return short reads on some file systems
            more = os.pread(self._fd, size - len(data), offset + len(data))
            if not more:
                break
            data += more
        return data


class PosixPreadIO(_LocalBackend):
    """``os.pread`` reads: one descriptor per open file, no seeking, safe across threads.

    Args:
        advice: tell the kernel reads are random (``POSIX_FADV_RANDOM``), which stops
            read-ahead from wasting I/O on shuffled access.
    """

    def __init__(self, advice: bool = False) -> None:
        self.advice = advice

    def sync_reader(self, path: PurePath) -> _PreadReader:
        """A reader of ``path``."""
        return _PreadReader(path, self.advice)

    def __repr__(self) -> str:
        return f"PosixPreadIO(advice={self.advice})"


class _SeekReader:
    def __init__(self, path: PurePath) -> None:
        self.path = path
        self._file: Any = None
        self._size = -1
        self._lock = threading.Lock()

    def open(self) -> None:
        if self._file is not None:
            return
        self._file = open(os.fspath(self.path), "rb")  # noqa: SIM115 - closed in close()
        self._size = os.fstat(self._file.fileno()).st_size

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None

    def filesize(self) -> int:
        if self._file is None:
            raise _not_open(self.path)
        return self._size

    def read(self, offset: int, size: int) -> Buffer:
        if self._file is None:
            raise _not_open(self.path)
        with self._lock:
            self._file.seek(offset)
            return self._file.read(size)


class SeekIO(_LocalBackend):
    """``seek`` + ``read`` on a buffered file object (serialised by a lock per file)."""

    def sync_reader(self, path: PurePath) -> _SeekReader:
        """A reader of ``path``."""
        return _SeekReader(path)


def resolve_backend(read_interface: Any) -> Any:
    """The backend object for a storage's ``read_interface`` argument.

    ``None`` gives :class:`MmapIO`; a backend class is instantiated with no arguments; an
    object with ``sync_reader`` is used as is.
    """
    if read_interface is None:
        return MmapIO()
    if isinstance(read_interface, type):
        read_interface = read_interface()
    if not callable(getattr(read_interface, "sync_reader", None)):
        raise TypeError(
            f"read_interface must be a read backend with sync_reader(path) (e.g. MmapIO(), "
            f"PosixPreadIO(), SeekIO()), got {read_interface!r}"
        )
    return read_interface


__all__ = ["MmapIO", "PosixPreadIO", "SeekIO", "resolve_backend"]
