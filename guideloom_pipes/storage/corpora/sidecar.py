"""The sidecar files the corpora keep what one scan found in (document ends, Parquet row
lengths): ``magic``, the key of what they were computed from (a digest), then int64 values;
written atomically beside the data or under ``cache_dir``, never trusted on another key."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["keep_values", "read_values"]


def read_values(path: Path, magic: bytes, key: bytes) -> np.ndarray | None:
    """The int64 values of the sidecar at ``path``, or None where there is none, or it is
    of another kind (``magic``) or of other files (``key``), or cut short."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(magic) + len(key)
    if data[: len(magic)] != magic or data[len(magic) : head] != key:
        return None
    if (len(data) - head) % 8:
        return None
    return np.frombuffer(data, dtype="<i8", offset=head).astype(np.int64)


def keep_values(places: Sequence[Path], magic: bytes, key: bytes, values: np.ndarray) -> bool:
    """Write ``values`` as the sidecar at the first of ``places`` that takes it (a
    temporary renamed into place); whether one did."""
    return any(_write(place, magic + key + values.astype("<i8").tobytes()) for place in places)


def _write(path: Path, data: bytes) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    except OSError:
        return False
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        return False
