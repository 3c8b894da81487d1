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
2. On a successful close, for all the shards of the writer together, step by step:
   (a) the data files are ``fsync``-ed and a *pending* record is written to
   ``0000003.shard.json.pending`` and ``fsync``-ed; (b) the pending record replaces the
   commit record (the old shard is no longer committed), then the directory is
   ``fsync``-ed; (c) the data files are renamed over their final names, then the directory
   is ``fsync``-ed; (d) the committed record is written into the lock file, ``fsync``-ed
   and renamed over the record (the commit point), then the directory is ``fsync``-ed.
   Three directory ``fsync`` calls per close, however many shards.
3. On an error (or ``abort``) the temporary files are removed: readers keep seeing the
   previous content of ``k``, or no shard ``k``. An error during (b) or (c) before any of
   the shard's data files was renamed puts its previous record back.

A crash after step 2b and before 2d leaves a pending record, which readers report (an
error during 2a leaves every shard as it was); once any shard of a dataset has a record, a
shard without one is reported as uncommitted. Datasets without any record (written by
GuideLoom) open as they are, with the checks their sizes allow.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
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
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from guideloom_pipes.storage.io import ResolvedBackend, resolve_backend

IN_BAND = ".in_band.bin"
OUT_OF_BAND = ".out_of_band.bin"
INDEX = ".out_of_band.index"
RECORD = ".shard.json"
TMP = ".tmp"
PENDING = ".pending"

RECORD_VERSION = 1
#: Names of shard files: the id as ``shard_name`` writes it (7 digits, or more without a
#: leading zero past 9,999,999), a known suffix, and ``.tmp``/``.pending`` for temporaries.
_NAME = re.compile(
    r"^(\d{7}|[1-9]\d{7,})"
    r"(\.in_band\.bin|\.out_of_band\.bin|\.out_of_band\.index|\.shard\.json)"
    r"(\.tmp|\.pending)?$"
)
#: The storage class whose shards are exactly these files.
_CLASS_OF_SUFFIXES = {
    frozenset({IN_BAND}): "StreamStorage",
    frozenset({INDEX, OUT_OF_BAND}): "DocumentStorage",
    frozenset({IN_BAND, INDEX, OUT_OF_BAND}): "StreamWithMetaStorage",
}
#: The data-file suffixes GuideLoom writes, and the storage classes that use each.
_DATA_SUFFIXES = {
    IN_BAND: "StreamStorage or StreamWithMetaStorage",
    OUT_OF_BAND: "DocumentStorage or StreamWithMetaStorage",
    INDEX: "DocumentStorage or StreamWithMetaStorage",
}
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
    key = repr(descr)
    found = _DTYPES.get(key)
    if found is None:
        if len(_DTYPES) > 256:
            _DTYPES.clear()
        found = _DTYPES[key] = _dtype_from_json(descr)
    return found


_DTYPES: dict[str, np.dtype[Any]] = {}  # the records of one dataset share their dtype


def _dtype_from_json(descr: Any) -> np.dtype[Any]:
    return np.lib.format.descr_to_dtype(_descr_from_json(descr))


def _descr_from_json(descr: Any) -> Any:
    # JSON turned numpy's tuples into lists: a field is [name, type] or [name, type, shape],
    # a name may be [title, name], and a type is a string or a nested list of fields.
    if not isinstance(descr, list):
        return descr
    fields = []
    for name, sub, *rest in descr:
        fields.append(
            (
                tuple(name) if isinstance(name, list) else name,
                _descr_from_json(sub),
                *(tuple(r) if isinstance(r, list) else r for r in rest),
            )
        )
    return fields


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
            version = int(data["guideloom_pipes_record"])
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptShardError(
                f"commit record {where} is unreadable ({type(error).__name__}: {error}); "
                f"rewrite the shard"
            ) from error
        if version > RECORD_VERSION:
            raise StorageError(
                f"commit record {where} has format version {version}, newer than this "
                f"guideloom_pipes understands ({RECORD_VERSION}); upgrade guideloom_pipes"
            )
        try:
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
                f"commit record {where} is unreadable ({type(error).__name__}: {error}); "
                f"rewrite the shard"
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


def _read_whole(backend: ResolvedBackend, path: PurePath) -> bytes:
    reader = backend.reader(path)
    reader.open()
    try:
        return bytes(reader.read(0, reader.filesize()))
    finally:
        reader.close()


def _read_local(path: str) -> bytes:
    """A small local file's bytes (a commit record), with the fewest system calls."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _backend_size(backend: ResolvedBackend, path: PurePath) -> int | None:
    reader = backend.reader(path)
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
    except OSError:  # gone (committed or aborted), or not a local file at all
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


def discover(backend: Any, directory: PurePath, suffixes: Sequence[str] | str) -> ShardListing:
    """Find the shards of ``directory``, a dataset whose shards consist of ``suffixes`` files.

    Lists the directory when the backend can (local backends, or one with ``list_dir``):
    a gap in the ids is an error naming the missing shard, an empty or missing directory is
    an error, data files of another storage class in a directory without commit records are
    an error, stale temporary files are named in a :class:`StaleWriteWarning`. Otherwise
    probes ids 0, 1, 2, 4, ... for the first suffix's files and bisects the end, as
    GuideLoom does (a gap is then undetectable). ``backend``: a read backend in either
    convention, or a :class:`~guideloom_pipes.storage.io.ResolvedBackend`.
    """
    backend = resolve_backend(backend)
    if isinstance(suffixes, str):
        suffixes = (suffixes,)
    ours = tuple(suffixes)
    if backend.local:
        sizes_by_name: dict[str, int] | None = _scan_local(directory)
    elif backend.list_dir is not None:
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
        return _probe(backend, directory, ours[0])

    ids: set[int] = set()
    sizes: dict[tuple[int, str], int] = {}
    record_names: dict[int, str] = {}
    temporaries: dict[int, list[str]] = {}
    foreign: set[str] = set()
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
        if suffix not in ours:
            foreign.add(suffix)
            continue
        sizes[(shard, suffix)] = size
        ids.add(shard)
    if temporaries and backend.local:
        _warn_stale(directory, temporaries)
    ids |= set(record_names)
    where = _display(directory)
    if foreign and not record_names:
        # Without commit records the kind is known only from the file names: GuideLoom's
        # storages never mix these, and reading one as another returns garbage.
        kinds = " and ".join(sorted(f"*{s}" for s in foreign))
        owners = sorted({_DATA_SUFFIXES[s] for s in foreign})
        opener = _CLASS_OF_SUFFIXES.get(frozenset(ours), "this storage class's")
        raise ValueError(
            f"{where} holds {kinds} files, which a {opener} dataset does not have (its "
            f"shards are {' and '.join(ours)} files only): it looks like a "
            f"{' / '.join(owners)} dataset. Open it with the storage class it was written with"
        )
    if not ids:
        raise FileNotFoundError(
            f"no shards in {where} (no {' / '.join(f'*{s}' for s in ours)} files); write the "
            f"dataset first, or check the path and the storage class"
        )
    count = max(ids) + 1
    if len(ids) != count:
        ordered = sorted(ids)  # O(shards found), however large the ids
        first_missing = next(i for i, shard in enumerate(ordered) if shard != i)
        found = ", ".join(str(i) for i in ordered[:20]) + (", ..." if len(ids) > 20 else "")
        raise FileNotFoundError(
            f"shard {shard_name(first_missing)} is missing from {where} (found {found}); "
            f"{count - len(ids)} missing in all. Rewrite the missing shard(s), or renumber the "
            f"shards so that ids run 0..N-1"
        )
    if backend.local:
        base = os.fspath(directory)
        records = {}
        for shard, name in record_names.items():
            path = os.path.join(base, name)
            records[shard] = ShardRecord.from_json(_read_local(path), path)
    else:
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


def _probe(backend: ResolvedBackend, directory: PurePath, primary: str) -> ShardListing:
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
    (interrupted commit), a record of another kind or shard, a dtype other than the one
    asked for, a missing file, a file whose size differs from its record.
    """
    backend = resolve_backend(backend)
    directory = listing.directory
    where = _display(directory)
    result: list[dict[str, int]] = []
    have_records = bool(listing.records)
    for shard in range(listing.num_shards):
        name = shard_name(shard)
        record = listing.records.get(shard)
        if record is None and have_records:
            raise UncommittedShardError(
                f"shard {name} of {where} has no commit record ({name}{RECORD}) although "
                f"other shards do: it was not committed by a writer that closed successfully "
                f"(interrupted, or written by another tool such as GuideLoom). Rewrite shard "
                f"{shard} with a guideloom_pipes writer, or, if its files are complete "
                f"(written by GuideLoom), record them with storage.seal()"
            )
        if record is not None:
            _check_record(record, listing, shard, kind, dtype, dtype_hint)
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
            if record is None:
                continue
            expected = record.files.get(suffix.lstrip("."))
            if expected is None:
                raise CorruptShardError(
                    f"commit record of shard {name} of {where} does not list {name}{suffix}; "
                    f"rewrite shard {shard}"
                )
            if expected.size != size:
                change = "was truncated" if size < expected.size else "grew"
                raise CorruptShardError(
                    f"{name}{suffix} in {where} is {size} bytes but was committed with "
                    f"{expected.size} bytes: the file {change} after it was written. "
                    f"Restore it or rewrite shard {shard}"
                )
        result.append(sizes)
    return result


def _check_record(
    record: ShardRecord,
    listing: ShardListing,
    shard: int,
    kind: str,
    dtype: np.dtype[Any] | None,
    dtype_hint: Callable[[np.dtype[Any]], str] | None,
) -> None:
    name = shard_name(shard)
    where = _display(listing.directory)
    if record.state != "committed":
        lock = listing.directory / (name + RECORD + TMP)
        if listing.listed and _is_locked(os.fspath(lock)):
            raise UncommittedShardError(
                f"shard {name} of {where} is being committed by a live writer right now "
                f"(it holds {_display(lock)}); open the dataset again once the writer has closed"
            )
        raise UncommittedShardError(
            f"shard {name} of {where} was being committed when its writer stopped (record "
            f"{name}{RECORD} is in state {record.state!r}); its files may mix old and new "
            f"data. Rewrite shard {shard}"
        )
    if record.shard != shard:
        raise CorruptShardError(
            f"commit record {name}{RECORD} in {where} belongs to shard {record.shard}, not "
            f"{shard} (was it copied or renamed?); rewrite shard {shard}"
        )
    if record.kind != kind:
        raise ValueError(
            f"shard {name} of {where} was written as {record.kind!r} data, but it is opened "
            f"as {kind!r}; open it with the storage class it was written with "
            f"({_STORAGE_CLASSES.get(record.kind, record.kind)})"
        )
    if dtype is not None and record.dtype is not None and record.dtype != dtype:
        hint = dtype_hint(record.dtype) if dtype_hint else f"np.dtype({record.dtype.descr!r})"
        raise ValueError(
            f"shard {name} of {where} was written with dtype {record.dtype} but the format "
            f"asks for {dtype}; reading it would return garbage. Open it with {hint}"
        )


_STORAGE_CLASSES = {
    "stream": "StreamStorage",
    "stream_meta": "StreamWithMetaStorage",
    "document": "DocumentStorage",
}


def verify_checksums(
    listing: ShardListing, backend: Any, suffixes: Sequence[str]
) -> dict[str, int]:
    """Recompute each recorded file's CRC-32; raise :class:`CorruptShardError` on a mismatch.

    Returns counts: ``{"shards": ..., "files": ..., "bytes": ...}`` checked, and
    ``"unrecorded"``: shards without a commit record (written by GuideLoom), which have no
    checksum to verify (a :class:`UserWarning` says so).
    """
    backend = resolve_backend(backend)
    checked = {"shards": 0, "files": 0, "bytes": 0, "unrecorded": 0}
    problems: list[str] = []
    for shard in range(listing.num_shards):
        record = listing.records.get(shard)
        if record is None:
            checked["unrecorded"] += 1
            continue
        checked["shards"] += 1
        for suffix in suffixes:
            name = shard_name(shard) + suffix
            expected = record.files[suffix.lstrip(".")]
            reader = backend.reader(listing.directory / name)
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
    if checked["unrecorded"]:
        warnings.warn(
            f"{checked['unrecorded']} of the {listing.num_shards} shards of "
            f"{_display(listing.directory)} have no commit record (written by GuideLoom or "
            f"another tool), so there is no checksum to verify them against",
            UserWarning,
            stacklevel=3,
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
        if isinstance(data, np.ndarray):
            if data.dtype.hasobject:
                raise TypeError(
                    f"cannot store an array of dtype {data.dtype}: it holds Python objects, "
                    f"whose bytes are pointers that mean nothing on disk; use numeric, bytes "
                    f"or string fields"
                )
            # Bytes of any dtype (memoryview refuses datetime64 and some structured ones).
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        view = memoryview(data).cast("B")
        self.file.write(view)
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += len(view)

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()

    def discard(self) -> None:
        """Close without reporting errors and remove the file (the shard is abandoned)."""
        with contextlib.suppress(OSError, ValueError):
            self.file.close()
        _unlink_quiet(self.path)


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

    Committing runs in four steps (see the module docstring); :func:`commit_transactions`
    runs each step for a group of shards before the next, so one ``fsync`` of the
    directory per step covers the whole group.

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
        self.done = False
        self.stage = "writing"
        self.record: ShardRecord | None = None
        stem = os.path.join(directory, shard_name(shard))
        self._stem = stem
        self._record_path = stem + RECORD
        self._lock_path = stem + RECORD + TMP
        self._pending_path = stem + RECORD + PENDING
        self._old_record: bytes | None = None
        self._renamed = 0
        self._lock_fd = _take_lock(self._lock_path, shard, directory)
        self._lock_linked = True  # the lock file still has its .tmp name
        self.files: dict[str, _CountingFile] = {}
        try:
            for suffix in self.suffixes:
                self.files[suffix] = _CountingFile(stem + suffix + TMP)
        except BaseException:
            self.abort()
            raise

    def prepare(self, count: int, dtype: np.dtype[Any] | None, payloads: int | None = None) -> None:
        """Step 1: ``fsync`` the data files and write the pending record (not yet in place)."""
        for handle in self.files.values():
            handle.sync()
            handle.close()
        self.record = ShardRecord(
            kind=self.kind,
            shard=self.shard,
            count=count,
            files={s.lstrip("."): FileRecord(h.size, h.crc32) for s, h in self.files.items()},
            dtype=dtype,
            payloads=payloads,
            state="pending",
        )
        try:
            with open(self._record_path, "rb") as old:
                self._old_record = old.read()
        except FileNotFoundError:
            self._old_record = None
        with open(self._pending_path, "wb") as out:
            out.write(self.record.to_json())
            out.flush()
            os.fsync(out.fileno())
        self.stage = "prepared"

    def install(self) -> None:
        """Step 2: the pending record replaces the committed one; the old shard is gone."""
        os.replace(self._pending_path, self._record_path)
        self.stage = "installed"

    def publish(self) -> None:
        """Step 3: rename the data files over their final names."""
        for suffix in self.suffixes:
            os.replace(self._stem + suffix + TMP, self._stem + suffix)
            self._renamed += 1
        self.stage = "published"

    def finish(self) -> None:
        """Step 4 (the commit point): the committed record replaces the pending one."""
        assert self.record is not None
        self.record.state = "committed"
        self._replace_record(self.record.to_json())
        self.stage = "committed"

    def _replace_record(self, data: bytes) -> None:
        _install_record(self._lock_fd, self._lock_path, self._record_path, data)
        self._lock_linked = False

    def release(self) -> None:
        """Drop the write lock (after the commit)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self.done = True

    def commit(self, count: int, dtype: np.dtype[Any] | None, payloads: int | None = None) -> None:
        """Make this shard visible (all four steps); see :func:`commit_transactions`."""
        commit_transactions(
            self.directory, [self], lambda _: {"count": count, "dtype": dtype, "payloads": payloads}
        )

    def abort(self) -> None:
        """Remove the temporary files; the committed shard (if any) stays as it was.

        After step 2, and before any data file was renamed, the previous commit record is
        put back. Once a data file was renamed, the pending record stays, so readers report
        the shard as uncommitted rather than read a mix of old and new files.
        """
        for handle in self.files.values():
            handle.discard()
        _unlink_quiet(self._pending_path)
        if self.stage == "installed" and self._renamed == 0 and self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                if self._old_record is None:
                    os.unlink(self._record_path)
                else:
                    self._replace_record(self._old_record)
                _fsync_directory(self.directory)
        if self._lock_fd >= 0:
            if self._lock_linked:
                _unlink_quiet(self._lock_path)  # still ours: nobody else can lock it
            os.close(self._lock_fd)
            self._lock_fd = -1
        self.done = True


def commit_transactions(
    directory: str,
    transactions: Sequence[ShardTransaction],
    commit_args: Callable[[ShardTransaction], dict[str, Any]],
) -> None:
    """Commit a group of shards of ``directory``: each step for every shard, then the next.

    ``commit_args(transaction)`` gives the keyword arguments of
    :meth:`ShardTransaction.prepare` (it may still write to the transaction's files).
    An error before any shard's pending record is in place (the usual case: a full disk
    while flushing) leaves every shard as it was. On any error the unfinished shards are
    aborted and the error re-raised.
    """
    try:
        for transaction in transactions:
            transaction.prepare(**commit_args(transaction))
        if not transactions:
            return
        for transaction in transactions:
            transaction.install()
        _fsync_directory(directory)  # no data file is renamed before its pending record lands
        for transaction in transactions:
            transaction.publish()
        _fsync_directory(directory)
        for transaction in transactions:
            transaction.finish()
        _fsync_directory(directory)
    except BaseException:
        for transaction in transactions:
            if transaction.stage != "committed":
                transaction.abort()
        raise
    finally:
        for transaction in transactions:
            if transaction.stage == "committed":
                transaction.release()


def _install_record(lock_fd: int, lock_path: str, record_path: str, data: bytes) -> None:
    """The lock file becomes the record: it is ours alone while we hold its lock."""
    os.pwrite(lock_fd, data, 0)
    os.ftruncate(lock_fd, len(data))
    os.fsync(lock_fd)
    os.replace(lock_path, record_path)


def seal_shard(
    directory: str,
    shard: int,
    kind: str,
    suffixes: Sequence[str],
    sizes: dict[str, int],
    count: int,
    dtype: np.dtype[Any] | None,
    payloads: int | None = None,
) -> bool:
    """Write a commit record for shard files already in place (written by GuideLoom).

    Holds the shard's write lock while it checksums the files and installs the record, and
    refuses files whose size changed since they were checked. False if another writer
    committed the shard meanwhile (its record is kept).
    """
    stem = os.path.join(directory, shard_name(shard))
    lock_path = stem + RECORD + TMP
    fd = _take_lock(lock_path, shard, directory)
    try:
        if os.path.exists(stem + RECORD):
            _unlink_quiet(lock_path)
            return False
        files: dict[str, FileRecord] = {}
        for suffix in suffixes:
            path = stem + suffix
            crc, size = 0, 0
            with open(path, "rb") as data:
                while chunk := data.read(_CHUNK):
                    crc = zlib.crc32(chunk, crc)
                    size += len(chunk)
            if size != sizes[suffix]:
                _unlink_quiet(lock_path)
                raise CorruptShardError(
                    f"{path} changed while it was being sealed ({sizes[suffix]} -> {size} "
                    f"bytes); seal again once no other process writes it"
                )
            files[suffix.lstrip(".")] = FileRecord(size, crc)
        record = ShardRecord(kind, shard, count, files, dtype, payloads, state="committed")
        _install_record(fd, lock_path, stem + RECORD, record.to_json())
        return True
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _too_many_files(error: OSError, shard: int, open_shards: int, per_shard: int) -> OSError:
    import resource

    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return OSError(
        error.errno,
        f"too many open files while starting shard {shard_name(shard)}: a writer keeps "
        f"{per_shard} file descriptors open per shard it writes until it closes, and this one "
        f"has {open_shards} shards open (the limit is {limit} descriptors per process). Write "
        f"at most about {max(1, open_shards - open_shards // 10)} shards per writer (close it "
        f"and open a new one for the next shards), or raise the limit (ulimit -n)",
    )


class ShardWriterBase:
    """Bookkeeping shared by the writers: one transaction per touched shard, commit on close.

    Subclasses implement ``append``: they check the record, call :meth:`_transaction` for
    the shard, write, and call :meth:`_written` once the append succeeded. A shard whose
    appends were all refused is not committed (it keeps its previous content).
    """

    kind = ""
    suffixes: tuple[str, ...] = ()

    def __init__(self, directory: PurePath) -> None:
        self.directory = os.fspath(directory)
        self._transactions: dict[int, ShardTransaction] = {}
        self._appended: set[int] = set()
        self._closed = False
        self._lock = threading.Lock()

    def open(self) -> None:
        """Create the directory if needed (also done by ``with``)."""
        os.makedirs(self.directory, exist_ok=True)

    def __enter__(self) -> Any:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"this writer of {self.directory} is closed (committed or aborted), it takes "
                f"no more appends; open a new one with storage.sync_writer()"
            )

    def _transaction(self, shard: Any) -> ShardTransaction:
        shard = check_shard_id(shard)
        self._check_open()
        transaction = self._transactions.get(shard)
        if transaction is None:
            os.makedirs(self.directory, exist_ok=True)
            try:
                transaction = ShardTransaction(self.directory, shard, self.kind, self.suffixes)
            except OSError as error:
                if error.errno in (errno.EMFILE, errno.ENFILE):
                    raise _too_many_files(
                        error, shard, len(self._transactions), len(self.suffixes) + 1
                    ) from error
                raise
            self._transactions[shard] = transaction
        return transaction

    def _written(self, shard: int) -> None:
        """Record that an append to ``shard`` succeeded (its transaction will commit)."""
        self._appended.add(shard)

    def _commit_args(self, shard: int) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Commit every shard this writer touched, each atomically.

        Either every shard is committed, or the error is raised; shards whose commit did
        not finish then read as before, or (after a failure in the middle of renaming their
        files) are reported as uncommitted, never as a mix of old and new.
        """
        if self._closed:
            return
        self._closed = True
        for shard, transaction in self._transactions.items():
            if shard not in self._appended and not transaction.done:
                transaction.abort()  # every append to it was refused: keep the old shard
        transactions = [t for s, t in sorted(self._transactions.items()) if s in self._appended]
        commit_transactions(self.directory, transactions, lambda t: self._commit_args(t.shard))

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


def _fill_function(reader: Any) -> Callable[[int, memoryview], int]:
    """``fill(offset, buffer)`` for ``reader``: its own ``readinto`` where it has one (our
    byte-range backends: the system call fills ``buffer``), else ``read`` and a copy."""
    readinto = getattr(reader, "readinto", None)
    if callable(readinto):
        return readinto
    return functools.partial(_read_and_copy, reader)


def _read_and_copy(reader: Any, offset: int, buffer: memoryview) -> int:
    """``reader.read`` copied into ``buffer``; the bytes ``read`` returned.

    The copy is a memoryview assignment, a ``memcpy`` under the GIL: numpy's copy of more
    than a few hundred elements releases the GIL and takes it back, and with many reading
    threads each such handoff costs more than the copy.
    """
    data = reader.read(offset, len(buffer))
    try:
        view = memoryview(data).cast("B")
    except TypeError:  # not contiguous, or not a plain buffer format
        view = memoryview(memoryview(data).tobytes())
    got = len(view)
    if got <= len(buffer):
        buffer[:got] = view
    return got


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
        self.backend = resolve_backend(backend)
        self.directory = directory
        self.suffix = suffix
        self.num_shards = num_shards
        self.bounded = self.backend.holds_fd
        #: whether ``read`` returns fresh buffers nobody else holds (our local backends)
        self.owned_reads = self.backend.local
        #: whether readers may offer ``buffer()`` (only tried where no descriptor is held)
        self._mappable = not self.bounded
        self.max_open = max(1, max_open)
        # with no more shards than max_open nothing is ever evicted: reads skip the LRU lock
        self._never_evicts = num_shards <= self.max_open
        self._readers: list[Any] = [None] * num_shards
        # per shard, its reader's fill(offset, buffer) (only where readers are never evicted)
        self._fills: list[Callable[[int, memoryview], int] | None] = [None] * num_shards
        self._arrays: dict[tuple[int, str], np.ndarray] = {}
        self._lru: OrderedDict[int, int] = OrderedDict()  # shard -> readers in use
        self._lock = threading.Lock()
        self._closed = False

    def path(self, shard: int) -> PurePath:
        return self.directory / (shard_name(shard) + self.suffix)

    def _open_reader(self, shard: int) -> Any:
        reader = self.backend.reader(self.path(shard))
        reader.open()
        return reader

    def array(self, shard: int, dtype: np.dtype[Any]) -> np.ndarray | None:
        """The whole file as a read-only numpy array, when the backend maps files; else None."""
        key = (shard, dtype.str if dtype.names is None else repr(dtype.descr))
        found = self._arrays.get(key)
        if found is not None:
            return found
        if not self._mappable:
            return None
        buffer = getattr(self._shared(shard), "buffer", None)  # mappable: never evicted
        if buffer is None:
            self._mappable = False  # a custom backend without buffers: use read()
            return None
        with self._lock:
            found = self._arrays.get(key)
            if found is None:
                view = buffer()
                usable = len(view) - len(view) % dtype.itemsize
                found = self._arrays[key] = np.frombuffer(view[:usable], dtype=dtype)
            return found

    def read(self, shard: int, offset: int, size: int) -> Any:
        """``size`` bytes at ``offset`` of the shard's file."""
        if not self.bounded or self._never_evicts:
            return self._shared(shard).read(offset, size)
        reader = self._acquire(shard)
        try:
            return reader.read(offset, size)
        finally:
            self._release(shard)

    def readinto(self, shard: int, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` (a writable, contiguous byte memoryview) with the bytes at ``offset``
        of the shard's file; returns how many bytes the file had there (fewer than
        ``len(buffer)`` only past its end)."""
        if not self.bounded or self._never_evicts:
            fill = self._fills[shard]
            if fill is None:
                fill = self._fills[shard] = _fill_function(self._shared(shard))
            return int(fill(offset, buffer))
        reader = self._acquire(shard)
        try:
            return int(_fill_function(reader)(offset, buffer))
        finally:
            self._release(shard)

    def _shared(self, shard: int) -> Any:
        """The shard's reader, opened on first use, where readers are never evicted."""
        reader = self._readers[shard]
        if reader is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError("reader is closed")
                reader = self._readers[shard]
                if reader is None:
                    reader = self._readers[shard] = self._open_reader(shard)
        return reader

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
            self._fills = [None] * self.num_shards
            for shard, reader in enumerate(self._readers):
                if reader is not None:
                    reader.close()
                    self._readers[shard] = None
            self._lru.clear()
