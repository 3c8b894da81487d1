"""``write_parallel`` and its steps: the arguments checked, the plan (each item's
fingerprint, the shards a resumed run skips), the items submitted to the pool and collected as
they finish, then the report (and the shards above the items removed, or warned of)."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import pickle
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from guideloom_pipes.parallel.committed import (
    _fingerprint,
    _remote,
    _settle_broken,
    _shards_present,
    _unchanged,
)
from guideloom_pipes.parallel.report import WriteParallelError, WriteReport, _short
from guideloom_pipes.parallel.worker import _start_worker, _stop_workers, _write_shard
from guideloom_pipes.progress import Progress
from guideloom_pipes.storage.base import StorageBase
from guideloom_pipes.storage.manifest_write import ManifestSession
from guideloom_pipes.storage.upload import RemoteUpload, sweep_staging
from guideloom_pipes.storage.writer_modes import (
    WRITER_MODES,
    CreateLock,
    refuse_other_kind,
    remove_shards_from,
)

__all__ = ["write_parallel"]


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
    convert_bytes = _check_arguments(storage, mode, executor, convert)
    plan = _plan(storage, items, convert_bytes, fingerprint, resume=resume, mode=mode)
    run = _Run(plan, convert, mode, executor, max_workers, max_in_flight, progress)
    manifest = _Manifest(storage, plan)
    try:
        report = _run(plan, run, mode)
    except KeyboardInterrupt as interrupt:
        manifest.end(written=False)
        raise interrupt.with_traceback(None) from None
    except BaseException:
        manifest.end(written=False)
        raise
    manifest.end(written=True)
    return report


def _run(plan: _Plan, run: _Run, mode: str) -> WriteReport:
    """Run the items; the report (see :func:`_finish`)."""
    try:
        run.submit_and_collect()
    except KeyboardInterrupt:
        _interrupted(run.executor, run.owned, run.pending, plan.report, len(plan.work))
        raise  # write_parallel raises it anew: its traceback starts at the caller
    finally:
        run.close()
    return _finish(plan, run, mode)


class _Manifest:
    """The manifest of a local dataset that ``write_parallel`` writes: its marker held
    through the run (readers list the directory meanwhile), then the whole table written
    from a listing of what the run left (its workers write none)."""

    def __init__(self, storage: Any, plan: _Plan) -> None:
        self.storage = storage
        self.session: ManifestSession | None = None
        if plan.remote is None:
            self.session = ManifestSession(
                plan.directory, storage.kind, storage.suffixes, whole=True
            )

    def end(self, written: bool) -> None:
        session = self.session
        if session is None:
            return
        try:
            if written:
                self.storage.index(own_marker=session.marker)
            else:
                session.forget()  # readers list the directory until the rerun indexes it
        except (OSError, ValueError):
            session.forget()
        finally:
            session.release(drop=True)


def _check_arguments(storage: Any, mode: str, executor: Any, convert: Any) -> bytes:
    """Refuse what write_parallel cannot run (nothing is written yet); ``convert``'s pickle."""
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
    return convert_bytes


@dataclass
class _Plan:
    """What a call writes: the items, their fingerprints, the shards to write (``todo``; the
    others are in ``report.skipped``), and where (``remote``: None for a local directory)."""

    storage: StorageBase
    directory: str
    work: list[Any]
    started: float
    remote: RemoteUpload | None
    report: WriteReport
    prints: list[str]
    todo: list[int]


def _plan(
    storage: StorageBase,
    items: Sequence[Any] | Iterable[Any],
    convert_bytes: bytes,
    fingerprint: Callable[[Any], str | bytes] | None,
    *,
    resume: bool,
    mode: str,
) -> _Plan:
    """Read the items, check the target for ``mode``, and find the shards to write."""
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
    return _Plan(storage, directory, work, started, remote, report, prints, todo)


def _own_pool(max_workers: int | None, items: int) -> cf.ProcessPoolExecutor:
    """write_parallel's own process pool, for ``items`` items; its workers end with us."""
    workers = max_workers or os.cpu_count() or 1
    context = multiprocessing.get_context()
    forked_here = context.get_start_method() != "forkserver"
    return cf.ProcessPoolExecutor(
        max_workers=min(workers, max(1, items)),
        mp_context=context,
        initializer=_start_worker,
        initargs=(os.getpid() if forked_here else None,),
    )


class _Run:
    """The items of one call in flight: the pool (our own, or the user's executor), the items
    submitted up to ``max_in_flight`` at a time and collected as they finish, the progress
    bar, and a create run's claim on the directory (held to the end)."""

    def __init__(
        self,
        plan: _Plan,
        convert: Callable[[Any], Iterable[Any]],
        mode: str,
        executor: cf.Executor | None,
        max_workers: int | None,
        max_in_flight: int | None,
        progress: bool,
    ) -> None:
        self.plan = plan
        self.convert = convert
        self.creating = None  # a local create run's claim on the directory, held to the end
        if mode == "create" and plan.remote is None:
            # a dataset there, or another create run: refused
            self.creating = CreateLock(plan.directory)
        self.owned = executor is None
        self.executor: cf.Executor = (
            _own_pool(max_workers, len(plan.todo)) if executor is None else executor
        )
        if max_in_flight is None:
            pool = getattr(self.executor, "_max_workers", None)
            max_in_flight = 2 * pool if isinstance(pool, int) and pool > 0 else 256
        self.max_in_flight = max_in_flight
        self.failures: list[tuple[int, Any, BaseException]] = []
        self.same = mode == "update"  # overwrite and create runs replace every shard
        self.bar = Progress("write_parallel", len(plan.work), "items", enabled=progress)
        self.driver, self.run = os.getpid(), os.urandom(8).hex()
        self.pending: dict[cf.Future[tuple[int, int]], int] = {}
        self.queue = iter(plan.todo)
        self.broken = False

    def submit_and_collect(self) -> None:
        """Keep ``max_in_flight`` items submitted until every one has finished (or, once the
        pool broke, until those in flight have: the rest are ``report.not_run``)."""
        report = self.plan.report
        if report.skipped:
            self.bar.update(len(report.skipped), skipped=len(report.skipped))
        self._fill()
        while self.pending:
            done, _ = cf.wait(list(self.pending), return_when=cf.FIRST_COMPLETED)
            for future in done:
                self._collect(future)
            self._fill()
        if self.broken:
            report.not_run.extend(self.queue)

    def _fill(self) -> None:
        plan = self.plan
        while not self.broken and len(self.pending) < self.max_in_flight:
            shard = next(self.queue, None)
            if shard is None:
                return
            try:
                future = self.executor.submit(
                    _write_shard,
                    plan.storage,
                    shard,
                    plan.work[shard],
                    self.convert,
                    plan.prints[shard],
                    self.driver,
                    self.run,
                    self.same,
                )
            except cf.BrokenExecutor:
                self.broken = True
                plan.report.not_run.append(shard)
                return
            self.pending[future] = shard

    def _collect(self, future: cf.Future[tuple[int, int]]) -> None:
        report = self.plan.report
        shard = self.pending.pop(future)
        try:
            records, size = future.result()
        except Exception as error:
            self.broken = self.broken or isinstance(error, cf.BrokenExecutor)
            self.failures.append((shard, self.plan.work[shard], error))
            report.failed.append(shard)
            self.bar.update(1, failed=1)
            return
        report.written.append(shard)
        report.records += records
        report.bytes += size
        self.bar.update(1, records=records, bytes=size)

    def close(self) -> None:
        """Shut our own pool down (a user's executor is left running), close the bar, and
        release a create run's claim."""
        if self.owned:
            self.executor.shutdown(wait=True, cancel_futures=True)
        self.bar.close()
        if self.creating is not None:
            self.creating.release()


def _finish(plan: _Plan, run: _Run, mode: str) -> WriteReport:
    """The report, once the pool is shut down: raise for failed items; else remove the
    shards above the items (``mode="overwrite"``) or warn of them (``"update"``)."""
    storage, remote, report, work = plan.storage, plan.remote, plan.report, plan.work
    if run.broken:  # once our own pool's workers are joined: what they committed is final
        _settle_broken(storage, remote, plan.prints, run.failures, report)
    report.written.sort()
    report.failed.sort()
    report.not_run.sort()
    report.seconds = time.perf_counter() - plan.started
    failures = run.failures
    if failures:
        failures.sort(key=lambda failure: failure[0])
        raise WriteParallelError(failures, report)
    above = sorted(s for s in _shards_present(storage, remote) if s >= len(work))
    if above and mode == "overwrite" and remote is not None:
        report.removed = remote.remove_from(len(work))
    elif above and mode == "overwrite":
        report.removed = remove_shards_from(plan.directory, len(work))
    elif above:
        warnings.warn(
            f"write_parallel wrote shards 0..{len(work) - 1} of {plan.directory}, but "
            f"{len(above)} shard(s) above them remain from an earlier write: readers see them "
            f"after the new ones. Use mode='overwrite' to make the dataset exactly the items",
            UserWarning,
            stacklevel=3,  # write_parallel's caller
        )
    report.seconds = time.perf_counter() - plan.started
    return report


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
