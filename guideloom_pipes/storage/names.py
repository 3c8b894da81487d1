"""Shard file names: the suffix of each file kind, the 7-digit name stem of shard ``k``, and the
pattern that recognises shard files (temporaries included) in a directory listing."""

from __future__ import annotations

import os
import re
from pathlib import PurePath
from typing import Any

import numpy as np

IN_BAND = ".in_band.bin"
OUT_OF_BAND = ".out_of_band.bin"
INDEX = ".out_of_band.index"
RECORD = ".shard.json"
TMP = ".tmp"
PENDING = ".pending"

#: Names of shard files: the id as ``shard_name`` writes it (7 digits, or more without a
#: leading zero past 9,999,999), a known suffix, and ``.tmp``/``.pending`` for temporaries.
_NAME = re.compile(
    r"^(\d{7}|[1-9]\d{7,})"
    r"(\.in_band\.bin|\.out_of_band\.bin|\.out_of_band\.index|\.shard\.json)"
    r"(\.tmp|\.pending)?$"
)


def shard_name(shard: int) -> str:
    """The file-name stem of shard ``shard``: its id zero-padded to 7 digits."""
    return f"{shard:07d}"


def check_shard_id(shard: Any) -> int:
    """``shard`` as a non-negative ``int``, or a clear ``TypeError``/``ValueError``."""
    if isinstance(shard, bool) or not isinstance(shard, (int, np.integer)):
        raise TypeError(f"shard id must be an int, got {shard!r} ({type(shard).__name__})")
    shard = int(shard)
    if shard < 0:
        raise ValueError(f"shard id must be >= 0, got {shard}")
    return shard


def _display(directory: PurePath) -> str:
    return os.fspath(directory)
