"""Datasets, collate functions and reference orders for the loader and pipes tests.

numpy only: process workers unpickle these, and a worker that needs no torch starts in a
fraction of the time.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing
import os
import signal
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np

from guideloom_pipes.shuffle import FeistelPermutation


class Ids:
    """A map-style dataset of ``n`` samples; sample ``i`` is ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(f"sample {index} out of range")
        return int(index)


def ids_collate(samples: list[Any]) -> list[int]:
    """Collate to the plain list of sample ids (works for ``[]`` too)."""
    return [int(sample) for sample in samples]


def stream_ids_collate(samples: list[dict[str, np.ndarray]]) -> list[int]:
    """Sample ids of ``StreamDataset(fixture, 5)`` windows: token ``k`` is ``k``."""
    return [int(sample["tokens"][0]) // 5 for sample in samples]


class ReadError(Exception):
    """What :class:`FailsAt` raises."""


class FailsAt(Ids):
    """Raises :class:`ReadError` when sample ``bad`` is read."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            raise ReadError(f"cannot read sample {index}")
        return super().__getitem__(index)


class CollateFailsAt:
    """A ``collate_fn`` (picklable, for worker processes) that raises :class:`ReadError` for
    the batch holding sample ``bad`` and returns the others' ids."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, samples: list[Any]) -> list[int]:
        ids = [int(sample) for sample in samples]
        if self.bad in ids:
            raise ReadError(f"cannot collate sample {self.bad}")
        return ids


class KillsItsWorker(Ids):
    """SIGKILLs the worker process that reads sample ``bad`` (never the parent)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad
        self.parent = os.getpid()

    def __getitem__(self, index: int) -> int:
        if index == self.bad and os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


class HangsInWorker(Ids):
    """Blocks forever when a worker process reads sample ``bad`` (a hung file system)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad
        self.parent = os.getpid()

    def __getitem__(self, index: int) -> int:
        if index == self.bad and os.getpid() != self.parent:
            threading.Event().wait()
        return super().__getitem__(index)


def expected_batches(
    n: int,
    *,
    world_size: int,
    local_batch_size: int,
    rank: int,
    drop_last: bool,
    shuffle_seed: int | None,
    epoch: int = 0,
    offset: int = 0,
) -> list[list[int]]:
    """SPEC §5's order written out plainly: one rank's batches of one epoch from ``offset``."""
    global_batch = world_size * local_batch_size
    left = n - offset
    if left <= 0:
        steps = 0
    elif drop_last:
        steps = left // global_batch
    else:
        steps = -(-left // global_batch)
    perm = None if shuffle_seed is None else FeistelPermutation.for_epoch(n, shuffle_seed, epoch)
    batches = []
    for step in range(steps):
        positions = [
            offset + step * global_batch + rank + world_size * j for j in range(local_batch_size)
        ]
        ids = [p if perm is None else int(perm(p)) for p in positions if p < n]
        batches.append(ids)
    return batches


class _FailingReader:
    def __init__(self, n: int, parent: int) -> None:
        self.n = n
        self.parent = parent

    def open(self) -> None:
        if os.getpid() != self.parent:
            raise ReadError("cannot open the dataset in a worker")

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        return self.n

    def read_batch(self, ids: np.ndarray) -> list[int]:
        return [int(i) for i in ids]


class OpensOnlyInTheParent(Ids):
    """A dataset with a reader whose ``open()`` raises :class:`ReadError` in a worker."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.parent = os.getpid()

    def sync_reader(self) -> _FailingReader:
        return _FailingReader(self.n, self.parent)


def lock_collate(samples: list[Any]) -> Any:
    """A batch that cannot be pickled (a lock)."""
    return threading.Lock()


def big_collate(samples: list[Any]) -> np.ndarray:
    """A 2 MiB batch (more than a pipe holds)."""
    return np.full(1 << 18, int(samples[0]), dtype=np.int64)


class Gate:
    """Where a read or ``collate_fn`` blocks until the test releases it, in a thread or in a
    worker process: a localhost socket, so no sleeps. The blocked side connects and waits
    for the test to close the connection; the test learns that it blocks by accepting.

    A pickled gate (what a worker process gets) holds only the port. After
    :meth:`release` the gate lets nothing block any more (connecting fails).
    """

    def __init__(self) -> None:
        self._server: socket.socket | None = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._accepted: list[socket.socket] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"port": self.port}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.port = state["port"]
        self._server = None
        self._accepted = []

    def block(self) -> None:
        """Block until the test calls :meth:`release` (or the gate is gone). Blocked in the
        main thread, it wakes every 0.25 s, so a KeyboardInterrupt from a signal that came
        just before it began to wait is still raised."""
        with socket.create_connection(("127.0.0.1", self.port)) as connection:
            connection.sendall(b"b")
            connection.settimeout(0.25)
            while True:
                try:
                    connection.recv(1)  # b"" once the test closes its end
                    return
                except TimeoutError:
                    continue

    def wait_blocked(self, timeout: float = 60) -> None:
        """Return once something blocks at the gate (``TimeoutError`` after ``timeout``)."""
        assert self._server is not None, "only the test's own gate can be waited on"
        self._server.settimeout(timeout)
        connection, _ = self._server.accept()
        connection.settimeout(timeout)
        assert connection.recv(1) == b"b"
        self._accepted.append(connection)

    def release(self) -> None:
        """Let everything blocked at the gate go on, and stop it blocking anything else."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in self._accepted:
            connection.close()
        self._accepted.clear()


class BlocksAt(Ids):
    """Blocks at ``gate`` while reading sample ``bad`` (a read that hangs, or a slow one)."""

    def __init__(self, n: int, bad: int, gate: Gate) -> None:
        super().__init__(n)
        self.bad = bad
        self.gate = gate

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            self.gate.block()
        return super().__getitem__(index)


class BlockingCollate:
    """``ids_collate`` that blocks at ``gate`` for a batch holding sample ``bad``, and takes
    ``seconds`` for each other batch (sleeping: slow batches are read one per job)."""

    def __init__(self, bad: int, gate: Gate, seconds: float = 0.0) -> None:
        self.bad = bad
        self.gate = gate
        self.seconds = seconds

    def __call__(self, samples: list[Any]) -> list[int]:
        if self.bad in samples:
            self.gate.block()
        elif self.seconds:
            time.sleep(self.seconds)
        return ids_collate(samples)


class InterruptingCollate:
    """``ids_collate`` that raises ``KeyboardInterrupt`` for a batch holding sample ``bad``."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, samples: list[Any]) -> list[int]:
        if self.bad in samples:
            raise KeyboardInterrupt
        return ids_collate(samples)


class SlowCollate:
    """``ids_collate`` that takes ``seconds`` per batch (sleeping: a slow collate, not a sync)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, samples: list[Any]) -> list[int]:
        time.sleep(self.seconds)
        return ids_collate(samples)


def our_threads() -> list[threading.Thread]:
    """The threads of this package (workers, prefetch) alive now."""
    return [t for t in threading.enumerate() if t.name.startswith("guideloom")]


def threads_end(
    timeout: float = 5, ignore: Collection[threading.Thread] = ()
) -> list[threading.Thread]:
    """Our threads (but those in ``ignore``) still alive after waiting up to ``timeout``
    seconds for them to end (a worker thread finishing a batch of a closed iterator ends
    with that batch)."""
    deadline = time.monotonic() + timeout
    for thread in our_threads():
        if thread not in ignore:
            thread.join(max(0.0, deadline - time.monotonic()))
    return [thread for thread in our_threads() if thread not in ignore]


#: Threads of ours found alive when a test began, already reported (see closed_at_the_end).
_REPORTED: set[int] = set()


@contextlib.contextmanager
def watchdog(gate: Gate, seconds: float = 30) -> Iterator[threading.Timer]:
    """Opens ``gate`` after ``seconds`` if the test has not (so a test of something that must
    not wait for a blocked batch fails instead of hanging), and at the end in any case."""
    timer = threading.Timer(seconds, gate.release)
    timer.start()
    try:
        yield timer
    finally:
        timer.cancel()
        gate.release()


@contextlib.contextmanager
def closed_at_the_end(monkeypatch: Any, classes: tuple[type, ...]) -> Iterator[None]:
    """Every object of ``classes`` (stages, pools, loaders: things with ``close()``) made
    while this is open is closed when it ends, whether the test passed or failed; then no
    thread or worker process of ours may be left. So a failing test cannot leave threads
    behind that fail the next tests' own checks. (Held weakly: garbage collection still
    closes what a test drops.)"""
    # threads left by an earlier test (one that does not use this) are not this test's:
    # reported once, by name, and not held against it
    earlier = set(our_threads())
    if earlier:
        gc.collect()  # (what earlier tests dropped is closed by its finalizer)
        earlier = set(threads_end(timeout=0.5))
    new = [t.name for t in earlier if t.ident not in _REPORTED]
    if new:
        _REPORTED.update(t.ident for t in earlier if t.ident is not None)
        warnings.warn(f"threads of ours left by an earlier test: {sorted(new)}", stacklevel=3)
    made: list[weakref.ref[Any]] = []
    for cls in classes:
        init = cls.__init__

        @functools.wraps(init)
        def register(self: Any, *args: Any, __init: Any = init, **kwargs: Any) -> None:
            made.append(weakref.ref(self))
            __init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", register)
    try:
        yield
    finally:
        monkeypatch.undo()
        for ref in reversed(made):
            obj = ref()
            if obj is not None:
                with contextlib.suppress(Exception):  # the test reports its own failures
                    obj.close()
    left = threads_end(ignore=earlier)
    if left:
        gc.collect()  # (what the test dropped is closed by its finalizer, as for a user)
        left = threads_end(ignore=earlier)
    assert left == [], f"threads of this test outlived it: {[t.name for t in left]}"
    assert multiprocessing.active_children() == [], "worker processes outlived the test"


class ListsOfInts(Ids):
    """Samples that are lists of 1,000 ints (as pickled documents decode): a batch of them is
    many small objects that die after the collate."""

    def __getitem__(self, index: int) -> list[int]:
        start = 100_000 + int(index) * 1000
        return list(range(start, start + 1000))


def faults_collate(samples: list[list[int]]) -> int:
    """The minor page faults this process took since its last call (the read included)."""
    import resource

    now = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    before = getattr(faults_collate, "last", now)
    faults_collate.last = now  # type: ignore[attr-defined]
    return now - before
