"""Parquet tables, read in place: ``ParquetStorage``.

What Hugging Face datasets, DataTrove and many tokenizing pipelines write: a table with a
column of token ids (a list of integers per row, e.g. ``input_ids``), one row per
document. The stream is the rows' tokens in row order, files in the order given; document
``i`` is row ``i``. Parquet is compressed and encoded, so nothing is mapped: a row group is
the unit of reading, decoded by pyarrow when a read first touches it and kept in a cache
bounded in bytes (``cache_bytes``, per reader). Where the documents start (each row's list
length) takes one scan of the column the first time; it is kept in a sidecar file (beside
the first file, else under ``cache_dir``) that later opens read instead.

A string column (``text``) is read as text documents (``{"text": str}``, through
``DocumentDataset``); its windows need a tokenizer, which this storage does not run.

pyarrow is imported only when a ``ParquetStorage`` is made (``pip install pyarrow``). The
reading itself (the row-group cache, the read backend, the text reader) is in
``parquet_reading.py``; here: the storage, its scan and its sidecar.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.progress import Progress, show_progress
from guideloom_pipes.storage.corpora.base import CorpusFiles, TokenCorpus
from guideloom_pipes.storage.corpora.location import corpus_paths, locate
from guideloom_pipes.storage.corpora.parquet_files import (
    column_kind,
    null_row,
    open_file,
    open_table,
    pyarrow_modules,
)
from guideloom_pipes.storage.corpora.parquet_reading import ParquetIO, TextReader
from guideloom_pipes.storage.corpora.sidecar import keep_values, read_values
from guideloom_pipes.storage.errors import DatasetChangedError
from guideloom_pipes.storage.io import resolve_backend
from guideloom_pipes.storage.remote import remote_backend
from guideloom_pipes.storage.remote_paths import RemotePath

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "ParquetStorage",
    "TOKEN_COLUMNS",
    "column_of",
    "parquet_paths",
    "pick_column",
    "pyarrow_modules",
]

#: Most bytes of decoded row groups a reader keeps by default (``cache_bytes``).
DEFAULT_CACHE_BYTES = 256 << 20
#: The token columns ``open_storage`` picks when ``column=`` is not given.
TOKEN_COLUMNS = ("input_ids", "tokens")
#: The sidecar's first bytes (then: its key's digest, 16 bytes; then int64 values: the
#: number of files, each file's row groups, each row group's rows, the document starts).
_SIDECAR_MAGIC = b"GLPPQT1\x00"


def parquet_paths(
    paths: Any, storage_options: dict[str, Any] | None = None, retry: Any = None
) -> list[PurePath]:
    """``paths`` (files, or directories: their ``.parquet`` files in name order, hidden
    ones aside; URLs too, a directory's listed where the store lists: S3, not HTTP) as a
    non-empty list of files."""
    out: list[PurePath] = []
    for path in corpus_paths(paths, "paths"):
        if isinstance(path, RemotePath):
            out.extend(
                [path] if path.suffix == ".parquet" else _listed(path, storage_options, retry)
            )
        elif Path(path).is_dir():
            found = sorted(
                name
                for name in os.listdir(path)
                if name.endswith(".parquet") and not name.startswith(".")
            )
            if not found:
                raise FileNotFoundError(f"{path} holds no .parquet files: check the path")
            out.extend(path / name for name in found)
        else:
            out.append(path)
    return out


def _listed(url: RemotePath, storage_options: dict[str, Any] | None, retry: Any) -> list[PurePath]:
    """The ``.parquet`` objects directly under ``url``, in name order."""
    listing = resolve_backend(remote_backend(str(url), storage_options, retry)).list_dir
    if listing is None:
        raise ValueError(
            f"{url} does not end with .parquet, and {url.protocol}:// cannot list a "
            f"directory: give the URLs of its .parquet files"
        )
    try:
        names = sorted(n for n in listing(url) if n.endswith(".parquet") and not n.startswith("."))
    except FileNotFoundError:
        names = []
    if not names:
        raise FileNotFoundError(f"{url} holds no .parquet files: check the URL")
    return [url / name for name in names]


def pick_column(path: Path) -> str:
    """The column ``open_storage`` reads of the Parquet file at ``path`` when none is
    given: see :func:`column_of`."""
    _, pq, _ = pyarrow_modules()
    return column_of(open_file(pq, path).schema_arrow, path)


def column_of(schema: Any, path: PurePath) -> str:
    """The column ``open_storage`` reads of a Parquet file of ``schema`` (at ``path``) when
    none is given: the one list-of-integers column among :data:`TOKEN_COLUMNS`, else the
    one string column ``text``; else a ``ValueError`` naming the columns and ``column=``."""
    pa, _, _ = pyarrow_modules()
    kinds: dict[str, np.dtype[Any] | str | None] = {}
    for field in schema:
        try:
            kinds[field.name] = column_kind(pa, schema, field.name, path)
        except ValueError:
            kinds[field.name] = "other"
    tokens = [name for name in TOKEN_COLUMNS if isinstance(kinds.get(name), np.dtype)]
    if len(tokens) == 1:
        return tokens[0]
    if not tokens and "text" in kinds and kinds["text"] is None:
        return "text"
    found = ", ".join(f"{field.name} ({field.type})" for field in schema)
    why = "both" if tokens else "neither"
    raise ValueError(
        f"{path} has {why} of the token columns {' and '.join(TOKEN_COLUMNS)} as a list of "
        f"integers (its columns: {found}): pass column= the one to read, e.g. "
        f"open_storage({os.fspath(path)!r}, column=...)"
    )


class ParquetStorage(TokenCorpus):
    """Parquet tables read in place: a column of token ids (a list of integers per row)
    as one token stream (``StreamDataset`` windows; rows in order, files in the order
    given) and its documents (row ``i`` is document ``i``: ``DocumentDataset``,
    ``PackedDataset``, ``from_storage`` without ``sequence_length``); or a string column
    as text documents (``{"text": str}``, ``DocumentDataset`` only: windows need a
    tokenizer).

    Args:
        paths: a Parquet file, a directory (its ``.parquet`` files in name order), or a
            list of them; or their URLs (``s3://``, ``http(s)://``, any fsspec protocol:
            read in byte ranges pinned to the ETag the open found; a directory's files
            listed where the store lists, as S3 does).
        column: the column to read: a list of integers (``list``, ``large_list`` or
            ``fixed_size_list``; every file the same type) or a string.
        dtype: the dtype samples have (None: the column's). A token that does not fit it
            is refused when read, naming the file and the value.
        cache_dir: where the sidecar of document starts goes when the first file's
            directory is read-only (by default: beside it, else in memory only); for files
            at a URL, the only place it goes (a reader never writes beside remote data).
        cache_bytes: most bytes of decoded row groups a reader keeps (least recently used
            dropped first; the row group being read is always kept).
        progress: show the first open's scan of the column (on stderr: a tqdm bar, else log
            lines): True, False, or None (the default) for tables of 64 MiB and more.
        storage_options: for URLs, the fsspec file system's options.
        retry: for URLs, a :class:`~guideloom_pipes.storage.remote.RetryPolicy`.

    Raises:
        ImportError: pyarrow is not installed.
        FileNotFoundError: a file does not exist.
        CorruptShardError: a file is not Parquet.
        ValueError: a file lacks ``column``, or it holds anything else than lists of
            integers or strings (floats, say), or the files disagree on its type.
    """

    description = "Parquet tables"

    def __init__(
        self,
        paths: Any,
        column: str,
        dtype: Any = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        progress: bool | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: Any = None,
    ) -> None:
        show_progress(progress, 0)  # (checked now)
        #: whether the scan of the column shows progress (None: for 64 MiB and more)
        self.progress = progress
        if not isinstance(column, str):
            raise TypeError(f"column must be a column name (a str), got {column!r}")
        self.files = parquet_paths(paths, storage_options, retry)
        self.column = column
        self.cache_bytes = check_int("cache_bytes", cache_bytes, minimum=0)
        #: where the files are, how they are read, where the sidecar goes
        self.location = locate(
            self.files, storage_options=storage_options, retry=retry, cache_dir=cache_dir
        )
        pa, _, _ = pyarrow_modules()
        kinds = {}
        for path, name in zip(self.files, self.location.names):
            schema = open_table(self.location, name).schema_arrow
            kinds[path] = column_kind(pa, schema, column, path)
        if len(set(kinds.values())) > 1:
            listed = ", ".join(
                f"{path} ({'string' if kind is None else kind})" for path, kind in kinds.items()
            )
            raise ValueError(
                f"column {column!r} has different types in the files: {listed}; open each "
                f"group as its own ParquetStorage and blend them with a MixtureDataset, "
                f"giving each the same dtype="
            )
        stored = kinds[self.files[0]]
        #: whether the column holds text (strings) rather than token ids
        self.text = stored is None
        if stored is None:
            if dtype is not None:
                raise TypeError(
                    f"dtype={dtype!r} is the dtype of token ids, but column {column!r} holds "
                    f"text (strings): drop dtype="
                )
            stored = np.dtype("<i4")  # (unused: the text has no token stream)
        self._names = self.location.names
        super().__init__(self.location.directory, stored, dtype, None)

    @property
    def has_documents(self) -> bool:
        """Whether the storage serves documents: always (row ``i`` is document ``i``)."""
        return True

    def _needs_tokenizer(self, what: str) -> TypeError:
        return TypeError(
            f"column {self.column!r} of {self!r} holds text (strings), so it has no token "
            f"{what}: read its text documents with DocumentDataset(storage) (or from_storage "
            f"without sequence_length); windows and packing need a tokenizer, which "
            f"ParquetStorage does not run (tokenize the text first, into a column of token "
            f"ids)"
        )

    def sync_reader(self) -> Any:
        """A reader of the token stream (context manager); text is refused."""
        if self.text:
            raise self._needs_tokenizer("stream")
        return super().sync_reader()

    def document_reader(self) -> Any:
        """A reader of the documents: row ``i`` as ``{"tokens": array}`` (``{"text": str}``
        for a string column)."""
        if self.text:
            return TextReader(self)
        return super().document_reader()

    def verify(self) -> dict[str, int]:
        """Open the tables and decode every row group once (tokens: also checked against
        ``dtype=``): ``{"shards": files, "tokens": tokens}`` (``"documents"`` for text)."""
        if self.text:
            with TextReader(self) as reader:
                return reader.verify()
        return super().verify()

    # -- the scan: each row group's rows and each row's tokens, kept in a sidecar ----------

    def _scan(self) -> CorpusFiles:
        if self.text:
            raise self._needs_tokenizer("stream")
        versions = [self.location.info(name) for name in self._names]
        key = self._key(versions)
        found = None
        for place in self._sidecars():
            values = read_values(place, _SIDECAR_MAGIC, key)
            found = None if values is None else _decode_sidecar(values, len(self._names))
            if found is not None:
                break
        if found is None:
            found = self._scan_files(versions)
            if not keep_values(self._sidecars(), _SIDECAR_MAGIC, key, _encode_sidecar(*found)):
                why = (
                    "they are at a URL, and a reader never writes beside remote data"
                    if self.location.remote
                    else "its directory is read-only"
                )
                warnings.warn(
                    f"ParquetStorage could not keep the row lengths of {self.files[0]} in a "
                    f"sidecar ({why}): every open scans the files again. Pass cache_dir= a "
                    f"writable local directory",
                    UserWarning,
                    stacklevel=5,
                )
        rows, starts = found
        layouts, sizes, row = {}, [], 0
        itemsize = self.stored.itemsize
        for name, groups, version in zip(self._names, rows, versions):
            bounds = np.zeros(len(groups) + 1, dtype=np.int64)
            np.cumsum(groups, out=bounds[1:])
            tokens = starts[bounds + row]
            layouts[os.fspath(self.dir / name)] = (name, groups, tokens - tokens[0], version)
            sizes.append(int(tokens[-1] - tokens[0]) * itemsize)
            row += int(bounds[-1])
        return CorpusFiles(
            list(self._names),
            sizes,
            starts,
            [{".parquet": size} for size, _ in versions],
            ParquetIO(self, layouts),
            tags=[tag for _, tag in versions] if self.location.remote else None,
        )

    def _key(self, versions: list[tuple[int, str]]) -> bytes:
        """What the sidecar must match: the files (names, sizes, modification times or
        ETags) and the column."""
        digest = hashlib.blake2b(digest_size=16)
        for name, (size, version) in zip(self._names, versions):
            digest.update(f"{name}\0{size}\0{version}\0".encode())
        digest.update(f"{self.column}\0{self.stored.str}".encode())
        return digest.digest()

    def _sidecars(self) -> list[Path]:
        # (named after every file and the column: two storages over one first file keep
        # their own sidecars rather than overwrite each other's)
        digest = hashlib.sha256()
        for path in self.files:
            shown = path if self.location.remote else Path(path).absolute()
            digest.update(os.fsencode(os.fspath(shown)) + b"\0")
        digest.update(self.column.encode())
        name = f".guideloom_pipes-parquet-{digest.hexdigest()[:16]}.bin"
        return self.location.sidecars(self.files[0], name)

    def _scan_files(self, versions: list[tuple[int, str]]) -> tuple[list[np.ndarray], np.ndarray]:
        """Each file's row groups' rows, and every row's first token in the stream (and the
        stream's end): one pass over the column (of the files as ``versions`` found them),
        refusing null rows and null tokens."""
        pa, _, pc = pyarrow_modules()
        opened = [open_table(self.location, n, v) for n, v in zip(self._names, versions)]
        size = sum(size for size, _ in versions)
        rows: list[np.ndarray] = []
        for path, table in zip(self.files, opened):
            kind = column_kind(pa, table.schema_arrow, self.column, path)
            if kind != self.stored:
                raise DatasetChangedError(
                    f"column {self.column!r} of {path} now holds "
                    f"{'strings' if kind is None else kind}, not {self.stored} as when the "
                    f"storage was made: make the ParquetStorage again"
                )
            metadata = table.metadata
            counts = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            rows.append(np.array(counts, dtype=np.int64))
        described = f"{self.files[0].name}" + (
            f" and {len(self.files) - 1} more files" if len(self.files) > 1 else ""
        )
        shown = Progress(
            f"scanning column {self.column!r} of {described}",
            sum(int(counts.sum()) for counts in rows),
            "rows",
            enabled=show_progress(self.progress, size),
        )
        lengths = []
        with shown:
            for path, table, groups in zip(self.files, opened, rows):
                row = 0
                for group, count in enumerate(groups.tolist()):
                    chunked = table.read_row_group(
                        group, columns=[self.column], use_threads=False
                    ).column(0)
                    self._check_nulls(chunked, path, row)
                    for chunk in chunked.chunks:
                        counts = pc.list_value_length(chunk).to_numpy(zero_copy_only=False)
                        lengths.append(np.asarray(counts, dtype=np.int64))
                    row += count
                    shown.update(count)
        every = np.concatenate(lengths) if lengths else np.empty(0, np.int64)
        starts = np.zeros(len(every) + 1, dtype=np.int64)
        np.cumsum(every, out=starts[1:])
        return rows, starts

    def _check_nulls(self, chunked: Any, path: PurePath, first_row: int) -> None:
        if chunked.null_count:
            row = first_row + null_row(chunked)
            raise ValueError(
                f"row {row} of {path} is null in column {self.column!r}: every row is a "
                f"document of token ids; write an empty list for an empty document, or drop "
                f"the row (e.g. table.filter(pyarrow.compute.is_valid(table[{self.column!r}])))"
            )
        offset = first_row
        for chunk in chunked.chunks:
            flat = chunk.flatten()
            if flat.null_count:
                _, _, pc = pyarrow_modules()
                lengths = np.asarray(
                    pc.list_value_length(chunk).to_numpy(zero_copy_only=False), dtype=np.int64
                )
                nulls = np.asarray(flat.is_null().to_numpy(zero_copy_only=False))
                token = int(np.flatnonzero(nulls)[0])
                row = offset + int(np.searchsorted(np.cumsum(lengths), token, side="right"))
                raise ValueError(
                    f"row {row} of {path} holds a null token in column {self.column!r}: token "
                    f"ids are integers; fill or drop the nulls and write the file again"
                )
            offset += len(chunk)

    def __repr__(self) -> str:
        listed = [os.fspath(path) for path in self.files]
        shown = listed[0] if len(listed) == 1 else listed
        extra = "" if self.text or self.dtype == self.stored else f", dtype={str(self.dtype)!r}"
        return f"ParquetStorage({shown!r}, column={self.column!r}{extra})"


def _decode_sidecar(values: np.ndarray, files: int) -> tuple[list[np.ndarray], np.ndarray] | None:
    """``(row lengths per row group of each file, row starts)`` of a sidecar's values, or
    None where they do not hold together."""
    if len(values) < 1 + files or int(values[0]) != files:
        return None
    counts = values[1 : 1 + files]
    at = 1 + files
    total_groups = int(counts.sum())
    if bool((counts < 0).any()) or len(values) < at + total_groups:
        return None
    rows, position = [], at
    for count in counts.tolist():
        rows.append(values[position : position + count].copy())
        position += count
    starts = values[position:].copy()
    total_rows = sum(int(r.sum()) for r in rows)
    if len(starts) != total_rows + 1 or int(starts[0]) != 0 or bool((np.diff(starts) < 0).any()):
        return None
    return rows, starts


def _encode_sidecar(rows: list[np.ndarray], starts: np.ndarray) -> np.ndarray:
    """The values :func:`_decode_sidecar` reads back."""
    return np.concatenate(
        [np.array([len(rows)], np.int64), np.array([len(r) for r in rows], np.int64), *rows, starts]
    )
