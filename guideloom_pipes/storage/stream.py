"""Stream storage: one flat array of ``format.stream_dtype`` elements per shard.

Shard ``k`` is ``{k:07d}.in_band.bin``: the packed bytes of its elements, no header. The
dataset's stream is shard 0, then shard 1, ... Reads may cross shard boundaries and, past
the last element, wrap around to shard 0.

This module holds the storage and its writer; the reader is in ``stream_reader.py``, the
checks of arguments in ``stream_checks.py`` (``StreamReader`` is importable from here too).
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any, Generic

import numpy as np

from guideloom_pipes.storage.base import AsyncReaderBase, StorageBase
from guideloom_pipes.storage.names import IN_BAND
from guideloom_pipes.storage.stream_checks import check_packed, check_stream_format
from guideloom_pipes.storage.stream_reader import StreamReader
from guideloom_pipes.storage.writer import ShardWriterBase
from guideloom_pipes.types import (
    InDataT,
    OutDataT,
    StreamDType,
    StreamStorageAbstract,
    StreamStorageAsyncReaderAbstract,
    StreamStorageSyncWriterAbstract,
)


class StreamStorage(
    StorageBase, StreamStorageAbstract[InDataT, OutDataT], Generic[InDataT, OutDataT, StreamDType]
):
    """Stream storage: shards of flat ``storage_format.stream_dtype`` arrays.

    Args:
        storage_dir: the dataset directory, or its URL (``"s3://bucket/data"``; see
            ``docs/remote.md``).
        storage_format: a stream format (e.g. :class:`~guideloom_pipes.StreamNumpyFormat`).
        read_interface: the read backend (default memory-mapped).
        storage_options: for a URL, the fsspec file system's options.
        retry: for a URL, a :class:`~guideloom_pipes.storage.remote.RetryPolicy`.
        cache_dir: for a URL, the shard cache's local directory (None: range reads).
        cache_limit_bytes: most bytes the shard cache keeps (None: no bound).
    """

    kind = "stream"
    suffixes = (IN_BAND,)

    def __init__(
        self: StreamStorage[Any, Any, Any],
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
        check_stream_format(format, ("pack", "unpack"))

    def sync_reader(self) -> StreamReader:
        """A reader of the committed shards (context manager)."""
        return StreamReader(self)

    def async_reader(self) -> AsyncStreamReader:
        """An ``async`` reader of the committed shards (``async with``)."""
        return AsyncStreamReader(StreamReader(self))

    def sync_writer(self, mode: str = "update") -> StreamWriter:
        """A writer; each touched shard is replaced atomically when it closes.

        ``mode``: ``"update"`` (the default, GuideLoom's: replace only the shards written;
        warns at close if shards of an earlier write remain above them), ``"overwrite"``
        (the dataset becomes exactly the shards written: the others are removed at commit)
        or ``"create"`` (refuse a directory that already holds shard files).
        """
        return StreamWriter(self, mode)


class StreamWriter(ShardWriterBase, StreamStorageSyncWriterAbstract[Any]):
    """Appends packed records to shards; commits each touched shard on close.

    The first ``append`` to a shard starts it afresh (an existing shard with that id is
    replaced at commit, never appended to).
    """

    kind = "stream"
    suffixes = (IN_BAND,)

    def __init__(self, storage: StreamStorage, mode: str = "update") -> None:
        super().__init__(storage.dir, mode, storage.read_interface)
        self.format = storage.format
        self.dtype = np.dtype(storage.format.stream_dtype)
        self._lengths: dict[int, int] = {}

    def append(self, shard: int, data: Any) -> None:
        """Pack ``data`` with the format and append it to shard ``shard``."""
        self._check_open()
        array = check_packed(
            self.format.pack(data), self.dtype, f"{type(self.format).__name__}.pack"
        )
        with self._lock:  # one append at a time: the file, its checksum, the length
            transaction = self._transaction(shard)
            transaction.files[IN_BAND].write(array)
            self._lengths[transaction.shard] = self._lengths.get(transaction.shard, 0) + len(array)
            self._written(transaction.shard)

    def length(self, shard: int) -> int:
        """Elements appended to ``shard`` in this writer session (``KeyError`` if none)."""
        try:
            return self._lengths[shard]
        except KeyError:
            raise KeyError(f"shard {shard} was not written by this writer") from None

    def start(self, shard: int) -> None:
        """Start shard ``shard`` with nothing in it: it is committed at close even if
        nothing is appended to it (an empty shard, where appends would otherwise be the
        only way to create one)."""
        self._check_open()
        with self._lock:
            transaction = self._transaction(shard)
            self._lengths.setdefault(transaction.shard, 0)
            self._written(transaction.shard)

    def _commit_args(self, shard: int) -> dict[str, Any]:
        return {"count": self._lengths[shard], "dtype": self.dtype}


class AsyncStreamReader(AsyncReaderBase, StreamStorageAsyncReaderAbstract[Any]):
    """``async`` stream reader: ``await reader.read(global_index, global_length)``."""

    async def read(self, global_index: int, global_length: int) -> Any:
        """See :meth:`StreamReader.read`."""
        import asyncio

        return await asyncio.to_thread(self._sync.read, global_index, global_length)
