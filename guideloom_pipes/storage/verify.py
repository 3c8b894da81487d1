"""Verification of a dataset's shards against their commit records: state, kind, dtype and file
sizes when it is opened (:func:`check_listing`), CRC-32 on demand (:func:`verify_checksums`)."""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import numpy as np

from guideloom_pipes.storage.commit import _read_record
from guideloom_pipes.storage.errors import (
    CorruptShardError,
    DatasetChangedError,
    UncommittedShardError,
    size_changed,
)
from guideloom_pipes.storage.io import ResolvedBackend, resolve_backend
from guideloom_pipes.storage.locks import is_locked
from guideloom_pipes.storage.names import RECORD, SHARD_NAME, TMP, _display, shard_name
from guideloom_pipes.storage.records import _CHUNK, FileRecord, ShardRecord
from guideloom_pipes.storage.remote import FsspecIO
from guideloom_pipes.storage.shard_listing import ShardListing, backend_size


def check_listing(
    listing: ShardListing,
    backend: Any,
    kind: str,
    suffixes: Sequence[str],
    dtype: np.dtype[Any] | None,
    dtype_hint: Callable[[np.dtype[Any]], str] | None = None,
    problems: list[Exception] | None = None,
) -> list[dict[str, int]]:
    """Check every shard's files against its commit record; the file sizes per shard.

    Refuses: a shard without a record when others have one (uncommitted), a pending record
    (interrupted commit), a record of another kind or shard, a dtype other than the one
    asked for, a missing file, a file whose size differs from its record. With a
    ``problems`` list, each shard's error is appended to it instead and the check goes on
    to the next shard (the sizes of a shard in error are those found before it).
    """
    backend = resolve_backend(backend)
    result: list[dict[str, int]] = []
    for shard in range(listing.num_shards):
        sizes: dict[str, int] = {}
        try:
            _check_shard(listing, backend, kind, suffixes, dtype, dtype_hint, shard, sizes)
        except (OSError, ValueError, RuntimeError) as error:  # StorageError kinds included
            if problems is None:
                raise
            problems.append(error)
        result.append(sizes)
    return result


def check_shard(
    listing: ShardListing,
    kind: str,
    suffixes: Sequence[str],
    dtype: np.dtype[Any] | None,
    shard: int,
) -> None:
    """:func:`check_listing`'s checks of one shard of a local ``listing`` that knows the
    shard's file sizes (a shard of a manifest whose record changed)."""
    sizes: dict[str, int] = {}
    _check_shard(listing, resolve_backend(None), kind, suffixes, dtype, None, shard, sizes)


def _check_shard(
    listing: ShardListing,
    backend: ResolvedBackend,
    kind: str,
    suffixes: Sequence[str],
    dtype: np.dtype[Any] | None,
    dtype_hint: Callable[[np.dtype[Any]], str] | None,
    shard: int,
    sizes: dict[str, int],
) -> None:
    """:func:`check_listing` for one shard; fills ``sizes`` as it goes."""
    directory = listing.directory
    where = _display(directory)
    have_records = bool(listing.records)
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
    for suffix in suffixes:
        file_name = listing.file_name(shard, suffix)
        size = listing.sizes.get((shard, suffix))
        if size is None:
            size = backend_size(backend, directory / file_name)
        if size is None:
            # a URL's missing object is a 404 (FsspecIO raises PermissionError for a refusal)
            remote = isinstance(backend.backend, FsspecIO)
            answer = " (the server answers 404 Not Found for it)" if remote else ""
            raise FileNotFoundError(
                f"shard {name} of {where} has no {file_name}{answer}; the shard is incomplete "
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
            raise size_changed(file_name, where, size, expected.size, shard)


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
        if listing.listed and is_locked(os.fspath(lock)):
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
        others = [s for s, r in sorted(listing.records.items()) if r.dtype == dtype][:3]
        if others:  # opening it with its own dtype fails on those: the fix is the data
            raise ValueError(
                f"shard {name} of {where} was written with dtype {record.dtype} but the "
                f"format asks for {dtype}, the dtype of shard(s) "
                f"{', '.join(map(shard_name, others))}: the dataset mixes dtypes, which no "
                f"format reads (guideloom-pipes info lists the shards of each). Rewrite shard "
                f"{shard} with {dtype}, or the whole dataset with mode='overwrite'"
            )
        raise ValueError(
            f"shard {name} of {where} was written with dtype {record.dtype} but the format "
            f"asks for {dtype}; reading it would return garbage. Open it with {hint}"
        )


_STORAGE_CLASSES = {
    "stream": "StreamStorage",
    "stream_meta": "StreamWithMetaStorage",
    "document": "DocumentStorage",
}


def file_crc32(reader: Any, size: int, progress: Callable[[int], None] | None = None) -> int:
    """The CRC-32 of the first ``size`` bytes of an open byte reader, read a 16 MiB chunk at
    a time: straight from the mapping where the reader has ``buffer()`` (``MmapIO``: no
    copy), into one reused buffer where it has ``readinto``, else through ``read``.
    ``progress(n)`` is called with the bytes of each chunk."""
    crc = 0
    buffer = getattr(reader, "buffer", None)
    if callable(buffer):
        with buffer() as view:
            for offset in range(0, size, _CHUNK):
                with view[offset : offset + _CHUNK] as chunk:
                    crc = zlib.crc32(chunk, crc)
                    if progress is not None:
                        progress(len(chunk))
        return crc
    readinto = getattr(reader, "readinto", None)
    scratch = bytearray(min(_CHUNK, size)) if callable(readinto) else None
    for offset in range(0, size, _CHUNK):
        want = min(_CHUNK, size - offset)
        if readinto is not None and scratch is not None:
            with memoryview(scratch)[:want] as target:
                got = readinto(offset, target)
                crc = zlib.crc32(target[:got], crc)
        else:
            data = reader.read(offset, want)
            got = len(data)
            crc = zlib.crc32(data, crc)
        if progress is not None:
            progress(got)
        if got < want:
            break  # the file shrank: the size check reports it
    return crc


@dataclass(frozen=True)
class FileCheck:
    """One recorded file checksummed: its size and CRC-32 now against its commit record's,
    or the ``OSError`` reading it raised (``check_files(..., errors="collect")``), or
    ``changed``: the file the listing saw is gone because a writer recommitted the shard
    since (not checked: list again to check the new version)."""

    shard: int
    name: str
    expected: FileRecord
    size: int = -1
    crc32: int = 0
    error: OSError | None = None
    changed: bool = False

    @property
    def matches(self) -> bool:
        """Whether the file reads whole and is what was committed."""
        return (
            not self.changed
            and self.error is None
            and self.size == self.expected.size
            and self.crc32 == self.expected.crc32
        )


def _identity_of(path: PurePath) -> tuple[int, int] | None:
    try:
        info = os.stat(os.fspath(path))
    except (FileNotFoundError, NotADirectoryError):
        return None
    return info.st_dev, info.st_ino


def _recommitted(listing: ShardListing, shard: int) -> bool:
    """Whether the shard's commit record on disk is no longer the one ``listing`` read (a
    writer committed or removed the shard since)."""
    stem = os.path.join(os.fspath(listing.directory), shard_name(shard))
    return _read_record(stem) != listing.records.get(shard)


def _listed_identity(listing: ShardListing, shard: int, name: str) -> tuple[int, int] | None:
    """The device and inode ``listing`` saw for the file ``name`` of ``shard`` (local
    listings; None where unknown)."""
    match = SHARD_NAME.match(name)
    return listing.identities.get((shard, match.group("suffix"))) if match else None


def _locate(listing: ShardListing, shard: int, name: str) -> PurePath | None:
    """Where the file ``name`` of ``shard`` that ``listing`` saw is now, as readers find it
    (local listings know each file's device and inode: under its listed name, or under its
    canonical name once its commit rolled forward); None when that file is gone because a
    writer recommitted the shard. A file replaced by anything else (a copy, ``rsync``) is
    checked where it is, at its name."""
    path = listing.directory / name
    identity = _listed_identity(listing, shard, name)
    match = SHARD_NAME.match(name)
    if identity is None or match is None:
        return path
    for candidate in dict.fromkeys((name, shard_name(shard) + match.group("suffix"))):
        if _identity_of(listing.directory / candidate) == identity:
            return listing.directory / candidate
    return None if _recommitted(listing, shard) else path


def recorded_files(
    listing: ShardListing, suffixes: Sequence[str], shards: Iterable[int]
) -> list[tuple[int, str, FileRecord]]:
    """(shard, file name, its record) of every file the records of ``shards`` name."""
    files = []
    for shard in shards:
        record = listing.records[shard]
        for suffix in suffixes:
            expected = record.files.get(suffix.lstrip("."))
            if expected is not None:
                files.append((shard, listing.file_name(shard, suffix), expected))
    return files


def check_files(
    listing: ShardListing,
    backend: Any,
    files: Iterable[tuple[int, str, FileRecord]],
    progress: Callable[[int], None] | None = None,
    errors: str = "raise",
) -> Iterator[FileCheck]:
    """Checksum each of ``files`` (see :func:`recorded_files`), one :class:`FileCheck`
    each. A file that cannot be read raises its ``OSError``, or with ``errors="collect"``
    is a check carrying it (the CLI reports every file and goes on)."""
    backend = resolve_backend(backend)
    for shard, name, expected in files:
        try:
            check = _check_file(listing, backend, shard, name, expected, progress)
        except OSError as error:
            if _recommitted_here(listing, shard):
                check = FileCheck(shard, name, expected, changed=True)
            elif errors != "collect":
                raise
            else:
                check = FileCheck(shard, name, expected, error=error)
        else:
            if not check.matches and _recommitted_here(listing, shard):
                # the file listed was replaced by a commit after all (its inode number
                # reused by the new version): not a mismatch, another version
                check = FileCheck(shard, name, expected, changed=True)
        yield check


def _recommitted_here(listing: ShardListing, shard: int) -> bool:
    """:func:`_recommitted` for a local listing (False for others: their records are not
    local files)."""
    return bool(listing.identities) and _recommitted(listing, shard)


def _check_file(
    listing: ShardListing,
    backend: ResolvedBackend,
    shard: int,
    name: str,
    expected: FileRecord,
    progress: Callable[[int], None] | None,
) -> FileCheck:
    """Checksum the file ``name`` of ``shard`` that ``listing`` saw (see :func:`_locate`)."""
    path = _locate(listing, shard, name)
    if path is None:
        return FileCheck(shard, name, expected, changed=True)
    reader = backend.reader(path)
    reader.open()
    try:
        identity = _listed_identity(listing, shard, name)
        if identity is not None and _identity_of(path) != identity:
            return FileCheck(shard, name, expected, changed=True)  # replaced as it opened
        size = reader.filesize()
        return FileCheck(shard, name, expected, size, file_crc32(reader, size, progress))
    finally:
        reader.close()


def verify_checksums(
    listing: ShardListing,
    backend: Any,
    suffixes: Sequence[str],
    progress: Callable[[int], None] | None = None,
) -> dict[str, int]:
    """Check each recorded file's size, then its CRC-32, against the commit record; raise
    :class:`CorruptShardError` on a mismatch.

    Sizes come first, for every shard, before any data is read: a file truncated (or grown)
    since its commit is named with both sizes at once, without checksumming the dataset.
    Returns counts: ``{"shards": ..., "files": ..., "bytes": ...}`` checked, and
    ``"unrecorded"``: shards without a commit record (written by GuideLoom), which have no
    checksum to verify (a :class:`UserWarning` says so). ``progress(n)`` is called with
    the bytes of each chunk checksummed.
    """
    backend = resolve_backend(backend)
    checked = {"shards": 0, "files": 0, "bytes": 0, "unrecorded": 0}
    recorded = [
        (shard, listing.records[shard])
        for shard in range(listing.num_shards)
        if shard in listing.records
    ]
    checked["unrecorded"] = listing.num_shards - len(recorded)
    changed = _check_sizes(listing, backend, suffixes, recorded)
    problems: list[str] = []
    checked["shards"] = len(recorded)
    files = recorded_files(listing, suffixes, [s for s, _ in recorded if s not in changed])
    for check in check_files(listing, backend, files, progress):
        if check.changed:
            changed.add(check.shard)
            continue
        checked["files"] += 1
        checked["bytes"] += check.size
        if not check.matches:
            problems.append(
                f"{check.name}: crc32 {check.crc32:#010x} over {check.size} bytes, committed "
                f"{check.expected.crc32:#010x} over {check.expected.size} bytes"
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
    if changed:
        raise DatasetChangedError(
            f"shard(s) {', '.join(shard_name(s) for s in sorted(changed))} of "
            f"{_display(listing.directory)} were recommitted by a writer after this reader "
            f"listed the dataset, so the version it opened could not be verified there (every "
            f"other shard was checked and is sound). Open the dataset again to verify the new "
            f"version (storage.verify() does, a few times)"
        )
    return checked


def _check_sizes(
    listing: ShardListing,
    backend: ResolvedBackend,
    suffixes: Sequence[str],
    recorded: list[tuple[int, ShardRecord]],
) -> set[int]:
    """Raise :class:`CorruptShardError` naming every recorded file whose size differs from
    its commit record (or that is gone), with both sizes; the shards a writer recommitted
    since they were listed (not checked)."""
    wrong: list[str] = []
    shards: list[int] = []
    changed: set[int] = set()
    for shard, record in recorded:
        for suffix in suffixes:
            name = listing.file_name(shard, suffix)
            expected = record.files[suffix.lstrip(".")].size
            path = _locate(listing, shard, name)
            if path is None:
                changed.add(shard)
                continue
            size = backend_size(backend, path)
            if size == expected:
                continue
            if _recommitted_here(listing, shard):
                changed.add(shard)  # replaced by a commit since it was listed
                continue
            if size is None:
                wrong.append(f"{name} is missing (committed with {expected} bytes)")
            else:
                change = "truncated" if size < expected else "grew"
                wrong.append(f"{name} is {size} bytes, committed with {expected} bytes ({change})")
            if not shards or shards[-1] != shard:
                shards.append(shard)
    if wrong:
        rewrite = ", ".join(map(str, shards))
        raise CorruptShardError(
            f"size mismatch in {_display(listing.directory)}: {'; '.join(wrong)}. These files "
            f"changed after they were committed (a file truncated under a running memory-mapped "
            f"reader kills it with SIGBUS; see 'Files changing under a reader' in "
            f"docs/storage.md). Restore them or rewrite shard(s) {rewrite}"
        )
    return changed
