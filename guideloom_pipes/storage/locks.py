"""The per-shard write locks of the commit protocol (:mod:`guideloom_pipes.storage.commit`):
an exclusive ``flock`` on the shard's ``.shard.json.tmp``, taken, dropped and probed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from guideloom_pipes.storage.commit import _unlink_quiet
from guideloom_pipes.storage.errors import ShardLockedError
from guideloom_pipes.storage.names import shard_name


def _take_lock(path: str, shard: int, directory: str, wait: float = 0.2) -> int:
    """Open ``path`` and hold an exclusive ``flock`` on it; the descriptor.

    Waits up to ``wait`` seconds for another holder (a reader's stale-file probe holds it
    for microseconds), then raises :class:`ShardLockedError`.
    """
    deadline = time.monotonic() + wait
    while True:
        fd = _lock_or_none(path)
        if fd is not None:
            os.ftruncate(fd, 0)
            return fd
        if time.monotonic() >= deadline:
            raise ShardLockedError(
                errno.EWOULDBLOCK,
                f"shard {shard_name(shard)} of {directory} is being written by another writer "
                f"(it holds the lock on {path}); write each shard id from one writer at a time",
            )
        time.sleep(0.005)


def _drop_lock(fd: int, path: str) -> None:
    """Remove the lock file (still ours: nobody else can lock it) and release the lock."""
    try:
        _unlink_quiet(path)
    finally:
        os.close(fd)


def is_locked(path: str) -> bool:
    """Whether a live writer holds the write lock on ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # gone (committed or aborted), or not a local file at all
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return True
        raise
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _lock_or_none(path: str) -> int | None:
    """Open ``path`` and take an exclusive ``flock`` on it without waiting; the descriptor,
    or None when another open file holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder removed it as it finished: take the new one
