"""The loader's orders: how a :class:`~guideloom_pipes.StatefulDataLoader` walks its dataset.

An order is a strategy object the loader holds (``loader.order`` names it): it knows an
epoch's length, builds the pipeline of stages that reads an epoch from a global position,
lists the sample ids each batch of an epoch holds (``loader.sampler``), and adds and checks
its own keys of the checkpoint. The loader's methods take the loader as their first
argument and keep no reference to it. Adding an order adds a class here, not a branch in
the loader:

- :class:`GlobalOrder`: GuideLoom's order. Rank ``r`` reads positions ``r, r + W, ...`` of
  each global batch, shuffled by the epoch's Feistel permutation; one read per sample.
- :class:`ShardOrder`: each rank reads whole shards, dealt per epoch and mixed in a seeded
  buffer (``docs/shard-streaming.md``); one read per shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from torchdata.nodes import BaseNode

from guideloom_pipes.batch import draws_no_random, keeps_no_arrays
from guideloom_pipes.mixture import MixtureDataset
from guideloom_pipes.pipes import (
    Collate,
    PinMemory,
    PinnedRing,
    Prefetcher,
    RankPositions,
    ReadSamples,
    Shuffle,
    ToDevice,
    num_steps,
)
from guideloom_pipes.pipes.read import CHUNK_SECONDS
from guideloom_pipes.pipes.seeding import Seeding, batch_seed
from guideloom_pipes.pipes.shards import (
    BatchSamples,
    ListShards,
    RankShards,
    ReadShards,
    ShardPlan,
    ShuffleBuffer,
    shard_spans,
)

if TYPE_CHECKING:
    from guideloom_pipes.loader.stateful import StatefulDataLoader

#: Extra keys of a shard-streaming state: the order, the world size and the buffer size its
#: shards were dealt and mixed with.
ORDER_KEY = "order"
WORLD_SIZE_KEY = "world_size"
BUFFER_KEY = "shuffle_buffer"
#: The global batch size of the run that reached a state's offset (a key of every state).
GLOBAL_BATCH_KEY = "global_batch_size"


class GlobalOrder:
    """GuideLoom's order: strided rank shares of each global batch of (shuffled) positions."""

    name = "global"

    def forget(self) -> None:
        """The loader opened or closed its reader (nothing is kept from it here)."""

    def steps(self, loader: StatefulDataLoader[Any, Any], epoch: int) -> int:
        """Steps in a full epoch: ``n // G`` with ``drop_last``, else ``ceil(n / G)``."""
        n, g = loader._num_samples(), loader.global_batch_size
        return n // g if loader.settings.drop_last else -(-n // g)

    def steps_left(self, loader: StatefulDataLoader[Any, Any], epoch: int, offset: int) -> int:
        """Steps of ``epoch`` left from global position ``offset``."""
        return num_steps(
            loader._num_samples(), offset, loader.global_batch_size, loader.settings.drop_last
        )

    def rank_samples(self, loader: StatefulDataLoader[Any, Any], epoch: int) -> int:
        """Samples this rank reads in a whole epoch (padding and a dropped tail left out)."""
        n, world = loader._num_samples(), loader.settings.world_size
        limit = min(n, self.steps(loader, epoch) * loader.global_batch_size)
        return max(0, -(-(limit - loader.settings.rank) // world))

    def drops_tail(self, loader: StatefulDataLoader[Any, Any]) -> int:
        """Samples ``drop_last`` drops from each epoch (for the warning of torch calls)."""
        return loader._num_samples() % loader.global_batch_size

    def epoch_batches(
        self, loader: StatefulDataLoader[Any, Any], epoch: int
    ) -> Iterator[list[int]]:
        """The sample ids of each batch this rank reads in ``epoch``, from its start."""
        for item in sample_ids(loader, epoch):
            ids = item if isinstance(item, np.ndarray) else item.positions
            yield [int(i) for i in ids]

    def build(self, loader: StatefulDataLoader[Any, Any], epoch: int, offset: int) -> BaseNode[Any]:
        """positions -> shuffle -> read (and collate) -> pin -> prefetch -> device."""
        settings = loader.settings
        mixture_epoch(loader, epoch)
        node = sample_ids(loader, epoch, offset)
        inline = settings.num_workers == 0 and settings.prefetch == 0
        seeds = batch_seeds(loader, epoch, offset)
        ring = pinned_ring(loader)
        buffers = ring.take if ring is not None else None
        if inline and not settings.timeout:
            # Everything inline in the training thread: the fewest steps per batch, the
            # collate inside the read (under the batch's seed when batches are seeded).
            node = ReadSamples(
                node,
                loader.dataset,
                reader=loader._held.reader,
                collate_fn=settings.collate_fn,
                batch_seeds=seeds,
                buffers=buffers,
            )
            return finish_pipeline(loader, node, ring)
        # Workers read and collate whole batches; finished batches wait in this stage
        # (``prefetch`` of them beyond the workers' own), so no extra thread hop. With
        # num_workers=0, prefetch uses one background thread (GuideLoom's prefetch thread);
        # so does a timeout without prefetch, reading only the batch asked for.
        workers = settings.num_workers
        process = workers > 0 and settings.parallel_method == "process"
        node = ReadSamples(
            node,
            loader.dataset,
            num_workers=workers or 1,
            method=settings.parallel_method if workers else "thread",  # type: ignore[arg-type]
            multiprocessing_context=settings.multiprocessing_context,
            collate_fn=settings.collate_fn,
            max_in_flight=1 if inline else batches_ahead(loader),
            timeout=settings.timeout or None,
            reader=loader._held.reader,
            chunk_seconds=0 if inline else CHUNK_SECONDS,
            batch_seeds=seeds,
            # workers know who they are (get_worker_info); the prefetch thread of
            # num_workers=0 is no worker, as in torch
            base_seed=loader.base_seed if workers else None,
            worker_init_fn=settings.worker_init_fn if workers else None,
            process_pool=(
                loader._held.processes(loader.dataset, settings, loader.base_seed)
                if process
                else None
            ),
            buffers=buffers,
            figures=loader._read_figures,
        )
        return finish_pipeline(loader, node, ring)

    def state(self, loader: StatefulDataLoader[Any, Any]) -> dict[str, Any]:
        """This order's keys of ``state_dict()`` (none: GuideLoom's keys say it all)."""
        return {}

    def check_state(
        self,
        loader: StatefulDataLoader[Any, Any],
        state: Mapping[str, Any],
        epoch: int,
        offset: int,
    ) -> bool:
        """Whether this order checked the state's position itself (it does not: the loader's
        checks of the offset against the dataset's size apply)."""
        return False


class ShardOrder:
    """Whole shards per rank, dealt and mixed per epoch (``from_storage(order="shards")``).

    Keeps the shard listing of the open reader and the last epoch's plan."""

    name = "shards"

    def __init__(self, buffer_size: int) -> None:
        self.buffer_size = buffer_size
        self._spans: list[Any] | None = None
        self._plan_cache: tuple[tuple[int, int], ShardPlan] | None = None

    def forget(self) -> None:
        """The loader opened or closed its reader: list its shards again when next asked."""
        self._spans, self._plan_cache = None, None

    def plan(self, loader: StatefulDataLoader[Any, Any], epoch: int) -> ShardPlan:
        """This rank's plan of ``epoch`` (from the shard listing)."""
        settings = loader.settings
        seed = loader.shuffle_seed or 0
        cached = self._plan_cache
        if cached is not None and cached[0] == (epoch, seed):  # (a loaded state may set seed)
            return cached[1]
        if self._spans is None:
            loader.open()
            self._spans = shard_spans(loader._held.reader)
        plan = ShardPlan(
            self._spans,
            settings.local_batch_size,
            rank=settings.rank,
            world_size=settings.world_size,
            drop_last=settings.drop_last,
            seed=seed,
            epoch=epoch,
            shuffle=settings.shuffle,
            buffer_size=self.buffer_size,
        )
        self._plan_cache = ((epoch, seed), plan)
        return plan

    def steps(self, loader: StatefulDataLoader[Any, Any], epoch: int) -> int:
        """The steps of ``epoch`` (they depend on how its shuffled shards were dealt)."""
        return self.plan(loader, epoch).steps

    def steps_left(self, loader: StatefulDataLoader[Any, Any], epoch: int, offset: int) -> int:
        return max(self.plan(loader, epoch).steps - offset // loader.global_batch_size, 0)

    def rank_samples(self, loader: StatefulDataLoader[Any, Any], epoch: int) -> int:
        return self.plan(loader, epoch).quota

    def drops_tail(self, loader: StatefulDataLoader[Any, Any]) -> int:
        """0: the tail this order drops depends on each epoch's dealing (documented)."""
        return 0

    def epoch_batches(
        self, loader: StatefulDataLoader[Any, Any], epoch: int
    ) -> Iterator[list[int]]:
        plan = self.plan(loader, epoch)
        ids = plan.sample_ids().tolist()
        size = loader.settings.local_batch_size
        for step in range(plan.steps):
            yield ids[step * size : (step + 1) * size]

    def build(self, loader: StatefulDataLoader[Any, Any], epoch: int, offset: int) -> BaseNode[Any]:
        """list shards -> this rank's shards -> whole-shard reads -> buffer -> batches."""
        settings = loader.settings
        size = settings.local_batch_size
        plan = self.plan(loader, epoch)
        step = offset // loader.global_batch_size
        position, skip = plan.resume_point(step * size)
        node: BaseNode[Any] = RankShards(
            ListShards(loader._held.reader),
            size,
            rank=settings.rank,
            world_size=settings.world_size,
            drop_last=settings.drop_last,
            seed=loader.shuffle_seed or 0,
            shuffle=settings.shuffle,
            buffer_size=self.buffer_size,
            epoch=epoch,
            position=position,
        )
        node = ReadShards(node, loader._held.reader, num_workers=settings.num_workers)
        node = ShuffleBuffer(node, skip=skip, size=size)
        node = BatchSamples(node, size, delivered=step, steps=plan.steps)
        # under each batch's seed where a collate of the user's may draw; a prefetch thread
        # collates: the global generators are the training loop's then, so only
        # batch_rng() is seeded (as the global order's threads do)
        seeding: Seeding = "local" if settings.prefetch else "globals"
        seeds = batch_seeds(loader, epoch, offset)
        node = Collate(node, settings.collate_fn, batch_seeds=seeds, seeding=seeding)
        if settings.prefetch and not settings.pin_memory:  # (pinning prefetches after itself)
            node = Prefetcher(node, settings.prefetch)  # collated batches wait ahead
        return finish_pipeline(loader, node)

    def state(self, loader: StatefulDataLoader[Any, Any]) -> dict[str, Any]:
        return {
            ORDER_KEY: self.name,
            WORLD_SIZE_KEY: loader.settings.world_size,
            BUFFER_KEY: self.buffer_size,
        }

    def check_state(
        self,
        loader: StatefulDataLoader[Any, Any],
        state: Mapping[str, Any],
        epoch: int,
        offset: int,
    ) -> bool:
        """Refuse a state taken on another world size, batch size or buffer, or past the
        epoch's steps; True: the position is a step of this order (checked here)."""
        for key, now in (
            (WORLD_SIZE_KEY, loader.settings.world_size),
            (GLOBAL_BATCH_KEY, loader.global_batch_size),
            (BUFFER_KEY, self.buffer_size),
        ):
            saved = state.get(key)
            if saved != now:
                raise ValueError(
                    f"this order='shards' state was taken with {key}={saved!r}, this loader "
                    f"has {key}={now!r}: ranks own whole shards, dealt and mixed for that "
                    f"setting, so the position cannot be carried over exactly. Resume with "
                    f"{key}={saved!r}, or start the epoch afresh (load the state with "
                    f"'epoch': {epoch + 1}, 'observation_offset': 0 and this setting)"
                    if offset
                    else f"this order='shards' state was taken with {key}={saved!r}, this "
                    f"loader has {key}={now!r}; pass the state's {key} to resume it"
                )
        steps = self.plan(loader, epoch).steps
        g = loader.global_batch_size
        if offset % g or offset // g > steps:
            raise ValueError(
                f"state_dict['observation_offset'] = {offset} is not a step of epoch {epoch} "
                f"in order='shards' ({steps} steps of {g} positions): the state belongs to "
                "another dataset or setting (or was changed)"
            )
        return True


def mixture_epoch(loader: StatefulDataLoader[Any, Any], epoch: int) -> None:
    """A mixture's weights history (from ``load_state_dict``) spans the epoch it was saved
    in: a later epoch reads the mixture's own weights from position 0."""
    here = loader._position
    if here.mixture_epoch is not None and epoch > here.mixture_epoch:
        here.mixture_epoch = None
        if isinstance(loader.dataset, MixtureDataset) and loader.dataset.resume_history([], 0):
            loader._held.stop_processes()  # (they hold a copy of the mixture)


def make_order(name: str, shuffle_buffer: int | None) -> GlobalOrder | ShardOrder:
    """The strategy object of the order a loader's settings name."""
    if name == ShardOrder.name:
        assert shuffle_buffer is not None  # (resolve_order gives the shard order one)
        return ShardOrder(shuffle_buffer)
    return GlobalOrder()


def sample_ids(loader: StatefulDataLoader[Any, Any], epoch: int, offset: int = 0) -> BaseNode[Any]:
    """The global order's first stages: this rank's positions of ``epoch`` from the global
    ``offset``, shuffled into sample ids when the loader shuffles."""
    settings = loader.settings
    node: BaseNode[Any] = RankPositions(
        loader._num_samples(),
        settings.local_batch_size,
        rank=settings.rank,
        world_size=settings.world_size,
        drop_last=settings.drop_last,
        epoch=epoch,
        observation_offset=offset,
    )
    if settings.shuffle:
        node = Shuffle(node, loader.shuffle_seed)
    return node


def batch_seeds(
    loader: StatefulDataLoader[Any, Any], epoch: int, offset: int
) -> Callable[[int], int] | None:
    """The seed of the ``k``-th batch of an iterator starting at ``(epoch, offset)``, from
    the base seed and the batch's place (epoch, global position, rank), so it is the same
    whichever worker reads the batch and after a resume. ``None`` when only our code reads
    and collates (nothing draws random numbers)."""
    collate = loader.settings.collate_fn
    # (our collates declare that they draw no random numbers: guideloom_pipes.batch)
    if hasattr(loader.dataset, "sync_reader") and (collate is None or draws_no_random(collate)):
        return None
    base, rank, step = loader.base_seed, loader.settings.rank, loader.global_batch_size

    def seed(k: int) -> int:
        return batch_seed(base, epoch, offset + k * step, rank)

    return seed


def finish_pipeline(
    loader: StatefulDataLoader[Any, Any], node: BaseNode[Any], ring: PinnedRing | None = None
) -> BaseNode[Any]:
    """The stages after the batches: pinning, prefetching, the device. Batches read into
    ``ring``'s pinned buffers go to the device at once: they are pinned already, and the
    read stage holds the prefetched ones."""
    settings = loader.settings
    if ring is not None:
        return ToDevice(node, settings.device, ring=ring)
    if settings.pin_memory:
        node = PinMemory(node)
        if settings.prefetch > 0:
            node = Prefetcher(node, settings.prefetch)  # pin in the background
    if settings.device.type != "cpu":
        node = ToDevice(node, settings.device)
    return node


def batches_ahead(loader: StatefulDataLoader[Any, Any]) -> int:
    """The most batches read ahead of the training loop: ``2 * num_workers`` (or one with
    the prefetch thread alone) plus ``prefetch`` waiting; 0 when reading inline. (Chunks of
    quick batches may hold more, each worth only ~2 ms of a worker's time.)"""
    settings = loader.settings
    if settings.num_workers == 0 and settings.prefetch == 0:
        return 0
    return (2 * settings.num_workers or 1) + settings.prefetch


def pinned_ring(loader: StatefulDataLoader[Any, Any]) -> PinnedRing | None:
    """The ring of pinned buffers an iterator reads its windows into, or None where the
    path does not apply: batches pinned for a CUDA device, in GuideLoom's global order,
    collated by a collate that keeps no arrays (``keeps_no_arrays``: ``default_collate``,
    whose tensors are the windows' own memory; a user's ``collate_fn`` could keep or hand on
    the host buffers), read in this process (inline or
    threads), from a stream whose columns are views of the windows read (a
    ``StreamNumpyFormat`` of one field). Elsewhere batches are pinned by a copy
    (``PinMemory``), as before.

    Its size is what is in flight: the batches read ahead, the one being copied to the
    device and the one whose copy may still run. The loader keeps it until ``close()``."""
    settings = loader.settings
    if not loader._held.ring_device(settings) or not isinstance(loader._order, GlobalOrder):
        return None
    if not keeps_no_arrays(settings.collate_fn):
        return None
    if settings.num_workers > 0 and settings.parallel_method == "process":
        return None
    reader = loader._held.reader
    reads_into = getattr(reader, "reads_into_buffers", None)
    if not callable(reads_into) or not reads_into():
        return None
    itemsize = reader.storage_reader.dtype.itemsize
    nbytes = settings.local_batch_size * reader.sequence_length * itemsize
    size = batches_ahead(loader) + 2
    held = loader._held
    ring = held.ring
    if ring is None or ring.nbytes != nbytes or ring.size != size:
        if ring is not None:
            ring.close()
        ring = held.ring = held.new_ring(nbytes, size)
    return ring


def tail_dropped(loader: StatefulDataLoader[Any, Any], dropped: int) -> str:
    """The warning, once per loader, that ``drop_last`` defaulting to True drops samples:
    torch code passing ``batch_size=`` expects torch's ``drop_last=False``."""
    s, n, g = loader.settings, loader._num_samples(), loader.global_batch_size
    ranks = f" * world_size {s.world_size}" if s.world_size > 1 else ""
    return (
        f"drop_last defaults to True here (GuideLoom's default; torch's is False): the "
        f"dataset's {n} samples at batch_size={s.local_batch_size}{ranks} make "
        f"{n // g} batches per epoch, and the last {dropped} samples of each epoch are "
        f"dropped (torch would deliver {-(-n // g)} batches, the last one short). Pass "
        "drop_last=False for torch's behaviour, or drop_last=True to keep this one"
    )
