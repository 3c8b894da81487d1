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
"""

from __future__ import annotations

import errno
import logging
import pickle
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

from guideloom_pipes.checks import check_int
from guideloom_pipes.storage.cache import CachedFile, ShardCache
from guideloom_pipes.storage.checksums import BlockChecksums
from guideloom_pipes.storage.errors import CorruptShardError, DatasetChangedError, StorageError
from guideloom_pipes.storage.io import BackendBase, _MmapReader
from guideloom_pipes.storage.names import RECORD, SHARD_NAME, shard_name
from guideloom_pipes.storage.records import ExpectedFile, ShardRecord
from guideloom_pipes.types import IOSyncReaderAbstract

T = TypeVar("T")

#: Each retry of a remote read is logged here at INFO (what failed, the attempt, the error).
logger = logging.getLogger("guideloom_pipes.remote")

#: Protocols whose "directories" cannot be listed reliably: shards are found by probing ids.
_UNLISTABLE = frozenset({"http", "https"})


def is_url(location: Any) -> bool:
    """Whether a storage location is a URL: a ``str`` containing ``://`` (a ``Path`` never is)."""
    return isinstance(location, str) and "://" in location


def file_url_path(url: str) -> Path | None:
    """The local path of a ``file://`` URL, or None for any other URL."""
    parsed = urlparse(url)
    if parsed.scheme != "file":
        return None
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(
            f"{url}: a file:// URL names a local path (file:///abs/path or "
            f"file://localhost/abs/path), not a file on host {parsed.netloc!r}"
        )
    return Path(unquote(parsed.path))


class RemotePath(PurePosixPath):
    """A URL held as a path: ``/`` joins names under it and ``str()`` (``os.fspath``) gives
    the URL back (``RemotePath("s3://bucket/data") / "x"`` is ``s3://bucket/data/x``).

    pathlib folds the ``//`` after the scheme into one ``/``; ``str`` puts it back.
    """

    def __str__(self) -> str:
        text = super().__str__()
        scheme, separator, rest = text.partition(":/")
        if separator and scheme.isascii() and "/" not in scheme:
            return f"{scheme}://{rest}"
        return text

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    @property
    def protocol(self) -> str:
        """The URL's scheme (``s3``, ``http``, ...)."""
        return str(self).partition("://")[0]


class RemoteReadError(StorageError, OSError):
    """A read of a remote dataset kept failing with transient errors (connection resets,
    timeouts, HTTP 5xx, S3 SlowDown) after every attempt its :class:`RetryPolicy` allows.
    The last failure is the ``__cause__``."""


class RangeIgnoredError(StorageError, OSError):
    """The server answered a ranged read with the whole object: it ignores the HTTP
    ``Range`` header, so a dataset cannot be read from it in byte ranges. Not retried."""


class _ShortRead(OSError):
    """A ranged read returned fewer bytes than the object holds there: never data."""


@dataclass(frozen=True)
class RetryPolicy:
    """How reads of a remote dataset retry transient failures.

    A transient failure (connection reset or refused, timeout, HTTP 5xx or 429, S3
    ``SlowDown`` / ``503``, a short read) is tried again after a delay that doubles each
    time, from ``base_delay`` up to ``max_delay`` seconds, each delay shortened by a random
    fraction up to ``jitter`` (so many readers do not retry in step). After ``attempts``
    tries in all, :class:`RemoteReadError` names the URL, the shard and the attempts. Other
    failures (a missing object, no permission) are raised at once.

    A request that has not finished after ``timeout`` seconds is abandoned and counts as a
    transient failure, so a server or connection that stops answering costs a retry, never
    a hung training job. The deadline covers the whole request (waiting for a connection
    included) on fsspec's asynchronous file systems (``http(s)://``, ``s3://``, ``gs://``,
    ``az://``); a synchronous one relies on its own client's timeouts.

    Args:
        attempts: tries in all, the first included (>= 1; 1 turns retrying off).
        base_delay: seconds before the second try.
        max_delay: longest delay between two tries.
        jitter: fraction (0..1) of each delay that is random.
        timeout: seconds one request may take (> 0), or None for no deadline of ours.
    """

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 10.0
    jitter: float = 0.5
    timeout: float | None = 60.0

    def __post_init__(self) -> None:
        check_int("attempts", self.attempts, minimum=1, hint="(1: no retries)")
        if not self.base_delay >= 0 or not self.max_delay >= 0:
            raise ValueError(
                f"base_delay and max_delay must be >= 0 seconds, got {self.base_delay} and "
                f"{self.max_delay}"
            )
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be between 0 and 1, got {self.jitter}")
        if self.timeout is not None and (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not self.timeout > 0
        ):
            raise ValueError(
                f"timeout must be a number of seconds > 0, or None for no deadline, got "
                f"{self.timeout!r}"
            )

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``failures``-th failed try (1 for the first)."""
        full = min(self.max_delay, self.base_delay * 2 ** (failures - 1))
        return full * (1 - self.jitter * (rng or random).random())


_TRANSIENT_ERRNOS = frozenset(
    code
    for code in (
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EBUSY,  # s3fs: SlowDown, ServiceUnavailable, 503
        errno.EAGAIN,
        getattr(errno, "EREMOTEIO", None),  # s3fs: InternalError, 500
        getattr(errno, "ENETRESET", None),
    )
    if code is not None
)
#: Exception classes (by name, so no client library is imported) that mean "try again".
_TRANSIENT_NAMES = frozenset(
    {
        # aiohttp (fsspec's http, s3fs)
        "ClientConnectionError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ClientPayloadError",
        "ConnectionTimeoutError",
        "SocketTimeoutError",
        # botocore / s3fs
        "HTTPClientError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "IncompleteRead",
        "FSTimeoutError",
        # requests / urllib3 / http.client
        "RemoteDisconnected",
        "ChunkedEncodingError",
        "ProtocolError",
        "_ShortRead",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
    }
)


def _transient_one(error: BaseException) -> bool:
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(error).__mro__):
        return True
    status = getattr(error, "status", None)  # aiohttp.ClientResponseError
    if isinstance(status, int) and (status >= 500 or status in (408, 429)):
        return True
    response = getattr(error, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        http = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _TRANSIENT_CODES or (isinstance(http, int) and http >= 500):
            return True
    return isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every error it was raised from (causes and contexts), each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a failure worth trying again:
    a connection reset, refused or closed early, a timeout, an HTTP 5xx / 408 / 429, an S3
    ``SlowDown`` / ``ServiceUnavailable`` / ``InternalError``, a short read.

    fsspec's HTTP client reports any failure to learn an object's size as
    ``FileNotFoundError``; the error it was raised from tells a real 404 from a 503.
    """
    return any(_transient_one(current) for current in _chain(error))


#: S3 error codes that mean "these credentials may not do this" (HTTP 403)
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
    }
)
#: S3 error codes that mean "no such object" (HTTP 404)
_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchVersion"})


def _answer(error: BaseException) -> tuple[int | None, str]:
    """The HTTP status of the server's answer that ``error`` (or one it was raised from)
    reports, and the server's words for it (``HTTP 403 Forbidden``, ``HTTP 403, S3
    AccessDenied: Access Denied``); ``(None, "")`` where none is found."""
    for current in _chain(error):
        status = getattr(current, "status", None)  # aiohttp.ClientResponseError
        if isinstance(status, int) and not isinstance(status, bool):
            reason = getattr(current, "message", None)
            return status, f"HTTP {status} {reason}" if reason else f"HTTP {status}"
        response = getattr(current, "response", None)  # botocore ClientError
        if isinstance(response, dict):
            details = response.get("Error", {})
            http = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code, said = details.get("Code"), details.get("Message")
            if code in _DENIED_CODES:
                http = http if isinstance(http, int) else 403
            elif code in _MISSING_CODES:
                http = http if isinstance(http, int) else 404
            if not isinstance(http, int):
                continue
            words = f"HTTP {http}"
            if code and not str(code).isdigit():  # a HEAD's answer has no body: its code is "403"
                words += f", S3 {code}" + (f": {said}" if said else "")
            elif said:
                words += f" {said}"
            return http, words
    return None, ""


def _refused(what: str, url: str, error: BaseException, http: bool) -> OSError | None:
    """``error`` as the error a user can act on, where the server refused the request:
    :class:`PermissionError` for HTTP 401/403 and S3 ``AccessDenied`` (and the like),
    :class:`FileNotFoundError` for HTTP 404 and S3 ``NoSuchKey``, an ``OSError`` for
    another 4xx, each naming what was done, the URL, the shard and the server's answer
    (and each picklable, unlike aiohttp's errors, so it crosses a worker process). None
    for any other error (ours included), which is raised as it is. ``http``: whether the
    file system speaks plain HTTP (fsspec's HTTP client raises a bare
    ``FileNotFoundError(url)`` for a 404)."""
    if isinstance(error, StorageError):
        return None
    status, words = _answer(error)
    if status is None and isinstance(error, PermissionError):
        status, words = 403, _describe(error)
    if status is None and isinstance(error, FileNotFoundError):
        status, words = 404, "HTTP 404 Not Found" if http else _describe(error)
    where = f"{what} {url} ({_shard_label(url)})"
    refused: OSError
    if status in (401, 403):
        refused = PermissionError(
            f"{where} was refused: {words}. The server does not let this reader read it: "
            f"check the object's permissions there (file mode, bucket policy, IAM role), "
            f"the credentials (storage_options=) and the URL"
        )
        refused.errno = errno.EACCES
        return refused
    if status in (404, 410):
        refused = FileNotFoundError(
            f"{where} failed: {words}. The object is not there: it was deleted or moved "
            f"(after the dataset was listed, if a reader had it open), or the URL is wrong. "
            f"Restore it, or open the dataset again (a new reader lists it again)"
        )
        refused.errno = errno.ENOENT
        return refused
    if status is not None and 400 <= status < 500:  # a client's own error (401/403/404 above)
        refused = OSError(
            f"{where} failed: {words}. The server refused the request, so trying it again "
            f"would not help; check the URL and what the server expects of its clients"
        )
        refused.errno = errno.EIO
        return refused
    return None


def _picklable(error: BaseException) -> bool:
    """Whether ``error`` survives ``pickle.dumps`` (an error path only: it costs a dump)."""
    try:
        pickle.dumps(error)
    except Exception:
        return False
    return True


def _precondition_failed(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is an HTTP 412: a conditional read
    (``If-Match``) of an object that changed."""
    for current in _chain(error):
        if getattr(current, "status", None) == 412:  # aiohttp
            return True
        response = getattr(current, "response", None)  # botocore ClientError
        if isinstance(response, dict) and (
            response.get("Error", {}).get("Code") == "PreconditionFailed"
            or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
        ):
            return True
    return False


def _changed(url: str, etag: str, now: str | None = None) -> DatasetChangedError:
    seen = f"the server's is now {now}" if now else "the server refused a read of that version"
    return DatasetChangedError(
        f"{url} ({_shard_label(url)}) changed after this reader opened the dataset (its ETag "
        f"was {etag}; {seen}): the object was replaced under an open reader, which reads only "
        f"the version it opened. Open the dataset again (a new reader) to read the new version"
    )


def _describe(error: BaseException) -> str:
    """``Type: message``, or the type alone for an error with no message (a timeout)."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _shard_label(url: str) -> str:
    match = SHARD_NAME.match(url.rpartition("/")[2])
    return f"shard {shard_name(int(match.group('shard')))}" if match else "the dataset"


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


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _strong(etag: str | None) -> bool:
    """Whether ``etag`` is a strong ETag: ``If-Match`` compares strongly, so a weak one
    (``W/"..."``, a server that compresses on the fly) would never match."""
    return etag is not None and not etag.startswith("W/")


async def _s3_get(fs: Any, url: str, start: int, end: int, etag: str) -> bytes:
    """Bytes ``start..end`` of an S3 object, only if its ETag is still ``etag``."""
    bucket, key, version = fs.split_path(url)
    extra = {"VersionId": version} if version else {}
    response = await fs._call_s3(
        "get_object",
        Bucket=bucket,
        Key=key,
        Range=f"bytes={start}-{end - 1}",
        IfMatch=etag,
        **extra,
    )
    try:
        return bytes(await response["Body"].read())
    finally:
        response["Body"].close()


def _check_length(url: str, start: int, end: int, size: int, got: int) -> None:
    """Refuse an answer of ``got`` bytes to a read of bytes ``start..end`` of an object of
    ``size`` bytes: the whole object where a part was asked for is a server that ignores
    ``Range`` (:class:`RangeIgnoredError`, not retried); any other length a
    :class:`_ShortRead` (retried)."""
    want = end - start
    if got == want:
        return
    if got == size:
        raise RangeIgnoredError(
            f"reading bytes {start}..{end} of {url} ({_shard_label(url)}): the server "
            f"answered with the whole object ({size} bytes) instead of those {want} bytes, so "
            f"it ignored the HTTP Range header. A dataset is read in byte ranges: serve it "
            f"from a server that honours Range requests (nginx, S3, a CDN with range "
            f"requests on), not through a proxy that drops the header"
        )
    raise _ShortRead(f"asked for bytes {start}..{end} ({want} bytes), got {got} bytes")


class _RemoteReader(IOSyncReaderAbstract):
    """Byte ranges of one object: its size on ``open`` (one request, none where the open
    of its dataset found it), a request per read; pinned to the ETag the open found."""

    def __init__(self, backend: FsspecIO, url: str, expected: ExpectedFile | None = None) -> None:
        self.backend = backend
        self.url = url
        self.expected = expected
        #: the object's ETag (None until open, or where the server gives none)
        self.etag: str | None = None
        self._pin: str | None = None
        self._size = -1

    def open(self) -> None:
        if self._size >= 0:
            return
        expected = self.expected
        if expected is not None and expected.size is not None and expected.etag is not None:
            self._size, self.etag = expected.size, expected.etag  # found by the open
            if _strong(expected.etag) and self._checks_each_read():
                self._pin = expected.etag  # every read is conditional
                return
            # no conditional reads (a weak ETag, another protocol): checked once, now
            now = self._info()[1]
            if now != expected.etag:
                raise _changed(self.url, expected.etag, now)
            return
        self._size, self.etag = self._info()
        if expected is not None and expected.etag is not None and self.etag != expected.etag:
            raise _changed(self.url, expected.etag, self.etag)
        if expected is not None and _strong(self.etag) and self._checks_each_read():
            self._pin = self.etag

    def _checks_each_read(self) -> bool:
        """Whether this protocol's reads can be made conditional on an ETag (If-Match)."""
        fs = self.backend.fs
        return hasattr(fs, "_call_s3") or any(p in ("http", "https") for p in _protocols(fs))

    def _info(self) -> tuple[int, str | None]:
        info = dict(self.backend.request("finding the size of", self.url, "info", self.url))
        if info.get("type") == "directory":
            raise IsADirectoryError(f"{self.url} is a directory, not a shard file")
        size = info.get("size")
        if size is None:
            raise OSError(
                f"{self.url}: the server did not say the object's size (no Content-Length), "
                f"so its shards cannot be checked against their commit records; serve the "
                f"files with their sizes (a static file server does)"
            )
        tag = info.get("ETag") or info.get("etag")
        return int(size), str(tag) if tag else None

    def close(self) -> None:
        self._size = -1

    def filesize(self) -> int:
        if self._size < 0:
            raise RuntimeError(f"reader of {self.url} is not open; call open() first")
        return self._size

    def read(self, offset: int, size: int) -> memoryview:
        """Bytes ``offset..offset + size`` (fewer past the end of the object), checked
        against the commit record: the range is widened to the whole blocks around it and
        each block's CRC-32 compared with the record's (records without block checksums:
        a read of the whole file is compared with the file's CRC-32)."""
        size_now = self.filesize()
        end = min(offset + size, size_now)
        want = max(0, end - offset)
        if want == 0:
            return memoryview(b"")
        expected = self.expected
        blocks = expected.blocks if expected is not None else None
        if blocks is not None and blocks.fits(size_now):
            start, stop = blocks.span(offset, end, size_now)
        else:
            start, stop, blocks = offset, end, None

        def fetch() -> bytes:
            data = self.backend.ranged(self.url, start, stop, self._pin)
            _check_length(self.url, start, stop, size_now, len(data))
            return data

        def ranged() -> memoryview:
            data = fetch()
            wrong = self._mismatch(data, start, blocks)
            if wrong is not None:  # a byte spoiled on the way is not there the next time
                logger.info("%s; reading it again", self._mismatch_text(wrong))
                data = fetch()
                wrong = self._mismatch(data, start, blocks)
                if wrong is not None:
                    raise self._refusal(offset, end, wrong)
            view = memoryview(data)
            return view if stop - start == want else view[offset - start : end - start]

        return self.backend.call(f"reading bytes {offset}..{end} of", self.url, ranged)

    def _mismatch(
        self, data: bytes, start: int, blocks: BlockChecksums | None
    ) -> tuple[int, int, int, int] | None:
        """``(first byte, end, CRC-32 read, CRC-32 committed)`` of the first block of
        ``data`` (read from ``start``) that differs from the record (without block
        checksums: of a read of the whole file that differs); None if none does."""
        if blocks is not None:
            found = blocks.mismatch(data, start)
            if found is None:
                return None
            block, crc = found
            first = block * blocks.block_size
            return first, min(first + blocks.block_size, start + len(data)), crc, blocks.crc(block)
        committed = self.expected.crc32 if self.expected is not None else None
        if committed is not None and start == 0 and len(data) == self._size:
            crc = zlib.crc32(data)
            if crc != committed:
                return 0, len(data), crc, committed
        return None

    def _mismatch_text(self, wrong: tuple[int, int, int, int]) -> str:
        first, last, crc, committed = wrong
        return (
            f"bytes {first}..{last} of {self.url} ({_shard_label(self.url)}) do not match its "
            f"commit record (crc32 {crc:#010x}, committed {committed:#010x})"
        )

    def _refusal(self, offset: int, end: int, wrong: tuple[int, int, int, int]) -> StorageError:
        """The error for bytes that differ from the record twice: a
        :class:`DatasetChangedError` where the shard's record changed since the open (the
        shard was committed again: this reader's view is old), else a
        :class:`CorruptShardError`."""
        asked = f", read for bytes {offset}..{end}" if (offset, end) != wrong[:2] else ""
        if self._recommitted():
            return DatasetChangedError(
                f"{self._mismatch_text(wrong)}{asked}, twice: the shard was committed again "
                f"after this reader opened the dataset (its commit record now describes other "
                f"content) and the object was replaced keeping its ETag (the same size and "
                f"modification time, as `rsync -a` can leave it). Open the dataset again (a "
                f"new reader) to read the new version"
            )
        return CorruptShardError(
            f"{self._mismatch_text(wrong)}{asked}, twice: the object is not the one that was "
            f"committed. It was changed in place without a new commit (a data file replaced by "
            f"one of the same size, e.g. by `rsync -a`, which keeps the modification time, so "
            f"the server's ETag did not change either), or it is corrupt in storage or on the "
            f"way. Restore the object or rewrite the shard; `guideloom-pipes verify URL` checks "
            f"every shard"
        )

    def _recommitted(self) -> bool:
        """Whether the shard's commit record, read again now (one try), describes this file
        otherwise than the record the open read; False where it cannot be told."""
        match = SHARD_NAME.match(self.url.rpartition("/")[2])
        if match is None or self.expected is None:
            return False
        url = f"{self.url.rpartition('/')[0]}/{shard_name(int(match['shard']))}{RECORD}"
        try:
            record = ShardRecord.from_json(bytes(self.backend.once("cat_file", url)), url)
        except Exception:  # gone, refused, unreadable: nothing to compare (the data is refused)
            return False
        entry = record.files.get(match["suffix"].lstrip("."))
        expected = self.expected
        return entry is None or (entry.crc32, entry.blocks) != (expected.crc32, expected.blocks)

    def readinto(self, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` with the bytes at ``offset`` (one ranged request); the bytes
        read, fewer than ``len(buffer)`` only past the end of the object."""
        data = self.read(offset, len(buffer))
        got = len(data)
        buffer[:got] = data
        return got


class _CachedReader(IOSyncReaderAbstract):
    """A shard file through the shard cache: downloaded whole on ``open`` where no process
    of the node has it yet (pinned ranged reads, the size and CRC-32 of its record
    checked), then reads of the memory-mapped local copy (checked by the cache when it is
    mapped)."""

    def __init__(self, backend: FsspecIO, url: str, expected: ExpectedFile) -> None:
        self.backend = backend
        self.url = url
        self.expected = expected
        self._local: _MmapReader | None = None

    def open(self) -> None:
        if self._local is not None:
            return
        cache = self.backend.cache
        assert cache is not None
        remote = _RemoteReader(self.backend, self.url, self.expected)
        remote.open()
        file = CachedFile(self.url, remote.filesize(), self.expected.crc32, remote.etag)

        def download(offset: int, size: int) -> memoryview:
            try:
                return remote.read(offset, size)
            except Exception as error:
                # botocore checks a GetObject's bytes against the checksum S3 keeps
                if not any(c.__name__ == "FlexibleChecksumError" for c in type(error).__mro__):
                    raise
                raise CorruptShardError(
                    f"{self.url} ({_shard_label(self.url)}): bytes {offset}..{offset + size} "
                    f"as received fail the checksum the store keeps for the object "
                    f"({_describe(error)}): something on the way (a proxy, the network) "
                    f"altered them, or the stored object is damaged. Nothing was cached; "
                    f"read again, and if it recurs check the path to the store or rewrite "
                    f"the shard"
                ) from error

        self._local = cache.open(file, download)

    def _reader(self) -> _MmapReader:
        if self._local is None:
            raise RuntimeError(f"reader of {self.url} is not open; call open() first")
        return self._local

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        self._local = None

    def filesize(self) -> int:
        return self._reader().filesize()

    def buffer(self) -> memoryview:
        """The whole local copy as a read-only memoryview."""
        return self._reader().buffer()

    def read(self, offset: int, size: int) -> bytearray:
        return self._reader().read(offset, size)


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
