"""The readers of the datasets of :mod:`guideloom_pipes.datasets`: ``StreamDatasetReader``
(windows of a stream: ``read_batch``, ``read_arrays`` as a ``Batch`` of columns,
``read_rows``, ``read_range``, a one-field stream's ``read_column``) and
``DocumentDatasetReader`` (documents; ``read_arrays`` as a ``Batch`` of rows), both built on
:class:`~guideloom_pipes.reader_base.DatasetReaderBase`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from guideloom_pipes.batch import Batch, LazyRows
from guideloom_pipes.formats import StreamNumpyFormat
from guideloom_pipes.reader_base import BatchReads, DatasetReaderBase, WindowBuffers, _as_ids
from guideloom_pipes.storage.document import DocumentReader
from guideloom_pipes.storage.stream import StreamReader
from guideloom_pipes.storage.stream_meta import StreamWithMetaReader

if TYPE_CHECKING:
    from guideloom_pipes.datasets import DocumentDataset, StreamDataset


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

    def decodes_small_objects(self) -> bool:
        """Whether its samples are many small Python objects (a loader that decodes them in
        its own process then keeps small-object memory mapped for them): not windows of a
        ``StreamNumpyFormat`` stream, which are arrays (a dict of them per sample, or a
        :class:`~guideloom_pipes.batch.Batch` of columns)."""
        reader = self._storage_reader
        format = reader.storage.format
        return not isinstance(format, StreamNumpyFormat) or isinstance(reader, StreamWithMetaReader)

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
        ids inside the dataset): its windows copied row by row, or gathered a shard at a
        time, into a recycled array of the field's dtype, which is the column; nothing else
        per batch. None where the
        batch takes :meth:`read_arrays`' general read (another format, other ids, many
        windows): that read also names what is wrong with the ids."""
        one = self._one_field
        if (
            one is None
            or type(ids) is not np.ndarray
            or ids.ndim != 1
            or not len(ids)
            or ids.dtype.kind not in "iu"
        ):
            return None
        return self._storage_reader._few_windows(ids, self.sequence_length, one[1])

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
        storage = dataset.storage
        # a corpus's documents come from its document reader, a document storage's from its
        # reader
        opener = getattr(storage, "document_reader", None) or storage.sync_reader
        super().__init__(opener())

    def document_lengths(self) -> np.ndarray | None:
        """Each document's length in tokens where the storage knows it without reading
        (a corpus's boundaries), else None."""
        lengths = getattr(self._storage_reader, "document_lengths", None)
        return None if lengths is None else lengths()

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
