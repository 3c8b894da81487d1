"""Collates for the tests of batches as arrays (numpy only: process workers unpickle them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from guideloom_pipes.batch import Batch


def describe(batch: Any) -> dict[str, Any]:
    """What a collate got: its type, and its samples as plain lists (picklable, comparable)."""
    samples = batch.samples() if type(batch) is Batch else batch
    return {"type": type(batch).__name__, "samples": [plain(sample) for sample in samples]}


def plain(value: Any) -> Any:
    """``value`` with numpy arrays as ``(dtype, list)`` and mappings as sorted item lists."""
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.tolist())
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, memoryview):
        return bytes(value)
    return value


def list_collate(samples: Any) -> dict[str, Any]:
    """A user's collate: says what it got (GuideLoom hands it a list of sample dicts)."""
    return describe(samples)


class ArrayCollate:
    """A user's collate that opts in to arrays (``accepts_batch_arrays = True``)."""

    accepts_batch_arrays = True

    def __call__(self, samples: Any) -> dict[str, Any]:
        return describe(samples)
