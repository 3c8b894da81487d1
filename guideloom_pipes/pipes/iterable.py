"""The read stage of an iterable dataset (torch's ``IterableDataset``): batches from each
worker's own pass over its copy, interleaved as torch's ``DataLoader`` interleaves them.

With worker processes, the ``k``-th job of an epoch goes to the next worker in turn that is
not known to have ended, and answers are delivered in the order the jobs were sent: worker
``w``'s batches come in its own order, and a worker that has ended is passed over. That is
torch's order whatever the timing: a job sent to a worker that has ended (before this side
knew) answers "ended" and is skipped, so the batches delivered are always the next worker
in turn that still has one. Without workers the calling thread makes the one pass.

The stage's state (:meth:`IterableReads.get_state`) is each worker's
:class:`~.workers.iteration.WorkerRecord` as of its last batch delivered and whose turn is
next: what a resume starts from.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from torchdata.nodes import BaseNode

from guideloom_pipes.pipes.delivery import failed_batch_error
from guideloom_pipes.pipes.errors import mark_batch_failure
from guideloom_pipes.pipes.workers.iteration import DatasetIteration, IterationStep, WorkerRecord
from guideloom_pipes.pipes.workers.process_main import IterateRequest
from guideloom_pipes.pipes.workers.processes import ProcessPool
from guideloom_pipes.pipes.workers.tasks import Failed

__all__ = ["IterableReads"]

#: Tokens of the passes (one per epoch of a stage): a worker starts a new pass on a new one.
_tokens = itertools.count()


class IterableReads(BaseNode[Any]):
    """Batches of an iterable dataset, read by ``pool``'s worker processes (each over its
    own copy) or, without a pool, by the calling thread.

    Args:
        dataset: The iterable dataset (what ``pool``'s workers hold copies of).
        collate_fn: Applied to each batch's list of samples (to the sample itself with
            ``batch_size=None``), in the worker.
        batch_size: Samples per batch; ``None``: one sample per step, not batched.
        drop_last: Drop each worker's last partial batch.
        pool: The worker processes, or None to read in the calling thread.
        max_in_flight: Jobs sent ahead of the one being delivered.
        timeout: Seconds to wait for a batch (None: no limit).
        records: Where each worker starts (a resume); ``turn``: the worker whose turn is
            first.
        prepare: Applied to each worker's dataset copy before its pass (picklable: sent to
            the worker processes with the pass's first job).
    """

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[Any], Any] | None,
        batch_size: int | None,
        drop_last: bool,
        *,
        pool: ProcessPool | None = None,
        max_in_flight: int = 2,
        timeout: float | None = None,
        records: Sequence[WorkerRecord] | None = None,
        turn: int = 0,
        prepare: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__()
        workers = 1 if pool is None else pool.num_workers
        records = list(records) if records is not None else [WorkerRecord()] * workers
        if len(records) != workers:
            raise ValueError(f"{len(records)} worker records for {workers} workers")
        self._dataset = dataset
        self._collate = collate_fn
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._pool = pool
        self._max_in_flight = max(1, max_in_flight)
        self._timeout = timeout
        self._start = records
        self._start_turn = turn % workers
        self._prepare = prepare
        self.records = list(records)
        self.turn = self._start_turn
        self._inline: DatasetIteration | None = None
        self._in_flight: collections.deque[tuple[int, Any]] = collections.deque()
        self._send_turn = 0
        self._known_ended: list[bool] = []
        self._started: list[bool] = []
        self._token = -1
        self._open = False
        #: An error met sending the next jobs after a batch was taken: raised at the next
        #: ``next()``, so the batch already read is delivered first.
        self._deferred: Exception | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            raise ValueError("IterableReads resumes from the records it is built with")
        self._release()
        self.records = list(self._start)
        self.turn = self._start_turn
        self._open = True
        if self._pool is None:
            self._inline = DatasetIteration(
                self._dataset,
                self._collate,
                self._batch_size,
                self._drop_last,
                self.records[0],
                copy_states=True,
                prepare=self._prepare,
            )
            self.records[0] = self._inline.record  # (the states at the pass's start)
            return
        self._pool.begin(self._dataset, self._collate)
        self._token = next(_tokens)
        self._send_turn = self.turn
        self._known_ended = [record.ended for record in self.records]
        self._started = [False] * len(self.records)
        self._fill()

    def _fill(self) -> None:
        pool = self._pool
        assert pool is not None
        workers = len(self.records)
        while len(self._in_flight) < self._max_in_flight:
            for _ in range(workers):
                index = self._send_turn
                self._send_turn = (index + 1) % workers
                if not self._known_ended[index]:
                    break
            else:
                return  # every worker has ended
            start = None if self._started[index] else self.records[index]
            self._started[index] = True
            request = IterateRequest(
                self._token,
                start,
                self._batch_size,
                self._drop_last,
                None if start is None else self._prepare,
            )
            self._in_flight.append((index, pool.submit_iteration(index, request)))

    def next(self) -> Any:
        if not self._open:
            raise StopIteration
        if self._pool is None:
            return self._next_inline()
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            try:
                raise deferred
            finally:
                del deferred
        pool = self._pool
        while self._in_flight:
            index, job = self._in_flight[0]
            outcomes, _, _ = pool.result(job, self._timeout)  # (a timeout leaves it first)
            self._in_flight.popleft()
            step = outcomes[0]
            if type(step) is Failed:
                if len(outcomes) == 2:  # the batch's own failure: it counts as delivered
                    self.records[index] = outcomes[1]
                    self._known_ended[index] = outcomes[1].ended
                    self.turn = (index + 1) % len(self.records)
                    self._fill_after_taking()
                    error = failed_batch_error(step)
                else:  # the pass could not start (a bad state, iter() raised): it ends here
                    error = step.raised()
                try:
                    raise error
                finally:
                    del error, step
            assert isinstance(step, IterationStep)
            if step.record.ended:
                self._known_ended[index] = True
            if step.batch is None:
                if not self.records[index].ended:
                    self.records[index] = step.record
                self._fill()
                continue
            self.records[index] = step.record
            self.turn = (index + 1) % len(self.records)
            self._fill_after_taking()
            return step.batch
        self._release()
        raise StopIteration

    def _fill_after_taking(self) -> None:
        """:meth:`_fill` once a batch (or a batch's own failure) was taken: an error sending
        the next jobs (a worker found dead) is raised at the next ``next()``, after it."""
        try:
            self._fill()
        except Exception as error:
            self._deferred = error

    def _next_inline(self) -> Any:
        iteration = self._inline
        assert iteration is not None
        try:
            step = iteration.step()
        except Exception as error:
            mark_batch_failure(error)  # this batch's alone: the next one follows
            raise
        finally:
            self.records[0] = iteration.record
        if step.batch is None:
            self._open = False
            raise StopIteration
        return step.batch

    def get_state(self) -> dict[str, Any]:
        return {"records": [r.as_dict() for r in self.records], "turn": self.turn}

    def _release(self) -> None:
        self._deferred = None
        self._in_flight.clear()
        if self._pool is not None and not self._pool.closed:
            self._pool.release()

    def close(self) -> None:
        """Stop: answers of the jobs sent ahead are dropped (the pool's owner stops it)."""
        self._open = False
        self._inline = None
        self._release()
