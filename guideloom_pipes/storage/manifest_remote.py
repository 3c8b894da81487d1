"""Opening a dataset at a URL through its manifest: one request for its whole table
(``.guideloom-manifest/manifest.bin``) instead of a listing and a request per shard, and
:class:`RemoteManifestListing`, the listing a reader serves from that table.

What a URL lets an open check cheaply, and what it does instead:

- only the whole table is read. Fragments and writers' markers cannot be listed over HTTP,
  and a listing of them would cost the request the manifest saves; they need no look:
  every writer of this package takes the whole table out of the way before its first commit
  (a local writer renames it to a fragment, a writer to a URL deletes it), and only a merge
  or an index with no writer writing puts it back. A dataset whose table is missing (only
  fragments, or none at all) opens by listing, silently, as one without a manifest;
- a table that is damaged, unchecked or not of the dataset's storage class is not used (a
  :class:`StaleManifestWarning` says so where it is damaged or unchecked);
- each shard is checked when a reader first touches it, before any of its bytes are
  delivered: its commit record is read (one request) and must name the files of its row
  (else :class:`DatasetChangedError`: the shard was recommitted since the table was
  written); each file's size is compared with its row (one request, a ``HEAD``, where the
  table has no ETag; a truncated file is a :class:`CorruptShardError`), and its reads are
  pinned to its ETag (``If-Match``), so an object replaced later is refused too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import PurePath
from typing import Any

import numpy as np

from guideloom_pipes.storage.errors import (
    CorruptShardError,
    DatasetChangedError,
    ShardLockedError,
    StaleManifestWarning,
)
from guideloom_pipes.storage.io import ResolvedBackend
from guideloom_pipes.storage.listing import discover
from guideloom_pipes.storage.manifest import MAIN, MANIFEST_DIR, ManifestTable, column_names
from guideloom_pipes.storage.manifest_open import Loaded, ManifestListing, combine
from guideloom_pipes.storage.manifest_write import NotTabulated, _dtype_of, _header, _whole
from guideloom_pipes.storage.names import RECORD, SHARD_NAME, shard_name
from guideloom_pipes.storage.records import ExpectedFile, ShardRecord
from guideloom_pipes.storage.remote import FsspecIO, ListingFsspecIO
from guideloom_pipes.storage.shard_listing import ShardListing
from guideloom_pipes.storage.verify import check_listing

#: the header key of a table's ETags: ``{suffix: [ETag or None per shard]}``
ETAGS = "etags"


def manifest_url(directory: PurePath) -> str:
    """The URL of the whole table of the dataset at ``directory``."""
    return str(directory / MANIFEST_DIR / MAIN)


def open_remote_listing(
    backend: ResolvedBackend, directory: PurePath, kind: str, suffixes: tuple[str, ...]
) -> RemoteManifestListing | None:
    """The listing of the dataset at the URL ``directory`` from its whole table (one
    request), when it has a usable one; else None (the caller lists the dataset), with a
    warning where the table is damaged or unchecked."""
    io = backend.backend
    if not isinstance(io, FsspecIO):
        return None  # a custom backend: its own discovery
    url = manifest_url(directory)
    try:
        raw = io.read_object("reading the manifest", url)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        return None  # no whole table (or a server that hides dot-folders): list
    try:
        table = ManifestTable.parse(raw, url)
    except CorruptShardError as error:
        _warn_unused(url, str(error))
        return None
    header = table.header
    if header.get("kind") != kind or tuple(header.get("suffixes", ())) != suffixes:
        return None  # opened as another storage class: the listing says which
    if not header.get("complete") or not header.get("verified"):
        _warn_unused(url, "its writer did not check it against the dataset")
        return None
    loaded = combine([table])
    if loaded is None:
        return None  # no shards: the listing says so
    if not isinstance(loaded, Loaded):
        _warn_unused(url, loaded.reason)
        return None
    return RemoteManifestListing(directory, loaded, io, header.get(ETAGS) or {})


def _warn_unused(url: str, reason: str) -> None:
    warnings.warn(
        f"the manifest {url} was not used: {reason}. The dataset was opened by listing it (a "
        f"request per shard); index it again (guideloom-pipes index) to open it with one "
        f"request",
        StaleManifestWarning,
        stacklevel=6,
    )


class _Tags(Mapping[tuple[int, str], str]):
    """The table's ETag of each (shard, suffix) file that has one."""

    def __init__(self, etags: Mapping[str, list[str | None]], num_shards: int) -> None:
        self._etags = {suffix: tags for suffix, tags in etags.items() if len(tags) == num_shards}

    def __getitem__(self, key: tuple[int, str]) -> str:
        shard, suffix = key
        tags = self._etags.get(suffix)
        found = tags[shard] if tags is not None and 0 <= shard < len(tags) else None
        if not found:
            raise KeyError(key)
        return found

    def __iter__(self) -> Iterator[tuple[int, str]]:
        for suffix, tags in self._etags.items():
            yield from ((shard, suffix) for shard, tag in enumerate(tags) if tag)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class RemoteManifestListing(ManifestListing):
    """A URL dataset's listing served from its whole table: sizes, counts and the
    fingerprint from the columns; each shard's commit record read, and checked against
    its row, when a reader first touches the shard (see :meth:`expected`)."""

    def __init__(
        self,
        directory: PurePath,
        loaded: Loaded,
        io: FsspecIO,
        etags: Mapping[str, list[str | None]],
    ) -> None:
        super().__init__(directory, loaded, dev=-1)
        self.io = io
        self.listed = False
        self.identities = {}  # no inodes at a URL: readers pin ETags instead
        self.tags = _Tags(etags, self.num_shards)
        self.changed_hint = (
            f". If no writer of this package changed it, the dataset's manifest "
            f"({manifest_url(directory)}) is out of date: index the dataset again "
            f"(guideloom-pipes index) or delete the manifest, so that opens see the change"
        )
        self._checked: set[int] = set()

    def read_record(self, shard: int) -> ShardRecord:
        """Shard ``shard``'s commit record, read now (one request)."""
        url = str(self.directory / (shard_name(shard) + RECORD))
        return ShardRecord.from_json(self.io.read_object("reading the record", url), url)

    def expected(self, shard: int, suffix: str) -> ExpectedFile:
        """What the table says of ``shard``'s ``suffix`` file, once the shard's commit
        record (read at the shard's first touch) is found to name the files of its row; its
        reader then checks the file's size or pins its ETag."""
        if self.has_records and shard not in self._checked:
            self._check_record(shard)
            self._checked.add(shard)
        return replace(super().expected(shard, suffix), changed_hint=self.changed_hint)

    def _check_record(self, shard: int) -> None:
        """Refuse shard ``shard`` if its record no longer names the files of its row (a
        :class:`DatasetChangedError`), or fails the checks of an open that lists."""
        name = shard_name(shard) + RECORD
        where = os.fspath(self.directory)
        try:
            record = self.records[shard]
        except FileNotFoundError:
            raise DatasetChangedError(
                f"shard {shard_name(shard)} of {where} has no commit record any more ({name} "
                f"is not found): it was removed after the dataset was indexed"
                f"{self.changed_hint}"
            ) from None
        if record.state == "deleted" or not self.names_row(shard, record):
            raise DatasetChangedError(
                f"shard {shard_name(shard)} of {where} was committed again or removed after "
                f"the dataset was indexed ({name} names other files than the manifest's "
                f"row): this reader reads only the version it opened{self.changed_hint}"
            )
        self.describes(shard, record)  # state, kind, shard id and dtype, as an open checks


def index_remote(
    backend: ResolvedBackend,
    directory: PurePath,
    kind: str,
    suffixes: tuple[str, ...],
    dtype: np.dtype[Any] | None,
    dtype_hint: Callable[[np.dtype[Any]], str],
) -> int:
    """Write the whole table of the dataset at the URL ``directory`` (an object store,
    which lists), with each shard file's ETag, from a listing checked as an open checks
    it; the number of shards. Opens then read every file pinned to its ETag without asking
    for it. The store is listed again once the table is written: a change meanwhile (a
    writer committed) deletes the table and raises :class:`ShardLockedError`."""
    io = backend.backend
    if not isinstance(io, ListingFsspecIO):
        raise ValueError(
            f"cannot index {directory}: the files of an HTTP(S) server cannot be listed nor "
            f"written; index the directory it serves (guideloom-pipes index DIR): the server "
            f"then serves its {MANIFEST_DIR}/{MAIN}"
        )
    before = _shard_objects(io, directory)
    listing = discover(backend, directory, suffixes)
    check_listing(listing, backend, kind, suffixes, dtype, dtype_hint)
    if listing.names:
        shard = min(listing.names)[0]
        raise ShardLockedError(
            errno.EWOULDBLOCK,
            f"a writer is publishing shard {shard_name(shard)} of {directory} (its record names "
            f"versioned files); index it once the writer has closed",
        )
    try:
        data = _remote_table(listing, kind, suffixes).to_bytes()
    except NotTabulated as error:
        raise ValueError(f"cannot index {directory}: {error}") from None
    url = manifest_url(directory)
    io.request("writing the manifest", url, "pipe_file", url, data)
    if _shard_objects(io, directory) != before:
        with contextlib.suppress(FileNotFoundError):
            io.request("deleting the manifest", url, "rm_file", url)
        raise ShardLockedError(
            errno.EWOULDBLOCK,
            f"{directory} changed while it was indexed (a writer committed); index it again "
            f"once no writer is writing it",
        )
    return listing.num_shards


def _shard_objects(io: ListingFsspecIO, directory: PurePath) -> dict[str, tuple[int, Any]]:
    """The size and ETag of each shard object (files and records) under ``directory``."""
    details = io.list_dir_details(directory)
    return {name: found for name, found in details.items() if SHARD_NAME.match(name)}


def _remote_table(listing: ShardListing, kind: str, suffixes: tuple[str, ...]) -> ManifestTable:
    """The whole table of a listed dataset at a URL, its files' ETags in the header (no
    inodes nor modification times: -1)."""
    count = listing.num_shards
    columns = {name: np.full(count, -1, dtype=np.int64) for name in column_names(suffixes)}
    columns["shard"][:] = np.arange(count)
    etags: dict[str, list[str | None]] = {suffix: [None] * count for suffix in suffixes}
    for shard in range(count):
        record = listing.records.get(shard)
        if record is not None:
            columns["count"][shard] = record.count
            columns["payloads"][shard] = -1 if record.payloads is None else record.payloads
        for i, suffix in enumerate(suffixes):
            columns[f"size{i}"][shard] = listing.sizes[(shard, suffix)]
            committed = record.files.get(suffix.lstrip(".")) if record is not None else None
            if committed is not None:
                columns[f"crc{i}"][shard] = committed.crc32
            etags[suffix][shard] = listing.tags.get((shard, suffix))
    dtype = _dtype_of(listing.records.values())
    header = _header(kind, suffixes, dtype, bool(listing.records), True, 0, 0, -1, count)
    header["verified"] = True  # listed and checked just now
    header[ETAGS] = etags
    return _whole(ManifestTable(header, columns))


__all__ = [
    "ETAGS",
    "RemoteManifestListing",
    "index_remote",
    "manifest_url",
    "open_remote_listing",
]
