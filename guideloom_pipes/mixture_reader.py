"""``MixtureReader``, the reader of a :class:`~guideloom_pipes.mixture.MixtureDataset`: a
batch of positions routed to the components, each component's share read with one call, the
samples put back in order (as one ``Batch`` of columns when the shares allow), and the check
that every component's samples have the mixture's dtypes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.batch import Batch
from guideloom_pipes.mixture_schedule import _PassPermutations
from guideloom_pipes.reader_base import (
    DatasetReaderBase,
    batch_read_fn,
    open_reader,
    reader_fingerprint,
)

if TYPE_CHECKING:
    from guideloom_pipes.mixture import MixtureDataset

__all__ = ["MixtureReader"]

_I64 = npt.NDArray[np.int64]


class MixtureReader(DatasetReaderBase):
    """Reader of a :class:`MixtureDataset`: opens a reader of every component.

    ``read_batch(ids)`` routes the ids (vectorised), reads each component's share with one
    call of that component's reader (its ``read_batch`` when it has one), and returns the
    samples in the order of ``ids``. Thread-safe when the components' readers are.
    """

    def __init__(self, dataset: MixtureDataset) -> None:
        super().__init__(None)
        self.dataset = dataset
        self._readers: list[tuple[Any, bool]] = []
        self._reads: list[Callable[[_I64], list[Any]]] = []
        self._array_reads: list[Callable[[_I64], Any]] = []
        self._passes = _PassPermutations(dataset)

    def open(self) -> None:
        """Open every component's reader and check its length is the one the mixture knows."""
        if self._length >= 0:
            return
        dataset = self.dataset
        opened: list[tuple[Any, bool]] = []
        try:
            for c, name in enumerate(dataset.names):
                reader, own = open_reader(dataset.components[name])
                opened.append((reader, own))
                now = len(reader)
                if now != dataset.lengths[c]:
                    raise ValueError(
                        f"component {name!r} has {now} samples now, {dataset.lengths[c]} when "
                        f"this MixtureDataset was built: its passes would refer to other "
                        f"samples. Build the MixtureDataset again (docs/mixtures.md, 'When a "
                        f"component changes size')"
                    )
        except BaseException:
            for reader, own in opened:
                if own:
                    reader.close()
            raise
        self._readers = opened
        self._reads = [batch_read_fn(reader) for reader, _ in opened]
        self._array_reads = [batch_read_fn(reader, arrays=True) for reader, _ in opened]
        self._length = dataset.num_samples

    def fingerprint(self) -> dict[str, Any] | None:
        """Each component's fingerprint by name (``None`` if one cannot tell)."""
        self._check_open()
        parts = [reader_fingerprint(reader) for reader, _ in self._readers]
        if any(part is None for part in parts):
            return None
        return {"components": dict(zip(self.dataset.names, parts))}

    def close(self) -> None:
        """Close the component readers this reader opened."""
        readers, self._readers, self._reads = self._readers, [], []
        self._array_reads = []
        for reader, own in readers:
            if own:
                reader.close()
        self._length = -1

    def _compute_length(self) -> int:
        return self.dataset.num_samples

    def read_batch(self, ids: Sequence[int] | np.ndarray) -> list[Any]:
        """The samples at ``ids`` (positions of the mixture), in that order.

        Args:
            ids: An integer array or sequence of positions in ``[0, len)``; one out of range
                raises ``IndexError`` naming it.
        """
        return self._read(ids, arrays=False)

    def read_arrays(self, ids: Sequence[int] | np.ndarray) -> Batch | list[Any]:
        """The samples at ``ids`` as a :class:`~guideloom_pipes.batch.Batch` when every
        component's share comes as one (with the same columns: their rows gathered back
        into the order of ``ids``), else as :meth:`read_batch`'s list."""
        return self._read(ids, arrays=True)

    def _read(self, ids: Sequence[int] | np.ndarray, arrays: bool) -> Any:
        self._check_open()
        dataset = self.dataset
        positions = dataset._check_ids(ids)
        component, draw = dataset._routing.route(positions)
        indexes = dataset._sample_indexes(component, draw, self._passes)
        reads = self._array_reads if arrays else self._reads
        if len(dataset.names) == 1:
            found = reads[0](indexes)
            self._check_dtypes(found, 0, indexes)
            return found if type(found) is Batch else list(found)
        # group the rows by component (one read each), then put the samples back in order
        order = np.argsort(component, kind="stable")
        ends = np.cumsum(np.bincount(component, minlength=len(self._reads))).tolist()
        parts: list[Any] = []
        slots: list[_I64] = []
        start = 0
        for c, end in enumerate(ends):
            if end > start:
                drawn = indexes[order[start:end]]
                parts.append(reads[c](drawn))
                self._check_dtypes(parts[-1], c, drawn)
                slots.append(order[start:end])
            start = end
        if arrays and _same_columns(parts) and sum(map(len, parts)) == len(positions):
            # each component's rows copied once, straight to their places in the batch
            columns = {}
            for name, column in parts[0].columns.items():
                out = np.empty((len(positions), *column.shape[1:]), dtype=column.dtype)
                for part, slot in zip(parts, slots):
                    out[slot] = part.columns[name]
                columns[name] = out
            return Batch.of_columns(columns)
        where = np.empty_like(order)
        where[order] = np.arange(len(order))
        grouped: list[Any] = []
        for part in parts:
            grouped += part.samples() if type(part) is Batch else part
        if len(grouped) != len(positions):
            raise RuntimeError(
                f"a component's reader returned {len(grouped)} samples for {len(positions)} ids"
            )
        return list(map(grouped.__getitem__, where.tolist()))

    def _check_dtypes(self, part: Any, component: int, indexes: _I64) -> None:
        """Refuse a component's samples (at ``indexes``) whose arrays have another dtype than
        the mixture's first sample: a batch of both would be promoted to a third dtype.
        One dtype comparison per array field of each sample (per column for columns)."""
        expected = self.dataset._dtypes
        if not expected:
            return
        if type(part) is Batch and part.columns is not None:
            for field, column in part.columns.items():
                want = expected.get(field)
                if want is not None and column.dtype != want:
                    self._wrong_dtype(component, int(indexes[0]), field, column.dtype, want)
            return
        rows = part.rows if type(part) is Batch else part
        assert rows is not None
        for field, want in expected.items():
            try:  # the quick way: samples of the first one's kind
                if field == _SAMPLE:
                    same = all([sample.dtype == want for sample in rows])
                else:
                    same = all([sample[field].dtype == want for sample in rows])
            except (AttributeError, KeyError, IndexError, TypeError):
                same = False
            if not same:
                self._find_wrong_dtype(rows, component, indexes, field, want)

    def _find_wrong_dtype(
        self, rows: Sequence[Any], component: int, indexes: _I64, field: str, want: Any
    ) -> None:
        """Raise for the first of ``rows`` whose ``field`` is not an array of ``want``."""
        for k, sample in enumerate(rows):
            if field == _SAMPLE:
                value = sample
            elif isinstance(sample, Mapping):
                value = sample.get(field)
            else:
                continue  # (its fields were checked once; a sample of another kind fails later)
            if getattr(value, "dtype", None) != want:
                self._wrong_dtype(component, int(indexes[k]), field, value, want)

    def _wrong_dtype(
        self, component: int, index: int, field: str, got: Any, want: np.dtype[Any]
    ) -> None:
        dataset = self.dataset
        if not isinstance(got, np.dtype):
            dtype = getattr(got, "dtype", None)
            got = dtype if isinstance(dtype, np.dtype) else f"none ({type(got).__name__})"
        what = "the sample" if field == _SAMPLE else f"field {field!r}"
        raise ValueError(
            f"component {dataset.names[component]!r} sample {index}: {what} has dtype {got}, "
            f"the mixture's samples have {want} (sample 0 of {dataset.names[0]!r}); a batch "
            f"of both would silently become another dtype. Write every document of a "
            f"component with one dtype, or cast them in a dataset that wraps the component"
        )


#: The field name of a sample that is one array (``_signature``'s).
_SAMPLE = "(sample)"


def _array_dtypes(sample: Any) -> dict[str, np.dtype[Any]]:
    """The dtype of each array field of ``sample`` (``"(sample)"``: the sample itself)."""
    if isinstance(sample, np.ndarray):
        return {_SAMPLE: sample.dtype}
    if isinstance(sample, Mapping):
        return {str(k): v.dtype for k, v in sample.items() if isinstance(v, np.ndarray)}
    return {}


def _same_columns(parts: list[Any]) -> bool:
    """Whether ``parts`` are all batches of columns with the same names, dtypes and shapes
    past the batch axis (so that they stack)."""
    first = parts[0]
    if type(first) is not Batch or first.columns is None:
        return False
    shape = {name: (c.dtype, c.shape[1:]) for name, c in first.columns.items()}
    return all(
        type(part) is Batch
        and part.columns is not None
        and {name: (c.dtype, c.shape[1:]) for name, c in part.columns.items()} == shape
        for part in parts
    )
