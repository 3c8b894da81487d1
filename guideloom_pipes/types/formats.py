"""Storage format protocols: how one record becomes stored bytes and back (stream, stream with
metadata, documents)."""

from __future__ import annotations

import sys
from collections.abc import Generator, Hashable, Sequence
from typing import Any, Protocol, Union, runtime_checkable

import numpy as np

from guideloom_pipes.types.buffers import (
    StorageBufferTypes,
    StreamDType,
    UserBufferTypes,
    Vector,
    _InContraT,
    _OutCoT,
)


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
