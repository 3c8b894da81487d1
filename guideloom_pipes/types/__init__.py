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
Each kind of extension point has a module of its own (``buffers``, ``formats``, ``context``,
``backends``, ``storages``, ``datasets``); import the names from this package.
"""

from __future__ import annotations

from guideloom_pipes.types.backends import (
    AsyncByteReader,
    IOAsyncReaderAbstract,
    IOReaderAbstract,
    IOSyncReaderAbstract,
    ListingReadInterface,
    ReadInterface,
    SyncByteReader,
)
from guideloom_pipes.types.buffers import (
    Buffer,
    StorageBufferTypes,
    UserBufferTypes,
    Vector,
)
from guideloom_pipes.types.buffers import (
    DType as DType,
)
from guideloom_pipes.types.buffers import (
    InDataT as InDataT,
)
from guideloom_pipes.types.buffers import (
    OutDataT as OutDataT,
)
from guideloom_pipes.types.buffers import (
    OutT as OutT,
)
from guideloom_pipes.types.buffers import (
    PathT as PathT,
)
from guideloom_pipes.types.buffers import (
    StreamDType as StreamDType,
)
from guideloom_pipes.types.context import (
    AsyncContextManager,
    SyncContextManager,
)
from guideloom_pipes.types.datasets import (
    Dataset,
    DatasetAbstract,
    DatasetAsyncReaderAbstract,
    DatasetSyncReaderAbstract,
    StatefulDataLoaderStateDict,
)
from guideloom_pipes.types.formats import (
    BatchStreamFormat,
    DocumentStorageFormat,
    StorageFormat,
    StreamStorageFormat,
    StreamWithMetaStorageFormat,
)
from guideloom_pipes.types.storages import (
    DocumentStorageAbstract,
    DocumentStorageAsyncReaderAbstract,
    DocumentStorageSyncReaderAbstract,
    DocumentStorageSyncWriterAbstract,
    Storage,
    StreamStorageAbstract,
    StreamStorageAsyncReaderAbstract,
    StreamStorageSyncReaderAbstract,
    StreamStorageSyncWriterAbstract,
)

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
