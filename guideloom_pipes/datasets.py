"""Datasets: numbered samples over a storage.

``StreamDataset(storage, L)``: sample ``i`` is stream elements ``[i*L, (i+1)*L)`` (windows
may cross shards; a trailing partial window is dropped). ``DocumentDataset(storage)``:
sample ``i`` is document ``i``. Samples are read through a reader::

    with StreamDataset(storage, 2048).sync_reader() as reader:
        len(reader), reader[0], reader[10:20], reader.read_batch(np.array([5, 3, 9]))

``read_batch`` takes a numpy array of sample ids and returns a list of samples, one
vectorised read per batch; ``read_arrays`` (the loader's path) returns the same samples as a
:class:`~guideloom_pipes.batch.Batch` of arrays where the format allows it (windows of a
``StreamNumpyFormat``; documents as rows), else the list. Readers are thread-safe; samples own
their memory (or share it only with samples of the same batch) and stay valid after the
reader closes.
"""

from __future__ import annotations

import asyncio
import functools
import operator
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import numpy as np

from guideloom_pipes.batch import Batch, LazyRows
from guideloom_pipes.checks import check_int
from guideloom_pipes.formats import StreamNumpyFormat
from guideloom_pipes.storage.document import DocumentReader, DocumentStorage
from guideloom_pipes.storage.stream import StreamReader, StreamStorage
from guideloom_pipes.storage.stream_checks import as_indexes
from guideloom_pipes.storage.stream_meta import StreamWithMetaReader, StreamWithMetaStorage
from guideloom_pipes.types import (
    DatasetAbstract,
    DatasetAsyncReaderAbstract,
    DatasetSyncReaderAbstract,
    OutDataT,
)

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


class StreamDatasetReader(DatasetReaderBase):
    """Reader of a :class:`StreamDataset` (windows of ``sequence_length`` elements)."""

    _storage_reader: StreamReader

    def __init__(self, dataset: StreamDataset) -> None:
        super().__init__(dataset.storage.sync_reader())
        self.sequence_length = dataset.sequence_length
        self._one_field: tuple[str, np.dtype[Any]] | None = None

    def _compute_length(self) -> int:
        return self._storage_reader.total_length // self.sequence_length

    def open(self) -> None:
        super().open()
        self._one_field = self._column_of_windows()

    def _column_of_windows(self) -> tuple[str, np.dtype[Any]] | None:
        """``(name, dtype)`` of the one field of a ``StreamNumpyFormat`` whose column is the
        windows' own bytes (``StreamNumpyFormat.window_field``): its batches are the copied
        windows viewed as that dtype. None for any other format."""
        reader = self._storage_reader
        format = reader.storage.format
        if not isinstance(format, StreamNumpyFormat) or isinstance(reader, StreamWithMetaReader):
            return None
        return format.window_field()

    def _read_one(self, index: int) -> Any:
        length = self.sequence_length
        return self._storage_reader.read(index * length, length)

    def read_arrays(
        self, ids: Sequence[int] | np.ndarray, out: WindowBuffers | None = None
    ) -> Batch | list[Any]:
        """The windows at ``ids`` as a :class:`~guideloom_pipes.batch.Batch`: one
        ``(len(ids), sequence_length)`` array per field, each token copied once out of the
        shards, when the format decodes columns (``StreamNumpyFormat``); else the list.

        ``out(shape, dtype)``, if given, returns the buffer the windows are copied into (an
        empty C-contiguous array of that shape and opaque dtype, e.g. pinned host memory
        from a loader's ring); where :meth:`reads_into_buffers` is True the columns are
        views of it. Ignored where the list is returned."""
        one = self._one_field
        if one is not None and out is None:
            windows = self.read_column(ids)
            if windows is not None:
                return Batch.of_columns({one[0]: windows})
        self._check_open()
        reader = self._storage_reader
        unpack_columns = getattr(reader.storage.format, "unpack_columns", None)
        if unpack_columns is None or isinstance(reader, StreamWithMetaReader):
            return self.read_batch(ids)
        ids = _as_ids(ids, self._length)
        length = self.sequence_length
        return Batch.of_columns(
            unpack_columns(reader._windows(ids * length, length, out, recycle=True))
        )

    def batch_reads(self, arrays: bool, out: WindowBuffers | None = None) -> BatchReads:
        """:meth:`DatasetReaderBase.batch_reads`, and for a one-field stream's arrays read
        into memory of their own (no ``out``) the batch's one column alone
        (:meth:`read_column`), for a collate that declares a form for one column."""
        reads = super().batch_reads(arrays, out)
        one = self._one_field
        if arrays and out is None and one is not None:
            reads.column = (one[0], one[1], self.read_column)
        return reads

    def read_column(self, ids: Any) -> np.ndarray | None:
        """The one column of a one-field stream's batch at ``ids`` (a 1-D integer array of
        ids inside the dataset): its few windows copied row by row into a recycled array
        of the field's dtype, which is the column; nothing else per batch. None where the
        batch takes :meth:`read_arrays`' general read (another format, other ids, many
        windows): that read also names what is wrong with the ids."""
        one = self._one_field
        if one is None or type(ids) is not np.ndarray or ids.ndim != 1:
            return None
        listed = ids.tolist()
        if (
            not listed
            or ids.dtype.kind not in "iu"
            or min(listed) < 0
            or max(listed) >= self._length
        ):
            return None
        return self._storage_reader._few_windows(listed, self.sequence_length, one[1])

    def reads_into_buffers(self) -> bool:
        """Whether :meth:`read_arrays` with ``out`` returns columns that are views of the
        buffer (no copy after it): a ``StreamNumpyFormat`` of one field, as wide as the
        element. A loader then reads windows straight into pinned buffers."""
        self._check_open()
        reader = self._storage_reader
        format = reader.storage.format
        if isinstance(reader, StreamWithMetaReader) or not isinstance(format, StreamNumpyFormat):
            return False
        dtype = format.stream_dtype
        fields = format.fields
        if len(fields) != 1:
            return False
        field_dtype, offset = dtype.fields[fields[0]][:2]  # type: ignore[index]
        return offset == 0 and field_dtype.itemsize == dtype.itemsize and not field_dtype.shape

    def read_batch(self, ids: Sequence[int] | np.ndarray) -> list[Any]:
        """The windows at ``ids``: one vectorised read, then the format decodes them."""
        self._check_open()
        ids = _as_ids(ids, self._length)
        length = self.sequence_length
        starts = ids * length
        windows = self._storage_reader._windows(starts, length)  # checked: inside the stream
        return self._decode(windows, starts)

    def read_rows(self, ids: Sequence[int] | np.ndarray) -> LazyRows | list[Any]:
        """:meth:`read_batch` with the decode left to the slices where it has a per-window
        part: windows of a stream with metadata come back as
        :class:`~guideloom_pipes.batch.LazyRows` whose slices make the windows' payload
        memoryviews and call ``unpack`` (the read itself, the run finding and the payload
        bytes' copy, done now for all of them: :meth:`StreamWithMetaReader.prepare_windows`).
        Slice it while the reader is open: a window that crosses a shard boundary (or whose
        payload numbers jump) reads its payloads when its slice is made."""
        reader = self._storage_reader
        if not isinstance(reader, StreamWithMetaReader):
            return self.read_batch(ids)
        self._check_open()
        ids = _as_ids(ids, self._length)
        length = self.sequence_length
        starts = ids * length
        prepared = reader.prepare_windows(reader._windows(starts, length), starts)
        return LazyRows(len(prepared), prepared.decode)

    def read_range(self, first: int, count: int) -> list[Any]:
        """Windows ``first .. first + count - 1`` read as one span (one read per shard it
        touches), then decoded as :meth:`read_batch` decodes."""
        self._check_open()
        ids = _as_ids(np.arange(first, first + count, dtype=np.int64), self._length)
        if count == 0:
            return []
        length = self.sequence_length
        span, _, _ = self._storage_reader.read_raw(first * length, count * length)
        return self._decode(span.reshape(count, length), ids * length)

    def _decode(self, windows: np.ndarray, starts: np.ndarray) -> list[Any]:
        """Samples from a ``(count, sequence_length)`` array of windows starting at
        ``starts`` (global element indexes)."""
        length = self.sequence_length
        reader = self._storage_reader
        if isinstance(reader, StreamWithMetaReader):
            return reader.decode_windows(windows, starts)
        format = reader.storage.format
        unpack_batch = getattr(format, "unpack_batch", None)
        if unpack_batch is not None:
            return list(unpack_batch(windows))
        return [
            format.unpack(windows[row], *reader.window_pieces(start, length))
            for row, start in enumerate(starts.tolist())
        ]


class DocumentDatasetReader(DatasetReaderBase):
    """Reader of a :class:`DocumentDataset`."""

    _storage_reader: DocumentReader

    def __init__(self, dataset: DocumentDataset) -> None:
        super().__init__(dataset.storage.sync_reader())

    def _compute_length(self) -> int:
        return self._storage_reader.total_length

    def _read_one(self, index: int) -> Any:
        return self._storage_reader.read(index)

    def read_batch(self, ids: Sequence[int] | np.ndarray) -> list[Any]:
        """The documents at ``ids``, in that order."""
        self._check_open()
        return self._storage_reader.read_many(_as_ids(ids, self._length))

    def read_arrays(self, ids: Sequence[int] | np.ndarray) -> Batch | list[Any]:
        """The documents at ``ids`` as a :class:`~guideloom_pipes.batch.Batch` of rows."""
        return Batch(rows=self.read_batch(ids))


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


class StreamDataset(DatasetAbstract[OutDataT]):
    """Fixed-length windows of a stream storage: sample ``i`` is ``[i*L, (i+1)*L)``.

    Args:
        storage: a :class:`~guideloom_pipes.StreamStorage` or
            :class:`~guideloom_pipes.StreamWithMetaStorage`.
        sequence_length: ``L``, elements per sample (>= 1).
    """

    def __init__(
        self: StreamDataset[Any],
        storage: StreamStorage[Any, Any, Any] | StreamWithMetaStorage[Any, Any, Any],
        sequence_length: int,
    ) -> None:
        if not isinstance(storage, (StreamStorage, StreamWithMetaStorage)):
            hint = " (use DocumentDataset)" if isinstance(storage, DocumentStorage) else ""
            raise TypeError(
                f"StreamDataset needs a StreamStorage or StreamWithMetaStorage, got "
                f"{type(storage).__name__}{hint}"
            )
        self.storage = storage
        self.sequence_length = check_int("sequence_length", sequence_length, minimum=1)

    def __len__(self) -> int:
        with self.sync_reader() as reader:
            return len(reader)

    def sync_reader(self) -> StreamDatasetReader:
        """A reader (context manager) with ``len``, ``[i]``, slices and ``read_batch``."""
        return StreamDatasetReader(self)

    def async_reader(self) -> _AsyncDatasetReader:
        """An ``async`` reader (``async with``) with ``read`` and ``read_batch``."""
        return _AsyncDatasetReader(StreamDatasetReader(self))

    def __repr__(self) -> str:
        return f"StreamDataset({self.storage!r}, sequence_length={self.sequence_length})"


class DocumentDataset(DatasetAbstract[OutDataT]):
    """The documents of a document storage: sample ``i`` is document ``i``.

    Args:
        storage: a :class:`~guideloom_pipes.DocumentStorage`.
    """

    def __init__(self: DocumentDataset[Any], storage: DocumentStorage[Any, Any]) -> None:
        if not isinstance(storage, DocumentStorage):
            raise TypeError(
                f"DocumentDataset needs a DocumentStorage, got {type(storage).__name__} "
                f"(use StreamDataset(storage, sequence_length) for streams)"
            )
        self.storage = storage

    def __len__(self) -> int:
        with self.sync_reader() as reader:
            return len(reader)

    def sync_reader(self) -> DocumentDatasetReader:
        """A reader (context manager) with ``len``, ``[i]``, slices and ``read_batch``."""
        return DocumentDatasetReader(self)

    def async_reader(self) -> _AsyncDatasetReader:
        """An ``async`` reader (``async with``) with ``read`` and ``read_batch``."""
        return _AsyncDatasetReader(DocumentDatasetReader(self))

    def __repr__(self) -> str:
        return f"DocumentDataset({self.storage!r})"


__all__ = ["DocumentDataset", "StreamDataset"]
