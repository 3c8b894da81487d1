"""The window plans of ``PackedDataset(..., packing="best_fit")`` (and ``"first_fit"``):
which pieces of which documents fill each window, computed once from the document lengths.

:func:`plan_windows` packs whole documents into windows of ``L`` tokens without cutting them,
``lookahead`` documents at a time: the next ``lookahead`` documents of the packing order,
sorted by length, longest first (ties in packing order), each put into the open window with
the least free space that holds it (best fit; ``"first_fit"``: the first window opened that
holds it), a new window opened when none does. A document longer than ``L`` is split at
multiples of ``L`` from its start: each full piece is a window of its own (those windows come
first in their block, in document order), the rest is placed like a document. The windows of
a block follow in the order they were opened, a window's pieces in the order they were put in;
no window stays open into the next block. The plan is a pure function of the lengths and the
options, so window ``i`` is the same pieces in every process and after every restart.

A :class:`PackingPlan` is three int64 arrays: ``offsets`` (window ``w``'s pieces are
``offsets[w]:offsets[w + 1]``), and per piece its document's ``position`` in the packing order
and its first token in that document (``start``, a multiple of ``L``; a piece ends at
``min(start + L, length)``). It is kept as a sidecar next to the prefix sums (see
:func:`load_plan`), and :func:`fitted_windows` assembles a batch of windows from it: the
pieces back to back, then ``pad_token`` up to ``L``.
"""

from __future__ import annotations

import warnings
import zlib
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.packing_index import (
    _CHECKED,
    _I64,
    _Damaged,
    _read_header,
    _write_atomic,
)

__all__ = [
    "DEFAULT_LOOKAHEAD",
    "FITS",
    "PACKINGS",
    "PackingPlan",
    "check_packing",
    "check_pad_dtype",
    "fitted_windows",
    "load_plan",
    "plan_windows",
]

#: The packing modes: cut and concatenate (the default), and the two that fit whole documents.
PACKINGS = ("concat", "best_fit", "first_fit")
FITS = ("best_fit", "first_fit")
#: Documents planned together by default.
DEFAULT_LOOKAHEAD = 1024
#: 1: offsets, positions and starts, int64 each
_PLAN_VERSION = 1
_INT64 = np.iinfo(np.int64)


def check_packing(
    packing: Any, pad_token: Any, lookahead: Any
) -> tuple[str, int | None, int | None]:
    """``(packing, pad_token, lookahead)`` checked: a known mode; ``pad_token`` (an int64
    token id) and ``lookahead`` (an int >= 1, default :data:`DEFAULT_LOOKAHEAD`) for a fit,
    neither for ``"concat"``."""
    if not isinstance(packing, str) or packing not in PACKINGS:
        raise ValueError(
            f"packing must be one of {', '.join(map(repr, PACKINGS))}, got {packing!r}"
        )
    if packing == "concat":
        for name, value in (("pad_token", pad_token), ("lookahead", lookahead)):
            if value is not None:
                raise ValueError(
                    f"{name}={value!r} is an option of packing='best_fit' or 'first_fit'; "
                    f"packing='concat' (the default) cuts documents into full windows and "
                    f"has no padding: drop {name}, or pass packing='best_fit'"
                )
        return packing, None, None
    if pad_token is None:
        raise ValueError(
            f"packing={packing!r} pads each window's free space: pass pad_token=<a token id "
            f"that fits the documents' dtype> (it is labelled -100)"
        )
    pad = check_int(
        "pad_token",
        pad_token,
        minimum=int(_INT64.min),
        maximum=int(_INT64.max),
        kind="an int token id",
    )
    ahead = check_int(
        "lookahead",
        DEFAULT_LOOKAHEAD if lookahead is None else lookahead,
        minimum=1,
        hint="(documents sorted and fitted together)",
    )
    return packing, pad, ahead


def check_pad_dtype(pad_token: int, dtype: np.dtype[Any]) -> None:
    """Refuse a ``pad_token`` outside the range of the documents' integer token ``dtype``."""
    if dtype.kind not in "iu":
        return
    info = np.iinfo(dtype)
    if not info.min <= pad_token <= info.max:
        raise ValueError(
            f"pad_token={pad_token} does not fit the documents' token dtype {dtype} "
            f"({info.min}..{info.max}): pass a pad_token in that range"
        )


@dataclass(frozen=True)
class PackingPlan:
    """The windows of a fitted packing: window ``w`` is the pieces
    ``offsets[w]:offsets[w + 1]``; piece ``p`` is tokens ``starts[p]`` to
    ``min(starts[p] + L, length)`` of the document at ``positions[p]`` in the packing order."""

    offsets: _I64
    positions: _I64
    starts: _I64

    @property
    def windows(self) -> int:
        """The number of windows (the dataset's ``len``)."""
        return len(self.offsets) - 1

    def pieces(self, ids: _I64) -> tuple[_I64, _I64, _I64, _I64]:
        """The pieces of windows ``ids``, window after window: ``(counts, owner, positions,
        starts)``, ``counts`` per window, and per piece the row of ``ids`` it fills."""
        first = self.offsets[ids]
        counts = self.offsets[ids + 1] - first
        owner = np.repeat(np.arange(len(ids), dtype=np.int64), counts)
        begins = np.zeros(len(ids), dtype=np.int64)
        np.cumsum(counts[:-1], out=begins[1:])
        index = first[owner] + (np.arange(len(owner), dtype=np.int64) - begins[owner])
        return counts, owner, self.positions[index], self.starts[index]

    def piece_sizes(self, lengths: _I64, sequence_length: int) -> _I64:
        """The tokens of each piece, given the document lengths in the packing order."""
        return np.minimum(self.starts + sequence_length, lengths[self.positions]) - self.starts


def _best_fit(sizes: list[int], capacity: int) -> list[int]:
    """The window of each item (``sizes`` in the order they are placed, each below
    ``capacity``): the open window with the least free space that holds it, the earliest
    opened among equals."""
    scale = len(sizes) + 1  # a window's key: free space * scale + its number
    spaces: list[int] = []  # the keys of the windows with free space, sorted
    out = []
    opened = 0
    for size in sizes:
        at = bisect_left(spaces, size * scale)
        if at == len(spaces):
            window, left = opened, capacity - size
            opened += 1
        else:
            left, window = divmod(spaces.pop(at), scale)
            left -= size
        if left:
            insort(spaces, left * scale + window)
        out.append(window)
    return out


def _first_fit(sizes: list[int], capacity: int) -> list[int]:
    """As :func:`_best_fit`, but the earliest opened window that holds the item."""
    space = np.zeros(len(sizes), dtype=np.int64)  # free space of each window opened
    out = []
    opened = 0
    for size in sizes:
        window = int(np.argmax(space[:opened] >= size)) if opened else 0
        if not opened or space[window] < size:
            window = opened
            space[window] = capacity
            opened += 1
        space[window] -= size
        out.append(window)
    return out


def plan_windows(
    lengths: Sequence[int] | np.ndarray,
    sequence_length: int,
    *,
    packing: str = "best_fit",
    lookahead: int = DEFAULT_LOOKAHEAD,
) -> PackingPlan:
    """The :class:`PackingPlan` of documents of ``lengths`` (in the packing order, an EOS
    counted) in windows of ``sequence_length`` tokens (see the module docstring).

    Args:
        lengths: Tokens per document (>= 0; an empty document takes no place).
        sequence_length: ``L``, tokens per window (>= 1).
        packing: ``"best_fit"`` or ``"first_fit"``.
        lookahead: Documents sorted and placed together (>= 1).
    """
    length = check_int("sequence_length", sequence_length, minimum=1)
    ahead = check_int("lookahead", lookahead, minimum=1)
    if packing not in FITS:
        raise ValueError(f"packing must be one of {', '.join(map(repr, FITS))}, got {packing!r}")
    fit: Callable[[list[int], int], list[int]] = _best_fit if packing == "best_fit" else _first_fit
    sizes = np.asarray(lengths, dtype=np.int64)
    if sizes.ndim != 1 or (len(sizes) and int(sizes.min()) < 0):
        raise ValueError("lengths must be a 1-D sequence of document lengths >= 0")
    counts: list[_I64] = []
    positions: list[_I64] = []
    starts: list[_I64] = []
    for begin in range(0, len(sizes), ahead):
        block = sizes[begin : begin + ahead]
        whole, rest = np.divmod(block, length)
        # the full pieces of the long documents: a window each, in document order
        owners = np.repeat(np.arange(len(block), dtype=np.int64), whole)
        before = np.cumsum(whole) - whole
        counts.append(np.ones(len(owners), dtype=np.int64))
        positions.append(begin + owners)
        starts.append((np.arange(len(owners), dtype=np.int64) - before[owners]) * length)
        # the rest, longest first (a stable sort: ties in packing order), fitted
        items = np.flatnonzero(rest)
        items = items[np.argsort(-rest[items], kind="stable")]
        windows = np.asarray(fit(rest[items].tolist(), length), dtype=np.int64)
        placed = items[np.argsort(windows, kind="stable")]  # by window, in placing order
        counts.append(np.bincount(windows, minlength=int(windows.max(initial=-1)) + 1))
        positions.append(begin + placed)
        starts.append(whole[placed] * length)
    offsets = np.zeros(1 + sum(len(c) for c in counts), dtype=np.int64)
    if counts:
        np.cumsum(np.concatenate(counts), out=offsets[1:])
    empty = np.zeros(0, dtype=np.int64)
    return PackingPlan(
        offsets,
        np.concatenate(positions) if positions else empty,
        np.concatenate(starts) if starts else empty,
    )


# -- assembling windows ---------------------------------------------------------------------


def fitted_windows(
    plan: PackingPlan,
    ids: _I64,
    sums: _I64,
    sequence_length: int,
    pad_token: int,
    eos_token: int | None,
    documents: Callable[[_I64, _I64], list[np.ndarray]],
) -> tuple[_I64, _I64, np.ndarray]:
    """The windows ``ids`` of ``plan``: ``(tokens, starts, padding)``, the ``(B, L)`` int64
    tokens (pieces back to back, then ``pad_token``), the sorted flat indexes where a
    sequence starts inside a window (each piece after the first, and the padding), and the
    ``(B, L)`` mask of the padding.

    Args:
        sums: The prefix sums of the document lengths in the packing order.
        documents: ``(positions, sizes) ->`` the documents at those positions of the
            packing order as token arrays without the EOS, checked against ``sizes`` (EOS
            counted).
    """
    length = sequence_length
    rows = len(ids)
    if rows == 0:
        empty = np.zeros((0, length), dtype=np.int64)
        return empty, np.zeros(0, dtype=np.int64), empty.astype(bool)
    counts, owner, positions, starts = plan.pieces(ids)
    sizes = sums[positions + 1] - sums[positions]
    ends = np.minimum(starts + length, sizes)
    parts: list[Any] = []
    eos = np.array([0 if eos_token is None else eos_token], dtype=np.int64)
    for array, start, end in zip(documents(positions, sizes), starts.tolist(), ends.tolist()):
        parts.append(array[start:end])
        if end > len(array):  # the piece ends with the document's EOS
            parts.append(eos)
    pieces = ends - starts
    fill = np.bincount(owner, weights=pieces, minlength=rows).astype(np.int64)
    kept = np.arange(length, dtype=np.int64) < fill[:, None]
    tokens = np.full((rows, length), pad_token, dtype=np.int64)
    tokens[kept] = np.concatenate(parts)
    # each piece's first column in its window: the tokens of the pieces before it there
    before = np.cumsum(pieces) - pieces
    first = np.zeros(rows, dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    column = before - before[first][owner]
    inner = column > 0
    padded = np.flatnonzero(fill < length)
    flat = np.concatenate((owner[inner] * length + column[inner], padded * length + fill[padded]))
    return tokens, np.sort(flat), ~kept


# -- the sidecar ----------------------------------------------------------------------------


def plan_meta(
    fingerprint: str,
    variant: str,
    packing: str,
    sequence_length: int,
    lookahead: int,
    sums: _I64,
) -> dict[str, Any]:
    """What a plan sidecar's header must hold to be this dataset's plan for these options."""
    return {
        "version": _PLAN_VERSION,
        "fingerprint": fingerprint,
        "variant": variant,
        "packing": packing,
        "sequence_length": sequence_length,
        "lookahead": lookahead,
        "documents": len(sums) - 1,
        "tokens": int(sums[-1]),
    }


def _write_plan(path: Path, meta: dict[str, Any], plan: PackingPlan) -> bool:
    arrays = [
        np.ascontiguousarray(a, dtype="<i8") for a in (plan.offsets, plan.positions, plan.starts)
    ]
    crc = 0
    for array in arrays:
        crc = zlib.crc32(array.data, crc)
    header = {**meta, "windows": plan.windows, "pieces": len(plan.positions), "crc32": crc}
    return _write_atomic(path, header, [array.data for array in arrays])


def _read_plan(path: Path, meta: dict[str, Any], sums: _I64) -> PackingPlan | None:
    """The plan in ``path`` if its header holds ``meta`` (None: no such file, or the plan of
    other options or of another state of the dataset, rebuilt quietly). Raises
    :class:`_Damaged` when its contents do not hold (checked once per process for an
    unchanged file)."""
    found = _read_header(path)
    if found is None:
        return None
    header_meta, header, info = found
    if any(header_meta.get(key) != value for key, value in meta.items()):
        return None
    try:
        windows, pieces = int(header_meta["windows"]), int(header_meta["pieces"])
        crc = int(header_meta["crc32"])
    except (KeyError, TypeError, ValueError) as error:
        raise _Damaged(f"its header lacks a valid {error}") from None
    count = windows + 1 + 2 * pieces
    if windows < 0 or pieces < 0 or info.st_size - len(header) != 8 * count:
        raise _Damaged(f"it has {info.st_size - len(header)} bytes, not {8 * count}")
    try:
        array = np.memmap(path, dtype="<i8", mode="r", offset=len(header), shape=(count,))
    except (OSError, ValueError):
        return None
    values = array.view(np.ndarray)
    plan = PackingPlan(
        values[: windows + 1],
        values[windows + 1 : windows + 1 + pieces],
        values[windows + 1 + pieces :],
    )
    identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    if identity not in _CHECKED:
        if zlib.crc32(values.data) != crc:
            raise _Damaged("it fails its checksum (the file changed after it was written)")
        _check_plan(plan, sums, int(meta["sequence_length"]))
        _CHECKED.add(identity)
    return plan


def _check_plan(plan: PackingPlan, sums: _I64, sequence_length: int) -> None:
    """Raise :class:`_Damaged` unless ``plan`` is a plan of windows of ``sequence_length``
    over documents of the prefix sums ``sums``: offsets from 0 up to every piece, positions
    of documents, starts at multiples of ``L`` inside their documents, no window over ``L``
    tokens, every token once."""
    offsets, positions, starts = plan.offsets, plan.positions, plan.starts
    if (
        offsets[0] != 0
        or offsets[-1] != len(positions)
        or bool((offsets[1:] <= offsets[:-1]).any())
    ):
        raise _Damaged("its window offsets do not run from 0 up to its pieces")
    if len(positions) and (int(positions.min()) < 0 or int(positions.max()) >= len(sums) - 1):
        raise _Damaged("a piece names a document outside the dataset")
    lengths = np.diff(sums)
    if bool((starts < 0).any() or (starts % sequence_length).any()) or bool(
        (starts >= lengths[positions]).any()
    ):
        raise _Damaged("a piece starts outside its document or off a window boundary")
    sizes = plan.piece_sizes(lengths, sequence_length)
    if plan.windows and int(np.add.reduceat(sizes, offsets[:-1]).max()) > sequence_length:
        raise _Damaged(f"a window holds more than {sequence_length} tokens")
    if int(sizes.sum()) != int(sums[-1]):
        raise _Damaged(f"its pieces hold {int(sizes.sum())} tokens, not {int(sums[-1])}")


def load_plan(
    sums: _I64,
    packing: str,
    sequence_length: int,
    lookahead: int,
    paths: Sequence[Path] = (),
    meta: dict[str, Any] | None = None,
) -> PackingPlan:
    """The plan of documents of the prefix sums ``sums``: from the first sidecar of
    ``paths`` that holds ``meta`` (see :func:`plan_meta`), else computed
    (:func:`plan_windows`) and written to the first of ``paths`` that can be written. A
    damaged sidecar is rebuilt, with a warning naming it; one that cannot be written is
    warned about (the plan is then computed by every process that opens the dataset)."""
    if meta is not None:
        for path in paths:
            try:
                found = _read_plan(path, meta, sums)
            except _Damaged as damage:
                warnings.warn(
                    f"the PackedDataset plan sidecar {path} does not hold its windows: "
                    f"{damage}. It is rebuilt from the document lengths",
                    UserWarning,
                    stacklevel=4,
                )
                continue
            if found is not None:
                return found
    plan = plan_windows(np.diff(sums), sequence_length, packing=packing, lookahead=lookahead)
    if meta is not None and paths and not any(_write_plan(p, meta, plan) for p in paths):
        warnings.warn(
            f"PackedDataset could not write its {packing} plan next to the dataset or "
            f"under cache_dir: it is kept in memory only and computed again by every "
            f"process. Pass cache_dir= a writable directory to keep it",
            UserWarning,
            stacklevel=4,
        )
    return plan
