"""How an epoch of :class:`~guideloom_pipes.DataLoader` starts: its index sampler's pass
(resumed where a state says) and the seeds torch draws for it, in torch's order (an
``IterDataPipe``'s shared seed, the base seed, and the shared seed torch's worker iterator
draws again), so the generators stand where torch's do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterDataPipe

from guideloom_pipes.loader.datapipes import distributed_settings, draw_shared_seed
from guideloom_pipes.loader.sampler_order import EpochStart, replay_pass
from guideloom_pipes.pipes.workers.iteration import is_stateful

if TYPE_CHECKING:
    from guideloom_pipes.loader.torch_loader import DataLoader

__all__ = ["draw_datapipe_seed", "draw_worker_datapipe_seed", "start_epoch"]


def start_epoch(
    loader: DataLoader[Any],
    resume: Mapping[str, Any] | None,
    offset: int,
    *,
    replay: bool = True,
) -> tuple[Any, bool]:
    """Start the index sampler's pass (resumed where ``resume`` says), drawing the
    epoch's base seed as torch does; its iterator, and whether to keep its states.
    Without ``replay`` a resumed pass does not skip what was delivered (an
    IterableDataset's workers skip it themselves)."""
    sampler = loader._index_sampler
    stateful = is_stateful(sampler)
    persistent_drawn = loader.persistent_workers and loader._pool is not None
    if resume is not None and offset and stateful and resume.get("sampler_state") is not None:
        sampler.load_state_dict(resume["sampler_state"])
        loader.base_seed, loader._drew_base_seed = resume["base_seed"], False
        return iter(sampler), True
    if resume is not None and (offset or resume.get("started")):
        # (mid-epoch, or at the start of a pass already drawn: the same draws again)
        start = EpochStart.of_state(resume["generators"], loader)
        loader.base_seed = resume["base_seed"]
        loader._drew_base_seed = bool(resume.get("drew_base_seed"))
        loader._epoch_start = start
        if replay:
            return replay_pass(loader, sampler, start, resume, offset), stateful
        caller = torch.default_generator.get_state()
        start.restore(loader, default=True)
        try:
            loader._shared_seed = draw_datapipe_seed(loader)
            if resume.get("drew_base_seed"):
                loader._draw_base_seed()  # (what it drew from generator=)
                draw_worker_datapipe_seed(loader)
        finally:
            torch.default_generator.set_state(caller)
        return iter(()), stateful
    if resume is not None and resume.get("generators") is not None:
        # the epoch's start as the saved run stood at it: its sampler generators
        EpochStart.of_state(resume["generators"], loader).restore(loader, default=False)
    loader._epoch_start = EpochStart.now(loader)
    loader._shared_seed = draw_datapipe_seed(loader)  # (before the rest, as torch draws it)
    items = iter(sampler)
    if not persistent_drawn:
        loader.base_seed = loader._draw_base_seed()
        loader._drew_base_seed = True
        draw_worker_datapipe_seed(loader)
    else:
        loader._drew_base_seed = False
    return items, stateful


def draw_datapipe_seed(loader: DataLoader[Any]) -> int | None:
    """An IterDataPipe's shared seed for the epoch, drawn as torch draws it (None for
    any other dataset: nothing is drawn)."""
    if not isinstance(loader.dataset, IterDataPipe):
        return None
    world_size, _ = distributed_settings()
    if world_size > 1 and loader._datapipe_group is None:
        loader._datapipe_group = torch.distributed.new_group(backend="gloo")
    return draw_shared_seed(loader.generator, loader._datapipe_group)


def draw_worker_datapipe_seed(loader: DataLoader[Any]) -> None:
    """The shared seed torch's worker-process iterator draws again at its start, after
    the base seed (for its next epoch; it is not used): drawn, so the generators stand
    where torch's do."""
    if loader.num_workers:
        draw_datapipe_seed(loader)
