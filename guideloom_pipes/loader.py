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

import torch
from torchdata.nodes import BaseNode

from guideloom_pipes.batch import accepts_batch_arrays
from guideloom_pipes.datasets import open_reader
from guideloom_pipes.loader_args import (
    _UNSET,
    _default_device,
    _int_arg,
    dataset_for_storage,
    resolve_arguments,
)
from guideloom_pipes.pipes import (
    Collate,
    PinMemory,
    Prefetcher,
    RankPositions,
    ReadSamples,
    Shuffle,
    ToDevice,
    close_pipeline,
    default_collate,
)
from guideloom_pipes.pipes._pool import DataLoaderTimeoutError, after_orphaned_jobs, seconds_text
from guideloom_pipes.pipes.read import _CHUNK_SECONDS, _together
from guideloom_pipes.types import SyncContextManager

__all__ = ["DataLoaderTimeoutError", "StatefulDataLoader"]

_STATE_KEYS = ("epoch", "observation_offset", "shuffle", "shuffle_seed", "drop_last")
#: Extra key of ours in ``state_dict()``: the dataset size, to warn when it changed.
_NUM_SAMPLES_KEY = "num_samples"
#: Extra key of ours: the global batch size of the run that reached the offset. Padding
#: takes an offset past the dataset's end by less than that, so it bounds a valid offset.
_GLOBAL_BATCH_KEY = "global_batch_size"
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
            warning, for a CPU device).
        drop_last: Drop the incomplete final global batch (True) or pad it (False: final
            batches may be short, or ``[]`` on some ranks).
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
        generator: A ``torch.Generator`` to draw the shuffle seed from when ``shuffle_seed``
            is ``None``.
        sampler: Not supported (pass ``shuffle``/``rank``/``world_size``).
        batch_sampler: Not supported (pass ``batch_size``/``drop_last``).
        worker_init_fn: Not supported.
        persistent_workers: Only ``False`` (workers live as long as their iterator).
        pin_memory_device: Only ``""`` (pass ``device``).
        in_order: Only ``True``.
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
        drop_last: bool = True,
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
        )
        self.dataset = dataset
        self.collate_fn = collate_fn
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
        self.device = settings.device
        self.pin_memory = settings.pin_memory

        self._epoch = 0
        self._offset = 0
        self._reader: Any = None
        self._owns_reader = False
        self._is_open = False
        self._iterator: weakref.ref[_LoaderIterator] | None = None
        # (epoch, global position) an iterator was closed early at, until state_dict() warns
        self._closed_early: tuple[int, int] | None = None
        # The global batch size of the run that reached _offset (see _GLOBAL_BATCH_KEY).
        self._offset_batch = self.global_batch_size

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
        drop_last: bool = True,
        prefetch: int = 0,
        **kwargs: Any,
    ) -> StatefulDataLoader[Any, BatchT]:
        """A loader over a storage: ``StreamDataset`` or ``DocumentDataset`` picked for you.

        Args:
            storage: A ``StreamStorage``, ``StreamWithMetaStorage`` or ``DocumentStorage``.
            collate_fn: As for the constructor.
            sequence_length: Elements per sample; required for stream storages, refused for
                document storages.
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
        dataset = dataset_for_storage(storage, sequence_length)
        return cls(dataset, collate_fn, **kwargs)

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
        """Steps in a full epoch: ``n // G`` with ``drop_last``, else ``ceil(n / G)``."""
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
        """Close the active iterator (stopping its workers) and the dataset's reader."""
        iterator = self._active_iterator()
        if iterator is not None:
            iterator.close()
        if self._is_open:
            reader, self._reader = self._reader, None
            self._is_open = False
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

    # -- iteration --------------------------------------------------------------------------

    def _active_iterator(self) -> _LoaderIterator | None:
        iterator = self._iterator() if self._iterator is not None else None
        return iterator if iterator is not None and iterator._active else None

    def __iter__(self) -> Iterator[BatchT]:
        if self._active_iterator() is not None:
            raise RuntimeError(
                "an iterator of this loader is still active: drain it or call its close() "
                "before calling iter() again (take state_dict() first to resume mid-epoch)"
            )
        self.open()
        self._closed_early = None
        root = self._build_pipeline(self._epoch, self._offset)
        iterator = _LoaderIterator(self, root, self._epoch, self._offset)
        self._iterator = weakref.ref(iterator)
        return iterator

    def _build_pipeline(self, epoch: int, offset: int) -> BaseNode[Any]:
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
        collate = self.collate_fn if self.collate_fn is not None else default_collate
        inline = self.num_workers == 0 and self.prefetch == 0
        if inline and not self.timeout:
            # Everything inline in the training thread: the fewest steps per batch.
            arrays = accepts_batch_arrays(collate)
            node = Collate(
                ReadSamples(node, self.dataset, reader=self._reader, arrays=arrays), collate
            )
        else:
            # Workers read and collate whole batches; finished batches wait in this stage
            # (``prefetch`` of them beyond the workers' own), so no extra thread hop. With
            # num_workers=0, prefetch uses one background thread (GuideLoom's prefetch thread);
            # so does a timeout without prefetch, reading only the batch asked for.
            workers = self.num_workers or 1
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
            )
        if self.pin_memory:
            node = PinMemory(node)
            if self.prefetch > 0:
                node = Prefetcher(node, self.prefetch)  # pin in the background
        if self.device.type != "cpu":
            node = ToDevice(node, self.device)
        return node

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
                            epoch, offset = iterator._epoch, iterator._position()
                            remaining = self._num_samples() - offset
                            if remaining <= 0 or (self.drop_last and remaining < iterator._global):
                                epoch, offset = epoch + 1, 0
                            iterator._finish(epoch, offset)
                            yield batch
                            return
                        yield batch
                finally:
                    if iterator._active:  # closed early: keep what was delivered
                        iterator._finish(iterator._epoch, iterator._position())

        return run()

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What was delivered: GuideLoom's five keys plus ``num_samples`` (ours).

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
        return {
            "epoch": epoch,
            "observation_offset": offset,
            "shuffle": self.shuffle,
            "shuffle_seed": self.shuffle_seed,
            "drop_last": self.drop_last,
            _NUM_SAMPLES_KEY: self._num_samples(),
            _GLOBAL_BATCH_KEY: offset_batch,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict`` (ours or GuideLoom's) at the next ``iter()``.

        It may come from a loader with another world size or batch size (the offset is
        global). Shuffle, seed and drop_last mismatches warn; a loader built with
        ``shuffle_seed=None`` adopts the state's seed. A state from a dataset of another
        size warns.

        Args:
            state_dict: A dict from :meth:`state_dict` (or GuideLoom's).
        """
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
        epoch = _int_arg("state_dict['epoch']", state_dict["epoch"], 0)
        offset = _int_arg("state_dict['observation_offset']", state_dict["observation_offset"], 0)
        saved_shuffle = state_dict["shuffle"]
        saved_seed = state_dict["shuffle_seed"]
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
        saved_batch = state_dict.get(_GLOBAL_BATCH_KEY)
        if saved_batch is not None:
            saved_batch = _int_arg(f"state_dict[{_GLOBAL_BATCH_KEY!r}]", saved_batch, 1)
        saved_n = state_dict.get(_NUM_SAMPLES_KEY)
        n = self._num_samples()
        if saved_n is not None and saved_n != n:
            warnings.warn(
                f"the state was taken on a dataset of {saved_n} samples, this loader's has "
                f"{n}: the offset and the shuffled order now refer to other samples",
                UserWarning,
                stacklevel=2,
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
        try:
            root.reset()
        except BaseException:
            close_pipeline(root)
            raise
        self._active = True

    def _position(self) -> int:
        return self._offset0 + self._delivered * self._global

    def _offset_batch(self) -> int:
        """The global batch size of the run that reached :meth:`_position`."""
        return self._global if self._delivered else self._loader._offset_batch

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> Any:
        if not self._active:
            raise StopIteration
        try:
            batch = next(self._root)
        except StopIteration:
            self._finish(self._epoch + 1, 0)
            raise
        except BaseException as error:
            # Nothing more was delivered: a resume (or the next iter()) retries this batch.
            self._finish(self._epoch, self._position())
            if isinstance(error, DataLoaderTimeoutError):
                timed_out = DataLoaderTimeoutError(self._timeout_message(error.batches))
                timed_out.batches = error.batches
                raise timed_out from None
            raise
        self._delivered += 1
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

    def close(self) -> None:
        """Stop early: workers stop and the loader's offset returns to 0 (same epoch)."""
        if self._active:
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
