"""The packed columns of a batch of windows: :func:`pack_columns` (the four int64 ``(B, L)``
fields of ``(B, L)`` token windows, ``tokens``, ``position_ids``, ``document_ids`` and
``labels``, computed for the whole batch with a few numpy passes), :func:`pack_windows` and
:class:`PackedSample` (a batch's rows as samples), and the sequence bounds a read leaves on its
output block's lease for ``collate_packed`` (:func:`known_sequences`). What
:class:`~guideloom_pipes.packing_reader.PackedReader` packs its reads with.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.storage.recycle import Lease

#: The label of positions that predict nothing (torch's ``cross_entropy`` ignore_index).
IGNORE_INDEX = -100
_I64 = npt.NDArray[np.int64]


#: The four fields of a packed sample.
FIELDS = ("tokens", "position_ids", "document_ids", "labels")


@functools.lru_cache(maxsize=8)
def _arange(count: int) -> _I64:
    steps = np.arange(count, dtype=np.int64)
    steps.flags.writeable = False
    return steps


@functools.lru_cache(maxsize=32)
def _eos_scalar(dtype: np.dtype[Any], eos_token: int) -> Any:
    """``eos_token`` as a scalar to compare windows of ``dtype`` with in their own dtype
    (fewer bytes than int64), or as an int64 where that dtype cannot hold it (then never
    found)."""
    if dtype.kind not in "iu":
        return eos_token
    info = np.iinfo(dtype)
    if not info.min <= eos_token <= info.max:
        return np.int64(eos_token)
    return dtype.type(eos_token)


def _narrow(length: int) -> type[np.signedinteger[Any]]:
    """The narrowest signed dtype that holds ``0..length`` (the window-local values: a
    position, a column, a document's number in its window)."""
    if length <= _INT16_MAX:
        return np.int16
    return np.int32 if length <= _INT32_MAX else np.int64


_INT16_MAX = int(np.iinfo(np.int16).max)
_INT32_MAX = int(np.iinfo(np.int32).max)
#: (length, dtype) -> ``0..length-1`` repeated, read-only (see ``_ramp``).
_RAMPS: dict[tuple[int, Any], np.ndarray] = {}
#: Ramps of up to this many values are kept (a batch of 512 windows of 8,192 tokens);
#: a larger read builds its own.
_RAMP_KEPT = 1 << 22


def _ramp(rows: int, length: int, dtype: type[np.signedinteger[Any]]) -> np.ndarray:
    """``0, 1, ..., length - 1`` repeated ``rows`` times in ``dtype`` (read-only): a slice
    of one array per window length, grown to twice the rows when a batch needs more (up to
    ``_RAMP_KEPT`` values)."""
    total = rows * length
    ramps = _RAMPS.get((length, dtype))
    if ramps is None or len(ramps) < total:
        have = 0 if ramps is None else len(ramps) // max(length, 1)
        ramps = np.tile(np.arange(length, dtype=dtype), max(rows, 2 * have))
        if len(ramps) > _RAMP_KEPT:  # a very large read: not kept
            return ramps[:total]
        ramps.flags.writeable = False
        if len(_RAMPS) >= 16:  # many window lengths: keep the latest ones
            _RAMPS.clear()
        _RAMPS[(length, dtype)] = ramps
    return ramps[:total]


def _remember_sequences(position_ids: _I64, bounds: _I64, sizes: _I64) -> None:
    """Record its batch's sequence bounds and sizes on the lease of ``position_ids`` (a
    column of a slab), for :func:`known_sequences` (``collate_packed`` then needs no pass
    over the positions): ``(column, bounds, sizes)`` as the lease's note, ``column`` a weak
    reference to ``position_ids``. Every array of the batch (columns, the rows of its
    samples, tensors made from them) holds the lease through its base, so it dies with the
    last of them and hands the slab back to the reader's pool (see
    :class:`~guideloom_pipes.storage.recycle.Lease`)."""
    lease: Lease = position_ids.base.base  # type: ignore[union-attr,assignment]
    lease.note = (weakref.ref(position_ids), bounds, sizes)


def known_sequences(position_ids: np.ndarray) -> tuple[_I64, _I64] | None:
    """``(bounds, sizes)`` of the sequences of ``position_ids`` when it is, unchanged in
    shape, the ``position_ids`` column of one :class:`PackedReader` read (as its read found
    them: the flat start of every sequence then ``B * L``, and each one's length), else
    None (then they are found from the positions)."""
    whole = position_ids.base
    if type(whole) is not np.ndarray:
        return None
    lease = whole.base
    if type(lease) is not Lease or type(note := lease.note) is not tuple:
        return None
    column, bounds, sizes = note
    if column() is not position_ids:
        return None
    return bounds, sizes


def pack_columns(
    windows: np.ndarray,
    *,
    eos_token: int | None = None,
    starts: _I64 | None = None,
    out: _I64 | None = None,
) -> tuple[dict[str, _I64], _I64]:
    """The four int64 ``(B, L)`` fields of ``(B, L)`` token windows, computed for the whole
    batch at once, and the flat starts of its sequences.

    Args:
        windows: ``(B, L)`` integer tokens (any integer dtype, any strides).
        eos_token: A document starts after each of these tokens (a stream).
        starts: Or: the flat indexes (into the ``B * L`` tokens) where a document starts
            inside a window, sorted (documents).
        out: Where to write the four fields: a ``(4, B, L)`` int64 array (by default a new
            one).

    Returns:
        ``(columns, segments)``: field -> ``(B, L)`` int64 array, and the sorted flat index
        of every sequence start (each window start and each document start inside a
        window). See :func:`_pack` for how.
    """
    columns, bounds, _ = _pack(windows, eos_token, starts, out)
    return columns, bounds[:-1]


def _pack(
    windows: np.ndarray, eos_token: int | None, starts: _I64 | None, out: _I64 | None
) -> tuple[dict[str, _I64], _I64, _I64]:
    """:func:`pack_columns`, returning the bounds of the sequences (their flat starts, then
    ``B * L``) and their sizes instead of the starts."""
    if out is None:
        out = np.empty((len(FIELDS), *windows.shape), dtype=np.int64)
    return _pack_many(windows, eos_token, starts, [out])[0]


def _pack_many(
    windows: np.ndarray, eos_token: int | None, starts: _I64 | None, outs: Sequence[_I64]
) -> list[tuple[dict[str, _I64], _I64, _I64]]:
    """The packed columns of consecutive groups of rows of ``windows``, one group per
    ``(4, B_i, L)`` int64 array of ``outs`` (their ``B_i`` add up to the rows): for each,
    ``(columns, bounds, sizes)`` as :func:`_pack` gives them for those rows alone.

    A few passes over all the rows at once and no loop per window or per document: a mask
    of the sequence starts (the EOS found in the source's own dtype, or ``starts``) and its
    nonzero indexes; per sequence, its first column and its number in its window, both
    repeated over its tokens with one ``repeat`` in the narrowest dtype that holds them
    (int16 for windows up to 32,767 tokens: a quarter of int64's bytes); ``position_ids`` as
    a cached ramp ``0..L-1`` per window minus the first column. Then per group, into its
    array: the tokens widened; the two planes widened into ``position_ids`` and
    ``document_ids`` with one copy (they are adjacent); ``labels`` as the widened tokens
    shifted by one (a plain copy), with ``-100`` scattered before each start and last.
    The work per sequence is done once for all the groups (a reader packs a chunk of
    batches together, each into its own array).
    """
    rows, length = windows.shape
    total = rows * length
    flat = windows.reshape(-1)  # a copy only for windows with odd strides
    if total == 0:
        return [
            (dict(zip(FIELDS, out)), np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
            for out in outs
        ]
    # is_start[k]: a sequence starts at flat index k (k == total: the end of the last one)
    is_start = np.empty(total + 1, dtype=bool)
    if starts is None:
        eos = _eos_scalar(windows.dtype, eos_token or 0)
        np.equal(flat[:-1], eos, out=is_start[1:total])
    else:
        is_start[1:total] = False
        is_start[starts] = True
    is_start[::length] = True  # every window start (index 0 among them), and index total
    bounds = is_start.nonzero()[0]
    segments = bounds[:-1]
    sizes = bounds[1:] - segments
    narrow = _narrow(length)
    # per sequence: its first column, and its number in its window (its rank minus the rank
    # of its window's first sequence, found by a search of its own window in the sorted ones)
    window, column = np.divmod(segments, length)
    numbers = _arange(total)[: len(segments)] - window.searchsorted(window)
    values = np.array((column, numbers), dtype=narrow)
    spread = np.repeat(values, sizes, axis=1)  # (2, total): each value over its sequence
    np.subtract(_ramp(rows, length, narrow), spread[0], out=spread[0])
    if len(outs) == 1:
        return [_fill(outs[0], flat, spread, bounds, sizes)]
    # each group's share of the bounds: every window start is one, so a group's rows
    # begin and end at bounds
    edges = np.cumsum([0] + [out.shape[1] * length for out in outs])
    at = bounds.searchsorted(edges).tolist()
    results = []
    for index, out in enumerate(outs):
        a, b = int(edges[index]), int(edges[index + 1])
        low, high = at[index], at[index + 1]
        results.append(
            _fill(out, flat[a:b], spread[:, a:b], bounds[low : high + 1] - a, sizes[low:high])
        )
    return results


def _fill(
    out: _I64, flat: np.ndarray, spread: np.ndarray, bounds: _I64, sizes: _I64
) -> tuple[dict[str, _I64], _I64, _I64]:
    """Write one group's four planes into ``out`` (see :func:`_pack_many`)."""
    planes = out.reshape(len(FIELDS), len(flat))
    tokens, labels = planes[0], planes[3]
    np.copyto(tokens, flat, casting="unsafe")
    np.copyto(planes[1:3], spread)  # position_ids and document_ids, widened
    if len(flat):
        labels[:-1] = tokens[1:]
        labels[bounds[1:] - 1] = IGNORE_INDEX  # the last token of each document, window, batch
    return dict(zip(FIELDS, out)), bounds, sizes


def pack_windows(
    windows: np.ndarray, *, eos_token: int | None = None, starts: _I64 | None = None
) -> list[PackedSample]:
    """The samples of ``(B, L)`` token windows (see :func:`pack_columns` for the
    arguments): one :class:`PackedSample` per window, rows of the ``(B, L)`` arrays."""
    columns, segments = pack_columns(windows, eos_token=eos_token, starts=starts)
    return _samples(columns, segments)


class PackedSample(dict[str, Any]):
    """A window of a :class:`PackedDataset`: a plain ``dict`` of its four ``(L,)`` arrays.

    It also remembers the ``(B, L)`` arrays of the read it is row ``row`` of (``batch``) and
    their sequence starts (``segments``), so that :func:`~guideloom_pipes.collate_packed`
    batches consecutive rows of one read without copying them. It pickles as a plain
    ``dict``.
    """

    __slots__ = ("batch", "row", "segments")

    batch: dict[str, _I64]
    row: int
    segments: _I64

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


def _samples(columns: dict[str, _I64], segments: _I64) -> list[PackedSample]:
    out = []
    for row in range(len(columns["tokens"])):
        sample = PackedSample({name: column[row] for name, column in columns.items()})
        sample.batch = columns
        sample.row = row
        sample.segments = segments
        out.append(sample)
    return out
