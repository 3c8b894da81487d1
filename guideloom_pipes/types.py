"""Abstract bases and protocols: storage formats, read backends, storages and datasets.

numpy structured dtypes are the schema language throughout. Formats turn one record into
stored bytes and back; read backends serve byte ranges of one file; storages own a
directory of shards; datasets index samples. These are the extension points: implement a
protocol, or subclass an abstract base, to plug in a format or a backend of your own.

The names GuideLoom 1.1 has in ``guideloom.types`` are all here, with the same bases and
abstract methods, so code written against them (``isinstance`` checks, subclasses) runs
unchanged; the built-in storages, readers, writers, datasets and backends subclass them.
Our own additions: :class:`BatchStreamFormat`, the structural reader protocols
(:class:`SyncByteReader`, :class:`ReadInterface`, ...), :class:`Storage` and ``Buffer``.

Nothing here imports torch (:class:`StatefulDataLoaderStateDict` is a plain ``TypedDict``).
"""

from __future__ import annotations

import abc
import contextlib
import sys
from collections.abc import Awaitable, Callable, Generator, Hashable, Iterable, Sequence
from pathlib import PurePath
from types import TracebackType
from typing import Any, Generic, Protocol, TypedDict, TypeVar, Union, runtime_checkable

import numpy as np

# Type variables ------------------------------------------------------------------------------

#: numpy scalar type of a :data:`Vector`'s elements.
DType = TypeVar("DType", bound=np.generic)
#: numpy scalar type of a stream format's ``stream_dtype``.
StreamDType = TypeVar("StreamDType", bound=np.generic)
#: what a writer's ``append`` takes (a format's ``pack`` input).
InDataT = TypeVar("InDataT")
#: what a reader's ``read`` returns (a format's ``unpack`` output).
OutDataT = TypeVar("OutDataT")
#: a sample of a dataset.
OutT = TypeVar("OutT")
#: the path type a read backend serves (``pathlib.Path``, or any ``PurePath`` subclass).
PathT = TypeVar("PathT", bound=PurePath)

# Protocols take their data types with the variance of their use (mypy checks it).
_InContraT = TypeVar("_InContraT", contravariant=True)
_OutCoT = TypeVar("_OutCoT", covariant=True)

# Buffers and vectors -------------------------------------------------------------------------

#: Bytes a user's ``pack`` may return.
UserBufferTypes = bytearray | bytes | memoryview
#: Bytes the storages hand to ``unpack`` (writable, owned by the caller).
StorageBufferTypes = bytearray | memoryview
#: A 1-D numpy array of ``DType`` elements, e.g. ``Vector[np.int64]``.
Vector = np.ndarray[tuple[int], np.dtype[DType]]
#: Any bytes-like value (our older name of :data:`UserBufferTypes`).
Buffer = UserBufferTypes


# Storage formats -----------------------------------------------------------------------------


def _init_stream_dtype(self: Any, stream_dtype: np.dtype[Any]) -> None:
    """Store ``stream_dtype`` (the constructor a format subclassing the protocol inherits)."""
    if getattr(type(self), "_is_protocol", False):
        raise TypeError("Protocols cannot be instantiated")
    self.stream_dtype = stream_dtype


@runtime_checkable
class StreamStorageFormat(Protocol[_InContraT, _OutCoT, StreamDType]):
    """Encodes records into a flat stream of ``stream_dtype`` elements and decodes windows.

    ``pack(data)`` returns a 1-D array of ``stream_dtype``. ``unpack(stream, shard_lengths,
    shards)`` receives a window of the stream in which the first ``shard_lengths[0]``
    elements came from shard ``shards[0]``, and so on (both int64 vectors).

    A class that subclasses this protocol explicitly inherits a constructor that stores
    its one argument as ``stream_dtype``.
    """

    stream_dtype: np.dtype[StreamDType]

    def __init__(self, stream_dtype: np.dtype[StreamDType]) -> None:
        _init_stream_dtype(self, stream_dtype)

    def pack(self, data: _InContraT) -> Vector[StreamDType]: ...

    def unpack(
        self,
        stream: Vector[StreamDType],
        shard_lengths: Vector[np.int64],
        shards: Vector[np.int64],
    ) -> _OutCoT: ...


@runtime_checkable
class BatchStreamFormat(Protocol):
    """Optional fast path for stream formats: decode many equal-length windows at once.

    ``unpack_batch(windows)`` gets a C-contiguous ``(batch, sequence_length)`` array of
    ``stream_dtype`` and returns one decoded sample per row. Samples must own their memory
    (or share it only with other samples of the same call), never the storage's.
    """

    def unpack_batch(self, windows: np.ndarray) -> list[Any]: ...


@runtime_checkable
class DocumentStorageFormat(Protocol[_InContraT, _OutCoT]):
    """Encodes one document to bytes (``pack``) and decodes it (``unpack(encoded_data, shard)``).

    ``unpack`` gets a ``bytearray`` (or a ``memoryview`` of one) that it may keep: it is a
    copy, valid after the reader closes.
    """

    def pack(self, data: _InContraT) -> UserBufferTypes: ...

    def unpack(self, encoded_data: StorageBufferTypes, shard: int) -> _OutCoT: ...


@runtime_checkable
class StreamWithMetaStorageFormat(Protocol[_InContraT, _OutCoT, StreamDType]):
    """A stream whose elements each belong to a metadata payload stored beside the stream.

    ``pack(data)`` is a generator yielding exactly ``size(data)`` pairs ``(key, payload)``,
    one per stream element, and *returning* the stream array. A key may repeat only in one
    contiguous run; the first pair of a run carries the payload (``bytes``/``memoryview``),
    later pairs may carry ``None``. ``unpack(stream_data, document_shard, document_index,
    document_data)`` gets the window, the shard of each payload it touches (int64), the
    payload of each element (int32, an index into ``document_data``), and the payloads in
    order of first use (``memoryview`` objects over copies, valid after the reader closes).

    A class that subclasses this protocol explicitly inherits a constructor that stores
    its one argument as ``stream_dtype``.
    """

    stream_dtype: np.dtype[StreamDType]

    def __init__(self, stream_dtype: np.dtype[StreamDType]) -> None:
        _init_stream_dtype(self, stream_dtype)

    def size(self, data: _InContraT) -> int: ...

    def pack(
        self, data: _InContraT
    ) -> Generator[tuple[Hashable, UserBufferTypes | None], None, Vector[StreamDType]]: ...

    def unpack(
        self,
        stream_data: Vector[StreamDType],
        document_shard: Vector[np.int64],
        document_index: Vector[np.int32],
        document_data: Sequence[StorageBufferTypes],
    ) -> _OutCoT: ...


if sys.version_info < (3, 11):  # pragma: no cover - Python 3.10
    # Python 3.10 swaps a protocol's own __init__ for one that refuses arguments; put ours
    # back so that formats subclassing the protocols inherit it, as on later Pythons.
    StreamStorageFormat.__init__ = _init_stream_dtype  # type: ignore[method-assign]
    StreamWithMetaStorageFormat.__init__ = _init_stream_dtype  # type: ignore[method-assign]

#: Any of the three storage formats.
StorageFormat = Union[  # noqa: UP007 - a generic alias: ``StorageFormat[In, Out]``
    StreamWithMetaStorageFormat[_InContraT, _OutCoT, Any],
    StreamStorageFormat[_InContraT, _OutCoT, Any],
    DocumentStorageFormat[_InContraT, _OutCoT],
]


# Context managers ----------------------------------------------------------------------------

_SyncT = TypeVar("_SyncT", bound="SyncContextManager")
_AsyncT = TypeVar("_AsyncT", bound="AsyncContextManager")


class SyncContextManager(contextlib.AbstractContextManager, abc.ABC):
    """An object with ``open()``/``close()`` that ``with`` opens and closes."""

    def __enter__(self: _SyncT) -> _SyncT:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @abc.abstractmethod
    def open(self) -> None:
        """Acquire what the object needs (files, mappings); called by ``with``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what ``open`` acquired; called when the ``with`` block ends."""


class AsyncContextManager(contextlib.AbstractAsyncContextManager, abc.ABC):
    """The ``async`` counterpart of :class:`SyncContextManager` (``async with``)."""

    async def __aenter__(self: _AsyncT) -> _AsyncT:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    @abc.abstractmethod
    async def open(self) -> None:
        """Acquire what the object needs; awaited by ``async with``."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release what ``open`` acquired; awaited when the ``async with`` block ends."""


# Read backends -------------------------------------------------------------------------------


class IOSyncReaderAbstract(metaclass=abc.ABCMeta):
    """Reads byte ranges of one file (made by a backend's ``sync_reader()`` factory).

    ``open`` raises ``FileNotFoundError`` for a missing file.
    """

    @abc.abstractmethod
    def filesize(self) -> int:
        """The file's size in bytes (after ``open``)."""

    @abc.abstractmethod
    def read(self, offset: int, size: int) -> StorageBufferTypes:
        """``size`` bytes from ``offset``."""

    @abc.abstractmethod
    def open(self) -> None:
        """Open the file."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the file."""


class IOAsyncReaderAbstract(metaclass=abc.ABCMeta):
    """The ``async`` counterpart of :class:`IOSyncReaderAbstract`, plus ``close_sync()``."""

    @abc.abstractmethod
    async def filesize(self) -> int:
        """The file's size in bytes (after ``open``)."""

    @abc.abstractmethod
    async def read(self, offset: int, size: int) -> StorageBufferTypes:
        """``size`` bytes from ``offset``."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Open the file."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the file."""

    @abc.abstractmethod
    def close_sync(self) -> None:
        """Close the file without an event loop (e.g. from a finalizer)."""


class IOReaderAbstract(Generic[PathT], metaclass=abc.ABCMeta):
    """A read backend (a storage's ``read_interface``).

    ``sync_reader()`` and ``async_reader()`` return *factories*: call one with a path to get
    a reader of that file (``backend.sync_reader()(path)``). The path is whatever
    ``pathlib.PurePath`` the storage was given, so a backend may serve an object store.

    Our extension: a backend may also define ``list_dir(path) -> Iterable[str]`` (the file
    names in a directory). With it, shard discovery lists the directory and detects a gap
    in the shard ids; without it, discovery probes ids one by one, as GuideLoom does.
    """

    @staticmethod
    @abc.abstractmethod
    def is_supported() -> bool:
        """Whether this backend works on this platform."""

    @abc.abstractmethod
    def sync_reader(self) -> Callable[[PathT], IOSyncReaderAbstract]:
        """A factory of sync readers: ``factory(path)``."""

    @abc.abstractmethod
    def async_reader(self) -> Callable[[PathT], IOAsyncReaderAbstract]:
        """A factory of ``async`` readers: ``factory(path)``."""


@runtime_checkable
class SyncByteReader(Protocol):
    """Any object that reads byte ranges of one file (the shape of
    :class:`IOSyncReaderAbstract`, without subclassing it)."""

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
    """A read backend in either convention.

    GuideLoom's (see :class:`IOReaderAbstract`): ``sync_reader()`` returns a factory that is
    called with the path. Ours, also accepted: ``sync_reader(path)`` returns the reader
    directly. The storages tell the two apart by ``sync_reader``'s signature (a required
    argument means the path-taking form).
    """

    def sync_reader(self, *args: Any) -> Any: ...

    def async_reader(self, *args: Any) -> Any: ...


@runtime_checkable
class ListingReadInterface(ReadInterface, Protocol):
    """A :class:`ReadInterface` that can list a directory (enables gap detection)."""

    def list_dir(self, path: PurePath) -> Iterable[str]: ...


# Storages ------------------------------------------------------------------------------------


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


# Datasets ------------------------------------------------------------------------------------


class DatasetSyncReaderAbstract(Sequence, SyncContextManager, abc.ABC, Generic[OutT]):
    """Indexed samples, open for reading: a ``Sequence`` (``len``, ``[i]``, slices, ``iter``,
    ``reversed``, ``in``) and a context manager."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many samples."""

    @abc.abstractmethod
    def __getitem__(self, index: int | slice) -> OutT | Sequence[OutT]:  # type: ignore[override]
        """Sample ``index``, or a list of samples for a slice."""


class DatasetAsyncReaderAbstract(AsyncContextManager, abc.ABC, Generic[OutT]):
    """Indexed samples for ``async`` code: ``len``, and ``await reader[i]`` /
    ``await reader[a:b]``; an ``async`` context manager."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many samples."""

    @abc.abstractmethod
    def __getitem__(self, index: int | slice) -> Awaitable[OutT] | Awaitable[Sequence[OutT]]:
        """An awaitable of sample ``index``, or of a list of samples for a slice."""


class DatasetAbstract(Generic[OutT], metaclass=abc.ABCMeta):
    """Numbered samples over a storage: factories of sync and ``async`` readers."""

    @abc.abstractmethod
    def __init__(
        self, storage: DocumentStorageAbstract[Any, OutT] | StreamStorageAbstract[Any, OutT]
    ) -> None:
        """Samples of ``storage``."""

    @abc.abstractmethod
    def sync_reader(self) -> DatasetSyncReaderAbstract[OutT]:
        """A reader (context manager)."""

    @abc.abstractmethod
    def async_reader(self) -> DatasetAsyncReaderAbstract[OutT]:
        """An ``async`` reader (``async with``)."""


#: Our older name of :class:`DatasetAbstract`.
Dataset = DatasetAbstract


# Loader state --------------------------------------------------------------------------------


class StatefulDataLoaderStateDict(TypedDict):
    """The checkpoint of a ``StatefulDataLoader`` (``state_dict()`` / ``load_state_dict``)."""

    epoch: int
    observation_offset: int
    shuffle: bool
    shuffle_seed: int | None
    drop_last: bool


__all__ = [
    # GuideLoom's names, in its order
    "StorageFormat",
    "StreamWithMetaStorageFormat",
    "StreamStorageFormat",
    "DocumentStorageFormat",
    "UserBufferTypes",
    "StorageBufferTypes",
    "Vector",
    "SyncContextManager",
    "AsyncContextManager",
    "IOReaderAbstract",
    "IOSyncReaderAbstract",
    "IOAsyncReaderAbstract",
    "DatasetAbstract",
    "DatasetSyncReaderAbstract",
    "DatasetAsyncReaderAbstract",
    "StreamStorageAbstract",
    "StreamStorageSyncWriterAbstract",
    "StreamStorageSyncReaderAbstract",
    "StreamStorageAsyncReaderAbstract",
    "DocumentStorageAbstract",
    "DocumentStorageSyncWriterAbstract",
    "DocumentStorageSyncReaderAbstract",
    "DocumentStorageAsyncReaderAbstract",
    "StatefulDataLoaderStateDict",
    # ours
    "AsyncByteReader",
    "BatchStreamFormat",
    "Buffer",
    "Dataset",
    "ListingReadInterface",
    "ReadInterface",
    "Storage",
    "SyncByteReader",
]
