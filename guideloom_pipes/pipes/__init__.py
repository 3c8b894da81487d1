"""Composable ``torchdata.nodes`` stages of the loading pipeline, one job each.

The standard pipeline (what :class:`guideloom_pipes.StatefulDataLoader` builds)::

    RankPositions(n, local_batch_size, rank=, world_size=, drop_last=)  # positions of this rank
      -> Shuffle(seed)                       # positions -> sample ids (epoch-seeded Feistel)
      -> ReadSamples(dataset, num_workers=)  # ids -> samples (threads or processes, in order)
      -> Collate(collate_fn)                 # samples -> batch
      -> PinMemory -> Prefetcher(prefetch) -> ToDevice(device)   # each only when wanted

Each stage is a :class:`torchdata.nodes.BaseNode` with its source in ``.source`` and its
state in ``state_dict()``, so stages mix with torchdata's own nodes (``Mapper``,
``Batcher``, ``Prefetcher``, ...) and a pipeline checkpoints through
``torchdata.nodes.Loader.state_dict()``. Stages that run threads or processes stop them in
``close()``; :func:`close_pipeline` closes every stage of a pipeline.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guideloom_pipes.pipes._pool import DataLoaderTimeoutError
    from guideloom_pipes.pipes.collate import Collate, default_collate
    from guideloom_pipes.pipes.device import PinMemory, Prefetcher, ToDevice, apply_to_tensors
    from guideloom_pipes.pipes.packed import collate_packed
    from guideloom_pipes.pipes.positions import Positions, RankPositions, num_steps
    from guideloom_pipes.pipes.read import ReadSamples
    from guideloom_pipes.pipes.shuffle import Shuffle, draw_seed

# The stages load on first use: a process worker imports ``guideloom_pipes.pipes._worker``
# (torch-free), and importing this package must not import torch for it.
_STAGES = {
    "DataLoaderTimeoutError": "_pool",
    "Collate": "collate",
    "default_collate": "collate",
    "collate_packed": "packed",
    "PinMemory": "device",
    "Prefetcher": "device",
    "ToDevice": "device",
    "apply_to_tensors": "device",
    "Positions": "positions",
    "RankPositions": "positions",
    "num_steps": "positions",
    "ReadSamples": "read",
    "Shuffle": "shuffle",
    "draw_seed": "shuffle",
}


def __getattr__(name: str) -> Any:
    try:
        module = _STAGES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_STAGES))


__all__ = [
    "Collate",
    "DataLoaderTimeoutError",
    "PinMemory",
    "Positions",
    "Prefetcher",
    "RankPositions",
    "ReadSamples",
    "Shuffle",
    "ToDevice",
    "apply_to_tensors",
    "close_pipeline",
    "collate_packed",
    "default_collate",
    "draw_seed",
    "num_steps",
]


def close_pipeline(root: Any) -> None:
    """Stop the threads and processes of a pipeline, from ``root`` down its ``.source`` chain.

    Calls ``close()`` on every node of the chain that has one (our stages; ``ReadSamples``
    also closes a reader it opened itself), consumers before their sources. torchdata's own
    threaded nodes stop when they are garbage-collected.

    Args:
        root: The last stage of the pipeline.
    """
    seen: set[int] = set()
    node = root
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        close = getattr(node, "close", None)
        if callable(close):
            close()
        node = getattr(node, "source", None)
