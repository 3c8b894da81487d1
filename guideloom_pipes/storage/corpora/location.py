"""Where a corpus's files are: local paths, or URLs (``s3://``, ``http(s)://``, any fsspec
protocol) read as our own datasets at a URL are (``storage/remote.py``).

At a URL the token files are read in byte ranges, each read pinned to the ETag the open
found (``If-Match``: an object replaced since is a ``DatasetChangedError``, never bytes of
two versions), retried as ``retry`` says; nothing is downloaded whole. The small files read
whole at each open (a Megatron ``.idx``) go through the node-local shard cache when
``cache_dir`` is given (downloaded once, then memory-mapped), and the sidecars of what a
scan found (document ends, row lengths) are kept under ``cache_dir``: a reader never writes
beside remote data.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from guideloom_pipes.storage.cache import ShardCache
from guideloom_pipes.storage.io import resolve_backend
from guideloom_pipes.storage.records import ExpectedFile
from guideloom_pipes.storage.remote import remote_backend
from guideloom_pipes.storage.remote_failures import RetryPolicy
from guideloom_pipes.storage.remote_paths import RemotePath, file_url_path, is_url
from guideloom_pipes.storage.shard_listing import backend_info

__all__ = ["CorpusLocation", "corpus_paths", "locate"]


def corpus_paths(paths: Any, what: str) -> list[PurePath]:
    """``paths`` (one path or URL, or several) as a non-empty list: local ``Path`` s
    (``file://`` URLs too), or :class:`RemotePath` s of one store, never both."""
    if isinstance(paths, (str, os.PathLike)):
        listed = [paths]
    else:
        try:
            listed = list(paths)
        except TypeError:
            raise TypeError(f"{what} must be a path or a list of paths, got {paths!r}") from None
    if not listed:
        raise ValueError(f"{what} is empty: give at least one path")
    out: list[PurePath] = []
    for path in listed:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{what} must be paths (str or os.PathLike) or URLs, got {path!r}")
        local = file_url_path(path) if isinstance(path, str) and is_url(path) else None
        if is_url(path) and local is None:
            out.append(RemotePath(str(path).rstrip("/")))
        else:
            out.append(local if local is not None else Path(os.fspath(path)))
    remote = [path for path in out if isinstance(path, RemotePath)]
    if remote and len(remote) != len(out):
        local_one = next(path for path in out if not isinstance(path, RemotePath))
        raise ValueError(
            f"{what} mixes local paths and URLs ({local_one} and {remote[0]}): a corpus is "
            f"read from one place; give all its files as URLs of one store, or all local"
        )
    stores = {path.parts[:2] for path in remote}
    if len(stores) > 1:
        shown = ", ".join(sorted(f"{scheme}//{host}" for scheme, host in stores))
        raise ValueError(
            f"{what} are URLs of different stores ({shown}): a corpus is read from one "
            f"store; open one storage per store and blend them with a MixtureDataset"
        )
    return out


def _common(files: Sequence[PurePath]) -> PurePath:
    """The deepest directory holding every file of ``files``."""
    if not isinstance(files[0], RemotePath):
        local = [Path(file).absolute() for file in files]
        return Path(os.path.commonpath([os.fspath(file.parent) for file in local]))
    root = files[0].parent
    while not all(file.is_relative_to(root) for file in files):
        root = root.parent
    return root


@dataclass
class CorpusLocation:
    """A corpus's directory and files, and for a URL how they are read."""

    #: the deepest directory holding the files (a :class:`RemotePath` for a URL)
    directory: PurePath
    #: each file's name relative to it
    names: list[str]
    #: the backend reading the files in pinned byte ranges (None: local files)
    backend: Any = None
    #: the backend reading index files whole, through the shard cache where there is one
    index_backend: Any = None
    #: where sidecars go (``cache_dir``; None: nowhere, for a URL)
    cache_dir: Path | None = None

    @property
    def remote(self) -> bool:
        """Whether the files are at a URL."""
        return self.backend is not None

    def path(self, name: str) -> PurePath:
        return self.directory / name

    def info(self, name: str) -> tuple[int, str]:
        """File ``name``'s size and version: its modification time (local), or its ETag
        (at a URL; one request). A missing file is a ``FileNotFoundError`` naming it."""
        path = self.path(name)
        if not self.remote:
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                raise FileNotFoundError(f"{path} does not exist: check the paths given") from None
            return stat.st_size, str(stat.st_mtime_ns)
        found = backend_info(resolve_backend(self.backend), path)
        if found is None:
            raise FileNotFoundError(f"{path} does not exist (the server says so): check the URL")
        size, tag = found
        return size, "" if tag is None else tag

    def reader(self, name: str, size: int, version: str, whole: bool = False) -> Any:
        """An open reader of the remote file ``name`` as :meth:`info` found it (pinned to
        that ETag); ``whole``: through the shard cache where there is one (an index)."""
        backend = self.index_backend if whole else self.backend
        expected = ExpectedFile(size, None, version or None)
        reader = backend.shard_reader(self.path(name), expected)
        reader.open()
        return reader

    def head(self, name: str, count: int) -> tuple[bytes, int]:
        """The first ``count`` bytes of file ``name`` (fewer in a shorter file) and its size
        (unpinned: what an object's construction reads)."""
        path = self.path(name)
        if not self.remote:
            with open(path, "rb") as handle:
                return handle.read(count), os.fstat(handle.fileno()).st_size
        reader = resolve_backend(self.backend).reader(path)
        reader.open()
        try:
            size = int(reader.filesize())
            return bytes(reader.read(0, min(count, size))), size
        finally:
            reader.close()

    def whole(self, name: str, size: int, version: str) -> bytes:
        """The whole remote file ``name``, as :meth:`info` found it: downloaded once into
        the shard cache (``cache_dir``) and read from there, else one ranged request."""
        reader = self.reader(name, size, version, whole=True)
        try:
            buffer = getattr(reader, "buffer", None)
            return bytes(buffer() if callable(buffer) else reader.read(0, size))
        finally:
            reader.close()

    def sidecars(self, first: PurePath, name: str) -> list[Path]:
        """Where the sidecar ``name`` of a corpus whose first file is ``first`` may go:
        beside it (local files), then under ``cache_dir``; at a URL, only there."""
        places = [] if self.remote else [Path(first).absolute().parent / name]
        if self.cache_dir is not None:
            places.append(self.cache_dir / name)
        return places


def locate(
    files: Sequence[PurePath],
    *,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    read_interface: Any = None,
) -> CorpusLocation:
    """The location of ``files`` (from :func:`corpus_paths`); at a URL its backends made
    (fsspec imported now: a missing package is an ``ImportError`` naming it)."""
    directory = _common(files)
    if isinstance(directory, RemotePath):
        names = [str(file.relative_to(directory)) for file in files]
    else:
        names = [os.fspath(Path(file).absolute().relative_to(directory)) for file in files]
    cache = None if cache_dir is None else Path(os.fspath(cache_dir))
    if not isinstance(directory, RemotePath):
        return CorpusLocation(directory, names, cache_dir=cache)
    if read_interface is not None:
        raise ValueError(
            f"read_interface={read_interface!r} cannot read {directory}: a URL is read in "
            f"byte ranges through fsspec. Drop read_interface (pass storage_options= for the "
            f"store's options), or give local paths with your backend"
        )
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(f"retry must be a RetryPolicy, got {retry!r}")
    url = str(directory)
    backend = remote_backend(url, storage_options, retry)
    shard_cache = None if cache is None else ShardCache(cache)
    index = (
        backend if shard_cache is None else remote_backend(url, storage_options, retry, shard_cache)
    )
    return CorpusLocation(directory, names, backend, index, cache)
