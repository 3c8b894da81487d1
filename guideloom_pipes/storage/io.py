"""Read backends: byte-range readers for one file each.

A backend follows GuideLoom's convention (:class:`~guideloom_pipes.types.IOReaderAbstract`):
``backend.sync_reader()`` / ``backend.async_reader()`` return *factories*, which are called
with a path and give readers with ``open()``, ``close()``, ``filesize()`` and
``read(offset, size)``. The built-in backends also implement ``list_dir(path)`` so that
shard discovery can list a directory (and so detect a missing shard) instead of probing ids.

A reader may also offer ``readinto(offset, buffer)``, filling a writable byte buffer and
returning the bytes read (fewer only at the end of the file): stream windows are then read
straight into the output array, with no intermediate buffer or copy. The byte-range
backends below have it; readers without it are read with ``read`` and copied.

The storages reach every backend through :func:`resolve_backend`.

- :class:`MmapIO` (our default): maps the file and closes its descriptor at once, so any
  number of open shards cost no file descriptors; reads are memory slices, no syscall.
- :class:`PosixPreadIO`: ``os.pread`` on a descriptor held while open; thread-safe, no seek.
- :class:`SeekIO`: ``seek`` + ``read`` on a buffered file under a lock (GuideLoom's default).

What they share with every backend of ours (``BackendBase``) is in ``backend_base.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import PurePath
from typing import Any

from guideloom_pipes.storage.backend_base import (
    _AsyncAdapter,
    _identity,
    _LocalBackend,
    _not_open,
    _regular_file,
)
from guideloom_pipes.types import AsyncByteReader, IOSyncReaderAbstract, SyncByteReader


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


class _MmapReader(IOSyncReaderAbstract):
    def __init__(self, path: PurePath) -> None:
        self.path = path
        self._map: Any = None  # an mmap.mmap, or a ctypes array over a libc mapping
        self._size = -1
        #: ``(st_dev, st_ino)`` of the file opened (None before): the file this reader
        #: reads, whatever its path names since
        self.identity: tuple[int, int] | None = None

    def open(self) -> None:
        if self._size >= 0:
            return
        fd = os.open(os.fspath(self.path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            info = _regular_file(fd, self.path)
            size = info.st_size
            self._map = _map_file(fd, size) if size else None
        finally:
            os.close(fd)  # the mapping keeps the file; no descriptor stays open
        self._size = size
        self.identity = _identity(info)

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

    def read(self, offset: int, size: int) -> bytearray:
        if self._size < 0:
            raise _not_open(self.path)
        if self._map is None:
            return bytearray()
        return bytearray(self.buffer()[offset : offset + size])


class MmapIO(_LocalBackend):
    """Memory-mapped reads (the default backend).

    Opening a file maps it and closes the descriptor immediately, so thousands of open shards
    need no file descriptors; a read is a slice of the mapping with no system call. A file
    truncated in place while it is mapped kills the process with SIGBUS at the next read of
    the lost pages: where files can change under a reader, use :class:`PosixPreadIO`.
    """

    holds_fd = False

    @staticmethod
    def is_supported() -> bool:
        """Whether files can be memory-mapped here."""
        return hasattr(mmap, "mmap")

    def _make(self, path: PurePath) -> _MmapReader:
        return _MmapReader(path)


class _PreadReader(IOSyncReaderAbstract):
    def __init__(self, path: PurePath, advice: bool = False) -> None:
        self.path = path
        self.advice = advice
        self._fd = -1
        self._size = -1
        #: ``(st_dev, st_ino)`` of the file opened (None before)
        self.identity: tuple[int, int] | None = None

    def open(self) -> None:
        if self._fd >= 0:
            return
        fd = os.open(os.fspath(self.path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            info = _regular_file(fd, self.path)
        except OSError:
            os.close(fd)
            raise
        self._size = info.st_size
        self.identity = _identity(info)
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

    def read(self, offset: int, size: int) -> bytearray:
        if self._fd < 0:
            raise _not_open(self.path)
        out = bytearray(size)
        with memoryview(out) as view:
            got = self.readinto(offset, view)
        del out[got:]  # past the end of the file: what there was
        return out

    def readinto(self, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` (writable bytes) from ``offset``; the bytes read, fewer only at the
        end of the file. One system call, straight into ``buffer``: no copy."""
        fd = self._fd
        if fd < 0:
            raise _not_open(self.path)
        if not _HAS_PREADV:  # pragma: no cover - platforms without preadv
            return _pread_into(fd, offset, buffer)
        size = len(buffer)
        got = os.preadv(fd, (buffer,), offset)
        while 0 < got < size:  # short reads happen on some file systems
            count = os.preadv(fd, (buffer[got:],), offset + got)
            if count <= 0:
                break
            got += count
        return got


def _pread_into(fd: int, offset: int, buffer: memoryview) -> int:  # pragma: no cover
    size, got = len(buffer), 0
    while got < size:
        data = os.pread(fd, size - got, offset + got)
        if not data:
            break
        buffer[got : got + len(data)] = data
        got += len(data)
    return got


_HAS_PREADV = hasattr(os, "preadv")


class PosixPreadIO(_LocalBackend):
    """``os.pread`` reads: one descriptor per open file, no seeking, safe across threads.

    The backend for file systems where files can change under a running reader (network
    file systems, files other tools rewrite in place): a read of a file that shrank comes
    back short and the storage raises ``CorruptShardError`` naming it, where a memory map
    would take a SIGBUS.

    Args:
        advice: tell the kernel reads are random (``POSIX_FADV_RANDOM``), which stops
            read-ahead from wasting I/O on shuffled access.
    """

    def __init__(self, advice: bool = False) -> None:
        self.advice = advice

    @staticmethod
    def is_supported(*, advice: bool = False) -> bool:
        """Whether ``os.pread`` (and, with ``advice``, ``posix_fadvise``) exists here."""
        return hasattr(os, "pread") and (not advice or hasattr(os, "posix_fadvise"))

    def _make(self, path: PurePath) -> _PreadReader:
        return _PreadReader(path, self.advice)

    def __repr__(self) -> str:
        return f"PosixPreadIO(advice={self.advice})"


class _SeekReader(IOSyncReaderAbstract):
    def __init__(self, path: PurePath) -> None:
        self.path = path
        self._file: Any = None
        self._size = -1
        self._lock = threading.Lock()
        #: ``(st_dev, st_ino)`` of the file opened (None before)
        self.identity: tuple[int, int] | None = None

    def open(self) -> None:
        if self._file is not None:
            return
        self._file = open(os.fspath(self.path), "rb")  # noqa: SIM115 - closed in close()
        info = os.fstat(self._file.fileno())
        self._size = info.st_size
        self.identity = _identity(info)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None

    def filesize(self) -> int:
        if self._file is None:
            raise _not_open(self.path)
        return self._size

    def read(self, offset: int, size: int) -> bytearray:
        if self._file is None:
            raise _not_open(self.path)
        out = bytearray(size)
        with memoryview(out) as view:
            got = self.readinto(offset, view)
        del out[got:]  # past the end of the file: what there was
        return out

    def readinto(self, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` (writable bytes) from ``offset``; the bytes read, fewer only at the
        end of the file."""
        if self._file is None:
            raise _not_open(self.path)
        size = len(buffer)
        with self._lock:
            self._file.seek(offset)
            got = 0
            while got < size:
                count = self._file.readinto(buffer[got:])
                if not count:
                    break
                got += count
        return got


class SeekIO(_LocalBackend):
    """``seek`` + ``read`` on a buffered file object (serialised by a lock per file)."""

    def _make(self, path: PurePath) -> _SeekReader:
        return _SeekReader(path)


def _takes_path(method: Callable[..., Any]) -> bool:
    """Whether a backend's ``sync_reader``/``async_reader`` requires an argument (the path:
    the path-taking form of version 0.1, which is refused)."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # no signature (a builtin, say): take it as a factory
        return False
    return any(
        parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
        and parameter.default is parameter.empty
        for parameter in signature.parameters.values()
    )


def _factory_of(method: Callable[[], Any], backend: Any, name: str) -> Callable[[], Any]:
    """``method`` (a backend's ``sync_reader`` or ``async_reader``), checked to take no
    argument: it returns a factory of readers."""
    if _takes_path(method):
        kind = type(backend).__name__
        raise TypeError(
            f"{kind}.{name}(path) takes the path: a read backend's {name}() takes no "
            f"argument and returns a factory of readers, called with the path (GuideLoom's "
            f"convention; the path-taking form was removed). Rename the method, e.g. to "
            f"open_reader(path), and add `def {name}(self): return self.open_reader`"
        )
    return method


def _call_factory(method: Callable[[], Any], backend: Any, name: str) -> Callable[[Any], Any]:
    factory = method()
    if not callable(factory):
        raise TypeError(
            f"{type(backend).__name__}.{name}() must return a factory of readers (a callable "
            f"taking the path), got {factory!r}"
        )
    return factory


class ResolvedBackend:
    """A read backend behind one calling convention (what the storages use internally).

    Attributes:
        backend: the backend object itself.
        holds_fd: whether its open readers hold a file descriptor (``holds_fd`` attribute
            of the backend, default True: the storage bounds how many stay open).
        list_dir: the backend's ``list_dir(path)``, or None (discovery then probes ids).
        local: whether it is one of the built-in local-file backends (discovery may then
            list the directory with ``os.scandir`` and check write locks).
    """

    __slots__ = ("_async_factory", "_sync_factory", "backend", "holds_fd", "list_dir", "local")

    def __init__(self, backend: Any) -> None:
        sync_reader = getattr(backend, "sync_reader", None)
        if not callable(sync_reader):
            raise TypeError(
                f"read_interface must be a read backend with sync_reader() (e.g. MmapIO(), "
                f"PosixPreadIO(), SeekIO(), or a subclass of "
                f"guideloom_pipes.types.IOReaderAbstract), got {backend!r}"
            )
        self.backend = backend
        self.local = isinstance(backend, _LocalBackend)
        self.holds_fd = bool(getattr(backend, "holds_fd", True))
        list_dir = getattr(backend, "list_dir", None)
        self.list_dir: Callable[[PurePath], Iterable[str]] | None = (
            list_dir if callable(list_dir) else None
        )
        self._sync_factory: Callable[[Any], SyncByteReader] = _call_factory(
            _factory_of(sync_reader, backend, "sync_reader"), backend, "sync_reader"
        )
        async_reader = getattr(backend, "async_reader", None)
        self._async_factory: Callable[[Any], AsyncByteReader] | None = None
        if callable(async_reader):
            async_reader = _factory_of(async_reader, backend, "async_reader")
            self._async_factory = functools.partial(_lazy_async_factory, async_reader, backend)

    def reader(self, path: PurePath) -> SyncByteReader:
        """A (not yet open) sync reader of ``path``."""
        return self._sync_factory(path)

    def async_reader(self, path: PurePath) -> AsyncByteReader:
        """A (not yet open) ``async`` reader of ``path``; a backend without
        ``async_reader`` gets its sync reader run in a worker thread."""
        if self._async_factory is None:
            return _AsyncAdapter(self.reader(path))
        return self._async_factory(path)

    def __repr__(self) -> str:
        return f"ResolvedBackend({self.backend!r})"


def _lazy_async_factory(method: Callable[[], Any], backend: Any, path: PurePath) -> Any:
    # GuideLoom-style async factories are asked for only when an async reader is wanted.
    return _call_factory(method, backend, "async_reader")(path)


def resolve_backend(read_interface: Any) -> ResolvedBackend:
    """The backend for a storage's ``read_interface`` argument, behind one convention.

    ``None`` gives :class:`MmapIO`; a backend class is instantiated with no arguments; an
    object with ``sync_reader`` is used as is (``sync_reader()`` returns a factory taking
    the path; a ``sync_reader(path)`` that takes the path is refused with a ``TypeError``
    saying how to change it). A :class:`ResolvedBackend` is returned unchanged.
    """
    if isinstance(read_interface, ResolvedBackend):
        return read_interface
    if read_interface is None:
        read_interface = MmapIO()
    elif isinstance(read_interface, type):
        read_interface = read_interface()
    return ResolvedBackend(read_interface)


__all__ = ["MmapIO", "PosixPreadIO", "ResolvedBackend", "SeekIO", "resolve_backend"]
