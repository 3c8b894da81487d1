"""``collate_packed``: windows of a ``PackedDataset`` -> the inputs of flash-attention's varlen
kernels (tokens, positions, document ids, labels, ``cu_seqlens``, ``max_seqlen``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from guideloom_pipes.batch import Batch, batch_arrays
from guideloom_pipes.packing import FIELDS, PackedSample, known_sequences

__all__ = ["collate_packed"]

_FIELDS = FIELDS


def _rows_of_one_read(samples: Sequence[Any]) -> tuple[dict[str, np.ndarray], Any] | None:
    """The ``(B, L)`` arrays of ``samples`` and their sequence starts, when they are
    consecutive rows of one ``PackedDataset`` read (batching them then copies nothing)."""
    first = samples[0]
    if type(first) is not PackedSample:
        return None
    batch, row = first.batch, first.row
    for offset, sample in enumerate(samples):
        if (
            type(sample) is not PackedSample
            or sample.batch is not batch
            or sample.row != row + offset
        ):
            return None
    arrays = {name: batch[name][row : row + len(samples)] for name in _FIELDS}
    length = arrays["tokens"].shape[1]
    segments = first.segments
    low, high = np.searchsorted(segments, (row * length, (row + len(samples)) * length))
    return arrays, segments[low:high] - row * length


def _columns_of_one_read(columns: dict[str, Any]) -> dict[str, Any] | None:
    """The batch of ``columns`` when they are the four columns of one ``PackedDataset``
    read, as it made them (planes of its output block, whose bounds and sizes it kept):
    tensors of the columns, and ``cu_seqlens`` and ``max_seqlen`` from the bounds and sizes.
    Else None (the general path checks and stacks them)."""
    position_ids: Any = columns.get("position_ids")
    known = None if position_ids is None else known_sequences(position_ids)
    if known is None or len(columns) != len(_FIELDS) or not len(position_ids):
        return None
    block, shape = position_ids.base, position_ids.shape
    out: dict[str, Any] = {}
    for name in _FIELDS:
        column = columns.get(name)
        if type(column) is not np.ndarray or column.base is not block or column.shape != shape:
            return None  # (a column replaced after the read)
        out[name] = torch.from_numpy(column)
    bounds, sizes = known  # the read's bounds (its starts, then B * L) are cu_seqlens
    out["cu_seqlens"] = torch.from_numpy(bounds.astype(np.int32))
    out["max_seqlen"] = max(sizes.tolist(), default=0)  # (a few: no numpy call)
    return out


def _stack(samples: Any, name: str, stacked: bool) -> np.ndarray:
    """Field ``name`` as a ``(B, L)`` int64 array: a column of ``samples`` (``stacked``: one
    dict of ``(B, L)`` arrays), else the samples' arrays stacked."""
    if stacked:
        column = samples[name]
        if type(column) is np.ndarray and column.dtype == np.int64 and column.ndim == 2:
            return column  # a column of a PackedDataset's Batch: taken as it is
        array = column.numpy() if isinstance(column, torch.Tensor) else np.asarray(column)
    else:
        array = np.stack([np.asarray(sample[name]) for sample in samples])
    if array.ndim != 2:
        raise ValueError(
            f"collate_packed needs windows of one length: {name!r} stacks to shape "
            f"{array.shape}, not (batch, sequence_length); pass samples of a PackedDataset"
        )
    return array.astype(np.int64, copy=False)


@batch_arrays
def collate_packed(samples: Sequence[Mapping[str, Any]] | Mapping[str, Any] | Batch) -> Any:
    """Batch the windows of a :class:`~guideloom_pipes.PackedDataset` for varlen attention.

    Args:
        samples: A list of samples (dicts with ``tokens``, ``position_ids``,
            ``document_ids`` and ``labels``, each of shape ``(L,)``), or one dict of those
            fields already stacked to ``(B, L)``, or a :class:`~guideloom_pipes.batch.Batch`
            of them.

    Returns:
        A dict: ``tokens``, ``position_ids``, ``document_ids``, ``labels`` as ``(B, L)``
        int64 tensors; ``cu_seqlens``, a 1-D int32 tensor of the sequence boundaries over the
        flattened ``B * L`` tokens (0, every document start and every window start, then
        ``B * L``), and ``max_seqlen``, the longest sequence as a Python int. An empty rank
        batch (``drop_last=False``) stays ``[]``. The columns of a ``PackedDataset`` read's
        ``Batch`` (what the loader's workers hand over), and consecutive samples of one read,
        are batched without a copy (the tensors share memory with that read's arrays) and
        their ``cu_seqlens`` come from the starts the read found.

    Raises:
        KeyError: A sample lacks one of the four fields.
        ValueError: The samples have different lengths.
    """
    if type(samples) is Batch:  # the loader's path: checked without the ABCs' costs
        columns = samples.columns
        if columns is not None:
            read = _columns_of_one_read(columns)
            if read is not None:
                return read
        if len(samples) == 0:
            return []
        samples = columns if columns is not None else samples.samples()
    elif not isinstance(samples, Mapping) and len(samples) == 0:
        return []
    stacked = type(samples) is dict or isinstance(samples, Mapping)
    found = None if stacked else _rows_of_one_read(samples)  # type: ignore[arg-type]
    if found is not None:
        arrays, starts = found
    else:
        arrays = {name: _stack(samples, name, stacked) for name in _FIELDS}
        read = _columns_of_one_read(arrays)  # a PackedDataset read's columns
        if read is not None:
            return read
        starts = (arrays["position_ids"].reshape(-1) == 0).nonzero()[0]
    size = arrays["tokens"].size
    cu_seqlens = np.empty(len(starts) + 1, dtype=np.int32)
    cu_seqlens[:-1] = starts
    cu_seqlens[-1] = size
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if size else 0
    out: dict[str, Any] = {name: torch.from_numpy(array) for name, array in arrays.items()}
    out["cu_seqlens"] = torch.from_numpy(cu_seqlens)
    out["max_seqlen"] = max_seqlen
    return out


# (see guideloom_pipes.batch.draws_no_random)
collate_packed.draws_random = False  # type: ignore[attr-defined]
