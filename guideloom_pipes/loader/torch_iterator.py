"""An epoch of a :class:`~guideloom_pipes.DataLoader` (:class:`TorchLoaderIterator`), and
``batch_size=None``'s collate (:class:`Unbatched`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torchdata.nodes import BaseNode

from guideloom_pipes.loader.iterable_order import IterableOrder
from guideloom_pipes.loader.iterator import LoaderIterator
from guideloom_pipes.loader.sampler_order import SamplerBatches
from guideloom_pipes.pipes.iterable import IterableReads
from guideloom_pipes.pipes.workers.processes import ProcessPool

__all__ = ["TorchLoaderIterator", "Unbatched"]


class Unbatched:
    """``batch_size=None``'s collate: each step reads one sample, given to ``collate_fn``
    alone (torch's ``default_convert`` by default), as torch does."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        return self.collate_fn(samples[0])


class TorchLoaderIterator(LoaderIterator):
    """An epoch of a :class:`DataLoader`: a :class:`LoaderIterator` that also stops the
    epoch's own worker processes when it ends (``persistent_workers=False``)."""

    def __init__(
        self,
        loader: Any,
        root: BaseNode[Any],
        epoch: int,
        offset: int,
        source: SamplerBatches | IterableReads,
        pool: ProcessPool | None,
    ) -> None:
        self.source = source
        self._own_pool = pool
        try:
            super().__init__(loader, root, epoch, offset)
        except BaseException:
            if pool is not None:
                pool.close()
            raise

    def __next__(self) -> Any:
        batch = super().__next__()
        loader: Any = self._loader
        promised = loader._IterableDataset_len_called
        if promised is not None and loader._iterable:
            yielded = self._position()
            if yielded > promised:
                message = (
                    f"Length of IterableDataset {loader.dataset} was reported to be "
                    f"{promised}(when accessing len(dataloader)), but {yielded} samples have "
                    "been fetched. "
                )
                if loader.num_workers > 0:
                    message += (
                        "For multiprocessing data-loading, this could be caused by not "
                        "properly configuring the IterableDataset replica at each worker. "
                        "Please see https://pytorch.org/docs/stable/data.html#torch.utils."
                        "data.IterableDataset for examples."
                    )
                warnings.warn(message, stacklevel=2)
        return batch

    def _finish(self, epoch: int, offset: int) -> None:
        pool, self._own_pool = self._own_pool, None
        loader: Any = self._loader
        # Left mid-epoch (an error that is not a batch's own, a timeout): the next iter()
        # resumes where this one stood, from its state as of the last batch delivered.
        stays = offset and offset == self._position()
        # Left early (a loop's break, close()): the next iter() starts the epoch over, as
        # torch's does, but state_dict() still says what was delivered (torchdata's: a
        # state taken after the loop resumes there when loaded).
        left = not offset and epoch == self._epoch and self._position() > 0
        state = loader.state_dict() if stays or left else None
        order = loader._order
        if isinstance(order, IterableOrder) and epoch != self._epoch:  # (the epoch ended)
            assert isinstance(self.source, IterableReads)
            loader._carried = order.carried(loader, self.source)
        try:
            super()._finish(epoch, offset)
        finally:
            if pool is not None:
                pool.close()
        if stays and state is not None:
            loader._position.move(state["epoch"], state["batches"], 1)
            loader._resume = state
        elif left:
            loader._left_state = state
