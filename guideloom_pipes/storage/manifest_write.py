"""Writing a dataset's manifest: a writer's :class:`ManifestSession` around its commit (its
marker held while it commits, then its fragment), the merge of fragments into the whole
table, and :func:`build_manifest` (``guideloom-pipes index``) for a dataset written without
one. Readers never write any of these (see :mod:`manifest_open`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from guideloom_pipes.storage.commit import _fsync_directory
from guideloom_pipes.storage.errors import CorruptShardError, ShardLockedError
from guideloom_pipes.storage.locks import is_locked
from guideloom_pipes.storage.manifest import (
    COMPACT_LOCK,
    FRAGMENT_PREFIX,
    MAIN,
    MANIFEST_DIR,
    MARKER_PREFIX,
    SUFFIX,
    ManifestTable,
    column_names,
    new_name,
)
from guideloom_pipes.storage.manifest_open import (
    Loaded,
    combine,
    differs,
    manifest_files,
    table_fingerprint,
)
from guideloom_pipes.storage.names import RECORD, SHARD_NAME, shard_name
from guideloom_pipes.storage.records import ShardRecord, dtype_to_json

#: fragments a writer's close leaves before it merges them into the whole table (an open
#: reads each; merging costs a pass over every shard's row)
MERGE_AT = 8


class NotTabulated(Exception):
    """A shard the table cannot describe (files not at their canonical names, records of
    several dtypes): no table is written; readers list the directory."""


def rows(
    directory: str,
    shards: Sequence[int],
    records: Mapping[int, ShardRecord | None],
    suffixes: Sequence[str],
) -> dict[str, np.ndarray]:
    """The table's columns for ``shards`` of ``directory`` (``records``: each shard's
    commit record, None for a shard without one), from a ``stat`` of each file."""
    names = column_names(suffixes)
    columns = {name: np.full(len(shards), -1, dtype=np.int64) for name in names}
    for row, shard in enumerate(shards):
        stem = os.path.join(directory, shard_name(shard))
        columns["shard"][row] = shard
        record = records.get(shard)
        if record is not None:
            if record.versioned or record.state != "committed":
                raise NotTabulated(f"shard {shard_name(shard)}'s commit is not settled")
            info = os.stat(stem + RECORD)
            columns["record_size"][row] = info.st_size
            columns["record_ino"][row] = info.st_ino
            columns["record_mtime"][row] = info.st_mtime_ns
            columns["count"][row] = record.count
            columns["payloads"][row] = -1 if record.payloads is None else record.payloads
        for i, suffix in enumerate(suffixes):
            info = os.stat(stem + suffix)
            columns[f"size{i}"][row] = info.st_size
            columns[f"ino{i}"][row] = info.st_ino
            columns[f"mtime{i}"][row] = info.st_mtime_ns
            committed = record.files.get(suffix.lstrip(".")) if record is not None else None
            if committed is not None:
                columns[f"crc{i}"][row] = committed.crc32
    return columns


def _dtype_of(records: Iterable[ShardRecord | None]) -> Any:
    found = {
        r.dtype.str if r.dtype.names is None else repr(r.dtype.descr): r.dtype
        for r in records
        if r is not None and r.dtype is not None
    }
    if len(found) > 1:
        raise NotTabulated("the shards have several dtypes")
    return dtype_to_json(next(iter(found.values()))) if found else None


def _header(
    kind: str,
    suffixes: Sequence[str],
    dtype: Any,
    records: bool,
    complete: bool,
    before: int,
    after: int,
    dev: int,
    count: int,
) -> dict[str, Any]:
    return {
        "kind": kind,
        "suffixes": list(suffixes),
        "dtype": dtype,
        "records": records,
        "complete": complete,
        "before": before,
        "after": after,
        "afters": [after],
        "written": time.time_ns(),
        "dev": dev,
        "rows": count,
        "fingerprint": None,
    }


def _whole(table: ManifestTable) -> ManifestTable:
    """``table`` (the whole dataset) with its fingerprint."""
    table.header["fingerprint"] = table_fingerprint(
        table.rows, table.suffixes, table.columns, bool(table.header["records"])
    )
    return table


class ManifestSession:
    """One writer's part in the manifest, around its commit: ``ManifestSession(...)`` just
    before the first commit point takes the marker; :meth:`finish` after the last writes the
    fragment and drops the marker; a writer that fails keeps the marker (released, so
    readers see that its writer stopped)."""

    def __init__(self, directory: str, kind: str, suffixes: Sequence[str], whole: bool) -> None:
        self.directory = directory
        self.kind = kind
        self.suffixes = tuple(suffixes)
        self.folder = os.path.join(directory, MANIFEST_DIR)
        os.makedirs(self.folder, exist_ok=True)
        self.marker = os.path.join(self.folder, new_name(MARKER_PREFIX))
        self._fd: int | None = os.open(
            self.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
        )
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        _retire_whole(self.folder)
        info = os.stat(directory)
        self.before, self.dev = info.st_mtime_ns, info.st_dev
        # the fragment is the whole dataset for an overwrite or create, and for a first
        # writer of an empty directory that no other writer is writing
        self.whole = whole or (
            not _shard_files(directory) and _only_marker(self.folder, self.marker)
        )

    def finish(self, records: Mapping[int, ShardRecord]) -> None:
        """Write the fragment of the shards committed with ``records`` (checked against a
        listing of the directory: see :meth:`_verified`), drop the marker, and merge the
        fragments if there are many."""
        try:
            shards = sorted(records)
            after = os.stat(self.directory).st_mtime_ns
            columns = rows(self.directory, shards, records, self.suffixes)
            dtype = _dtype_of(records.values())
            header = _header(
                self.kind,
                self.suffixes,
                dtype,
                True,
                self.whole,
                self.before,
                after,
                self.dev,
                len(shards),
            )
            table = ManifestTable(header, columns)
            if self.whole and shards != list(range(len(shards))):
                # not the whole dataset after all (other writers write the other ids, or
                # the ids have a gap): its rows, for the merge of every writer's
                header["complete"] = self.whole = False
            if self.whole:
                _whole(table)
            verified = table.header["verified"] = self._verified(table, after)
            table.header["written"] = time.time_ns()  # once checked: the newest check
            table.write(os.path.join(self.folder, new_name(FRAGMENT_PREFIX, SUFFIX)))
            _fsync_directory(self.folder)
        except NotTabulated:
            self.forget()  # a dataset the table cannot describe has no manifest
            self.release(drop=True)
            return
        self.release(drop=True)
        with contextlib.suppress(OSError):
            merge_fragments(self.directory, at_least=MERGE_AT if verified else 1)

    def _verified(self, table: ManifestTable, after: int) -> bool:
        """Whether the dataset's table with ``table`` applied describes the directory as it
        is (one listing), with no other writer committing: what lets readers trust the
        manifest without listing the directory while its modification time stays
        ``after``."""
        names = os.listdir(self.folder)
        if _other_markers(names, self.marker):
            return False  # its writer verifies when it finishes
        tables = [table]
        for name in names:
            if name == MAIN or (name.startswith(FRAGMENT_PREFIX) and name.endswith(SUFFIX)):
                with contextlib.suppress(FileNotFoundError, CorruptShardError):
                    tables.append(ManifestTable.read(os.path.join(self.folder, name)))
        found = combine(tables, assume_whole=True)
        if not isinstance(found, Loaded) or differs(self.directory, found):
            return False
        return os.stat(self.directory).st_mtime_ns == after and any(
            t.header["complete"] for t in tables
        )

    def forget(self) -> None:
        """Delete the manifest's tables: readers list the directory (they read no table
        while this writer's marker exists, so none reads a half-deleted manifest)."""
        for name in os.listdir(self.folder):
            if name == MAIN or name.startswith(FRAGMENT_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.folder, name))
        _fsync_directory(self.folder)

    def release(self, drop: bool) -> None:
        """Release the marker: deleted (``drop``: the fragment is in place), or left for
        readers to find unlocked (the writer failed between its commits and its fragment)."""
        if self._fd is None:
            return
        if drop:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.marker)
        os.close(self._fd)
        self._fd = None


def _retire_whole(folder: str) -> None:
    """Give the whole table, if there is one, a fragment's name, once this writer's marker
    exists: local opens read it as before (a fragment may be whole), while opens at a URL,
    which read only the whole table, list the dataset until a merge or an index with no
    writer writing names one whole again, instead of trusting a table that this writer's
    commits make stale. Under the merge lock, so that a merge that began before the marker
    existed has written its table."""
    lock = _CompactLock(folder, wait=True)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.rename(
                os.path.join(folder, MAIN), os.path.join(folder, new_name(FRAGMENT_PREFIX, SUFFIX))
            )
            _fsync_directory(folder)
    finally:
        lock.close()


def _shard_files(directory: str) -> bool:
    """Whether ``directory`` holds shard files (temporaries aside: the writer's own)."""
    with os.scandir(directory) as entries:
        for entry in entries:
            match = SHARD_NAME.match(entry.name)
            if match is not None and not match.group("temporary"):
                return True
    return False


def _only_marker(folder: str, marker: str) -> bool:
    return not _other_markers(os.listdir(folder), marker)


def _other_markers(names: Iterable[str], marker: str) -> bool:
    """Whether ``names`` (the manifest folder's) hold another writer's marker than
    ``marker``."""
    mine = os.path.basename(marker)
    return any(n.startswith(MARKER_PREFIX) and n != mine for n in names)


class _CompactLock:
    """The manifest folder's merge lock, taken without waiting (None: another holds it)."""

    def __init__(self, folder: str, wait: bool) -> None:
        self.fd = os.open(os.path.join(folder, COMPACT_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as error:
            os.close(self.fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ShardLockedError(
                    error.errno, "another process is merging the manifest"
                ) from None
            raise

    def close(self) -> None:
        os.close(self.fd)


def merge_fragments(directory: str, at_least: int = 1) -> bool:
    """Merge the manifest's tables into one whole table, checked against a listing of the
    directory, when there are ``at_least`` fragments and no writer is writing; whether it
    did. Writers call it once they dropped their marker: the last of several concurrent
    writers (each found the others' markers, so none could check the directory alone)
    leaves a checked table."""
    folder = os.path.join(directory, MANIFEST_DIR)
    names = manifest_files(directory) or []
    fragments = [n for n in names if n.startswith(FRAGMENT_PREFIX) and n.endswith(SUFFIX)]
    if len(fragments) < at_least or any(n.startswith(MARKER_PREFIX) for n in names):
        return False
    try:
        lock = _CompactLock(folder, wait=False)
    except ShardLockedError:
        return False
    try:
        names = os.listdir(folder)  # again, under the lock
        if any(n.startswith(MARKER_PREFIX) for n in names):
            return False
        fragments = [n for n in names if n.startswith(FRAGMENT_PREFIX) and n.endswith(SUFFIX)]
        info = os.stat(directory)
        tables = [
            ManifestTable.read(os.path.join(folder, n))
            for n in [*fragments, MAIN]
            if n != MAIN or MAIN in names
        ]
        found = combine(tables, assume_whole=True)
        if not isinstance(found, Loaded) or differs(directory, found):
            return False
        if os.stat(directory).st_mtime_ns != info.st_mtime_ns:
            return False
        _write_whole(folder, found, info.st_mtime_ns)
        for name in fragments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))
        _fsync_directory(folder)
        return True
    except (FileNotFoundError, CorruptShardError):
        return False
    finally:
        lock.close()


def _write_whole(folder: str, loaded: Loaded, after: int) -> None:
    """Write ``loaded`` as the whole table, checked against the directory at ``after``."""
    header = dict(loaded.header)
    header.update(
        complete=True,
        before=after,
        after=after,
        verified=True,
        written=time.time_ns(),
        rows=len(loaded.columns["shard"]),
    )
    table = ManifestTable(header, dict(loaded.columns))
    if loaded.fingerprint is not None:
        table.header["fingerprint"] = loaded.fingerprint
    else:
        _whole(table)
    table.write(os.path.join(folder, MAIN))


def build_manifest(
    directory: str,
    kind: str,
    suffixes: Sequence[str],
    records: Mapping[int, ShardRecord],
    num_shards: int,
    own_marker: str | None = None,
) -> None:
    """Write the whole table of ``directory``, whose ``num_shards`` shards were just listed
    and checked (``records``: their commit records; empty for a dataset without), and delete
    the fragments and the markers of stopped writers it replaces. Refuses while a writer is
    writing (:class:`ShardLockedError`)."""
    folder = os.path.join(directory, MANIFEST_DIR)
    os.makedirs(folder, exist_ok=True)
    lock = _CompactLock(folder, wait=True)
    try:
        names = os.listdir(folder)
        mine = os.path.basename(own_marker) if own_marker else None
        live = [
            n
            for n in names
            if n.startswith(MARKER_PREFIX) and n != mine and is_locked(os.path.join(folder, n))
        ]
        if live:
            raise ShardLockedError(
                errno.EWOULDBLOCK,
                f"a writer is writing {directory} ({live[0]} is held); index it once it closed",
            )
        info = os.stat(directory)
        shards = list(range(num_shards))
        columns = rows(directory, shards, records, suffixes)
        if os.stat(directory).st_mtime_ns != info.st_mtime_ns:
            raise ShardLockedError(
                errno.EWOULDBLOCK, f"{directory} changed while it was indexed; index it again"
            )
        dtype = _dtype_of(records.values())
        header = _header(
            kind,
            suffixes,
            dtype,
            bool(records),
            True,
            info.st_mtime_ns,
            info.st_mtime_ns,
            info.st_dev,
            num_shards,
        )
        header["verified"] = True  # listed and checked just now
        _whole(ManifestTable(header, columns)).write(os.path.join(folder, MAIN))
        for name in names:
            stale = name.startswith(FRAGMENT_PREFIX) or (
                name.startswith(MARKER_PREFIX) and not is_locked(os.path.join(folder, name))
            )
            if stale:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))
        _fsync_directory(folder)
    finally:
        lock.close()
