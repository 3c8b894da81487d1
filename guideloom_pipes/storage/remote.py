"""Datasets at a URL: :class:`FsspecIO`, a read backend that reads byte ranges of objects
through fsspec (``s3://``, ``gs://``, ``http(s)://``, any fsspec protocol), retrying transient
failures (:class:`RetryPolicy`) and never returning a short read as data.

fsspec is optional (``pip install guideloom_pipes[remote]``): it is imported only when a
storage is given a URL. A storage built from ``"s3://bucket/prefix"`` keeps its location as
a :class:`RemotePath` (a ``PurePosixPath`` whose ``str`` is the URL again), so the rest of
the storage layer joins names to it as to any directory; listing, commit records and size
checks run as for a local dataset (see ``listing.py`` and ``verify.py``).

A storage reader's shard files are pinned at the ETag its open listed (conditional reads,
``If-Match``), and with a ``cache_dir`` they are read through the node-local shard cache
(``cache.py``): downloaded whole once, then memory-mapped.

This module holds the backend (:class:`FsspecIO`, :class:`ListingFsspecIO`) and the resolution
of a storage's location; URLs as paths are in ``remote_paths.py``, the errors and the retry
policy in ``remote_failures.py``, the shard readers in ``remote_readers.py``. Every name of
``__all__`` is importable from here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import PurePath
from typing import Any, TypeVar

from guideloom_pipes.storage.backend_base import BackendBase
from guideloom_pipes.storage.cache import ShardCache
from guideloom_pipes.storage.records import ExpectedFile
from guideloom_pipes.storage.remote_failures import (
    RangeIgnoredError,
    RemoteReadError,
    RetryPolicy,
    _changed,
    _describe,
    _picklable,
    _precondition_failed,
    _refused,
    _shard_label,
    is_transient,
    logger,
)
from guideloom_pipes.storage.remote_paths import RemotePath, file_url_path, is_url
from guideloom_pipes.storage.remote_readers import _CachedReader, _protocols, _RemoteReader
from guideloom_pipes.types import IOSyncReaderAbstract

T = TypeVar("T")

#: Protocols whose "directories" cannot be listed reliably: shards are found by probing ids.
_UNLISTABLE = frozenset({"http", "https"})


def _import_fsspec(url: str) -> Any:
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"reading {url} needs fsspec, an optional dependency: pip install "
            f"guideloom_pipes[remote] (plus the protocol's own package, e.g. s3fs for s3://, "
            f"gcsfs for gs://)"
        ) from None
    return fsspec


class FsspecIO(BackendBase):
    """Reads objects under a URL through fsspec, a byte range per read.

    Built by the storages for a URL location (``StreamStorage("s3://bucket/data", fmt)``);
    you do not pass it as ``read_interface``. Every request (size, ranged read, listing) is
    retried on transient failures as ``retry`` says; a ranged read that returns fewer bytes
    than the object holds there is retried too, and never returned.

    Args:
        url: the dataset's URL (any fsspec protocol).
        storage_options: keyword arguments of the fsspec file system (credentials,
            ``endpoint_url``, ``client_kwargs``, ...), as in ``fsspec.open``.
        retry: the :class:`RetryPolicy` (default ``RetryPolicy()``).
        cache: a :class:`~guideloom_pipes.storage.cache.ShardCache`: the shard files a
            reader opens are downloaded whole into it once, then read memory-mapped (None:
            range mode, every read a request).

    A storage reader pins each object at the version its open listed (its ETag): reads
    are conditional (``If-Match`` over HTTP and S3), and an object replaced since is a
    :class:`~guideloom_pipes.storage.DatasetChangedError`, never bytes of two versions.
    """

    #: an open reader holds no descriptor: the storages keep every reader open
    holds_fd = False
    #: requests an open of the dataset keeps in flight (records, sizes)
    open_concurrency = 16

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        cache: ShardCache | None = None,
    ) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.retry = RetryPolicy() if retry is None else retry
        self.cache = cache
        self._fs: Any = None
        self._lock = threading.Lock()

    @staticmethod
    def is_supported() -> bool:
        """Whether fsspec is installed."""
        try:
            import fsspec  # noqa: F401
        except ImportError:
            return False
        return True

    @property
    def fs(self) -> Any:
        """The fsspec file system (made on first use, in each process)."""
        fs = self._fs
        if fs is None:
            with self._lock:
                if self._fs is None:
                    fsspec = _import_fsspec(self.url)
                    self._fs = fsspec.core.url_to_fs(self.url, **self.storage_options)[0]
                fs = self._fs
        return fs

    def call(self, what: str, url: str, function: Callable[[], T]) -> T:
        """``function()``, tried again on transient failures as :attr:`retry` says; then a
        :class:`RemoteReadError` naming ``what`` was done, ``url``, the shard, the attempts.
        A refusal is raised at once, as a ``PermissionError`` (HTTP 401/403, S3
        ``AccessDenied``) or ``FileNotFoundError`` (HTTP 404, S3 ``NoSuchKey``) naming the
        same and the server's answer."""
        policy = self.retry
        started = time.monotonic()
        unchained: OSError | None = None
        for attempt in range(1, policy.attempts + 1):
            try:
                return function()
            except Exception as error:
                if not is_transient(error):
                    refused = _refused(what, url, error, self._speaks_http())
                    if refused is None:
                        raise
                    if _picklable(error):
                        raise refused from error
                    # aiohttp's errors do not pickle, and where tblib's pickling is
                    # installed (importing dask.distributed does that) an error crossing a
                    # worker process is pickled with its cause and context: raised below,
                    # outside this handler, it has neither
                    unchained = refused
                    break
                if attempt == policy.attempts:
                    elapsed = time.monotonic() - started
                    raise RemoteReadError(
                        f"{what} {url} ({_shard_label(url)}) failed {attempt} time(s) over "
                        f"{elapsed:.1f} s with transient errors, the last: "
                        f"{_describe(error)}. The server or the network kept "
                        f"failing; check them, or allow more attempts (retry=RetryPolicy("
                        f"attempts=...))"
                    ) from error
                delay = policy.delay(attempt)
                logger.info(
                    "%s %s (%s): attempt %d of %d failed with a transient error (%s); "
                    "trying again in %.3f s",
                    what,
                    url,
                    _shard_label(url),
                    attempt,
                    policy.attempts,
                    _describe(error),
                    delay,
                )
                time.sleep(delay)
        if unchained is not None:
            raise unchained
        raise AssertionError("unreachable")  # pragma: no cover

    def _speaks_http(self) -> bool:
        """Whether the file system is fsspec's plain HTTP(S) one."""
        return any(p in ("http", "https") for p in _protocols(self.fs))

    def once(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One try of the file system's ``method(*args, **kwargs)``; on an asynchronous file
        system abandoned after :attr:`RetryPolicy.timeout` seconds with fsspec's
        ``FSTimeoutError`` (a transient failure: :meth:`call` tries again)."""
        fs = self.fs
        timeout = self.retry.timeout
        if timeout is not None and getattr(fs, "async_impl", False):
            from fsspec.asyn import sync

            # the coroutine is cancelled at the deadline, its connection released
            return sync(fs.loop, getattr(fs, "_" + method), *args, timeout=timeout, **kwargs)
        return getattr(fs, method)(*args, **kwargs)

    def request(self, what: str, url: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """:meth:`once` through :meth:`call`: retried on transient failures, timeouts
        included."""
        return self.call(what, url, lambda: self.once(method, *args, **kwargs))

    def ranged(self, url: str, start: int, end: int, etag: str | None) -> bytes:
        """One try of bytes ``start..end`` of ``url``; with an ``etag``, only of that
        version of the object (``If-Match``: HTTP and S3; a 412 is a
        :class:`DatasetChangedError`). Other protocols read without the condition (their
        pin is checked when a reader opens)."""
        fs = self.fs
        if etag is None:
            return bytes(self.once("cat_file", url, start=start, end=end))
        try:
            if hasattr(fs, "_call_s3"):  # s3fs: GetObject with IfMatch
                return bytes(self._run(_s3_get, fs, url, start, end, etag))
            if any(p in ("http", "https") for p in _protocols(fs)):
                headers = {**dict(getattr(fs, "kwargs", {}).get("headers") or {}), "If-Match": etag}
                return bytes(self.once("cat_file", url, start=start, end=end, headers=headers))
        except Exception as error:
            if _precondition_failed(error):
                raise _changed(url, etag) from error
            raise
        return bytes(self.once("cat_file", url, start=start, end=end))

    def read_object(self, what: str, url: str) -> bytes:
        """The whole of the (small) object at ``url`` in one request, retried as
        :meth:`call` says: fsspec's S3 file system asks for the size of an object before it
        reads it whole, a second request that an open from a manifest does without."""
        if hasattr(self.fs, "_call_s3"):
            return self.call(what, url, lambda: bytes(self._run(_s3_get, self.fs, url)))
        return bytes(self.request(what, url, "cat_file", url))

    def _run(self, function: Callable[..., Any], *args: Any) -> Any:
        """One try of the coroutine ``function(*args)`` on the file system's event loop,
        abandoned after :attr:`RetryPolicy.timeout` seconds."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, function, *args, timeout=self.retry.timeout)

    def _make(self, path: PurePath) -> _RemoteReader:
        return _RemoteReader(self, str(path))

    def shard_reader(self, path: PurePath, expected: ExpectedFile) -> IOSyncReaderAbstract:
        """The reader of a shard file that a storage reader's open found as ``expected``:
        pinned to its ETag, through the shard cache where there is one."""
        if self.cache is not None:
            return _CachedReader(self, str(path), expected)
        return _RemoteReader(self, str(path), expected)

    def __getstate__(self) -> dict[str, Any]:
        # the file system (sessions, event loop) is made again in each process
        state = dict(self.__dict__)
        state["_fs"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class ListingFsspecIO(FsspecIO):
    """:class:`FsspecIO` for stores that list a prefix (object stores, not HTTP): discovery
    lists it, with sizes, so a gap in the shard ids is found and no size costs a request."""

    def list_dir_sizes(self, path: PurePath) -> dict[str, int]:
        """The name and size of each object directly under ``path``."""
        return {name: size for name, (size, _) in self.list_dir_details(path).items()}

    def list_dir_details(self, path: PurePath) -> dict[str, tuple[int, str | None]]:
        """The name, size and ETag (None where the store gives none) of each object
        directly under ``path``."""
        url = str(path)

        self.fs.invalidate_cache(url)  # a listing cached by an earlier open may be stale
        try:
            entries = list(self.request("listing", url, "ls", url, detail=True))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"dataset {url} does not exist (nothing under that prefix); check the URL"
            ) from None
        found = {}
        for entry in entries:
            if entry.get("type", "file") != "file":
                continue
            name = str(entry["name"]).rstrip("/").rpartition("/")[2]
            tag = entry.get("ETag") or entry.get("etag")
            found[name] = (int(entry.get("size") or 0), str(tag) if tag else None)
        return found

    def list_dir(self, path: PurePath) -> Iterable[str]:
        """The names of the objects directly under ``path``."""
        return list(self.list_dir_sizes(path))


async def _s3_get(
    fs: Any, url: str, start: int | None = None, end: int | None = None, etag: str | None = None
) -> bytes:
    """Bytes ``start..end`` of an S3 object (all of it without ``start``), only if its
    ETag is still ``etag`` (where one is given)."""
    bucket, key, version = fs.split_path(url)
    extra = {"VersionId": version} if version else {}
    if start is not None and end is not None:
        extra["Range"] = f"bytes={start}-{end - 1}"
    if etag is not None:
        extra["IfMatch"] = etag
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
    try:
        return bytes(await response["Body"].read())
    finally:
        response["Body"].close()


def remote_backend(
    url: str,
    storage_options: dict[str, Any] | None,
    retry: RetryPolicy | None,
    cache: ShardCache | None = None,
) -> FsspecIO:
    """The backend for a dataset at ``url`` (not ``file://``): fsspec imported now, so a
    missing fsspec or protocol package is an error at once, naming what to install."""
    fsspec = _import_fsspec(url)
    protocol = url.partition("://")[0].lower()
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as error:
        raise ImportError(
            f"reading {url} needs the package of fsspec's {protocol!r} protocol: {error}"
        ) from None
    except ValueError as error:
        raise ValueError(f"{url}: fsspec knows no protocol {protocol!r} ({error})") from None
    cls = FsspecIO if protocol in _UNLISTABLE else ListingFsspecIO
    return cls(url.rstrip("/"), storage_options, retry, cache)


def resolve_location(
    location: Any,
    read_interface: Any,
    storage_options: dict[str, Any] | None,
    retry: RetryPolicy | None,
    cache_dir: Any = None,
    cache_limit_bytes: int | None = None,
) -> tuple[PurePath, Any]:
    """A storage's location and backend from what it was given: a URL's
    :class:`RemotePath` and :class:`FsspecIO` (with a
    :class:`~guideloom_pipes.storage.cache.ShardCache` where ``cache_dir`` is given; a
    ``file://`` URL: its local path and ``read_interface``); anything else as it is."""
    if cache_dir is None and cache_limit_bytes is not None:
        raise ValueError(
            f"cache_limit_bytes={cache_limit_bytes!r} bounds the shard cache, which is on only "
            f"with cache_dir=: pass cache_dir='/local/disk/cache' too, or drop cache_limit_bytes"
        )
    cache = None if cache_dir is None else ShardCache(cache_dir, cache_limit_bytes)
    if not is_url(location):
        return location, read_interface
    local = file_url_path(location)
    if local is not None:
        return local, read_interface
    if read_interface is not None:
        raise ValueError(
            f"read_interface={read_interface!r} cannot read {location}: a URL is read in "
            f"byte ranges through fsspec. Drop read_interface (pass storage_options= for the "
            f"store's options), or give a local Path with your backend"
        )
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(f"retry must be a RetryPolicy, got {retry!r}")
    backend = remote_backend(location, storage_options, retry, cache)
    return RemotePath(backend.url), backend


__all__ = [
    "FsspecIO",
    "ListingFsspecIO",
    "RangeIgnoredError",
    "RemotePath",
    "RemoteReadError",
    "RetryPolicy",
    "file_url_path",
    "is_transient",
    "is_url",
    "resolve_location",
]
