"""Bringing a directory's shards to a committed state outside a writer: finishing what
stopped writers left (:func:`recover_directory`, planned by :func:`recovery_plan`) and
sealing shard files GuideLoom wrote with a commit record (:func:`seal_shard`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from guideloom_pipes.storage.checksums import BlockCrc32
from guideloom_pipes.storage.commit import (
    _DATA_SUFFIXES,
    _fsync_directory,
    _read_record,
    _remove,
    _write_record,
)
from guideloom_pipes.storage.errors import CorruptShardError, ShardLockedError
from guideloom_pipes.storage.locks import _drop_lock, _take_lock
from guideloom_pipes.storage.names import PENDING, RECORD, SHARD_NAME, TMP, shard_name
from guideloom_pipes.storage.records import _CHUNK, FileRecord, ShardRecord
from guideloom_pipes.storage.transaction import _recover_shard


def recovery_plan(directory: str) -> dict[int, str]:
    """The shards of ``directory`` that stopped writers left something of, each with what
    :func:`recover_directory` would do: ``"rolled_forward"`` (a committed record naming
    versioned files), ``"removed"`` (an interrupted removal) or ``"cleaned"`` (temporaries,
    versioned files no record names, a stale lock). Reads names and records only; takes no
    lock, so a shard in the plan may be one a live writer holds."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    suspects: dict[int, str] = {}
    records: list[int] = []
    for name in names:
        match = SHARD_NAME.match(name)
        if match is None:
            continue
        shard = int(match.group("shard"))
        if match.group("temporary") or match.group("generation") is not None:
            suspects.setdefault(shard, "cleaned")
        elif match.group("suffix") == RECORD:
            records.append(shard)
    for shard in records:
        record = _read_record(os.path.join(directory, shard_name(shard)))
        if record is not None and record.state == "deleted":
            suspects[shard] = "removed"
        elif record is not None and record.versioned:
            suspects[shard] = "rolled_forward"
    return suspects


def recover_directory(directory: str) -> dict[str, list[int]]:
    """Finish or clean up what stopped writers left in ``directory``.

    For every shard not being written right now (its write lock is free): a committed
    record naming versioned files is rolled forward to the canonical names, a shard whose
    removal was interrupted is removed, and versioned files no record names, stale
    temporaries and stale locks are deleted. Shards a live writer holds are left alone.
    Returns the shard ids ``{"rolled_forward": [...], "removed": [...], "cleaned": [...]}``.
    """
    result: dict[str, list[int]] = {"rolled_forward": [], "removed": [], "cleaned": []}
    suspects = recovery_plan(directory)
    for shard, what in sorted(suspects.items(), reverse=True):  # removals from the top
        stem = os.path.join(directory, shard_name(shard))
        try:
            fd = _take_lock(stem + RECORD + TMP, shard, directory, wait=0.0)
        except ShardLockedError:
            continue  # a live writer: its files are not leftovers
        try:
            _recover_shard(directory, shard)
            for suffix in _DATA_SUFFIXES:
                _remove(stem + suffix + TMP)
            _remove(stem + RECORD + PENDING)
        finally:
            _drop_lock(fd, stem + RECORD + TMP)
        result[what].append(shard)
    if suspects:
        _fsync_directory(directory)
    return result


def seal_shard(
    directory: str,
    shard: int,
    kind: str,
    suffixes: Sequence[str],
    sizes: dict[str, int],
    count: int,
    dtype: np.dtype[Any] | None,
    payloads: int | None = None,
    format: str | None = None,
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
            return False
        files: dict[str, FileRecord] = {}
        for suffix in suffixes:
            path = stem + suffix
            checksums = BlockCrc32()
            with open(path, "rb") as data:
                while chunk := data.read(_CHUNK):
                    checksums.update(chunk)
            size = checksums.size
            if size != sizes[suffix]:
                raise CorruptShardError(
                    f"{path} changed while it was being sealed ({sizes[suffix]} -> {size} "
                    f"bytes); seal again once no other process writes it"
                )
            files[suffix.lstrip(".")] = FileRecord(size, checksums.crc32, checksums.blocks())
        record = ShardRecord(
            kind, shard, count, files, dtype, payloads, generation=1, format=format
        )
        _write_record(stem, record.to_json())
        return True
    finally:
        _drop_lock(fd, lock_path)
