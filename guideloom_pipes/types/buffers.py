"""Type variables, buffer types and ``Vector``: the vocabulary the protocols are written in."""

from __future__ import annotations

from pathlib import PurePath
from typing import TypeVar

import numpy as np

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


#: Bytes a user's ``pack`` may return.
UserBufferTypes = bytearray | bytes | memoryview
#: Bytes the storages hand to ``unpack`` (writable, owned by the caller).
StorageBufferTypes = bytearray | memoryview
#: A 1-D numpy array of ``DType`` elements, e.g. ``Vector[np.int64]``.
Vector = np.ndarray[tuple[int], np.dtype[DType]]
#: Any bytes-like value (our older name of :data:`UserBufferTypes`).
Buffer = UserBufferTypes
