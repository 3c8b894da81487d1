"""One shard's commit (:class:`ShardTransaction`) and a group of shards committed step by
step together (:func:`commit_transactions`): the steps a-e of the commit protocol
(:mod:`guideloom_pipes.storage.commit`), and rolling a stopped commit forward.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from guideloom_pipes.storage.commit import (
    _DATA_SUFFIXES,
    _CountingFile,
    _fsync_directory,
    _link,
    _read_record,
    _remove,
    _rename,
    _unlink_quiet,
    _write_record,
)
from guideloom_pipes.storage.locks import _drop_lock, _take_lock
from guideloom_pipes.storage.names import PENDING, RECORD, TMP, shard_name, versioned_name
from guideloom_pipes.storage.records import FileRecord, ShardRecord


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

    Committing runs in steps (see :mod:`guideloom_pipes.storage.commit`);
    :func:`commit_transactions` runs each step for a group of shards before the next, so one
    ``fsync`` of the directory per step covers the whole group.

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
