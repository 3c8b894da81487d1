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

This module holds the two datasets; their readers are in :mod:`guideloom_pipes.dataset_readers`,
the readers' base, ``BatchReads`` / ``batch_reads``, ``batch_read_fn``, ``open_reader`` and
``reader_fingerprint`` in :mod:`guideloom_pipes.reader_base` (all importable from here too).
"""

from __future__ import annotations

from typing import Any

from guideloom_pipes.checks import check_int
from guideloom_pipes.dataset_readers import DocumentDatasetReader as DocumentDatasetReader
from guideloom_pipes.dataset_readers import StreamDatasetReader as StreamDatasetReader
from guideloom_pipes.reader_base import BatchReads as BatchReads
from guideloom_pipes.reader_base import DatasetReaderBase as DatasetReaderBase
from guideloom_pipes.reader_base import WindowBuffers as WindowBuffers
from guideloom_pipes.reader_base import _AsyncDatasetReader
from guideloom_pipes.reader_base import batch_read_fn as batch_read_fn
from guideloom_pipes.reader_base import batch_reads as batch_reads
from guideloom_pipes.reader_base import open_reader as open_reader
from guideloom_pipes.reader_base import reader_fingerprint as reader_fingerprint
from guideloom_pipes.storage.document import DocumentStorage
from guideloom_pipes.storage.stream import StreamStorage
from guideloom_pipes.storage.stream_meta import StreamWithMetaStorage
from guideloom_pipes.types import DatasetAbstract, OutDataT


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
        if not isinstance(storage, DocumentStorage) and not has_documents(storage):
            raise TypeError(
                f"DocumentDataset needs a DocumentStorage (or a corpus with documents, such as "
                f"MegatronIndexedStorage), got {type(storage).__name__} (use "
                f"StreamDataset(storage, sequence_length) for streams)"
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


def has_documents(storage: Any) -> bool:
    """Whether ``storage`` is a corpus that serves documents (``document_reader()``: a
    :class:`~guideloom_pipes.storage.corpora.TokenCorpus`), besides a ``DocumentStorage``."""
    return callable(getattr(storage, "document_reader", None)) and bool(
        getattr(storage, "has_documents", True)
    )


__all__ = ["DocumentDataset", "StreamDataset", "has_documents"]
