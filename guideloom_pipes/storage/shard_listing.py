""":class:`ShardListing`, what discovery found in a dataset directory (shards, sizes,
records, file names and identities), and the requests discovery makes through a read
backend: a small file read whole, a file's size and ETag, several of them at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import TypeVar

from guideloom_pipes.storage.io import ResolvedBackend
from guideloom_pipes.storage.names import shard_name
from guideloom_pipes.storage.records import ExpectedFile, ShardRecord


@dataclass
class ShardListing:
    """What discovery found in a dataset directory."""

    directory: PurePath
    num_shards: int
    #: size of each (shard, suffix) file, when the backend could tell without opening it
    sizes: dict[tuple[int, str], int] = field(default_factory=dict)
    records: dict[int, ShardRecord] = field(default_factory=dict)
    listed: bool = True
    #: the file name of each (shard, suffix) whose record names a versioned file (a commit
    #: whose files are not yet at their canonical names); others are the canonical name
    names: dict[tuple[int, str], str] = field(default_factory=dict)
    #: ``(st_dev, st_ino)`` of each (shard, suffix) file as listed (local backends only):
    #: readers open exactly these files, or fail (see ``ShardFiles``)
    identities: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    #: the ETag of each (shard, suffix) object as listed (remote backends that give one):
    #: readers read exactly that version of the object, or fail (see ``FsspecIO``)
    tags: dict[tuple[int, str], str] = field(default_factory=dict)

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
