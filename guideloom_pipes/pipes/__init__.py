"""Composable ``torchdata.nodes`` stages of the loading pipeline, one job each.

The standard pipeline (what :class:`guideloom_pipes.StatefulDataLoader` builds)::

    RankPositions(n, local_batch_size, rank=, world_size=, drop_last=)  # positions of this rank
      -> Shuffle(seed)                       # positions -> sample ids (epoch-seeded Feistel)
      -> ReadSamples(dataset, num_workers=)  # ids -> samples (threads or processes, in order)
      -> Collate(collate_fn)                 # samples -> batch
      -> PinMemory -> Prefetcher(prefetch) -> ToDevice(device)   # each only when wanted

The shard-streaming pipeline (``order="shards"``, see :mod:`guideloom_pipes.pipes.shards`)::

    ListShards(reader) -> RankShards(...) -> ReadShards(reader) -> ShuffleBuffer()
      -> BatchSamples(local_batch_size) -> Collate(collate_fn) -> (as above)

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
    from guideloom_pipes.pipes.collate import Collate, default_collate, pad_collate
    from guideloom_pipes.pipes.device import PinMemory, Prefetcher, ToDevice, apply_to_tensors
    from guideloom_pipes.pipes.errors import DataLoaderTimeoutError
    from guideloom_pipes.pipes.packed import collate_packed
    from guideloom_pipes.pipes.positions import Positions, RankPositions, num_steps
    from guideloom_pipes.pipes.read import ReadSamples
    from guideloom_pipes.pipes.ring import PinnedRing
    from guideloom_pipes.pipes.seeding import BatchRandom, batch_rng
    from guideloom_pipes.pipes.shard_batches import BatchSamples, ShuffleBuffer
    from guideloom_pipes.pipes.shard_plan import ShardPlan
    from guideloom_pipes.pipes.shard_reads import ListShards, RankShards, ReadShards
    from guideloom_pipes.pipes.shuffle import Shuffle, draw_seed
    from guideloom_pipes.pipes.worker_info import get_worker_info

# The stages load on first use: a process worker imports
# ``guideloom_pipes.pipes.workers.process_main``
# (torch-free), and importing this package must not import torch for it.
_STAGES = {
    "DataLoaderTimeoutError": "errors",
    "BatchRandom": "seeding",
    "batch_rng": "seeding",
    "Collate": "collate",
    "default_collate": "collate",
    "pad_collate": "collate",
    "collate_packed": "packed",
    "PinMemory": "device",
    "Prefetcher": "device",
    "ToDevice": "device",
    "apply_to_tensors": "device",
    "Positions": "positions",
    "RankPositions": "positions",
    "num_steps": "positions",
    "ReadSamples": "read",
    "PinnedRing": "ring",
    "BatchSamples": "shard_batches",
    "ListShards": "shard_reads",
    "RankShards": "shard_reads",
    "ReadShards": "shard_reads",
    "ShardPlan": "shard_plan",
    "ShuffleBuffer": "shard_batches",
    "Shuffle": "shuffle",
    "draw_seed": "shuffle",
    "get_worker_info": "worker_info",
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
    "BatchRandom",
    "BatchSamples",
    "ListShards",
    "RankShards",
    "ReadShards",
    "ShardPlan",
    "ShuffleBuffer",
    "Collate",
    "DataLoaderTimeoutError",
    "PinMemory",
    "PinnedRing",
    "Positions",
    "Prefetcher",
    "RankPositions",
    "ReadSamples",
    "Shuffle",
    "ToDevice",
    "apply_to_tensors",
    "batch_rng",
    "close_pipeline",
    "collate_packed",
    "default_collate",
    "draw_seed",
    "get_worker_info",
    "num_steps",
    "pad_collate",
]


def close_pipeline(root: Any) -> None:
    """Stop the threads and processes of a pipeline: every node reachable from ``root``.

    Calls ``close()`` on each node that has one (our stages; ``ReadSamples`` also closes a
    reader it opened itself), each once, consumers before their sources. A node's sources
    are its ``.source`` and every attribute that is a ``torchdata.nodes.BaseNode`` or a
    dict, list or tuple of them (``MultiNodeWeightedSampler``'s ``source_nodes``). If a
    ``close()`` raises, the other nodes are still closed and the first error is raised at
    the end. torchdata's own threaded nodes stop when they are garbage-collected.

    Args:
        root: The last stage of the pipeline.
    """
    seen: set[int] = set()
    stack = [root]
    failure: Exception | None = None
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        close = getattr(node, "close", None)
        if callable(close):
            try:
                close()
            except Exception as error:
                failure = failure or error
        stack.extend(reversed(_sources(node)))
    if failure is not None:
        raise failure


def _sources(node: Any) -> list[Any]:
    """The nodes ``node`` reads from (see :func:`close_pipeline`)."""
    try:
        from torchdata.nodes import BaseNode
    except ImportError:  # (no torchdata: only ``.source`` chains)
        base: tuple[type, ...] = ()
    else:
        base = (BaseNode,)
    sources = []
    source = getattr(node, "source", None)
    if source is not None:
        sources.append(source)
    for value in getattr(node, "__dict__", {}).values():
        if isinstance(value, base):
            sources.append(value)
        elif isinstance(value, dict):
            sources.extend(item for item in value.values() if isinstance(item, base))
        elif isinstance(value, (list, tuple)):
            sources.extend(item for item in value if isinstance(item, base))
    return sources
