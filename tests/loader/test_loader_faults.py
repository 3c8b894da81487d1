"""The loader when a read or ``collate_fn`` hangs or is slow, or Ctrl-C comes, in every
worker mode.

A hanging batch blocks at a :class:`loader_helpers.Gate` that the test opens at its end, so
no test can hang and every thread still busy with such a batch ends with the test.
"""

from __future__ import annotations

import _thread
import gc
import multiprocessing
import os
import signal
import threading
from typing import Any

import pytest

pytest.importorskip("torch")

from loader_helpers import (
    BlockingCollate,
    BlocksAt,
    Gate,
    Ids,
    InterruptingCollate,
    SlowCollate,
    closed_at_the_end,
    expected_batches,
    ids_collate,
    threads_end,
    watchdog,
)

from guideloom_pipes import StatefulDataLoader
from guideloom_pipes.loader import DataLoaderTimeoutError
from guideloom_pipes.pipes import ReadSamples
from guideloom_pipes.pipes.workers.threads import ThreadPool

pytestmark = [pytest.mark.fault, pytest.mark.timeout(120)]

MODES: dict[str, dict[str, Any]] = {
    "inline": {},
    "prefetch-thread": {"prefetch": 1},
    "2-threads": {"num_workers": 2, "prefetch": 2},
    "2-processes": {"num_workers": 2, "parallel_method": "process", "prefetch": 2},
}
#: The first batch of process workers waits for them to start too (a fork of the fork
#: server, or a whole new interpreter), which can take seconds on a loaded machine.
_STARTS = {"2-processes": 5.0}


@pytest.fixture(autouse=True)
def _loaders_closed_whatever_happens(monkeypatch):
    with closed_at_the_end(monkeypatch, (StatefulDataLoader, ReadSamples, ThreadPool)):
        yield


def _loader(collate_fn: Any = ids_collate, dataset: Any = None, **kw: Any) -> StatefulDataLoader:
    dataset = Ids(16) if dataset is None else dataset
    return StatefulDataLoader(dataset, collate_fn, device="cpu", local_batch_size=2, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_a_hanging_collate_fn_raises_the_timeout_error_and_closes_the_iterator(mode):
    gate = Gate()
    loader = _loader(BlockingCollate(0, gate), timeout=0.5, **MODES[mode])
    with watchdog(gate):
        it = iter(loader)
        with pytest.raises(DataLoaderTimeoutError) as info:
            next(it)
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, TimeoutError)
        message = str(info.value)
        assert "DataLoader timed out after 0.5 seconds" in message
        assert "batch 0 of this iterator (epoch 0, global position 0, rank 0 of 1)" in message
        assert loader._active_iterator() is None  # closed
        assert multiprocessing.active_children() == []  # worker processes stopped
        assert loader.state_dict()["observation_offset"] == 0  # resuming retries the batch
    assert threads_end() == []  # a thread still in the hung batch ends once it returns


@pytest.mark.parametrize("mode", ["inline", "prefetch-thread", "2-threads"])
def test_the_timeout_error_names_the_batch_that_hangs(mode):
    gate = Gate()
    # Batches of 10 ms go one per job (quick ones are read several at a time).
    loader = _loader(BlockingCollate(6, gate, seconds=0.01), timeout=1, **MODES[mode])
    loader.load_state_dict({**loader.state_dict(), "epoch": 2, "observation_offset": 2})
    with watchdog(gate):
        it = iter(loader)
        assert next(it) == [2, 3]
        assert next(it) == [4, 5]
        with pytest.raises(DataLoaderTimeoutError, match="timed out after 1 seconds") as info:
            next(it)  # samples 6 and 7
        assert "batch 2 of this iterator (epoch 2, global position 6," in str(info.value)
        assert loader.state_dict()["observation_offset"] == 6
    assert threads_end() == []


@pytest.mark.parametrize("mode", MODES)
def test_a_slow_collate_fn_within_the_timeout_delivers_every_batch(mode):
    # 8 batches of 0.15 s: each well within the timeout, the whole epoch (inline) not.
    timeout = _STARTS.get(mode, 1.0)
    loader = _loader(SlowCollate(0.15), timeout=timeout, **MODES[mode])
    expected = expected_batches(
        16, world_size=1, local_batch_size=2, rank=0, drop_last=True, shuffle_seed=None
    )
    assert list(loader) == expected
    assert loader.state_dict()["epoch"] == 1
    loader.close()  # worker processes belong to the loader
    assert threads_end() == [] and multiprocessing.active_children() == []


# -- Ctrl-C -------------------------------------------------------------------------------------


def _train(loader: StatefulDataLoader) -> None:
    for _ in loader:
        pass


@pytest.fixture
def ctrl_c_raises_keyboard_interrupt():
    """Python's own SIGINT handler for the test: a process started in the background by a
    shell (``cmd &``) ignores SIGINT from its start, and then neither a SIGINT nor
    ``_thread.interrupt_main()`` does anything."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupt_when_blocked(gate: Gate, how: str) -> threading.Thread:
    """A thread that interrupts the main thread (as Ctrl-C does) once a read blocks at
    ``gate``: by a SIGINT, or by ``_thread.interrupt_main()`` (no signal: nothing blocked
    is woken, the main thread has to look)."""
    main = threading.main_thread().ident
    assert main == threading.get_ident()

    def interrupt() -> None:
        gate.wait_blocked()
        if how == "signal":
            signal.pthread_kill(main, signal.SIGINT)
        else:
            _thread.interrupt_main()

    thread = threading.Thread(target=interrupt, name="test-interrupter", daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
@pytest.mark.parametrize("how", ["signal", "interrupt_main"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.usefixtures("ctrl_c_raises_keyboard_interrupt")
def test_ctrl_c_while_a_batch_is_read_returns_at_once_and_stops_the_iterator(mode, how):
    gate = Gate()
    loader = _loader(dataset=BlocksAt(16, 4, gate), **MODES[mode])
    with watchdog(gate) as timer:
        interrupter = _interrupt_when_blocked(gate, how)
        with pytest.raises(KeyboardInterrupt):
            _train(loader)  # batch 2 (samples 4, 5) blocks until the gate opens
        assert not timer.finished.is_set()  # control came back with the batch still blocked
        assert loader._active_iterator() is None
        assert multiprocessing.active_children() == []  # worker processes are stopped
        interrupter.join(30)
    assert threads_end() == []  # and the thread that was reading the batch ends with it


@pytest.mark.parametrize("mode", MODES)
def test_a_keyboard_interrupt_from_collate_fn_reaches_the_loop_and_stops_the_iterator(mode):
    loader = _loader(InterruptingCollate(4), **MODES[mode])
    delivered = []
    with pytest.raises(KeyboardInterrupt):
        for batch in loader:
            delivered.append(batch)
    # Batches read in one job with the interrupted one (quick ones are) end with it.
    assert delivered == [[0, 1], [2, 3]][: len(delivered)]
    assert loader._active_iterator() is None
    loader.close()  # worker processes belong to the loader
    assert multiprocessing.active_children() == []
    assert threads_end() == []
    # What was not delivered is read again by the next iterator (or a resume).
    assert loader.state_dict()["observation_offset"] == 2 * len(delivered)


def _train_holding_the_iterator(loader: StatefulDataLoader) -> None:
    iterator = iter(loader)  # a local: the traceback of what ends the loop keeps it alive
    for _ in iterator:
        raise KeyboardInterrupt  # Ctrl-C during a training step


@pytest.mark.parametrize("ending", ["close", "with", "gc"])
@pytest.mark.parametrize("mode", ["2-threads", "2-processes"])
def test_workers_of_a_loop_left_by_ctrl_c_end_with_the_loader(mode, ending):
    loader = _loader(**MODES[mode])
    if ending == "with":
        with pytest.raises(KeyboardInterrupt), loader:
            _train_holding_the_iterator(loader)
    else:
        with pytest.raises(KeyboardInterrupt) as info:
            _train_holding_the_iterator(loader)
        assert loader._active_iterator() is not None  # alive: its frame is in the traceback
        if ending == "close":
            loader.close()
        else:
            del info, loader
            gc.collect()
    assert multiprocessing.active_children() == []
    assert threads_end() == []


# -- a worker process killed between epochs ------------------------------------------------------


def _kill_and_reap(loader: StatefulDataLoader, index: int) -> None:
    """SIGKILL worker process ``index`` of ``loader`` and wait until it has been reaped."""
    process = loader._held.pool._workers[index].process  # type: ignore[union-attr]
    os.kill(process.pid, signal.SIGKILL)
    process.join(60)
    assert process.exitcode == -signal.SIGKILL


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("before", ["drained", "closed early", "killed while open"])
def test_the_next_iterator_replaces_a_worker_killed_between_epochs(persistent, before):
    loader = _loader(
        num_workers=2, parallel_method="process", prefetch=1, persistent_workers=persistent
    )
    expected = list(_loader())  # no workers
    if before == "drained":
        assert list(loader) == expected
        state = loader.state_dict()  # the next epoch's start
        resumed = expected
    else:
        iterator = iter(loader)
        assert next(iterator) == expected[0]
        state = loader.state_dict()
        if before == "killed while open":  # with batches in flight: closing must not fail
            for index in (0, 1):
                _kill_and_reap(loader, index)
        iterator.close()  # the workers may hold answers of batches never taken
        resumed = expected[1:]
    if before != "killed while open":
        for index in (0, 1):
            _kill_and_reap(loader, index)
    with pytest.warns(
        RuntimeWarning, match=r"worker process \d .*killed by SIGKILL.*replaces"
    ) as got:
        loader.load_state_dict(state)
        batches = list(loader)
    assert batches == resumed
    assert sorted(str(w.message).split()[2] for w in got) == ["0", "1"]
    assert len(multiprocessing.active_children()) == 2  # the two new ones, no more
    _kill_and_reap(loader, 1)  # and again: always
    with pytest.warns(RuntimeWarning, match="worker process 1"):
        assert list(loader) == expected
    loader.close()
    assert multiprocessing.active_children() == []
