"""The read stage of an iterable dataset (``IterableReads``) driven through a pool that
answers as the worker processes do, so what happens around a worker's death is exact."""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pytest

pytest.importorskip("torch")

from guideloom_pipes.pipes.iterable import IterableReads
from guideloom_pipes.pipes.workers.iteration import IterationStep, WorkerRecord
from guideloom_pipes.pipes.workers.tasks import Failed


class _Pool:
    """Two workers, each giving batches ``[w, w + 2, ...]`` one at a time; sending the
    ``dies_at``-th job fails as a dead worker's pipe does."""

    num_workers = 2
    closed = False

    def __init__(self, dies_at: int, bad_sample: int = -1) -> None:
        self.dies_at = dies_at
        self.bad_sample = bad_sample
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
        record = WorkerRecord(self.given[job])
        if sample == self.bad_sample:  # (the batch's own failure, as a worker answers it)
            return [Failed(ValueError(f"sample {sample} is bad")), record], 0.0, None
        return [IterationStep([sample], record)], 0.0, None

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


def test_a_batchs_own_failure_is_raised_before_a_worker_found_dead_after_it() -> None:
    pool = _Pool(dies_at=4, bad_sample=1)
    reads = IterableReads([], None, 1, False, pool=pool, max_in_flight=2)  # type: ignore[arg-type]
    reads.reset()
    assert reads.next() == [0]
    with pytest.raises(ValueError, match="sample 1 is bad"):  # (it counts as delivered)
        reads.next()
    assert [r.yielded for r in reads.records] == [1, 1]
    with pytest.raises(BrokenProcessPool):
        reads.next()
