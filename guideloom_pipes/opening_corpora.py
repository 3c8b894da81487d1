"""Opening a corpus another tool wrote (:func:`foreign_corpus`, which
:func:`~guideloom_pipes.open_storage` asks first): a Megatron-LM prefix or its ``.bin`` /
``.idx``, ``.npy`` files, Parquet tables, local or at a URL, as their read-only storage."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

from guideloom_pipes.storage.corpora import (
    MegatronIndexedStorage,
    NumpyTokensStorage,
    ParquetStorage,
)
from guideloom_pipes.storage.corpora.location import corpus_paths, locate
from guideloom_pipes.storage.corpora.megatron import MAGIC as MEGATRON_MAGIC
from guideloom_pipes.storage.corpora.parquet import column_of, pick_column
from guideloom_pipes.storage.corpora.parquet_files import open_table
from guideloom_pipes.storage.names import SHARD_NAME
from guideloom_pipes.storage.remote_failures import RetryPolicy
from guideloom_pipes.storage.remote_paths import file_url_path, is_url

__all__ = ["foreign_corpus", "local_path"]

#: The suffixes of a corpus's file at a URL (a directory URL is a dataset of ours).
_REMOTE_SUFFIXES = (".parquet", ".npy", ".bin", ".idx")


def local_path(path_or_url: Any) -> Path:
    """``path_or_url`` (a path, a ``str``, or a ``file://`` URL) as a local ``Path``."""
    if isinstance(path_or_url, os.PathLike):
        return Path(path_or_url)
    if not isinstance(path_or_url, str):
        raise TypeError(f"path_or_url must be a path or a string, got {type(path_or_url).__name__}")
    parsed = urlparse(path_or_url)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1 and "://" in path_or_url:
        raise ValueError(
            f"{path_or_url}: this needs a local directory (a path or a file:// URL), and a "
            f"URL of another store is read through fsspec only; copy the dataset to a local "
            f"directory first"
        )
    return Path(path_or_url)


def foreign_corpus(
    path_or_url: Any,
    *,
    dtype: Any = None,
    eos_id: int | None = None,
    read_interface: Any = None,
    column: str | None = None,
    cache_dir: Any = None,
    progress: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> Any:
    """The read-only storage of a corpus another tool wrote at ``path_or_url``, or None
    where it is not one: a local Megatron prefix or its ``.bin`` / ``.idx``
    (:class:`~guideloom_pipes.MegatronIndexedStorage`), an ``.npy`` file or a directory of
    nothing but ``.npy`` files (:class:`~guideloom_pipes.NumpyTokensStorage`, in name
    order, documents split at ``eos_id``), a ``.parquet`` file or a directory of
    ``.parquet`` files (:class:`~guideloom_pipes.ParquetStorage` of ``column``, in name
    order; None: the one list-of-integers column ``input_ids`` or ``tokens``, else a
    string column ``text``; ``cache_dir``: where its sidecar goes if the directory is
    read-only). ``dtype``: the dtype their tokens are read as (None: their own).
    ``progress``: whether the first open's scan (for ``eos_id``, of a Parquet column) shows
    progress (None: for 64 MiB and more).

    At a URL (``s3://``, ``http(s)://``, any fsspec protocol; ``storage_options`` and
    ``retry`` as the storages take them) a corpus is told by its file's suffix: a
    ``.parquet`` or ``.npy`` file, or a Megatron prefix's ``.bin`` or ``.idx``; any other
    URL is not a corpus (None: a dataset of ours)."""
    if not isinstance(path_or_url, (str, os.PathLike)):
        return None
    if is_url(path_or_url) and file_url_path(str(path_or_url)) is None:
        return _remote_corpus(
            str(path_or_url),
            dtype,
            eos_id,
            column,
            read_interface,
            {"cache_dir": cache_dir, "storage_options": storage_options, "retry": retry},
            progress,
        )
    path = local_path(path_or_url)
    parquet_files = _parquet_files(path)
    if parquet_files:
        if eos_id is not None:
            raise TypeError(
                f"eos_id={eos_id} splits flat token files into documents; {path} is Parquet, "
                f"whose rows are its documents: drop eos_id="
            )
        if read_interface is not None:
            raise TypeError(f"{path} is Parquet, which pyarrow reads itself: drop read_interface=")
        return ParquetStorage(
            parquet_files,
            pick_column(parquet_files[0]) if column is None else column,
            dtype,
            cache_dir=cache_dir,
            progress=progress,
        )
    corpus = _token_files(path, dtype, eos_id, read_interface, progress, cache_dir)
    if corpus is not None and column is not None:
        raise TypeError(
            f"column={column!r} names a column of a Parquet table; {path} is "
            f"{corpus.description}: drop column="
        )
    return corpus


def _remote_corpus(
    url: str,
    dtype: Any,
    eos_id: int | None,
    column: str | None,
    read_interface: Any,
    where: dict[str, Any],
    progress: bool | None,
) -> Any:
    """The corpus whose file is at ``url`` (by its suffix), or None (``where``: its
    ``cache_dir``, ``storage_options`` and ``retry``)."""
    suffix = PurePosixPath(urlparse(url).path).suffix
    if suffix not in _REMOTE_SUFFIXES:
        return None
    if read_interface is not None:
        raise ValueError(
            f"read_interface={read_interface!r} cannot read {url}: a URL is read in byte "
            f"ranges through fsspec; drop read_interface (storage_options= for the store's)"
        )
    if suffix == ".parquet":
        if eos_id is not None:
            raise TypeError(
                f"eos_id={eos_id} splits flat token files into documents; {url} is Parquet, "
                f"whose rows are its documents: drop eos_id="
            )
        if column is None:
            options = {k: v for k, v in where.items() if k != "cache_dir"}
            location = locate(corpus_paths(url, "path_or_url"), **options)
            schema = open_table(location, location.names[0]).schema_arrow
            column = column_of(schema, location.path(location.names[0]))
        return ParquetStorage(url, column, dtype, progress=progress, **where)
    if column is not None:
        raise TypeError(
            f"column={column!r} names a column of a Parquet table; {url} is not one: drop column="
        )
    if suffix == ".npy":
        return NumpyTokensStorage(url, dtype, eos_id, progress=progress, **where)
    if eos_id is not None:
        raise TypeError(
            f"eos_id={eos_id} splits flat token files; {url} is a Megatron indexed dataset, "
            f"whose index gives its documents: drop eos_id="
        )
    return MegatronIndexedStorage(url, dtype, **where)


def _token_files(
    path: Path,
    dtype: Any,
    eos_id: int | None,
    read_interface: Any,
    progress: bool | None,
    cache_dir: Any,
) -> Any:
    """The Megatron or numpy corpus at ``path``, or None."""
    numpy_files = _npy_files(path)
    if numpy_files:
        return NumpyTokensStorage(
            numpy_files,
            dtype=dtype,
            eos_id=eos_id,
            read_interface=read_interface,
            progress=progress,
            cache_dir=cache_dir,
        )
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    index = prefix.with_name(prefix.name + ".idx")
    if path.is_dir() or not index.is_file():
        return None
    with open(index, "rb") as handle:
        if handle.read(len(MEGATRON_MAGIC)) != MEGATRON_MAGIC:
            return None
    return MegatronIndexedStorage(prefix, dtype=dtype, read_interface=read_interface)


def _parquet_files(path: Path) -> list[Path]:
    """``[path]`` for a ``.parquet`` file; a directory's ``.parquet`` files if it holds
    any and no shard files of ours (hidden files aside: a sidecar); else ``[]``."""
    if path.suffix == ".parquet" and path.is_file():
        return [path]
    if not path.is_dir():
        return []
    names = sorted(name for name in os.listdir(path) if not name.startswith("."))
    parquet = [name for name in names if name.endswith(".parquet")]
    if not parquet or any(SHARD_NAME.match(name) for name in names):
        return []
    return [path / name for name in parquet]


def _npy_files(path: Path) -> list[Path]:
    """``[path]`` for an ``.npy`` file; a directory's files if they are all ``.npy`` (hidden
    ones aside: a sidecar); else ``[]``."""
    if path.suffix == ".npy" and path.is_file():
        return [path]
    if not path.is_dir():
        return []
    names = sorted(name for name in os.listdir(path) if not name.startswith("."))
    if names and all(name.endswith(".npy") for name in names):
        return [path / name for name in names]
    return []
