"""torch ``DataLoader``'s keywords as the loader meets them: the ones it cannot honour
refused with what to pass instead, and torch's own checks and warnings of the ones it takes
(``multiprocessing_context``, too many worker processes, ``snapshot_every_n_steps``), in
torch's words where torch code or users match them.
"""

from __future__ import annotations

import multiprocessing.context
import os
import pickle
import warnings
from typing import Any

#: Whether the note on ``snapshot_every_n_steps`` was given (once per process).
snapshot_note_given = False


def check_picklable(name: str, value: Any) -> None:
    try:
        pickle.dumps(value)
    except Exception as error:
        raise TypeError(
            f"{name} {value!r} cannot be pickled ({error}), and parallel_method='process' "
            f"sends it to every worker process: define it at module level (not a lambda, a "
            f"nested function or an object holding open files or locks), or use "
            f"parallel_method='thread'"
        ) from error


def reject_torch_keywords(
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


def cpu_count() -> int | None:
    """CPUs this process may run on (its affinity where the platform has one), as torch
    counts them for its excessive-worker warning."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def check_mp_context(context: Any, num_workers: int) -> None:
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


def excessive_workers_message(num_workers: int) -> str | None:
    """torch's warning text for more worker processes than CPUs (None: not too many)."""
    suggest = cpu_count()
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


def note_snapshot_every_n_steps(value: int | None, stacklevel: int) -> None:
    """Accept torchdata's ``snapshot_every_n_steps`` and say once why it does nothing here."""
    global snapshot_note_given
    if value is None:
        return
    steps = value
    if snapshot_note_given:
        return
    snapshot_note_given = True
    warnings.warn(
        f"snapshot_every_n_steps={steps} is ignored: torchdata's StatefulDataLoader snapshots "
        "its workers' state every n steps, while this loader's state_dict() is exact after "
        "every batch (it is computed from the position, no snapshot is taken); remove the "
        "keyword. This note is shown once",
        UserWarning,
        stacklevel=stacklevel,
    )
