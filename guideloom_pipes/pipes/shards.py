"""Shard streaming: list shards -> deal to ranks -> read whole shards -> shuffle buffer -> batch.

The second standard pipeline (``StatefulDataLoader.from_storage(..., order="shards")``), for
stores where a request per sample window is too dear. Each rank reads its own shards, each in
one sequential read, and mixes their samples in a seeded buffer::

    ListShards(reader)                         # (shard, first sample, sample count), fingerprinted
      -> RankShards(local_batch_size, rank=, world_size=, seed=)   # this rank's shards of the epoch
      -> ReadShards(reader, num_workers=)      # whole shards, read ahead on threads, in order
      -> ShuffleBuffer(size=local_batch_size)  # a seeded permutation of each buffer of shards
      -> BatchSamples(local_batch_size)        # lists of samples, the same steps on every rank

Everything about the order is a pure function of the listing, the seed and the epoch
(:class:`ShardPlan`): each epoch the non-empty shards are shuffled and dealt, one at a time,
to the rank holding the fewest samples so far, so the ranks' sample counts differ by at most
the largest shard. The rank's shards are cut into buffers: consecutive shards until the buffer holds
at least ``buffer_size`` samples; each buffer's samples come out in a permutation seeded by
``(seed, epoch, rank, buffer)``. A position in the epoch (samples delivered on the rank)
therefore needs only the shards of the buffer in progress to be read again on resume: at
most ``buffer_size - 1`` samples plus one shard.

All ranks take ``steps`` steps: with ``drop_last`` the smallest rank's count over the local
batch size (each rank drops the rest of its shuffled samples, at most the largest shard plus
a batch); without, the largest rank's, ranks that run out first getting short or empty final
batches (as GuideLoom's padding does in the global order).
"""

from __future__ import annotations

import collections
import concurrent.futures
import heapq
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from torchdata.nodes import BaseNode

from guideloom_pipes.checks import check_int
from guideloom_pipes.datasets import reader_fingerprint

__all__ = [
    "BatchSamples",
    "ListShards",
    "RankShards",
    "ReadShards",
    "ShardPlan",
    "ShardSpan",
    "ShuffleBuffer",
    "fingerprint_changes",
    "shard_spans",
]

_I64 = npt.NDArray[np.int64]
#: Keys of the seed sequences, so the shard shuffle and the buffers draw unrelated numbers.
_SHARD_SHUFFLE, _BUFFER_SHUFFLE = 0x5348, 0x4246


class ShardSpan(NamedTuple):
    """A shard and its samples: ids ``first .. first + size - 1`` of the dataset."""

    shard: int
    first: int
    size: int


def shard_spans(reader: Any) -> list[ShardSpan]:
    """The samples of each shard of an open dataset reader (a stream or document dataset's).

    A document is a sample of the shard holding it. A stream window belongs to the shard
    holding its first element, so a shard's read also takes the few elements of the next
    shard that its last window crosses into.

    Raises:
        TypeError: The reader is not one of a ``StreamDataset`` or ``DocumentDataset``.
    """
    storage_reader = getattr(reader, "storage_reader", None)
    if storage_reader is None or not hasattr(storage_reader, "num_shards"):
        raise TypeError(
            f"order='shards' reads whole shards, so it needs a StreamDataset or "
            f"DocumentDataset (from a storage); got a reader of type {type(reader).__name__}: "
            "use the default order='global' for other datasets"
        )
    lengths = [storage_reader.length(k) for k in range(storage_reader.num_shards)]
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=starts[1:])
    n = len(reader)
    length = int(getattr(reader, "sequence_length", 1))
    bounds = np.minimum(-(-starts // length), n)  # first window starting in each shard
    return [
        ShardSpan(k, int(bounds[k]), int(bounds[k + 1] - bounds[k])) for k in range(len(lengths))
    ]


def fingerprint_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """What differs between two listing fingerprints, in words."""
    changed = [
        f"{key} {saved.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(set(saved) | set(now))
        if saved.get(key) != now.get(key)
    ]
    return ", ".join(changed) or f"{dict(saved)} -> {dict(now)}"


class ShardPlan:
    """The order of one epoch on one rank: its shards, buffers, sample ids and steps.

    Args:
        spans: Every shard of the dataset (:func:`shard_spans`).
        local_batch_size: Samples per step on each rank.
        rank: This rank.
        world_size: Number of ranks.
        drop_last: Every rank stops at the smallest rank's last full batch (True), or goes
            on to the largest rank's last batch with short or empty batches (False).
        seed: Seeds the shard shuffle and the buffers.
        epoch: The epoch.
        shuffle: Shuffle the shards and each buffer's samples; False keeps shard order and
            the samples' order within each shard (shards are still dealt to ranks).
        buffer_size: Samples a buffer holds at least (its last shard completes it).

    Raises:
        ValueError: Fewer non-empty shards than ranks.
    """

    def __init__(
        self,
        spans: list[ShardSpan],
        local_batch_size: int,
        *,
        rank: int,
        world_size: int,
        drop_last: bool,
        seed: int,
        epoch: int,
        shuffle: bool,
        buffer_size: int,
    ) -> None:
        self.rank, self.epoch, self.seed, self.shuffle = rank, epoch, seed, shuffle
        nonempty = [i for i, span in enumerate(spans) if span.size]
        if len(nonempty) < world_size:
            raise ValueError(
                f"order='shards' deals whole shards to ranks, and the dataset has "
                f"{len(nonempty)} non-empty shards for world_size={world_size}: write the "
                "data in at least as many shards as ranks (many more keeps the ranks' "
                "sample counts even), or use order='global'"
            )
        order = np.asarray(nonempty, dtype=np.int64)
        if shuffle:
            rng = np.random.default_rng([seed, epoch, _SHARD_SHUFFLE])
            order = rng.permutation(order)
        totals = [0] * world_size
        heap = [(0, r) for r in range(world_size)]
        mine: list[ShardSpan] = []
        for index in order.tolist():
            total, r = heapq.heappop(heap)  # the rank with the fewest samples (lowest first)
            span = spans[index]
            totals[r] = total + span.size
            heapq.heappush(heap, (totals[r], r))
            if r == rank:
                mine.append(span)
        self.spans = mine
        self.totals = totals
        if drop_last:
            self.steps = min(totals) // local_batch_size
            self.quota = self.steps * local_batch_size
        else:
            self.steps = max(-(-total // local_batch_size) for total in totals)
            self.quota = totals[rank]
        # buffers: consecutive shards until one holds >= buffer_size samples
        self.buffer_of: list[int] = []
        starts = [0]
        held = 0
        for span in mine:
            self.buffer_of.append(len(starts) - 1)
            held += span.size
            if held >= buffer_size:
                starts.append(starts[-1] + held)
                held = 0
        if held:
            starts.append(starts[-1] + held)
        #: sample count before each buffer (and the total at the end)
        self.buffer_starts = starts

    def last_in_buffer(self, position: int) -> bool:
        """Whether the rank's shard ``position`` closes its buffer."""
        return position + 1 == len(self.spans) or (
            self.buffer_of[position + 1] != self.buffer_of[position]
        )

    def permutation(self, buffer: int, size: int) -> _I64:
        """The order buffer ``buffer``'s ``size`` samples come out in."""
        if not self.shuffle:
            return np.arange(size, dtype=np.int64)
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, buffer, _BUFFER_SHUFFLE])
        return rng.permutation(size).astype(np.int64)

    def resume_point(self, delivered: int) -> tuple[int, int]:
        """Where ``delivered`` samples of the rank leave off: ``(shard position, samples of
        its buffer already delivered)``; the shard position starts the buffer."""
        delivered = min(delivered, self.quota)
        buffer = int(np.searchsorted(self.buffer_starts, delivered, side="right")) - 1
        if buffer >= len(self.buffer_starts) - 1:  # all delivered
            return len(self.spans), 0
        position = self.buffer_of.index(buffer)
        return position, delivered - self.buffer_starts[buffer]

    def sample_ids(self) -> _I64:
        """The rank's sample ids of the epoch, in delivery order (``quota`` of them)."""
        pieces = []
        ids: list[_I64] = []
        for position, span in enumerate(self.spans):
            ids.append(np.arange(span.first, span.first + span.size, dtype=np.int64))
            if self.last_in_buffer(position):
                held = np.concatenate(ids)
                pieces.append(held[self.permutation(self.buffer_of[position], len(held))])
                ids = []
        every = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
        return every[: self.quota]


class ListShards(BaseNode[ShardSpan]):
    """Emits the dataset's shards (:class:`ShardSpan`), in shard order.

    Its state is the listing's fingerprint (the reader's: shard count, a digest of the
    files' sizes and of the records' checksums) and the position; a state taken on another
    listing is refused, naming what changed.

    Args:
        reader: An open reader of a ``StreamDataset`` or ``DocumentDataset``.
    """

    FINGERPRINT_KEY = "fingerprint"
    POSITION_KEY = "position"

    def __init__(self, reader: Any) -> None:
        super().__init__()
        self.spans = shard_spans(reader)
        fingerprint = reader_fingerprint(reader)
        self.fingerprint: dict[str, Any] = dict(fingerprint) if fingerprint else {}
        self.fingerprint.setdefault("samples", [span.size for span in self.spans])
        self._position = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._position = 0
        if initial_state is not None:
            saved = initial_state[self.FINGERPRINT_KEY]
            if saved != self.fingerprint:
                raise ValueError(
                    "this state was taken on another listing of the dataset: "
                    f"{fingerprint_changes(saved, self.fingerprint)}. Resume on the dataset "
                    "the state was taken on"
                )
            self._position = int(initial_state[self.POSITION_KEY])

    def next(self) -> ShardSpan:
        if self._position >= len(self.spans):
            raise StopIteration()
        self._position += 1
        return self.spans[self._position - 1]

    def get_state(self) -> dict[str, Any]:
        return {self.FINGERPRINT_KEY: self.fingerprint, self.POSITION_KEY: self._position}


class RankShard(NamedTuple):
    """One shard this rank reads, with its epoch's plan and place in it."""

    plan: ShardPlan
    position: int
    span: ShardSpan


class RankShards(BaseNode[RankShard]):
    """Emits this rank's shards of each epoch (see :class:`ShardPlan`), from a listing.

    At each epoch's start it reads the whole listing from ``source``. Its state is
    ``{"source", "epoch", "position"}`` (the next shard's place in the rank's list); the
    listing's state in it refuses a resume on another listing. ``reset()`` without a state
    after the epoch ran out starts the next epoch, otherwise where the node was built.

    Args:
        source: Emits :class:`ShardSpan` (:class:`ListShards`).
        local_batch_size, rank, world_size, drop_last, seed, shuffle, buffer_size: As for
            :class:`ShardPlan`.
        epoch: Epoch to start at.
        position: The rank's shard to start at (the first of a buffer).
    """

    SOURCE_KEY = "source"
    EPOCH_KEY = "epoch"
    POSITION_KEY = "position"

    def __init__(
        self,
        source: BaseNode[ShardSpan],
        local_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        seed: int = 0,
        shuffle: bool = True,
        buffer_size: int = 1,
        epoch: int = 0,
        position: int = 0,
    ) -> None:
        super().__init__()
        self.source = source
        self.local_batch_size, self.rank, self.world_size = local_batch_size, rank, world_size
        self.drop_last, self.seed, self.shuffle = drop_last, seed, shuffle
        self.buffer_size = buffer_size
        self._epoch, self._start = epoch, position
        self._position = position
        self._exhausted = False
        self._plan: ShardPlan | None = None

    def plan(self, epoch: int) -> ShardPlan:
        """The plan of ``epoch`` (reads the listing)."""
        self.source.reset()
        spans = list(self.source)
        return ShardPlan(
            spans,
            self.local_batch_size,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            buffer_size=self.buffer_size,
        )

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])  # refuses another listing
            self._epoch = int(initial_state[self.EPOCH_KEY])
            self._position = int(initial_state[self.POSITION_KEY])
        elif self._exhausted:
            self._epoch, self._position = self._epoch + 1, 0
        else:
            self._position = self._start
        self._start = self._position
        self._exhausted = False
        self._plan = self.plan(self._epoch)

    def next(self) -> RankShard:
        plan = self._plan
        assert plan is not None, "reset() first"
        if self._position >= len(plan.spans):
            self._exhausted = True
            raise StopIteration()
        self._position += 1
        return RankShard(plan, self._position - 1, plan.spans[self._position - 1])

    def get_state(self) -> dict[str, Any]:
        return {
            self.SOURCE_KEY: self.source.state_dict(),
            self.EPOCH_KEY: self._epoch,
            self.POSITION_KEY: self._position,
        }


class ShardSamples(NamedTuple):
    """A shard's samples, read."""

    shard: RankShard
    samples: list[Any]


class ReadShards(BaseNode[ShardSamples]):
    """Reads each shard's samples in one ``reader.read_range`` call, in order.

    With ``num_workers > 0`` that many threads read the next shards ahead (a shard each);
    the stage still delivers them in order. Its state is its source's as of the last shard
    delivered, so shards read ahead are read again after a resume.

    Args:
        source: Emits :class:`RankShard`.
        reader: An open dataset reader (thread-safe, as ours are).
        num_workers: Threads reading ahead; 0 reads in the calling thread.
    """

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[RankShard], reader: Any, num_workers: int = 0) -> None:
        super().__init__()
        self.source = source
        self.reader = reader
        self.num_workers = num_workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ahead: collections.deque[tuple[concurrent.futures.Future[list[Any]], Any, Any]]
        self._ahead = collections.deque()
        self._source_done = False
        self._state: dict[str, Any] | None = None

    def _read(self, shard: RankShard) -> list[Any]:
        span = shard.span
        return list(self.reader.read_range(span.first, span.size))

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._drop_ahead()
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
        else:
            self.source.reset()
        self._state = self.source.state_dict()
        self._source_done = False

    def _drop_ahead(self) -> None:
        while self._ahead:
            self._ahead.popleft()[0].cancel()

    def _fill(self) -> None:
        while not self._source_done and len(self._ahead) < max(self.num_workers, 1):
            try:
                shard = next(self.source)
            except StopIteration:
                self._source_done = True
                break
            state = self.source.state_dict()
            if self.num_workers:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(
                        self.num_workers, thread_name_prefix="guideloom-read-shards"
                    )
                future = self._pool.submit(self._read, shard)
            else:
                future = concurrent.futures.Future()
                future.set_result(None)  # type: ignore[arg-type]  # read on delivery
            self._ahead.append((future, shard, state))

    def next(self) -> ShardSamples:
        self._fill()
        if not self._ahead:
            raise StopIteration()
        future, shard, state = self._ahead.popleft()
        samples = future.result() if self.num_workers else self._read(shard)
        self._state = state
        return ShardSamples(shard, samples)

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self._state}

    def close(self) -> None:
        """Stop the reading threads."""
        self._drop_ahead()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


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
