"""``StatefulDataLoader``: GuideLoom's resumable loader, built from :mod:`guideloom_pipes.pipes`.

It reproduces GuideLoom 1.1's constructor, order and checkpoints (SPEC §5, with the
differences of §6) and accepts the keywords of ``torch.utils.data.DataLoader``. The class is
the front door; its parts live beside it: :mod:`.settings` (the keywords, checked once into
one frozen ``LoaderSettings``), :mod:`.orders` (how an epoch is walked and its pipeline
built), :mod:`.checkpoint` (``state_dict``/``load_state_dict``), :mod:`.iterator` (an epoch
being delivered) and :mod:`.samplers` (``loader.sampler``).
"""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing.context
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch

from guideloom_pipes.loader import checkpoint
from guideloom_pipes.loader.iterator import (
    LoaderIterator,
    close_failed_iterator,
    refuse_active,
    run_steps,
    skip_steps,
)
from guideloom_pipes.loader.orders import make_order, tail_dropped
from guideloom_pipes.loader.resources import LoaderResources
from guideloom_pipes.loader.samplers import EpochBatchSampler, EpochSampler
from guideloom_pipes.loader.settings import (
    _UNSET,
    DROP_LAST_DEFAULT,
    LoaderSettings,
    _default_device,
    _int_arg,
    dataset_for_storage,
    resolve_arguments,
    resolve_order,
)
from guideloom_pipes.pipes.read import ReadFigures
from guideloom_pipes.types import SyncContextManager

__all__ = ["StatefulDataLoader"]

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
#: The keywords of ``__init__`` and ``from_storage`` that are not settings.
_NOT_KEYWORDS = ("self", "cls", "dataset", "storage", "collate_fn", "kwargs", "__class__")
if TYPE_CHECKING:
    # Defaults (PEP 696) for type checkers only: a loader built without a typed collate_fn is
    # a StatefulDataLoader[Any, Any] instead of an error asking the user for an annotation.
    from typing_extensions import TypeVar as _TypeVarWithDefault

    SourceT = _TypeVarWithDefault("SourceT", default=Any)
    BatchT = _TypeVarWithDefault("BatchT", default=Any)
else:
    SourceT = TypeVar("SourceT")
    BatchT = TypeVar("BatchT")
T = TypeVar("T")


class _Setting(Generic[T]):
    """A loader attribute that reads its ``LoaderSettings``; setting one that torch lets be
    set replaces the settings object (the frozen ones refuse first, in ``__setattr__``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, loader: None, owner: type) -> _Setting[T]: ...
    @overload
    def __get__(self, loader: object, owner: type) -> T: ...
    def __get__(self, loader: Any, owner: type) -> Any:
        return self if loader is None else getattr(loader.settings, self.name)

    def __set__(self, loader: Any, value: T) -> None:
        loader.settings = dataclasses.replace(loader.settings, **{self.name: value})


def _keywords(names: dict[str, Any]) -> dict[str, Any]:
    """A call's own keywords (its ``locals()`` at the start), to pass on whole."""
    return {key: value for key, value in names.items() if key not in _NOT_KEYWORDS}


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

    # the settings, read whole from ``self.settings`` (see LoaderSettings)
    local_batch_size = _Setting[int]()
    rank = _Setting[int]()
    world_size = _Setting[int]()
    num_workers = _Setting[int]()
    parallel_method = _Setting[str]()
    multiprocessing_context = _Setting[str | multiprocessing.context.BaseContext | None]()
    timeout = _Setting[float]()
    shuffle = _Setting[bool]()
    drop_last = _Setting[bool]()
    prefetch = _Setting[int]()
    worker_init_fn = _Setting[Callable[[int], Any] | None]()
    persistent_workers = _Setting[bool]()
    device = _Setting[torch.device]()
    pin_memory = _Setting[bool]()
    collate_fn = _Setting[Callable[[list[Any]], Any]]()
    #: ``"global"`` (GuideLoom's order) or ``"shards"`` (see ``from_storage``)
    order = _Setting[str]()
    #: samples the shard order's buffer holds at least (``order="shards"`` only)
    shuffle_buffer = _Setting[int | None]()
    generator = _Setting[torch.Generator | None]()
    prefetch_factor = _Setting[int | None]()
    in_order = _Setting[bool]()
    pin_memory_device = _Setting[str]()

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
        settings = resolve_arguments(dataset, collate_fn, _keywords(locals()))
        self._setup(dataset, settings)

    def _setup(self, dataset: Any, settings: LoaderSettings) -> None:
        """Take the settings (whole) and start at epoch 0, position 0, nothing open."""
        self.dataset = dataset
        self.settings = settings
        #: The shuffle's seed: the one given or drawn, or a loaded state's (when not given).
        self.shuffle_seed: int | None = settings.shuffle_seed
        #: Drawn at construction (see ``generator``); restored by :meth:`load_state_dict`.
        self.base_seed: int = settings.base_seed
        self._order = make_order(settings.order, settings.shuffle_buffer)
        # the reader, worker processes, pinned ring and memory reserve held open
        self._held = LoaderResources()
        self.sampler = EpochSampler(self)
        self.batch_sampler = EpochBatchSampler(self)
        self._warn_dropped_tail = settings.warn_dropped_tail
        # the position: what was delivered (see checkpoint.py)
        self._position = checkpoint.Position(batch=self.global_batch_size)
        self._iterator: weakref.ref[LoaderIterator] | None = None
        # what the read stage learned of the batches and of the training loop, carried from
        # one epoch's stage to the next (ReadSamples(figures=))
        self._read_figures = ReadFigures()
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
        keywords = {**kwargs, **_keywords(locals())}
        del keywords["sequence_length"], keywords["order"], keywords["shuffle_buffer"]
        unknown = sorted(set(keywords) - set(_CONSTRUCTOR_DEFAULTS))
        if unknown:
            raise TypeError(
                f"{cls.__name__}.from_storage() got an unexpected keyword argument {unknown[0]!r}"
            )
        order, shuffle_buffer = resolve_order(order, shuffle_buffer, keywords)
        dataset = dataset_for_storage(storage, sequence_length)
        settings = resolve_arguments(
            dataset,
            collate_fn,
            {**_CONSTRUCTOR_DEFAULTS, **keywords},
            order=order,
            shuffle_buffer=shuffle_buffer,
        )
        loader = cls.__new__(cls)
        loader._setup(dataset, settings)
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
        return self.settings.local_batch_size

    @property
    def global_batch_size(self) -> int:
        """``local_batch_size * world_size``: positions consumed per step by all ranks."""
        return self.settings.local_batch_size * self.settings.world_size

    def __len__(self) -> int:
        """Steps in a full epoch: ``n // G`` with ``drop_last``, else ``ceil(n / G)``; with
        ``order="shards"``, the current epoch's (they depend on how its shards were dealt)."""
        return self._order.steps(self, self._current_epoch())

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"{type(self).__name__}({type(self.dataset).__name__} of {self._num_samples()}, "
            f"local_batch_size={s.local_batch_size}, rank={s.rank}, "
            f"world_size={s.world_size}, shuffle={s.shuffle}, drop_last={s.drop_last}, "
            f"num_workers={s.num_workers}, parallel_method={s.parallel_method!r}, "
            f"prefetch={s.prefetch}, device={s.device})"
        )

    # -- open / close -----------------------------------------------------------------------

    def open(self) -> None:
        """Open the dataset's reader and check it holds a global batch (idempotent)."""
        if not self._held.is_open:
            self._held.open(self.dataset, self.settings)
            self._order.forget()

    def _num_samples(self) -> int:
        # An open reader knows the size without opening the storage again.
        reader = self._held.reader
        if self._held.is_open and hasattr(reader, "__len__"):
            return len(reader)
        return len(self.dataset)

    def close(self) -> None:
        """Close the active iterator, stop the worker processes and close the dataset's
        reader (the next ``iter()`` opens it and starts workers again)."""
        iterator = self._active_iterator()
        if iterator is not None:
            iterator.close()
        self._held.close()
        self._order.forget()

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

    def _active_iterator(self) -> LoaderIterator | None:
        iterator = self._iterator() if self._iterator is not None else None
        return iterator if iterator is not None and iterator._active else None

    def __iter__(self) -> Iterator[BatchT]:
        close_failed_iterator(self)
        if self._active_iterator() is not None:
            raise RuntimeError(
                "an iterator of this loader is still active: drain it or call its close() "
                "before calling iter() again (take state_dict() first to resume mid-epoch)"
            )
        self.open()
        if self._warn_dropped_tail:
            self._warn_dropped_tail = False
            dropped = self._order.drops_tail(self)
            if dropped:
                warnings.warn(tail_dropped(self, dropped), UserWarning, stacklevel=2)
        here = self._position
        here.closed_early = None
        root = self._order.build(self, here.epoch, here.offset)
        iterator = LoaderIterator(self, root, here.epoch, here.offset)
        self._iterator = weakref.ref(iterator)
        return iterator

    def _current_epoch(self) -> int:
        """The epoch being read, or the one the next ``iter()`` reads."""
        iterator = self._active_iterator()
        return iterator._epoch if iterator is not None else self._position.epoch

    def steps(self, n: int) -> Iterator[BatchT]:
        """Exactly ``n`` batches from where the loader stands, across epoch ends.

        ``for batch in loader.steps(n)`` delivers ``n`` batches from the current ``(epoch,
        offset)``, moving to ``(epoch + 1, 0)`` at each epoch's end (each epoch in
        GuideLoom's order); the next call continues there. The state stores no ``n``: after
        ``load_state_dict`` pass the steps still to run (on any world size). Between batches
        the loader has an active epoch iterator (``iter()`` and ``load_state_dict`` raise);
        it is closed as the last batch is handed over, or when the returned iterator is
        closed early, keeping the position of what was delivered.

        Raises ``ValueError`` (``n < 1``), ``TypeError`` (not an int), ``RuntimeError`` (an
        iterator of this loader is still active).
        """
        count = _int_arg("n", n, 1)
        refuse_active(self, "steps()")
        return run_steps(self, count)

    def skip(self, n: int) -> None:
        """Move past ``n`` global batches unread, across epoch ends as :meth:`steps` goes (the
        state says so, on any world size; the shard order re-reads a shuffle buffer's shards).
        Raises as :meth:`steps` does (``RuntimeError`` while an iterator is active)."""
        count = _int_arg("n", n, 1)
        refuse_active(self, "skip()")
        self.open()
        skip_steps(self, count)

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What was delivered: GuideLoom's five keys plus ``num_samples``,
        ``global_batch_size`` and ``base_seed`` (ours; the base seed makes each batch's
        random draws repeat on resume), and where they apply ``dataset_fingerprint``,
        ``mixture`` and the shard order's keys (``docs/checkpoints.md``).

        ``observation_offset`` grows by the global batch size for each batch handed to the
        caller (padding included; prefetched batches do not count). A drained iterator moves
        to ``(epoch + 1, 0)``; one closed early to ``(epoch, 0)``, as in GuideLoom: a state
        taken after that restarts the epoch, and the first one taken warns so (take it
        inside the loop instead).
        """
        return checkpoint.state_of(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict`` (ours or GuideLoom's) at the next ``iter()``.

        It may come from a loader with another world size or batch size (the offset is
        global). Shuffle, seed and drop_last mismatches warn; a loader built with
        ``shuffle_seed=None`` adopts the state's seed. A state from a dataset of another
        size warns. A state's ``base_seed`` replaces this loader's (worker processes started
        with another one start again), so the resumed batches draw what the saved run's did.
        A state of another dataset version, mixture or order is refused (``ValueError``).
        It opens the loader, as ``iter()`` does (the checks read the dataset through it).

        Args:
            state_dict: A dict from :meth:`state_dict` (or GuideLoom's).
        """
        checkpoint.load_into(self, state_dict)


#: The constructor's keywords and their defaults (``from_storage`` passes on the rest).
_CONSTRUCTOR_DEFAULTS = {
    key: parameter.default
    for key, parameter in inspect.signature(StatefulDataLoader.__init__).parameters.items()
    if key not in _NOT_KEYWORDS
}
