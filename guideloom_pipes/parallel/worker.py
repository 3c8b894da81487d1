"""The worker side of :func:`~guideloom_pipes.parallel.write_parallel`: one item converted
and committed as its shard, and worker processes that end with their driver."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

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
        writer._keeps_manifest = False  # the driver writes the manifest once, at the end
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
