"""The loader's settings: GuideLoom's keywords and torch ``DataLoader``'s, checked once and
translated into one frozen :class:`LoaderSettings`, which the loader holds whole.

Keywords the loader cannot honour are refused here, each with what to pass instead.
"""

from __future__ import annotations

import math
import multiprocessing.context
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from guideloom_pipes.checks import check_int
from guideloom_pipes.datasets import DocumentDataset, StreamDataset, has_documents
from guideloom_pipes.loader.torch_keywords import (
    check_mp_context,
    check_picklable,
    excessive_workers_message,
    note_snapshot_every_n_steps,
    reject_torch_keywords,
)
from guideloom_pipes.mixture import MixtureDataset
from guideloom_pipes.opening import open_storage
from guideloom_pipes.pipes import default_collate
from guideloom_pipes.storage import DocumentStorage, StreamStorage, StreamWithMetaStorage

_METHODS = ("thread", "process")


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


class _DefaultTrue(int):
    """``True`` as a keyword's default, told apart from a ``True`` the caller passed.

    It equals ``True`` and shows as ``True`` in the signature; the loader replaces it with a
    real ``True`` and knows the caller left the keyword out (see ``drop_last``).
    """

    def __repr__(self) -> str:
        return "True"


#: ``drop_last``'s default: GuideLoom's ``True``, unless the caller passes it.
DROP_LAST_DEFAULT: Any = _DefaultTrue(1)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: Bound of the numbers a batch's seed is derived from (64-bit words: ``batch_seed``).
SEED_WORD_LIMIT = 1 << 64


def _int_arg(name: str, value: Any, minimum: int, limit: int | None = None) -> int:
    """``value`` as an int ``>= minimum`` (and ``< limit`` when given), else an error naming
    ``name``, the value and the bound."""
    number = check_int(name, value, minimum=minimum)
    if limit is not None and number >= limit:
        bound = "2**64" if limit == SEED_WORD_LIMIT else str(limit)
        raise ValueError(
            f"{name} must be < {bound} (batches are seeded from it as a 64-bit number), "
            f"got {number}"
        )
    return number


def _bool_arg(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


@dataclass(frozen=True)
class LoaderSettings:
    """What a loader runs on, after :func:`resolve_arguments` checked and translated it.

    Built once per loader and held whole (``loader.settings``); the loader's attributes of
    the same names read it. Setting one of those that torch lets be set (``timeout``,
    ``num_workers`` ...) replaces the settings object; the rest are frozen, as in torch.
    """

    local_batch_size: int
    rank: int
    world_size: int
    num_workers: int
    parallel_method: str
    multiprocessing_context: str | multiprocessing.context.BaseContext | None
    timeout: float
    shuffle: bool
    #: The seed in use at construction (drawn now when shuffling without one); the loader's
    #: ``shuffle_seed`` may adopt a loaded state's.
    shuffle_seed: int | None
    #: Whether the caller passed ``shuffle_seed`` (a loaded state's seed is adopted if not).
    seed_given: bool
    #: Drawn once at construction (from ``generator``, else torch's global generator): the
    #: shuffle seed when none is given, the workers' seeds and every batch's seed.
    base_seed: int
    worker_init_fn: Callable[[int], Any] | None
    persistent_workers: bool
    drop_last: bool
    prefetch: int
    pin_memory: bool
    device: torch.device
    #: The function batches go through (torch reports its ``default_collate`` too).
    collate_fn: Callable[[list[Any]], Any]
    #: torch's ``batch_size=`` was used and ``drop_last`` left out: warn if a tail is dropped.
    warn_dropped_tail: bool = False
    #: ``"global"`` (GuideLoom's order) or ``"shards"`` (see ``from_storage``).
    order: str = "global"
    #: Samples the shard order's buffer holds at least (``order="shards"`` only).
    shuffle_buffer: int | None = None
    # torch's attributes, as passed (torch code reads them)
    generator: torch.Generator | None = None
    prefetch_factor: int | None = None
    in_order: bool = True
    pin_memory_device: str = ""


#: The orders ``from_storage`` offers: GuideLoom's global windows, or whole shards per rank.
ORDERS = ("global", "shards")
#: ``shuffle_buffer``'s default, in samples.
SHUFFLE_BUFFER_DEFAULT = 8192


def resolve_order(
    order: str, shuffle_buffer: int | None, keywords: dict[str, Any]
) -> tuple[str, int | None]:
    """Check ``from_storage``'s ``order`` and ``shuffle_buffer`` against the other keywords
    (the shard order reads whole shards on threads, with no timeout)."""
    if order not in ORDERS:
        raise ValueError(
            f"order must be one of {ORDERS}, got {order!r}: 'global' is GuideLoom's "
            "order, 'shards' streams whole shards per rank"
        )
    if order == "global":
        if shuffle_buffer is not None:
            raise ValueError(
                f"shuffle_buffer={shuffle_buffer!r} applies to order='shards' only: pass "
                "order='shards', or leave shuffle_buffer out"
            )
        return order, None
    buffer = _int_arg(
        "shuffle_buffer", SHUFFLE_BUFFER_DEFAULT if shuffle_buffer is None else shuffle_buffer, 1
    )
    if keywords.get("num_workers", 0) and keywords.get("parallel_method") == "process":
        raise ValueError(
            "order='shards' reads shards on worker threads: pass parallel_method='thread' "
            "(or num_workers=0), or use order='global' for process workers"
        )
    if keywords.get("timeout"):
        raise ValueError(
            f"timeout={keywords['timeout']!r} is not supported with order='shards' (a whole "
            "shard is one read): leave timeout at 0, or use order='global'"
        )
    return order, buffer


def resolve_arguments(
    dataset: Any,
    collate_fn: Any,
    keywords: Mapping[str, Any],
    *,
    order: str = "global",
    shuffle_buffer: int | None = None,
    stacklevel: int = 2,
) -> LoaderSettings:
    """Check the constructor's ``keywords`` (each of ``StatefulDataLoader.__init__``'s, by
    name) and translate torch's into GuideLoom's.

    Raises ``TypeError``/``ValueError`` naming the argument and the fix; warnings point
    ``stacklevel`` frames above this function's caller, as ``warnings.warn`` counts them.
    """
    stacklevel += 1
    k = SimpleNamespace(**keywords)
    _check_collate_fn(collate_fn)
    reject_torch_keywords(k.sampler, k.batch_sampler, k.pin_memory_device, k.in_order)
    _check_map_style(dataset, k.worker_init_fn)
    local_batch_size, drop_last, drop_last_given = _torch_batching(
        k.batch_size, k.local_batch_size, k.drop_last
    )
    num_workers, prefetch = _workers_and_prefetch(k.num_workers, k.prefetch_factor, k.prefetch)
    _check_timeout(k.timeout)
    local_batch_size, world_size, rank = _ranks(local_batch_size, k.world_size, k.rank)
    _check_method(k.parallel_method, k.multiprocessing_context, num_workers)
    shuffle = _bool_arg("shuffle", False if k.shuffle is None else k.shuffle)
    check_scheduled_mixture(dataset, shuffle)
    drop_last = _bool_arg("drop_last", drop_last)
    prefetch = _int_arg("prefetch", prefetch, 0)
    pin_memory = _bool_arg("pin_memory", k.pin_memory)
    shuffle_seed, seed_given, base_seed = _seeds(shuffle, k.shuffle_seed, k.generator)
    persistent_workers = _bool_arg("persistent_workers", k.persistent_workers)
    if persistent_workers and num_workers == 0:
        raise ValueError(
            "persistent_workers=True needs num_workers > 0 (as in torch): there are no "
            "workers to keep; remove the keyword or pass num_workers="
        )
    device, pin_memory = _device_and_pinning(k.device, pin_memory, stacklevel + 1)
    if prefetch * local_batch_size < num_workers and k.batch_size is _UNSET:
        _warn_prefetch(prefetch, local_batch_size, num_workers, stacklevel + 1)
    if k.parallel_method == "process" and num_workers > 0:
        _check_process_workers(dataset, collate_fn, k.worker_init_fn, num_workers, stacklevel + 1)
    snapshot = k.snapshot_every_n_steps
    if snapshot is not None:
        snapshot = _int_arg("snapshot_every_n_steps", snapshot, 1)
    note_snapshot_every_n_steps(snapshot, stacklevel + 1)
    return LoaderSettings(
        local_batch_size=local_batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        parallel_method=k.parallel_method,
        multiprocessing_context=k.multiprocessing_context,
        timeout=float(k.timeout),
        shuffle=shuffle,
        shuffle_seed=shuffle_seed,
        seed_given=seed_given,
        base_seed=base_seed,
        worker_init_fn=k.worker_init_fn,
        persistent_workers=persistent_workers,
        drop_last=drop_last,
        prefetch=prefetch,
        pin_memory=pin_memory,
        device=device,
        collate_fn=collate_fn if collate_fn is not None else default_collate,
        warn_dropped_tail=k.batch_size is not _UNSET and not drop_last_given,
        order=order,
        shuffle_buffer=shuffle_buffer,
        generator=k.generator,
        prefetch_factor=k.prefetch_factor,
        in_order=k.in_order,
        pin_memory_device=k.pin_memory_device,
    )


def check_scheduled_mixture(dataset: Any, shuffle: bool) -> None:
    """Refuse to shuffle a ``MixtureDataset`` whose weights follow a ``WeightSchedule``."""
    if shuffle and isinstance(dataset, MixtureDataset) and dataset.schedule is not None:
        raise ValueError(
            "a MixtureDataset with a WeightSchedule needs shuffle=False: the schedule's "
            "points are positions of the run, and the loader's shuffle would scatter them "
            "over the whole epoch. The mixture shuffles each component itself (a new "
            "permutation per pass), so pass shuffle=False"
        )


def _check_collate_fn(collate_fn: Any) -> None:
    if collate_fn is not None and not callable(collate_fn):
        if isinstance(collate_fn, int) and not isinstance(collate_fn, bool):
            raise TypeError(
                f"the second positional argument is collate_fn, got {collate_fn!r}: for a "
                f"batch size, pass batch_size={collate_fn} (or local_batch_size="
                f"{collate_fn})"
            )
        raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")


def _check_timeout(timeout: Any) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(
            f"timeout option should be non-negative: a number of seconds (0: wait forever), "
            f"got {timeout!r}"
        )


def _ranks(local_batch_size: Any, world_size: Any, rank: Any) -> tuple[int, int, int]:
    local_batch_size = _int_arg("local_batch_size", local_batch_size, 1)
    world_size = _int_arg("world_size", world_size, 1)
    rank = _int_arg("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(
            f"rank must be < world_size ({world_size}), got {rank}: pass the "
            "global rank, from 0 to world_size - 1"
        )
    return local_batch_size, world_size, rank


def _warn_prefetch(prefetch: int, local_batch_size: int, num_workers: int, stacklevel: int) -> None:
    """GuideLoom's warning, for GuideLoom's keywords (a torch-style call, with
    ``batch_size=``, gets torch's behaviour, which has nothing to warn of: workers read
    ahead anyway)."""
    warnings.warn(
        f"prefetch * local_batch_size = {prefetch * local_batch_size} < num_workers = "
        f"{num_workers}: set prefetch >= {math.ceil(num_workers / local_batch_size)} "
        "to silence this GuideLoom warning (the workers read ahead either way)",
        UserWarning,
        stacklevel=stacklevel,
    )


def _check_map_style(dataset: Any, worker_init_fn: Any) -> None:
    if worker_init_fn is not None and not callable(worker_init_fn):
        raise TypeError(f"worker_init_fn must be callable or None, got {worker_init_fn!r}")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError(
            f"{type(dataset).__name__} is an iterable-style dataset; StatefulDataLoader needs "
            "a map-style one (len() and [i]) to shuffle, shard and resume by position. Give "
            "it __len__ and __getitem__, or write its samples once with write_parallel and "
            "read them with StatefulDataLoader.from_storage('path/to/data', ...) "
            "(docs/writing.md)"
        )
    if not hasattr(dataset, "__len__") or not (
        hasattr(dataset, "__getitem__") or hasattr(dataset, "sync_reader")
    ):
        raise TypeError(
            f"dataset must be map-style (support len() and [i]), got {type(dataset).__name__}"
        )


def _torch_batching(
    batch_size: Any, local_batch_size: Any, drop_last: Any
) -> tuple[Any, Any, bool]:
    """torch's ``batch_size`` for ``local_batch_size``; ``drop_last`` left out is GuideLoom's
    ``True`` (and whether it was given)."""
    drop_last_given = drop_last is not DROP_LAST_DEFAULT
    if not drop_last_given:
        drop_last = True
    if batch_size is not _UNSET:
        if batch_size is None:
            raise ValueError(
                "batch_size=None (torch's unbatched loading) is not supported: pass "
                "batch_size=1 and take batch[0], or collate_fn=lambda samples: samples[0]"
            )
        batch_size = _int_arg("batch_size", batch_size, 1)
        if local_batch_size not in (1, batch_size):
            raise ValueError(
                f"batch_size={batch_size} and local_batch_size={local_batch_size} disagree: "
                "pass only one of them (they mean the same)"
            )
        local_batch_size = batch_size
    return local_batch_size, drop_last, drop_last_given


def _workers_and_prefetch(num_workers: Any, prefetch_factor: Any, prefetch: Any) -> tuple[int, Any]:
    """``num_workers`` checked (torch's wording for a negative one); torch's
    ``prefetch_factor`` translated into ``prefetch``."""
    if isinstance(num_workers, int) and not isinstance(num_workers, bool) and num_workers < 0:
        raise ValueError(
            "num_workers option should be non-negative; use num_workers=0 to disable "
            f"multiprocessing (here: to read in the training thread), got {num_workers}"
        )
    num_workers = _int_arg("num_workers", num_workers, 0)
    if prefetch_factor is not None:
        if num_workers == 0:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing (as in "
                f"torch: prefetch_factor={prefetch_factor} applies only with num_workers > "
                "0); pass prefetch= for finished batches waiting ahead"
            )
        prefetch_factor = _int_arg("prefetch_factor", prefetch_factor, 1)
        if prefetch != 0:
            raise ValueError(
                f"pass prefetch ({prefetch}) or prefetch_factor ({prefetch_factor}), not "
                "both: prefetch = prefetch_factor * num_workers"
            )
        prefetch = prefetch_factor * num_workers
    return num_workers, prefetch


def _check_method(parallel_method: Any, multiprocessing_context: Any, num_workers: int) -> None:
    if parallel_method not in _METHODS:
        raise ValueError(f"parallel_method must be 'thread' or 'process', got {parallel_method!r}")
    if multiprocessing_context is not None:
        check_mp_context(multiprocessing_context, num_workers)
        if parallel_method != "process":
            raise ValueError(
                f"multiprocessing_context={multiprocessing_context!r} applies only to process "
                "workers: pass parallel_method='process' too (workers are threads by default)"
            )


def _seeds(
    shuffle: bool, shuffle_seed: Any, generator: torch.Generator | None
) -> tuple[int | None, bool, int]:
    """The shuffle seed, whether it was given, and the base seed drawn now."""
    if shuffle_seed is not None:
        if generator is not None:
            raise ValueError("pass shuffle_seed or generator, not both")
        shuffle_seed = _int_arg("shuffle_seed", shuffle_seed, 0)
    seed_given = shuffle_seed is not None
    # As torch's DataLoader draws its base seed (per iterator there, once here): from the
    # generator, else torch's global one, so torch.manual_seed(s) repeats a run.
    base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    if shuffle_seed is None and shuffle:
        shuffle_seed = base_seed
    return shuffle_seed, seed_given, base_seed


def _device_and_pinning(
    device: torch.device | str | int | None, pin_memory: bool, stacklevel: int
) -> tuple[torch.device, bool]:
    """The device batches go to (the default one for ``None``) and whether to pin, warning
    where pinning cannot help or is missing."""
    device = _default_device() if device is None else torch.device(device)
    if pin_memory and device.type != "cuda":
        warnings.warn(
            f"pin_memory=True has no effect with device={device}: pinned memory only "
            "speeds up copies to a CUDA device; ignoring it (GuideLoom raises ValueError)",
            UserWarning,
            stacklevel=stacklevel,
        )
        pin_memory = False
    if device.type == "cuda" and not pin_memory:
        warnings.warn(
            f"device={device} without pin_memory=True: host-to-device copies will be "
            "synchronous; pass pin_memory=True",
            UserWarning,
            stacklevel=stacklevel,
        )
    return device, pin_memory


def _check_process_workers(
    dataset: Any, collate_fn: Any, worker_init_fn: Any, num_workers: int, stacklevel: int
) -> None:
    """What worker processes are sent must pickle; more of them than CPUs warns (torch's)."""
    check_picklable("collate_fn", collate_fn)
    check_picklable("dataset", dataset)
    if worker_init_fn is not None:
        check_picklable("worker_init_fn", worker_init_fn)
    too_many = excessive_workers_message(num_workers)
    if too_many is not None:
        warnings.warn(too_many, UserWarning, stacklevel=stacklevel)


def dataset_for_storage(storage: Any, sequence_length: int | None) -> Any:
    """The dataset ``from_storage`` reads: ``StreamDataset`` or ``DocumentDataset`` (a
    corpus of documents such as ``MegatronIndexedStorage``: windows with ``sequence_length``,
    its documents without); a path (``str`` or ``os.PathLike``) is opened with
    :func:`~guideloom_pipes.open_storage`."""
    if isinstance(storage, (str, os.PathLike)):
        storage = open_storage(storage)
    if isinstance(storage, (StreamStorage, StreamWithMetaStorage)):
        if sequence_length is None and has_documents(storage):
            return DocumentDataset(storage)  # type: ignore[arg-type]  # a corpus's documents
        if sequence_length is None:
            raise ValueError(
                f"{type(storage).__name__} needs sequence_length= (the number of stream "
                "elements per sample)"
            )
        return StreamDataset(storage, sequence_length)
    if isinstance(storage, DocumentStorage):
        if sequence_length is not None:
            raise TypeError(
                f"DocumentStorage takes no sequence_length (got {sequence_length!r}): each "
                "document is one sample; remove the keyword"
            )
        return DocumentDataset(storage)
    raise TypeError(
        "storage must be a StreamStorage, StreamWithMetaStorage or DocumentStorage, or the "
        f"path of one (opened with open_storage), got {type(storage).__name__}; for other "
        "map-style data pass it to StatefulDataLoader(dataset, ...)"
    )
