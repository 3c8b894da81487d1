"""Quick batches that run only our code are read by the calling thread, not handed to a
worker thread (``ReadSamples``' policy, see ``_quick_to_inline``).

The policy follows measured figures (a batch's time and CPU share); these tests replace the
clock the stage measures inline batches with, and set what the workers' first job taught,
so they do not depend on how fast or how loaded the machine is.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
from loader_helpers import closed_at_the_end

from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage
from guideloom_pipes.datasets import open_reader
from guideloom_pipes.pipes import Prefetcher, ReadSamples, Shuffle
from guideloom_pipes.pipes import read as read_module
from guideloom_pipes.pipes._pool import _ThreadPool
from guideloom_pipes.pipes.collate import default_collate
from guideloom_pipes.pipes.positions import RankPositions

TOKENS = np.dtype([("tokens", "<i4")])
LENGTH = 4
BATCH = 2
WINDOWS = 1000  # 500 batches: more than the workers' jobs hold ahead (at most 2 x 64)


@pytest.fixture(autouse=True)
def _stages_closed_whatever_happens(monkeypatch: pytest.MonkeyPatch) -> Any:
    with closed_at_the_end(monkeypatch, (ReadSamples, Prefetcher, _ThreadPool)):
        yield


class FakeClock:
    """Stands in for ``time`` in the stage: every reading moves on by ``step`` seconds, and
    the thread's CPU clock moves with it unless ``waiting`` (then it stands still)."""

    def __init__(self, step: float = 1e-6) -> None:
        self.step = step
        self.waiting = False
        self.now = 0.0
        self.cpu = 0.0

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now

    def thread_time(self) -> float:
        if not self.waiting:
            self.cpu += 4 * self.step  # ahead of the wall clock: a share of 1 (capped)
        return self.cpu


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(read_module, "time", fake)
    return fake


class Readers:
    """Our dataset's reader, opened here, whose reads note the thread that runs them (and
    can be told to fail)."""

    def __init__(self, root: Path) -> None:
        storage = StreamStorage(root, StreamNumpyFormat(TOKENS))
        with storage.sync_writer() as writer:
            writer.append(0, {"tokens": np.arange(WINDOWS * LENGTH // 2)})
            writer.append(1, {"tokens": np.arange(WINDOWS * LENGTH // 2, WINDOWS * LENGTH)})
        self.dataset = StreamDataset(storage, LENGTH)
        self.reader, _ = open_reader(self.dataset)
        self.threads: list[str] = []
        self.fail_on: int | None = None
        self.interrupt_on: int | None = None
        for name in ("read_batch", "read_arrays"):
            setattr(self.reader, name, self._noting(getattr(self.reader, name)))

    def _noting(self, read: Any) -> Any:
        def noted(ids: Any) -> Any:
            self.threads.extend([threading.current_thread().name] * (len(ids) // BATCH))
            if self.fail_on is not None and self.fail_on in ids.tolist():
                raise ValueError(f"sample {self.fail_on} cannot be read")
            if self.interrupt_on is not None and self.interrupt_on in ids.tolist():
                raise KeyboardInterrupt
            return read(ids)

        return noted

    def close(self) -> None:
        self.reader.close()


@pytest.fixture
def readers(tmp_path: Path) -> Any:
    made = Readers(tmp_path / "tokens")
    yield made
    made.close()


def _ids() -> Shuffle:
    return Shuffle(RankPositions(WINDOWS, BATCH), 11)


def _stage(readers: Readers, collate_fn: Any = default_collate, **kw: Any) -> ReadSamples:
    return ReadSamples(
        _ids(), readers.dataset, num_workers=2, reader=readers.reader, collate_fn=collate_fn, **kw
    )


def _reference(readers: Readers, collate_fn: Any = default_collate) -> list[Any]:
    node = ReadSamples(_ids(), readers.dataset, reader=readers.reader, collate_fn=collate_fn)
    node.reset()
    out = list(node)
    node.close()
    readers.threads.clear()
    return out


def _tokens(batch: Any) -> list[list[int]]:
    if isinstance(batch, dict):
        return batch["tokens"].tolist()
    return [sample["tokens"].tolist() for sample in batch]


def _taught_quick(node: ReadSamples) -> None:
    """What the workers' first job would teach of quick batches that compute."""
    node._batch_seconds, node._cpu_share = 1e-6, 1.0


def test_quick_batches_of_our_code_are_read_by_the_calling_thread(
    readers: Readers, clock: FakeClock
) -> None:
    expected = _reference(readers)
    node = _stage(readers)
    node.reset()
    got = [next(node)]  # the first job runs on a worker and is timed
    _taught_quick(node)
    got += list(node)
    node.close()

    assert list(map(_tokens, got)) == list(map(_tokens, expected))
    main = threading.current_thread().name
    # jobs submitted before the figures were known drain first (at most 2 x 64 batches)
    assert len(readers.threads) == len(expected)
    assert readers.threads[-300:] == [main] * 300
    assert any(name != main for name in readers.threads[:1])


def test_a_user_collate_keeps_the_batches_on_the_workers(
    readers: Readers, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    def user_collate(samples: list[Any]) -> list[Any]:
        return samples

    inline = []
    monkeypatch.setattr(
        ReadSamples, "_next_inline", lambda self: inline.append(1) or pytest.fail("inline")
    )
    node = _stage(readers, user_collate)
    node.reset()
    next(node)
    _taught_quick(node)
    assert not node._quick_to_inline()
    rest = list(node)
    node.close()
    assert len(rest) == WINDOWS // BATCH - 1 and not inline


@pytest.mark.parametrize("change", ["slow", "waiting"])
def test_batches_that_turn_slow_or_wait_go_back_to_the_workers(
    readers: Readers, clock: FakeClock, change: str
) -> None:
    expected = _reference(readers)
    node = _stage(readers)
    node.reset()
    got = [next(node)]
    _taught_quick(node)
    while node._pending or node._job is not None:  # the jobs already submitted
        got.append(next(node))
    for _ in range(20):
        got.append(next(node))
    assert node._quick_to_inline() and not node._pending
    turned = len(got)
    if change == "slow":
        clock.step = 1.0  # each inline batch now measures a second
    else:
        clock.waiting = True  # ... or no CPU time: it waits on I/O
    # a second per batch tells at once; waiting, once a few sampled batches have told
    for _ in range(8 * read_module._INLINE_SAMPLE):
        got.append(next(node))
        if not node._quick_to_inline():
            break
    assert not node._quick_to_inline()
    assert change == "waiting" or len(got) == turned + 1
    got.append(next(node))  # through the workers again
    assert node._jobs > 0 or node._job is not None
    got += list(node)
    node.close()
    assert list(map(_tokens, got)) == list(map(_tokens, expected))


def test_a_failed_inline_batch_counts_as_delivered_and_the_next_follows(
    readers: Readers, clock: FakeClock
) -> None:
    expected = _reference(readers)
    node = _stage(readers)
    node.reset()
    got = [next(node)]
    _taught_quick(node)
    while node._pending or node._job is not None:
        got.append(next(node))
    failing = len(got) + 3
    readers.fail_on = int(expected[failing]["tokens"][0, 0]) // LENGTH
    while True:
        try:
            got.append(next(node))
        except ValueError as error:
            assert "cannot be read" in str(error)
            break
    assert len(got) == failing
    readers.fail_on = None
    got.append(next(node))
    assert _tokens(got[-1]) == _tokens(expected[failing + 1])


def test_ctrl_c_inside_an_inline_batch_delivers_nothing_and_a_resume_reads_it(
    readers: Readers, clock: FakeClock
) -> None:
    expected = _reference(readers)
    node = _stage(readers)
    node.reset()
    got = [next(node)]
    _taught_quick(node)
    while node._pending or node._job is not None:
        got.append(next(node))
    state = node.state_dict()
    readers.interrupt_on = int(expected[len(got)]["tokens"][0, 0]) // LENGTH
    with pytest.raises(KeyboardInterrupt):
        next(node)
    assert node.state_dict() == state
    readers.interrupt_on = None
    node.close()

    resumed = _stage(readers)
    resumed.reset(state)
    got += list(resumed)
    resumed.close()
    assert list(map(_tokens, got)) == list(map(_tokens, expected))


def test_a_state_taken_between_inline_batches_resumes_there(
    readers: Readers, clock: FakeClock
) -> None:
    expected = _reference(readers)
    node = _stage(readers)
    node.reset()
    got = [next(node)]
    _taught_quick(node)
    while len(got) < 300:
        got.append(next(node))
    assert node._quick_to_inline() and not node._pending
    state = node.state_dict()
    node.reset()  # no state: the epoch restarts where the delivered batches leave it
    again = next(node)
    node.close()
    resumed = _stage(readers)
    resumed.reset(state)
    rest = list(resumed)
    resumed.close()
    assert list(map(_tokens, got + rest)) == list(map(_tokens, expected))
    assert _tokens(again) == _tokens(expected[0])  # a partly read epoch restarts (SPEC)
