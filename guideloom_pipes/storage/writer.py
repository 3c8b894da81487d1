"""``ShardWriterBase``, the writers' base: one transaction per shard touched, all of them
committed together at close (:mod:`guideloom_pipes.storage.commit`), in the writer's
mode (:mod:`guideloom_pipes.storage.writer_modes`); a writer dropped unclosed aborts.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import warnings
import weakref
from pathlib import PurePath
from types import TracebackType
from typing import Any, TypeVar

from guideloom_pipes.storage.manifest_write import ManifestSession
from guideloom_pipes.storage.names import SHARD_NAME, check_shard_id, shard_name
from guideloom_pipes.storage.records import format_name
from guideloom_pipes.storage.recovery import recover_directory
from guideloom_pipes.storage.remote_paths import RemotePath
from guideloom_pipes.storage.transaction import ShardTransaction, commit_transactions
from guideloom_pipes.storage.writer_modes import (
    WRITER_MODES,
    CreateLock,
    _Removal,
    _shards_in,
    refuse_other_kind,
    refuse_to_create,
)


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
    #: whether the close writes the shards it committed into the dataset's manifest
    #: (``write_parallel``'s workers turn it off: their driver writes it once at the end)
    _keeps_manifest = True

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
            session = self._manifest_session(transactions)
            try:
                commit_transactions(
                    self.directory, transactions, lambda t: self._record_args(t.shard)
                )
            except BaseException:
                self._manifest_failed(session, transactions)
                raise
            self._manifest_done(session, transactions)
            if self.mode == "update" and transactions and self._warn_older_above:
                self._warn_of_older_shards_above(transactions[-1].shard)
            return
        self.open()  # (an overwrite that wrote nothing empties the dataset)
        removal = _Removal(self.directory, set(self._appended))
        session = self._manifest_session(transactions)
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
            self._manifest_failed(session, transactions)
            raise
        removal.finish()
        self._manifest_done(session, transactions)

    def _manifest_session(self, transactions: list[ShardTransaction]) -> ManifestSession | None:
        """The manifest's marker, held through the commit (none where nothing is
        committed, or for a ``write_parallel`` worker: its driver keeps the manifest)."""
        if not self._keeps_manifest or (not transactions and self.mode != "overwrite"):
            return None
        whole = self.mode in ("overwrite", "create")
        return ManifestSession(self.directory, self.kind, self.suffixes, whole)

    def _manifest_done(
        self, session: ManifestSession | None, transactions: list[ShardTransaction]
    ) -> None:
        if session is not None:
            session.finish({t.shard: t.record for t in transactions if t.record is not None})

    @staticmethod
    def _manifest_failed(
        session: ManifestSession | None, transactions: list[ShardTransaction]
    ) -> None:
        if session is not None:  # the marker stays if a shard was committed
            session.release(drop=not any(t.committed for t in transactions))

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
