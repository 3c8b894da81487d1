"""The shard-streaming order as a pure function: which shards each rank reads, in which order.

:func:`shard_spans` lists each shard's samples; :class:`ShardPlan` is one epoch on one rank
(used by the stages of :mod:`guideloom_pipes.pipes.shards` and by the loader's
``ShardOrder``, which asks it for an epoch's steps and resume point without running a
pipeline). It holds no state to checkpoint: the listing, the seed and the epoch give it.

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

import heapq
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["ShardPlan", "ShardSpan", "shard_spans"]

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
