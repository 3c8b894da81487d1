"""The dataset manifest's file: a table with a row per shard of what an open needs (each
file's size, inode and modification time, each data file's CRC-32, the record's count), so
that a dataset of a million shards opens by reading one file instead of listing the
directory and reading a million commit records.

The files live in ``<dataset>/.guideloom-manifest/`` (GuideLoom and earlier versions of this
package list only shard file names, and ignore it):

``manifest.bin``
    the whole dataset (written by ``guideloom-pipes index``, ``write_parallel`` and a
    writer's compaction);
``fragment-<ns>-<id>.bin``
    what one writer committed (its shards only, or the whole dataset for ``"overwrite"`` and
    ``"create"``), merged at open;
``writing-<id>``
    held (``flock``) by a writer from before its first commit until its fragment is in
    place: while one exists, the manifest may lack shards, and readers list the directory.

A table file: 8 magic bytes, the header's length (8 bytes, little-endian), the header (JSON),
zero padding to 8 bytes, then each column (``int64``, little-endian) in the order the header
names them. The header holds the CRC-32 of each block of 65,536 rows of each column, checked
when the block is first used: an open of a million shards reads its size columns, and each
shard's first read a block of the others.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guideloom_pipes.storage.errors import CorruptShardError

#: the manifest's folder in a dataset directory
MANIFEST_DIR = ".guideloom-manifest"
#: the whole-dataset table
MAIN = "manifest.bin"
FRAGMENT_PREFIX = "fragment-"
MARKER_PREFIX = "writing-"
#: the lock a writer holds while it merges fragments into ``MAIN``
COMPACT_LOCK = "compact.lock"
SUFFIX = ".bin"
_MAGIC = b"GLPMAN\x00\x01"
VERSION = 1

#: rows per checksummed block of a column (512 KiB)
BLOCK_ROWS = 1 << 16
#: columns every table has (``-1``: unknown or absent, e.g. no record)
BASE_COLUMNS = ("shard", "record_size", "record_ino", "record_mtime", "count", "payloads")
#: columns per file kind, named ``<what><i>`` for the storage's ``i``-th suffix
FILE_COLUMNS = ("size", "ino", "mtime", "crc")


def column_names(suffixes: Sequence[str]) -> tuple[str, ...]:
    """The columns of a table of a storage whose shards are ``suffixes`` files."""
    per_file = tuple(f"{what}{i}" for i in range(len(suffixes)) for what in FILE_COLUMNS)
    return BASE_COLUMNS + per_file


def new_name(prefix: str, suffix: str = "") -> str:
    """A file name no other writer picks: ``prefix``, the time, the process, a random part
    (names sort by the time they were made)."""
    return f"{prefix}{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}{suffix}"


@dataclass
class ManifestTable:
    """A manifest file's header and columns (shard ``rows`` of ``int64``).

    Header keys: ``kind``, ``suffixes``, ``dtype`` (the records' dtype, JSON as in records;
    None for documents), ``records`` (whether the shards have commit records), ``complete``
    (the table is the whole dataset), ``before``/``after`` (the directory's ``st_mtime_ns``
    before the writer's first commit and after its last), ``dev`` (the directory's
    ``st_dev``), ``fingerprint`` (the dataset's, when the table is the whole dataset);
    ``etags`` (a table of a dataset at a URL that lists: each file's ETag, per suffix).
    """

    header: dict[str, Any]
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    #: where the columns were read from (their CRC-32 checked on first use), else None
    _source: str | None = None
    _checked: set[str] = field(default_factory=set)
    _checked_blocks: set[tuple[str, int]] = field(default_factory=set)

    @property
    def rows(self) -> int:
        return int(self.header["rows"])

    @property
    def suffixes(self) -> tuple[str, ...]:
        return tuple(self.header["suffixes"])

    def column(self, name: str) -> np.ndarray:
        """Column ``name``, each block checked against its CRC-32 the first time."""
        found = self.columns[name]
        if name not in self._checked:
            for block in range(-(-len(found) // BLOCK_ROWS)):
                self._check(name, block)
            self._checked.add(name)
        return found

    def value(self, name: str, row: int) -> int:
        """Column ``name`` at ``row``, its block checked against its CRC-32 the first time
        (what a shard's first read needs: a few pages of each column, not all of them)."""
        found = self.columns[name]
        if name not in self._checked:
            self._check(name, row // BLOCK_ROWS)
        return int(found[row])

    def _check(self, name: str, block: int) -> None:
        key = (name, block)
        if key in self._checked_blocks:
            return
        crcs = self.header.get("crc32", {}).get(name)
        found = self.columns[name][block * BLOCK_ROWS : (block + 1) * BLOCK_ROWS]
        if crcs is not None and zlib.crc32(found.data) != crcs[block]:
            raise CorruptShardError(
                f"the manifest {self._source} is damaged (column {name!r} fails its "
                f"checksum); delete it and run `guideloom-pipes index` on the dataset"
            )
        self._checked_blocks.add(key)

    def file_column(self, what: str, suffix: str) -> np.ndarray:
        """Column ``what`` (size, ino, mtime, crc) of the ``suffix`` files."""
        return self.column(f"{what}{self.suffixes.index(suffix)}")

    def _parts(self) -> list[Any]:
        """The file's parts: its head (magic, length, header), then each column's buffer."""
        names = column_names(self.suffixes)
        columns = [np.ascontiguousarray(self.columns[n], dtype="<i8") for n in names]
        if any(len(c) != self.rows for c in columns):
            raise ValueError("manifest columns of different lengths")
        header = dict(self.header, columns=list(names), version=VERSION)
        header["crc32"] = {
            n: [
                zlib.crc32(c[start : start + BLOCK_ROWS].data)
                for start in range(0, len(c), BLOCK_ROWS)
            ]
            for n, c in zip(names, columns)
        }
        raw = json.dumps(header, sort_keys=True).encode()
        raw += b" " * (-(len(raw) + 16) % 8)
        return [_MAGIC + len(raw).to_bytes(8, "little") + raw, *(c.data for c in columns)]

    def to_bytes(self) -> bytes:
        """The table's file, as bytes (what an index uploads to an object store)."""
        return b"".join(self._parts())

    def write(self, path: str) -> None:
        """Write the table to ``path`` atomically (a temporary, flushed, then renamed)."""
        parts = self._parts()
        temporary = f"{path}.{secrets.token_hex(4)}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            with os.fdopen(fd, "wb") as file:
                for part in parts:
                    file.write(part)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    @classmethod
    def read(cls, path: str) -> ManifestTable:
        """The table in ``path``, its columns mapped (read when used)."""
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < 16:
                raise _damaged(path, "too short")
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        return cls.parse(mapped, path)

    @classmethod
    def parse(cls, data: Any, source: str) -> ManifestTable:
        """The table whose file's bytes are ``data`` (a buffer: a mapped file, or the bytes
        of a manifest read over the network), read from ``source``."""
        size = len(data)
        if size < 16:
            raise _damaged(source, "too short")
        if bytes(data[:8]) != _MAGIC:
            raise _damaged(source, "not a manifest of this version")
        length = int.from_bytes(data[8:16], "little")
        try:
            header = json.loads(bytes(data[16 : 16 + length]))
            rows, names = int(header["rows"]), list(header["columns"])
        except (ValueError, KeyError, TypeError):
            raise _damaged(source, "its header is not a manifest's") from None
        start = 16 + length
        if size != start + 8 * rows * len(names):
            wanted = start + 8 * rows * len(names)
            raise _damaged(source, f"{size} bytes, not the {wanted} its header describes")
        values = np.frombuffer(data, dtype="<i8", offset=start, count=rows * len(names))
        columns = {name: values[i * rows : (i + 1) * rows] for i, name in enumerate(names)}
        return cls(header, columns, source)


def _damaged(path: str, why: str) -> CorruptShardError:
    return CorruptShardError(
        f"the manifest {path} is damaged ({why}); delete it and run `guideloom-pipes index` "
        f"on the dataset to write it again"
    )


def merge(tables: Iterable[ManifestTable]) -> dict[str, np.ndarray]:
    """The columns of ``tables`` applied in order (a later table's row of a shard replaces
    an earlier one's), sorted by shard id."""
    tables = list(tables)
    names = column_names(tables[0].suffixes)
    stacked = {n: np.concatenate([t.column(n) for t in tables]) for n in names}
    shards = stacked["shard"]
    # the last row of each shard id: np.unique's first occurrence in the reversed order
    _, first_reversed = np.unique(shards[::-1], return_index=True)
    keep = len(shards) - 1 - first_reversed
    return {n: column[keep] for n, column in stacked.items()}
