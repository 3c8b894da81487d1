"""The loader when a read or ``collate_fn`` hangs or is slow, in every worker mode.

A hanging batch blocks at a :class:`loader_helpers.Gate` that the test opens at its end, so
no test can hang and every thread still busy with such a batch ends with the test.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

pytest.importorskip("torch")

from loader_helpers import (
    BlockingCollate,
    Gate,
    Ids,
    SlowCollate,
    expected_batches,
    ids_collate,
    threads_end,
    watchdog,
)

from guideloom_pipes import StatefulDataLoader
from guideloom_pipes.loader import DataLoaderTimeoutError

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


def _loader(collate_fn: Any = ids_collate, **kw: Any) -> StatefulDataLoader:
    return StatefulDataLoader(Ids(16), collate_fn, device="cpu", local_batch_size=2, **kw)


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
    assert threads_end() == [] and multiprocessing.active_children() == []
