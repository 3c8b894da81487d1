"""The shard-streaming pipeline's first stages: list shards -> this rank's shards -> reads.

``ListShards(reader) -> RankShards(...) -> ReadShards(reader, num_workers=)``, in the order
of :class:`.ShardPlan`. What each stage's ``state_dict()`` holds:

- ``ListShards``: ``{"fingerprint", "position"}``, the listing's fingerprint (the reader's,
  with the samples of each shard) and the next shard's index; ``reset(state)`` refuses a
  state of another listing, naming what changed.
- ``RankShards``: ``{"source", "epoch", "position"}``, the listing's state, the epoch and
  the next shard's place in the rank's list.
- ``ReadShards``: ``{"source"}``, its source's state as of the last shard delivered (it
  takes it at each shard it pulls), so shards read ahead are read again after a resume.

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

import collections
import concurrent.futures
from typing import Any, NamedTuple

from torchdata.nodes import BaseNode

from guideloom_pipes.datasets import reader_fingerprint
from guideloom_pipes.pipes.fingerprints import fingerprint_changes, same_dataset
from guideloom_pipes.pipes.shard_plan import ShardPlan, ShardSpan, shard_spans

__all__ = ["ListShards", "RankShard", "RankShards", "ReadShards", "ShardSamples"]


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
            if not same_dataset(saved, self.fingerprint):
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
