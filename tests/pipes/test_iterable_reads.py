"""The read stage of an iterable dataset (``IterableReads``) driven through a pool that
answers as the worker processes do, so what happens around a worker's death is exact."""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pytest

pytest.importorskip("torch")

from guideloom_pipes.pipes.iterable import IterableReads
from guideloom_pipes.pipes.workers.iteration import IterationStep, WorkerRecord


class _Pool:
    """Two workers, each giving batches ``[w, w + 2, ...]`` one at a time; sending the
    ``dies_at``-th job fails as a dead worker's pipe does."""

    num_workers = 2
    closed = False

    def __init__(self, dies_at: int) -> None:
        self.dies_at = dies_at
        self.sent = 0
        self.given = [0, 0]

    def begin(self, dataset: Any, collate_fn: Any) -> None:
        pass

    def submit_iteration(self, index: int, request: Any) -> int:
        self.sent += 1
        if self.sent == self.dies_at:
            raise BrokenProcessPool("worker 1 exited unexpectedly")
        return index

    def result(self, job: int, timeout: Any) -> tuple[list[Any], float, None]:
        self.given[job] += 1
        sample = job + 2 * (self.given[job] - 1)
        return [IterationStep([sample], WorkerRecord(self.given[job]))], 0.0, None

    def release(self) -> None:
        pass


def test_a_worker_found_dead_when_sending_ahead_fails_after_the_batch_already_read() -> None:
    pool = _Pool(dies_at=4)  # (2 jobs in flight: the 4th is sent as the 2nd batch is taken)
    reads = IterableReads([], None, 1, False, pool=pool, max_in_flight=2)  # type: ignore[arg-type]
    reads.reset()
    assert reads.next() == [0]
    assert reads.next() == [1]  # read before the failed send: delivered, not lost
    assert [r.yielded for r in reads.records] == [1, 1]
    with pytest.raises(BrokenProcessPool):
        reads.next()
