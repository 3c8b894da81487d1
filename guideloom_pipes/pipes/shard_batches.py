"""The shard-streaming pipeline's last stages: a seeded shuffle buffer -> batches of samples.

``... -> ShuffleBuffer(size=local_batch_size) -> BatchSamples(local_batch_size)``, after
:mod:`.shard_reads`. What each stage's ``state_dict()`` holds:

- ``ShuffleBuffer``: ``{"source", "delivered_in_buffer"}``, its source's state at the first
  shard of the buffer in progress (it takes it at each buffer) and the samples of that
  buffer delivered, never the buffer's contents; at a buffer's end, the source's state
  then and 0.
- ``BatchSamples``: ``{"source", "steps", "delivered"}``, its source's state, the epoch's
  steps (``None`` until known) and the batches of the epoch delivered.

Who reads these states: a pipeline a user assembles from the stages (see
``docs/pipelines.md``) and checkpoints with ``torchdata.nodes.Loader``, whose
``state_dict()`` holds the last stage's, which holds every source's in turn (torchdata's
composition). The package's own loader never reads them: its checkpoint is its own
``Position`` (``loader/checkpoint.py``), from which ``ShardOrder`` (``loader/orders.py``)
builds the pipeline already at its place (the constructors' ``epoch``, ``position``,
``skip``, ``delivered`` and ``steps``, from :meth:`.ShardPlan.resume_point`) and resets it
without a state (``loader/iterator.py``); it checks the dataset's fingerprint itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from torchdata.nodes import BaseNode

from guideloom_pipes.checks import check_int
from guideloom_pipes.pipes.shard_plan import _I64, ShardPlan
from guideloom_pipes.pipes.shard_reads import ShardSamples

__all__ = ["BatchSamples", "BufferedSamples", "ShuffleBuffer"]


class BufferedSamples(NamedTuple):
    """Samples leaving the buffer, in order, with the plan of their epoch."""

    plan: ShardPlan
    samples: list[Any]


class ShuffleBuffer(BaseNode[BufferedSamples]):
    """Gathers whole shards into buffers and emits each buffer's samples in a seeded order.

    A buffer is the plan's run of consecutive shards holding at least ``buffer_size``
    samples; its order is :meth:`ShardPlan.permutation` (seeded by seed, epoch, rank and
    buffer). Each item is the next ``size`` samples of that order (fewer only at the epoch's
    end), across buffers; the epoch ends after the plan's ``quota`` samples. The state is
    the source's state at the buffer's first shard and the samples of the buffer delivered,
    never the buffer's contents: a resume reads that buffer's shards again and skips what
    was delivered (a state taken at a buffer's end points at the next one).

    Args:
        source: Emits :class:`ShardSamples`.
        skip: Samples of the first buffer to skip (a resume point's).
        size: Samples per item (the local batch size saves a stage hop per sample).
    """

    SOURCE_KEY = "source"
    SKIP_KEY = "delivered_in_buffer"

    def __init__(self, source: BaseNode[ShardSamples], skip: int = 0, size: int = 1) -> None:
        super().__init__()
        self.size = check_int("size", size, minimum=1, not_int=ValueError)
        self.source = source
        self._skip = skip
        self._clear()

    def _clear(self) -> None:
        self._samples: list[Any] = []
        self._order: _I64 = np.empty(0, dtype=np.int64)
        self._next = 0
        self._plan: ShardPlan | None = None
        self._delivered = 0  # samples of the epoch delivered
        self._buffer_state: dict[str, Any] | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self._skip = int(initial_state[self.SKIP_KEY])
        else:
            self.source.reset()
        self._buffer_state = self.source.state_dict()

    def _refill(self) -> None:
        state = self.source.state_dict()
        samples: list[Any] = []
        while True:
            shard, read = next(self.source)  # StopIteration: the rank's shards ran out
            samples.extend(read)
            if shard.plan.last_in_buffer(shard.position):
                break
        plan = shard.plan
        buffer = plan.buffer_of[shard.position]
        if self._plan is None:  # the first buffer of this reset: where the epoch stands
            self._delivered = plan.buffer_starts[buffer]
        self._plan = plan
        self._buffer_state = state
        self._samples = samples
        self._order = plan.permutation(buffer, len(samples))
        self._next = self._skip
        self._delivered += self._skip
        self._skip = 0

    def next(self) -> BufferedSamples:
        out: list[Any] = []
        while len(out) < self.size:
            plan = self._plan
            if plan is not None and self._delivered >= plan.quota:
                break  # (the shards left are the dropped tail: not read)
            if plan is None or self._next >= len(self._samples):
                try:
                    self._refill()
                except StopIteration:
                    break
                continue
            take = min(
                self.size - len(out), len(self._samples) - self._next, plan.quota - self._delivered
            )
            samples = self._samples
            out.extend([samples[i] for i in self._order[self._next : self._next + take].tolist()])
            self._next += take
            self._delivered += take
        if not out:
            raise StopIteration()
        assert self._plan is not None
        return BufferedSamples(self._plan, out)

    def get_state(self) -> dict[str, Any]:
        if self._samples and self._next >= len(self._samples):
            # the buffer is delivered: a resume starts at the next one, reading nothing again
            return {self.SOURCE_KEY: self.source.state_dict(), self.SKIP_KEY: 0}
        return {self.SOURCE_KEY: self._buffer_state, self.SKIP_KEY: self._next}


class BatchSamples(BaseNode[list[Any]]):
    """Lists of ``local_batch_size`` samples; every rank takes the plan's ``steps`` steps.

    A rank whose samples run out before ``steps`` (``drop_last=False``) delivers its short
    last batch, then empty ones. The state is ``{"source", "steps", "delivered"}``.

    Args:
        source: Emits :class:`BufferedSamples`.
        local_batch_size: Samples per batch.
        delivered: Batches of the epoch already delivered (a resume point's).
        steps: The epoch's steps, if known (a resume point where this rank has no sample
            left needs it; otherwise the samples' plan tells).
    """

    SOURCE_KEY = "source"
    STEPS_KEY = "steps"
    DELIVERED_KEY = "delivered"

    def __init__(
        self,
        source: BaseNode[BufferedSamples],
        local_batch_size: int,
        delivered: int = 0,
        steps: int | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        self.local_batch_size = local_batch_size
        self._start = delivered
        self._delivered = delivered
        self._first_steps = steps
        self._steps: int | None = steps
        self._source_done = False

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._source_done = False
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self._steps = initial_state[self.STEPS_KEY]
            self._delivered = int(initial_state[self.DELIVERED_KEY])
        else:
            self.source.reset()
            self._delivered, self._start = self._start, 0
            self._steps, self._first_steps = self._first_steps, None

    def next(self) -> list[Any]:
        batch: list[Any] = []
        while not self._source_done and len(batch) < self.local_batch_size:
            try:
                item = next(self.source)
            except StopIteration:
                self._source_done = True
                break
            self._steps = item.plan.steps
            batch.extend(item.samples)
            if len(batch) > self.local_batch_size:
                raise ValueError(
                    f"the source emitted {len(item.samples)} samples at once, past a batch of "
                    f"{self.local_batch_size}: give ShuffleBuffer a size that divides "
                    "local_batch_size"
                )
        steps = self._steps
        if batch and (steps is None or self._delivered < steps):
            self._delivered += 1
            return batch
        if steps is not None and self._delivered < steps:
            self._delivered += 1
            return []  # this rank ran out first: an empty step (drop_last=False)
        raise StopIteration()

    def get_state(self) -> dict[str, Any]:
        return {
            self.SOURCE_KEY: self.source.state_dict(),
            self.STEPS_KEY: self._steps,
            self.DELIVERED_KEY: self._delivered,
        }
