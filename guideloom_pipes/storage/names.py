"""Shard file names: the suffix of each file kind, the 7-digit name stem of shard ``k``, the
versioned names of a replacement being committed, and the pattern that recognises shard files
(temporaries and versioned files included) in a directory listing."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import PurePath
from typing import Any

from guideloom_pipes.checks import check_int

IN_BAND = ".in_band.bin"
OUT_OF_BAND = ".out_of_band.bin"
INDEX = ".out_of_band.index"
RECORD = ".shard.json"
TMP = ".tmp"
PENDING = ".pending"
#: the lock file a ``mode="create"`` run holds in the directory it creates (not a shard
#: file: readers and GuideLoom ignore it; a run that died leaves it unlocked and harmless)
CREATE_LOCK = ".guideloom_pipes-create.lock"

#: Names of shard files: the id as ``shard_name`` writes it (7 digits, or more without a
#: leading zero past 9,999,999), ``.v<generation>`` for a versioned data file (see
#: :func:`versioned_name`), a known suffix, and ``.tmp``/``.pending`` for temporaries.
#: Groups: ``shard`` (also group 1), ``generation``, ``suffix``, ``temporary``.
SHARD_NAME = re.compile(
    r"^(?P<shard>\d{7}|[1-9]\d{7,})"
    r"(?:\.v(?P<generation>0|[1-9]\d*))?"
    r"(?P<suffix>\.in_band\.bin|\.out_of_band\.bin|\.out_of_band\.index|\.shard\.json)"
    r"(?P<temporary>\.tmp|\.pending)?$"
)


def shard_ids(names: Iterable[str]) -> set[int]:
    """The ids of the shards with a file at its canonical name among ``names`` (a data file
    or a record; temporaries and versioned files left out)."""
    found = set()
    for name in names:
        match = SHARD_NAME.match(name)
        if match and not match.group("temporary") and match.group("generation") is None:
            found.add(int(match.group("shard")))
    return found


def shard_name(shard: int) -> str:
    """The file-name stem of shard ``shard``: its id zero-padded to 7 digits."""
    return f"{shard:07d}"


def versioned_name(shard: int, generation: int, suffix: str) -> str:
    """The name a data file of generation ``generation`` of ``shard`` has between its commit
    and its move to the canonical name, e.g. ``0000003.v2.in_band.bin`` (GuideLoom does not
    read it)."""
    return f"{shard_name(shard)}.v{generation}{suffix}"


def check_shard_id(shard: Any) -> int:
    """``shard`` as a non-negative ``int``, or a clear ``TypeError``/``ValueError``."""
    return check_int("shard id", shard, minimum=0)


def _display(directory: PurePath) -> str:
    return os.fspath(directory)
