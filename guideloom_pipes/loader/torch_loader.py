"""``guideloom_pipes.DataLoader``: torch's ``DataLoader``, its signature, defaults, attributes
and order, read by our stages and worker processes, with ``state_dict()`` /
``load_state_dict()`` besides.

It is torch's class (a subclass: ``isinstance(loader, torch.utils.data.DataLoader)``), built
by torch's own ``__init__`` (so its checks, errors and attributes are torch's), with its
iteration replaced: indices come from the loader's index sampler in the main process
(:mod:`.sampler_order`), batches are read by :class:`~guideloom_pipes.pipes.ReadSamples`
inline (``num_workers=0``) or in worker processes that torch seeds alike (``base_seed +
worker_id``, the batches dealt round robin), and an iterator is a
:class:`~guideloom_pipes.loader.iterator.LoaderIterator`, which counts what was delivered.
"""

from __future__ import annotations

import functools
import multiprocessing
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.utils.data
from torch.utils.data._utils.collate import default_collate as torch_default_collate
from torchdata.nodes import BaseNode

from guideloom_pipes.checks import check_int
from guideloom_pipes.loader.checkpoint import Position
from guideloom_pipes.loader.datapipes import (
    SeedDataPipe,
    distributed_settings,
    is_datapipe,
    shard_in_worker,
    shard_inline,
)
from guideloom_pipes.loader.epoch_draws import start_epoch
from guideloom_pipes.loader.iterable_order import IterableOrder
from guideloom_pipes.loader.sampler_order import (
    KIND,
    VERSION,
    EpochStart,
    SamplerBatches,
    SamplerOrder,
)
from guideloom_pipes.loader.settings import LoaderSettings, check_scheduled_mixture
from guideloom_pipes.loader.torch_iterator import TorchLoaderIterator, Unbatched
from guideloom_pipes.pipes import PinMemory, ReadSamples, default_collate
from guideloom_pipes.pipes.iterable import IterableReads
from guideloom_pipes.pipes.workers.processes import ProcessPool

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """torch's ``DataLoader``, checkpointable: change the import, keep the call.

    Same signature, defaults, attributes, errors and batches as
    ``torch.utils.data.DataLoader`` (the same ``generator`` or global seed gives the same
    order and the same draws in ``__getitem__``: worker ``k`` is seeded ``base_seed + k`` and
    takes batches ``k, k + num_workers, ...``). Batches are read by this package's stages;
    ``state_dict()`` says what was delivered and ``load_state_dict()`` resumes at the next
    batch, with any ``num_workers`` (see ``docs/torch-dataloader.md``).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        snapshot_every_n_steps: int | None = 1,
    ) -> None:
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        check_int("snapshot_every_n_steps", snapshot_every_n_steps, minimum=0, allow_none=True)
        check_scheduled_mixture(dataset, isinstance(self.sampler, torch.utils.data.RandomSampler))
        #: torchdata's ``StatefulDataLoader`` keyword, taken so its callers run unchanged:
        #: ``state_dict()`` is exact after every batch whatever it says.
        self.snapshot_every_n_steps = snapshot_every_n_steps
        #: An IterableDataset: each worker's own pass, not indices from a sampler.
        self._iterable = self._dataset_kind == torch.utils.data.dataloader._DatasetKind.Iterable
        self._order: SamplerOrder | IterableOrder = (
            IterableOrder() if self._iterable else SamplerOrder()
        )
        self._position = Position(batch=1)
        #: The base seed of the epoch being read (or last read); None before the first.
        self.base_seed: int | None = None
        self._drew_base_seed = False
        #: The generator states the current position's epoch started from.
        self._epoch_start: EpochStart | None = None
        #: A loaded state, applied by the next ``iter()``.
        self._resume: Mapping[str, Any] | None = None
        #: The state as of the last batch of an iterator left early (state_dict() after a
        #: loop's break), until the next iter() or load_state_dict().
        self._left_state: dict[str, Any] | None = None
        self._live: weakref.ref[TorchLoaderIterator] | None = None
        #: An IterableDataset's worker records an ended epoch carries into the next (the
        #: datasets' own states, :meth:`IterableOrder.carried`), for state_dict() between.
        self._carried: list[Any] | None = None
        self._pool: ProcessPool | None = None  # persistent_workers' processes
        #: An IterDataPipe's shared seed of the epoch (None: not a DataPipe, or not drawn),
        #: and the process group it is broadcast over (torch.distributed initialized).
        self._shared_seed: int | None = None
        self._datapipe_group: Any = None
        self._pool_finalizer: weakref.finalize[Any, Any] | None = None

    # -- what the loader's iterator reads of it ------------------------------------------

    @property
    def settings(self) -> LoaderSettings:
        """The keywords as the shared iterator reads them (a step is one sampler item)."""
        return LoaderSettings(
            local_batch_size=1,
            rank=0,
            world_size=1,
            num_workers=self.num_workers,
            parallel_method="process",
            multiprocessing_context=self.multiprocessing_context,
            timeout=float(self.timeout),
            shuffle=isinstance(self.sampler, torch.utils.data.RandomSampler),
            shuffle_seed=None,
            seed_given=False,
            base_seed=self.base_seed or 0,
            worker_init_fn=self.worker_init_fn,
            persistent_workers=self.persistent_workers,
            drop_last=self.drop_last,
            prefetch=0,
            pin_memory=self.pin_memory,
            device=torch.device("cpu"),
            collate_fn=self.collate_fn,
            order=SamplerOrder.name,
            generator=self.generator,
            prefetch_factor=self.prefetch_factor,
            in_order=self.in_order,
            pin_memory_device=self.pin_memory_device,
        )

    @property
    def global_batch_size(self) -> int:
        """Positions per step: 1 (a step is one item of the index sampler)."""
        return 1

    def _active_iterator(self) -> TorchLoaderIterator | None:
        iterator = self._live() if self._live is not None else None
        return iterator if iterator is not None and iterator._active else None

    # -- iteration ------------------------------------------------------------------------

    def _get_iterator(self) -> Iterator[Any]:  # type: ignore[override]
        """torch's hook for a new iterator (code that extends torch's loader calls it):
        ours, never torch's."""
        return self.__iter__()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        old = self._active_iterator()
        if old is not None:
            old.close()  # as torch: a new iter() starts a new pass
        if self.num_workers > 0:
            self.check_worker_number_rationality()
        if self.pin_memory and not torch.accelerator.is_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, then "
                "device pinned memory won't be used.",
                stacklevel=2,
            )
        self._left_state = None
        self._carried = None
        if self.num_workers == 0 and is_datapipe(self.dataset):
            shard_inline(self.dataset)
        here = self._position
        resume, self._resume = self._resume, None
        epoch, offset = here.epoch, here.offset
        if self._iterable:
            return self._iter_iterable(resume, epoch, offset)
        items, source_states = start_epoch(self, resume, offset)
        source = SamplerBatches(
            items,
            self._index_sampler,
            batched=self._auto_collation,
            keep_states=source_states,
        )
        pool = self._processes()
        return self._deliver(self._read(source, pool), epoch, offset, source, pool)

    def _iter_iterable(
        self, resume: Mapping[str, Any] | None, epoch: int, offset: int
    ) -> Iterator[Any]:
        """An epoch of an IterableDataset: each worker's pass (resumed where ``resume``
        says), interleaved as torch interleaves them."""
        start_epoch(self, resume, offset, replay=False)
        order = self._order
        assert isinstance(order, IterableOrder)
        records, turn = None, 0
        if resume is not None and order.starts(resume):
            records, turn = order.records(self, resume), resume["turn"]
        pool = self._processes()
        reads = IterableReads(
            self.dataset,
            self._collate(unbatched=False),
            self.batch_size if self._auto_collation else None,
            self.drop_last,
            pool=pool,
            max_in_flight=(self.prefetch_factor or 2) * max(self.num_workers, 1),
            timeout=float(self.timeout) or None,
            records=records,
            turn=turn,
            prepare=None if self._shared_seed is None else SeedDataPipe(self._shared_seed),
        )
        return self._deliver(reads, epoch, offset, reads, pool)

    def _deliver(
        self,
        node: BaseNode[Any],
        epoch: int,
        offset: int,
        source: SamplerBatches | IterableReads,
        pool: ProcessPool | None,
    ) -> TorchLoaderIterator:
        """The epoch's iterator over ``node`` (pinned where CUDA is and ``pin_memory``),
        owning ``pool`` unless the workers persist; the loader's live iterator."""
        if self.pin_memory and torch.cuda.is_available():
            node = PinMemory(node)
        own = pool if pool is not None and not self.persistent_workers else None
        iterator = TorchLoaderIterator(self, node, epoch, offset, source, own)
        self._live = weakref.ref(iterator)
        return iterator

    def _draw_base_seed(self) -> int:
        """torch's draw of an iterator's base seed (from ``generator``, else the global one)."""
        seed = torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        return int(seed.item())

    def _collate(self, *, unbatched: bool = True) -> Callable[[Any], Any]:
        """What each batch goes through: ``collate_fn``, with torch's ``default_collate``
        taken by ours (the same tensors, read straight from our datasets' columns); with
        ``batch_size=None`` (and ``unbatched``) given each one-sample read's sample."""
        collate: Callable[[Any], Any] = self.collate_fn
        if collate is torch_default_collate:
            collate = default_collate
        return collate if self._auto_collation or not unbatched else Unbatched(collate)

    def _context(self) -> multiprocessing.context.BaseContext:
        """``multiprocessing_context``: None is the platform's default start method, as in
        torch."""
        context = self.multiprocessing_context
        if context is None:
            return multiprocessing.get_context()
        if isinstance(context, str):
            return multiprocessing.get_context(context)
        return context

    def _processes(self) -> ProcessPool | None:
        """This epoch's worker processes: the persistent ones (started once), else new ones
        seeded from this epoch's base seed; None without workers."""
        if self.num_workers == 0:
            return None
        if self.persistent_workers and self._pool is not None and not self._pool.closed:
            return self._pool
        pool = ProcessPool(
            self.dataset,
            self._collate(unbatched=not self._iterable),
            self.num_workers,
            self._context(),
            base_seed=self.base_seed,
            worker_init_fn=self._worker_init(),
            persistent=True,
            deal="round_robin",
            torch_seeding=True,
        )
        if self.persistent_workers:
            self._stop_processes()
            self._pool = pool
            self._pool_finalizer = weakref.finalize(self, pool.close)
        return pool

    def _worker_init(self) -> Callable[[int], Any] | None:
        """What a worker process runs at its start: ``worker_init_fn``, after sharding a
        DataPipe's copy to the worker's share (as torch's workers do)."""
        if not is_datapipe(self.dataset):
            return self.worker_init_fn
        world_size, rank = distributed_settings()
        return functools.partial(shard_in_worker, self.worker_init_fn, world_size, rank)

    def _stop_processes(self) -> None:
        finalizer, self._pool_finalizer = self._pool_finalizer, None
        self._pool = None
        if finalizer is not None:
            finalizer()

    def _read(self, source: SamplerBatches, pool: ProcessPool | None) -> BaseNode[Any]:
        workers = self.num_workers
        if workers == 0:
            return ReadSamples(source, self.dataset, collate_fn=self._collate())
        return ReadSamples(
            source,
            self.dataset,
            num_workers=workers,
            method="process",
            collate_fn=self._collate(),
            max_in_flight=(self.prefetch_factor or 2) * workers,
            timeout=float(self.timeout) or None,
            chunk_seconds=0,
            base_seed=self.base_seed,
            worker_init_fn=self.worker_init_fn,
            process_pool=pool,
        )

    def close(self) -> None:
        """Stop the active iterator and the persistent worker processes."""
        iterator = self._active_iterator()
        if iterator is not None:
            iterator.close()
        self._stop_processes()

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What was delivered: the epoch, the batches delivered in it, and what the epoch's
        draws started from (``docs/torch-dataloader.md``, "Checkpoints")."""
        iterator = self._active_iterator()
        if iterator is None and self._left_state is not None:
            return dict(self._left_state)
        if iterator is None and self._resume is not None:
            return dict(self._resume)  # (what the next iter() resumes from)
        if self._iterable:
            order = self._order
            assert isinstance(order, IterableOrder)
            return order.state_of(self, iterator)
        sampler_state = None
        sampler_epoch = None
        started = False
        if iterator is not None:
            epoch, offset = iterator._epoch, iterator._position()
            started = offset == 0
            source = iterator.source
            assert isinstance(source, SamplerBatches)
            sampler_epoch = source.pass_epoch if source.drawn else self._loaded_sampler_epoch
            if offset and self._order.steps_left(self, epoch, offset) == 0:
                # every batch of the epoch delivered: the state is the next epoch's start
                # (as its iterator will stand once it ends), from the generators as now
                epoch, offset = epoch + 1, 0
            elif iterator._delivered:
                sampler_state = iterator.source.sampler_state(iterator._delivered)
            elif self._resume is None and iterator._offset0:
                sampler_state = self._loaded_sampler_state
        else:
            epoch, offset = self._position.epoch, self._position.offset
        return {
            "kind": KIND,
            "version": VERSION,
            "epoch": epoch,
            "batches": offset,
            **self._draws(offset, started),
            "sampler_state": sampler_state,
            "sampler_epoch": sampler_epoch if offset or started else None,
        }

    def _draws(self, offset: int, started: bool = False) -> dict[str, Any]:
        """The state's keys of what the epoch's draws started from; ``started``: an
        iterator has started the epoch (its draws are made) and delivered nothing yet."""
        start = self._epoch_start
        if (offset == 0 and not started) or start is None:
            start = EpochStart.now(self)
        return {
            "base_seed": self.base_seed,
            "drew_base_seed": self._drew_base_seed,
            "generators": start.state(),
            "started": started,
        }

    _loaded_sampler_state: Any = None
    _loaded_sampler_epoch: int | None = None

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the next ``iter()`` from ``state_dict`` (from :meth:`state_dict`, on
        any ``num_workers``); an active iterator is closed first."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"load_state_dict() takes the dict of state_dict(), got {type(state_dict)!r}"
            )
        self._order.check_state(self, state_dict)
        iterator = self._active_iterator()
        if iterator is not None:
            iterator.close()
        self._left_state = self._carried = None
        # persistent workers were seeded from this run's base seed: the next iter() starts
        # new ones, seeded from the state's, as the saved run's were
        self._stop_processes()
        state = dict(state_dict)
        self._position.move(state["epoch"], state["batches"], 1)
        self._resume = state
        self._loaded_sampler_state = state.get("sampler_state")
        self._loaded_sampler_epoch = state.get("sampler_epoch")
        self.base_seed = state.get("base_seed")
        self._drew_base_seed = bool(state.get("drew_base_seed"))
        if state["batches"]:
            self._epoch_start = EpochStart.of_state(state["generators"], self)
