"""Document storage: whole encoded documents, back to back, with an offset index per shard.

Shard ``k`` is ``{k:07d}.out_of_band.bin`` (the encoded documents) and
``{k:07d}.out_of_band.index`` (``n + 1`` little-endian int64 byte offsets, the first 0:
document ``j`` is bytes ``[idx[j], idx[j+1])``). Documents are numbered globally: shard 0's,
then shard 1's, ...
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from pathlib import PurePath
from typing import Any

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.storage.base import AsyncReaderBase, ReaderBase, StorageBase
from guideloom_pipes.storage.errors import ShardDecodeError, StorageError, decode_error
from guideloom_pipes.storage.names import INDEX, OUT_OF_BAND, shard_name
from guideloom_pipes.storage.payloads import (
    OffsetIndex,
    PayloadLog,
    check_payload,
    index_counts,
)
from guideloom_pipes.storage.shard_listing import FileSizes, ShardListing
from guideloom_pipes.storage.stream_checks import as_indexes
from guideloom_pipes.storage.writer import ShardWriterBase
from guideloom_pipes.types import (
    DocumentStorageAbstract,
    DocumentStorageAsyncReaderAbstract,
    DocumentStorageSyncReaderAbstract,
    DocumentStorageSyncWriterAbstract,
    InDataT,
    OutDataT,
)


class DocumentStorage(StorageBase, DocumentStorageAbstract[InDataT, OutDataT]):
    """Document storage: encoded documents plus an offset index per shard.

    Args:
        storage_dir: the dataset directory, or its URL (``"s3://bucket/data"``; see
            ``docs/remote.md``).
        storage_format: a document format (e.g. :class:`~guideloom_pipes.DocumentPickleFormat`).
        read_interface: the read backend (default memory-mapped).
        storage_options: for a URL, the fsspec file system's options.
        retry: for a URL, a :class:`~guideloom_pipes.storage.remote.RetryPolicy`.
        cache_dir: for a URL, the shard cache's local directory (None: range reads).
        cache_limit_bytes: most bytes the shard cache keeps (None: no bound).

    The format's ``unpack(encoded_data, shard)`` gets a fresh ``bytearray`` from ``read``,
    and a ``memoryview`` of a fresh ``bytearray`` from ``read_many`` (as GuideLoom does);
    either stays valid after the reader closes.
    """

    kind = "document"
    suffixes = (INDEX, OUT_OF_BAND)

    def __init__(
        self: DocumentStorage[Any, Any],
        storage_dir: PurePath | str,
        storage_format: Any,
        read_interface: Any = None,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: Any = None,
        cache_dir: Any = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        super().__init__(
            storage_dir,
            storage_format,
            read_interface,
            storage_options=storage_options,
            retry=retry,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )

    def _check_format(self, format: Any) -> None:
        missing = [n for n in ("pack", "unpack") if not callable(getattr(format, n, None))]
        if missing:
            raise TypeError(f"{format!r} is not a document format: it lacks {', '.join(missing)}")

    def sync_reader(self) -> DocumentReader:
        """A reader of the committed shards (context manager)."""
        return DocumentReader(self)

    def async_reader(self) -> AsyncDocumentReader:
        """An ``async`` reader of the committed shards (``async with``)."""
        return AsyncDocumentReader(DocumentReader(self))

    def sync_writer(self, mode: str = "update") -> DocumentWriter:
        """A writer; each touched shard is replaced atomically when it closes.

        ``mode``: ``"update"`` (the default, GuideLoom's: replace only the shards written;
        warns at close if shards of an earlier write remain above them), ``"overwrite"``
        (the dataset becomes exactly the shards written: the others are removed at commit)
        or ``"create"`` (refuse a directory that already holds shard files).
        """
        return DocumentWriter(self, mode)


class DocumentWriter(ShardWriterBase, DocumentStorageSyncWriterAbstract[Any]):
    """Appends encoded documents to shards; commits each touched shard on close."""

    kind = "document"
    suffixes = (INDEX, OUT_OF_BAND)

    def __init__(self, storage: DocumentStorage, mode: str = "update") -> None:
        super().__init__(storage.dir, mode, storage.read_interface)
        self.format = storage.format
        self._logs: dict[int, PayloadLog] = {}

    def append(self, shard: int, data: Any) -> None:
        """Encode the document ``data`` with the format and append it to shard ``shard``."""
        self._check_open()
        payload = check_payload(self.format.pack(data), f"{type(self.format).__name__}.pack")
        with self._lock:  # one append at a time: the file, its checksum, the offsets
            transaction = self._transaction(shard)
            log = self._logs.get(transaction.shard)
            if log is None:
                log = self._logs[transaction.shard] = PayloadLog(transaction.files[OUT_OF_BAND])
            log.append(payload)
            self._written(transaction.shard)

    def length(self, shard: int) -> int:
        """Documents appended to ``shard`` in this writer session (``KeyError`` if none)."""
        try:
            return len(self._logs[shard])
        except KeyError:
            raise KeyError(f"shard {shard} was not written by this writer") from None

    def start(self, shard: int) -> None:
        """Start shard ``shard`` with nothing in it: it is committed at close even if
        nothing is appended to it (an empty shard, where appends would otherwise be the
        only way to create one)."""
        self._check_open()
        with self._lock:
            transaction = self._transaction(shard)
            if transaction.shard not in self._logs:
                self._logs[transaction.shard] = PayloadLog(transaction.files[OUT_OF_BAND])
            self._written(transaction.shard)

    def _commit_args(self, shard: int) -> dict[str, Any]:
        log = self._logs[shard]
        log.write_index(self._transactions[shard].files[INDEX])
        return {"count": len(log), "dtype": None}


class DocumentReader(ReaderBase, DocumentStorageSyncReaderAbstract[Any]):
    """Reads documents by global index."""

    storage: DocumentStorage

    def _setup(self, listing: ShardListing, sizes: FileSizes) -> None:
        self._counts = index_counts(self, sizes)
        self._starts = np.zeros(listing.num_shards + 1, dtype=np.int64)
        np.cumsum(self._counts, out=self._starts[1:])
        self._total = int(self._starts[-1])
        self._index = OffsetIndex(self, self._counts, sizes.column(OUT_OF_BAND))

    def _seal_args(self, shard: int) -> dict[str, Any]:
        self._index._check(shard)  # the index must run from 0 to the data file's size
        return {"count": int(self._counts[shard]), "dtype": None}

    @property
    def total_length(self) -> int:
        """Documents in the dataset."""
        self._check_open()
        return self._total

    def __len__(self) -> int:
        return self.total_length

    def length(self, shard: int) -> int:
        """Documents in shard ``shard``."""
        shard = self._check_shard(check_int("shard", shard))
        return int(self._counts[shard])

    def _out_of_range(self, global_index: int) -> IndexError:
        total = self._total
        valid = f"valid: 0..{total - 1}" if total else "it is empty"
        return IndexError(
            f"document index {global_index} out of range for a dataset of {total} documents "
            f"({valid})"
        )

    def _locate(self, global_index: int) -> tuple[int, int]:
        if not 0 <= global_index < self._total:
            raise self._out_of_range(global_index)
        shard = int(np.searchsorted(self._starts, global_index, side="right")) - 1
        return shard, global_index - int(self._starts[shard])

    def read(self, global_index: int) -> Any:
        """Document ``global_index``, decoded by the format.

        A document the format cannot decode raises :class:`ShardDecodeError` (a
        ``CorruptShardError``) naming the shard, the file and the document, with the
        format's own exception chained (and mixed in, see :func:`decode_error`).
        """
        self._check_open()
        global_index = check_int("global_index", global_index)
        shard, local = self._locate(global_index)
        payload = self._index.payload(shard, local)
        try:
            return self.storage.format.unpack(payload, shard)
        except StorageError:
            raise
        except Exception as error:
            raise self._decode_failed(error, shard, local, global_index) from error

    def _decode_failed(
        self, error: Exception, shard: int, local: int, global_index: int
    ) -> ShardDecodeError:
        path = self._shard_path(shard, OUT_OF_BAND)
        try:
            where = "bytes [{}, {}) of {}".format(*self._index.span(shard, local), path)
        except Exception:  # the index itself unreadable now: name the file alone
            where = path
        format_name = type(self.storage.format).__name__
        return decode_error(
            error,
            f"document {global_index} (document {local} of shard {shard_name(shard)}, {where}) "
            f"could not be decoded: {format_name}.unpack raised "
            f"{type(error).__name__}: {str(error).rstrip('.')}; the file is corrupt, or the "
            f"shard was written with another format. Run storage.verify() (it checks every "
            f"committed file against its checksum), then rewrite shard {shard}",
        )

    def read_many(self, global_indexes: Iterable[int] | np.ndarray) -> list[Any]:
        """Documents at ``global_indexes`` (an int64 vector, or any iterable of ints), in
        that order."""
        self._check_open()
        if not isinstance(global_indexes, (np.ndarray, Sequence)):
            global_indexes = list(global_indexes)  # any iterable of ints, e.g. a generator
        ids = as_indexes(global_indexes, self._total, "document indexes", self._out_of_range)
        shards = np.searchsorted(self._starts, ids, side="right") - 1
        locals_ = ids - self._starts[shards]
        # every document's bytes at once: one gather and check of the offsets, one copy
        # (read errors are not decode errors: they are raised here)
        payloads = self._index.run_views(shards, locals_, np.ones(len(ids), dtype=np.int64))
        unpack = self.storage.format.unpack
        out: list[Any] = []
        for s, data in zip(shards.tolist(), payloads):
            try:
                out.append(unpack(data, s))
            except StorageError:
                raise
            except Exception as error:
                k = int(locals_[len(out)])
                raise self._decode_failed(error, s, k, int(ids[len(out)])) from error
        return out


class AsyncDocumentReader(AsyncReaderBase, DocumentStorageAsyncReaderAbstract[Any]):
    """``async`` document reader: ``await reader.read(i)``, ``await reader.read_many(ids)``."""

    async def read(self, global_index: int) -> Any:
        """See :meth:`DocumentReader.read`."""
        return await asyncio.to_thread(self._sync.read, global_index)

    async def read_many(self, global_indexes: Iterable[int] | np.ndarray) -> list[Any]:
        """See :meth:`DocumentReader.read_many`."""
        return await asyncio.to_thread(self._sync.read_many, global_indexes)
