"""The commit protocol: a writer's shard files stay temporary, under a per-shard write lock,
until its close makes them visible atomically; shards written by GuideLoom are sealed with a record.

On disk a shard ``k`` of a dataset directory is one to three files named by the 7-digit
zero-padded id (``0000003.in_band.bin``, ``0000003.out_of_band.bin``,
``0000003.out_of_band.index``), byte for byte as GuideLoom 1.1 writes them. We add one
file of our own per shard, the *commit record* ``0000003.shard.json`` (GuideLoom ignores
it). It records the format kind, the stream dtype, the element or document count and each
file's size and CRC-32.

Writing a shard never exposes half-written data:

1. The first ``append`` to shard ``k`` creates ``0000003.shard.json.tmp`` and takes an
   exclusive ``flock`` on it (the *write lock*: a second writer of ``k`` fails at once; a
   lock left by a dead process is released by the kernel, so its leftover files are stale
   and the next writer replaces them). Data goes to ``<final name>.tmp`` files.
2. On a successful close, for all the shards of the writer together, step by step:
   (a) the data files are ``fsync``-ed and a *pending* record is written to
   ``0000003.shard.json.pending`` and ``fsync``-ed; (b) the pending record replaces the
   commit record (the old shard is no longer committed), then the directory is
   ``fsync``-ed; (c) the data files are renamed over their final names, then the directory
   is ``fsync``-ed; (d) the committed record is written into the lock file, ``fsync``-ed
   and renamed over the record (the commit point), then the directory is ``fsync``-ed.
   Three directory ``fsync`` calls per close, however many shards.
3. On an error (or ``abort``) the temporary files are removed: readers keep seeing the
   previous content of ``k``, or no shard ``k``. An error during (b) or (c) before any of
   the shard's data files was renamed puts its previous record back.

A crash after step 2b and before 2d leaves a pending record, which readers report (an
error during 2a leaves every shard as it was); once any shard of a dataset has a record, a
shard without one is reported as uncommitted. Datasets without any record (written by
GuideLoom) open as they are, with the checks their sizes allow.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import PurePath
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from guideloom_pipes.storage.errors import CorruptShardError, ShardLockedError
from guideloom_pipes.storage.names import PENDING, RECORD, TMP, check_shard_id, shard_name
from guideloom_pipes.storage.records import _CHUNK, FileRecord, ShardRecord


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _CountingFile:
    """A buffered temporary file that tracks its size and CRC-32."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.file: BinaryIO = os.fdopen(fd, "wb", buffering=1 << 20)
        self.size = 0
        self.crc32 = 0

    def write(self, data: Any) -> None:
        if isinstance(data, np.ndarray):
            if data.dtype.hasobject:
                raise TypeError(
                    f"cannot store an array of dtype {data.dtype}: it holds Python objects, "
                    f"whose bytes are pointers that mean nothing on disk; use numeric, bytes "
                    f"or string fields"
                )
            # Bytes of any dtype (memoryview refuses datetime64 and some structured ones).
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        view = memoryview(data).cast("B")
        self.file.write(view)
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += len(view)

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()

    def discard(self) -> None:
        """Close without reporting errors and remove the file (the shard is abandoned)."""
        with contextlib.suppress(OSError, ValueError):
            self.file.close()
        _unlink_quiet(self.path)


def _take_lock(path: str, shard: int, directory: str) -> int:
    """Open ``path`` and hold an exclusive ``flock`` on it; the descriptor."""
    deadline = time.monotonic() + 0.2  # a reader's stale-file probe holds it for microseconds
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            if time.monotonic() < deadline:
                time.sleep(0.005)
                continue
            raise ShardLockedError(
                error.errno,
                f"shard {shard_name(shard)} of {directory} is being written by another writer "
                f"(it holds the lock on {path}); write each shard id from one writer at a time",
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            return fd
        os.close(fd)  # the lock file was committed or removed under us: take the new one


def _is_locked(path: str) -> bool:
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


class ShardTransaction:
    """The temporary files of one shard being written, committed or aborted as a unit.

    Committing runs in four steps (see the module docstring); :func:`commit_transactions`
    runs each step for a group of shards before the next, so one ``fsync`` of the
    directory per step covers the whole group.

    Args:
        directory: the dataset directory (a local path).
        shard: the shard id.
        kind: the format kind recorded in the commit record.
        suffixes: the files of the shard, e.g. ``(".in_band.bin",)``.
    """

    def __init__(self, directory: str, shard: int, kind: str, suffixes: Sequence[str]) -> None:
        self.directory = directory
        self.shard = shard
        self.kind = kind
        self.suffixes = tuple(suffixes)
        self.done = False
        self.stage = "writing"
        self.record: ShardRecord | None = None
        stem = os.path.join(directory, shard_name(shard))
        self._stem = stem
        self._record_path = stem + RECORD
        self._lock_path = stem + RECORD + TMP
        self._pending_path = stem + RECORD + PENDING
        self._old_record: bytes | None = None
        self._renamed = 0
        self._lock_fd = _take_lock(self._lock_path, shard, directory)
        self._lock_linked = True  # the lock file still has its .tmp name
        self.files: dict[str, _CountingFile] = {}
        try:
            for suffix in self.suffixes:
                self.files[suffix] = _CountingFile(stem + suffix + TMP)
        except BaseException:
            self.abort()
            raise

    def prepare(self, count: int, dtype: np.dtype[Any] | None, payloads: int | None = None) -> None:
        """Step 1: ``fsync`` the data files and write the pending record (not yet in place)."""
        for handle in self.files.values():
            handle.sync()
            handle.close()
        self.record = ShardRecord(
            kind=self.kind,
            shard=self.shard,
            count=count,
            files={s.lstrip("."): FileRecord(h.size, h.crc32) for s, h in self.files.items()},
            dtype=dtype,
            payloads=payloads,
            state="pending",
        )
        try:
            with open(self._record_path, "rb") as old:
                self._old_record = old.read()
        except FileNotFoundError:
            self._old_record = None
        with open(self._pending_path, "wb") as out:
            out.write(self.record.to_json())
            out.flush()
            os.fsync(out.fileno())
        self.stage = "prepared"

    def install(self) -> None:
        """Step 2: the pending record replaces the committed one; the old shard is gone."""
        os.replace(self._pending_path, self._record_path)
        self.stage = "installed"

    def publish(self) -> None:
        """Step 3: rename the data files over their final names."""
        for suffix in self.suffixes:
            os.replace(self._stem + suffix + TMP, self._stem + suffix)
            self._renamed += 1
        self.stage = "published"

    def finish(self) -> None:
        """Step 4 (the commit point): the committed record replaces the pending one."""
        assert self.record is not None
        self.record.state = "committed"
        self._replace_record(self.record.to_json())
        self.stage = "committed"

    def _replace_record(self, data: bytes) -> None:
        _install_record(self._lock_fd, self._lock_path, self._record_path, data)
        self._lock_linked = False

    def release(self) -> None:
        """Drop the write lock (after the commit)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self.done = True

    def commit(self, count: int, dtype: np.dtype[Any] | None, payloads: int | None = None) -> None:
        """Make this shard visible (all four steps); see :func:`commit_transactions`."""
        commit_transactions(
            self.directory, [self], lambda _: {"count": count, "dtype": dtype, "payloads": payloads}
        )

    def abort(self) -> None:
        """Remove the temporary files; the committed shard (if any) stays as it was.

        After step 2, and before any data file was renamed, the previous commit record is
        put back. Once a data file was renamed, the pending record stays, so readers report
        the shard as uncommitted rather than read a mix of old and new files.
        """
        for handle in self.files.values():
            handle.discard()
        _unlink_quiet(self._pending_path)
        if self.stage == "installed" and self._renamed == 0 and self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                if self._old_record is None:
                    os.unlink(self._record_path)
                else:
                    self._replace_record(self._old_record)
                _fsync_directory(self.directory)
        if self._lock_fd >= 0:
            if self._lock_linked:
                _unlink_quiet(self._lock_path)  # still ours: nobody else can lock it
            os.close(self._lock_fd)
            self._lock_fd = -1
        self.done = True


def commit_transactions(
    directory: str,
    transactions: Sequence[ShardTransaction],
    commit_args: Callable[[ShardTransaction], dict[str, Any]],
) -> None:
    """Commit a group of shards of ``directory``: each step for every shard, then the next.

    ``commit_args(transaction)`` gives the keyword arguments of
    :meth:`ShardTransaction.prepare` (it may still write to the transaction's files).
    An error before any shard's pending record is in place (the usual case: a full disk
    while flushing) leaves every shard as it was. On any error the unfinished shards are
    aborted and the error re-raised.
    """
    try:
        for transaction in transactions:
            transaction.prepare(**commit_args(transaction))
        if not transactions:
            return
        for transaction in transactions:
            transaction.install()
        _fsync_directory(directory)  # no data file is renamed before its pending record lands
        for transaction in transactions:
            transaction.publish()
        _fsync_directory(directory)
        for transaction in transactions:
            transaction.finish()
        _fsync_directory(directory)
    except BaseException:
        for transaction in transactions:
            if transaction.stage != "committed":
                transaction.abort()
        raise
    finally:
        for transaction in transactions:
            if transaction.stage == "committed":
                transaction.release()


def _install_record(lock_fd: int, lock_path: str, record_path: str, data: bytes) -> None:
    """The lock file becomes the record: it is ours alone while we hold its lock."""
    os.pwrite(lock_fd, data, 0)
    os.ftruncate(lock_fd, len(data))
    os.fsync(lock_fd)
    os.replace(lock_path, record_path)


def seal_shard(
    directory: str,
    shard: int,
    kind: str,
    suffixes: Sequence[str],
    sizes: dict[str, int],
    count: int,
    dtype: np.dtype[Any] | None,
    payloads: int | None = None,
) -> bool:
    """Write a commit record for shard files already in place (written by GuideLoom).

    Holds the shard's write lock while it checksums the files and installs the record, and
    refuses files whose size changed since they were checked. False if another writer
    committed the shard meanwhile (its record is kept).
    """
    stem = os.path.join(directory, shard_name(shard))
    lock_path = stem + RECORD + TMP
    fd = _take_lock(lock_path, shard, directory)
    try:
        if os.path.exists(stem + RECORD):
            _unlink_quiet(lock_path)
            return False
        files: dict[str, FileRecord] = {}
        for suffix in suffixes:
            path = stem + suffix
            crc, size = 0, 0
            with open(path, "rb") as data:
                while chunk := data.read(_CHUNK):
                    crc = zlib.crc32(chunk, crc)
                    size += len(chunk)
            if size != sizes[suffix]:
                _unlink_quiet(lock_path)
                raise CorruptShardError(
                    f"{path} changed while it was being sealed ({sizes[suffix]} -> {size} "
                    f"bytes); seal again once no other process writes it"
                )
            files[suffix.lstrip(".")] = FileRecord(size, crc)
        record = ShardRecord(kind, shard, count, files, dtype, payloads, state="committed")
        _install_record(fd, lock_path, stem + RECORD, record.to_json())
        return True
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _too_many_files(error: OSError, shard: int, open_shards: int, per_shard: int) -> OSError:
    import resource

    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return OSError(
        error.errno,
        f"too many open files while starting shard {shard_name(shard)}: a writer keeps "
        f"{per_shard} file descriptors open per shard it writes until it closes, and this one "
        f"has {open_shards} shards open (the limit is {limit} descriptors per process). Write "
        f"at most about {max(1, open_shards - open_shards // 10)} shards per writer (close it "
        f"and open a new one for the next shards), or raise the limit (ulimit -n)",
    )


class ShardWriterBase:
    """Bookkeeping shared by the writers: one transaction per touched shard, commit on close.

    Subclasses implement ``append``: they check the record, call :meth:`_transaction` for
    the shard, write, and call :meth:`_written` once the append succeeded. A shard whose
    appends were all refused is not committed (it keeps its previous content).
    """

    kind = ""
    suffixes: tuple[str, ...] = ()

    def __init__(self, directory: PurePath) -> None:
        self.directory = os.fspath(directory)
        self._transactions: dict[int, ShardTransaction] = {}
        self._appended: set[int] = set()
        self._closed = False
        self._lock = threading.Lock()

    def open(self) -> None:
        """Create the directory if needed (also done by ``with``)."""
        os.makedirs(self.directory, exist_ok=True)

    def __enter__(self) -> Any:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"this writer of {self.directory} is closed (committed or aborted), it takes "
                f"no more appends; open a new one with storage.sync_writer()"
            )

    def _transaction(self, shard: Any) -> ShardTransaction:
        shard = check_shard_id(shard)
        self._check_open()
        transaction = self._transactions.get(shard)
        if transaction is None:
            os.makedirs(self.directory, exist_ok=True)
            try:
                transaction = ShardTransaction(self.directory, shard, self.kind, self.suffixes)
            except OSError as error:
                if error.errno in (errno.EMFILE, errno.ENFILE):
                    raise _too_many_files(
                        error, shard, len(self._transactions), len(self.suffixes) + 1
                    ) from error
                raise
            self._transactions[shard] = transaction
        return transaction

    def _written(self, shard: int) -> None:
        """Record that an append to ``shard`` succeeded (its transaction will commit)."""
        self._appended.add(shard)

    def _commit_args(self, shard: int) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Commit every shard this writer touched, each atomically.

        Either every shard is committed, or the error is raised; shards whose commit did
        not finish then read as before, or (after a failure in the middle of renaming their
        files) are reported as uncommitted, never as a mix of old and new.
        """
        if self._closed:
            return
        self._closed = True
        for shard, transaction in self._transactions.items():
            if shard not in self._appended and not transaction.done:
                transaction.abort()  # every append to it was refused: keep the old shard
        transactions = [t for s, t in sorted(self._transactions.items()) if s in self._appended]
        commit_transactions(self.directory, transactions, lambda t: self._commit_args(t.shard))

    def abort(self) -> None:
        """Drop everything written in this session; committed shards stay as they were."""
        self._closed = True
        for transaction in self._transactions.values():
            if not transaction.done:
                transaction.abort()

    def __del__(self) -> None:
        # A writer dropped without close() must not leave locks or temporaries behind.
        try:
            if not self._closed:
                self.abort()
        except Exception:
            pass
