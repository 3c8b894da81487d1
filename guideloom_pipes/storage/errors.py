"""The storage layer's exceptions and warnings: uncommitted, corrupt or locked shards, and
temporary files left by a writer that stopped."""

from __future__ import annotations


class StorageError(Exception):
    """Base class of the storage layer's own errors."""


class UncommittedShardError(StorageError, RuntimeError):
    """A shard was not committed by a writer that closed, or its commit was interrupted."""


class CorruptShardError(StorageError, ValueError):
    """A shard's files do not match its commit record or each other (size, checksum)."""


class ShardLockedError(StorageError, BlockingIOError):
    """Another writer holds the write lock of the shard."""


class StaleWriteWarning(UserWarning):
    """A temporary file left by a writer that stopped before it committed."""
