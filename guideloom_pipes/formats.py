"""Built-in storage formats: numpy structured streams and pickled documents."""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from guideloom_pipes.types import Buffer, DocumentStorageFormat, DType, StreamStorageFormat

#: What ``StreamNumpyFormat.pack`` takes and ``unpack`` returns: a mapping of field -> array.
DataT = TypeVar("DataT", bound=Mapping[str, Any])
#: A document of ``DocumentPickleFormat``.
DocumentT = TypeVar("DocumentT")


def _check_fits(name: str, column: np.ndarray, dtype: np.dtype[Any]) -> None:
    """Refuse values that an integer field would silently change: integers it would wrap
    around, floats it would truncate (not whole, NaN, infinite) or overflow."""
    if dtype.kind not in "iu" or not column.size:
        return
    if column.dtype.kind == "f":
        _check_whole(name, column, dtype)
        return
    if column.dtype.kind not in "iu":
        return
    if np.can_cast(column.dtype, dtype, "safe"):
        return
    info = np.iinfo(dtype)
    low, high = column.min(), column.max()
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        raise ValueError(
            f"field {name!r} holds {int(bad)}, which does not fit its dtype {dtype} "
            f"({info.min}..{info.max}); numpy would wrap it around silently. Fix the data or "
            f"widen the field"
        )


def _check_whole(name: str, column: np.ndarray, dtype: np.dtype[Any]) -> None:
    """Refuse floats that the integer ``dtype`` cannot hold exactly (one vectorised pass)."""
    info = np.iinfo(dtype)
    # both bounds are powers of two (or 0), exact as floats: [min, max + 1)
    low, high = float(info.min), float(info.max + 1)
    with np.errstate(invalid="ignore"):
        bad = (np.trunc(column) != column) | ~(column >= low) | ~(column < high)
    if not bad.any():
        return
    value = column.reshape(-1)[np.flatnonzero(bad.reshape(-1))[0]]
    if np.isfinite(value) and value == np.trunc(value):
        problem = f"does not fit its dtype {dtype} ({info.min}..{info.max})"
    else:
        problem = f"is not a whole number, so its dtype {dtype} cannot hold it"
    with np.errstate(invalid="ignore", over="ignore"):
        cast = int(np.array(value).astype(dtype))
    raise ValueError(
        f"field {name!r} holds {float(value)!r} ({column.dtype}), which {problem}; numpy "
        f"would cast it silently (here to {cast}). Fix or round the data (e.g. "
        f"np.rint(x).astype({dtype.str!r}) once it is in range), or make the field a float"
    )


class StreamNumpyFormat(StreamStorageFormat[DataT, DataT, DType]):
    """Stream records described by a numpy structured dtype.

    ``pack`` takes a mapping of 1-D arrays, one per field; ``unpack`` returns
    ``{field: array}`` where each array is contiguous and owns its memory, so it can go
    straight through ``torch.from_numpy`` and stays valid after the reader closes.

    Args:
        stream_dtype: a numpy dtype with named fields, e.g.
            ``np.dtype([("tokens", "<i4"), ("loss_mask", "u1")])``.
        data_type: for type checkers only, as in GuideLoom: the mapping type ``pack`` takes
            and ``unpack`` returns (e.g. a ``TypedDict`` of the fields). It changes nothing
            at run time: ``unpack`` returns a ``dict`` whatever it is.
    """

    def __init__(
        self: StreamNumpyFormat[Any, Any],
        stream_dtype: np.dtype[Any] | Any,
        data_type: type[Any] | None = None,
    ) -> None:
        dtype = np.dtype(stream_dtype)
        if dtype.names is None:
            raise ValueError(
                f"StreamNumpyFormat needs a structured dtype with named fields, got {dtype!r}; "
                'wrap it, e.g. np.dtype([("tokens", "<i4")])'
            )
        self.stream_dtype: np.dtype[Any] = dtype
        self.data_type = data_type

    @property
    def fields(self) -> tuple[str, ...]:
        """The field names of ``stream_dtype``, in order."""
        names = self.stream_dtype.names
        assert names is not None
        return names

    def pack(self, data: DataT) -> np.ndarray:
        """Interleave one 1-D array per field into a structured array.

        As in GuideLoom, keys that are not fields are ignored, and a scalar or a length-1
        array is broadcast to the common length. A missing field, a field of another
        length, or an array of more than one dimension is a ``ValueError``.
        """
        if not isinstance(data, Mapping):
            raise TypeError(
                f"StreamNumpyFormat.pack takes a mapping of field -> 1-D array, got "
                f"{type(data).__name__}; pass {{{', '.join(repr(f) for f in self.fields)}: ...}}"
            )
        missing = [name for name in self.fields if name not in data]
        if missing:
            raise ValueError(
                f"StreamNumpyFormat.pack needs the fields {list(self.fields)}; missing {missing}"
            )
        columns = {name: np.asarray(data[name]) for name in self.fields}
        lengths: dict[str, int] = {}
        for name, column in columns.items():
            if column.ndim > 1:
                raise ValueError(f"field {name!r} must be a 1-D array, got shape {column.shape}")
            if column.ndim == 1:
                lengths[name] = len(column)
        if not lengths:
            raise ValueError(
                "StreamNumpyFormat.pack needs at least one field given as a 1-D array (it sets "
                f"the record count); got only scalars for {list(self.fields)}"
            )
        length = max(lengths.values())
        if any(n not in (1, length) for n in lengths.values()):
            raise ValueError(
                f"fields must have equal lengths (or length 1, broadcast), got {lengths}"
            )
        out = np.zeros(length, dtype=self.stream_dtype)  # zeroed: no stray padding bytes
        for name, column in columns.items():
            _check_fits(name, column, self.stream_dtype[name])
            out[name] = column
        return out

    def unpack(
        self,
        stream: np.ndarray,
        shard_lengths: np.ndarray | Sequence[int],
        shards: np.ndarray | Sequence[int],
    ) -> DataT:
        """Split a window into ``{field: contiguous array}``."""
        return cast(DataT, {name: np.array(stream[name], copy=True) for name in self.fields})

    def unpack_columns(self, windows: np.ndarray) -> dict[str, np.ndarray]:
        """Decode a ``(batch, length)`` array of windows into one contiguous ``(batch,
        length)`` array per field: a view of ``windows`` for a dtype of one field (no copy),
        else one copy per field."""
        return {name: np.ascontiguousarray(windows[name]) for name in self.fields}

    def window_field(self) -> tuple[str, np.dtype[Any]] | None:
        """``(name, dtype)`` of the one field whose column :meth:`unpack_columns` makes of
        windows by viewing them as ``dtype``, nothing decoded: a dtype of one field, as wide
        as the element, at offset 0, not a subarray. None for any other dtype, and for a
        subclass that decodes columns its own way (overrides :meth:`unpack_columns`): its
        reader then asks it for every batch's columns."""
        if type(self).unpack_columns is not StreamNumpyFormat.unpack_columns:
            return None
        dtype = self.stream_dtype
        if len(self.fields) != 1:
            return None
        name = self.fields[0]
        field_dtype, offset = dtype.fields[name][:2]  # type: ignore[index]
        if offset or field_dtype.itemsize != dtype.itemsize or field_dtype.shape:
            return None
        return name, field_dtype

    def unpack_batch(self, windows: np.ndarray) -> list[dict[str, np.ndarray]]:
        """Decode a ``(batch, length)`` array of windows: one contiguous copy per field."""
        columns = list(self.unpack_columns(windows).items())
        if len(columns) == 1:  # (iterating the rows: half the cost of indexing each)
            name, column = columns[0]
            return [{name: row} for row in column]
        return [{name: column[i] for name, column in columns} for i in range(len(windows))]

    def __repr__(self) -> str:
        return f"StreamNumpyFormat({self.stream_dtype!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StreamNumpyFormat) and other.stream_dtype == self.stream_dtype

    def __hash__(self) -> int:
        return hash(("StreamNumpyFormat", self.stream_dtype))


class DocumentPickleFormat(DocumentStorageFormat[DocumentT, DocumentT]):
    """Documents stored as pickles (any picklable object).

    Args:
        protocol: the pickle protocol used to write (default: ``pickle.DEFAULT_PROTOCOL``).
    """

    def __init__(self: DocumentPickleFormat[Any], protocol: int | None = None) -> None:
        self.protocol = pickle.DEFAULT_PROTOCOL if protocol is None else protocol

    def pack(self, data: DocumentT) -> bytes:
        """Pickle one document."""
        return pickle.dumps(data, protocol=self.protocol)

    def unpack(self, encoded_data: Buffer, shard: int) -> DocumentT:
        """Unpickle one document."""
        return cast(DocumentT, pickle.loads(encoded_data))

    def __repr__(self) -> str:
        return f"DocumentPickleFormat(protocol={self.protocol})"


__all__ = ["DocumentPickleFormat", "StreamNumpyFormat"]
