"""Opening Parquet files for ``ParquetStorage``: pyarrow imported lazily, a file opened
where it is (a local path, or at a URL read in byte ranges pinned to the ETag its storage's
open found, :class:`RangeFile`), a column's type checked, the first null row found."""

from __future__ import annotations

import io
import os
from pathlib import PurePath
from typing import Any

import numpy as np

from guideloom_pipes.storage.corpora.location import CorpusLocation
from guideloom_pipes.storage.errors import CorruptShardError, DatasetChangedError

__all__ = ["RangeFile", "column_kind", "null_row", "open_file", "open_table", "pyarrow_modules"]


def pyarrow_modules() -> tuple[Any, Any, Any]:
    """``(pyarrow, pyarrow.parquet, pyarrow.compute)``, or an ``ImportError`` saying how to
    install pyarrow."""
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError as error:
        raise ImportError(
            f"reading Parquet needs pyarrow, which is not installed ({error}): pip install "
            f"pyarrow (or pip install 'guideloom-pipes[parquet]')"
        ) from None
    return pyarrow, pyarrow.parquet, pyarrow.compute


def open_file(pq: Any, path: PurePath | str) -> Any:
    """``pyarrow.parquet.ParquetFile`` of ``path``; a missing file or one that is not
    Parquet is refused naming it."""
    local = os.fspath(path)
    if not os.path.exists(local):
        raise FileNotFoundError(f"{local} does not exist: check the paths given")
    try:
        return pq.ParquetFile(local)
    except (OSError, ValueError) as error:  # (pyarrow's ArrowInvalid is a ValueError)
        raise CorruptShardError(
            f"{local} is not a Parquet file pyarrow can read ({error}); give Parquet files "
            f"(e.g. written by pyarrow.parquet.write_table or datasets' to_parquet)"
        ) from None


def column_kind(pa: Any, schema: Any, column: str, path: PurePath) -> np.dtype[Any] | None:
    """The token dtype of ``column`` in ``schema`` (a list of integers), or None for a
    string column (text); anything else is refused naming the file, the column and the
    fix."""
    index = schema.get_field_index(column)
    if index < 0:
        found = ", ".join(f"{field.name} ({field.type})" for field in schema)
        raise ValueError(
            f"{os.fspath(path)} has no column {column!r} (its columns: {found}): pass column= "
            f"the column of token ids (a list of integers) or of text (a string)"
        )
    kind = schema.field(index).type
    types = pa.types
    if types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind):
        value = kind.value_type
        if types.is_integer(value):
            return np.dtype(value.to_pandas_dtype()).newbyteorder("<")
        raise ValueError(
            f"column {column!r} of {os.fspath(path)} holds lists of {value}: token ids are "
            f"integers; cast the column (e.g. table.cast(...) with pyarrow.list_(pyarrow."
            f"int32())) and write the file again"
        )
    if types.is_dictionary(kind):  # (categorical strings: pandas' category dtype)
        kind = kind.value_type
    is_view = getattr(types, "is_string_view", None)
    if types.is_string(kind) or types.is_large_string(kind) or (is_view and is_view(kind)):
        return None
    raise ValueError(
        f"column {column!r} of {os.fspath(path)} is {kind}: ParquetStorage reads a column of "
        f"token ids (a list of integers per row) or of text (a string per row)"
    )


def null_row(chunked: Any) -> int:
    """The first null row of a chunked list array (one is known to be there)."""
    offset = 0
    for chunk in chunked.chunks:
        if chunk.null_count:
            nulls = np.asarray(chunk.is_null().to_numpy(zero_copy_only=False))
            return offset + int(np.flatnonzero(nulls)[0])
        offset += len(chunk)
    return offset  # pragma: no cover - called only where there is one


class RangeFile(io.RawIOBase):
    """A remote file as the binary file pyarrow reads (seek, tell, read): each read one
    ranged request of a pinned reader (``location.reader``)."""

    def __init__(self, reader: Any, name: str) -> None:
        super().__init__()
        self._reader = reader
        self._size = int(reader.filesize())
        self._position = 0
        self.name = name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = max(0, min(len(view), self._size - self._position))
        if not want:
            return 0
        got = int(self._reader.readinto(self._position, view[:want]))
        self._position += got
        return got

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
        super().close()


def open_table(location: CorpusLocation, name: str, version: tuple[int, str] | None = None) -> Any:
    """``pyarrow.parquet.ParquetFile`` of file ``name`` of ``location``. ``version``: the
    file's size and version (modification time, or ETag at a URL) when its storage's open
    found it: a local file that has another is refused with ``DatasetChangedError``, and a
    remote one is read pinned to that ETag (a replaced object: the same error, at the read
    that meets it)."""
    _, pq, _ = pyarrow_modules()
    path = location.path(name)
    if not location.remote:
        opened = open_file(pq, path)
        if version is not None and location.info(name) != version:
            raise DatasetChangedError(
                f"{path} changed since its row groups were scanned (its size or "
                f"modification time): open the storage again, which scans it again"
            )
        return opened
    size, tag = location.info(name) if version is None else version
    reader = location.reader(name, size, tag)
    try:
        return pq.ParquetFile(RangeFile(reader, os.fspath(path)))
    except (OSError, ValueError) as error:  # (pyarrow's ArrowInvalid is a ValueError)
        reader.close()
        if isinstance(error, DatasetChangedError):
            raise
        raise CorruptShardError(
            f"{path} is not a Parquet file pyarrow can read ({error}); give Parquet files "
            f"(e.g. written by pyarrow.parquet.write_table or datasets' to_parquet)"
        ) from None
