"""Opening a dataset without restating its format: :func:`open_storage` reads the kind,
dtype and format class from the commit records (or the kind from the file names) and builds
the right storage, and :func:`detect` says what a directory holds."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from guideloom_pipes.formats import DocumentPickleFormat, StreamNumpyFormat
from guideloom_pipes.opening_corpora import foreign_corpus, local_path
from guideloom_pipes.storage import DocumentStorage, StreamStorage, StreamWithMetaStorage
from guideloom_pipes.storage.errors import StorageError
from guideloom_pipes.storage.io import resolve_backend
from guideloom_pipes.storage.names import (
    IN_BAND,
    INDEX,
    OUT_OF_BAND,
    RECORD,
    SHARD_NAME,
    shard_name,
)
from guideloom_pipes.storage.records import ShardRecord, format_name
from guideloom_pipes.storage.remote import resolve_location
from guideloom_pipes.storage.remote_failures import RetryPolicy
from guideloom_pipes.storage.remote_paths import file_url_path, is_url
from guideloom_pipes.storage.shard_listing import backend_size, read_whole

__all__ = ["Detected", "detect", "open_storage", "STORAGE_CLASSES"]

#: the storage class of each kind (as commit records name it)
STORAGE_CLASSES: dict[str, type[Any]] = {
    "stream": StreamStorage,
    "stream_meta": StreamWithMetaStorage,
    "document": DocumentStorage,
}
#: the data files of each kind's shards
KIND_SUFFIXES = {
    "stream": (IN_BAND,),
    "stream_meta": (IN_BAND, INDEX, OUT_OF_BAND),
    "document": (INDEX, OUT_OF_BAND),
}
_STREAM_NUMPY = format_name(StreamNumpyFormat(np.dtype([("x", "u1")])))
DOCUMENT_PICKLE = format_name(DocumentPickleFormat())


@dataclass
class Detected:
    """What a dataset directory holds, from its file names and one commit record."""

    #: the directory (a ``RemotePath`` for a URL)
    directory: PurePath
    #: ``"stream"``, ``"stream_meta"`` or ``"document"`` (from the records, else the files)
    kind: str
    #: whether any shard has a commit record (False: written by GuideLoom)
    recorded: bool
    #: the stream dtype the records name (None: documents, or no records)
    dtype: np.dtype[Any] | None = None
    #: the format class the records name (``module.QualName``; None: not recorded)
    format: str | None = None
    #: the data-file suffixes found
    suffixes: set[str] = field(default_factory=set)


def _shard_files(names: Iterable[str]) -> tuple[set[str], list[int]]:
    """The data-file suffixes among ``names`` and the ids of the shards with a record
    (temporaries and versioned files left out)."""
    suffixes: set[str] = set()
    records: list[int] = []
    for name in names:
        match = SHARD_NAME.match(name)
        if match is None or match.group("temporary") or match.group("generation"):
            continue
        if match.group("suffix") == RECORD:
            records.append(int(match.group("shard")))
        else:
            suffixes.add(match.group("suffix"))
    return suffixes, records


def _remote(path_or_url: Any) -> bool:
    """Whether ``path_or_url`` is a URL read through fsspec (not ``file://``)."""
    return is_url(path_or_url) and file_url_path(path_or_url) is None


def detect(
    path_or_url: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> Detected:
    """What the dataset directory ``path_or_url`` holds: its kind (from the commit records,
    else from the file suffixes), and the dtype and format class the records name.

    A URL (``s3://``, ``http(s)://``, any fsspec protocol) is listed through fsspec with
    ``storage_options`` and ``retry`` (over HTTP, which cannot list, shard 0's files are
    probed).

    Raises ``FileNotFoundError`` (no such directory, or no shard files in it),
    ``NotADirectoryError``, and ``ValueError`` for files of no single kind.
    """
    if _remote(path_or_url):
        return _detect_remote(path_or_url, storage_options, retry)
    directory = local_path(path_or_url)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"dataset directory {directory} does not exist; check the path"
        ) from None
    except NotADirectoryError:
        raise NotADirectoryError(
            f"{directory} is not a directory; pass the dataset directory"
        ) from None
    suffixes, records = _shard_files(names)
    record = _first_record(directory, sorted(records))
    if record is not None and record.kind in KIND_SUFFIXES:
        return Detected(directory, record.kind, True, record.dtype, record.format, suffixes)
    kind = _kind_of(suffixes)
    if kind is None:
        if not suffixes:
            raise FileNotFoundError(
                f"{directory} is not a dataset: it holds no shard files (0000000.in_band.bin, "
                f"0000000.out_of_band.bin, ...); check the path"
            )
        raise ValueError(
            f"{directory} holds {' and '.join(sorted(suffixes))} files, which no one kind of "
            f"dataset has together; pass the kind (stream, stream_meta or document)"
        )
    return Detected(directory, kind, bool(records), None, None, suffixes)


def _detect_remote(
    url: str, storage_options: dict[str, Any] | None, retry: RetryPolicy | None
) -> Detected:
    """:func:`detect` of a URL: its names listed (object stores) or shard 0's probed (HTTP),
    its first committed record read."""
    directory, backend = resolve_location(url, None, storage_options, retry)
    io = resolve_backend(backend)
    if io.list_dir is not None:
        try:
            names = list(io.list_dir(directory))
        except FileNotFoundError:
            names = []
    else:  # HTTP: shard 0's files, if any
        first = shard_name(0)
        names = [
            first + suffix
            for suffix in (RECORD, IN_BAND, INDEX, OUT_OF_BAND)
            if backend_size(io, directory / (first + suffix)) is not None
        ]
    suffixes, records = _shard_files(names)
    if not suffixes and not records:
        raise FileNotFoundError(
            f"{url} is not a dataset: nothing there has a shard file's name "
            f"(0000000.in_band.bin, 0000000.shard.json, ...); check the URL"
        )
    record = None
    for shard in sorted(records)[:8]:
        path = directory / (shard_name(shard) + RECORD)
        try:
            candidate = ShardRecord.from_json(read_whole(io, path), url)
        except (OSError, StorageError):
            continue
        if candidate.state == "committed":
            record = candidate
            break
    if record is not None and record.kind in KIND_SUFFIXES:
        return Detected(directory, record.kind, True, record.dtype, record.format, suffixes)
    kind = _kind_of(suffixes)
    if kind is None:
        raise ValueError(
            f"{url} holds {' and '.join(sorted(suffixes)) or 'no data'} files, which no one "
            f"kind of dataset has together; build the storage class of its kind yourself"
        )
    return Detected(directory, kind, bool(records), None, None, suffixes)


def _first_record(directory: Path, shards: list[int]) -> ShardRecord | None:
    """The first committed record among ``shards`` (a few tried; unreadable ones skipped)."""
    for shard in shards[:8]:
        path = directory / (shard_name(shard) + RECORD)
        try:
            record = ShardRecord.from_json(path.read_bytes(), os.fspath(path))
        except (OSError, StorageError):
            continue
        if record.state == "committed":
            return record
    return None


def _kind_of(suffixes: set[str]) -> str | None:
    if IN_BAND in suffixes:
        return "stream_meta" if OUT_OF_BAND in suffixes or INDEX in suffixes else "stream"
    if OUT_OF_BAND in suffixes or INDEX in suffixes:
        return "document"
    return None


def is_pickled(directory: PurePath) -> bool:
    """Whether the first document of the first non-empty shard starts as a pickle does
    (a local directory; for a URL, False: pass ``fmt=``)."""
    if not isinstance(directory, Path):
        return False
    for shard in range(8):
        stem = directory / shard_name(shard)
        try:
            index = np.fromfile(stem.with_name(stem.name + INDEX), dtype="<i8", count=2)
            if len(index) < 2:
                continue
            with open(stem.with_name(stem.name + OUT_OF_BAND), "rb") as data:
                head = data.read(2)
        except OSError:
            return False
        if index[1] > index[0]:
            return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5
    return False


def open_storage(
    path_or_url: Any,
    *,
    fmt: Any = None,
    read_interface: Any = None,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    cache_dir: Any = None,
    cache_limit_bytes: int | None = None,
    dtype: Any = None,
    eos_id: int | None = None,
    column: str | None = None,
    progress: bool | None = None,
) -> Any:
    """The storage of the dataset at ``path_or_url``, its format rebuilt from its records.

    A corpus written by another tool (a Megatron-LM prefix or its ``.bin`` / ``.idx``,
    ``.npy`` files, ``.parquet`` tables; local or at a URL) is opened read-only by
    :func:`foreign_corpus`, which says what ``dtype``, ``eos_id``, ``column``,
    ``cache_dir`` and ``progress`` mean there.

    A dataset written by this package records its kind, stream dtype and format class in
    each shard's commit record, so ``open_storage("data/tokens")`` returns a
    :class:`~guideloom_pipes.StreamStorage` with the right
    :class:`~guideloom_pipes.StreamNumpyFormat`, or a
    :class:`~guideloom_pipes.DocumentStorage` with
    :class:`~guideloom_pipes.DocumentPickleFormat`. Any other format (every
    stream-with-metadata format is a user class) and data written by GuideLoom (no records,
    so no dtype) need ``fmt=``; the error says so and names the format to pass.

    Args:
        path_or_url: the dataset directory (a path, a string, or a ``file://`` URL), or
            its URL (``s3://``, ``http(s)://``, any fsspec protocol; ``docs/remote.md``).
        fmt: the storage format; given, it is used as is (the reader still checks its
            dtype against the records when it opens).
        read_interface: the read backend (default memory-mapped); not with a remote URL.
        storage_options: for a URL, the fsspec file system's options (as the storages
            take them).
        retry: for a URL, the :class:`~guideloom_pipes.storage.remote.RetryPolicy`.
        cache_dir: for a URL, the shard cache's local directory (None: range reads).
        cache_limit_bytes: most bytes the shard cache keeps (None: no bound).

    Raises:
        FileNotFoundError: no such directory, or no shard files in it.
        ValueError: the format cannot be rebuilt from the records: pass ``fmt=``.
    """
    where = {"storage_options": storage_options, "retry": retry, "cache_dir": cache_dir}
    options = {"dtype": dtype, "eos_id": eos_id, "column": column, "progress": progress}
    corpus = foreign_corpus(path_or_url, read_interface=read_interface, **options, **where)
    if corpus is not None:
        return corpus
    if dtype is not None or eos_id is not None or column is not None:
        raise TypeError(
            f"dtype=, eos_id= and column= are for corpora written by other tools (a Megatron "
            f"prefix, .npy files, Parquet tables); {path_or_url} is a dataset of ours, whose "
            f"records give its dtype: drop them"
        )
    remote = _remote(path_or_url)
    if remote and read_interface is not None:
        resolve_location(path_or_url, read_interface, storage_options, retry)  # raises
    found = detect(path_or_url, storage_options=storage_options, retry=retry)
    storage_class = STORAGE_CLASSES[found.kind]
    if fmt is None:
        fmt = rebuilt_format(found)
    if not remote:
        return storage_class(found.directory, fmt, read_interface)
    return storage_class(str(found.directory), fmt, cache_limit_bytes=cache_limit_bytes, **where)


def rebuilt_format(found: Detected) -> Any:
    """The built-in format that ``found``'s records describe, or a ``ValueError`` saying
    which ``fmt=`` to pass."""
    where = found.directory
    if found.kind == "stream_meta":
        named = f" (its records name {found.format})" if found.format else ""
        raise ValueError(
            f"{where} is a stream-with-metadata dataset{named}; every such format is a user "
            f"class, so it cannot be rebuilt from the records: pass fmt=YourFormat(...), "
            f"e.g. open_storage({os.fspath(where)!r}, fmt=...)"
        )
    if not found.recorded:
        example = (
            "StreamNumpyFormat(np.dtype([('tokens', '<i4')]))"
            if found.kind == "stream"
            else "DocumentPickleFormat()"
        )
        raise ValueError(
            f"{where} holds {found.kind} data without commit records (written by GuideLoom), "
            f"so its format is not recorded: pass fmt=, e.g. open_storage("
            f"{os.fspath(where)!r}, fmt={example}) with the format it was written with"
        )
    if found.kind == "stream":
        if found.format not in (None, _STREAM_NUMPY):
            raise ValueError(
                f"{where} was written with the format {found.format}, which cannot be rebuilt "
                f"from the records: pass fmt={found.format.rpartition('.')[2]}(...)"
            )
        if found.dtype is None or found.dtype.names is None:
            raise ValueError(
                f"{where} records the stream dtype {found.dtype}, which is not a structured "
                f"dtype (StreamNumpyFormat needs named fields): pass fmt= the format it was "
                f"written with"
            )
        return StreamNumpyFormat(found.dtype)
    if found.format == DOCUMENT_PICKLE or (found.format is None and is_pickled(where)):
        return DocumentPickleFormat()
    named = found.format or "a format that is not DocumentPickleFormat"
    raise ValueError(
        f"{where} holds documents written with {named}, which cannot be rebuilt from the "
        f"records: pass fmt= that format, e.g. open_storage({os.fspath(where)!r}, fmt=...)"
    )
