"""Reading Parquet tables a row group at a time, for ``ParquetStorage`` (``parquet.py``):
row groups decoded through a cache bounded in bytes, a read backend that serves each file as
the raw bytes of its tokens (so the stream reader reads it as it reads mapped files), and
the reader of a text column's documents. Opening a file (local or at a URL) and checking a
column's type are in ``parquet_files.py``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.storage.backend_base import BackendBase
from guideloom_pipes.storage.corpora.base import DocumentReaderBase
from guideloom_pipes.storage.corpora.location import CorpusLocation
from guideloom_pipes.storage.corpora.parquet_files import open_table, pyarrow_modules
from guideloom_pipes.storage.errors import CorruptShardError, DatasetChangedError
from guideloom_pipes.types import IOSyncReaderAbstract

if TYPE_CHECKING:
    from guideloom_pipes.storage.corpora.parquet import ParquetStorage

__all__ = [
    "GroupFile",
    "ParquetIO",
    "RowGroupCache",
    "TextReader",
    "TokenFile",
]


class RowGroupCache:
    """Decoded row groups, least recently used dropped first once they pass ``limit``
    bytes (the newest is always kept). Thread-safe; ``decoded`` counts decodes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.decoded = 0
        self._items: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self._sizes: dict[tuple[str, int], int] = {}
        self.nbytes = 0
        self.lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> Any:
        with self.lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: tuple[str, int], value: Any, size: int) -> Any:
        """Keep ``value`` (of ``size`` bytes) for ``key``; the value kept (an earlier one
        for the key, if another thread put it first)."""
        with self.lock:
            self.decoded += 1
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            self._items[key] = value
            self._sizes[key] = size
            self.nbytes += size
            while self.nbytes > self.limit and len(self._items) > 1:
                old, _ = self._items.popitem(last=False)
                self.nbytes -= self._sizes.pop(old)
            return value

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self.lock:
            self._items.clear()
            self._sizes.clear()
            self.nbytes = 0


class GroupFile:
    """One Parquet file's row groups of one column, decoded on demand through a cache
    (opened lazily). A read takes a ``ParquetFile`` no other read is using (pyarrow's
    readers are not to be shared), opening another only where every open one is in use, so
    threads decode row groups in parallel: pyarrow releases the GIL while it decodes."""

    def __init__(
        self,
        location: CorpusLocation,
        name: str,
        column: str,
        rows: np.ndarray,
        cache: RowGroupCache,
        version: tuple[int, str] | None = None,
    ) -> None:
        self.location = location
        self.name = name
        self.path = os.fspath(location.path(name))
        self.column = column
        #: each row group's rows, as the sidecar (or the scan) found them
        self.rows = rows
        self.cache = cache
        #: the file's size and version (modification time, or ETag at a URL) when the rows
        #: were found (None: not checked)
        self.version = version
        self._lock = threading.Lock()
        #: every open ParquetFile, and those no read is using
        self._files: list[Any] = []
        self._idle: list[Any] = []
        self._open = False

    def _opened(self) -> Any:
        """The file opened and checked: its row groups those the scan found."""
        opened = open_table(self.location, self.name, self.version)
        metadata = opened.metadata
        rows = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        if rows != self.rows.tolist():
            raise DatasetChangedError(
                f"{self.path} changed since its row groups were scanned (now {len(rows)} "
                f"row groups of {sum(rows)} rows, then {len(self.rows)} of "
                f"{int(self.rows.sum())}): open the storage again, which scans it again"
            )
        return opened

    def open(self) -> None:
        """Open (and check) the file; idempotent."""
        with self._lock:
            if self._open:
                return
            opened = self._opened()
            self._files, self._idle, self._open = [opened], [opened], True

    def close(self) -> None:
        with self._lock:
            files, self._files, self._idle, self._open = self._files, [], [], False
        for opened in files:
            _close(opened)

    def _take(self) -> Any:
        """An open ParquetFile no other read is using (opened if there is none)."""
        with self._lock:
            if not self._open:
                raise RuntimeError(f"reader of {self.path} is not open")
            if self._idle:
                return self._idle.pop()
        opened = self._opened()
        with self._lock:
            if not self._open:  # (closed meanwhile)
                _close(opened)
                raise RuntimeError(f"reader of {self.path} is not open")
            self._files.append(opened)
        return opened

    def _give(self, opened: Any) -> None:
        with self._lock:
            if any(opened is mine for mine in self._files):
                self._idle.append(opened)
                return
        _close(opened)  # (the reader closed while it was read)

    def group(self, group: int, decode: Any) -> Any:
        """Row group ``group``'s column as ``decode(chunked_array)`` made it (cached; two
        reads that miss it at once may both decode it, the first one kept)."""
        key = (self.path, group)
        found = self.cache.get(key)
        if found is not None:
            return found
        opened = self._take()
        try:
            table = opened.read_row_group(group, columns=[self.column], use_threads=False)
        except (OSError, ValueError) as error:
            raise CorruptShardError(
                f"row group {group} of {self.path} cannot be decoded ({error}): the file "
                f"is damaged; write it again"
            ) from None
        finally:
            self._give(opened)
        found, size = decode(table.column(0), group)
        return self.cache.put(key, found, size)


def _close(opened: Any) -> None:
    close = getattr(opened, "close", None)
    if callable(close):
        close()


class ParquetIO(BackendBase):
    """The read backend of a :class:`ParquetStorage` reader: each Parquet file served as
    the raw bytes of its tokens (little-endian ``stored``), decoded a row group at a time
    through one cache shared by the reader's files."""

    holds_fd = True

    def __init__(
        self,
        storage: ParquetStorage,
        layouts: dict[str, tuple[str, np.ndarray, np.ndarray, tuple[int, str]]],
    ) -> None:
        self.storage = storage
        #: per file path: each row group's rows, each row group's first token (and the
        #: end), and the file's (size, mtime in ns) when they were found
        self.layouts = layouts
        self.cache = RowGroupCache(storage.cache_bytes)

    @staticmethod
    def is_supported() -> bool:
        """Whether pyarrow is here."""
        try:
            pyarrow_modules()
        except ImportError:
            return False
        return True

    def _make(self, path: PurePath) -> TokenFile:
        name, rows, starts, version = self.layouts[os.fspath(path)]
        location = self.storage.location
        groups = GroupFile(location, name, self.storage.column, rows, self.cache, version)
        return TokenFile(groups, starts, self.storage.stored)

    def __repr__(self) -> str:
        return f"ParquetIO({self.storage!r})"


class TokenFile(IOSyncReaderAbstract):
    """A Parquet file's tokens as a byte-range reader (what the stream reader reads)."""

    def __init__(self, groups: GroupFile, starts: np.ndarray, stored: np.dtype[Any]) -> None:
        self.groups = groups
        self.starts = starts
        self.bounds: list[int] = starts.tolist()
        self.stored = stored

    def open(self) -> None:
        self.groups.open()

    def close(self) -> None:
        self.groups.close()

    def filesize(self) -> int:
        return self.bounds[-1] * self.stored.itemsize

    def read(self, offset: int, size: int) -> bytearray:
        out = bytearray(size)
        with memoryview(out) as view:
            got = self.readinto(offset, view)
        del out[got:]
        return out

    def readinto(self, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` with the tokens' bytes from ``offset``; the bytes filled."""
        size = self.stored.itemsize
        first = offset // size
        count = max(0, min(len(buffer) // size, self.bounds[-1] - first))
        out = np.frombuffer(buffer, dtype=self.stored, count=count)
        position, filled, bounds = first, 0, self.bounds
        while filled < count:
            group = int(np.searchsorted(self.starts, position, side="right")) - 1
            values = self.groups.group(group, self._decode)
            local = position - bounds[group]
            take = min(count - filled, len(values) - local)
            out[filled : filled + take] = values[local : local + take]
            filled += take
            position += take
        return count * size

    def _decode(self, chunked: Any, group: int) -> tuple[np.ndarray, int]:
        """A row group's column as one read-only array of ``stored`` tokens, checked
        against the scan (rows and tokens)."""
        path, column = self.groups.path, self.groups.column
        if chunked.null_count:
            raise DatasetChangedError(
                f"{path} changed since it was scanned: row group {group} of column "
                f"{column!r} now has a null row; open the storage again"
            )
        pieces = [chunk.flatten() for chunk in chunked.chunks]
        if any(piece.null_count for piece in pieces):
            raise DatasetChangedError(
                f"{path} changed since it was scanned: row group {group} of column "
                f"{column!r} now holds a null token; open the storage again"
            )
        arrays = [np.asarray(piece.to_numpy(zero_copy_only=False)) for piece in pieces]
        values = np.concatenate(arrays) if arrays else np.empty(0, self.stored)
        values = values.astype(self.stored, copy=False)
        expected = self.bounds[group + 1] - self.bounds[group]
        if len(values) != expected:
            raise DatasetChangedError(
                f"{path} changed since it was scanned: row group {group} holds {len(values)} "
                f"tokens, the scan found {expected}; open the storage again"
            )
        values.flags.writeable = False
        return values, int(values.nbytes)


class TextReader(DocumentReaderBase):
    """The text documents of a :class:`ParquetStorage` over a string column: document
    ``i`` is ``{"text": str}``, row ``i`` (the reader a ``DocumentDataset`` reads)."""

    def __init__(self, storage: ParquetStorage) -> None:
        self.storage = storage
        self._files: list[GroupFile] = []
        self._starts: np.ndarray | None = None

    def open(self) -> None:
        """Read the files' footers (their row groups' rows); idempotent. At a URL the
        files are read pinned to the ETags found now."""
        if self._starts is not None:
            return
        cache = RowGroupCache(self.storage.cache_bytes)
        files, counts, location = [], [], self.storage.location
        self._sizes: list[int] = []
        for name in location.names:
            version = location.info(name)
            metadata = open_table(location, name, version).metadata
            rows = np.array(
                [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)],
                dtype=np.int64,
            )
            files.append(GroupFile(location, name, self.storage.column, rows, cache, version))
            counts.extend(rows.tolist())
            self._sizes.append(version[0])
        starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        self._files = files
        #: the first row of each row group of every file, and the end
        self._starts = starts
        self._groups = np.cumsum([0] + [len(f.rows) for f in files])

    def close(self) -> None:
        for opened in self._files:
            opened.close()
        self._files = []
        self._starts = None

    @property
    def total_length(self) -> int:
        """Documents (rows) in the tables."""
        return int(self._checked()[-1])

    @property
    def num_shards(self) -> int:
        self._checked()
        return len(self._files)

    def length(self, shard: int) -> int:
        """Rows in file ``shard``."""
        self._checked()
        return int(self._files[check_int("shard", shard)].rows.sum())

    def document_lengths(self) -> np.ndarray:
        raise self.storage._needs_tokenizer("lengths to pack")

    def fingerprint(self) -> dict[str, Any]:
        self._checked()
        digest = hashlib.blake2b(digest_size=8)
        for path, size in zip(self.storage.files, self._sizes):
            digest.update(f"{path}\0{size}\0".encode())
        return {"shards": len(self._files), "sizes": digest.hexdigest(), "checksums": None}

    def read(self, global_index: int) -> dict[str, str]:
        """Document ``global_index`` as ``{"text": str}``."""
        starts = self._checked()
        index = check_int("global_index", global_index)
        if not 0 <= index < int(starts[-1]):
            raise IndexError(
                f"document {index} out of range: the tables have {int(starts[-1])} rows"
            )
        group = int(np.searchsorted(starts, index, side="right")) - 1
        shard = int(np.searchsorted(self._groups, group, side="right")) - 1
        opened = self._files[shard]
        opened.open()
        local = group - int(self._groups[shard])
        values = opened.group(local, self._decode)
        text = values[index - int(starts[group])]
        if text is None:
            row = index - int(starts[int(self._groups[shard])])
            raise ValueError(
                f"row {row} of {opened.path} is null in column {self.storage.column!r}: a "
                f"text document is a string; write an empty string, or drop the row"
            )
        return {"text": text}

    @staticmethod
    def _decode(chunked: Any, group: int) -> tuple[list[str | None], int]:
        return chunked.to_pylist(), int(chunked.nbytes)

    def read_many(self, global_indexes: Iterable[int] | np.ndarray) -> list[dict[str, str]]:
        """The documents at ``global_indexes``, in that order."""
        ids: Sequence[int] | np.ndarray = (
            global_indexes if isinstance(global_indexes, np.ndarray) else list(global_indexes)
        )
        return [self.read(int(index)) for index in np.asarray(ids).tolist()]

    def verify(self) -> dict[str, int]:
        """Read every row once (a null one is refused): counts read."""
        for index in range(self.total_length):
            self.read(index)
        return {"shards": self.num_shards, "documents": self.total_length}
