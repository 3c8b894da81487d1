"""Abstract bases and protocols: storage formats, read backends, storages and datasets.

numpy structured dtypes are the schema language throughout. Formats turn one record into
stored bytes and back; read backends serve byte ranges of one file; storages own a
directory of shards; datasets index samples. These are the extension points: implement a
protocol to plug in a format or a backend of your own.
"""

from __future__ import annotations

import abc
from collections.abc import Generator, Hashable, Iterable, Sequence
from pathlib import PurePath
from typing import Any, Protocol, runtime_checkable

import numpy as np

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class StreamStorageFormat(Protocol):
    """Encodes records into a flat stream of ``stream_dtype`` elements and decodes windows.

    ``unpack(stream, shard_lengths, shards)`` receives a window of the stream in which the
    first ``shard_lengths[0]`` elements came from shard ``shards[0]``, and so on.
    """

    stream_dtype: np.dtype[Any]

    def pack(self, data: Any) -> np.ndarray: ...

    def unpack(
        self, stream: np.ndarray, shard_lengths: Sequence[int], shards: Sequence[int]
    ) -> Any: ...


@runtime_checkable
class BatchStreamFormat(Protocol):
    """Optional fast path for stream formats: decode many equal-length windows at once.

    ``unpack_batch(windows)`` gets a C-contiguous ``(batch, sequence_length)`` array of
    ``stream_dtype`` and returns one decoded sample per row. Samples must own their memory
    (or share it only with other samples of the same call), never the storage's.
    """

    def unpack_batch(self, windows: np.ndarray) -> list[Any]: ...


@runtime_checkable
class DocumentStorageFormat(Protocol):
    """Encodes one document to bytes (``pack``) and decodes it (``unpack(buffer, shard)``)."""

    def pack(self, document: Any) -> Buffer: ...

    def unpack(self, buffer: Buffer, shard: int) -> Any: ...


@runtime_checkable
class StreamWithMetaStorageFormat(Protocol):
    """A stream whose elements each belong to a metadata payload stored beside the stream.

    ``pack(data)`` is a generator yielding exactly ``size(data)`` pairs ``(key, payload)``,
    one per stream element, and *returning* the stream array. A key may repeat only in one
    contiguous run; the first pair of a run carries the payload (``bytes``/``memoryview``),
    later pairs may carry ``None``.
    """

    stream_dtype: np.dtype[Any]

    def size(self, data: Any) -> int: ...

    def pack(self, data: Any) -> Generator[tuple[Hashable, Buffer | None], None, np.ndarray]: ...

    def unpack(
        self,
        stream_data: np.ndarray,
        document_shard: np.ndarray,
        document_index: np.ndarray,
        document_data: list[bytes],
    ) -> Any: ...


# Read backends ----------------------------------------------------------------------------


@runtime_checkable
class SyncByteReader(Protocol):
    """Reads byte ranges of one file. ``open`` raises ``FileNotFoundError`` for a missing file."""

    def open(self) -> None: ...

    def close(self) -> None: ...

    def filesize(self) -> int: ...

    def read(self, offset: int, size: int) -> Buffer: ...


@runtime_checkable
class AsyncByteReader(Protocol):
    """The ``async`` counterpart of :class:`SyncByteReader`."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def filesize(self) -> int: ...

    async def read(self, offset: int, size: int) -> Buffer: ...


@runtime_checkable
class ReadInterface(Protocol):
    """A read backend: factories of byte readers for a path (any ``PurePath`` subclass).

    A backend may also offer ``list_dir(path) -> Iterable[str]`` (file names in a
    directory). With it, shard discovery lists the directory and detects gaps; without it,
    discovery probes shard ids one by one, as GuideLoom does, and a gap cannot be seen.
    """

    def sync_reader(self, path: PurePath) -> SyncByteReader: ...

    def async_reader(self, path: PurePath) -> AsyncByteReader: ...


@runtime_checkable
class ListingReadInterface(ReadInterface, Protocol):
    """A :class:`ReadInterface` that can list a directory (enables gap detection)."""

    def list_dir(self, path: PurePath) -> Iterable[str]: ...


# Storages and datasets --------------------------------------------------------------------


class Storage(abc.ABC):
    """A directory of shards written by one format: factories for readers and writers."""

    @abc.abstractmethod
    def sync_reader(self) -> Any:
        """A reader over the committed shards; use it as a context manager."""

    @abc.abstractmethod
    def async_reader(self) -> Any:
        """An ``async`` reader over the committed shards (``async with``)."""

    @abc.abstractmethod
    def sync_writer(self) -> Any:
        """A writer; shards it touches commit atomically when it closes without error."""


class Dataset(abc.ABC):
    """Indexed samples over a storage: ``len``, and readers with ``[i]``, slices, batches."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def sync_reader(self) -> Any:
        """A reader (context manager) with ``len``, ``[i]``, slices and ``read_batch``."""

    @abc.abstractmethod
    def async_reader(self) -> Any:
        """An ``async`` reader (``async with``) with ``read`` and ``read_batch``."""


__all__ = [
    "AsyncByteReader",
    "BatchStreamFormat",
    "Buffer",
    "Dataset",
    "DocumentStorageFormat",
    "ListingReadInterface",
    "ReadInterface",
    "Storage",
    "StreamStorageFormat",
    "StreamWithMetaStorageFormat",
    "SyncByteReader",
]
