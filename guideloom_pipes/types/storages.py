"""Storages, their readers and writers: abstract bases of a directory of shards."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Generic

import numpy as np

from guideloom_pipes.types.buffers import (
    InDataT,
    OutDataT,
    Vector,
)
from guideloom_pipes.types.context import (
    AsyncContextManager,
    SyncContextManager,
)


class Storage(abc.ABC):
    """A directory of shards written by one format: factories for readers and writers.

    Our common base of the three storages (GuideLoom has one base per kind:
    :class:`StreamStorageAbstract` and :class:`DocumentStorageAbstract`).
    """

    @abc.abstractmethod
    def sync_reader(self) -> Any:
        """A reader over the committed shards; use it as a context manager."""

    @abc.abstractmethod
    def async_reader(self) -> Any:
        """An ``async`` reader over the committed shards (``async with``)."""

    @abc.abstractmethod
    def sync_writer(self) -> Any:
        """A writer; shards it touches commit atomically when it closes without error."""


class _StreamStorageSharedReaderAbstract(metaclass=abc.ABCMeta):
    """What sync and ``async`` stream readers share: the shard layout."""

    @property
    @abc.abstractmethod
    def num_shards(self) -> int:
        """How many shards the stream has."""

    @property
    @abc.abstractmethod
    def total_length(self) -> int:
        """Elements in the whole stream."""

    @abc.abstractmethod
    def length(self, shard: int) -> int:
        """Elements in shard ``shard``."""


class StreamStorageSyncWriterAbstract(SyncContextManager, abc.ABC, Generic[InDataT]):
    """Appends records to the shards of a stream storage (a context manager)."""

    @abc.abstractmethod
    def append(self, shard: int, data: InDataT) -> None:
        """Pack ``data`` and append it to shard ``shard``."""

    @abc.abstractmethod
    def length(self, shard: int) -> int:
        """Elements appended to ``shard`` in this writer session."""


class StreamStorageSyncReaderAbstract(
    _StreamStorageSharedReaderAbstract, SyncContextManager, abc.ABC, Generic[OutDataT]
):
    """Reads spans of a stream storage (a context manager)."""

    @abc.abstractmethod
    def read(self, global_index: int, global_length: int) -> OutDataT:
        """The decoded span of ``global_length`` elements from ``global_index``."""


class StreamStorageAsyncReaderAbstract(
    _StreamStorageSharedReaderAbstract, AsyncContextManager, abc.ABC, Generic[OutDataT]
):
    """The ``async`` counterpart of :class:`StreamStorageSyncReaderAbstract`."""

    @abc.abstractmethod
    async def read(self, global_index: int, global_length: int) -> OutDataT:
        """The decoded span of ``global_length`` elements from ``global_index``."""


class StreamStorageAbstract(Generic[InDataT, OutDataT], metaclass=abc.ABCMeta):
    """A stream storage: a factory of writers and readers over one dataset directory."""

    @abc.abstractmethod
    def sync_writer(self) -> StreamStorageSyncWriterAbstract[InDataT]:
        """A writer."""

    @abc.abstractmethod
    def sync_reader(self) -> StreamStorageSyncReaderAbstract[OutDataT]:
        """A reader."""

    @abc.abstractmethod
    def async_reader(self) -> StreamStorageAsyncReaderAbstract[OutDataT]:
        """An ``async`` reader."""


class _DocumentStorageSharedReaderAbstract(metaclass=abc.ABCMeta):
    """What sync and ``async`` document readers share: the shard layout."""

    @property
    @abc.abstractmethod
    def num_shards(self) -> int:
        """How many shards the storage has."""

    @property
    @abc.abstractmethod
    def total_length(self) -> int:
        """Documents in the storage."""

    @abc.abstractmethod
    def length(self, shard: int) -> int:
        """Documents in shard ``shard``."""


class DocumentStorageSyncWriterAbstract(SyncContextManager, abc.ABC, Generic[InDataT]):
    """Appends documents to the shards of a document storage (a context manager)."""

    @abc.abstractmethod
    def append(self, shard: int, data: InDataT) -> None:
        """Encode ``data`` and append it to shard ``shard``."""

    @abc.abstractmethod
    def length(self, shard: int) -> int:
        """Documents appended to ``shard`` in this writer session."""


class DocumentStorageSyncReaderAbstract(
    _DocumentStorageSharedReaderAbstract, SyncContextManager, abc.ABC, Generic[OutDataT]
):
    """Reads documents of a document storage by global index (a context manager)."""

    @abc.abstractmethod
    def read(self, global_index: int) -> OutDataT:
        """Document ``global_index``, decoded."""

    def read_many(self, global_indexes: Vector[np.int64]) -> Sequence[OutDataT]:
        """The documents at ``global_indexes``, in that order (one ``read`` each here)."""
        return [self.read(int(index)) for index in global_indexes]


class DocumentStorageAsyncReaderAbstract(
    _DocumentStorageSharedReaderAbstract, AsyncContextManager, abc.ABC, Generic[OutDataT]
):
    """The ``async`` counterpart of :class:`DocumentStorageSyncReaderAbstract`."""

    @abc.abstractmethod
    async def read(self, global_index: int) -> OutDataT:
        """Document ``global_index``, decoded."""

    async def read_many(self, global_indexes: Vector[np.int64]) -> Sequence[OutDataT]:
        """The documents at ``global_indexes``, in that order (one ``read`` each here)."""
        return [await self.read(int(index)) for index in global_indexes]


class DocumentStorageAbstract(Generic[InDataT, OutDataT], metaclass=abc.ABCMeta):
    """A document storage: a factory of writers and readers over one dataset directory."""

    @abc.abstractmethod
    def sync_writer(self) -> DocumentStorageSyncWriterAbstract[InDataT]:
        """A writer."""

    @abc.abstractmethod
    def sync_reader(self) -> DocumentStorageSyncReaderAbstract[OutDataT]:
        """A reader."""

    @abc.abstractmethod
    def async_reader(self) -> DocumentStorageAsyncReaderAbstract[OutDataT]:
        """An ``async`` reader."""
