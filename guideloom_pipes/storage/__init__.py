"""The storage layer: shard files, atomic commit, read backends and the three storages."""

from guideloom_pipes.storage.document import DocumentStorage
from guideloom_pipes.storage.errors import (
    CorruptShardError,
    DatasetChangedError,
    ShardDecodeError,
    ShardLockedError,
    StaleManifestWarning,
    StaleWriteWarning,
    StorageError,
    UncommittedShardError,
)
from guideloom_pipes.storage.remote_failures import RangeIgnoredError, RemoteReadError, RetryPolicy
from guideloom_pipes.storage.stream import StreamStorage
from guideloom_pipes.storage.stream_meta import StreamWithMetaStorage

__all__ = [
    "CorruptShardError",
    "DatasetChangedError",
    "DocumentStorage",
    "RangeIgnoredError",
    "RemoteReadError",
    "RetryPolicy",
    "ShardDecodeError",
    "ShardLockedError",
    "StaleManifestWarning",
    "StaleWriteWarning",
    "StorageError",
    "StreamStorage",
    "StreamWithMetaStorage",
    "UncommittedShardError",
]
