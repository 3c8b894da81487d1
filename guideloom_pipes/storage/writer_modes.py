"""The rules of a writer's modes (:data:`WRITER_MODES`); the steps named are those of the
commit protocol (:mod:`guideloom_pipes.storage.commit`).

``"update"`` (default) commits only the shards written, and warns at close
of shards that were there when the writer opened and remain above the highest one it
wrote; its first append refuses a dataset whose committed shards are of another kind or
dtype (:func:`refuse_other_kind`). ``"create"`` refuses a directory holding shard files,
and one that another create run holds (:class:`CreateLock`). ``"overwrite"`` also removes
every other shard (:class:`_Removal`): between steps 2a and 2b it takes their write locks
and replaces each one's record by one in state ``"deleted"``, highest id first (readers
treat such a shard as absent, so the ids never have a gap); after step 2e it removes their
data files, then their records. An error before the first commit point puts their records
back; a crash leaves the marks, which recovery completes.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from guideloom_pipes.storage.commit import (
    _DATA_SUFFIXES,
    _fsync_directory,
    _read_record,
    _remove,
    _write_record,
)
from guideloom_pipes.storage.errors import StorageError
from guideloom_pipes.storage.locks import _drop_lock, _lock_or_none, _take_lock
from guideloom_pipes.storage.names import (
    CREATE_LOCK,
    IN_BAND,
    INDEX,
    OUT_OF_BAND,
    RECORD,
    SHARD_NAME,
    TMP,
    shard_ids,
    shard_name,
)
from guideloom_pipes.storage.records import ShardRecord
from guideloom_pipes.storage.recovery import recover_directory
from guideloom_pipes.storage.transaction import _recover_shard


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
