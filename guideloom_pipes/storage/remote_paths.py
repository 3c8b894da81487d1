"""Locations that are URLs: telling one (:func:`is_url`), a ``file://`` URL's local path
(:func:`file_url_path`) and :class:`RemotePath`, a URL held as a path.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse


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
