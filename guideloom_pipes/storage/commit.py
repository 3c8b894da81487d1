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
(:func:`~guideloom_pipes.storage.recovery.recover_directory`), each holding the shard's
write lock: a record that names versioned files is rolled forward (steps c-e again; each
is idempotent), versioned files that no record names (a commit stopped before 2b) and stale
temporaries are removed. Until then our readers read the committed version; GuideLoom,
which reads canonical names only, may see a mix of a multi-file shard's old and new files.

*Writer modes* (``"update"``, ``"overwrite"``, ``"create"``) are described in
:mod:`guideloom_pipes.storage.writer_modes`.

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
import os
from typing import Any, BinaryIO

import numpy as np

from guideloom_pipes.storage.checksums import BlockCrc32
from guideloom_pipes.storage.errors import StorageError
from guideloom_pipes.storage.names import IN_BAND, INDEX, OUT_OF_BAND, PENDING, RECORD
from guideloom_pipes.storage.records import ShardRecord

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
