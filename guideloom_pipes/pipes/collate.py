"""Batching and collation: a list of samples -> one batch (``default_collate``, and
``pad_collate`` for documents of different lengths)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate as _torch_collate
from torch.utils.data._utils.collate import collate_numpy_array_fn as _torch_collate_numpy_array_fn
from torch.utils.data._utils.collate import collate_tensor_fn as _torch_collate_tensor_fn
from torch.utils.data._utils.collate import default_collate_fn_map
from torchdata.nodes import BaseNode

from guideloom_pipes.batch import Batch, batch_arrays, token_array
from guideloom_pipes.pipes.errors import mark_batch_failure
from guideloom_pipes.pipes.seeding import Seeding, seeded

__all__ = ["Collate", "default_collate", "pad_collate"]


def _stack_tensors(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    """torch's tensor collate without its shared-memory output: torch allocates that when
    its ``get_worker_info()`` is set, as it is in our worker processes (for torch's pipe
    from its own worker processes); ours hand results back through their result ring, and
    worker threads need none."""
    elem = batch[0]
    if elem.is_nested or elem.layout != torch.strided:  # torch's errors for these
        return _torch_collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    return torch.stack(list(batch), 0)


def _stack_arrays(batch: Sequence[np.ndarray], *, collate_fn_map: Any = None) -> torch.Tensor:
    """torch's numpy-array collate (each array made a tensor, then stacked) in one
    ``np.stack`` whose result the tensor shares: the same tensor, in a third of the time for
    a batch of token windows. Arrays that are not all of one shape and one numeric dtype in
    the machine's byte order go through torch's function (its tensors, or its errors)."""
    elem = batch[0]
    dtype, shape = elem.dtype, elem.shape
    if dtype.kind in "biufc" and dtype.isnative:
        for array in batch:
            if type(array) is not np.ndarray or array.dtype != dtype or array.shape != shape:
                break
        else:
            return torch.from_numpy(np.stack(batch))
    return _torch_collate_numpy_array_fn(batch, collate_fn_map=collate_fn_map)


#: torch's collate rules, tensors stacked into ordinary memory (see :func:`_stack_tensors`),
#: numpy arrays stacked by numpy (see :func:`_stack_arrays`).
_COLLATE_FN_MAP: dict[type | tuple[type, ...], Callable[..., Any]] = {
    **default_collate_fn_map,
    torch.Tensor: _stack_tensors,
    np.ndarray: _stack_arrays,
}


@batch_arrays
def default_collate(samples: Sequence[Any] | Batch) -> Any:
    """torch's ``default_collate``, except that an empty rank batch stays ``[]``.

    With ``drop_last=False`` and several ranks a rank's last batch can be empty (SPEC §5);
    torch's function cannot stack nothing, so that batch is delivered as ``[]``.

    Args:
        samples: The samples of one local batch, or a :class:`~guideloom_pipes.batch.Batch`
            of them: its columns become the tensors (``torch.from_numpy``, no copy), the
            same dict of ``(B, ...)`` tensors torch's function stacks from the samples.
    """
    if type(samples) is Batch:
        columns = samples.columns
        if columns is not None:
            tensors = {}
            for name, column in columns.items():
                if not len(column):
                    return []
                # a tensor sharing the column's memory; a column torch.from_numpy refuses
                # (strings, another byte order) goes through torch's function, row by row,
                # which then does what it does with such samples
                try:
                    tensors[name] = torch.from_numpy(column)
                except (TypeError, ValueError):
                    tensors[name] = _torch_collate(list(column), collate_fn_map=_COLLATE_FN_MAP)
            return tensors
        samples = samples.samples()
    if len(samples) == 0:
        return []
    samples = samples if isinstance(samples, list) else list(samples)
    return _torch_collate(samples, collate_fn_map=_COLLATE_FN_MAP)


def _one_column(name: str, dtype: np.dtype[Any]) -> Callable[[np.ndarray], Any] | None:
    """:func:`default_collate`'s form for batches of one column ``name`` of ``dtype`` (see
    :func:`~guideloom_pipes.batch.one_column_collate`): the column's tensor in a dict, as
    ``default_collate(Batch({name: column}))`` makes it. None for a dtype that torch cannot
    share (``default_collate`` goes row by row there)."""
    from_numpy = torch.from_numpy
    try:
        from_numpy(np.empty(0, dtype))
    except (TypeError, ValueError):
        return None

    def collate(column: np.ndarray) -> dict[str, torch.Tensor]:
        return {name: from_numpy(column)}

    return collate


default_collate.one_column = _one_column  # type: ignore[attr-defined]
# (see guideloom_pipes.batch: draws_no_random, keeps_no_arrays)
default_collate.draws_random = False  # type: ignore[attr-defined]
default_collate.keeps_no_arrays = True  # type: ignore[attr-defined]


def _as_sequence(value: Any) -> np.ndarray | None:
    """``value`` as a 1-D numeric array if it is one (array, tensor, list of numbers)."""
    if isinstance(value, torch.Tensor):
        value = value.numpy()
    elif isinstance(value, (list, tuple)):
        try:  # one conversion; what is not a flat list of numbers has another dtype or shape
            value = token_array(value)
        except (ValueError, TypeError):
            return None
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "biuf":
        return value
    return None


def _mask(lengths: np.ndarray, width: int, left: bool) -> np.ndarray:
    """The ``(B, width)`` mask of real tokens, for all rows at once."""
    steps = np.arange(width, dtype=np.int64)
    if left:
        return steps >= (width - lengths)[:, None]
    return steps < lengths[:, None]


def _pad(
    name: str, columns: list[np.ndarray], lengths: np.ndarray, width: int, value: Any, left: bool
) -> torch.Tensor:
    """``columns`` (cut to ``lengths``) padded to ``width`` with ``value``: one ``(B,
    width)`` buffer, one copy per document."""
    dtype = np.result_type(*[c.dtype for c in columns])
    try:
        fill = np.array(value).astype(dtype, casting="same_kind")
    except TypeError:
        raise ValueError(
            f"pad_collate: pad value {value!r} does not fit field {name!r} of dtype {dtype}"
        ) from None
    out = np.full((len(columns), width), fill, dtype=dtype)
    for row, (column, n) in enumerate(zip(columns, lengths.tolist())):
        if left:
            out[row, width - n :] = column[:n]
        else:
            out[row, :n] = column[:n]
    return torch.from_numpy(out)


def _rows_of(samples: Iterable[Any]) -> list[Mapping[str, Any]]:
    """:func:`pad_collate`'s samples as dicts (a bare array is ``{"tokens": array}``), all
    with the fields of sample 0, in its order."""
    rows = [s if isinstance(s, Mapping) else {"tokens": s} for s in samples]
    names = list(rows[0])
    for index, row in enumerate(rows):
        if list(row) != names:
            raise ValueError(
                f"pad_collate: sample {index} has fields {list(row)}, sample 0 has {names}"
            )
    return rows


def _fields_of(
    rows: list[Mapping[str, Any]],
) -> tuple[dict[str, list[np.ndarray]], dict[str, list[Any]]]:
    """The fields of ``rows`` split into the sequence fields (a 1-D numeric array in every
    row: the arrays, padded) and the others (their values)."""
    names = list(rows[0])
    sequences: dict[str, list[np.ndarray]] = {}
    others: dict[str, list[Any]] = {}
    for name in names:
        found = [_as_sequence(row[name]) for row in rows]
        arrays = [array for array in found if array is not None]
        if len(arrays) == len(rows):
            sequences[name] = arrays
        else:
            others[name] = [row[name] for row in rows]
    if not sequences:
        raise ValueError(
            f"pad_collate needs token arrays: no field of the samples is a 1-D numeric array "
            f"(fields: {names})"
        )
    return sequences, others


def _lengths_of(sequences: dict[str, list[np.ndarray]]) -> np.ndarray:
    """Each sample's length (int64), which all its sequence fields must share."""
    lengths = np.array([len(c) for c in next(iter(sequences.values()))], dtype=np.int64)
    for name, columns in sequences.items():
        sizes = np.array([len(c) for c in columns])
        if (sizes != lengths).any():
            bad = int(np.flatnonzero(sizes != lengths)[0])
            raise ValueError(
                f"pad_collate: sample {bad}'s field {name!r} has {sizes[bad]} elements but its "
                f"other sequence fields have {lengths[bad]}; fields padded together need one length"
            )
    return lengths


def _other_field(column: list[Any]) -> Any:
    """A field that is not a sequence: numbers as a ``(B,)`` tensor, else the list."""
    if all(
        isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
        for v in column
    ):
        return torch.as_tensor(np.asarray(column))
    return column


@batch_arrays
def pad_collate(
    samples: Sequence[Any] | Batch,
    *,
    pad_value: Any = 0,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
    padding_side: str = "right",
) -> Any:
    """Batch documents of token arrays of different lengths: pad them to one length.

    Each sample is a 1-D array of tokens (a numpy array, a tensor or a list of ints), or a
    dict of fields: every field that is a 1-D numeric array is padded (all of a sample's
    sequence fields must have one length); number fields become a ``(B,)`` tensor, other
    values a list.

    Args:
        samples: one local batch (what a ``DocumentDataset`` of token arrays yields), a
            list or a :class:`~guideloom_pipes.batch.Batch` of its samples.
        pad_value: the value of the padding; a dict ``{field: value}`` gives each field its
            own (e.g. ``{"tokens": 0, "labels": -100}``; fields not in it get 0).
        max_length: truncate longer documents to this many tokens.
        pad_to_multiple_of: round the padded length up to a multiple of this (tensor cores
            like multiples of 8).
        padding_side: ``"right"`` (default) or ``"left"`` (for generation).

    Returns:
        A dict: each sequence field as a ``(B, T)`` tensor (``tokens`` for samples that are
        bare arrays), ``attention_mask`` (``(B, T)`` bool, True on real tokens) and
        ``lengths`` (``(B,)`` int64, tokens per document before padding, after
        truncation). ``T`` is the longest document's length (after truncation, rounded up).
        An empty rank batch (``drop_last=False``) stays ``[]``.

    Raises:
        ValueError: a sample has no sequence field, its sequence fields differ in length,
            samples have different fields, or a pad value does not fit a field's dtype.
    """
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    if len(samples) == 0:
        return []
    if type(samples) is Batch:
        samples = samples.samples()
    sequences, others = _fields_of(_rows_of(samples))
    lengths = _lengths_of(sequences)
    if max_length is not None:
        lengths = np.minimum(lengths, max_length)
    width = int(lengths.max()) if len(lengths) else 0
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    values = pad_value if isinstance(pad_value, Mapping) else {}
    out: dict[str, Any] = {}
    left = padding_side == "left"
    for name, columns in sequences.items():
        value = values.get(name, 0) if isinstance(pad_value, Mapping) else pad_value
        out[name] = _pad(name, columns, lengths, width, value, left)
    out["attention_mask"] = torch.from_numpy(_mask(lengths, width, left))
    out["lengths"] = torch.from_numpy(lengths)
    for name, column in others.items():
        out[name] = _other_field(column)
    return out


pad_collate.draws_random = False  # type: ignore[attr-defined]


class Collate(BaseNode[Any]):
    """Applies ``collate_fn`` to each list of samples from ``source``, in the calling thread.

    ``collate_fn`` receives every batch, an empty one (``[]``) included: GuideLoom hands a
    rank's empty final batch to the collator too. To collate inside read workers instead,
    pass ``collate_fn`` to :class:`~guideloom_pipes.pipes.ReadSamples`. An exception of
    ``collate_fn`` fails its batch alone: the next ``next()`` collates the next batch.

    Args:
        source: Emits lists of samples (e.g. :class:`~guideloom_pipes.pipes.ReadSamples`).
        collate_fn: samples -> batch; ``None`` uses :func:`default_collate`.
        batch_seeds: The seed of the ``k``-th batch since ``reset()``; when given, each
            batch is collated under its seed (``guideloom_pipes.pipes.seeding.seeded``),
            so a ``collate_fn`` that draws random numbers repeats its draws on resume.
        seeding: How the seed reaches the generators (see ``seeded``): ``"globals"`` also
            seeds the global ones, ``"local"`` (another thread collates) only ``batch_rng()``.
    """

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode[Any],
        collate_fn: Callable[[Any], Any] | None = None,
        *,
        batch_seeds: Callable[[int], int] | None = None,
        seeding: Seeding = "globals",
    ):
        super().__init__()
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        self.source = source
        self.collate_fn: Callable[[Any], Any] = collate_fn or default_collate
        self.batch_seeds = batch_seeds
        self.seeding: Seeding = seeding
        self._count = 0  # batches since reset(), for batch_seeds

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._count = 0
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
        else:
            self.source.reset()

    def next(self) -> Any:
        samples = next(self.source)
        seeds = self.batch_seeds
        if seeds is None:
            try:
                return self.collate_fn(samples)
            except Exception as error:
                mark_batch_failure(error)  # this batch alone: the next one follows
                raise
        seed = seeds(self._count)
        self._count += 1
        try:
            with seeded(seed, self.seeding):
                return self.collate_fn(samples)
        except Exception as error:
            mark_batch_failure(error)
            raise

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}
