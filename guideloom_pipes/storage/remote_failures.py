"""How reading a remote dataset fails: the errors raised (:class:`RemoteReadError`,
:class:`RangeIgnoredError`), which failures are transient and retried, and how
(:class:`RetryPolicy`, :func:`is_transient`), which are a server's refusal (HTTP
401/403/404, S3 ``AccessDenied``/``NoSuchKey``) or an object that changed (HTTP 412).
"""

from __future__ import annotations

import errno
import logging
import pickle
import random
from collections.abc import Iterator
from dataclasses import dataclass

from guideloom_pipes.checks import check_int
from guideloom_pipes.storage.errors import DatasetChangedError, StorageError
from guideloom_pipes.storage.names import SHARD_NAME, shard_name

#: Each retry of a remote read is logged here at INFO (what failed, the attempt, the error).
logger = logging.getLogger("guideloom_pipes.remote")


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


def _changed(url: str, etag: str, now: str | None = None, hint: str = "") -> DatasetChangedError:
    seen = f"the server's is now {now}" if now else "the server refused a read of that version"
    return DatasetChangedError(
        f"{url} ({_shard_label(url)}) changed after this reader opened the dataset (its ETag "
        f"was {etag}; {seen}): the object was replaced under an open reader, which reads only "
        f"the version it opened. Open the dataset again (a new reader) to read the new "
        f"version{hint}"
    )


def _describe(error: BaseException) -> str:
    """``Type: message``, or the type alone for an error with no message (a timeout)."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _shard_label(url: str) -> str:
    match = SHARD_NAME.match(url.rpartition("/")[2])
    return f"shard {shard_name(int(match.group('shard')))}" if match else "the dataset"
