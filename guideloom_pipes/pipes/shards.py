"""Shard streaming: list shards -> deal to ranks -> read whole shards -> shuffle buffer -> batch.

The second standard pipeline (``StatefulDataLoader.from_storage(..., order="shards")``), for
stores where a request per sample window is too dear. Each rank reads its own shards, each in
one sequential read, and mixes their samples in a seeded buffer::

    ListShards(reader)                         # (shard, first sample, sample count), fingerprinted
      -> RankShards(local_batch_size, rank=, world_size=, seed=)   # this rank's shards of the epoch
      -> ReadShards(reader, num_workers=)      # whole shards, read ahead on threads, in order
      -> ShuffleBuffer(size=local_batch_size)  # a seeded permutation of each buffer of shards
      -> BatchSamples(local_batch_size)        # lists of samples, the same steps on every rank

This module names the pipeline's parts; they live in :mod:`.shard_plan` (the order, a pure
function of the listing, the seed and the epoch: :class:`ShardPlan`), :mod:`.shard_reads`
(``ListShards``, ``RankShards``, ``ReadShards``) and :mod:`.shard_batches`
(``ShuffleBuffer``, ``BatchSamples``).
"""

from __future__ import annotations

from guideloom_pipes.pipes.fingerprints import fingerprint_changes
from guideloom_pipes.pipes.shard_batches import BatchSamples, BufferedSamples, ShuffleBuffer
from guideloom_pipes.pipes.shard_plan import ShardPlan, ShardSpan, shard_spans
from guideloom_pipes.pipes.shard_reads import (
    ListShards,
    RankShard,
    RankShards,
    ReadShards,
    ShardSamples,
)

__all__ = [
    "BatchSamples",
    "BufferedSamples",
    "ListShards",
    "RankShard",
    "RankShards",
    "ReadShards",
    "ShardPlan",
    "ShardSamples",
    "ShardSpan",
    "ShuffleBuffer",
    "fingerprint_changes",
    "shard_spans",
]
