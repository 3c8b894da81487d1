"""The base of the dataset readers and how any reader is read: ``DatasetReaderBase`` (the
``len`` / ``[i]`` / slice / iteration / lifecycle every dataset reader shares, and its
``batch_reads``), ``BatchReads`` (how a loader's read task reads one reader's batches, as the
reader chose) with :func:`batch_reads` for any reader, :func:`batch_read_fn` (the plain batch
read of any reader), :func:`open_reader`, :func:`reader_fingerprint` and the ``async``
facade of a reader. The readers of :mod:`guideloom_pipes.datasets` are in
:mod:`guideloom_pipes.dataset_readers`; all of these names are importable from
``guideloom_pipes.datasets`` too.
"""

from __future__ import annotations

import asyncio
import functools
import operator
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import numpy as np

from guideloom_pipes.batch import Batch, LazyRows
from guideloom_pipes.storage.stream_checks import as_indexes
from guideloom_pipes.types import DatasetAsyncReaderAbstract, DatasetSyncReaderAbstract

#: Samples that iterating a reader decodes at a time (one ``read_batch`` each).
_ITER_BATCH = 64
#: ``(shape, dtype) -> empty array``: where a batch read puts its windows (see
#: :meth:`StreamDatasetReader.read_arrays`).
WindowBuffers = Callable[[tuple[int, int], np.dtype[Any]], np.ndarray]


def open_reader(dataset: Any) -> tuple[Any, bool]:
    """Open ``dataset`` for reading; return ``(reader, opened_here)``.

    Datasets with a ``sync_reader()`` factory (ours) get an opened reader that the caller must
    close; any other map-style dataset is its own reader.
    """
    factory = getattr(dataset, "sync_reader", None)
    if callable(factory):
        reader = factory()
        reader.open()
        return reader, True
    return dataset, False


def batch_read_fn(
    reader: Any, arrays: bool = False, out: WindowBuffers | None = None
) -> Callable[[np.ndarray], Any]:
    """The fastest way ``reader`` offers to turn an int64 id array into a list of samples:
    its ``read_batch``, else ``__getitems__``, else ``[i]`` for each id (what a reader
    reading another one, a mixture's component or a packed dataset's source, reads it with).

    With ``arrays=True``, a reader's ``read_arrays`` comes first: it may return a
    :class:`~guideloom_pipes.batch.Batch` instead of the list (for a collate that takes one);
    ``out`` (see :meth:`StreamDatasetReader.read_arrays`) is then passed to it.
    """
    if arrays:
        read_arrays = getattr(reader, "read_arrays", None)
        if callable(read_arrays):
            if out is not None:
                return functools.partial(read_arrays, out=out)
            return read_arrays
    read_batch = getattr(reader, "read_batch", None)
    if callable(read_batch):
        return read_batch
    getitems = getattr(reader, "__getitems__", None)
    if callable(getitems):
        return lambda ids: list(getitems(ids.tolist()))
    getitem = reader.__getitem__
    return lambda ids: [getitem(i) for i in ids.tolist()]


class BatchReads:
    """How a loader's read task reads the batches of one reader, as the reader chose
    (:meth:`DatasetReaderBase.batch_reads`; :func:`batch_reads` for any reader).

    Args:
        read: ``ids -> samples``: a :class:`~guideloom_pipes.batch.Batch` (for a collate
            that takes arrays), :class:`~guideloom_pipes.batch.LazyRows` (samples made a
            slice at a time) or the list of samples.
        read_many: ``[ids, ...] -> [Batch, ...]``: a chunk of batches read and packed
            together, each a :class:`~guideloom_pipes.batch.Batch` of its own (packed
            windows); None where the reader has no such read.
        column: ``(name, dtype, read_column)`` where a batch's :class:`Batch` would be one
            column ``name`` of ``dtype``: ``read_column(ids)`` reads that array alone (None
            for a batch that ``read`` takes: empty, other ids), for a collate that declares
            a form for one column (:func:`~guideloom_pipes.batch.one_column_collate`).
        draws_random: whether a read may draw random numbers (a user's ``__getitem__``):
            each batch that has a seed is then read under it. Our readers' reads draw none.
    """

    __slots__ = ("column", "draws_random", "read", "read_many")

    def __init__(
        self,
        read: Callable[[np.ndarray], Any],
        *,
        read_many: Callable[[list[np.ndarray]], list[Batch]] | None = None,
        column: tuple[str, np.dtype[Any], Callable[[np.ndarray], np.ndarray | None]] | None = None,
        draws_random: bool = False,
    ) -> None:
        self.read = read
        self.read_many = read_many
        self.column = column
        self.draws_random = draws_random


def batch_reads(reader: Any, arrays: bool = False, out: WindowBuffers | None = None) -> BatchReads:
    """How ``reader``'s batches are read, for a collate that takes arrays (``arrays``) or
    not; ``out``: where the arrays' windows go (a loader's pinned ring).

    Our readers choose (:meth:`DatasetReaderBase.batch_reads`). Any other reader is read
    with :func:`batch_read_fn`; one that offers ``read_batch`` (a batch read of its own) is
    taken to draw no random numbers, as ours, any other may (its ``__getitem__``)."""
    if isinstance(reader, DatasetReaderBase):
        return reader.batch_reads(arrays, out)
    return BatchReads(
        batch_read_fn(reader, arrays, out),
        draws_random=not callable(getattr(reader, "read_batch", None)),
    )


def reader_fingerprint(reader: Any) -> dict[str, Any] | None:
    """``reader.fingerprint()`` of an open reader that has one (ours), else ``None``: what a
    loader's checkpoint records so that it is not resumed on another version of the data."""
    fingerprint = getattr(reader, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else None


def _as_ids(ids: Any, length: int) -> np.ndarray:
    return as_indexes(ids, length, "sample ids", functools.partial(_out_of_range, length))


def _out_of_range(length: int, index: int) -> IndexError:
    valid = f"valid: 0..{length - 1}" if length else "it is empty"
    return IndexError(
        f"sample index {index} out of range for a dataset of {length} samples ({valid})"
    )


class DatasetReaderBase(DatasetSyncReaderAbstract[Any]):
    """Shared ``len`` / ``[i]`` / slice / lifecycle of the dataset readers.

    A reader is a ``collections.abc.Sequence``: ``iter``, ``reversed``, ``in``, ``index``
    and ``count`` work as on a list (iteration decodes a batch of samples at a time).
    """

    def __init__(self, storage_reader: Any) -> None:
        self._storage_reader = storage_reader
        self._length = -1

    def open(self) -> None:
        """Open the storage reader (discovers and checks the shards)."""
        self._storage_reader.open()
        self._length = self._compute_length()

    def close(self) -> None:
        """Close the storage reader; samples already returned stay valid."""
        self._storage_reader.close()
        self._length = -1

    def _compute_length(self) -> int:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._length < 0:
            raise RuntimeError(
                f"{type(self).__name__} is not open; call open() or use it in a `with` block"
            )

    def __len__(self) -> int:
        self._check_open()
        return self._length

    @property
    def storage_reader(self) -> Any:
        """The underlying storage reader."""
        return self._storage_reader

    def fingerprint(self) -> dict[str, Any] | None:
        """What identifies the version of the data this reader reads (see
        ``ReaderBase.fingerprint``), or ``None`` if its source cannot tell."""
        self._check_open()
        return reader_fingerprint(self._storage_reader)

    def _resolve(self, index: int | slice) -> int | np.ndarray:
        """Sample ``index`` checked (an ``int``), or a slice's sample ids (an int64 array)."""
        self._check_open()
        if isinstance(index, slice):
            return np.arange(*index.indices(self._length), dtype=np.int64)
        try:
            position = operator.index(index)
        except TypeError:
            raise TypeError(
                f"dataset indices must be integers or slices, got {type(index).__name__}"
            ) from None
        if not 0 <= position < self._length:
            raise _out_of_range(self._length, position)
        return position

    def __getitem__(self, index: int | slice) -> Any:
        """Sample ``index`` (``0 <= index < len``), or a list of samples for a slice."""
        resolved = self._resolve(index)
        if isinstance(resolved, np.ndarray):
            return self.read_batch(resolved)
        return self._read_one(resolved)

    def __iter__(self) -> Iterator[Any]:
        self._check_open()
        start = 0
        while start < len(self):
            stop = min(start + _ITER_BATCH, len(self))
            yield from self.read_batch(np.arange(start, stop, dtype=np.int64))
            start = stop

    def _read_one(self, index: int) -> Any:
        return self.read_batch(np.array([index], dtype=np.int64))[0]

    def read_batch(self, ids: Sequence[int] | np.ndarray) -> list[Any]:
        """The samples at ``ids`` (a numpy array of sample ids), in that order."""
        raise NotImplementedError

    def read_range(self, first: int, count: int) -> list[Any]:
        """Samples ``first .. first + count - 1``: the shard-streaming path, which reads a
        whole shard's samples at once (a stream reads the span in one request per shard)."""
        return self.read_batch(np.arange(first, first + count, dtype=np.int64))

    def read_arrays(self, ids: Sequence[int] | np.ndarray) -> Batch | list[Any]:
        """The samples at ``ids`` as a :class:`~guideloom_pipes.batch.Batch` where this
        reader can make one, else as :meth:`read_batch`'s list (the same samples)."""
        return self.read_batch(ids)

    def read_rows(self, ids: Sequence[int] | np.ndarray) -> LazyRows | list[Any]:
        """The samples at ``ids`` as :class:`~guideloom_pipes.batch.LazyRows` where this
        reader's read has a shared part and a per-sample part (its slices make the
        samples), else as :meth:`read_batch`'s list (the same samples)."""
        return self.read_batch(ids)

    def batch_reads(self, arrays: bool, out: WindowBuffers | None = None) -> BatchReads:
        """How a loader reads this reader's batches: :meth:`read_arrays` for a collate that
        takes arrays (``arrays``; ``out`` passed on), else :meth:`read_rows`. Readers with
        faster ways for some batches add them (one column alone, packed chunks)."""
        if not arrays:
            return BatchReads(self.read_rows)
        read_arrays: Callable[..., Any] = self.read_arrays
        if out is not None:  # (a reader whose read_arrays takes no out raises for each batch)
            return BatchReads(functools.partial(read_arrays, out=out))
        return BatchReads(read_arrays)


class _AsyncDatasetReader(DatasetAsyncReaderAbstract[Any]):
    """``async`` facade of a dataset reader: blocking reads run in a worker thread.

    ``await reader[i]`` and ``await reader[a:b]`` as in GuideLoom (an index out of range
    raises at once, before anything is awaited), ``len(reader)``, and ``read`` /
    ``read_batch``.
    """

    def __init__(self, reader: DatasetReaderBase) -> None:
        self._sync = reader

    async def open(self) -> None:
        """Open the reader."""
        await asyncio.to_thread(self._sync.open)

    async def close(self) -> None:
        """Close the reader."""
        self._sync.close()

    def __len__(self) -> int:
        return len(self._sync)

    def __getitem__(self, index: int | slice) -> Awaitable[Any]:
        """An awaitable of sample ``index``, or of a list of samples for a slice."""
        resolved = self._sync._resolve(index)
        if isinstance(resolved, np.ndarray):
            return asyncio.to_thread(self._sync.read_batch, resolved)
        return asyncio.to_thread(self._sync._read_one, resolved)

    async def read(self, index: int | slice) -> Any:
        """Sample ``index`` (or a list for a slice)."""
        return await asyncio.to_thread(self._sync.__getitem__, index)

    async def read_batch(self, ids: Sequence[int] | np.ndarray) -> list[Any]:
        """The samples at ``ids``."""
        return await asyncio.to_thread(self._sync.read_batch, ids)
