"""Writing to a URL: a writer stages its shards in a local directory with the local commit
protocol, then :class:`RemoteUpload` publishes them to the object store, record last.

An object store has no rename and no lock, but one ``PUT`` replaces an object atomically.
Publishing shard ``k`` (generation ``g`` at the URL, ``0`` if none) follows the local
protocol's steps, each for every shard before the next:

a. each data file is uploaded under its *versioned* name (``0000003.v<g+1>.in_band.bin``),
   which no reader opens until a record names it;
b. **the commit point**: the record of generation ``g + 1`` naming the versioned files
   replaces ``0000003.shard.json`` (one ``PUT``). Before it readers see the old shard (or
   none); from it on, the new one;
c. each versioned file is copied, on the server, to its canonical name;
d. the record is replaced by one naming the canonical files (GuideLoom reads them);
e. the versioned files (of this and the previous generation) are deleted.

A crash before b leaves versioned objects no record names (the next publish of the shard
overwrites or deletes them); after b, a record naming complete files. A reader that opened
the old canonical file and reads it after step c sees a changed object: readers pin what
they opened where the store allows it.

``mode="overwrite"`` marks every other shard's record ``"deleted"`` (highest id first, so
the ids never have a gap) just before the first commit point, and after step e deletes
their data files, then their records. ``mode="create"`` refuses a URL that holds shard
files. There is no write lock on an object store: two writers of one shard at the same time
is a race the last one wins; give each writer its own shards (``write_parallel`` does).

The staging directory (``guideloom_pipes-upload-*`` in the temporary directory) is removed
when the writer closes or aborts. A writer killed outright cannot remove it, so it holds an
exclusive ``flock`` on a file in it for its whole life: the kernel drops the lock when the
process dies, however it dies, and the next writer's process (and ``write_parallel``'s
driver) removes every staging directory whose lock is free (:func:`sweep_staging`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import replace

from guideloom_pipes.storage.commit import _read_record
from guideloom_pipes.storage.errors import CorruptShardError, StorageError
from guideloom_pipes.storage.manifest import MAIN, MANIFEST_DIR
from guideloom_pipes.storage.names import (
    IN_BAND,
    INDEX,
    OUT_OF_BAND,
    RECORD,
    SHARD_NAME,
    shard_ids,
    shard_name,
    versioned_name,
)
from guideloom_pipes.storage.records import ShardRecord
from guideloom_pipes.storage.remote import FsspecIO, ListingFsspecIO
from guideloom_pipes.storage.remote_paths import RemotePath
from guideloom_pipes.storage.writer_modes import refuse_to_create

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: staging directories are not swept
    fcntl = None  # type: ignore[assignment]

_DATA_SUFFIXES = (IN_BAND, OUT_OF_BAND, INDEX)
#: the names of staging directories in the temporary directory, and of the file whose
#: lock says that the writer that made one is alive
STAGING_PREFIX = "guideloom_pipes-upload-"
_OWNER = ".owner.lock"
_swept = False


def sweep_staging(root: str | None = None) -> list[str]:
    """Remove the staging directories under ``root`` (the temporary directory) that no live
    process holds: those of writers killed before they could remove their own. Directories
    of other users, or without an owner file (made by an older version), are left alone.
    Returns the paths removed."""
    global _swept
    _swept = True
    if fcntl is None:  # pragma: no cover
        return []
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(STAGING_PREFIX)]
    except OSError:
        return []
    for entry in entries:
        try:
            owner = open(os.path.join(entry.path, _OWNER), "rb")  # noqa: SIM115
        except OSError:
            continue  # not ours to judge (or being made: the owner file comes last)
        with owner:
            try:
                fcntl.flock(owner.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its writer is alive
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _new_staging() -> tuple[str, object | None]:
    """A new staging directory and the open file whose lock marks it as in use."""
    if not _swept:
        sweep_staging()
    directory = tempfile.mkdtemp(prefix=STAGING_PREFIX)
    if fcntl is None:  # pragma: no cover
        return directory, None
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".owner-")
    owner = os.fdopen(fd, "rb")
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(temporary, os.path.join(directory, _OWNER))  # locked before it is seen
    return directory, owner


class RemoteUpload:
    """Publishes shards committed in a local staging directory to the dataset at ``url``.

    Args:
        backend: the storage's :class:`~guideloom_pipes.storage.remote.FsspecIO` (its file
            system, options and retry policy are used for every request).
        url: the dataset's URL.
        mode: the writer's mode (``"update"``, ``"overwrite"``, ``"create"``).
        kind: the writer's kind of shard (``"stream"``, ...), for the records that mark
            shards without one as deleted.
    """

    def __init__(self, backend: FsspecIO, url: str, mode: str, kind: str) -> None:
        if not isinstance(backend, ListingFsspecIO):
            raise ValueError(
                f"cannot write to {url}: an HTTP server is read-only here (fsspec's HTTP file "
                f"system cannot upload or delete). Write to an object store (s3://, gs://, "
                f"az://) or to a local directory and serve that"
            )
        self.backend = backend
        self.url = url.rstrip("/")
        self.mode = mode
        self.kind = kind
        #: shard ids at the URL when the writer opened (any of their files present)
        self.present: set[int] = set()
        self._opened = False
        self._owner: object | None = None  # the locked owner file of the staging directory

    def stage(self) -> str:
        """A new local staging directory for this writer, marked as in use for as long as
        this object lives (see :func:`sweep_staging`)."""
        directory, self._owner = _new_staging()
        return directory

    def _url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _shard_files(self) -> dict[str, int]:
        try:
            names = self.backend.list_dir_sizes(RemotePath(self.url))
        except FileNotFoundError:
            return {}
        return {name: size for name, size in names.items() if SHARD_NAME.match(name)}

    def open(self) -> None:
        """Check ``mode="create"`` against the URL; note the shards already there."""
        if self._opened:
            return
        found = sorted(self._shard_files())
        if self.mode == "create":
            refuse_to_create(self.url, found)
        self.present = {int(SHARD_NAME.match(n).group("shard")) for n in found}  # type: ignore[union-attr]
        self._opened = True

    def shards_present(self) -> set[int]:
        """Ids of the shards with a file at its canonical name at the URL."""
        return shard_ids(self._shard_files())

    def object_sizes(self) -> dict[str, int]:
        """The size of each shard object at the URL, by name (one listing)."""
        return self._shard_files()

    def record(self, shard: int) -> ShardRecord | None:
        """Shard ``shard``'s record at the URL (None if it has none, or an unreadable one)."""
        return self._remote_record(shard)

    def remove_from(self, first: int) -> list[int]:
        """Remove every shard whose id is ``first`` or more, as an ``"overwrite"`` writer
        removes the shards it did not write; the ids removed."""
        doomed = sorted((s for s in self.shards_present() if s >= first), reverse=True)
        if doomed:
            self._drop_manifest()
        self._mark_deleted(doomed)
        self._remove(doomed)
        return sorted(doomed)

    def _remote_record(self, shard: int) -> ShardRecord | None:
        url = self._url(shard_name(shard) + RECORD)
        try:
            raw = self.backend.request("reading the record", url, "cat_file", url)
        except FileNotFoundError:
            return None
        try:
            return ShardRecord.from_json(bytes(raw), url)
        except StorageError:
            return None  # unreadable: replaced by the new record

    def _put(self, what: str, url: str, data: bytes) -> None:
        self.backend.request(what, url, "pipe_file", url, data)

    def _put_record(self, record: ShardRecord) -> None:
        url = self._url(shard_name(record.shard) + RECORD)
        self._put("writing the record", url, record.to_json())

    def _delete(self, names: Iterable[str]) -> None:
        for name in names:
            url = self._url(name)
            with contextlib.suppress(FileNotFoundError):
                self.backend.request("deleting", url, "rm_file", url)

    def publish(self, staging: str, shards: Sequence[int]) -> None:
        """Upload the committed shards ``shards`` of ``staging`` to the URL (steps a-e);
        with ``mode="overwrite"`` remove every other shard there."""
        self.open()
        staged: list[ShardRecord] = []
        for shard in sorted(shards):
            record = _read_record(os.path.join(staging, shard_name(shard)))
            if record is None or record.versioned or record.state != "committed":
                raise CorruptShardError(
                    f"shard {shard_name(shard)} in the staging directory {staging} has no "
                    f"settled commit record; nothing of it was uploaded"
                )
            previous = self._remote_record(shard)
            generation = 0 if previous is None else previous.generation
            staged.append(replace(record, generation=generation + 1, versioned=True))
        # a. the data, under versioned names no reader opens
        for record in staged:
            for key in record.files:
                suffix = "." + key
                source = os.path.join(staging, shard_name(record.shard) + suffix)
                target = self._url(record.file_name(suffix))
                self.backend.request("uploading", target, "put_file", source, target)
        self._drop_manifest()
        removed = sorted(self.present - set(shards), reverse=True)
        if self.mode == "overwrite":
            self._mark_deleted(removed)
        # b. the commit point of each shard
        for record in staged:
            self._put_record(record)
        # c, d, e. canonical names, the record naming them, the versioned names gone
        for record in staged:
            for key in record.files:
                suffix = "." + key
                source = self._url(record.file_name(suffix))
                target = self._url(shard_name(record.shard) + suffix)
                self.backend.request("copying", source, "copy", source, target)
        for record in staged:
            self._put_record(replace(record, versioned=False))
        for record in staged:
            self._delete(
                versioned_name(record.shard, generation, suffix)
                for generation in (record.generation - 1, record.generation)
                for suffix in _DATA_SUFFIXES
            )
        if self.mode == "overwrite":
            self._remove(removed)
        self._drop_manifest()  # again: an index that ran meanwhile saw a dataset half-published
        if self.mode == "update" and staged:
            highest = staged[-1].shard
            older = sorted(s for s in self.present if s > highest)
            if older:
                shown = ", ".join(shard_name(s) for s in older[:10])
                warnings.warn(
                    f"this writer of {self.url} wrote shards up to {shard_name(highest)}, but "
                    f"{len(older)} shard(s) it did not write remain above it from an earlier "
                    f"write ({shown}): readers see them after the new ones, as one dataset. "
                    f"To make the dataset exactly the shards written, write with "
                    f"sync_writer(mode='overwrite')",
                    UserWarning,
                    stacklevel=5,
                )

    def _drop_manifest(self) -> None:
        """Delete the manifest's whole table (uploaded with the dataset, or written by an
        index), which this writer's commits are about to make stale: opens list the
        dataset until it is indexed again. Before the first commit point."""
        self._delete([f"{MANIFEST_DIR}/{MAIN}"])

    def _mark_deleted(self, shards: Sequence[int]) -> None:
        """Records in state ``"deleted"`` for ``shards`` (highest first): readers treat
        them as absent from now on."""
        for shard in shards:
            record = self._remote_record(shard)
            if record is None:
                record = ShardRecord(kind=self.kind, shard=shard, count=0, files={})
            self._put_record(replace(record, state="deleted"))

    def _remove(self, shards: Sequence[int]) -> None:
        """Delete the data files of shards marked deleted, then their records."""
        listing = self._shard_files()  # once: versioned leftovers of every shard
        for shard in shards:
            self._delete(shard_name(shard) + suffix for suffix in _DATA_SUFFIXES)
            self._delete(
                name
                for name in listing
                if name.startswith(shard_name(shard) + ".v") and not name.endswith(RECORD)
            )
            self._delete([shard_name(shard) + RECORD])


__all__ = ["STAGING_PREFIX", "RemoteUpload", "sweep_staging"]
