"""Shard files: names, discovery, commit records (sidecars), atomic commit and locking.

On disk a shard ``k`` of a dataset directory is one to three files named by the 7-digit
zero-padded id (``0000003.in_band.bin``, ``0000003.out_of_band.bin``,
``0000003.out_of_band.index``), byte for byte as GuideLoom 1.1 writes them. We add one
file of our own per shard, the *commit record* ``0000003.shard.json`` (GuideLoom ignores
it). It records the format kind, the stream dtype, the element or document count and each
file's size and CRC-32.

Writing a shard never exposes half-written data:

1. The first ``append`` to shard ``k`` creates ``0000003.shard.json.tmp`` and takes an
   exclusive ``flock`` on it (the *write lock*: a second writer of ``k`` fails at once; a
   lock left by a dead process is released by the kernel, so its leftover files are stale
   and the next writer replaces them). Data goes to ``<final name>.tmp`` files.
2. On a successful close: data files are ``fsync``-ed; the commit record is replaced by a
   *pending* record; the data files are renamed over their final names; the directory is
   ``fsync``-ed; the committed record is written into the lock file, ``fsync``-ed and
   renamed over the record (the commit point); the directory is ``fsync``-ed again.
3. On an error (or ``abort``) the temporary files are removed: readers keep seeing the
   previous content of ``k``, or no shard ``k``.

A crash during step 2 leaves a pending record, which readers report; once any shard of a
dataset has a record, a shard without one is reported as uncommitted. Datasets without any
record (written by GuideLoom) open as they are, with the checks their sizes allow.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import threading
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, BinaryIO

import numpy as np

IN_BAND = ".in_band.bin"
OUT_OF_BAND = ".out_of_band.bin"
INDEX = ".out_of_band.index"
RECORD = ".shard.json"
TMP = ".tmp"
PENDING = ".pending"

RECORD_VERSION = 1
_NAME = re.compile(
    r"^(\d{7,})(\.in_band\.bin|\.out_of_band\.bin|\.out_of_band\.index|\.shard\.json)(\.tmp)?$"
)
_CHUNK = 16 << 20


class StorageError(Exception):
    """Base class of the storage layer's own errors."""


class UncommittedShardError(StorageError, RuntimeError):
    """A shard was not committed by a writer that closed, or its commit was interrupted."""


class CorruptShardError(StorageError, ValueError):
    """A shard's files do not match its commit record or each other (size, checksum)."""


class ShardLockedError(StorageError, BlockingIOError):
    """Another writer holds the write lock of the shard."""


class StaleWriteWarning(UserWarning):
    """A temporary file left by a writer that stopped before it committed."""


def shard_name(shard: int) -> str:
    """The file-name stem of shard ``shard``: its id zero-padded to 7 digits."""
    return f"{shard:07d}"


def check_shard_id(shard: Any) -> int:
    """``shard`` as a non-negative ``int``, or a clear ``TypeError``/``ValueError``."""
    if isinstance(shard, bool) or not isinstance(shard, (int, np.integer)):
        raise TypeError(f"shard id must be an int, got {shard!r} ({type(shard).__name__})")
    shard = int(shard)
    if shard < 0:
        raise ValueError(f"shard id must be >= 0, got {shard}")
    return shard


def _display(directory: PurePath) -> str:
    return os.fspath(directory)


def dtype_to_json(dtype: np.dtype[Any]) -> Any:
    """A JSON-able description of ``dtype`` (numpy's ``descr`` form)."""
    return json.loads(json.dumps(np.lib.format.dtype_to_descr(dtype)))


def dtype_from_json(descr: Any) -> np.dtype[Any]:
    """The dtype described by :func:`dtype_to_json`'s output."""
    if isinstance(descr, list):
        descr = [tuple(item) if isinstance(item, list) else item for item in descr]
        descr = [
            (name, dtype_from_json(sub) if isinstance(sub, list) else sub, *rest)
            for name, sub, *rest in descr
        ]
    return np.lib.format.descr_to_dtype(descr)


# Commit records ----------------------------------------------------------------------------


@dataclass
class FileRecord:
    """Size and CRC-32 of one committed file."""

    size: int
    crc32: int


@dataclass
class ShardRecord:
    """The commit record of one shard (the ``.shard.json`` sidecar)."""

    kind: str
    shard: int
    count: int
    files: dict[str, FileRecord]
    dtype: np.dtype[Any] | None = None
    payloads: int | None = None
    state: str = "committed"

    def to_json(self) -> bytes:
        data: dict[str, Any] = {
            "guideloom_pipes_record": RECORD_VERSION,
            "state": self.state,
            "kind": self.kind,
            "shard": self.shard,
            "count": self.count,
            "dtype": None if self.dtype is None else dtype_to_json(self.dtype),
            "files": {s: {"size": f.size, "crc32": f.crc32} for s, f in self.files.items()},
        }
        if self.payloads is not None:
            data["payloads"] = self.payloads
        return json.dumps(data, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> ShardRecord:
        try:
            data = json.loads(raw)
            return cls(
                kind=data["kind"],
                shard=int(data["shard"]),
                count=int(data["count"]),
                files={
                    s: FileRecord(int(f["size"]), int(f["crc32"])) for s, f in data["files"].items()
                },
                dtype=None if data.get("dtype") is None else dtype_from_json(data["dtype"]),
                payloads=data.get("payloads"),
                state=data["state"],
            )
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptShardError(
                f"commit record {where} is unreadable ({error}); rewrite the shard"
            ) from error


# Discovery ---------------------------------------------------------------------------------


@dataclass
class ShardListing:
    """What discovery found in a dataset directory."""

    directory: PurePath
    num_shards: int
    #: size of each (shard, suffix) file, when the backend could tell without opening it
    sizes: dict[tuple[int, str], int] = field(default_factory=dict)
    records: dict[int, ShardRecord] = field(default_factory=dict)
    listed: bool = True


def _scan_local(directory: PurePath) -> dict[str, int]:
    try:
        with os.scandir(os.fspath(directory)) as entries:
            return {e.name: e.stat().st_size for e in entries if e.is_file()}
    except FileNotFoundError:
        raise FileNotFoundError(
            f"dataset directory {_display(directory)} does not exist; check the path, or "
            f"write the dataset first"
        ) from None
    except NotADirectoryError:
        raise NotADirectoryError(
            f"{_display(directory)} is not a directory; pass the dataset directory"
        ) from None


def _read_whole(backend: Any, path: PurePath) -> bytes:
    reader = backend.sync_reader(path)
    reader.open()
    try:
        return bytes(reader.read(0, reader.filesize()))
    finally:
        reader.close()


def _backend_size(backend: Any, path: PurePath) -> int | None:
    reader = backend.sync_reader(path)
    try:
        reader.open()
    except (FileNotFoundError, IsADirectoryError):
        return None
    try:
        return int(reader.filesize())
    finally:
        reader.close()


def _is_locked(path: str) -> bool:
    """Whether a live writer holds the write lock on ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        raise
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def discover(backend: Any, directory: PurePath, primary: str) -> ShardListing:
    """Find the shards of ``directory`` whose presence is marked by files ending in ``primary``.

    Lists the directory when the backend can (local backends, or one with ``list_dir``):
    a gap in the ids is an error naming the missing shard, an empty or missing directory is
    an error, stale temporary files are named in a :class:`StaleWriteWarning`. Otherwise
    probes ids 0, 1, 2, 4, ... and bisects the end, as GuideLoom does (a gap is undetectable).
    """
    from guideloom_pipes.storage.io import _LocalBackend

    if isinstance(backend, _LocalBackend):
        sizes_by_name: dict[str, int] | None = _scan_local(directory)
    elif callable(getattr(backend, "list_dir", None)):
        try:
            names = list(backend.list_dir(directory))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"dataset directory {_display(directory)} does not exist; check the path"
            ) from None
        sizes_by_name = dict.fromkeys(names, -1)
    else:
        sizes_by_name = None

    if sizes_by_name is None:
        return _probe(backend, directory, primary)

    ids: set[int] = set()
    sizes: dict[tuple[int, str], int] = {}
    record_names: dict[int, str] = {}
    temporaries: dict[int, list[str]] = {}
    for name, size in sizes_by_name.items():
        match = _NAME.match(name)
        if match is None:
            continue
        shard, suffix, tmp = int(match.group(1)), match.group(2), match.group(3)
        if tmp:
            temporaries.setdefault(shard, []).append(name)
            continue
        if suffix == RECORD:
            record_names[shard] = name
            continue
        if size >= 0:
            sizes[(shard, suffix)] = size
        else:
            sizes.setdefault((shard, suffix), -1)
        if suffix == primary:
            ids.add(shard)
    if temporaries and isinstance(backend, _LocalBackend):
        _warn_stale(directory, temporaries)
    ids |= set(record_names)
    if not ids:
        raise FileNotFoundError(
            f"no shards in {_display(directory)} (no *{primary} files); write the dataset "
            f"first, or check the path and the storage class"
        )
    count = max(ids) + 1
    if len(ids) != count:
        missing = sorted(set(range(count)) - ids)
        found = ", ".join(str(i) for i in sorted(ids)[:20]) + (", ..." if len(ids) > 20 else "")
        raise FileNotFoundError(
            f"shard {shard_name(missing[0])} is missing from {_display(directory)} "
            f"(found {found}); {len(missing)} missing in all. Rewrite the missing shard(s), "
            f"or renumber the shards so that ids run 0..N-1"
        )
    records = {
        shard: ShardRecord.from_json(
            _read_whole(backend, directory / name), _display(directory / name)
        )
        for shard, name in record_names.items()
    }
    sizes = {key: value for key, value in sizes.items() if value >= 0}
    return ShardListing(directory, count, sizes, records, listed=True)


def _warn_stale(directory: PurePath, temporaries: dict[int, list[str]]) -> None:
    for shard, names in sorted(temporaries.items()):
        lock = os.fspath(directory / (shard_name(shard) + RECORD + TMP))
        if _is_locked(lock):
            continue  # a live writer is writing this shard right now
        warnings.warn(
            f"stale temporary file(s) {', '.join(sorted(names))} in {_display(directory)}: a "
            f"writer of shard {shard_name(shard)} stopped before committing. Readers ignore "
            f"them and the next writer of that shard replaces them; delete them to silence this",
            StaleWriteWarning,
            stacklevel=4,
        )


def _probe(backend: Any, directory: PurePath, primary: str) -> ShardListing:
    def exists(shard: int) -> bool:
        return _backend_size(backend, directory / (shard_name(shard) + primary)) is not None

    if not exists(0):
        raise FileNotFoundError(
            f"no shard 0000000{primary} in {_display(directory)}; write the dataset first, or "
            f"check the path and the storage class"
        )
    low, high = 0, 1  # exists(low); probe 1, 2, 4, ... for the first id that does not
    while exists(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if exists(middle):
            low = middle
        else:
            high = middle
    records: dict[int, ShardRecord] = {}
    for shard in range(high):
        path = directory / (shard_name(shard) + RECORD)
        if _backend_size(backend, path) is not None:
            records[shard] = ShardRecord.from_json(_read_whole(backend, path), _display(path))
    return ShardListing(directory, high, {}, records, listed=False)


def check_listing(
    listing: ShardListing,
    backend: Any,
    kind: str,
    suffixes: Sequence[str],
    dtype: np.dtype[Any] | None,
    dtype_hint: Callable[[np.dtype[Any]], str] | None = None,
) -> list[dict[str, int]]:
    """Check every shard's files against its commit record; the file sizes per shard.

    Refuses: a shard without a record when others have one (uncommitted), a pending record
    (interrupted commit), a record of another kind, a dtype other than the one asked for,
    a missing file, a file whose size differs from its record.
    """
    directory = listing.directory
    where = _display(directory)
    result: list[dict[str, int]] = []
    have_records = bool(listing.records)
    for shard in range(listing.num_shards):
        name = shard_name(shard)
        sizes: dict[str, int] = {}
        for suffix in suffixes:
            size = listing.sizes.get((shard, suffix))
            if size is None:
                size = _backend_size(backend, directory / (name + suffix))
            if size is None:
                raise FileNotFoundError(
                    f"shard {name} of {where} has no {name}{suffix}; the shard is incomplete "
                    f"(was it copied partially, or written with another storage class?). "
                    f"Rewrite shard {shard}"
                )
            sizes[suffix] = size
        record = listing.records.get(shard)
        if record is None:
            if have_records:
                raise UncommittedShardError(
                    f"shard {name} of {where} has no commit record ({name}{RECORD}) although "
                    f"other shards do: it was not committed by a writer that closed "
                    f"successfully (interrupted, or written by another tool). Rewrite shard "
                    f"{shard} with a guideloom_pipes writer"
                )
            result.append(sizes)
            continue
        if record.state != "committed":
            raise UncommittedShardError(
                f"shard {name} of {where} was being committed when its writer stopped "
                f"(record state {record.state!r}); its files may mix old and new data. "
                f"Rewrite shard {shard}"
            )
        if record.kind != kind:
            raise ValueError(
                f"shard {name} of {where} was written as {record.kind!r} data, but it is "
                f"opened as {kind!r}; open it with the storage class it was written with"
            )
        if dtype is not None and record.dtype is not None and record.dtype != dtype:
            hint = dtype_hint(record.dtype) if dtype_hint else f"np.dtype({record.dtype.descr!r})"
            raise ValueError(
                f"shard {name} of {where} was written with dtype {record.dtype} but the format "
                f"asks for {dtype}; reading it would return garbage. Open it with {hint}"
            )
        for suffix in suffixes:
            expected = record.files.get(suffix.lstrip("."))
            if expected is None:
                raise CorruptShardError(
                    f"commit record of shard {name} of {where} does not list {name}{suffix}; "
                    f"rewrite shard {shard}"
                )
            if expected.size != sizes[suffix]:
                change = "truncated" if sizes[suffix] < expected.size else "grown"
                raise CorruptShardError(
                    f"{name}{suffix} in {where} is {sizes[suffix]} bytes but was committed with "
                    f"{expected.size} bytes: the file was {change} after it was written. "
                    f"Restore it or rewrite shard {shard}"
                )
        result.append(sizes)
    return result


def verify_checksums(
    listing: ShardListing, backend: Any, suffixes: Sequence[str]
) -> dict[str, int]:
    """Recompute each recorded file's CRC-32; raise :class:`CorruptShardError` on a mismatch.

    Returns counts: ``{"shards": ..., "files": ..., "bytes": ...}`` checked.
    """
    checked = {"shards": 0, "files": 0, "bytes": 0}
    problems: list[str] = []
    for shard in range(listing.num_shards):
        record = listing.records.get(shard)
        if record is None:
            continue
        checked["shards"] += 1
        for suffix in suffixes:
            name = shard_name(shard) + suffix
            expected = record.files[suffix.lstrip(".")]
            reader = backend.sync_reader(listing.directory / name)
            reader.open()
            try:
                size = reader.filesize()
                crc = 0
                for offset in range(0, size, _CHUNK):
                    crc = zlib.crc32(reader.read(offset, min(_CHUNK, size - offset)), crc)
            finally:
                reader.close()
            checked["files"] += 1
            checked["bytes"] += size
            if crc != expected.crc32 or size != expected.size:
                problems.append(
                    f"{name}: crc32 {crc:#010x} over {size} bytes, committed "
                    f"{expected.crc32:#010x} over {expected.size} bytes"
                )
    if problems:
        raise CorruptShardError(
            f"checksum mismatch in {_display(listing.directory)} (the files changed after "
            f"they were committed): " + "; ".join(problems) + ". Restore or rewrite these shards"
        )
    return checked


# Writing -----------------------------------------------------------------------------------


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _CountingFile:
    """A buffered temporary file that tracks its size and CRC-32."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.file: BinaryIO = os.fdopen(fd, "wb", buffering=1 << 20)
        self.size = 0
        self.crc32 = 0

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.file.write(view)
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += len(view)

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


def _take_lock(path: str, shard: int, directory: str) -> int:
    """Open ``path`` and hold an exclusive ``flock`` on it; the descriptor."""
    deadline = time.monotonic() + 0.2  # a reader's stale-file probe holds it for microseconds
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            if time.monotonic() < deadline:
                time.sleep(0.005)
                continue
            raise ShardLockedError(
                error.errno,
                f"shard {shard_name(shard)} of {directory} is being written by another writer "
                f"(it holds the lock on {path}); write each shard id from one writer at a time",
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            return fd
        os.close(fd)  # the lock file was committed or removed under us: take the new one


class ShardTransaction:
    """The temporary files of one shard being written, committed or aborted as a unit.

    Args:
        directory: the dataset directory (a local path).
        shard: the shard id.
        kind: the format kind recorded in the commit record.
        suffixes: the files of the shard, e.g. ``(".in_band.bin",)``.
    """

    def __init__(self, directory: str, shard: int, kind: str, suffixes: Sequence[str]) -> None:
        self.directory = directory
        self.shard = shard
        self.kind = kind
        self.suffixes = tuple(suffixes)
        stem = os.path.join(directory, shard_name(shard))
        self._record_path = stem + RECORD
        self._lock_path = stem + RECORD + TMP
        self._lock_fd = _take_lock(self._lock_path, shard, directory)
        self.files: dict[str, _CountingFile] = {}
        try:
            for suffix in self.suffixes:
                self.files[suffix] = _CountingFile(stem + suffix + TMP)
        except BaseException:
            self.abort()
            raise
        self.done = False

    def commit(self, count: int, dtype: np.dtype[Any] | None, payloads: int | None = None) -> None:
        """Make the shard visible: fsync, pending record, renames, committed record."""
        stem = os.path.join(self.directory, shard_name(self.shard))
        for handle in self.files.values():
            handle.sync()
            handle.close()
        record = ShardRecord(
            kind=self.kind,
            shard=self.shard,
            count=count,
            files={s.lstrip("."): FileRecord(h.size, h.crc32) for s, h in self.files.items()},
            dtype=dtype,
            payloads=payloads,
            state="pending",
        )
        pending = stem + RECORD + PENDING
        with open(pending, "wb") as out:
            out.write(record.to_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(pending, self._record_path)
        for suffix in self.suffixes:
            os.replace(stem + suffix + TMP, stem + suffix)
        _fsync_directory(self.directory)
        record.state = "committed"
        data = record.to_json()
        os.pwrite(self._lock_fd, data, 0)
        os.fsync(self._lock_fd)
        os.replace(self._lock_path, self._record_path)
        _fsync_directory(self.directory)
        os.close(self._lock_fd)
        self._lock_fd = -1
        self.done = True

    def abort(self) -> None:
        """Remove the temporary files; the committed shard (if any) stays as it was."""
        for handle in self.files.values():
            try:
                handle.close()
            finally:
                _unlink_quiet(handle.path)
        if self._lock_fd >= 0:
            _unlink_quiet(self._lock_path)
            os.close(self._lock_fd)
            self._lock_fd = -1
        self.done = True


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ShardWriterBase:
    """Bookkeeping shared by the writers: one transaction per touched shard, commit on close.

    Subclasses implement ``append`` and call :meth:`_transaction` for the shard.
    """

    kind = ""
    suffixes: tuple[str, ...] = ()

    def __init__(self, directory: PurePath) -> None:
        self.directory = os.fspath(directory)
        self._transactions: dict[int, ShardTransaction] = {}
        self._closed = False
        self._lock = threading.Lock()

    def open(self) -> None:
        """Create the directory if needed (also done by ``with``)."""
        os.makedirs(self.directory, exist_ok=True)

    def __enter__(self) -> Any:
        self.open()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this writer is closed; open a new one with storage.sync_writer()")

    def _transaction(self, shard: Any) -> ShardTransaction:
        shard = check_shard_id(shard)
        self._check_open()
        transaction = self._transactions.get(shard)
        if transaction is None:
            os.makedirs(self.directory, exist_ok=True)
            transaction = ShardTransaction(self.directory, shard, self.kind, self.suffixes)
            self._transactions[shard] = transaction
        return transaction

    def _commit_args(self, shard: int) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Commit every shard this writer touched (each atomically), in id order."""
        if self._closed:
            return
        self._closed = True
        pending = sorted(self._transactions.items())
        try:
            for shard, transaction in pending:
                transaction.commit(**self._commit_args(shard))
        except BaseException:
            for _, transaction in pending:
                if not transaction.done:
                    transaction.abort()
            raise

    def abort(self) -> None:
        """Drop everything written in this session; committed shards stay as they were."""
        self._closed = True
        for transaction in self._transactions.values():
            if not transaction.done:
                transaction.abort()

    def __del__(self) -> None:
        # A writer dropped without close() must not leave locks or temporaries behind.
        try:
            if not self._closed:
                self.abort()
        except Exception:
            pass


# Reading -----------------------------------------------------------------------------------


class ShardFiles:
    """Byte readers of one file kind (``suffix``) across the shards, opened lazily.

    Readers of backends that hold a descriptor per open file (``holds_fd``, and any custom
    backend) are kept in an LRU of at most ``max_open``; memory-mapped ones hold none and
    stay open. Thread-safe.

    Args:
        backend: the read backend.
        directory: the dataset directory.
        suffix: the file kind, e.g. ``".in_band.bin"``.
        num_shards: how many shards there are.
        max_open: most descriptor-holding readers kept open at once.
    """

    def __init__(
        self, backend: Any, directory: PurePath, suffix: str, num_shards: int, max_open: int = 64
    ) -> None:
        self.backend = backend
        self.directory = directory
        self.suffix = suffix
        self.num_shards = num_shards
        self.bounded = getattr(backend, "holds_fd", True)
        self.max_open = max(1, max_open)
        self._readers: list[Any] = [None] * num_shards
        self._arrays: dict[tuple[int, str], np.ndarray] = {}
        self._lru: OrderedDict[int, int] = OrderedDict()  # shard -> readers in use
        self._lock = threading.Lock()
        self._closed = False

    def path(self, shard: int) -> PurePath:
        return self.directory / (shard_name(shard) + self.suffix)

    def _open_reader(self, shard: int) -> Any:
        reader = self.backend.sync_reader(self.path(shard))
        reader.open()
        return reader

    def array(self, shard: int, dtype: np.dtype[Any]) -> np.ndarray | None:
        """The whole file as a read-only numpy array, when the backend maps files; else None."""
        key = (shard, dtype.str if dtype.names is None else repr(dtype.descr))
        found = self._arrays.get(key)
        if found is not None:
            return found
        if self.bounded:
            return None
        with self._lock:
            if self._closed:
                raise RuntimeError("reader is closed")
            reader = self._readers[shard]
            if reader is None:
                reader = self._readers[shard] = self._open_reader(shard)
            buffer = getattr(reader, "buffer", None)
            if buffer is None:
                self.bounded = True  # a custom unbounded backend without buffers: use read()
                return None
            view = buffer()
            usable = len(view) - len(view) % dtype.itemsize
            found = np.frombuffer(view[:usable], dtype=dtype)
            self._arrays[key] = found
            return found

    def read(self, shard: int, offset: int, size: int) -> Any:
        """``size`` bytes at ``offset`` of the shard's file."""
        if not self.bounded:
            reader = self._readers[shard]
            if reader is None:
                with self._lock:
                    if self._closed:
                        raise RuntimeError("reader is closed")
                    reader = self._readers[shard]
                    if reader is None:
                        reader = self._readers[shard] = self._open_reader(shard)
            return reader.read(offset, size)
        reader = self._acquire(shard)
        try:
            return reader.read(offset, size)
        finally:
            self._release(shard)

    def _acquire(self, shard: int) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("reader is closed")
            reader = self._readers[shard]
            if reader is None:
                self._evict()
                reader = self._readers[shard] = self._open_reader(shard)
                self._lru[shard] = 0
            self._lru[shard] += 1
            self._lru.move_to_end(shard)
            return reader

    def _release(self, shard: int) -> None:
        with self._lock:
            self._lru[shard] -= 1

    def _evict(self) -> None:
        if len(self._lru) < self.max_open:
            return
        for shard, users in list(self._lru.items()):
            if users == 0:
                del self._lru[shard]
                reader, self._readers[shard] = self._readers[shard], None
                reader.close()
                if len(self._lru) < self.max_open:
                    return

    def close(self) -> None:
        """Close every open reader."""
        with self._lock:
            self._closed = True
            self._arrays.clear()
            for shard, reader in enumerate(self._readers):
                if reader is not None:
                    reader.close()
                    self._readers[shard] = None
            self._lru.clear()
