""":class:`ShardListing`, what discovery found in a dataset directory (shards, sizes,
records, file names and identities), and the requests discovery makes through a read
backend: a small file read whole, a file's size and ETag, several of them at once.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, TypeVar

import numpy as np

from guideloom_pipes.storage.io import ResolvedBackend
from guideloom_pipes.storage.names import shard_name
from guideloom_pipes.storage.records import ExpectedFile, ShardRecord


@dataclass
class ShardListing:
    """What discovery found in a dataset directory."""

    directory: PurePath
    num_shards: int
    #: size of each (shard, suffix) file, when the backend could tell without opening it
    sizes: Mapping[tuple[int, str], int] = field(default_factory=dict)
    records: Mapping[int, ShardRecord] = field(default_factory=dict)
    listed: bool = True
    #: the file name of each (shard, suffix) whose record names a versioned file (a commit
    #: whose files are not yet at their canonical names); others are the canonical name
    names: Mapping[tuple[int, str], str] = field(default_factory=dict)
    #: ``(st_dev, st_ino)`` of each (shard, suffix) file as listed (local backends only):
    #: readers open exactly these files, or fail (see ``ShardFiles``)
    identities: Mapping[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    #: the ETag of each (shard, suffix) object as listed (remote backends that give one):
    #: readers read exactly that version of the object, or fail (see ``FsspecIO``)
    tags: Mapping[tuple[int, str], str] = field(default_factory=dict)
    #: what to add to the error of a shard file found changed when a reader opens it
    changed_hint: str = ""

    def same_file(self, shard: int, suffix: str, info: os.stat_result) -> bool:
        """Whether the file a reader is about to open for ``shard``'s ``suffix`` (its
        ``stat``) is still the one this listing describes, beyond its identity and size
        (which the reader checks): a listing read from a manifest also compares its
        modification time, and the shard's record. True here: a directory listing has no
        more to compare."""
        return True

    def fingerprint(self, sizes: FileSizes) -> dict[str, Any]:
        """The dataset's fingerprint (see ``ReaderBase.fingerprint``) from ``sizes`` and
        the records."""
        return fingerprint_of(self.num_shards, sizes, self.records)

    def file_name(self, shard: int, suffix: str) -> str:
        """The name of the file a reader reads for ``shard``'s ``suffix``."""
        return self.names.get((shard, suffix)) or shard_name(shard) + suffix

    def expected(self, shard: int, suffix: str) -> ExpectedFile:
        """What the open found of ``shard``'s ``suffix`` file: its size, its record's
        CRC-32 and block checksums, and its ETag (each None where unknown)."""
        record = self.records.get(shard)
        committed = record.files.get(suffix.lstrip(".")) if record is not None else None
        return ExpectedFile(
            self.sizes.get((shard, suffix)),
            committed.crc32 if committed is not None else None,
            self.tags.get((shard, suffix)),
            committed.blocks if committed is not None else None,
        )


class FileSizes:
    """The size of each shard's files, a column per suffix (-1 where unknown): what a reader
    sets up from, compact for a million shards. ``sizes[shard]`` is the shard's
    ``{suffix: size}`` (sizes known only)."""

    def __init__(self, columns: Mapping[str, np.ndarray]) -> None:
        self.columns = {suffix: np.asarray(c, dtype=np.int64) for suffix, c in columns.items()}
        lengths = {len(c) for c in self.columns.values()}
        self._length = lengths.pop() if lengths else 0

    @classmethod
    def from_dicts(cls, sizes: Sequence[Mapping[str, int]], suffixes: Iterable[str]) -> FileSizes:
        """The table of per-shard ``{suffix: size}`` dicts (a missing size: -1)."""
        return cls({s: np.array([d.get(s, -1) for d in sizes], dtype=np.int64) for s in suffixes})

    def column(self, suffix: str) -> np.ndarray:
        """Each shard's ``suffix`` file size (-1: unknown)."""
        return self.columns[suffix]

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, shard: int) -> dict[str, int]:
        found = {suffix: int(column[shard]) for suffix, column in self.columns.items()}
        return {suffix: size for suffix, size in found.items() if size >= 0}

    def __iter__(self) -> Iterator[dict[str, int]]:
        for shard in range(self._length):
            yield self[shard]


def fingerprint_of(
    num_shards: int, sizes: Iterable[Mapping[str, int]], records: Mapping[int, ShardRecord]
) -> dict[str, Any]:
    """What identifies a version of a dataset, compactly: the number of shards, a digest
    of every shard file's size, and a digest of the commit records' checksums (None for a
    dataset without records)."""
    size_digest = hashlib.blake2b(digest_size=8)
    for shard_sizes in sizes:
        size_digest.update(repr(sorted(shard_sizes.items())).encode())
    checksums: str | None = None
    if records:
        digest = hashlib.blake2b(digest_size=8)
        for shard in range(num_shards):
            record = records.get(shard)
            files = {} if record is None else record.files
            digest.update(repr(sorted((k, f.crc32) for k, f in files.items())).encode())
        checksums = digest.hexdigest()
    return {"shards": num_shards, "sizes": size_digest.hexdigest(), "checksums": checksums}


#: an entry of a directory listing: size (-1: unknown), st_dev, st_ino (0: unknown)
_Entry = tuple[int, int, int]


def read_whole(backend: ResolvedBackend, path: PurePath) -> bytes:
    reader = backend.reader(path)
    reader.open()
    try:
        return bytes(reader.read(0, reader.filesize()))
    finally:
        reader.close()


def backend_size(backend: ResolvedBackend, path: PurePath) -> int | None:
    found = _backend_info(backend, path)
    return None if found is None else found[0]


def backend_info(backend: ResolvedBackend, path: PurePath) -> tuple[int, str | None] | None:
    """The size of ``path`` and its ETag (None where the backend gives none: local ones),
    or None where it does not exist."""
    return _backend_info(backend, path)


def _backend_info(backend: ResolvedBackend, path: PurePath) -> tuple[int, str | None] | None:
    """The size of ``path`` and its ETag (where the reader has an ``etag``: remote
    backends), or None where it does not exist."""
    reader = backend.reader(path)
    try:
        reader.open()
    except (FileNotFoundError, IsADirectoryError):
        return None
    try:
        return int(reader.filesize()), getattr(reader, "etag", None)
    finally:
        reader.close()


_T = TypeVar("_T")
_R = TypeVar("_R")


def _concurrently(
    backend: ResolvedBackend, function: Callable[[_T], _R], items: Iterable[_T]
) -> list[_R]:
    """``[function(item) for item in items]``, on up to ``open_concurrency`` threads where
    the backend has that attribute (``FsspecIO``: the requests of an open overlap their
    latency instead of adding it up); in order, the first error raised."""
    workers = int(getattr(backend.backend, "open_concurrency", 1) or 1)
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="storage-open") as pool:
        return list(pool.map(function, items))
