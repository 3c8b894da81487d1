"""Speck64/128, the Feistel round function of the epoch shuffle: the key schedule of a round
and the block encryption, vectorised over numpy arrays (the construction:
:mod:`guideloom_pipes.shuffle`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

_MASK32 = 0xFFFFFFFF
_SPECK_STEPS = 27

_U64 = npt.NDArray[np.uint64]


def _rol32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _ror32(x: int, r: int) -> int:
    return ((x >> r) | (x << (32 - r))) & _MASK32


def _speck_round_keys(key_seed: int, j: int) -> list[int]:
    """The 27 Speck64/128 round keys of Feistel round ``j``."""
    b = key_seed & _MASK32
    words = [(key_seed >> 32) & _MASK32, j & _MASK32, (j >> 32) & _MASK32]
    keys = [b]
    for i in range(_SPECK_STEPS - 1):
        x = ((_ror32(words[i % 3], 8) + b) & _MASK32) ^ i
        b = _rol32(b, 3) ^ x
        words[i % 3] = x
        keys.append(b)
    return keys


def _speck_block(values: _U64, keys: Sequence[Any]) -> _U64:
    """Speck64 encryption of blocks ``values < 2**32`` (so the high word starts at 0), under
    the round keys ``keys``: uint32 scalars, or arrays that broadcast against ``values``
    (a column of keys per row of a 2-D ``values``)."""
    lo = values.astype(np.uint32)
    t = np.empty_like(lo)
    # Step 0 with hi = 0: hi = (ror(0, 8) + lo) ^ k0.
    hi = np.bitwise_xor(lo, keys[0])
    np.right_shift(lo, 29, out=t)
    np.left_shift(lo, 3, out=lo)
    np.bitwise_or(lo, t, out=lo)
    np.bitwise_xor(lo, hi, out=lo)
    for k in keys[1:]:
        np.right_shift(hi, 8, out=t)
        np.left_shift(hi, 24, out=hi)
        np.bitwise_or(hi, t, out=hi)
        np.add(hi, lo, out=hi)
        np.bitwise_xor(hi, k, out=hi)
        np.right_shift(lo, 29, out=t)
        np.left_shift(lo, 3, out=lo)
        np.bitwise_or(lo, t, out=lo)
        np.bitwise_xor(lo, hi, out=lo)
    out = hi.astype(np.uint64)
    np.left_shift(out, np.uint64(32), out=out)
    np.bitwise_or(out, lo, out=out)
    return out
