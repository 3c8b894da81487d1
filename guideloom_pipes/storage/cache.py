"""The node-local shard cache of remote datasets: :class:`ShardCache` keeps whole shard
files downloaded from a URL in a local directory, shared by every process and rank of a
node, and hands them out memory-mapped.

Layout of a cache directory (``cache_dir=``)::

    entries/<key>-<file name>    complete, checked copies (immutable, read memory-mapped)
    partial/<key>.<pid>.<n>      downloads in progress (never read as data)
    locks/<key>                  one lock file per entry (fcntl.flock)
    evict.lock                   held while an eviction scans the entries

The key is a hash of the object's URL, its size, and the CRC-32 of its commit record (or,
for a shard without a record, the object's ETag), so a replaced shard gets another entry
and a stale copy is never served. A download happens under the entry's exclusive lock:
every other process or thread that wants the same file waits on the lock, then maps the
entry the first one renamed into place. A download is written under ``partial/``, its size
and CRC-32 checked against the record, flushed, and only then renamed to its entry name,
so a download that fails or is killed leaves nothing a reader takes for data (the next
eviction scan deletes what it left).

``limit_bytes`` bounds the entries: after each download the least recently used entries
(by modification time, which each use of an entry renews) are deleted until the rest fit.
An entry a reader of this node has mapped may be deleted: on Linux the mapping stays valid
after the unlink, and the space returns when the last mapping is gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import os
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guideloom_pipes.storage.errors import CorruptShardError
from guideloom_pipes.storage.io import _MmapReader

#: bytes downloaded per ranged request (each retried on its own)
DOWNLOAD_CHUNK = 16 << 20
_COUNTER = itertools.count()


@dataclass(frozen=True)
class CachedFile:
    """What the cache must hold for one remote file: its URL, its size, and the CRC-32 of
    its commit record (None: a shard without a record) and the object's ETag (None: the
    server gave none)."""

    url: str
    size: int
    crc32: int | None
    etag: str | None = None

    @property
    def key(self) -> str:
        """The entry's key: the URL, size and checksum (or ETag) hashed."""
        identity = f"{self.url}\0{self.size}\0{self.crc32}\0"
        if self.crc32 is None:
            identity += str(self.etag)
        return hashlib.sha256(identity.encode()).hexdigest()[:32]

    @property
    def entry_name(self) -> str:
        """The entry's file name: the key, then the object's own name (for people)."""
        return f"{self.key}-{self.url.rpartition('/')[2]}"


@contextlib.contextmanager
def _flock(path: Path, operation: int = fcntl.LOCK_EX) -> Iterator[bool]:
    """Hold ``flock(operation)`` on ``path`` (made if missing) in the block; yields False
    (and holds nothing) where ``operation`` has ``LOCK_NB`` and another holder has it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, operation)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                yield False
                return
            raise
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class ShardCache:
    """A node-local directory of whole remote files, bounded and shared through file locks.

    Args:
        directory: the cache directory (made if missing); on a local disk of the node, the
            same for every process and rank that reads the same datasets.
        limit_bytes: most bytes of entries kept (least recently used deleted first), or
            None for no bound.
    """

    def __init__(self, directory: str | os.PathLike[str], limit_bytes: int | None = None) -> None:
        if isinstance(directory, str) and "://" in directory:
            raise ValueError(
                f"cache_dir={directory!r} is a URL; the shard cache is a local directory "
                f"(a node-local disk, e.g. cache_dir='/local/scratch/guideloom-cache')"
            )
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a local path, got {directory!r}")
        if limit_bytes is not None and (
            isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0
        ):
            raise ValueError(
                f"cache_limit_bytes must be a number of bytes > 0, or None for no bound, got "
                f"{limit_bytes!r} (e.g. cache_limit_bytes=200 * 2**30)"
            )
        self.directory = Path(directory)
        self.limit_bytes = limit_bytes
        self._made = False

    def _ensure(self) -> None:
        if not self._made:
            for sub in ("entries", "partial", "locks"):
                (self.directory / sub).mkdir(parents=True, exist_ok=True)
            self._made = True

    def entry_path(self, file: CachedFile) -> Path:
        """Where ``file``'s complete copy lives (whether or not it is there yet)."""
        return self.directory / "entries" / file.entry_name

    def open(self, file: CachedFile, download: Callable[[int, int], Any]) -> _MmapReader:
        """``file``'s copy, open and memory-mapped; downloaded first if no process of this
        node has it (``download(offset, size)`` returns those bytes of the object).

        Raises :class:`CorruptShardError` if the download's size or CRC-32 differs from
        ``file``'s, and whatever ``download`` raises; either way nothing is cached."""
        self._ensure()
        path = self.entry_path(file)
        reader = self._open_entry(path)
        if reader is not None:
            return reader
        with _flock(self.directory / "locks" / file.key):
            reader = self._open_entry(path)  # another process finished it meanwhile
            if reader is None:
                self._download(file, path, download)
                reader = self._open_entry(path)
                assert reader is not None  # under our lock, nobody evicts it
        self.evict()
        return reader

    def _open_entry(self, path: Path) -> _MmapReader | None:
        reader = _MmapReader(path)
        try:
            reader.open()
        except FileNotFoundError:
            return None
        now = time.time_ns()  # fine-grained (file systems stamp "now" coarsely)
        with contextlib.suppress(FileNotFoundError):  # evicted since: the mapping stays
            os.utime(path, ns=(now, now))  # used now: the least recently used go first
        return reader

    def _download(self, file: CachedFile, path: Path, download: Callable[[int, int], Any]) -> None:
        partial = self.directory / "partial" / f"{file.key}.{os.getpid()}.{next(_COUNTER)}"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            crc, got = 0, 0
            with os.fdopen(fd, "wb", closefd=False) as out:
                for offset in range(0, file.size, DOWNLOAD_CHUNK):
                    data = download(offset, min(DOWNLOAD_CHUNK, file.size - offset))
                    crc = zlib.crc32(data, crc)
                    got += len(data)
                    out.write(data)
            if got != file.size or (file.crc32 is not None and crc != file.crc32):
                raise CorruptShardError(
                    f"the download of {file.url} does not match its commit record: crc32 "
                    f"{crc:#010x} over {got} bytes, committed "
                    f"{(file.crc32 or 0):#010x} over {file.size} bytes. The object changed "
                    f"after it was committed; restore it or rewrite the shard (nothing was "
                    f"cached)"
                )
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(partial, path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            raise

    def evict(self) -> None:
        """Delete least recently used entries until the rest fit ``limit_bytes``, and the
        partial downloads of processes that stopped; an entry being downloaded or mapped
        right now by this call's peers is skipped (its lock is held)."""
        if self.limit_bytes is None:
            self._clean_partials()
            return
        self._ensure()
        with _flock(self.directory / "evict.lock"):
            self._clean_partials()
            entries = []
            for entry in os.scandir(self.directory / "entries"):
                with contextlib.suppress(FileNotFoundError):
                    info = entry.stat()
                    entries.append((info.st_mtime_ns, entry.name, info.st_size))
            total = sum(size for _, _, size in entries)
            for _, name, size in sorted(entries):
                if total <= self.limit_bytes:
                    break
                key = name.partition("-")[0]
                with _flock(self.directory / "locks" / key, fcntl.LOCK_EX | fcntl.LOCK_NB) as ok:
                    if not ok:
                        continue  # being downloaded or opened right now
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.directory / "entries" / name)
                total -= size

    def _clean_partials(self) -> None:
        """Delete partial downloads no live download holds the lock of."""
        partial = self.directory / "partial"
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(partial):
                key = entry.name.partition(".")[0]
                with _flock(self.directory / "locks" / key, fcntl.LOCK_EX | fcntl.LOCK_NB) as ok:
                    if ok:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)

    def size(self) -> int:
        """Bytes of entries in the cache now."""
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory / "entries"):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat().st_size
        return total

    def __repr__(self) -> str:
        return f"ShardCache({os.fspath(self.directory)!r}, limit_bytes={self.limit_bytes})"

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "limit_bytes": self.limit_bytes, "_made": False}


__all__ = ["DOWNLOAD_CHUNK", "CachedFile", "ShardCache"]
