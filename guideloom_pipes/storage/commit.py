"""The commit protocol: a writer's shard files stay temporary, under a per-shard write lock,
until its close makes them visible atomically, replacing any earlier version of the shard in
one step; shards written by GuideLoom are sealed with a record.

On disk a shard ``k`` of a dataset directory is one to three files named by the 7-digit
zero-padded id (``0000003.in_band.bin``, ``0000003.out_of_band.bin``,
``0000003.out_of_band.index``), byte for byte as GuideLoom 1.1 writes them. We add one
file of our own per shard, the *commit record* ``0000003.shard.json`` (GuideLoom ignores
it). It records the format kind, the stream dtype, the element or document count, each
file's size and CRC-32, and the shard's *generation* (how many times it was committed).
Readers read the files the record names.

Writing shard ``k`` (generation ``g`` on disk, ``0`` if none) never exposes half-written data
and never leaves it with neither its old nor its new version:

1. The first ``append`` to shard ``k`` creates ``0000003.shard.json.tmp`` and takes an
   exclusive ``flock`` on it (the *write lock*, held until the commit is over: a second
   writer of ``k`` fails at once; a lock left by a dead process is released by the kernel,
   so its leftover files are stale). Holding the lock, the writer first finishes whatever
   a stopped writer of ``k`` left (see *Recovery*). Data goes to ``<final name>.tmp``.
2. On a successful close, for all the shards of the writer together, step by step (each
   step for every shard, then one ``fsync`` of the directory):

   a. the data files are ``fsync``-ed and renamed to their *versioned* names
      ``0000003.v<g+1>.in_band.bin`` (GuideLoom never reads these names); directory
      ``fsync``;
   b. **the commit point**: a record of generation ``g + 1`` that names the versioned files
      is written to ``0000003.shard.json.pending``, ``fsync``-ed and renamed over the
      record; directory ``fsync``. Until this rename readers read the old version (or no
      shard ``k``); from it on, the new one;
   c. each versioned file is hard-linked to ``<final name>.tmp``, which is renamed over
      the canonical name (``0000003.in_band.bin``); directory ``fsync``;
   d. the record is rewritten (same way) to name the canonical files; directory ``fsync``;
   e. the versioned names are unlinked and the write lock released.

   Four directory ``fsync`` calls per close, however many shards. After a completed close
   every file is at its canonical name, so GuideLoom reads the dataset.
3. On an error (or ``abort``) before a shard's commit point its temporary and versioned
   files are removed: readers keep seeing its previous content, or no shard ``k``. After
   the commit point the shard is committed; an error in steps c-e leaves its record naming
   files that exist (versioned, or canonical), and the close raises, saying so.

*Recovery.* A crash at any moment leaves each shard's record naming a complete version
(old before 2b, new from it on). Leftovers are finished by the next writer of the shard,
by any writer's ``open`` (for the whole directory) and by ``storage.recover()``
(:func:`recover_directory`), each holding the shard's write lock: a record that names
versioned files is rolled forward (steps c-e again; each is idempotent), versioned files
that no record names (a commit stopped before 2b) and stale temporaries are removed. Until
then our readers read the committed version; GuideLoom, which reads canonical names only,
may see a mix of a multi-file shard's old and new files.

*Writer modes.* ``"update"`` (default) commits only the shards written, and warns at close
of shards that were there when the writer opened and remain above the highest one it
wrote; its first append refuses a dataset whose committed shards are of another kind or
dtype (:func:`refuse_other_kind`). ``"create"`` refuses a directory holding shard files,
and one that another create run holds (:class:`CreateLock`). ``"overwrite"`` also removes
every other shard (:class:`_Removal`): between steps 2a and 2b it takes their write locks
and replaces each one's record by one in state ``"deleted"``, highest id first (readers
treat such a shard as absent, so the ids never have a gap); after step 2e it removes their
data files, then their records. An error before the first commit point puts their records
back; a crash leaves the marks, which recovery completes.

*Fault hook.* Every write, ``fsync``, rename, link and unlink of this protocol first calls
:func:`_fault` (a no-op), which tests replace to inject an error or kill the process at
that step.

Once any shard of a dataset has a record, a shard without one is reported as
uncommitted. Datasets without any record (written by GuideLoom) open as they are, with the
checks their sizes allow. Records in state ``"pending"`` were left by the protocol of
earlier versions of this package (interrupted commits) and are reported as such.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import PurePath
from types import TracebackType
from typing import Any, BinaryIO, TypeVar

import numpy as np

from guideloom_pipes.storage.checksums import BlockCrc32
from guideloom_pipes.storage.errors import CorruptShardError, ShardLockedError, StorageError
from guideloom_pipes.storage.names import (
    CREATE_LOCK,
    IN_BAND,
    INDEX,
    OUT_OF_BAND,
    PENDING,
    RECORD,
    SHARD_NAME,
    TMP,
    check_shard_id,
    shard_ids,
    shard_name,
    versioned_name,
)
from guideloom_pipes.storage.records import _CHUNK, FileRecord, ShardRecord, format_name
from guideloom_pipes.storage.remote import RemotePath

#: every data-file suffix (a stopped writer's leftovers may be of any kind)
_DATA_SUFFIXES = (IN_BAND, OUT_OF_BAND, INDEX)


def _fault(step: str, path: str) -> None:
    """The fault-injection hook; does nothing.

    Called just before each write, ``fsync``, rename, link and unlink that writing,
    committing or recovering a shard makes, with the step (``"write"``, ``"fsync"``,
    ``"rename"``, ``"link"``, ``"unlink"``) and the path acted on (for a rename or a link:
    the new name). Tests replace it (``commit._fault = ...``) to raise an error or kill the
    process at any step.
    """


def _fsync(fd: int, path: str) -> None:
    _fault("fsync", path)
    os.fsync(fd)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _fsync(fd, directory)
    finally:
        os.close(fd)


def _rename(source: str, target: str) -> None:
    _fault("rename", target)
    os.replace(source, target)


def _link(source: str, target: str) -> None:
    _fault("link", target)
    os.link(source, target)


def _remove(path: str) -> bool:
    """Unlink ``path`` if it exists; whether it did."""
    if not os.path.lexists(path):
        return False
    _fault("unlink", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _unlink_quiet(path: str) -> None:
    """Unlink ``path``, ignoring every error (cleanup after a failure)."""
    with contextlib.suppress(OSError):
        _remove(path)


def _write_record(stem: str, data: bytes) -> None:
    """Replace the commit record of ``stem`` with ``data``, atomically: written to
    ``.shard.json.pending``, ``fsync``-ed, renamed over ``.shard.json``."""
    pending = stem + RECORD + PENDING
    _fault("write", pending)
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        _fsync(fd, pending)
    finally:
        os.close(fd)
    _rename(pending, stem + RECORD)


def _read_record(stem: str) -> ShardRecord | None:
    """The shard's commit record; None if it has none or it cannot be parsed (a reader
    reports that; a new commit replaces it)."""
    try:
        with open(stem + RECORD, "rb") as file:
            raw = file.read()
    except FileNotFoundError:
        return None
    try:
        return ShardRecord.from_json(raw, stem + RECORD)
    except StorageError:
        return None


class _CountingFile:
    """A buffered temporary file that tracks its size and CRC-32."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.file: BinaryIO = os.fdopen(fd, "wb", buffering=1 << 20)
        #: the CRC-32 of the file and of each of its blocks, as it is written
        self.checksums = BlockCrc32()

    @property
    def size(self) -> int:
        return self.checksums.size

    @property
    def crc32(self) -> int:
        return self.checksums.crc32

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
        _fault("write", self.path)
        self.file.write(view)
        self.checksums.update(view)

    def sync(self) -> None:
        _fault("write", self.path)
        self.file.flush()
        _fsync(self.file.fileno(), self.path)

    def close(self) -> None:
        self.file.close()

    def discard(self) -> None:
        """Close without reporting errors and remove the file (the shard is abandoned)."""
        with contextlib.suppress(OSError, ValueError):
            self.file.close()
        _unlink_quiet(self.path)


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


def _place(directory: str, record: ShardRecord) -> None:
    """Step c for one shard: give each versioned file of ``record`` its canonical name too
    (hard link to ``<name>.tmp``, renamed over ``<name>``). Idempotent."""
    stem = os.path.join(directory, shard_name(record.shard))
    for key in record.files:
        suffix = "." + key
        versioned = os.path.join(directory, record.file_name(suffix))
        temporary = stem + suffix + TMP
        _remove(temporary)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(versioned, stem + suffix):
                continue  # placed already (rename would do nothing and keep the link)
        _link(versioned, temporary)
        _rename(temporary, stem + suffix)


def _settle_record(directory: str, record: ShardRecord) -> ShardRecord:
    """Step d for one shard: the record names the canonical files."""
    settled = replace(record, versioned=False)
    _write_record(os.path.join(directory, shard_name(record.shard)), settled.to_json())
    return settled


def _remove_versions(directory: str, shard: int, generations: Sequence[int]) -> None:
    """Unlink the versioned files of ``generations`` of ``shard`` (step e, or cleanup)."""
    for generation in generations:
        for suffix in _DATA_SUFFIXES:
            _remove(os.path.join(directory, versioned_name(shard, generation, suffix)))


def _recover_shard(directory: str, shard: int) -> int:
    """Finish what a stopped writer of ``shard`` left (the caller holds its write lock).

    A committed record that names versioned files is rolled forward to the canonical names;
    a shard being removed (record in state ``"deleted"``) is removed; versioned files no
    record names are unlinked. Returns the shard's generation on disk.
    """
    stem = os.path.join(directory, shard_name(shard))
    record = _read_record(stem)
    if record is None:
        _remove_versions(directory, shard, (0, 1))
        return 0
    generation = record.generation
    if record.state == "committed" and record.versioned:
        named = [os.path.join(directory, record.file_name("." + k)) for k in record.files]
        if not all(os.path.exists(path) for path in named):
            _remove_versions(directory, shard, (generation + 1,))
            return generation  # a file it names is gone: readers report it, keep the rest
        _place(directory, record)
        _fsync_directory(directory)
        _settle_record(directory, record)
        _fsync_directory(directory)
    elif record.state == "deleted":
        _remove_shard_files(directory, shard)
    _remove_versions(directory, shard, (generation, generation + 1))
    return generation


def _remove_shard_files(directory: str, shard: int) -> None:
    """Remove a shard whose record says ``"deleted"``: its data files, then the record."""
    stem = os.path.join(directory, shard_name(shard))
    for suffix in _DATA_SUFFIXES:
        _remove(stem + suffix)
    _fsync_directory(directory)
    _remove(stem + RECORD)


class ShardTransaction:
    """The files of one shard being written, committed or aborted as a unit.

    Committing runs in steps (see the module docstring); :func:`commit_transactions` runs
    each step for a group of shards before the next, so one ``fsync`` of the directory per
    step covers the whole group.

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
        #: writing, prepared, versioned, committed (the commit point), placed, settled
        self.stage = "writing"
        self.record: ShardRecord | None = None
        stem = os.path.join(directory, shard_name(shard))
        self._stem = stem
        self._lock_path = stem + RECORD + TMP
        self._lock_fd = _take_lock(self._lock_path, shard, directory)
        self.files: dict[str, _CountingFile] = {}
        self.generation = 0  # none of ours yet: set once the shard's leftovers are recovered
        try:
            self.generation = _recover_shard(directory, shard) + 1
            for suffix in self.suffixes:
                self.files[suffix] = _CountingFile(stem + suffix + TMP)
        except BaseException:
            self.abort()
            raise

    @property
    def committed(self) -> bool:
        """Whether this shard's commit point has passed (its new version is the one read)."""
        return self.stage in ("committed", "placed", "settled")

    def _versioned(self, suffix: str) -> str:
        return os.path.join(self.directory, versioned_name(self.shard, self.generation, suffix))

    def prepare(
        self,
        count: int,
        dtype: np.dtype[Any] | None,
        payloads: int | None = None,
        format: str | None = None,
        fingerprint: str | None = None,
    ) -> None:
        """Flush and ``fsync`` the data files; the record to commit (``format``: the format
        class's ``module.QualName``; ``fingerprint``: what the shard was made from)."""
        for handle in self.files.values():
            handle.sync()
            handle.close()
        self.record = ShardRecord(
            kind=self.kind,
            shard=self.shard,
            count=count,
            files={
                s.lstrip("."): FileRecord(h.size, h.crc32, h.checksums.blocks())
                for s, h in self.files.items()
            },
            dtype=dtype,
            payloads=payloads,
            state="committed",
            generation=self.generation,
            versioned=True,
            format=format,
            fingerprint=fingerprint,
        )
        self.stage = "prepared"

    def version(self) -> None:
        """Step a: rename the data files to their versioned names."""
        for suffix in self.suffixes:
            _rename(self._stem + suffix + TMP, self._versioned(suffix))
        self.stage = "versioned"

    def install(self) -> None:
        """Step b, the commit point: the record naming the versioned files replaces the old."""
        assert self.record is not None
        _write_record(self._stem, self.record.to_json())
        self.stage = "committed"

    def place(self) -> None:
        """Step c: the versioned files get their canonical names too."""
        assert self.record is not None
        _place(self.directory, self.record)
        self.stage = "placed"

    def settle(self) -> None:
        """Step d: the record names the canonical files."""
        assert self.record is not None
        self.record = _settle_record(self.directory, self.record)
        self.stage = "settled"

    def finish(self) -> None:
        """Step e: unlink the versioned names, release the write lock."""
        _remove_versions(self.directory, self.shard, (self.generation,))
        self.release()

    def roll_forward(self) -> None:
        """Steps c-e for this shard alone (after a failure in a grouped commit)."""
        if self.stage != "settled":
            _place(self.directory, self.record)  # type: ignore[arg-type]
            _fsync_directory(self.directory)
            self.settle()
            _fsync_directory(self.directory)
        self.finish()

    def release(self) -> None:
        """Remove the lock file and drop the write lock."""
        if self._lock_fd >= 0:
            _remove(self._lock_path)  # on an error the lock is still held, the file ours
            fd, self._lock_fd = self._lock_fd, -1
            os.close(fd)
        self.done = True

    def commit(self, count: int, dtype: np.dtype[Any] | None, payloads: int | None = None) -> None:
        """Make this shard visible (all the steps); see :func:`commit_transactions`."""
        commit_transactions(
            self.directory, [self], lambda _: {"count": count, "dtype": dtype, "payloads": payloads}
        )

    def abort(self) -> None:
        """Drop what this session wrote.

        Before the commit point: the temporary and versioned files are removed, and readers
        keep the previous version of the shard (or none). After it the shard is committed
        and stays so; only the write lock is released (its leftovers are rolled forward by
        the next writer or ``recover``).
        """
        if not self.committed:
            for handle in self.files.values():
                handle.discard()
            for suffix in self.suffixes if self.generation else ():
                _unlink_quiet(self._versioned(suffix))
        else:
            for suffix in self.suffixes:  # hard links of step c not yet renamed
                _unlink_quiet(self._stem + suffix + TMP)
        _unlink_quiet(self._stem + RECORD + PENDING)
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            with contextlib.suppress(OSError):
                _drop_lock(fd, self._lock_path)
        self.done = True


def commit_transactions(
    directory: str,
    transactions: Sequence[ShardTransaction],
    commit_args: Callable[[ShardTransaction], dict[str, Any]],
    before_commit: Callable[[], None] | None = None,
) -> None:
    """Commit a group of shards of ``directory``: each step for every shard, then the next.

    ``commit_args(transaction)`` gives the keyword arguments of
    :meth:`ShardTransaction.prepare` (it may still write to the transaction's files).
    ``before_commit()``, if given, runs once every shard's data is durable under its
    versioned names, just before the first commit point. An error before a shard's commit
    point leaves it as it was (the usual case: a full disk while flushing leaves every
    shard as it was). An error after some commit points: those shards are committed (their
    steps c-e are retried here once), the others aborted, and an ``OSError`` says which.
    """
    try:
        for transaction in transactions:
            transaction.prepare(**commit_args(transaction))
        if not transactions:
            if before_commit is not None:
                before_commit()
            return
        for transaction in transactions:
            transaction.version()
        _fsync_directory(directory)  # the versioned files exist before any record names them
        if before_commit is not None:
            before_commit()
        for transaction in transactions:
            transaction.install()
        _fsync_directory(directory)  # the commit points are durable
        for transaction in transactions:
            transaction.place()
        _fsync_directory(directory)  # canonical names in place before the records say so
        for transaction in transactions:
            transaction.settle()
        _fsync_directory(directory)  # records settled before the versioned names go
        for transaction in transactions:
            transaction.finish()
    except BaseException as error:
        committed = [t for t in transactions if t.committed and not t.done]
        for transaction in transactions:
            if not transaction.committed and not transaction.done:
                transaction.abort()
        unsettled = []
        for transaction in committed:
            try:
                transaction.roll_forward()
            except BaseException:
                transaction.abort()  # committed all the same; only the lock is released
                unsettled.append(transaction.shard)
        if committed and isinstance(error, OSError):
            done = ", ".join(shard_name(t.shard) for t in committed)
            later = (
                f"; the files of shard(s) {', '.join(shard_name(s) for s in unsettled)} are "
                f"still under versioned names (.v<n>), which our readers read but GuideLoom "
                f"does not: storage.recover() or the next writer moves them"
                if unsettled
                else ""
            )
            raise OSError(
                error.errno,
                f"closing the writer of {directory} failed ({error}) after shard(s) {done} "
                f"were committed: those read as written, every other shard as before{later}",
            ) from error
        raise


def recovery_plan(directory: str) -> dict[int, str]:
    """The shards of ``directory`` that stopped writers left something of, each with what
    :func:`recover_directory` would do: ``"rolled_forward"`` (a committed record naming
    versioned files), ``"removed"`` (an interrupted removal) or ``"cleaned"`` (temporaries,
    versioned files no record names, a stale lock). Reads names and records only; takes no
    lock, so a shard in the plan may be one a live writer holds."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    suspects: dict[int, str] = {}
    records: list[int] = []
    for name in names:
        match = SHARD_NAME.match(name)
        if match is None:
            continue
        shard = int(match.group("shard"))
        if match.group("temporary") or match.group("generation") is not None:
            suspects.setdefault(shard, "cleaned")
        elif match.group("suffix") == RECORD:
            records.append(shard)
    for shard in records:
        record = _read_record(os.path.join(directory, shard_name(shard)))
        if record is not None and record.state == "deleted":
            suspects[shard] = "removed"
        elif record is not None and record.versioned:
            suspects[shard] = "rolled_forward"
    return suspects


def recover_directory(directory: str) -> dict[str, list[int]]:
    """Finish or clean up what stopped writers left in ``directory``.

    For every shard not being written right now (its write lock is free): a committed
    record naming versioned files is rolled forward to the canonical names, a shard whose
    removal was interrupted is removed, and versioned files no record names, stale
    temporaries and stale locks are deleted. Shards a live writer holds are left alone.
    Returns the shard ids ``{"rolled_forward": [...], "removed": [...], "cleaned": [...]}``.
    """
    result: dict[str, list[int]] = {"rolled_forward": [], "removed": [], "cleaned": []}
    suspects = recovery_plan(directory)
    for shard, what in sorted(suspects.items(), reverse=True):  # removals from the top
        stem = os.path.join(directory, shard_name(shard))
        try:
            fd = _take_lock(stem + RECORD + TMP, shard, directory, wait=0.0)
        except ShardLockedError:
            continue  # a live writer: its files are not leftovers
        try:
            _recover_shard(directory, shard)
            for suffix in _DATA_SUFFIXES:
                _remove(stem + suffix + TMP)
            _remove(stem + RECORD + PENDING)
        finally:
            _drop_lock(fd, stem + RECORD + TMP)
        result[what].append(shard)
    if suspects:
        _fsync_directory(directory)
    return result


def seal_shard(
    directory: str,
    shard: int,
    kind: str,
    suffixes: Sequence[str],
    sizes: dict[str, int],
    count: int,
    dtype: np.dtype[Any] | None,
    payloads: int | None = None,
    format: str | None = None,
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
            return False
        files: dict[str, FileRecord] = {}
        for suffix in suffixes:
            path = stem + suffix
            checksums = BlockCrc32()
            with open(path, "rb") as data:
                while chunk := data.read(_CHUNK):
                    checksums.update(chunk)
            size = checksums.size
            if size != sizes[suffix]:
                raise CorruptShardError(
                    f"{path} changed while it was being sealed ({sizes[suffix]} -> {size} "
                    f"bytes); seal again once no other process writes it"
                )
            files[suffix.lstrip(".")] = FileRecord(size, checksums.crc32, checksums.blocks())
        record = ShardRecord(
            kind, shard, count, files, dtype, payloads, generation=1, format=format
        )
        _write_record(stem, record.to_json())
        return True
    finally:
        _drop_lock(fd, lock_path)


def refuse_to_create(location: str, found: Sequence[str]) -> None:
    """A ``mode="create"`` writer's refusal of a location that holds the shard files
    ``found`` (nothing if it holds none)."""
    if not found:
        return
    found = sorted(found)
    shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
    raise FileExistsError(
        f"{location} already holds shard files ({shown}; {len(found)} in all) and this writer "
        f"was opened with mode='create'. Write into an empty or new location, or use "
        f"mode='overwrite' to replace the dataset, or mode='update' to replace only the "
        f"shards written"
    )


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


class CreateLock:
    """The claim of one ``mode="create"`` run on a local directory, held from its check that
    the directory holds no shard files until the run ends (:meth:`release`).

    It is an exclusive ``flock`` on :data:`~guideloom_pipes.storage.names.CREATE_LOCK` in
    the directory, taken before the check: a second create run started meanwhile finds it
    held and is refused at once with ``FileExistsError``, before it writes anything. The
    kernel drops the lock of a process that dies, so a run that was killed never blocks the
    next one (the file it leaves is ignored by readers and taken over by the next run, which
    also recovers the killed run's leftovers before it looks for shard files: temporaries
    are cleaned, shards it committed stay and refuse the new run).
    ``write_parallel`` takes one for a whole run: its workers are that run.
    """

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, CREATE_LOCK)
        fd = _lock_or_none(self.path)
        if fd is None:
            raise FileExistsError(
                f"another mode='create' writer is creating a dataset in {directory} right now "
                f"(it holds the lock on {self.path}), and this writer was opened with "
                f"mode='create'. Write into another location, or let that run finish (then "
                f"use mode='overwrite' to replace what it wrote)",
            )
        self._release = weakref.finalize(self, _drop_lock, fd, self.path)
        try:
            recover_directory(directory)  # what a killed run left is no dataset
            refuse_to_create(directory, [n for n in os.listdir(directory) if SHARD_NAME.match(n)])
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """End the claim: remove the lock file and drop the lock (idempotent)."""
        self._release()


def _committed_kind(
    names: Iterable[str], read_record: Callable[[int], ShardRecord | None]
) -> tuple[int, str, np.dtype[Any] | None] | None:
    """What the committed shards among ``names`` (a directory's or a URL's listing) are,
    from the lowest-numbered one that says: ``(shard, kind, dtype)`` from its commit record
    (``read_record(shard)``), or for a dataset without records (GuideLoom's) the kind its
    data files show (dtype None); None for no shards."""
    records: list[int] = []
    files: dict[int, set[str]] = {}
    for name in names:
        match = SHARD_NAME.match(name)
        if match is None or match.group("temporary") or match.group("generation") is not None:
            continue
        shard = int(match.group("shard"))
        if match.group("suffix") == RECORD:
            records.append(shard)
        else:
            files.setdefault(shard, set()).add(match.group("suffix"))
    for shard in sorted(records):
        record = read_record(shard)
        if record is not None and record.state == "committed":
            return shard, record.kind, record.dtype
    if records:
        return None  # records, none of them readable and committed: nothing to go by
    for shard in sorted(files):
        kind = _KIND_OF_FILES.get(frozenset(files[shard]))
        if kind is not None:
            return shard, kind, None
    return None


def refuse_other_kind(
    directory: str, kind: str, dtype: np.dtype[Any] | None, upload: Any = None
) -> None:
    """Raise :class:`StorageError` if the committed shards of ``directory`` are of another
    kind than ``kind`` or another stream dtype than ``dtype`` (an ``"update"`` writer's
    check: the dataset would mix them, and no format could open it). ``upload``: the
    :class:`~guideloom_pipes.storage.upload.RemoteUpload` of a dataset at a URL, whose
    listing and records are the ones asked (``directory`` is then its URL)."""
    if upload is not None:
        found = _committed_kind(upload.object_sizes(), upload.record)
    else:
        found = _committed_kind(
            os.listdir(directory),
            lambda shard: _read_record(os.path.join(directory, shard_name(shard))),
        )
    if found is None:
        return
    shard, committed_kind, committed = found
    if committed_kind == kind and (committed is None or committed == dtype):
        return
    raise StorageError(
        f"this writer writes {_describe(kind, dtype)} into {directory}, whose committed "
        f"shards are {_describe(committed_kind, committed)} (shard {shard_name(shard)} is "
        f"one): a dataset holds one kind and dtype, and a mix of them is a dataset no format "
        f"opens. Write with the dataset's dtype and storage class; or replace the whole "
        f"dataset with sync_writer(mode='overwrite') (write_parallel(..., mode='overwrite')), "
        f"or write into a new directory"
    )


#: the kind of a shard that has exactly these data files
_KIND_OF_FILES = {
    frozenset({IN_BAND}): "stream",
    frozenset({INDEX, OUT_OF_BAND}): "document",
    frozenset({IN_BAND, INDEX, OUT_OF_BAND}): "stream_meta",
}


def _describe(kind: str, dtype: np.dtype[Any] | None) -> str:
    if dtype is None:
        return f"{kind} shards"
    shown = repr(dtype.descr) if dtype.names else repr(dtype.str)
    return f"{kind} shards of dtype {shown}"


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


_WriterT = TypeVar("_WriterT", bound="ShardWriterBase")


class ShardWriterBase:
    """Bookkeeping shared by the writers: one transaction per touched shard, commit on close.

    Subclasses implement ``append``: they check the record, then, holding ``self._lock``,
    call :meth:`_transaction` for the shard, write, and call :meth:`_written` once the
    append succeeded. A shard whose appends were all refused is not committed (it keeps its
    previous content). ``append``, ``close`` and ``abort`` hold the lock, so a writer may be
    shared by threads: each append lands whole, before the commit or not at all.
    """

    kind = ""
    suffixes: tuple[str, ...] = ()
    #: whether an ``"update"`` close warns of older shards left above the ones written
    #: (``write_parallel``'s workers write one shard each and turn it off)
    _warn_older_above = True
    #: whether an ``"update"`` writer's first append checks that the committed shards are
    #: of its kind and dtype (``write_parallel``'s workers of an overwrite or create run,
    #: which replace every shard, turn it off)
    _same_as_committed = True

    def __init__(self, directory: PurePath, mode: str = "update", backend: Any = None) -> None:
        if mode not in WRITER_MODES:
            raise ValueError(
                f"mode must be one of {', '.join(map(repr, WRITER_MODES))}, got {mode!r}: "
                f"'update' replaces only the shards written, 'overwrite' also removes the "
                f"others, 'create' refuses a directory that holds shards"
            )
        #: for a URL: what publishes the shards, staged in a local directory, at close
        self._upload: Any = None
        if isinstance(directory, RemotePath):
            from guideloom_pipes.storage.upload import RemoteUpload

            self._upload = RemoteUpload(backend, str(directory), mode, self.kind)
            directory = PurePath(self._upload.stage())  # swept if this process dies
        self.directory = os.fspath(directory)
        #: ``"update"``, ``"overwrite"`` or ``"create"`` (see :data:`WRITER_MODES`)
        self.mode = mode
        self._present: set[int] = set()  # shards in the directory when it was opened
        self._transactions: dict[int, ShardTransaction] = {}
        self._appended: set[int] = set()
        self._fingerprints: dict[int, str] = {}
        self._closed = False
        self._opened = False
        self._kind_checked = False
        #: a local ``"create"`` writer's claim on its directory, from open to close
        self._creating: CreateLock | None = None
        #: serialises append, close and abort: a writer may be shared by threads
        self._lock = threading.RLock()
        # A writer dropped (or left open at exit) without close() or abort(): warn, and
        # remove its temporaries and locks as abort() would. Holds no reference to self.
        self._finalizer = weakref.finalize(
            self,
            _abandon,
            self._transactions,
            self.directory,
            type(self).__name__,
            self._upload is not None,
        )

    def open(self) -> None:
        """Create the directory if needed and finish what stopped writers left in it (see
        :func:`recover_directory`); also done by ``with`` and by the first ``append``."""
        if self._opened:
            return
        if self._upload is not None:
            self._upload.open()
        os.makedirs(self.directory, exist_ok=True)
        if self.mode == "create" and self._upload is None:
            self._creating = CreateLock(self.directory)  # refuses a dataset, or a second run
        elif self.mode == "create":
            refuse_to_create(
                self.directory, [n for n in os.listdir(self.directory) if SHARD_NAME.match(n)]
            )
        recover_directory(self.directory)
        self._present = _shards_in(self.directory)
        self._opened = True

    def __enter__(self: _WriterT) -> _WriterT:
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
            self.open()
            if not self._kind_checked:
                self._check_committed_kind()
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

    def _check_committed_kind(self) -> None:
        """In ``"update"`` mode, refuse to write shards of another kind or dtype than the
        committed ones (see :func:`refuse_other_kind`)."""
        if self.mode == "update" and self._same_as_committed:
            dtype = getattr(self, "dtype", None)
            if self._upload is None:
                refuse_other_kind(self.directory, self.kind, dtype)
            else:  # the committed shards are at the URL, not in the staging directory
                refuse_other_kind(self._upload.url, self.kind, dtype, self._upload)
        self._kind_checked = True

    def _written(self, shard: int) -> None:
        """Record that an append to ``shard`` succeeded (its transaction will commit)."""
        self._appended.add(shard)

    def _commit_args(self, shard: int) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def set_fingerprint(self, shard: int, fingerprint: str) -> None:
        """Record ``fingerprint`` (a string naming what shard ``shard`` is made from) in the
        shard's commit record when this writer commits it; ``write_parallel`` compares it
        on a rerun to skip shards whose input did not change."""
        if not isinstance(fingerprint, str):
            raise TypeError(f"fingerprint must be a str, got {type(fingerprint).__name__}")
        with self._lock:
            self._fingerprints[check_shard_id(shard)] = fingerprint

    def _record_args(self, shard: int) -> dict[str, Any]:
        """The keyword arguments of the shard's record: counts, format, fingerprint."""
        args = self._commit_args(shard)
        format = getattr(self, "format", None)
        if format is not None:
            args["format"] = format_name(format)
        args["fingerprint"] = self._fingerprints.get(shard)
        return args

    def close(self) -> None:
        """Commit every shard this writer touched, each atomically.

        Either every shard is committed, or the error is raised; each shard then reads as
        its old version or its new one, never a mix or neither (see
        :func:`commit_transactions`).
        """
        with self._lock:
            try:
                self._close()
            finally:
                self._end_creation()

    def _end_creation(self) -> None:
        if self._creating is not None:
            self._creating.release()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        for shard, transaction in self._transactions.items():
            if shard not in self._appended and not transaction.done:
                transaction.abort()  # every append to it was refused: keep the old shard
        transactions = [t for s, t in sorted(self._transactions.items()) if s in self._appended]
        if self._upload is not None:
            try:  # committed in the staging directory, then published, record last
                self.open()
                commit_transactions(
                    self.directory, transactions, lambda t: self._record_args(t.shard)
                )
                self._upload.publish(self.directory, [t.shard for t in transactions])
            finally:
                shutil.rmtree(self.directory, ignore_errors=True)
            return
        if self.mode != "overwrite":
            commit_transactions(self.directory, transactions, lambda t: self._record_args(t.shard))
            if self.mode == "update" and transactions and self._warn_older_above:
                self._warn_of_older_shards_above(transactions[-1].shard)
            return
        self.open()  # (an overwrite that wrote nothing empties the dataset)
        removal = _Removal(self.directory, set(self._appended))
        try:
            commit_transactions(
                self.directory,
                transactions,
                lambda t: self._record_args(t.shard),
                before_commit=removal.mark,
            )
        except BaseException:
            if any(t.committed for t in transactions):
                removal.finish()  # the removed shards stay removed
            else:
                removal.undo()  # the dataset as it was
            raise
        removal.finish()

    def _warn_of_older_shards_above(self, highest: int) -> None:
        older = sorted(s for s in self._present & _shards_in(self.directory) if s > highest)
        if not older:
            return
        shown = ", ".join(shard_name(s) for s in older[:10]) + (", ..." if len(older) > 10 else "")
        warnings.warn(
            f"this writer of {self.directory} wrote shards up to {shard_name(highest)}, but "
            f"{len(older)} shard(s) it did not write remain above it from an earlier write "
            f"({shown}): readers see them after the new ones, as one dataset. To make the "
            f"dataset exactly the shards written, write with sync_writer(mode='overwrite'); "
            f"if several writers share the dataset on purpose, ignore this",
            UserWarning,
            stacklevel=4,
        )

    def abort(self) -> None:
        """Drop everything written in this session; committed shards stay as they were."""
        with self._lock:
            self._closed = True
            self._finalizer.detach()
            for transaction in self._transactions.values():
                if not transaction.done:
                    transaction.abort()
            if self._upload is not None:
                shutil.rmtree(self.directory, ignore_errors=True)  # nothing was uploaded
            self._end_creation()


#: the modes of a writer: replace the shards written (GuideLoom's behaviour); make the
#: dataset exactly the shards written; refuse a directory that holds shards
WRITER_MODES = ("update", "overwrite", "create")


def _shards_in(directory: str) -> set[int]:
    """The ids of the shards whose data files or records are in ``directory`` (by name)."""
    return shard_ids(os.listdir(directory))


class _Removal:
    """The shards an ``overwrite`` writer did not write, removed at its commit.

    :meth:`mark` (called once the new shards' data is durable, before their commit points)
    takes each one's write lock, then marks it deleted, highest id first: its record is
    replaced by one in state ``"deleted"`` (one atomic rename; readers treat the shard as
    absent, and removing from the top never opens a gap). :meth:`finish` (after the new
    shards are committed) removes their files, data first, records last, and releases the
    locks; :meth:`undo` (when no new shard was committed) puts their records back.
    """

    def __init__(self, directory: str, keep: set[int]) -> None:
        self.directory = directory
        self.keep = keep
        self.locks: dict[int, int] = {}
        self.marked: list[tuple[int, bytes | None]] = []  # shard, its previous record

    def _stem(self, shard: int) -> str:
        return os.path.join(self.directory, shard_name(shard))

    def mark(self) -> None:
        others = sorted(_shards_in(self.directory) - self.keep, reverse=True)
        for shard in others:
            self.locks[shard] = _take_lock(self._stem(shard) + RECORD + TMP, shard, self.directory)
            _recover_shard(self.directory, shard)  # a versioned record: rolled forward first
        for shard in others:
            stem = self._stem(shard)
            try:
                with open(stem + RECORD, "rb") as file:
                    previous: bytes | None = file.read()
            except FileNotFoundError:
                previous = None
            record = _read_record(stem)
            if record is None:
                record = ShardRecord("", shard, 0, {}, generation=0)
            tombstone = replace(record, state="deleted", versioned=False)
            self.marked.append((shard, previous))
            _write_record(stem, tombstone.to_json())
        if self.marked:
            _fsync_directory(self.directory)

    def undo(self) -> None:
        with contextlib.suppress(OSError):
            for shard, previous in reversed(self.marked):
                if previous is None:
                    _remove(self._stem(shard) + RECORD)
                else:
                    _write_record(self._stem(shard), previous)
            if self.marked:
                _fsync_directory(self.directory)
        self.marked = []
        self.release(quiet=True)

    def finish(self) -> None:
        try:
            for shard, _ in self.marked:
                for suffix in _DATA_SUFFIXES:
                    _remove(self._stem(shard) + suffix)
            if self.marked:
                _fsync_directory(self.directory)  # no record goes before its data files
            for shard, _ in self.marked:
                _remove(self._stem(shard) + RECORD)
        finally:
            self.release()

    def release(self, quiet: bool = False) -> None:
        locks, self.locks = self.locks, {}
        failed: OSError | None = None
        for shard, fd in locks.items():
            try:
                _remove(self._stem(shard) + RECORD + TMP)
            except OSError as error:
                failed = failed or error
            finally:
                os.close(fd)
        if failed is not None and not quiet:
            raise failed


def remove_shards_from(directory: str, first: int) -> list[int]:
    """Remove every shard of ``directory`` whose id is ``first`` or more, as an
    ``"overwrite"`` writer removes the shards it did not write (marked deleted highest id
    first, so the ids never have a gap, then their files removed); the ids removed."""
    removal = _Removal(directory, set(range(first)))
    try:
        removal.mark()
    except BaseException:
        removal.undo()
        raise
    removal.finish()
    return sorted(shard for shard, _ in removal.marked)


def _abandon(
    transactions: dict[int, ShardTransaction], directory: str, writer: str, staging: bool = False
) -> None:
    """What a writer garbage-collected (or left at interpreter exit) unclosed leaves: its
    uncommitted shards are aborted, with a :class:`ResourceWarning` naming them (and the
    staging directory of a writer to a URL removed: nothing of it was uploaded)."""
    try:
        pending = sorted(shard for shard, t in transactions.items() if not t.done)
        if not pending:
            return
        names = ", ".join(shard_name(shard) for shard in pending)
        warnings.warn(
            f"a {writer} of {directory} was dropped without close() or abort(), with shard(s) "
            f"{names} uncommitted: they were discarded (their previous versions stay). Use "
            f"the writer in a `with` block, or call close() to commit",
            ResourceWarning,
            stacklevel=2,
        )
        for shard in pending:
            with contextlib.suppress(Exception):
                transactions[shard].abort()
    finally:
        if staging:
            shutil.rmtree(directory, ignore_errors=True)
