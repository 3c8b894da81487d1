"""``write_parallel``: a dataset written by many workers (a local process pool, or any
``concurrent.futures.Executor``, Dask's included), item ``k`` of the input becoming shard ``k``
through the atomic commit; resumable by a fingerprint of each item kept in the shard's commit
record. numpy only: it never imports torch."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import multiprocessing
import os
import pickle
import signal
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guideloom_pipes.progress import Progress
from guideloom_pipes.storage.base import StorageBase
from guideloom_pipes.storage.errors import StorageError
from guideloom_pipes.storage.names import RECORD, shard_ids, shard_name
from guideloom_pipes.storage.records import ShardRecord, format_name
from guideloom_pipes.storage.remote_paths import RemotePath
from guideloom_pipes.storage.upload import RemoteUpload, sweep_staging
from guideloom_pipes.storage.writer_modes import (
    WRITER_MODES,
    CreateLock,
    refuse_other_kind,
    remove_shards_from,
)

__all__ = ["WriteParallelError", "WriteReport", "item_fingerprint", "write_parallel"]


@dataclass
class WriteReport:
    """What :func:`write_parallel` did."""

    #: shard ids written (converted and committed) in this run
    written: list[int] = field(default_factory=list)
    #: shard ids skipped: committed by an earlier run from the same item
    skipped: list[int] = field(default_factory=list)
    #: shard ids whose item failed (left uncommitted: their earlier version, if any, stays)
    failed: list[int] = field(default_factory=list)
    #: shard ids at or above ``len(items)`` removed (``mode="overwrite"``)
    removed: list[int] = field(default_factory=list)
    #: shard ids never started because the run stopped early (the executor broke)
    not_run: list[int] = field(default_factory=list)
    #: records appended, over the shards written
    records: int = 0
    #: bytes of the files written
    bytes: int = 0
    #: wall-clock seconds
    seconds: float = 0.0

    def __str__(self) -> str:
        return (
            f"{len(self.written)} shards written, {len(self.skipped)} skipped (unchanged), "
            f"{len(self.failed)} failed"
            + (f", {len(self.removed)} removed (above the items)" if self.removed else "")
            + (f", {len(self.not_run)} not started" if self.not_run else "")
            + f"; {self.records} records, {self.bytes} bytes in {self.seconds:.2f} s"
        )


class WriteParallelError(RuntimeError):
    """Items failed in :func:`write_parallel`; every other item was written, but for those
    in ``report.not_run`` when a process pool broke (a worker died mid-item).

    Attributes:
        failures: ``(index, item, exception)`` of each failed item, by index.
        report: the :class:`WriteReport` of the run.
    """

    def __init__(self, failures: list[tuple[int, Any, BaseException]], report: WriteReport):
        self.failures = failures
        self.report = report
        lines = [
            f"item {index} ({_short(item)}): {type(error).__name__}: {error}"
            for index, item, error in failures
        ]
        broken = [index for index, _, error in failures if isinstance(error, cf.BrokenExecutor)]
        why = ""
        if broken:
            shown = ", ".join(map(str, broken[:10])) + (", ..." if len(broken) > 10 else "")
            why = (
                f" The executor broke while items {shown} were in flight: a worker process "
                f"ended abruptly while running one of them (killed by a signal, e.g. by the "
                f"out-of-memory killer, or os._exit in convert), and the pool failed every "
                f"item it held (a rerun skips any shard a worker committed as the pool "
                f"stopped)."
            )
        if report.not_run:
            why += (
                f" {len(report.not_run)} item(s) were not started (from shard "
                f"{shard_name(report.not_run[0])})."
            )
        others = "every item finished before was written" if why else "every other item was written"
        super().__init__(
            f"{len(failures)} of the items failed in write_parallel; their shards "
            f"({', '.join(shard_name(i) for i, _, _ in failures[:10])}"
            f"{', ...' if len(failures) > 10 else ''}) were not committed, {others} "
            f"({report}).{why} Fix them and run the same call again: the shards already "
            f"committed are skipped"
            + (
                " (with a new executor if it was yours: a broken pool takes no more work)"
                if broken
                else ""
            )
            + ".\n"
            + "\n".join(lines)
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failures, self.report))


def _short(value: Any, limit: int = 80) -> str:
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def item_fingerprint(item: Any) -> bytes:
    """What identifies an item's input: for a path to a file, its absolute path, size and
    modification time (so an edited file is rewritten); for anything else, its pickle."""
    if isinstance(item, (str, os.PathLike)):
        path = os.fspath(item)
        try:
            info = os.stat(path)
        except (OSError, ValueError):
            info = None
        if info is not None and stat.S_ISREG(info.st_mode):
            return f"file\0{os.path.abspath(path)}\0{info.st_size}\0{info.st_mtime_ns}".encode()
    return b"pickle\0" + pickle.dumps(item, protocol=4)


def _fingerprint(
    item: Any,
    convert_bytes: bytes,
    storage: StorageBase,
    fingerprint: Callable[[Any], str | bytes] | None,
) -> str:
    own = fingerprint(item) if fingerprint is not None else item_fingerprint(item)
    if isinstance(own, str):
        own = own.encode()
    digest = hashlib.blake2b(digest_size=16)
    try:  # the format's class and settings (a StreamNumpyFormat's dtype)
        format_bytes = pickle.dumps(storage.format, protocol=4)
    except Exception:
        format_bytes = format_name(storage.format).encode()
    for part in (own, convert_bytes, format_bytes, storage.kind.encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return "blake2b:" + digest.hexdigest()


# --- worker processes end with their driver ---------------------------------------------------
#
# A pool worker whose driver died (SIGKILL, SIGTERM, a crash) would wait on its call queue
# forever. In a worker process, a watcher thread notices that its parent changed (the driver,
# or the forkserver that dies with it) and sends the worker SIGTERM; on Linux the pool's own
# workers also ask the kernel for SIGTERM when their parent ends (PR_SET_PDEATHSIG). The
# SIGTERM handler ends an idle worker at once; in an item, it raises _Stopped in convert, so
# the writer aborts (its temporaries, locks and staging directory removed) before the worker
# ends; while the writer opens and once the commit has begun, it waits for them to finish.

_PR_SET_PDEATHSIG = 1
#: seconds between two looks of the watcher thread at its process's parent
_WATCH_INTERVAL = 0.25


class _Stopped(BaseException):
    """Raised in a worker's item by SIGTERM: its driver ended, or stopped its pool."""


class _Guard:
    installed = False
    #: in an item; and whether a stop now only notes itself (while the writer is made and
    #: opened, and during the commit), for _write_shard to act on
    in_item = False
    deferred = False
    stopping = False


_GUARD = _Guard()


def _on_sigterm(signum: int, frame: Any) -> None:
    if _GUARD.stopping:
        return
    _GUARD.stopping = True
    if not _GUARD.in_item:
        os._exit(128 + signum)
    if not _GUARD.deferred:
        raise _Stopped
    # deferred: _write_shard ends the worker at the next safe point


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_INTERVAL)
    os.kill(os.getpid(), signal.SIGTERM)


def _die_with_parent() -> None:
    """Linux: SIGTERM when the thread that forked this process ends (the pool's driver)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl: the watcher thread alone
        pass


def _guard(parent_death_signal: bool) -> None:
    """Make this worker process end when its parent does (see above); once per process."""
    if _GUARD.installed:
        return
    _GUARD.installed = True
    parent = os.getppid()
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)
    if parent_death_signal:
        _die_with_parent()
    threading.Thread(
        target=_watch_parent, args=(parent,), name="guideloom_pipes-driver-watch", daemon=True
    ).start()
    if os.getppid() != parent:  # the parent ended before the watch began
        os.kill(os.getpid(), signal.SIGTERM)


def _start_worker(parent: int | None) -> None:
    """Initializer of write_parallel's own pool: Ctrl-C is for the driver (it stops the
    workers), and the workers end with it. ``parent``: the driver's pid where it is the
    workers' parent (not with a forkserver)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _guard(parent_death_signal=True)
    if parent is not None and os.getppid() != parent:  # it died before the guard was up
        os.kill(os.getpid(), signal.SIGTERM)


def _in_pool_worker(driver: int) -> bool:
    """Whether this is the main thread of a worker process of a pool the driver started
    (a user's ProcessPoolExecutor): not the driver, not a thread of Dask's workers."""
    return (
        os.getpid() != driver
        and threading.current_thread() is threading.main_thread()
        and multiprocessing.parent_process() is not None
    )


def _write_shard(
    storage: Any,
    shard: int,
    item: Any,
    convert: Callable[[Any], Iterable[Any]],
    fp: str,
    driver: int = -1,
    run: str = "",
    same_kind: bool = True,
) -> tuple[int, int]:
    """In a worker: convert ``item`` and commit it as shard ``shard``; (records, bytes).
    ``driver``: the pid of write_parallel's process; ``run``: a token of the call, so that
    an executor that caches results by their arguments (Dask) runs each call afresh;
    ``same_kind``: refuse a dataset of another kind or dtype (a run in ``"update"`` mode)."""
    if not _GUARD.installed and _in_pool_worker(driver):
        _guard(parent_death_signal=False)  # a user's pool: its forking thread may be gone
    guarded = _GUARD.installed and threading.current_thread() is threading.main_thread()
    if guarded:  # a stop waits while the writer is made and opened (its staging directory)
        _GUARD.in_item = _GUARD.deferred = True
    try:
        writer: Any = storage.sync_writer(mode="update")
        writer._warn_older_above = False  # the other shards are other workers' business
        writer._same_as_committed = same_kind
        with writer:
            if guarded:
                _GUARD.deferred = False
                if _GUARD.stopping:
                    raise _Stopped
            writer.start(shard)  # an item that yields nothing is an empty shard, not a gap
            records = 0
            for record in convert(item):
                writer.append(shard, record)
                records += 1
            writer.set_fingerprint(shard, fp)
            if guarded:  # the commit is let finish
                _GUARD.deferred = True
    except _Stopped:  # the writer aborted: nothing of the item is left
        os._exit(128 + signal.SIGTERM)
    finally:
        if guarded:
            _GUARD.in_item = _GUARD.deferred = False
    if guarded and _GUARD.stopping:  # stopped while deferred: the commit is done
        os._exit(128 + signal.SIGTERM)
    committed = writer._transactions[shard].record
    return records, sum(f.size for f in committed.files.values())


def _stop_workers(executor: cf.ProcessPoolExecutor) -> None:
    """SIGTERM to each worker of write_parallel's own pool: each aborts its item and ends."""
    processes = getattr(executor, "_processes", None) or {}
    for process in list(processes.values()):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            process.terminate()


def _remote(storage: StorageBase) -> RemoteUpload | None:
    """What reads and removes the shards of a storage at a URL; None for a local one."""
    if not isinstance(storage.dir, RemotePath):
        return None
    return RemoteUpload(storage.read_interface, str(storage.dir), "update", storage.kind)


def _unchanged(
    storage: StorageBase,
    shard: int,
    fp: str,
    remote: RemoteUpload | None = None,
    remote_sizes: dict[str, int] | None = None,
) -> bool:
    """Whether shard ``shard`` is committed from the item of fingerprint ``fp`` with its
    files at their recorded sizes (at a URL: ``remote``, with its objects' sizes from one
    listing, ``remote_sizes``)."""
    if remote is not None:
        found = remote.record(shard)
        if found is None:
            return False
        record = found
        sizes = remote_sizes or {}

        def size_of(name: str) -> int | None:
            return sizes.get(name)
    else:
        directory = os.fspath(storage.dir)
        stem = os.path.join(directory, shard_name(shard))
        try:
            with open(stem + RECORD, "rb") as file:
                record = ShardRecord.from_json(file.read(), stem + RECORD)
        except (OSError, StorageError):
            return False

        def size_of(name: str) -> int | None:
            try:
                return os.stat(os.path.join(directory, name)).st_size
            except OSError:
                return None

    if record.state != "committed" or record.fingerprint != fp or record.kind != storage.kind:
        return False
    for suffix in storage.suffixes:
        expected = record.files.get(suffix.lstrip("."))
        if expected is None or expected.size != size_of(record.file_name(suffix)):
            return False
    return True


def _settle_broken(
    storage: StorageBase,
    remote: RemoteUpload | None,
    prints: list[str],
    failures: list[tuple[int, Any, BaseException]],
    report: WriteReport,
) -> None:
    """A broken pool fails every item it held, also those whose worker committed the shard
    before the pool broke, or as it stopped: count those as written. (A user's pool may
    still be stopping its workers: a rerun skips what they commit.)"""
    lost = [shard for shard, _, error in failures if isinstance(error, cf.BrokenExecutor)]
    if not lost:
        return
    sizes = remote.object_sizes() if remote is not None else None
    done = {shard for shard in lost if _unchanged(storage, shard, prints[shard], remote, sizes)}
    if done:
        failures[:] = [failure for failure in failures if failure[0] not in done]
        report.failed = [shard for shard in report.failed if shard not in done]
        report.written.extend(done)
    for shard in done:  # their bytes (how many records convert yielded is unknown here)
        record = _record_of(storage, shard, remote)
        if record is not None:
            report.bytes += sum(f.size for f in record.files.values())


def _record_of(storage: StorageBase, shard: int, remote: RemoteUpload | None) -> ShardRecord | None:
    if remote is not None:
        return remote.record(shard)
    stem = os.path.join(os.fspath(storage.dir), shard_name(shard))
    try:
        with open(stem + RECORD, "rb") as file:
            return ShardRecord.from_json(file.read(), stem + RECORD)
    except (OSError, StorageError):
        return None


def _interrupted(
    executor: cf.Executor,
    owned: bool,
    pending: dict[cf.Future[tuple[int, int]], int],
    report: WriteReport,
    total: int,
) -> None:
    """Ctrl-C in write_parallel: cancel what has not started, stop the pool it started (a
    user's executor is left running), and say on stderr how far the dataset got."""
    for future in pending:
        future.cancel()
    if owned:
        assert isinstance(executor, cf.ProcessPoolExecutor)
        _stop_workers(executor)  # each aborts its item: no shard is left half-written
        executor.shutdown(wait=True, cancel_futures=True)
    running = 0
    for future, shard in pending.items():
        if not future.done():
            running += 1
        elif not future.cancelled() and future.exception() is None:
            report.written.append(shard)
    committed = len(report.written) + len(report.skipped)
    still = f" ({running} still running in your executor may commit theirs)" if running else ""
    print(
        f"write_parallel interrupted: {committed} shards committed, {total - committed} "
        f"not{still}; run the same call again to finish (committed shards are skipped)",
        file=sys.stderr,
        flush=True,
    )


def _check_picklable(convert: Any) -> bytes:
    try:
        return pickle.dumps(convert, protocol=4)
    except Exception as error:
        raise TypeError(
            f"convert {_short(convert)} cannot be pickled ({type(error).__name__}: {error}), "
            f"so it cannot be sent to worker processes: define it with `def` at the top level "
            f"of a module (not a lambda, a nested function or a bound method of an unpicklable "
            f"object); use functools.partial for its arguments. Nothing was written"
        ) from error


def _shards_present(storage: StorageBase, remote: RemoteUpload | None) -> set[int]:
    if remote is not None:
        return remote.shards_present()
    try:
        return shard_ids(os.listdir(os.fspath(storage.dir)))
    except FileNotFoundError:
        return set()


def write_parallel(
    storage: Any,
    items: Sequence[Any] | Iterable[Any],
    convert: Callable[[Any], Iterable[Any]],
    *,
    executor: cf.Executor | None = None,
    max_workers: int | None = None,
    progress: bool = True,
    resume: bool = True,
    mode: str = "overwrite",
    fingerprint: Callable[[Any], str | bytes] | None = None,
    max_in_flight: int | None = None,
) -> WriteReport:
    """Write a dataset from ``items`` in parallel: item ``k`` becomes shard ``k``.

    Each item (a file path, a slice of a list, ...) is sent to a worker, where
    ``convert(item)`` returns the item's records (each what ``writer.append(shard, record)``
    takes) and a writer of its own commits them as shard ``k`` with the atomic commit of
    every writer. Which worker finishes first changes nothing: the data files and commit
    records are byte for byte those of a serial run (records hold no timestamps).

    Args:
        storage: a :class:`~guideloom_pipes.StreamStorage`,
            :class:`~guideloom_pipes.DocumentStorage` or
            :class:`~guideloom_pipes.StreamWithMetaStorage` of a local directory.
        items: the work items, in shard order (any iterable; it is read once, up front).
        convert: item -> iterable of records. It crosses to the workers by pickle: a
            function defined at the top level of a module (or a ``functools.partial`` of
            one). An unpicklable one is refused before any work starts.
        executor: where to run: ``None`` starts a local process pool (``max_workers``
            processes, default one per CPU) and shuts it down at the end (its workers end
            with the calling process, even one killed by SIGKILL); any
            ``concurrent.futures.Executor`` (a ``ProcessPoolExecutor``, a
            ``ThreadPoolExecutor``, ``dask.distributed.Client(...).get_executor()``) is used
            as is and left running.
        max_workers: processes of the local pool (``executor=None`` only).
        progress: show items, records and bytes written (a tqdm bar when tqdm is
            installed, else a log line every few seconds on stderr).
        resume: skip shard ``k`` when its commit record carries the fingerprint of item
            ``k`` (the same input, the same ``convert``, format (class and settings, such as
            the dtype) and kind) and its files have
            their recorded sizes; every other item is written. ``False`` writes them all.
        mode: ``"overwrite"`` (default): once every item is written, shards numbered
            ``len(items)`` and above (left by an earlier, longer run) are removed, so the
            dataset is exactly the items; ``"update"``: they stay (with a warning);
            ``"create"``: the directory must hold no shards.
        fingerprint: item -> ``str``/``bytes`` identifying its input, instead of
            :func:`item_fingerprint` (a path's size and modification time, else the pickle).
        max_in_flight: items submitted but not finished at any time (default: twice the
            workers of the local pool, else 256).

    Returns:
        A :class:`WriteReport`: shards written and skipped, records, bytes.

    Raises:
        TypeError: ``convert`` cannot be pickled (nothing was written).
        WriteParallelError: some items failed; every other item was written, the failed
            ones' shards were not committed. It lists each (index, item, exception). A
            worker process that died mid-item breaks a process pool: the error then names
            the items in flight, and ``report.not_run`` the items never started.
        KeyboardInterrupt: re-raised after Ctrl-C cancelled the items not started and
            stopped the pool ``write_parallel`` started (a user's executor is left
            running), with one line on stderr saying how many shards are committed. Running
            the same call again finishes the dataset.
    """
    if not isinstance(storage, StorageBase):
        raise TypeError(
            f"write_parallel needs a StreamStorage, DocumentStorage or StreamWithMetaStorage, "
            f"got {type(storage).__name__}"
        )
    if mode not in WRITER_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, WRITER_MODES))}, got {mode!r}")
    if executor is not None and not isinstance(executor, cf.Executor):
        raise TypeError(
            f"executor must be a concurrent.futures.Executor (or None for a local process "
            f"pool), got {type(executor).__name__}; for Dask pass client.get_executor()"
        )
    if not callable(convert):
        raise TypeError(f"convert must be callable, got {_short(convert)}")
    convert_bytes = _check_picklable(convert)
    try:
        pickle.dumps(storage, protocol=4)
    except Exception as error:
        raise TypeError(
            f"the storage {storage!r} cannot be pickled ({error}), so workers cannot open it "
            f"(is its format or read backend defined at the top level of a module?)"
        ) from error
    directory = os.fspath(storage.dir)
    work = list(items)
    started = time.perf_counter()
    remote = _remote(storage)
    if remote is not None:
        sweep_staging()  # what workers killed in an earlier run left in the temporary dir
    if mode == "create" and remote is not None and _shards_present(storage, remote):
        raise FileExistsError(
            f"{directory} already holds shards and write_parallel was called with "
            f"mode='create'; write into a new directory, or use mode='overwrite'"
        )
    if mode == "update" and (remote is not None or os.path.isdir(directory)):
        dtype = getattr(storage.format, "stream_dtype", None)
        refuse_other_kind(
            directory, storage.kind, None if dtype is None else np.dtype(dtype), remote
        )
    report = WriteReport()
    prints = [_fingerprint(item, convert_bytes, storage, fingerprint) for item in work]
    todo = []
    check = resume and mode != "create"
    remote_sizes = remote.object_sizes() if remote is not None and check else None
    for shard, fp in enumerate(prints):
        if check and _unchanged(storage, shard, fp, remote, remote_sizes):
            report.skipped.append(shard)
        else:
            todo.append(shard)
    creating = None  # a local create run's claim on the directory, held to the end
    if mode == "create" and remote is None:
        creating = CreateLock(directory)  # a dataset there, or another create run: refused
    owned = executor is None
    if owned:
        workers = max_workers or os.cpu_count() or 1
        context = multiprocessing.get_context()
        forked_here = context.get_start_method() != "forkserver"
        executor = cf.ProcessPoolExecutor(
            max_workers=min(workers, max(1, len(todo))),
            mp_context=context,
            initializer=_start_worker,
            initargs=(os.getpid() if forked_here else None,),
        )
    assert executor is not None
    if max_in_flight is None:
        pool = getattr(executor, "_max_workers", None)
        max_in_flight = 2 * pool if isinstance(pool, int) and pool > 0 else 256
    failures: list[tuple[int, Any, BaseException]] = []
    same = mode == "update"  # overwrite and create runs replace every shard
    bar = Progress("write_parallel", len(work), "items", enabled=progress)
    driver, run = os.getpid(), os.urandom(8).hex()
    pending: dict[cf.Future[tuple[int, int]], int] = {}
    queue = iter(todo)
    broken = False
    try:
        if report.skipped:
            bar.update(len(report.skipped), skipped=len(report.skipped))

        def fill() -> None:
            nonlocal broken
            while not broken and len(pending) < max_in_flight:
                shard = next(queue, None)
                if shard is None:
                    return
                try:
                    future = executor.submit(
                        _write_shard,
                        storage,
                        shard,
                        work[shard],
                        convert,
                        prints[shard],
                        driver,
                        run,
                        same,
                    )
                except cf.BrokenExecutor:
                    broken = True
                    report.not_run.append(shard)
                    return
                pending[future] = shard

        fill()
        while pending:
            done, _ = cf.wait(list(pending), return_when=cf.FIRST_COMPLETED)
            for future in done:
                shard = pending.pop(future)
                try:
                    records, size = future.result()
                except Exception as error:
                    broken = broken or isinstance(error, cf.BrokenExecutor)
                    failures.append((shard, work[shard], error))
                    report.failed.append(shard)
                    bar.update(1, failed=1)
                    continue
                report.written.append(shard)
                report.records += records
                report.bytes += size
                bar.update(1, records=records, bytes=size)
            fill()
        if broken:
            report.not_run.extend(queue)
    except KeyboardInterrupt as interrupt:
        _interrupted(executor, owned, pending, report, len(work))
        raise interrupt.with_traceback(None) from None
    finally:
        if owned:
            executor.shutdown(wait=True, cancel_futures=True)
        bar.close()
        if creating is not None:
            creating.release()
    if broken:  # once our own pool's workers are joined: what they committed is final
        _settle_broken(storage, remote, prints, failures, report)
    report.written.sort()
    report.failed.sort()
    report.not_run.sort()
    report.seconds = time.perf_counter() - started
    if failures:
        failures.sort(key=lambda failure: failure[0])
        raise WriteParallelError(failures, report)
    above = sorted(s for s in _shards_present(storage, remote) if s >= len(work))
    if above and mode == "overwrite" and remote is not None:
        report.removed = remote.remove_from(len(work))
    elif above and mode == "overwrite":
        report.removed = remove_shards_from(directory, len(work))
    elif above:
        warnings.warn(
            f"write_parallel wrote shards 0..{len(work) - 1} of {directory}, but {len(above)} "
            f"shard(s) above them remain from an earlier write: readers see them after the "
            f"new ones. Use mode='overwrite' to make the dataset exactly the items",
            UserWarning,
            stacklevel=2,
        )
    report.seconds = time.perf_counter() - started
    return report
