"""What every read backend of ours shares: :class:`BackendBase` (GuideLoom's reader
factories over one ``_make(path)``), the local-file backends' base, the adapter that
runs a sync reader for an event loop, the checks of an opened file, and the budget of
descriptors a storage reader's readers may hold (:func:`max_open_per_kind`).
"""

from __future__ import annotations

import asyncio
import functools
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import PurePath
from types import TracebackType
from typing import Any

from guideloom_pipes.types import (
    IOAsyncReaderAbstract,
    IOReaderAbstract,
    IOSyncReaderAbstract,
    SyncByteReader,
)


def _not_open(path: PurePath) -> RuntimeError:
    return RuntimeError(
        f"reader of {os.fspath(path)} is not open; call open() or use it in a `with` block"
    )


def _identity(info: os.stat_result) -> tuple[int, int]:
    """Which file ``info`` is: ``(st_dev, st_ino)`` (a local reader's ``identity``, and what
    a listing records of each shard file)."""
    return info.st_dev, info.st_ino


def _regular_file(fd: int, path: PurePath) -> os.stat_result:
    """``os.fstat(fd)`` of the open file ``fd``; a clear error naming ``path`` if it is not
    a regular file (a directory, say: mapping or reading it fails with a bare errno)."""
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode):
        return info
    what = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
    error = IsADirectoryError if stat.S_ISDIR(info.st_mode) else OSError
    raise error(
        f"{os.fspath(path)} is {what}, so it cannot be read as a shard file; move it away "
        f"and put the shard's file there (rewrite the shard if it is lost)"
    )


#: Most descriptors one file kind of a storage reader keeps open (an LRU closes the rest).
MAX_OPEN_PER_KIND = 64


def descriptor_limit() -> int | None:
    """The process's soft limit on open file descriptors (``ulimit -n``), or None where it
    is unlimited or unknown."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


#: Linux's default ``vm.max_map_count``.
DEFAULT_MAP_LIMIT = 65530


@functools.lru_cache(maxsize=1)
def map_limit() -> int:
    """The most memory mappings a process may hold (Linux's ``vm.max_map_count``, 65,530 by
    default; that default where it cannot be read). Past it, ``mmap`` fails with
    ``ENOMEM``."""
    try:
        with open("/proc/sys/vm/max_map_count") as file:
            return max(64, int(file.read().strip()))
    except (OSError, ValueError):
        return DEFAULT_MAP_LIMIT


def max_mapped_per_kind() -> int:
    """How many shards' files one file kind of a storage reader keeps mapped at once (the
    oldest mapped is let go past it): an eighth of :func:`map_limit` (8,191 by default), so
    that several readers and kinds in one process stay under the kernel's limit."""
    return max(8, map_limit() // 8)


def max_open_per_kind(kinds: int = 3) -> int:
    """How many descriptor-holding readers each of a storage reader's ``kinds`` file kinds
    may keep open: :data:`MAX_OPEN_PER_KIND`, but together at most half the process limit
    (the other half is left to the rest of the process), and at least 1 each."""
    limit = descriptor_limit()
    if limit is None:
        return MAX_OPEN_PER_KIND
    return max(1, min(MAX_OPEN_PER_KIND, limit // 2 // max(1, kinds)))


class _AsyncAdapter(IOAsyncReaderAbstract):
    """Runs a sync byte reader's calls in a worker thread so an event loop never blocks."""

    def __init__(self, reader: SyncByteReader) -> None:
        self._reader = reader

    async def open(self) -> None:
        await asyncio.to_thread(self._reader.open)

    async def close(self) -> None:
        self._reader.close()

    def close_sync(self) -> None:
        self._reader.close()

    async def filesize(self) -> int:
        return self._reader.filesize()

    async def read(self, offset: int, size: int) -> Any:
        return await asyncio.to_thread(self._reader.read, offset, size)

    async def __aenter__(self) -> _AsyncAdapter:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


class BackendBase(IOReaderAbstract[PurePath]):
    """The reader factories every backend of ours shares: ``sync_reader()`` and
    ``async_reader()`` in GuideLoom's form (a factory of readers) and in ours (given a path,
    that path's reader), over the one method a backend defines, ``_make(path)``."""

    def _make(self, path: PurePath) -> IOSyncReaderAbstract:  # pragma: no cover - abstract
        raise NotImplementedError

    def _make_async(self, path: PurePath) -> _AsyncAdapter:
        return _AsyncAdapter(self._make(path))

    def sync_reader(self) -> Callable[[PurePath], IOSyncReaderAbstract]:
        """A factory of readers: ``backend.sync_reader()(path)`` (GuideLoom's convention)."""
        return self._make

    def async_reader(self) -> Callable[[PurePath], IOAsyncReaderAbstract]:
        """A factory of ``async`` readers (calls run in a worker thread)."""
        return self._make_async


class _LocalBackend(BackendBase):
    """Shared parts of the local-file backends: listing, equality."""

    #: Whether an open reader holds a file descriptor (the storage bounds how many stay open).
    holds_fd = True

    @staticmethod
    def is_supported() -> bool:
        """Whether this backend works here."""
        return True

    def list_dir(self, path: PurePath) -> Iterable[str]:
        """Names of the entries in directory ``path``."""
        return os.listdir(os.fspath(path))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash(type(self))
