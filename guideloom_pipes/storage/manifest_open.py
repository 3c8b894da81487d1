"""Opening a dataset through its manifest: which manifest files make the dataset's table,
whether they still describe the directory, and :class:`ManifestListing`, the listing a
reader serves from that table.

The checks, cheapest first: while a writer's ``writing-*`` marker exists, or when a marker's
writer is gone, the manifest is not used. The table is then trusted at open if the
directory's modification time is the one the last writer recorded after its commit; if it
differs (a file was added, renamed or removed since), the directory is listed once (names
and inodes, no ``stat``) and must hold exactly the table's files. Each shard's files and
record are compared with the table (inode, size, modification time) when a reader first
opens the shard, before any of its bytes are delivered. A manifest that fails a check is not
used: the dataset opens by listing its directory, as one without a manifest, with a
:class:`StaleManifestWarning` that says how to write it again.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import numpy as np

from guideloom_pipes.storage.errors import StaleManifestWarning, size_changed
from guideloom_pipes.storage.locks import is_locked
from guideloom_pipes.storage.manifest import (
    FRAGMENT_PREFIX,
    MAIN,
    MANIFEST_DIR,
    MARKER_PREFIX,
    SUFFIX,
    ManifestTable,
    merge,
)
from guideloom_pipes.storage.names import RECORD, SHARD_NAME, shard_name
from guideloom_pipes.storage.records import ShardRecord, dtype_from_json
from guideloom_pipes.storage.shard_listing import FileSizes, ShardListing, fingerprint_of
from guideloom_pipes.storage.verify import check_shard


@dataclass
class Loaded:
    """The dataset's table, merged from its manifest files."""

    #: the header of the whole-dataset table the others were applied to
    header: dict[str, Any]
    columns: Mapping[str, np.ndarray]
    #: the directory's modification time after the last writer's commit
    after: int
    #: the dataset's fingerprint, when no fragment was applied to the whole table
    fingerprint: dict[str, Any] | None
    source: str
    #: whether the newest table's writer found the directory to hold exactly this table's
    #: files once it had written them
    verified: bool = False


@dataclass
class Unusable:
    """Why the manifest cannot be used, and whether that deserves a warning (a manifest
    that disagrees with its directory) or is expected (a writer is committing)."""

    reason: str
    warn: bool


def manifest_files(directory: str) -> list[str] | None:
    """The names in the dataset's manifest folder, or None if it has none."""
    try:
        return os.listdir(os.path.join(directory, MANIFEST_DIR))
    except (FileNotFoundError, NotADirectoryError):
        return None


def load(directory: str, own_marker: str | None = None) -> Loaded | Unusable | None:
    """The dataset's table from its manifest files (None: it has none). ``own_marker``: a
    writer's own marker, not counted as another writer's."""
    for _ in range(3):  # a fragment merged away while we read: read the files again
        names = manifest_files(directory)
        if names is None:
            return None
        try:
            return _load(directory, [n for n in names if n != own_marker])
        except FileNotFoundError:
            continue
    return Unusable("its files changed every time they were read", warn=False)


def _load(directory: str, names: list[str]) -> Loaded | Unusable | None:
    folder = os.path.join(directory, MANIFEST_DIR)
    markers = sorted(n for n in names if n.startswith(MARKER_PREFIX))
    if markers:
        dead = [m for m in markers if not is_locked(os.path.join(folder, m))]
        if dead:
            return Unusable(
                f"a writer stopped between its commit and its manifest entry ({dead[0]})", True
            )
        return Unusable("a writer is committing", warn=False)
    files = [
        n for n in names if n == MAIN or (n.startswith(FRAGMENT_PREFIX) and n.endswith(SUFFIX))
    ]
    if not files:
        return None
    tables = [ManifestTable.read(os.path.join(folder, n)) for n in files]
    found = combine(tables)
    if isinstance(found, Loaded) and not found.verified:
        return Unusable(f"the last writer found files it did not write ({found.source})", True)
    return found


def combine(tables: list[ManifestTable], assume_whole: bool = False) -> Loaded | Unusable | None:
    """The dataset's table from manifest tables: the newest whole one, with the partial
    ones written after it began applied in the order they were written. ``assume_whole``:
    without a whole table, the partial ones together (for a writer that then checks the
    result against a listing of the directory)."""
    whole = [t for t in tables if t.header["complete"]]
    if not whole and not (assume_whole and tables):
        return Unusable("no table covers the whole dataset", warn=False)
    base = max(whole or tables, key=_written)
    if not whole:  # the partial tables, oldest first, as one
        tables = sorted(tables, key=_written)
        base, rest = tables[0], tables[1:]
        return _applied(base, [t for t in rest], whole=False)
    later = sorted(
        (t for t in tables if t is not base and t.header["after"] > base.header["before"]),
        key=_written,
    )
    return _applied(base, later, whole=True)


def _applied(
    base: ManifestTable, later: list[ManifestTable], whole: bool
) -> Loaded | Unusable | None:
    """``later`` applied to ``base``."""
    for table in later:
        same = (table.header["kind"], table.suffixes, table.header["dtype"])
        if same != (base.header["kind"], base.suffixes, base.header["dtype"]):
            return Unusable(f"{table._source} describes shards of another kind or dtype", True)
    columns = merge([base, *later]) if later else _Columns(base)
    shards = columns["shard"]
    if len(shards) == 0:
        return None  # no shards: discovery says so
    if int(shards[-1]) != len(shards) - 1 or int(shards[0]) != 0:
        return Unusable("its shard ids do not run 0..N-1", True)
    # the table written last was checked last: trusted if its writer found the directory
    # to be what the tables say, with no other writer committing
    newest = max([base, *later], key=lambda t: t.header["written"])
    fingerprint = base.header.get("fingerprint") if not later and whole else None
    return Loaded(
        base.header,
        columns,
        max(t.header["after"] for t in [base, *later]),
        fingerprint,
        str(newest._source),
        bool(newest.header.get("verified")),
    )


class _Columns(Mapping[str, np.ndarray]):
    """A table's columns, each checked against its checksum when first used (an open of a
    million shards reads the few it needs)."""

    def __init__(self, table: ManifestTable) -> None:
        self._table = table

    def __getitem__(self, name: str) -> np.ndarray:
        return self._table.column(name)

    def value(self, name: str, row: int) -> int:
        return self._table.value(name, row)

    def __iter__(self) -> Iterator[str]:
        return iter(self._table.columns)

    def __len__(self) -> int:
        return len(self._table.columns)


def _written(table: ManifestTable) -> tuple[int, int]:
    return table.header["after"], table.header["written"]


def open_listing(
    directory: PurePath, kind: str, suffixes: tuple[str, ...]
) -> ManifestListing | None:
    """The listing of ``directory`` from its manifest, when the manifest passes the open's
    checks; else None (the caller lists the directory), with a warning where the manifest
    disagrees with the directory."""
    path = os.fspath(directory)
    try:
        info = os.stat(path)
    except OSError:
        return None  # discovery names the problem
    loaded = load(path)
    if loaded is None:
        return None
    if isinstance(loaded, Unusable):
        if loaded.warn:
            _warn_stale(path, loaded.reason)
        return None
    if loaded.header["kind"] != kind or tuple(loaded.header["suffixes"]) != suffixes:
        return None  # opened as another storage class: discovery says which
    if info.st_mtime_ns != loaded.after or info.st_dev != loaded.header["dev"]:
        reason = differs(path, loaded)
        if reason:
            _warn_stale(path, reason)
            return None
    return ManifestListing(directory, loaded, info.st_dev)


def _warn_stale(directory: str, reason: str) -> None:
    warnings.warn(
        f"the manifest of {directory} was not used: {reason}. The dataset was opened by "
        f"listing its directory (as fast as without a manifest); run `guideloom-pipes index "
        f"{directory}` once no writer is writing it, to open it in constant time again",
        StaleManifestWarning,
        stacklevel=6,
    )


def differs(directory: str, loaded: Loaded) -> str:
    """How the directory's shard files differ from the table ('' if they do not): one
    listing, names and inodes only."""
    suffixes = tuple(loaded.header["suffixes"])
    records = bool(loaded.header["records"])
    columns = loaded.columns
    count = len(columns["shard"])
    found = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            match = SHARD_NAME.match(entry.name)
            if match is None or match.group("temporary"):
                continue
            if match.group("generation") is not None:
                return f"{entry.name} is a commit the manifest does not know"
            shard, suffix = int(match.group("shard")), match.group("suffix")
            if shard >= count:
                return f"shard {shard_name(shard)} is not in it"
            if suffix == RECORD:
                expected = int(columns["record_ino"][shard]) if records else -1
            elif suffix in suffixes:
                expected = int(columns[f"ino{suffixes.index(suffix)}"][shard])
            else:
                return f"{entry.name} is a file of another storage class"
            if entry.inode() != expected or not entry.is_file(follow_symlinks=False):
                return f"{entry.name} was replaced or added since it was written"
            found += 1
    if found != count * (len(suffixes) + records):
        return "shard files were deleted since it was written"
    return ""


class _FileColumn(Mapping[tuple[int, str], Any]):
    """A table column per (shard, suffix), as the listing's dicts are (lazily)."""

    def __init__(self, listing: ManifestListing, what: str) -> None:
        self._listing = listing
        self._what = what

    def __getitem__(self, key: tuple[int, str]) -> Any:
        shard, suffix = key
        listing = self._listing
        if not 0 <= shard < listing.num_shards or suffix not in listing.suffixes:
            raise KeyError(key)
        value = listing.value(f"{self._what}{listing.suffixes.index(suffix)}", shard)
        return (listing.dev, value) if self._what == "ino" else value

    def __iter__(self) -> Iterator[tuple[int, str]]:
        listing = self._listing
        return ((s, x) for s in range(listing.num_shards) for x in listing.suffixes)

    def __len__(self) -> int:
        return self._listing.num_shards * len(self._listing.suffixes)


class _Records(Mapping[int, ShardRecord]):
    """The shards' commit records, each read when first asked for."""

    def __init__(self, listing: ManifestListing) -> None:
        self._listing = listing
        self._read: dict[int, ShardRecord] = {}

    def __getitem__(self, shard: int) -> ShardRecord:
        listing = self._listing
        if not listing.has_records or not 0 <= shard < listing.num_shards:
            raise KeyError(shard)
        found = self._read.get(shard)
        if found is None:
            found = self._read[shard] = listing.read_record(shard)
        return found

    def __iter__(self) -> Iterator[int]:
        listing = self._listing
        return iter(range(listing.num_shards if listing.has_records else 0))

    def __len__(self) -> int:
        return self._listing.num_shards if self._listing.has_records else 0


class ManifestListing(ShardListing):
    """A dataset's listing served from its manifest table: the tables a reader asks for
    are views of the columns, records are read when first asked for, and each file is
    compared with its row when a reader first opens it (see :meth:`same_file`)."""

    def __init__(self, directory: PurePath, loaded: Loaded, dev: int) -> None:
        self.loaded = loaded
        self.suffixes = tuple(loaded.header["suffixes"])
        self.has_records = bool(loaded.header["records"])
        self.dev = dev
        descr = loaded.header.get("dtype")
        #: the records' dtype (None for documents, or without records)
        self.dtype = None if descr is None else dtype_from_json(descr)
        super().__init__(
            directory,
            len(loaded.columns["shard"]),
            listed=True,
            changed_hint=(
                f" (if no writer replaced it, the dataset's manifest is out of date: run "
                f"`guideloom-pipes index {os.fspath(directory)}`)"
            ),
        )
        self.sizes = _FileColumn(self, "size")
        self.identities = _FileColumn(self, "ino")
        self.records = _Records(self)
        self._local = os.fspath(directory)  # (the records' paths are joined to it)

    def file_column(self, what: str, suffix: str) -> np.ndarray:
        return self.loaded.columns[f"{what}{self.suffixes.index(suffix)}"]

    def read_record(self, shard: int) -> ShardRecord:
        """Shard ``shard``'s commit record, read now."""
        path = os.fspath(self.directory / (shard_name(shard) + RECORD))
        with open(path, "rb") as file:
            return ShardRecord.from_json(file.read(), path)

    def value(self, name: str, shard: int) -> int:
        """Column ``name`` at ``shard`` (of a table read from disk: its block checked)."""
        columns = self.loaded.columns
        if isinstance(columns, _Columns):
            return columns.value(name, shard)
        return int(columns[name][shard])

    def file_sizes(self) -> FileSizes:
        """Each shard's file sizes, straight from the table."""
        return FileSizes({suffix: self.file_column("size", suffix) for suffix in self.suffixes})

    def same_file(self, shard: int, suffix: str, info: os.stat_result) -> bool:
        """Make the checks an open that listed the directory makes, for a file its reader
        is about to open (same inode as its row): its size against the row (the record's);
        with the shard's first file, the record itself, read and checked again as the open
        would if it is not the file the table describes. Raises the error that open would
        raise; False where the shard was recommitted (a new record)."""
        committed = self.value(f"size{self.suffixes.index(suffix)}", shard)
        if info.st_size != committed:
            name = shard_name(shard) + suffix
            raise size_changed(name, os.fspath(self.directory), info.st_size, committed, shard)
        if suffix != self.suffixes[0] or not self.has_records:
            return True
        path = os.path.join(self._local, shard_name(shard) + RECORD)
        try:
            record = os.stat(path)
        except FileNotFoundError:
            return False
        row = (
            self.value("record_ino", shard),
            self.value("record_size", shard),
            self.value("record_mtime", shard),
        )
        if (record.st_ino, record.st_size, record.st_mtime_ns) == row:
            return True
        if record.st_ino != row[0]:
            return False  # recommitted since the manifest was written
        return self._record_checks(shard, path)

    def _record_checks(self, shard: int, path: str) -> bool:
        """The open's checks of a record edited in place, and whether it still describes
        the files the table does."""
        with open(path, "rb") as file:
            record = ShardRecord.from_json(file.read(), path)  # raises: unreadable
        return self.describes(shard, record)

    def describes(self, shard: int, record: ShardRecord) -> bool:
        """Make the open's checks of ``record``, shard ``shard``'s commit record (raising
        the error an open that listed the dataset would raise); whether it names the files
        of the shard's row (same sizes and CRC-32s)."""
        found = {s: self.value(f"size{i}", shard) for i, s in enumerate(self.suffixes)}
        single = ShardListing(
            self.directory,
            self.num_shards,
            sizes={(shard, s): size for s, size in found.items()},
            records={shard: record},
            listed=self.listed,
        )
        check_shard(single, self.loaded.header["kind"], self.suffixes, self.dtype, shard)
        return self.names_row(shard, record, sizes=False)

    def names_row(self, shard: int, record: ShardRecord, sizes: bool = True) -> bool:
        """Whether ``record`` names the files of shard ``shard``'s row: their CRC-32s, and
        with ``sizes`` their sizes."""
        for i, suffix in enumerate(self.suffixes):
            committed = record.files.get(suffix.lstrip("."))
            if committed is None or committed.crc32 != self.value(f"crc{i}", shard):
                return False
            if sizes and committed.size != self.value(f"size{i}", shard):
                return False
        return True

    def fingerprint(self, sizes: FileSizes) -> dict[str, Any]:
        found = self.loaded.fingerprint
        if found is None:
            found = self.loaded.fingerprint = table_fingerprint(
                self.num_shards, self.suffixes, self.loaded.columns, self.has_records
            )
        # in fingerprint_of's key order (JSON headers sort their keys): states print alike
        return {key: found[key] for key in ("shards", "sizes", "checksums")}


def table_fingerprint(
    num_shards: int, suffixes: tuple[str, ...], columns: Mapping[str, np.ndarray], records: bool
) -> dict[str, Any]:
    """The dataset fingerprint (as :func:`fingerprint_of` gives it from the listing) from
    a table's columns: each record lists exactly the shard's files, so their checksums are
    the table's."""
    size_columns = {s: columns[f"size{i}"] for i, s in enumerate(suffixes)}
    sizes = FileSizes(size_columns)
    if not records:
        return fingerprint_of(num_shards, sizes, {})
    crcs = {s.lstrip("."): columns[f"crc{i}"] for i, s in enumerate(suffixes)}
    return fingerprint_of(num_shards, sizes, _CrcRecords(num_shards, crcs))


@dataclass
class _Crc:
    crc32: int


class _CrcRecords(Mapping[int, Any]):
    """Records reduced to their files' CRC-32s (what the fingerprint reads of them)."""

    def __init__(self, num_shards: int, crcs: dict[str, np.ndarray]) -> None:
        self._count = num_shards
        self._crcs = crcs

    def __getitem__(self, shard: int) -> Any:
        files = {name: _Crc(int(column[shard])) for name, column in self._crcs.items()}
        return _RecordFiles(files)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._count))

    def __len__(self) -> int:
        return self._count


@dataclass
class _RecordFiles:
    files: dict[str, _Crc]
