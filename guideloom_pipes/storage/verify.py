"""Verification of a dataset's shards against their commit records: state, kind, dtype and file
sizes when it is opened (:func:`check_listing`), CRC-32 on demand (:func:`verify_checksums`)."""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from guideloom_pipes.storage.commit import _is_locked
from guideloom_pipes.storage.errors import CorruptShardError, UncommittedShardError
from guideloom_pipes.storage.io import ResolvedBackend, resolve_backend
from guideloom_pipes.storage.listing import ShardListing, _backend_size
from guideloom_pipes.storage.names import RECORD, TMP, _display, shard_name
from guideloom_pipes.storage.records import _CHUNK, ShardRecord


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
            file_name = listing.file_name(shard, suffix)
            size = listing.sizes.get((shard, suffix))
            if size is None:
                size = _backend_size(backend, directory / file_name)
            if size is None:
                raise FileNotFoundError(
                    f"shard {name} of {where} has no {file_name}; the shard is incomplete "
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
                    f"{file_name} in {where} is {size} bytes but was committed with "
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
    """Check each recorded file's size, then its CRC-32, against the commit record; raise
    :class:`CorruptShardError` on a mismatch.

    Sizes come first, for every shard, before any data is read: a file truncated (or grown)
    since its commit is named with both sizes at once, without checksumming the dataset.
    Returns counts: ``{"shards": ..., "files": ..., "bytes": ...}`` checked, and
    ``"unrecorded"``: shards without a commit record (written by GuideLoom), which have no
    checksum to verify (a :class:`UserWarning` says so).
    """
    backend = resolve_backend(backend)
    checked = {"shards": 0, "files": 0, "bytes": 0, "unrecorded": 0}
    recorded = [
        (shard, listing.records[shard])
        for shard in range(listing.num_shards)
        if shard in listing.records
    ]
    checked["unrecorded"] = listing.num_shards - len(recorded)
    _check_sizes(listing, backend, suffixes, recorded)
    problems: list[str] = []
    for shard, record in recorded:
        checked["shards"] += 1
        for suffix in suffixes:
            name = listing.file_name(shard, suffix)
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


def _check_sizes(
    listing: ShardListing,
    backend: ResolvedBackend,
    suffixes: Sequence[str],
    recorded: list[tuple[int, ShardRecord]],
) -> None:
    """Raise :class:`CorruptShardError` naming every recorded file whose size differs from
    its commit record (or that is gone), with both sizes."""
    wrong: list[str] = []
    shards: list[int] = []
    for shard, record in recorded:
        for suffix in suffixes:
            name = listing.file_name(shard, suffix)
            expected = record.files[suffix.lstrip(".")].size
            size = _backend_size(backend, listing.directory / name)
            if size == expected:
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
