"""``StatefulDataLoader``: GuideLoom's resumable loader, built from :mod:`guideloom_pipes.pipes`.

It reproduces GuideLoom 1.1's constructor, order and checkpoints (SPEC §5, with the
differences of §6) and accepts the keywords of ``torch.utils.data.DataLoader``.
"""

from __future__ import annotations

import multiprocessing.context
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch
from torchdata.nodes import BaseNode

from guideloom_pipes.datasets import open_reader, reader_fingerprint
from guideloom_pipes.loader_args import (
    _UNSET,
    DROP_LAST_DEFAULT,
    SEED_WORD_LIMIT,
    _default_device,
    _int_arg,
    dataset_for_storage,
    resolve_arguments,
)
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
    close_pipeline,
    collate_packed,
    default_collate,
    num_steps,
    pad_collate,
)
from guideloom_pipes.pipes._errors import is_batch_failure, mark_batch_failure
from guideloom_pipes.pipes._pool import (
    DataLoaderTimeoutError,
    _ProcessPool,
    after_orphaned_jobs,
    seconds_text,
)
from guideloom_pipes.pipes._worker import (
    Seeding,
    batch_seed,
    hold_small_object_reserve,
    seeded,
)
from guideloom_pipes.pipes.read import _CHUNK_SECONDS, ReadFigures, _mp_context, _together
from guideloom_pipes.pipes.shards import (
    BatchSamples,
    ListShards,
    RankShards,
    ReadShards,
    ShardPlan,
    ShuffleBuffer,
    shard_spans,
)
from guideloom_pipes.types import SyncContextManager

__all__ = ["DataLoaderTimeoutError", "EpochBatchSampler", "EpochSampler", "StatefulDataLoader"]

_STATE_KEYS = ("epoch", "observation_offset", "shuffle", "shuffle_seed", "drop_last")
#: Extra key of ours in ``state_dict()``: the dataset size, to warn when it changed.
_NUM_SAMPLES_KEY = "num_samples"
#: Extra key of ours: the global batch size of the run that reached the offset. Padding
#: takes an offset past the dataset's end by less than that, so it bounds a valid offset.
_GLOBAL_BATCH_KEY = "global_batch_size"
#: Extra key of ours: what identifies the dataset's version (shards, sizes, record
#: checksums; see ``ReaderBase.fingerprint``), so a state is not resumed on another one.
_FINGERPRINT_KEY = "dataset_fingerprint"
#: Extra key of ours: the base seed (workers' and batches' seeds; the unseeded shuffle's).
_BASE_SEED_KEY = "base_seed"
#: Extra key of ours for a ``MixtureDataset``: its seed and weights (``schedule_state()``),
#: so a state is not resumed on another blend (its positions would mean other samples).
_MIXTURE_KEY = "mixture"
#: Extra keys of a shard-streaming loader (``order="shards"``): the order, the world size
#: and the buffer size its shards were dealt and mixed with.
_ORDER_KEY = "order"
_WORLD_SIZE_KEY = "world_size"
_BUFFER_KEY = "shuffle_buffer"
#: The orders ``from_storage`` offers: GuideLoom's global windows, or whole shards per rank.
_ORDERS = ("global", "shards")
#: ``shuffle_buffer``'s default, in samples.
SHUFFLE_BUFFER_DEFAULT = 8192
#: Collates of ours: they draw no random numbers, so batches read by our datasets' readers
#: and collated by them need no seed.
_OUR_COLLATES: tuple[Callable[..., Any], ...] = (default_collate, pad_collate, collate_packed)
#: Attributes that torch's ``DataLoader`` refuses to set once built (its wording too): a
#: change would silently alter later epochs and the meaning of saved states.
_FROZEN = (
    "batch_size",
    "local_batch_size",
    "batch_sampler",
    "sampler",
    "drop_last",
    "dataset",
    "persistent_workers",
)
if TYPE_CHECKING:
    # Defaults (PEP 696) for type checkers only: a loader built without a typed collate_fn is
    # a StatefulDataLoader[Any, Any] instead of an error asking the user for an annotation.
    from typing_extensions import TypeVar as _TypeVarWithDefault

    SourceT = _TypeVarWithDefault("SourceT", default=Any)
    BatchT = _TypeVarWithDefault("BatchT", default=Any)
else:
    SourceT = TypeVar("SourceT")
    BatchT = TypeVar("BatchT")


class StatefulDataLoader(Iterable[BatchT], Sized, SyncContextManager, Generic[SourceT, BatchT]):
    """GuideLoom's resumable data loader: exact shuffled order, exact checkpoints, many ranks.

    Each rank takes its strided share of every global batch of ``local_batch_size *
    world_size`` positions; with ``shuffle`` position ``p`` of epoch ``e`` is sample
    ``feistel_e(p)`` (GuideLoom's permutation). ``state_dict()`` describes what was delivered
    to the caller and resumes in O(1), also on another world size or batch size.

    Built from :mod:`guideloom_pipes.pipes` stages: ``RankPositions -> Shuffle ->
    ReadSamples -> Collate -> PinMemory -> Prefetcher -> ToDevice`` (each only when needed).

    It is a context manager (``open()``/``close()`` the dataset's reader; used without
    ``with`` it opens on first use) and an iterable: each iterator is one epoch (or the rest
    of one). Drain or close an iterator before asking for the next.

    Args:
        dataset: Any map-style dataset (``len`` and ``[i]``: a torch ``Dataset``, a numpy
            array, a ``Sequence``) or ours (``StreamDataset``, ``DocumentDataset``).
        collate_fn: samples -> batch. ``None`` collates as torch's ``default_collate`` and
            delivers an empty rank batch as ``[]``; a given ``collate_fn`` also gets ``[]``.
        device: Where batches go (tensors nested in dicts, lists, tuples, dataclasses); by
            default the current CUDA device, else the CPU (no copy).
        local_batch_size: Samples per batch on this rank (torch's ``batch_size``).
        rank: This process's global rank, ``0 <= rank < world_size``.
        world_size: Number of training processes sharing the dataset.
        num_workers: Worker threads or processes reading whole batches in parallel
            (0: read in the calling thread, or in the prefetch thread when ``prefetch``).
        parallel_method: ``"thread"`` or ``"process"`` (``forkserver`` start method by
            default, ``spawn`` where there is none; ``collate_fn`` and ``dataset`` must then
            be picklable).
        shuffle: Shuffle with GuideLoom's per-epoch Feistel permutation.
        shuffle_seed: Seed of the shuffle; ``None`` draws one now (see ``state_dict()``).
        pin_memory: Pin batches before moving them to a CUDA device (ignored, with a
            warning, for a CPU device). With ``collate_fn=None`` over a stream of one
            field, read inline or on threads, windows are read straight into pinned
            buffers the loader reuses (a :class:`~guideloom_pipes.pipes.PinnedRing`):
            no pinning copy.
        drop_last: Drop the incomplete final global batch (True) or pad it (False: final
            batches may be short, or ``[]`` on some ranks). Left out with torch's
            ``batch_size=``, a loader that drops samples warns once (torch pads).
        prefetch: How many finished batches wait ahead of the training loop (0: none; with
            workers, reads still overlap training).
        batch_size: torch's name for ``local_batch_size``.
        prefetch_factor: torch's per-worker prefetch: ``prefetch = prefetch_factor *
            num_workers`` (needs ``num_workers > 0``, as in torch).
        multiprocessing_context: Start method or context for ``parallel_method="process"``
            (``"forkserver"`` by default where available, else ``"spawn"``; or ``"fork"``).
        timeout: Seconds to wait for each batch before raising
            :class:`~guideloom_pipes.pipes.DataLoaderTimeoutError` (a ``RuntimeError`` and a
            ``TimeoutError``), in every mode: with ``num_workers=0`` and ``prefetch=0``
            batches are then read in one background thread (no read-ahead), since the
            training thread could not be interrupted. 0: wait forever.
        generator: A ``torch.Generator`` to draw the base seed from (else torch's global
            generator): the shuffle seed when ``shuffle_seed`` is ``None``, the workers'
            seeds (``base_seed + worker_id``) and each batch's seed; see ``base_seed``.
        sampler: Not supported (pass ``shuffle``/``rank``/``world_size``); the attribute
            ``sampler`` is an :class:`EpochSampler` describing this rank's order.
        batch_sampler: Not supported (pass ``batch_size``/``drop_last``); the attribute is
            an :class:`EpochBatchSampler`.
        worker_init_fn: Called with the worker id in each worker, after
            :func:`~guideloom_pipes.get_worker_info` is set there (and torch's
            ``get_worker_info()`` in worker processes): once per worker thread (threads
            start with each iterator), and in a worker process each time it takes a copy of
            the dataset (each epoch, or once with ``persistent_workers``).
        persistent_workers: Worker processes keep their copy of the dataset across epochs
            (``False``: the dataset is sent to them again at each epoch start, so changes
            made in the main process are seen). The processes themselves start once per
            loader either way and stop at :meth:`close`.
        pin_memory_device: Only ``""`` (pass ``device``).
        in_order: Only ``True``.
        snapshot_every_n_steps: torchdata's keyword, accepted and ignored (with a note, once):
            ``state_dict()`` is exact after every batch.

    Attributes that torch code reads are there (``sampler``, ``batch_sampler``,
    ``generator``, ``prefetch_factor``, ``persistent_workers``, ``worker_init_fn``,
    ``in_order``, ``pin_memory_device``; ``collate_fn`` is the function batches go
    through); setting ``batch_size``, ``local_batch_size``, ``drop_last``, ``dataset``,
    ``sampler``, ``batch_sampler`` or ``persistent_workers`` after construction raises
    ``ValueError``, as in torch.
    """

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], BatchT] | None = None,
        *,
        device: torch.device | str | int | None = None,
        local_batch_size: int = 1,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        parallel_method: str = "thread",
        shuffle: bool | None = False,
        shuffle_seed: int | None = None,
        pin_memory: bool = False,
        drop_last: bool = DROP_LAST_DEFAULT,
        prefetch: int = 0,
        batch_size: int | None = _UNSET,
        prefetch_factor: int | None = None,
        multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
        timeout: float = 0,
        generator: torch.Generator | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        worker_init_fn: Any = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        snapshot_every_n_steps: int | None = None,
    ) -> None:
        settings = resolve_arguments(
            dataset,
            collate_fn,
            device=device,
            local_batch_size=local_batch_size,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            parallel_method=parallel_method,
            shuffle=shuffle,
            shuffle_seed=shuffle_seed,
            pin_memory=pin_memory,
            drop_last=drop_last,
            prefetch=prefetch,
            batch_size=batch_size,
            prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context,
            timeout=timeout,
            generator=generator,
            sampler=sampler,
            batch_sampler=batch_sampler,
            worker_init_fn=worker_init_fn,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )
        self.dataset = dataset
        #: The function batches go through (torch reports its ``default_collate`` too).
        self.collate_fn: Callable[[list[Any]], Any] = (
            collate_fn if collate_fn is not None else default_collate
        )
        self.local_batch_size = settings.local_batch_size
        self.world_size = settings.world_size
        self.rank = settings.rank
        self.num_workers = settings.num_workers
        self.parallel_method = settings.parallel_method
        self.multiprocessing_context = settings.multiprocessing_context
        self.timeout = settings.timeout
        self.shuffle = settings.shuffle
        self.drop_last = settings.drop_last
        self.prefetch = settings.prefetch
        self._seed_given = settings.seed_given
        self.shuffle_seed: int | None = settings.shuffle_seed
        #: Drawn at construction (see ``generator``); restored by :meth:`load_state_dict`.
        self.base_seed: int = settings.base_seed
        self.worker_init_fn = settings.worker_init_fn
        self.persistent_workers = settings.persistent_workers
        self.device = settings.device
        self.pin_memory = settings.pin_memory
        # The worker processes, one pool per loader (started at the first iter()).
        self._process_pool: _ProcessPool | None = None
        self._pool_finalizer: weakref.finalize[Any, Any] | None = None
        # the small-object reserve this loader holds while open (reading in this process)
        self._reserve: weakref.finalize[Any, Any] | None = None
        # torch's attributes, as torch code reads them
        self.generator = generator
        self.prefetch_factor = prefetch_factor
        self.in_order = in_order
        self.pin_memory_device = pin_memory_device
        self.sampler = EpochSampler(self)
        self.batch_sampler = EpochBatchSampler(self)
        self._warn_dropped_tail = settings.warn_dropped_tail
        #: "global" (GuideLoom's order) or "shards" (see ``from_storage``)
        self.order = "global"
        #: samples the shard order's buffer holds at least (``order="shards"`` only)
        self.shuffle_buffer: int | None = None
        # (the shard order) the dataset's shards of the open reader, and the last plan
        self._spans: list[Any] | None = None
        self._plan_cache: tuple[tuple[int, int], ShardPlan] | None = None

        self._epoch = 0
        self._offset = 0
        #: the dataset's fingerprint when the loader last opened it (None: not yet, or the
        #: dataset cannot tell)
        self._fingerprint: dict[str, Any] | None = None
        self._reader: Any = None
        self._owns_reader = False
        self._is_open = False
        # The pinned buffers batches are read into (pin_memory on a CUDA device), made by
        # the first iterator that uses them and kept by the loader until close().
        self._ring: PinnedRing | None = None
        self._iterator: weakref.ref[_LoaderIterator] | None = None
        # what the read stage learned of the batches and of the training loop, carried from
        # one epoch's stage to the next (ReadSamples(figures=))
        self._read_figures = ReadFigures()
        # (epoch, global position) an iterator was closed early at, until state_dict() warns
        self._closed_early: tuple[int, int] | None = None
        # The global batch size of the run that reached _offset (see _GLOBAL_BATCH_KEY).
        self._offset_batch = self.global_batch_size
        self._initialized = True  # last: from now on the attributes of _FROZEN are fixed

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FROZEN and self.__dict__.get("_initialized", False):
            raise ValueError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized"
            )
        super().__setattr__(name, value)

    @classmethod
    def from_storage(
        cls,
        storage: Any,
        collate_fn: Callable[[list[Any]], BatchT] | None = None,
        *,
        sequence_length: int | None = None,
        device: torch.device | str | int | None = None,
        local_batch_size: int = 1,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        parallel_method: str = "thread",
        shuffle: bool = False,
        shuffle_seed: int | None = None,
        pin_memory: bool = False,
        drop_last: bool = DROP_LAST_DEFAULT,
        prefetch: int = 0,
        order: str = "global",
        shuffle_buffer: int | None = None,
        **kwargs: Any,
    ) -> StatefulDataLoader[Any, BatchT]:
        """A loader over a storage: ``StreamDataset`` or ``DocumentDataset`` picked for you.

        Args:
            storage: A ``StreamStorage``, ``StreamWithMetaStorage`` or ``DocumentStorage``,
                or the path (``str``, ``os.PathLike``; or URL) of a dataset, opened with
                ``open_storage(path)`` (its format read from the commit records).
            collate_fn: As for the constructor.
            sequence_length: Elements per sample; required for stream storages, refused for
                document storages.
            order: ``"global"`` (the default): GuideLoom's order, a global shuffle of sample
                windows (a read per window). ``"shards"``: each rank reads whole shards (one
                read each), shuffled per epoch, its samples mixed in a seeded buffer (see
                ``docs/shard-streaming.md``); for object stores where a request per window
                is too dear. Thread workers or ``num_workers=0`` only.
            shuffle_buffer: (``order="shards"``) samples a buffer of shards holds at least
                before its samples are shuffled together; default 8192. A resume reads the
                shards of one buffer again.
            **kwargs: The constructor's other keywords (torch ``DataLoader`` names).

        ``device``, ``local_batch_size``, ``rank``, ``world_size``, ``num_workers``,
        ``parallel_method``, ``shuffle``, ``shuffle_seed``, ``pin_memory``, ``drop_last`` and
        ``prefetch`` are as for the constructor (GuideLoom's keywords and defaults).
        """
        kwargs.update(
            device=device,
            local_batch_size=local_batch_size,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            parallel_method=parallel_method,
            shuffle=shuffle,
            shuffle_seed=shuffle_seed,
            pin_memory=pin_memory,
            drop_last=drop_last,
            prefetch=prefetch,
        )
        if order not in _ORDERS:
            raise ValueError(
                f"order must be one of {_ORDERS}, got {order!r}: 'global' is GuideLoom's "
                "order, 'shards' streams whole shards per rank"
            )
        if order == "global" and shuffle_buffer is not None:
            raise ValueError(
                f"shuffle_buffer={shuffle_buffer!r} applies to order='shards' only: pass "
                "order='shards', or leave shuffle_buffer out"
            )
        if order == "shards":
            shuffle_buffer = _int_arg(
                "shuffle_buffer",
                SHUFFLE_BUFFER_DEFAULT if shuffle_buffer is None else shuffle_buffer,
                1,
            )
            if kwargs.get("num_workers", 0) and kwargs.get("parallel_method") == "process":
                raise ValueError(
                    "order='shards' reads shards on worker threads: pass "
                    "parallel_method='thread' (or num_workers=0), or use order='global' for "
                    "process workers"
                )
            if kwargs.get("timeout"):
                raise ValueError(
                    f"timeout={kwargs['timeout']!r} is not supported with order='shards' (a "
                    "whole shard is one read): leave timeout at 0, or use order='global'"
                )
        dataset = dataset_for_storage(storage, sequence_length)
        loader = cls(dataset, collate_fn, **kwargs)
        loader.order = order
        loader.shuffle_buffer = shuffle_buffer
        return loader

    @staticmethod
    def get_default_device() -> torch.device:
        """The device batches go to by default: the current CUDA device, else the CPU."""
        return _default_device()

    # -- sizes ------------------------------------------------------------------------------

    @property
    def dataset_size(self) -> int:
        """Samples in the dataset (from the open reader when the loader is open)."""
        return self._num_samples()

    @property
    def batch_size(self) -> int:
        """torch's name for ``local_batch_size``."""
        return self.local_batch_size

    @property
    def global_batch_size(self) -> int:
        """``local_batch_size * world_size``: positions consumed per step by all ranks."""
        return self.local_batch_size * self.world_size

    def __len__(self) -> int:
        """Steps in a full epoch: ``n // G`` with ``drop_last``, else ``ceil(n / G)``.

        With ``order="shards"``: the steps of the current epoch (ranks get whole shards,
        so an epoch's steps depend on how its shuffled shards were dealt)."""
        if self.order == "shards":
            return self._shard_plan(self._current_epoch()).steps
        n, g = self._num_samples(), self.global_batch_size
        return n // g if self.drop_last else -(-n // g)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self.dataset).__name__} of {self._num_samples()}, "
            f"local_batch_size={self.local_batch_size}, rank={self.rank}, "
            f"world_size={self.world_size}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last}, num_workers={self.num_workers}, "
            f"parallel_method={self.parallel_method!r}, prefetch={self.prefetch}, "
            f"device={self.device})"
        )

    # -- open / close -----------------------------------------------------------------------

    def open(self) -> None:
        """Open the dataset's reader and check it holds a global batch (idempotent)."""
        if self._is_open:
            return
        reader, owns_reader = open_reader(self.dataset)
        n = len(reader) if hasattr(reader, "__len__") else len(self.dataset)
        if n < self.global_batch_size:
            try:
                message = self._too_few_samples(reader, n)
            finally:
                if owns_reader:
                    reader.close()
            raise ValueError(message)
        self._reader, self._owns_reader = reader, owns_reader
        self._is_open = True
        self._fingerprint = reader_fingerprint(reader)
        self._spans, self._plan_cache = None, None
        if not (self.num_workers > 0 and self.parallel_method == "process"):
            # samples are decoded in this process: keep small-object memory mapped for
            # them while the loader is open (see reserve_small_object_memory); released by
            # close(), or when the loader is garbage-collected
            self._reserve = weakref.finalize(self, hold_small_object_reserve())

    def _too_few_samples(self, reader: Any, n: int) -> str:
        """Why a dataset of ``n`` samples cannot fill a global batch, and the fix."""
        g = self.global_batch_size
        batch = (
            f"one global batch of local_batch_size * world_size = {self.local_batch_size} * "
            f"{self.world_size} = {g} (also required with drop_last=False)"
        )
        length = getattr(reader, "sequence_length", None)
        total = getattr(getattr(reader, "storage_reader", None), "total_length", None)
        if not isinstance(length, int) or not isinstance(total, int):
            return (
                f"the dataset has {n} samples, fewer than {batch}: use a smaller batch or "
                "world size, or more data"
            )
        if n == 0:  # a stream dataset: sample i is elements [i * L, (i + 1) * L)
            return (
                f"the stream holds {total} elements, fewer than sequence_length={length}, so "
                f"it makes no sample at all ({total} // {length} = 0): pass a sequence_length "
                f"of at most {total}, or write more data"
            )
        return (
            f"the stream's {total} elements make {n} samples of sequence_length={length} "
            f"({total} // {length}), fewer than {batch}: use a sequence_length of at most "
            f"{total // g}, a smaller batch or world size, or more data"
        )

    def _num_samples(self) -> int:
        # An open reader knows the size without opening the storage again.
        reader = self._reader
        if self._is_open and hasattr(reader, "__len__"):
            return len(reader)
        return len(self.dataset)

    def close(self) -> None:
        """Close the active iterator, stop the worker processes and close the dataset's
        reader (the next ``iter()`` opens it and starts workers again)."""
        iterator = self._active_iterator()
        if iterator is not None:
            iterator.close()
        self._stop_process_pool()
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()  # waits for copies still running out of its buffers
        reserve, self._reserve = self._reserve, None
        if reserve is not None:
            reserve()
        if self._is_open:
            reader, self._reader = self._reader, None
            self._is_open = False
            self._spans, self._plan_cache = None, None
            if self._owns_reader:
                self._owns_reader = False
                # Once worker threads still finishing a batch of a closed iterator are done.
                after_orphaned_jobs(reader.close)

    def __enter__(self) -> StatefulDataLoader[SourceT, BatchT]:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- worker processes ---------------------------------------------------------------------

    def _worker_processes(self) -> _ProcessPool:
        """The loader's worker processes: started on first use, kept across iterators."""
        pool = self._process_pool
        if pool is not None and not pool.closed:
            return pool
        self._stop_process_pool()  # (a failed one)
        pool = _ProcessPool(
            self.dataset,
            self.collate_fn if self.collate_fn is not None else default_collate,
            self.num_workers,
            _mp_context(self.multiprocessing_context),
            base_seed=self.base_seed,
            worker_init_fn=self.worker_init_fn,
            persistent=self.persistent_workers,
        )
        self._process_pool = pool
        # Stopped by close(), or when the loader is garbage-collected (the finalizer holds
        # the pool, not the loader).
        self._pool_finalizer = weakref.finalize(self, pool.close)
        return pool

    def _stop_process_pool(self) -> None:
        finalizer, self._pool_finalizer = self._pool_finalizer, None
        self._process_pool = None
        if finalizer is not None:
            finalizer()

    def _batch_seeds(self, epoch: int, offset: int) -> Callable[[int], int] | None:
        """The seed of the ``k``-th batch of an iterator starting at ``(epoch, offset)``, from
        the base seed and the batch's place (epoch, global position, rank), so it is the
        same whichever worker reads the batch and after a resume. ``None`` when only our
        code reads and collates (nothing draws random numbers)."""
        collate = self.collate_fn
        if hasattr(self.dataset, "sync_reader") and (collate is None or collate in _OUR_COLLATES):
            return None
        base, rank, step = self.base_seed, self.rank, self.global_batch_size

        def seed(k: int) -> int:
            return batch_seed(base, epoch, offset + k * step, rank)

        return seed

    # -- iteration --------------------------------------------------------------------------

    def _active_iterator(self) -> _LoaderIterator | None:
        iterator = self._iterator() if self._iterator is not None else None
        return iterator if iterator is not None and iterator._active else None

    def _close_failed_iterator(self) -> None:
        """Close the active iterator if its last ``next()`` raised a batch's own error.

        Such an iterator could go on, but a loop that got the error has usually left it, and
        it lives on until that exception is collected (tracebacks hold it, often in a
        reference cycle): ``iter()``, ``steps()``, ``load_state_dict()`` and
        ``sampler.set_epoch()`` close it rather than refuse (the loader then stands after
        the failed batch), as torch's ``iter()`` leaves an old iterator behind.
        """
        iterator = self._active_iterator()
        if iterator is not None and iterator._failed:
            iterator.close()

    def __iter__(self) -> Iterator[BatchT]:
        self._close_failed_iterator()
        if self._active_iterator() is not None:
            raise RuntimeError(
                "an iterator of this loader is still active: drain it or call its close() "
                "before calling iter() again (take state_dict() first to resume mid-epoch)"
            )
        self.open()
        if self._warn_dropped_tail:
            self._warn_dropped_tail = False
            self._warn_if_tail_dropped()
        self._closed_early = None
        root = self._build_pipeline(self._epoch, self._offset)
        iterator = _LoaderIterator(self, root, self._epoch, self._offset)
        self._iterator = weakref.ref(iterator)
        return iterator

    def _warn_if_tail_dropped(self) -> None:
        """Warn (once per loader) that ``drop_last`` defaulting to True drops samples: torch
        code passing ``batch_size=`` expects torch's ``drop_last=False``. (The shard order
        drops a tail that depends on each epoch's dealing: its documentation says so.)"""
        if self.order == "shards":
            return
        n, g = self._num_samples(), self.global_batch_size
        if n % g == 0:
            return
        ranks = f" * world_size {self.world_size}" if self.world_size > 1 else ""
        warnings.warn(
            f"drop_last defaults to True here (GuideLoom's default; torch's is False): the "
            f"dataset's {n} samples at batch_size={self.local_batch_size}{ranks} make "
            f"{n // g} batches per epoch, and the last {n % g} samples of each epoch are "
            f"dropped (torch would deliver {-(-n // g)} batches, the last one short). Pass "
            "drop_last=False for torch's behaviour, or drop_last=True to keep this one",
            UserWarning,
            stacklevel=3,
        )

    def _current_epoch(self) -> int:
        """The epoch being read, or the one the next ``iter()`` reads."""
        iterator = self._active_iterator()
        return iterator._epoch if iterator is not None else self._epoch

    def _set_epoch(self, epoch: int) -> None:
        """``sampler.set_epoch``: move to the start of ``epoch`` unless it is the current one."""
        epoch = _int_arg("epoch", epoch, 0, SEED_WORD_LIMIT)
        self._close_failed_iterator()
        if epoch == self._current_epoch():
            return  # (a resumed position in it is kept)
        if self._active_iterator() is not None:
            raise RuntimeError(
                f"sampler.set_epoch({epoch}) while an iterator of this loader is reading epoch "
                f"{self._current_epoch()}: drain it or call its close() first"
            )
        self._epoch, self._offset = epoch, 0
        self._offset_batch = self.global_batch_size
        self._closed_early = None

    # -- the shard order ---------------------------------------------------------------------

    def _shard_plan(self, epoch: int) -> ShardPlan:
        """This rank's plan of ``epoch`` in the shard order (from the shard listing)."""
        seed = self.shuffle_seed or 0
        cached = self._plan_cache
        if cached is not None and cached[0] == (epoch, seed):  # (a loaded state may set seed)
            return cached[1]
        if self._spans is None:
            self.open()
            self._spans = shard_spans(self._reader)
        plan = ShardPlan(
            self._spans,
            self.local_batch_size,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
            seed=seed,
            epoch=epoch,
            shuffle=self.shuffle,
            buffer_size=self.shuffle_buffer or 1,
        )
        self._plan_cache = ((epoch, seed), plan)
        return plan

    def _steps_left(self, epoch: int, offset: int) -> int:
        """Steps of ``epoch`` left from global position ``offset``."""
        if self.order == "shards":
            return max(self._shard_plan(epoch).steps - offset // self.global_batch_size, 0)
        return num_steps(self._num_samples(), offset, self.global_batch_size, self.drop_last)

    def _build_shard_pipeline(self, epoch: int, offset: int) -> BaseNode[Any]:
        """list shards -> this rank's shards -> whole-shard reads -> buffer -> batches."""
        plan = self._shard_plan(epoch)
        step = offset // self.global_batch_size
        position, skip = plan.resume_point(step * self.local_batch_size)
        node: BaseNode[Any] = RankShards(
            ListShards(self._reader),
            self.local_batch_size,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
            seed=self.shuffle_seed or 0,
            shuffle=self.shuffle,
            buffer_size=self.shuffle_buffer or 1,
            epoch=epoch,
            position=position,
        )
        node = ReadShards(node, self._reader, num_workers=self.num_workers)
        node = ShuffleBuffer(node, skip=skip, size=self.local_batch_size)
        node = BatchSamples(node, self.local_batch_size, delivered=step, steps=plan.steps)
        seeds = self._batch_seeds(epoch, offset)
        if seeds is None:
            node = Collate(node, self.collate_fn)
        else:
            # a prefetch thread collates: the global generators are the training loop's
            # then, so only batch_rng() is seeded (as the global order's threads do)
            seeding: Seeding = "local" if self.prefetch else "globals"
            node = _SeededCollate(node, self.collate_fn, seeds, seeding)
        if self.prefetch and not self.pin_memory:  # (pinning prefetches after itself)
            node = Prefetcher(node, self.prefetch)  # collated batches wait ahead
        return node

    def _sample_ids(self, epoch: int, offset: int = 0) -> BaseNode[Any]:
        """The first stages of the pipeline: this rank's positions of ``epoch`` from the
        global ``offset``, shuffled into sample ids when the loader shuffles."""
        node: BaseNode[Any] = RankPositions(
            self._num_samples(),
            self.local_batch_size,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
            epoch=epoch,
            observation_offset=offset,
        )
        if self.shuffle:
            node = Shuffle(node, self.shuffle_seed)
        return node

    def _epoch_batches(self, epoch: int) -> Iterator[list[int]]:
        """The sample ids of each batch this rank reads in ``epoch``, from its start."""
        if self.order == "shards":
            plan = self._shard_plan(epoch)
            ids = plan.sample_ids().tolist()
            size = self.local_batch_size
            for step in range(plan.steps):
                yield ids[step * size : (step + 1) * size]
            return
        for item in self._sample_ids(epoch):
            ids = item if isinstance(item, np.ndarray) else item.positions
            yield [int(i) for i in ids]

    def _build_pipeline(self, epoch: int, offset: int) -> BaseNode[Any]:
        if self.order == "shards":
            return self._finish_pipeline(self._build_shard_pipeline(epoch, offset))
        node = self._sample_ids(epoch, offset)
        collate = self.collate_fn
        inline = self.num_workers == 0 and self.prefetch == 0
        seeds = self._batch_seeds(epoch, offset)
        ring = self._pinned_ring()
        buffers = ring.take if ring is not None else None
        if inline and not self.timeout:
            # Everything inline in the training thread: the fewest steps per batch, the
            # collate inside the read (under the batch's seed when batches are seeded).
            node = ReadSamples(
                node,
                self.dataset,
                reader=self._reader,
                collate_fn=collate,
                batch_seeds=seeds,
                buffers=buffers,
            )
        else:
            # Workers read and collate whole batches; finished batches wait in this stage
            # (``prefetch`` of them beyond the workers' own), so no extra thread hop. With
            # num_workers=0, prefetch uses one background thread (GuideLoom's prefetch thread);
            # so does a timeout without prefetch, reading only the batch asked for.
            workers = self.num_workers or 1
            process = self.num_workers > 0 and self.parallel_method == "process"
            node = ReadSamples(
                node,
                self.dataset,
                num_workers=workers,
                method=self.parallel_method if self.num_workers else "thread",  # type: ignore[arg-type]
                multiprocessing_context=self.multiprocessing_context,
                collate_fn=collate,
                max_in_flight=1 if inline else self._batches_ahead(),
                timeout=self.timeout or None,
                reader=self._reader,
                chunk_seconds=0 if inline else _CHUNK_SECONDS,
                batch_seeds=seeds,
                # workers know who they are (our get_worker_info); the prefetch thread of
                # num_workers=0 is no worker, as in torch
                base_seed=self.base_seed if self.num_workers else None,
                worker_init_fn=self.worker_init_fn if self.num_workers else None,
                process_pool=self._worker_processes() if process else None,
                buffers=buffers,
                figures=self._read_figures,
            )
        return self._finish_pipeline(node, ring)

    def _finish_pipeline(
        self, node: BaseNode[Any], ring: PinnedRing | None = None
    ) -> BaseNode[Any]:
        """The stages after the batches: pinning, prefetching, the device. Batches read
        into ``ring``'s pinned buffers go to the device at once: they are pinned already,
        and the read stage holds the prefetched ones."""
        if ring is not None:
            return ToDevice(node, self.device, ring=ring)
        if self.pin_memory:
            node = PinMemory(node)
            if self.prefetch > 0:
                node = Prefetcher(node, self.prefetch)  # pin in the background
        if self.device.type != "cpu":
            node = ToDevice(node, self.device)
        return node

    def _ring_device(self) -> bool:
        """Whether batches go to a CUDA device from pinned memory (what the ring is for)."""
        return self.pin_memory and self.device.type == "cuda"

    def _new_ring(self, nbytes: int, size: int) -> PinnedRing:
        """A ring of ``size`` pinned buffers of ``nbytes`` with CUDA events."""
        return PinnedRing(nbytes, size)

    def _pinned_ring(self) -> PinnedRing | None:
        """The ring of pinned buffers this iterator reads its windows into, or None where
        the path does not apply: batches pinned for a CUDA device, in GuideLoom's global
        order, collated by ``default_collate`` (whose tensors are the windows' own memory;
        a user's ``collate_fn`` could keep or hand on the host buffers), read in this
        process (inline or threads), from a stream whose columns are views of the windows
        read (a ``StreamNumpyFormat`` of one field). Elsewhere batches are pinned by a copy
        (``PinMemory``), as before.

        Its size is what is in flight: the batches read ahead, the one being copied to the
        device and the one whose copy may still run."""
        if not self._ring_device() or self.order != "global":
            return None
        if self.collate_fn is not default_collate:
            return None
        if self.num_workers > 0 and self.parallel_method == "process":
            return None
        reads_into = getattr(self._reader, "reads_into_buffers", None)
        if not callable(reads_into) or not reads_into():
            return None
        itemsize = self._reader.storage_reader.dtype.itemsize
        nbytes = self.local_batch_size * self._reader.sequence_length * itemsize
        size = self._batches_ahead() + 2
        ring = self._ring
        if ring is None or ring.nbytes != nbytes or ring.size != size:
            if ring is not None:
                ring.close()
            ring = self._ring = self._new_ring(nbytes, size)
        return ring

    def _batches_ahead(self) -> int:
        """The most batches read ahead of the training loop: ``2 * num_workers`` (or one
        with the prefetch thread alone) plus ``prefetch`` waiting; 0 when reading inline.
        (Chunks of quick batches may hold more, each worth only ~2 ms of a worker's time.)"""
        if self.num_workers == 0 and self.prefetch == 0:
            return 0
        return (2 * self.num_workers or 1) + self.prefetch

    def steps(self, n: int) -> Iterator[BatchT]:
        """Exactly ``n`` batches from where the loader stands, across epoch ends.

        Training loops count steps, not epochs: ``for batch in loader.steps(n)`` delivers
        ``n`` batches from the current ``(epoch, offset)``, moving to ``(epoch + 1, 0)`` at
        each epoch's end (each epoch in GuideLoom's order, as ``iter()`` gives it), and the
        next call continues where this one stopped. ``state_dict()`` is the usual dict (it
        stores no ``n``): after ``load_state_dict`` pass the steps still to run, on another
        world size too. While the returned iterator is between batches the loader has an
        active epoch iterator (``state_dict()`` reports what was delivered; ``iter()`` and
        ``load_state_dict`` raise); it is closed as the last batch is handed over, or when
        the returned iterator is closed (or dropped) early, keeping the position of what was
        delivered. ``len(loader)`` and plain iteration are unchanged.

        Args:
            n: How many batches, >= 1.

        Raises:
            ValueError: ``n < 1``.
            TypeError: ``n`` is not an int.
            RuntimeError: An iterator of this loader is still active.
        """
        count = _int_arg("n", n, 1)
        self._close_failed_iterator()
        if self._active_iterator() is not None:
            raise RuntimeError(
                "steps() while an iterator of this loader is active: drain it or call its "
                "close() first"
            )

        def run() -> Iterator[Any]:
            left = count
            while left:
                iterator: Any = iter(self)
                try:
                    for batch in iterator:
                        left -= 1
                        if left == 0:
                            # hand the last batch over with no iterator left active; an epoch
                            # that has no batch left moves to the next one
                            iterator._finish(*iterator._resume_point())
                            yield batch
                            return
                        yield batch
                finally:
                    if iterator._active:  # closed early (or a batch raised): keep what was
                        # delivered; an epoch with no batch left moves to the next one
                        iterator._finish(*iterator._resume_point())

        return run()

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What was delivered: GuideLoom's five keys plus ``num_samples``,
        ``global_batch_size`` and ``base_seed`` (ours; the base seed makes each batch's
        random draws repeat on resume).

        ``observation_offset`` grows by the global batch size for each batch handed to the
        caller (padding included; prefetched batches do not count). A drained iterator moves
        to ``(epoch + 1, 0)``; one closed early to ``(epoch, 0)``, as in GuideLoom: a state
        taken after that restarts the epoch, and the first one taken warns so (take it
        inside the loop instead).
        """
        iterator = self._active_iterator()
        if iterator is not None:
            epoch, offset = iterator._epoch, iterator._position()
            offset_batch = iterator._offset_batch()
        else:
            epoch, offset = self._epoch, self._offset
            offset_batch = self._offset_batch
            if self._closed_early is not None:
                closed_epoch, position = self._closed_early
                self._closed_early = None
                warnings.warn(
                    f"state_dict() after an iterator was closed early (at global position "
                    f"{position} of epoch {closed_epoch}): as in GuideLoom, closing early "
                    f"restarts the epoch, so this state (epoch {epoch}, observation_offset "
                    f"{offset}) repeats the epoch from its start. To resume where the loop "
                    "stopped, take state_dict() inside the loop, before breaking out of it",
                    UserWarning,
                    stacklevel=2,
                )
        state: dict[str, Any] = {
            "epoch": epoch,
            "observation_offset": offset,
            "shuffle": self.shuffle,
            "shuffle_seed": self.shuffle_seed,
            "drop_last": self.drop_last,
            _NUM_SAMPLES_KEY: self._num_samples(),
            _GLOBAL_BATCH_KEY: offset_batch,
            _BASE_SEED_KEY: self.base_seed,
        }
        fingerprint = self._dataset_fingerprint()
        if fingerprint is not None:
            state[_FINGERPRINT_KEY] = fingerprint
        if isinstance(self.dataset, MixtureDataset):
            state[_MIXTURE_KEY] = self.dataset.schedule_state()
        if self.order == "shards":
            state[_ORDER_KEY] = self.order
            state[_WORLD_SIZE_KEY] = self.world_size
            state[_BUFFER_KEY] = self.shuffle_buffer
        return state

    def _dataset_fingerprint(self) -> dict[str, Any] | None:
        """The dataset's fingerprint: from the open reader, or the last one this loader
        opened; before the first open, from a reader opened for the purpose."""
        if self._is_open or self._fingerprint is not None:
            return self._fingerprint
        reader, owns = open_reader(self.dataset)
        try:
            self._fingerprint = reader_fingerprint(reader)
        finally:
            if owns:
                reader.close()
        return self._fingerprint

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict`` (ours or GuideLoom's) at the next ``iter()``.

        It may come from a loader with another world size or batch size (the offset is
        global). Shuffle, seed and drop_last mismatches warn; a loader built with
        ``shuffle_seed=None`` adopts the state's seed. A state from a dataset of another
        size warns. A state's ``base_seed`` replaces this loader's (worker processes started
        with another one start again), so the resumed batches draw what the saved run's did.

        Args:
            state_dict: A dict from :meth:`state_dict` (or GuideLoom's).
        """
        self._close_failed_iterator()
        if self._active_iterator() is not None:
            raise RuntimeError(
                "load_state_dict() while an iterator of this loader is active: drain it or "
                "call its close() first"
            )
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(
                f"state_dict is missing {missing}: expected the keys {list(_STATE_KEYS)} of "
                "StatefulDataLoader.state_dict()"
            )
        epoch = _int_arg("state_dict['epoch']", state_dict["epoch"], 0, SEED_WORD_LIMIT)
        offset = _int_arg("state_dict['observation_offset']", state_dict["observation_offset"], 0)
        saved_base_seed = state_dict.get(_BASE_SEED_KEY)
        if saved_base_seed is not None:
            saved_base_seed = _int_arg(
                f"state_dict[{_BASE_SEED_KEY!r}]", saved_base_seed, 0, SEED_WORD_LIMIT
            )
        saved_batch = state_dict.get(_GLOBAL_BATCH_KEY)
        if saved_batch is not None:
            saved_batch = _int_arg(f"state_dict[{_GLOBAL_BATCH_KEY!r}]", saved_batch, 1)
        saved_order = state_dict.get(_ORDER_KEY, "global")
        if saved_order != self.order:
            raise ValueError(
                f"this state was taken with order={saved_order!r} and this loader reads in "
                f"order={self.order!r}: the position means other samples in the other order. "
                f"Build the loader with order={saved_order!r} to resume it"
            )
        if _MIXTURE_KEY in state_dict:
            self._check_mixture(state_dict[_MIXTURE_KEY], epoch)
        saved_shuffle = state_dict["shuffle"]
        saved_seed = state_dict["shuffle_seed"]
        seed_before = self.shuffle_seed
        saved_drop_last = state_dict["drop_last"]
        if saved_shuffle != self.shuffle:
            warnings.warn(
                f"the state was saved with shuffle={saved_shuffle}, this loader has "
                f"shuffle={self.shuffle}: the order will differ from the saved run's",
                UserWarning,
                stacklevel=2,
            )
        elif self.shuffle and saved_seed != self.shuffle_seed:
            if saved_seed is None:
                warnings.warn(
                    "the state comes from an unseeded GuideLoom run, whose order cannot be "
                    f"reproduced; continuing with shuffle_seed={self.shuffle_seed}",
                    UserWarning,
                    stacklevel=2,
                )
            elif not self._seed_given:
                self.shuffle_seed = _int_arg("state_dict['shuffle_seed']", saved_seed, 0)
            else:
                warnings.warn(
                    f"the state was saved with shuffle_seed={saved_seed}, this loader has "
                    f"shuffle_seed={self.shuffle_seed}: the order will differ from the saved "
                    "run's (build the loader with shuffle_seed=None to adopt the state's)",
                    UserWarning,
                    stacklevel=2,
                )
        if saved_drop_last != self.drop_last:
            warnings.warn(
                f"the state was saved with drop_last={saved_drop_last}, this loader has "
                f"drop_last={self.drop_last}: epochs will have a different number of steps",
                UserWarning,
                stacklevel=2,
            )
        try:
            self._load_position(state_dict, epoch, offset, saved_batch, saved_base_seed)
        except BaseException:
            self.shuffle_seed = seed_before  # a refused state changes nothing
            raise

    def _load_position(
        self,
        state_dict: Mapping[str, Any],
        epoch: int,
        offset: int,
        saved_batch: int | None,
        saved_base_seed: int | None,
    ) -> None:
        """The checks of ``load_state_dict`` that need the state's seed in place (the shard
        order's plan follows it), then the position itself."""
        saved_fingerprint = state_dict.get(_FINGERPRINT_KEY)
        if saved_fingerprint is not None:
            self._check_fingerprint(saved_fingerprint)
        if self._check_order(state_dict, epoch, offset):
            self._epoch, self._offset = epoch, offset
            self._offset_batch = self.global_batch_size
            self._closed_early = None
            if saved_base_seed is not None and saved_base_seed != self.base_seed:
                self.base_seed = saved_base_seed
                self._stop_process_pool()
            return
        saved_n = state_dict.get(_NUM_SAMPLES_KEY)
        n = self._num_samples()
        if saved_n is not None and saved_n != n:
            warnings.warn(
                f"the state was taken on a dataset of {saved_n} samples, this loader's has "
                f"{n}: the offset and the shuffled order now refer to other samples",
                UserWarning,
                stacklevel=3,
            )
        # Padding (drop_last=False) takes the offset past n by less than one global batch
        # of the run that reached it: a state of ours records that batch size; for
        # GuideLoom's five keys this loader's stands in.
        offset_batch = saved_batch or self.global_batch_size
        limit = n + offset_batch - 1
        if offset > limit:
            raise ValueError(
                f"state_dict['observation_offset'] = {offset} is past the end of the epoch: "
                f"the dataset has {n} samples, and padding takes an offset past {n} by less "
                f"than one global batch ({offset_batch}), so at most to {limit}. The state "
                "belongs to another dataset (or was changed); to start the next epoch "
                f"instead, load it with 'epoch': {epoch + 1}, 'observation_offset': 0"
            )
        self._epoch, self._offset = epoch, offset
        self._offset_batch = offset_batch
        self._closed_early = None
        if saved_base_seed is not None and saved_base_seed != self.base_seed:
            # The batches' seeds follow the saved run's (workers started with the old base
            # seed start again, so get_worker_info().seed agrees).
            self.base_seed = saved_base_seed
            self._stop_process_pool()

    def _check_order(self, state_dict: Mapping[str, Any], epoch: int, offset: int) -> bool:
        """Refuse a state of the shard order on another world size, batch size or buffer,
        or past the epoch's steps; True when the state is the shard order's (checked here)."""
        if self.order != "shards":
            return False
        for key, now in (
            (_WORLD_SIZE_KEY, self.world_size),
            (_GLOBAL_BATCH_KEY, self.global_batch_size),
            (_BUFFER_KEY, self.shuffle_buffer),
        ):
            saved = state_dict.get(key)
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
        steps = self._shard_plan(epoch).steps
        if offset % self.global_batch_size or offset // self.global_batch_size > steps:
            raise ValueError(
                f"state_dict['observation_offset'] = {offset} is not a step of epoch {epoch} "
                f"in order='shards' ({steps} steps of {self.global_batch_size} positions): "
                "the state belongs to another dataset or setting (or was changed)"
            )
        return True

    def _check_mixture(self, saved: Any, epoch: int) -> None:
        """Refuse a state taken on a ``MixtureDataset`` with other weights or another seed
        (its positions would draw other samples: some repeated, some never seen)."""
        dataset = self.dataset
        if not isinstance(dataset, MixtureDataset):
            raise ValueError(
                f"this state was taken on a MixtureDataset ({_MIXTURE_KEY!r}: {saved!r}), "
                f"this loader reads a {type(dataset).__name__}: resume on the same mixture"
            )
        now = dataset.schedule_state()
        if _same_schedule(saved, now):
            return
        raise ValueError(
            f"this state was taken on a MixtureDataset with {_schedule_changes(saved, now)}. "
            "Resuming would draw other samples for the positions already read (repeating "
            "some, skipping others). Build the MixtureDataset with the state's weights and "
            "seed to resume it; changing the blend mid-run is not supported yet. To start "
            f"the new blend afresh, load {{'epoch': {epoch + 1}, 'observation_offset': 0}} "
            f"with the state's other keys and without {_MIXTURE_KEY!r}"
        )

    def _check_fingerprint(self, saved: Any) -> None:
        """Refuse a state taken on another version of the dataset, naming what changed."""
        now = self._dataset_fingerprint()
        if now is None or saved == now:
            return
        if not isinstance(saved, Mapping):
            raise TypeError(
                f"state_dict[{_FINGERPRINT_KEY!r}] must be a dict (from state_dict()), got "
                f"{saved!r}"
            )
        changed = _fingerprint_changes(saved, now)
        raise ValueError(
            f"this state was taken on another version of the dataset: {changed}. Its "
            f"offset and order would refer to other samples. Resume on the dataset the state "
            f"was taken on; to continue on this one anyway, drop the key first "
            f"(state.pop({_FINGERPRINT_KEY!r}))"
        )


def _same_schedule(saved: Any, now: Mapping[str, Any]) -> bool:
    """Whether a saved ``schedule_state()`` is ``now``'s: the same seed, the same weights in
    the same order (the order numbers the components), the same nested ones."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("weights"), Mapping):
        return False
    if saved.get("seed") != now["seed"]:
        return False
    if list(saved["weights"].items()) != list(now["weights"].items()):
        return False
    before, after = saved.get("components") or {}, now.get("components") or {}
    return (
        isinstance(before, Mapping)
        and set(before) == set(after)
        and all(_same_schedule(before[name], after[name]) for name in after)
    )


def _schedule_changes(saved: Any, now: Mapping[str, Any], prefix: str = "") -> str:
    """What differs between two ``schedule_state()`` dicts, in words."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("weights"), Mapping):
        return f"{prefix}a schedule state {saved!r} that is not one (now {dict(now)!r})"
    parts = []
    if saved.get("seed") != now["seed"]:
        parts.append(f"{prefix}seed={saved.get('seed')!r}, this one has seed={now['seed']!r}")
    weights, here = dict(saved["weights"]), dict(now["weights"])
    if weights != here:
        parts.append(f"{prefix}weights {weights}, this one has weights {here}")
    elif list(weights) != list(here):
        parts.append(
            f"{prefix}the components in the order {list(weights)}, this one in the order "
            f"{list(here)} (the order numbers them)"
        )
    before, after = saved.get("components") or {}, now.get("components") or {}
    for name in sorted(set(before) | set(after), key=str):
        if name not in before or name not in after:
            where = "the state's" if name in before else "this one's"
            parts.append(f"{prefix}nested mixture {name!r} only in {where}")
        elif not _same_schedule(before[name], after[name]):
            parts.append(_schedule_changes(before[name], after[name], f"{prefix}{name!r}: "))
    return "; ".join(parts)


def _fingerprint_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """What differs between two dataset fingerprints, in words."""
    if "components" in saved or "components" in now:
        before, after = saved.get("components") or {}, now.get("components") or {}
        parts = []
        for name in sorted(set(before) | set(after)):
            if name not in before:
                parts.append(f"component {name!r} is new")
            elif name not in after:
                parts.append(f"component {name!r} is gone")
            elif before[name] != after[name]:
                change = _fingerprint_changes(before[name], after[name])
                parts.append(f"component {name!r}: {change}")
        return "; ".join(parts) or "its components differ"
    if saved.get("shards") != now.get("shards"):
        return f"it had {saved.get('shards')} shard(s), it has {now.get('shards')} now"
    if saved.get("sizes") != now.get("sizes"):
        return "it has as many shards, but shard files changed size"
    if saved.get("checksums") != now.get("checksums"):
        return (
            "it has the same shards and sizes, but their contents changed (the commit "
            "records' checksums differ)"
        )
    return f"fingerprint {dict(saved)} is now {dict(now)}"


class EpochSampler(torch.utils.data.Sampler[int]):
    """``loader.sampler``: the sample ids this rank reads in the loader's current epoch.

    The loader orders samples itself (GuideLoom's rank sharding and shuffle); this object
    describes that order for code written against torch's samplers. ``len()`` is the number
    of samples this rank reads in a whole epoch (as for a ``DistributedSampler``: padding
    left out, and with ``drop_last`` the dropped tail too), and iterating gives their ids
    in reading order, from the start of the epoch the loader is in (or will read next).
    ``set_epoch(e)`` moves the loader to the start of epoch ``e``, unless ``e`` is its
    current epoch (a resumed position in it is kept): the usual ``sampler.set_epoch(epoch)``
    before each epoch's loop agrees with the loader's own count.
    """

    def __init__(self, loader: StatefulDataLoader[Any, Any]) -> None:
        self._loader = weakref.proxy(loader)

    def __len__(self) -> int:
        loader = self._loader
        if loader.order == "shards":  # this rank's samples of the epoch
            return loader._shard_plan(loader._current_epoch()).quota
        n, world = loader._num_samples(), loader.world_size
        limit = min(n, len(loader) * loader.global_batch_size)  # positions read, all ranks
        return max(0, -(-(limit - loader.rank) // world))

    def __iter__(self) -> Iterator[int]:
        for ids in self._loader._epoch_batches(self._loader._current_epoch()):
            yield from ids

    @property
    def epoch(self) -> int:
        """The loader's current epoch (the one being read, or read next)."""
        return self._loader._current_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Move the loader to the start of ``epoch`` (nothing if it is in that epoch)."""
        self._loader._set_epoch(epoch)


class EpochBatchSampler(torch.utils.data.Sampler[list[int]]):
    """``loader.batch_sampler``: the sample ids of each batch this rank reads in the
    loader's current epoch (see :class:`EpochSampler`); ``len()`` is ``len(loader)``.
    Batches are short or ``[]`` where padding (``drop_last=False``) leaves them so."""

    def __init__(self, loader: StatefulDataLoader[Any, Any]) -> None:
        self._loader = weakref.proxy(loader)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[list[int]]:
        return self._loader._epoch_batches(self._loader._current_epoch())

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank."""
        return self._loader.local_batch_size

    @property
    def drop_last(self) -> bool:
        """Whether the incomplete final global batch is dropped."""
        return self._loader.drop_last

    @property
    def sampler(self) -> EpochSampler:
        """The loader's :class:`EpochSampler`."""
        return self._loader.sampler

    def set_epoch(self, epoch: int) -> None:
        """As :meth:`EpochSampler.set_epoch`."""
        self._loader._set_epoch(epoch)


class _SeededCollate(BaseNode[Any]):
    """``collate_fn`` of the shard order's batches under each batch's seed (as the global
    order's reads run it), so its random draws repeat on resume."""

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode[Any],
        collate_fn: Callable[[list[Any]], Any],
        seeds: Callable[[int], int],
        seeding: Seeding,
    ) -> None:
        super().__init__()
        self.source = source
        self.collate_fn = collate_fn
        self.seeds = seeds
        self.seeding = seeding
        self._count = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._count = 0
        self.source.reset(None if initial_state is None else initial_state[self.SOURCE_KEY])

    def next(self) -> Any:
        samples = next(self.source)
        seed = self.seeds(self._count)
        self._count += 1
        try:
            with seeded(seed, self.seeding):
                return self.collate_fn(samples)
        except Exception as error:
            mark_batch_failure(error)  # this batch alone: the next one follows
            raise

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}


class _LoaderIterator(Iterator[Any]):
    """One epoch (or the rest of one) of a :class:`StatefulDataLoader`.

    Owns the pipeline: its threads and processes stop when it is drained, closed, fails, or
    is garbage-collected.
    """

    def __init__(self, loader: StatefulDataLoader, root: BaseNode[Any], epoch: int, offset: int):
        self._active = False
        self._loader = loader
        self._root = root
        self._epoch = epoch
        self._offset0 = offset
        self._global = loader.global_batch_size
        self._delivered = 0
        self._failed = False  # the last next() raised a batch's own error
        try:
            root.reset()
        except BaseException:
            close_pipeline(root)
            raise
        # reset above: the node's own next(), without BaseNode.__next__'s check that it was
        self._next_batch = root.next
        self._active = True

    def _position(self) -> int:
        return self._offset0 + self._delivered * self._global

    def _offset_batch(self) -> int:
        """The global batch size of the run that reached :meth:`_position`."""
        return self._global if self._delivered else self._loader._offset_batch

    def __iter__(self) -> _LoaderIterator:
        return self

    def __len__(self) -> int:
        """Batches this iterator delivers from where it started: ``len(loader)`` for a
        whole epoch, fewer for the rest of a resumed one."""
        return self._loader._steps_left(self._epoch, self._offset0)

    def __next__(self) -> Any:
        if not self._active:
            raise StopIteration
        try:
            batch = self._next_batch()
        except StopIteration:
            self._finish(self._epoch + 1, 0)
            raise
        except BaseException as error:
            if is_batch_failure(error):
                # A read or collate_fn failed this batch alone: it counts as delivered, and
                # the next next() delivers the batch after it (as in torch).
                self._delivered += 1
                self._failed = True
                raise
            # Nothing more was delivered: a resume (or the next iter()) retries this batch.
            self._finish(self._epoch, self._position())
            if isinstance(error, DataLoaderTimeoutError):
                timed_out = DataLoaderTimeoutError(self._timeout_message(error.batches))
                timed_out.batches = error.batches
                raise timed_out from None
            raise
        self._delivered += 1
        self._failed = False
        return batch

    def _timeout_message(self, together: int) -> str:
        loader = self._loader
        if loader.num_workers:
            workers = loader.num_workers
            source = f"{workers} {loader.parallel_method} worker" + "s" * (workers > 1)
        elif loader.prefetch:
            source = "the prefetch thread"
        else:
            source = "the read thread (num_workers=0 with a timeout reads in one thread)"
        return (
            f"DataLoader timed out after {seconds_text(loader.timeout)} seconds waiting for "
            f"batch {self._delivered} of this iterator (epoch {self._epoch}, global position "
            f"{self._position()}, rank {loader.rank} of {loader.world_size}) from {source}"
            f"{_together(together)}: a read or collate_fn took longer than timeout=, or hangs. "
            "Raise timeout= or find what blocks; the state still points at this batch, so the "
            "next iterator (or a resume) retries it"
        )

    def _resume_point(self) -> tuple[int, int]:
        """Where the loader goes on after what was delivered: ``(epoch, position)``, or the
        next epoch's start when this one has no batch left."""
        loader, offset = self._loader, self._position()
        if loader._steps_left(self._epoch, offset) == 0:
            return self._epoch + 1, 0
        return self._epoch, offset

    def close(self) -> None:
        """Stop early: workers stop and the loader's offset returns to 0 (same epoch),
        except right after a batch raised: the loader then goes on after that batch (a loop
        that ended with a read or ``collate_fn`` error resumes past it, as its state says)."""
        if self._active:
            if self._failed:
                self._finish(*self._resume_point())
                return
            position = self._position()
            self._finish(self._epoch, 0)
            if position:  # a state taken now would not resume there: state_dict() warns
                self._loader._closed_early = (self._epoch, position)

    def _finish(self, epoch: int, offset: int) -> None:
        self._active = False
        loader = self._loader
        loader._offset_batch = self._offset_batch() if offset else self._global
        loader._epoch, loader._offset = epoch, offset
        close_pipeline(self._root)

    def __del__(self) -> None:
        if getattr(self, "_active", False):
            self.close()
