"""The checks of what the stream storages are given: index vectors (:func:`as_indexes`),
read sizes against the machine's memory, the arrays a format packs, a window read's
``out`` buffer, and a stream format's protocol.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

#: The largest int64, the last index numpy can hold in the int64 vectors the readers use.
_INT64_MAX = int(np.iinfo(np.int64).max)
#: Up to this many indexes are checked as a Python list (numpy's min and max cost more).
_FEW = 64


def as_indexes(
    values: Any, length: int, kind: str, out_of_range: Callable[[int], IndexError]
) -> np.ndarray:
    """``values`` (an integer array, or a sequence or iterable of ints) as a 1-D int64
    vector of indexes in ``[0, length)``.

    Non-integers: ``TypeError`` naming ``kind`` (e.g. ``"sample ids"``) and the dtype. An
    index outside the range: ``out_of_range(first bad value)``, the value as it was given,
    also past int64 (where a cast would wrap it around to a negative number). One pass over
    the whole vector (``min``/``max``), never a check per element.
    """
    given = isinstance(values, np.ndarray)
    if given and values.dtype == np.int64 and values.ndim == 1 and len(values) <= _FEW:
        listed = values.tolist()  # a loader's batch of ids: checked in Python, faster
        if not listed or (min(listed) >= 0 and max(listed) < length):
            return values
    array = values if given else np.asarray(values)
    if array.dtype.kind not in "iu":
        if not array.size:
            return np.zeros(0, dtype=np.int64)
        if array.dtype.kind == "O" or not given:
            # Python ints past int64 make numpy choose float64 or object: find them as given
            flat = (array if given else np.asarray(values, dtype=object)).reshape(-1).tolist()
            if all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
                bad = next((v for v in flat if not 0 <= v < length), None)
                if bad is not None:
                    raise out_of_range(bad)
        raise TypeError(f"{kind} must be integers, got an array of {array.dtype}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > _INT64_MAX:
        raise out_of_range(int(array[array > _INT64_MAX].flat[0]))
    array = array.astype(np.int64, copy=False).reshape(-1)
    if len(array) and (int(array.min()) < 0 or int(array.max()) >= length):
        raise out_of_range(int(array[(array < 0) | (array >= length)][0]))
    return array


def _memory_bytes() -> int:
    """The machine's physical memory in bytes (``sys.maxsize`` where it cannot tell)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return sys.maxsize


def check_read_size(length: int, itemsize: int, what: str) -> None:
    """Refuse a read of ``length`` elements of ``itemsize`` bytes that this machine could
    not hold (more bytes than its memory): ``ValueError`` saying ``what`` was asked for
    (e.g. ``"global_length 4611686018427387904"``) and the limit. Numpy's own errors for
    such sizes name neither."""
    if length * itemsize > _MEMORY:
        raise ValueError(
            f"{what} is too large: {length} elements of {itemsize} bytes are "
            f"{length * itemsize} bytes, more than this machine's {_MEMORY} bytes of memory. "
            f"Read at most {_MEMORY // itemsize} elements at a time (in practice far fewer)"
        )


_MEMORY = min(_memory_bytes(), sys.maxsize)


def check_packed(array: Any, dtype: np.dtype[Any], what: str) -> np.ndarray:
    """``array`` if it is a 1-D numpy array of exactly ``dtype``, else a clear error."""
    if not isinstance(array, np.ndarray):
        raise TypeError(
            f"{what} must return a 1-D numpy array of {dtype}, got {type(array).__name__}"
        )
    if array.ndim != 1:
        raise ValueError(f"{what} must return a 1-D array, got shape {array.shape}")
    if array.dtype != dtype:
        raise TypeError(
            f"{what} returned dtype {array.dtype}, but the format's stream_dtype is {dtype}; "
            f"convert it (array.astype(stream_dtype)) in pack"
        )
    return np.ascontiguousarray(array)


def _checked_out(out: Any, shape: tuple[int, int], dtype: np.dtype[Any]) -> np.ndarray:
    """The buffer a window read was given, checked: a writable C-contiguous array of
    ``shape`` and ``dtype``."""
    if (
        not isinstance(out, np.ndarray)
        or out.shape != shape
        or out.dtype != dtype
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        got = (
            f"shape {out.shape}, dtype {out.dtype}, contiguous {out.flags.c_contiguous}, "
            f"writeable {out.flags.writeable}"
            if isinstance(out, np.ndarray)
            else type(out).__name__
        )
        raise ValueError(
            f"the out buffer of a window read must be a writable C-contiguous array of shape "
            f"{shape} and dtype {dtype}, got {got}: return np.empty(shape, dtype) or a view "
            "of that size"
        )
    return out


def check_stream_format(format: Any, needs: tuple[str, ...]) -> np.dtype[Any]:
    """The format's ``stream_dtype``, after checking it has the protocol's methods."""
    missing = [name for name in needs if not callable(getattr(format, name, None))]
    if missing or not hasattr(format, "stream_dtype"):
        raise TypeError(
            f"{format!r} is not a stream format: it needs stream_dtype and "
            f"{', '.join(needs)} (missing {', '.join(missing) or 'stream_dtype'})"
        )
    return np.dtype(format.stream_dtype)
