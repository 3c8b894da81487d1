"""The node-local shard cache of remote datasets: :class:`ShardCache` keeps whole shard
files downloaded from a URL in a local directory, shared by every process and rank of a
node, and hands them out memory-mapped.

Layout of a cache directory (``cache_dir=``)::

    entries/<key>-<file name>    complete, checked copies (immutable, read memory-mapped)
    verified/<key>               what an entry was when it was last checked (see below);
                                 its modification time is the entry's last use
    partial/<key>.<pid>.<n>      downloads and markers being written (never read as data)
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

An entry is checked again whenever a process maps it, as cheaply as that can be sound: its
marker ``verified/<key>`` holds the entry's device, inode, size, modification and change
times (``st_ctime``, which a write sets and ``touch`` or ``rsync -a`` cannot set back) as
they were when the entry's bytes were last checked, at its download or by a full CRC-32 of
the entry against the record. A map whose entry still has those costs two ``stat`` calls
and the read of the marker; otherwise the entry is checked whole under its lock (its CRC-32
computed), and one that fails (a byte changed, a truncation, an emptied file) is deleted
with a warning naming it and downloaded again. A change made to an entry while a process
has it mapped reaches that mapping and is not seen until the next map.

``limit_bytes`` bounds the entries: after each download the least recently used entries
(by the modification time of their marker, which each use renews) are deleted until the
rest fit. An entry a reader of this node has mapped may be deleted: on Linux the mapping
stays valid after the unlink, and the space returns when the last mapping is gone, so the
disk holds the bound plus the deleted entries still mapped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import os
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guideloom_pipes.checks import check_int
from guideloom_pipes.storage.errors import CorruptShardError
from guideloom_pipes.storage.io import _MmapReader

#: bytes downloaded per ranged request (each retried on its own)
DOWNLOAD_CHUNK = 16 << 20
_COUNTER = itertools.count()
#: the first word of a marker (``verified/<key>``) this version writes and trusts
_MARKER = "guideloom-pipes-verified-1"
#: errors of a disk with no room for what is written (EFBIG: a file size limit, ulimit -f)
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: errors of a directory this process may not write
_READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


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


def _identity(info: os.stat_result) -> tuple[int, ...]:
    """What a marker records of an entry: any write to it, a truncation, a replacement
    changes one of these (a write sets the change time, which tools cannot set back)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


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

    Each entry is checked when a process maps it: against the marker written when its
    bytes were last checked (two ``stat`` calls), or, where the entry changed since, by
    its size and CRC-32 against the commit record; a damaged entry is deleted with a
    warning and downloaded again.

    Args:
        directory: the cache directory (made if missing); on a local disk of the node, the
            same for every process and rank that reads the same datasets.
        limit_bytes: most bytes of entries kept (least recently used deleted first), or
            None for no bound. Entries deleted while a reader still maps them keep their
            disk space until it closes them, which the bound does not count.
    """

    def __init__(self, directory: str | os.PathLike[str], limit_bytes: int | None = None) -> None:
        if isinstance(directory, str) and "://" in directory:
            raise ValueError(
                f"cache_dir={directory!r} is a URL; the shard cache is a local directory "
                f"(a node-local disk, e.g. cache_dir='/local/scratch/guideloom-cache')"
            )
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a local path, got {directory!r}")
        try:
            check_int("cache_limit_bytes", limit_bytes, minimum=1, allow_none=True)
        except (TypeError, ValueError):
            raise ValueError(
                f"cache_limit_bytes must be a number of bytes > 0, or None for no bound, got "
                f"{limit_bytes!r} (e.g. cache_limit_bytes=200 * 2**30)"
            ) from None
        self.directory = Path(directory)
        self.limit_bytes = limit_bytes
        self._made = False

    def _ensure(self) -> None:
        if not self._made:
            for sub in ("entries", "verified", "partial", "locks"):
                with self._writing("make the directory", self.directory / sub):
                    (self.directory / sub).mkdir(parents=True, exist_ok=True)
            self._made = True

    @contextlib.contextmanager
    def _writing(self, what: str, path: Path) -> Iterator[None]:
        """Run the block, a change to the cache's own files; an ``OSError`` of it becomes
        one (of the same errno) naming ``path`` and what to do."""
        try:
            yield
        except OSError as error:
            raise self._error(error, what, path) from error

    def _error(self, error: OSError, what: str, path: Path) -> OSError:
        where = os.fspath(self.directory)
        reason = error.strerror or str(error)
        if error.errno in _FULL:
            bound = f"now {self.limit_bytes!r}"
            fix = (
                f"The disk of the shard cache {where} is full (or this process may not write "
                f"files this large: ulimit -f). Free space on it, set cache_limit_bytes= "
                f"({bound}) low enough to leave room for the largest shard, or give "
                f"cache_dir= a directory on a disk with room"
            )
        elif error.errno in _READ_ONLY:
            fix = (
                f"The shard cache {where} is read-only for this process. Give cache_dir= a "
                f"directory on a local disk this process may write (the same for every rank "
                f"of the node), or drop cache_dir= to read in range mode"
            )
        else:
            fix = f"Check the disk of the shard cache {where}, or give cache_dir= another directory"
        # OSError(errno, text) is the errno's own subclass (PermissionError, ...)
        return OSError(error.errno, f"the shard cache could not {what} {path}: {reason}. {fix}")

    def entry_path(self, file: CachedFile) -> Path:
        """Where ``file``'s complete copy lives (whether or not it is there yet)."""
        return self.directory / "entries" / file.entry_name

    def _marker_path(self, file: CachedFile) -> Path:
        return self.directory / "verified" / file.key

    def open(self, file: CachedFile, download: Callable[[int, int], Any]) -> _MmapReader:
        """``file``'s copy, open and memory-mapped; downloaded first if no process of this
        node has it (``download(offset, size)`` returns those bytes of the object).

        The entry is checked first: unchanged since its last check (its marker), or else
        its size and CRC-32 against ``file``'s; a damaged entry is deleted, with a
        warning naming it, and downloaded again.

        Raises :class:`CorruptShardError` if the download's size or CRC-32 differs from
        ``file``'s, and whatever ``download`` raises; either way nothing is cached. An
        ``OSError`` writing the cache (a full disk, a read-only directory) names the path
        and the fix."""
        self._ensure()
        path = self.entry_path(file)
        reader = self._open_unchanged(file, path)
        if reader is not None:
            return reader
        with contextlib.ExitStack() as stack:
            lock = self.directory / "locks" / file.key
            with self._writing("open the lock file", lock):
                stack.enter_context(_flock(lock))
            reader = self._open_checked(file, path)  # or another process finished it
            if reader is None:
                self._download(file, path, download)
                reader = self._map(path)  # checked as it came
                assert reader is not None  # under our lock, nobody evicts it
                self._touch(file)
        self.evict()
        return reader

    def _marker(self, file: CachedFile) -> tuple[tuple[int, ...], int] | None:
        """The identity and CRC-32 of ``file``'s entry when it was last checked, or None
        (no marker, or one this version does not read)."""
        try:
            words = self._marker_path(file).read_text().split()
        except (OSError, UnicodeDecodeError):
            return None  # missing or unreadable: the entry is checked whole
        if len(words) != 7 or words[0] != _MARKER:
            return None
        try:
            numbers = [int(word) for word in words[1:]]
        except ValueError:
            return None
        return tuple(numbers[:5]), numbers[5]

    def _open_unchanged(self, file: CachedFile, path: Path) -> _MmapReader | None:
        """The entry mapped, if it is the very file its marker describes (stat before and
        after the map), else None; no lock is needed."""
        try:
            before = os.stat(path)
        except FileNotFoundError:
            return None
        marker = self._marker(file)
        if marker is None or marker[0] != _identity(before) or before.st_size != file.size:
            return None
        reader = self._map(path)
        if reader is None:
            return None
        try:
            same = _identity(os.stat(path)) == marker[0]
        except FileNotFoundError:
            same = False  # evicted meanwhile: which file was mapped is not known
        if not same:
            reader.close()
            return None
        self._touch(file)
        return reader

    def _open_checked(self, file: CachedFile, path: Path) -> _MmapReader | None:
        """Under the entry's lock: the entry mapped if it is sound (unchanged since its
        marker, or its size and CRC-32 those of ``file``), else None (none, or a damaged
        one deleted with a warning)."""
        reader = self._map(path)
        if reader is None:
            return None
        try:
            info = os.stat(path)  # under the lock the cache neither replaces nor evicts it
        except FileNotFoundError:  # deleted by something else: which file is mapped?
            reader.close()
            return None
        marker = self._marker(file)
        if marker is not None and marker[0] == _identity(info) and info.st_size == file.size:
            self._touch(file)
            return reader
        expected = file.crc32  # the record's, or the download's (in its marker) without one
        if expected is None and marker is not None:
            expected = marker[1]
        problem = None
        if info.st_size != file.size:
            problem = f"it has {info.st_size} bytes, the object {file.size}"
        elif expected is not None:
            crc = zlib.crc32(reader.buffer())
            if crc != expected:
                problem = f"its crc32 is {crc:#010x}, the object's {expected:#010x}"
        if problem is None and expected is not None:
            self._write_marker(file, info, expected)
            self._touch(file)
            return reader
        reader.close()
        if problem is not None:  # (nothing to check it against: downloaded again, quietly)
            warnings.warn(
                f"shard cache entry {path} (the copy of {file.url}) is damaged: {problem}. "
                f"It was deleted and is downloaded again. Something other than the cache "
                f"changed it, or the disk is failing: leave the files under {self.directory} "
                f"to the cache, and check the disk if this recurs",
                stacklevel=2,
            )
        with self._writing("delete the damaged entry", path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._marker_path(file))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return None

    @staticmethod
    def _map(path: Path) -> _MmapReader | None:
        reader = _MmapReader(path)
        try:
            reader.open()
        except FileNotFoundError:
            return None
        return reader

    def _touch(self, file: CachedFile) -> None:
        """Mark ``file``'s entry used now (its marker's modification time): the least
        recently used go first. A cache that cannot be written is read without it."""
        now = time.time_ns()  # fine-grained (file systems stamp "now" coarsely)
        with contextlib.suppress(OSError):
            os.utime(self._marker_path(file), ns=(now, now))

    def _write_marker(self, file: CachedFile, info: os.stat_result, crc: int) -> None:
        """Record that ``file``'s entry, as ``info`` describes it, holds bytes of CRC-32
        ``crc`` checked against the object (written whole: a temporary file renamed). A
        marker that cannot be written is left out: the entry's next map checks it whole."""
        partial = self.directory / "partial" / f"{file.key}.{os.getpid()}.{next(_COUNTER)}"
        text = " ".join(str(number) for number in (*_identity(info), crc))
        try:
            partial.write_text(f"{_MARKER} {text}\n")
            os.replace(partial, self._marker_path(file))
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(partial)

    def _download(self, file: CachedFile, path: Path, download: Callable[[int, int], Any]) -> None:
        partial = self.directory / "partial" / f"{file.key}.{os.getpid()}.{next(_COUNTER)}"
        with self._writing("create the download", partial):
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            crc, got = 0, 0
            for offset in range(0, file.size, DOWNLOAD_CHUNK):
                data = download(offset, min(DOWNLOAD_CHUNK, file.size - offset))
                crc = zlib.crc32(data, crc)
                got += len(data)
                with self._writing(f"write the {file.size} bytes of {file.url} to", partial):
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
            if got != file.size or (file.crc32 is not None and crc != file.crc32):
                raise CorruptShardError(
                    f"the download of {file.url} does not match its commit record: crc32 "
                    f"{crc:#010x} over {got} bytes, committed "
                    f"{(file.crc32 or 0):#010x} over {file.size} bytes. The object changed "
                    f"after it was committed; restore it or rewrite the shard (nothing was "
                    f"cached)"
                )
            with self._writing(f"write the {file.size} bytes of {file.url} to", partial):
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
        # the bytes written were checked as they came: the entry as it is now is sound
        self._write_marker(file, os.stat(path), crc)

    def evict(self) -> None:
        """Delete least recently used entries until the rest fit ``limit_bytes``, and the
        partial downloads of processes that stopped; an entry being downloaded or mapped
        right now by this call's peers is skipped (its lock is held)."""
        with self._writing("clean up", self.directory):
            if self.limit_bytes is None:
                self._clean_partials()
                return
            self._ensure()
            with _flock(self.directory / "evict.lock"):
                self._clean_partials()
                self._evict(self.limit_bytes)

    def _evict(self, limit: int) -> None:
        entries = []
        for entry in os.scandir(self.directory / "entries"):
            key = entry.name.partition("-")[0]
            with contextlib.suppress(FileNotFoundError):
                info = entry.stat()
                used = info.st_mtime_ns
                with contextlib.suppress(FileNotFoundError):
                    used = os.stat(self.directory / "verified" / key).st_mtime_ns
                entries.append((used, entry.name, key, info.st_size))
        total = sum(size for *_, size in entries)
        for _, name, key, size in sorted(entries):
            if total <= limit:
                break
            with _flock(self.directory / "locks" / key, fcntl.LOCK_EX | fcntl.LOCK_NB) as ok:
                if not ok:
                    continue  # being downloaded or opened right now
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / "entries" / name)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / "verified" / key)
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
