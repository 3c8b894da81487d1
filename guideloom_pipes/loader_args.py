"""The loader's arguments: GuideLoom's keywords and torch ``DataLoader``'s, checked and
translated into the one set of settings :class:`~guideloom_pipes.StatefulDataLoader` runs on.

Keywords the loader cannot honour are refused here, each with what to pass instead.
"""

from __future__ import annotations

import math
import multiprocessing.context
import operator
import os
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from guideloom_pipes.datasets import DocumentDataset, StreamDataset
from guideloom_pipes.opening import open_storage
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

#: Whether the note on ``snapshot_every_n_steps`` was given (once per process).
_snapshot_note_given = False


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: Bound of the numbers a batch's seed is derived from (64-bit words: ``batch_seed``).
SEED_WORD_LIMIT = 1 << 64


def _int_arg(name: str, value: Any, minimum: int, limit: int | None = None) -> int:
    """``value`` as an int ``>= minimum`` (and ``< limit`` when given), else an error naming
    ``name``, the value and the bound."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
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


def _check_picklable(name: str, value: Any) -> None:
    try:
        pickle.dumps(value)
    except Exception as error:
        raise TypeError(
            f"{name} {value!r} cannot be pickled ({error}), and parallel_method='process' "
            f"sends it to every worker process: define it at module level (not a lambda, a "
            f"nested function or an object holding open files or locks), or use "
            f"parallel_method='thread'"
        ) from error


def _reject_torch_keywords(
    sampler: Any,
    batch_sampler: Any,
    pin_memory_device: Any,
    in_order: Any,
) -> None:
    """torch ``DataLoader`` keywords this loader cannot honour: say what to use instead."""
    if sampler is not None:
        raise ValueError(
            f"sampler={sampler!r} is not supported: the loader orders samples itself so that "
            "it can checkpoint and resume them exactly. Pass shuffle=True (with shuffle_seed=) "
            "for a random order, and rank=/world_size= instead of a DistributedSampler"
        )
    if batch_sampler is not None:
        raise ValueError(
            f"batch_sampler={batch_sampler!r} is not supported: pass batch_size= (or "
            "local_batch_size=), drop_last= and shuffle= instead"
        )
    if pin_memory_device:
        raise ValueError(
            f"pin_memory_device={pin_memory_device!r} is not supported: pass device= (the "
            "device batches are moved to) with pin_memory=True"
        )
    if in_order is not True:
        raise ValueError(
            f"in_order={in_order!r} is not supported: batches always arrive in order, which is "
            "what makes checkpoints exact; remove the keyword"
        )


def _cpu_count() -> int | None:
    """CPUs this process may run on (its affinity where the platform has one), as torch
    counts them for its excessive-worker warning."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def _check_mp_context(context: Any, num_workers: int) -> None:
    """torch's checks of ``multiprocessing_context``, with its words: only with workers, a
    start method this platform has, or a context object."""
    if num_workers == 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading "
            f"(num_workers > 0), but got num_workers={num_workers}"
        )
    if isinstance(context, str):
        valid = multiprocessing.get_all_start_methods()
        if context not in valid:
            raise ValueError(
                f"multiprocessing_context option should specify a valid start method in "
                f"{valid!r}, but got multiprocessing_context={context!r}"
            )
    elif not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context}"
        )


def _excessive_workers_message(num_workers: int) -> str | None:
    """torch's warning text for more worker processes than CPUs (None: not too many)."""
    suggest = _cpu_count()
    if suggest is not None and num_workers <= suggest:
        return None
    if suggest is None:
        suggested = (
            "DataLoader is not able to compute a suggested max number of worker in current system."
        )
    else:
        cpuset = "" if hasattr(os, "sched_getaffinity") else " (`cpuset` is not taken into account)"
        suggested = (
            f"Our suggested max number of worker in current system is {suggest}{cpuset}, "
            "which is smaller than what this DataLoader is going to create."
        )
    return (
        f"This DataLoader will create {num_workers} worker processes in total. {suggested} "
        "Please be aware that excessive worker creation might get DataLoader running slow or "
        "even freeze, lower the worker number to avoid potential slowness/freeze if necessary."
    )


def _note_snapshot_every_n_steps(value: Any, stacklevel: int) -> None:
    """Accept torchdata's ``snapshot_every_n_steps`` and say once why it does nothing here."""
    global _snapshot_note_given
    if value is None:
        return
    steps = _int_arg("snapshot_every_n_steps", value, 1)
    if _snapshot_note_given:
        return
    _snapshot_note_given = True
    warnings.warn(
        f"snapshot_every_n_steps={steps} is ignored: torchdata's StatefulDataLoader snapshots "
        "its workers' state every n steps, while this loader's state_dict() is exact after "
        "every batch (it is computed from the position, no snapshot is taken); remove the "
        "keyword. This note is shown once",
        UserWarning,
        stacklevel=stacklevel,
    )


@dataclass(frozen=True)
class LoaderSettings:
    """What a loader runs on, after :func:`resolve_arguments` checked and translated it."""

    local_batch_size: int
    rank: int
    world_size: int
    num_workers: int
    parallel_method: str
    multiprocessing_context: str | multiprocessing.context.BaseContext | None
    timeout: float
    shuffle: bool
    #: The seed in use (drawn now when shuffling without one).
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
    #: torch's ``batch_size=`` was used and ``drop_last`` left out: warn if a tail is dropped.
    warn_dropped_tail: bool = False


def resolve_arguments(
    dataset: Any,
    collate_fn: Any,
    *,
    device: torch.device | str | int | None,
    local_batch_size: int,
    rank: int,
    world_size: int,
    num_workers: int,
    parallel_method: str,
    shuffle: bool | None,
    shuffle_seed: int | None,
    pin_memory: bool,
    drop_last: bool,
    prefetch: int,
    batch_size: Any,
    prefetch_factor: int | None,
    multiprocessing_context: str | multiprocessing.context.BaseContext | None,
    timeout: float,
    generator: torch.Generator | None,
    sampler: Any,
    batch_sampler: Any,
    worker_init_fn: Any,
    persistent_workers: bool,
    pin_memory_device: str,
    in_order: bool,
    snapshot_every_n_steps: int | None = None,
    stacklevel: int = 2,
) -> LoaderSettings:
    """Check the constructor's arguments and translate torch's keywords into GuideLoom's.

    Raises ``TypeError``/``ValueError`` naming the argument and the fix; warnings point
    ``stacklevel`` frames above this function's caller, as ``warnings.warn`` counts them.
    """
    stacklevel += 1
    if collate_fn is not None and not callable(collate_fn):
        if isinstance(collate_fn, int) and not isinstance(collate_fn, bool):
            raise TypeError(
                f"the second positional argument is collate_fn, got {collate_fn!r}: for a "
                f"batch size, pass batch_size={collate_fn} (or local_batch_size="
                f"{collate_fn})"
            )
        raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
    _reject_torch_keywords(sampler, batch_sampler, pin_memory_device, in_order)
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

    # torch's batch_size / prefetch_factor / shuffle=None / timeout; drop_last left out
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
    if shuffle is None:
        shuffle = False
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
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(
            f"timeout option should be non-negative: a number of seconds (0: wait forever), "
            f"got {timeout!r}"
        )

    local_batch_size = _int_arg("local_batch_size", local_batch_size, 1)
    world_size = _int_arg("world_size", world_size, 1)
    rank = _int_arg("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(
            f"rank must be < world_size ({world_size}), got {rank}: pass the "
            "global rank, from 0 to world_size - 1"
        )
    if parallel_method not in _METHODS:
        raise ValueError(f"parallel_method must be 'thread' or 'process', got {parallel_method!r}")
    if multiprocessing_context is not None:
        _check_mp_context(multiprocessing_context, num_workers)
    if multiprocessing_context is not None and parallel_method != "process":
        raise ValueError(
            f"multiprocessing_context={multiprocessing_context!r} applies only to process "
            "workers: pass parallel_method='process' too (workers are threads by default)"
        )
    shuffle = _bool_arg("shuffle", shuffle)
    drop_last = _bool_arg("drop_last", drop_last)
    prefetch = _int_arg("prefetch", prefetch, 0)
    pin_memory = _bool_arg("pin_memory", pin_memory)

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
    persistent_workers = _bool_arg("persistent_workers", persistent_workers)
    if persistent_workers and num_workers == 0:
        raise ValueError(
            "persistent_workers=True needs num_workers > 0 (as in torch): there are no "
            "workers to keep; remove the keyword or pass num_workers="
        )

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
    # GuideLoom's warning, for GuideLoom's keywords: a torch-style call (batch_size=) gets
    # torch's behaviour, which has nothing to warn of here (workers read ahead anyway)
    if prefetch * local_batch_size < num_workers and batch_size is _UNSET:
        warnings.warn(
            f"prefetch * local_batch_size = {prefetch * local_batch_size} < num_workers = "
            f"{num_workers}: set prefetch >= {math.ceil(num_workers / local_batch_size)} "
            "to silence this GuideLoom warning (the workers read ahead either way)",
            UserWarning,
            stacklevel=stacklevel,
        )
    if parallel_method == "process" and num_workers > 0:
        _check_picklable("collate_fn", collate_fn)
        _check_picklable("dataset", dataset)
        if worker_init_fn is not None:
            _check_picklable("worker_init_fn", worker_init_fn)
        too_many = _excessive_workers_message(num_workers)
        if too_many is not None:
            warnings.warn(too_many, UserWarning, stacklevel=stacklevel)
    _note_snapshot_every_n_steps(snapshot_every_n_steps, stacklevel + 1)

    return LoaderSettings(
        local_batch_size=local_batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        parallel_method=parallel_method,
        multiprocessing_context=multiprocessing_context,
        timeout=float(timeout),
        shuffle=shuffle,
        shuffle_seed=shuffle_seed,
        seed_given=seed_given,
        base_seed=base_seed,
        worker_init_fn=worker_init_fn,
        persistent_workers=persistent_workers,
        drop_last=drop_last,
        prefetch=prefetch,
        pin_memory=pin_memory,
        device=device,
        warn_dropped_tail=batch_size is not _UNSET and not drop_last_given,
    )


def dataset_for_storage(storage: Any, sequence_length: int | None) -> Any:
    """The dataset ``from_storage`` reads: ``StreamDataset`` or ``DocumentDataset``; a path
    (``str`` or ``os.PathLike``) is opened with :func:`~guideloom_pipes.open_storage`."""
    if isinstance(storage, (str, os.PathLike)):
        storage = open_storage(storage)
    if isinstance(storage, (StreamStorage, StreamWithMetaStorage)):
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
