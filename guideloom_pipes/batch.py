"""``Batch``: one local batch as arrays (one ``(B, ...)`` array per field), the way a batch
travels from a dataset reader to our collates without a dict per sample.

A dataset reader's ``read_arrays(ids)`` returns a :class:`Batch` for the built-in formats:
windows of a ``StreamNumpyFormat`` stream as *columns* (one contiguous ``(B, L)`` array per
field, each token copied once out of the shard mapping), documents as *rows* (the decoded
documents, whose ``lengths`` the padding collate reads first). Our collates
(``default_collate``, ``pad_collate``, ``collate_packed``) and any callable marked with
:func:`batch_arrays` take it as it is; every other ``collate_fn`` gets
:meth:`Batch.samples`, the list of sample dicts GuideLoom hands over. numpy only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "Batch",
    "LazyRows",
    "accepts_batch_arrays",
    "batch_arrays",
    "draws_no_random",
    "keeps_no_arrays",
    "one_column_collate",
]

_F = TypeVar("_F", bound=Callable[..., Any])


class Batch:
    """A batch of samples held as arrays.

    Exactly one of ``columns`` and ``rows`` is given.

    Args:
        columns: field -> array whose first axis is the batch (``(B, L)`` for windows). The
            arrays must own their memory (or share it only with this batch), never a
            storage's; sample ``i`` is ``{field: column[i]}``.
        rows: the samples themselves (e.g. decoded documents), when they are not arrays of
            one shape.

    ``len(batch)`` is the number of samples; ``batch[i]`` is sample ``i``, ``batch[a:b]`` a
    :class:`Batch` of those samples (sharing the arrays), and iterating yields the samples.
    It pickles as its arrays, so a process worker sends one buffer per field.
    """

    __slots__ = ("columns", "rows")

    columns: dict[str, np.ndarray] | None
    rows: list[Any] | None

    def __init__(
        self,
        columns: Mapping[str, np.ndarray] | None = None,
        rows: Sequence[Any] | None = None,
    ) -> None:
        if (columns is None) == (rows is None):
            raise ValueError("Batch needs exactly one of columns= (field -> array) and rows=")
        if columns is not None:
            columns = dict(columns)
            if not columns:
                raise ValueError("Batch(columns=...) needs at least one field")
            sizes = {name: len(column) for name, column in columns.items()}
            if len(set(sizes.values())) != 1:
                raise ValueError(
                    f"Batch columns must have one length along the batch axis, got {sizes}"
                )
        self.columns = columns
        self.rows = list(rows) if rows is not None else None

    @classmethod
    def of_columns(cls, columns: dict[str, np.ndarray]) -> Batch:
        """A batch of ``columns`` that the caller made with one length (not checked again:
        the readers' path, once per batch)."""
        batch = cls.__new__(cls)
        batch.columns, batch.rows = columns, None
        return batch

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """The samples of ``batches`` one after the other (columns of equal fields)."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        if len(batches) == 1:
            return batches[0]
        first = batches[0]
        if first.columns is None:
            return cls(rows=[sample for batch in batches for sample in batch.samples()])
        names = list(first.columns)
        for batch in batches:
            if batch.columns is None or list(batch.columns) != names:
                raise ValueError("Batch.concat needs batches with the same columns")
        return cls(
            {
                name: np.concatenate([b.columns[name] for b in batches])  # type: ignore[index]
                for name in names
            }
        )

    @property
    def fields(self) -> tuple[str, ...]:
        """The column names (empty for a batch of rows)."""
        return tuple(self.columns) if self.columns is not None else ()

    @property
    def lengths(self) -> np.ndarray:
        """Each sample's length (int64): its first column's second axis, else ``len(row)``."""
        if self.columns is not None:
            column = next(iter(self.columns.values()))
            size = column.shape[1] if column.ndim > 1 else 1
            return np.full(len(column), size, dtype=np.int64)
        assert self.rows is not None
        return np.fromiter((len(row) for row in self.rows), dtype=np.int64, count=len(self.rows))

    def __len__(self) -> int:
        if self.columns is not None:
            return len(next(iter(self.columns.values())))
        assert self.rows is not None
        return len(self.rows)

    def samples(self) -> list[Any]:
        """The samples as a list: ``{field: column[i]}`` each (views of the columns), or the
        rows. What a ``collate_fn`` that does not take arrays receives."""
        if self.rows is not None:
            return list(self.rows)
        assert self.columns is not None
        items = list(self.columns.items())
        return [{name: column[i] for name, column in items} for i in range(len(self))]

    def take(self, order: np.ndarray) -> Batch:
        """The samples at ``order`` (int positions in this batch), in that order."""
        if self.rows is not None:
            return Batch(rows=[self.rows[i] for i in np.asarray(order).tolist()])
        assert self.columns is not None
        return Batch({name: column[order] for name, column in self.columns.items()})

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            if self.rows is not None:
                return Batch(rows=self.rows[index])
            assert self.columns is not None
            return Batch.of_columns({name: column[index] for name, column in self.columns.items()})
        if self.rows is not None:
            return self.rows[index]
        assert self.columns is not None
        return {name: column[index] for name, column in self.columns.items()}

    def __iter__(self) -> Iterator[Any]:
        return iter(self.samples())

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.columns, self.rows))

    def __repr__(self) -> str:
        if self.columns is not None:
            shapes = ", ".join(
                f"{name}: {column.dtype}{list(column.shape)}"
                for name, column in self.columns.items()
            )
            return f"Batch({{{shapes}}})"
        return f"Batch(rows of {len(self)})"


class LazyRows:
    """The samples of one read, made a slice at a time: ``rows[a:b]`` decodes samples
    ``a .. b - 1`` and returns them as a list.

    A reader returns it (``read_rows``) where its read splits into work shared by the whole
    read, done at once, and a per-sample part whose objects (sample dicts, ``memoryview``
    payloads) the garbage collector tracks: a loader that reads a chunk of batches with one
    read then makes each batch's samples only when the batch is collated, so only the
    batches being delivered hold tracked objects. Each slice decodes again (nothing is
    kept). It pickles as its samples.

    Args:
        length: the number of samples.
        decode: ``(begin, end) -> list`` of samples ``begin .. end - 1``.
    """

    __slots__ = ("_decode", "_length")

    def __init__(self, length: int, decode: Callable[[int, int], list[Any]]) -> None:
        self._length = length
        self._decode = decode

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            begin, end, step = index.indices(self._length)
            if step != 1:
                raise ValueError(f"LazyRows slices go one row at a time, got step {step}")
            return self._decode(begin, max(begin, end))
        position = range(self._length)[index]  # an IndexError names the range
        return self._decode(position, position + 1)[0]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._decode(0, self._length))

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (self._decode(0, self._length),))

    def __repr__(self) -> str:
        return f"LazyRows(of {self._length})"


def _rebuild(columns: dict[str, np.ndarray] | None, rows: list[Any] | None) -> Batch:
    batch = Batch.__new__(Batch)
    batch.columns, batch.rows = columns, rows
    return batch


def batch_arrays(fn: _F) -> _F:
    """Mark ``fn`` (a collate) as taking a :class:`Batch` as well as a list of samples.

    The loader then hands it the arrays its reader produced (it sets the attribute
    ``accepts_batch_arrays = True``, which a class may also define).
    """
    fn.accepts_batch_arrays = True  # type: ignore[attr-defined]
    return fn


def accepts_batch_arrays(fn: Any) -> bool:
    """Whether ``fn`` takes a :class:`Batch` (``accepts_batch_arrays = True`` on it, or on
    the function a ``functools.partial`` wraps)."""
    if fn is None:
        return False
    if getattr(fn, "accepts_batch_arrays", False) is True:
        return True
    inner = getattr(fn, "func", None)  # functools.partial(pad_collate, pad_value=...)
    return inner is not None and getattr(inner, "accepts_batch_arrays", False) is True


def one_column_collate(
    fn: Any, name: str, dtype: np.dtype[Any]
) -> Callable[[np.ndarray], Any] | None:
    """The form ``fn`` (a collate) declares for batches that are one column: its
    ``one_column(name, dtype)`` attribute gives ``column -> batch``, what ``fn`` returns for
    ``Batch({name: column})`` (a column of at least one row), or None where it has none for
    that dtype. A reader that can read such a batch's column alone (see
    ``guideloom_pipes.datasets.BatchReads``) then makes no :class:`Batch` for it. None where
    ``fn`` declares no such form."""
    make = getattr(fn, "one_column", None)
    return make(name, dtype) if callable(make) else None


def draws_no_random(fn: Any) -> bool:
    """Whether ``fn`` (a collate) declares that its calls draw no random numbers
    (``draws_random = False`` on it, as on ours): batches it collates from our readers then
    need no seed."""
    return getattr(fn, "draws_random", True) is False


def keeps_no_arrays(fn: Any) -> bool:
    """Whether ``fn`` (a collate) declares ``keeps_no_arrays = True``: of the arrays it is
    given it keeps only what the batch it returns holds (its tensors may view them), so the
    buffers they were read into can be reused once that batch is copied to the device (a
    loader's pinned ring). A collate that could keep or hand on the arrays does not."""
    return getattr(fn, "keeps_no_arrays", False) is True


def int64_list(value: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    """A list of Python ints (a document's token ids, as pickled documents hold them) as
    the int64 array ``np.asarray`` makes of it, packed by ``struct`` straight into a new
    array: no pass to find the dtype, about 1.8x faster than ``array.array`` and 2-3x
    ``np.asarray``. None for anything else (an empty list, a first element that is not an
    ``int``, floats, ints beyond int64), which the caller then converts with ``np.asarray``
    as always. A list that starts with an ``int`` and holds only integers (``bool``, numpy
    integers) is int64 for numpy too, with one exception: numpy makes a list holding a
    ``np.uint64`` float64; here it is int64, the same values (any past int64 go to numpy)."""
    if not value or type(value[0]) is not int:
        return None
    out = np.empty(len(value), dtype=np.int64)
    try:
        # (numpy arrays are buffers; the stubs say so only for Python 3.12+)
        struct.pack_into(f"={len(value)}q", out, 0, *value)  # type: ignore[arg-type]
    except (struct.error, TypeError, OverflowError):
        return None
    return out


def token_array(value: Any) -> np.ndarray:
    """``np.asarray(value)``, quicker for a list of Python ints (see :func:`int64_list`)."""
    if isinstance(value, (list, tuple)):
        ints = int64_list(value)
        if ints is not None:
            return ints
    return np.asarray(value)
