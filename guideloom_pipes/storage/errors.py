"""The storage layer's exceptions and warnings: uncommitted, corrupt or locked shards, and
temporary files left by a writer that stopped."""

from __future__ import annotations

from typing import Any


class StorageError(Exception):
    """Base class of the storage layer's own errors."""


class UncommittedShardError(StorageError, RuntimeError):
    """A shard was not committed by a writer that closed, or its commit was interrupted."""


class CorruptShardError(StorageError, ValueError):
    """A shard's files do not match its commit record or each other (size, checksum)."""


class ShardDecodeError(CorruptShardError):
    """The format could not decode a document or payload of a shard.

    The format's own exception is the ``__cause__``. Where its class allows, the error is
    also an instance of it (``except pickle.UnpicklingError`` still catches a corrupt
    pickle): see :func:`decode_error`.
    """

    #: the class of the format's exception this error stands for (None: not mixed in)
    original: type[BaseException] | None = None

    def __str__(self) -> str:
        return BaseException.__str__(self)  # not the mixed-in class's (KeyError quotes it)

    def __reduce__(self) -> tuple[Any, ...]:
        # the mixed-in classes are made at run time: rebuild them by their parts
        return (_rebuild_decode_error, (self.original, self.args))


_DECODE_ERRORS: dict[type[BaseException], type[ShardDecodeError]] = {}


def decode_error(error: BaseException, message: str) -> ShardDecodeError:
    """A :class:`ShardDecodeError` saying ``message``, chained to the format's ``error``.

    Its class derives from ``type(error)`` too when that works (a class that can be
    subclassed and built from one message), so handlers of the format's own exception
    keep catching it; otherwise it is a plain :class:`ShardDecodeError`.
    """
    wrapped = _rebuild_decode_error(type(error), (message,))
    wrapped.__cause__ = error
    return wrapped


def _rebuild_decode_error(original: Any, args: tuple[Any, ...]) -> ShardDecodeError:
    cls = _decode_error_class(original) if isinstance(original, type) else None
    if cls is not None:
        try:
            return cls(*args)
        except Exception:  # a constructor that wants other arguments
            _DECODE_ERRORS[original] = ShardDecodeError
    return ShardDecodeError(*args)


def _decode_error_class(original: type[BaseException]) -> type[ShardDecodeError]:
    found = _DECODE_ERRORS.get(original)
    if found is not None:
        return found
    if issubclass(original, StorageError) or not issubclass(original, Exception):
        found = ShardDecodeError
    else:
        try:
            found = type(
                "ShardDecodeError",
                (ShardDecodeError, original),
                {"__module__": __name__, "__doc__": ShardDecodeError.__doc__, "original": original},
            )
        except TypeError:  # a final class, or one whose layout cannot be mixed in
            found = ShardDecodeError
    _DECODE_ERRORS[original] = found
    return found


def size_changed(name: str, where: str, size: int, committed: int, shard: int) -> CorruptShardError:
    """The error for shard ``shard``'s file ``name`` in ``where``, found ``size`` bytes
    long where it was committed with ``committed`` bytes."""
    change = "was truncated" if size < committed else "grew"
    return CorruptShardError(
        f"{name} in {where} is {size} bytes but was committed with {committed} bytes: the "
        f"file {change} after it was written. Restore it or rewrite shard {shard}"
    )


class ShardLockedError(StorageError, BlockingIOError):
    """Another writer holds the write lock of the shard."""


class StaleWriteWarning(UserWarning):
    """A temporary file left by a writer that stopped before it committed."""


class StaleManifestWarning(UserWarning):
    """A dataset's manifest no longer describes its directory (changed by a tool that does
    not keep it, or by a writer that stopped): the open listed the directory instead.
    ``guideloom-pipes index DIR`` writes it again."""


class DatasetChangedError(StorageError, RuntimeError):
    """A writer changed the dataset under a reader: it was committing while the reader
    opened (open again), or it replaced a shard the reader had open (open a new reader)."""
