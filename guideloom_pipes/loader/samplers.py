"""``loader.sampler`` and ``loader.batch_sampler``: torch's sampler objects describing the
order a :class:`~guideloom_pipes.StatefulDataLoader` reads in (it orders samples itself)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from guideloom_pipes.loader.iterator import close_failed_iterator
from guideloom_pipes.loader.settings import SEED_WORD_LIMIT, _int_arg

if TYPE_CHECKING:
    from guideloom_pipes.loader.stateful import StatefulDataLoader


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
        return loader._order.rank_samples(loader, loader._current_epoch())

    def __iter__(self) -> Iterator[int]:
        loader = self._loader
        for ids in loader._order.epoch_batches(loader, loader._current_epoch()):
            yield from ids

    @property
    def epoch(self) -> int:
        """The loader's current epoch (the one being read, or read next)."""
        return self._loader._current_epoch()

    def set_epoch(self, epoch: int) -> None:
        """Move the loader to the start of ``epoch`` (nothing if it is in that epoch)."""
        set_epoch(self._loader, epoch)


class EpochBatchSampler(torch.utils.data.Sampler[list[int]]):
    """``loader.batch_sampler``: the sample ids of each batch this rank reads in the
    loader's current epoch (see :class:`EpochSampler`); ``len()`` is ``len(loader)``.
    Batches are short or ``[]`` where padding (``drop_last=False``) leaves them so."""

    def __init__(self, loader: StatefulDataLoader[Any, Any]) -> None:
        self._loader = weakref.proxy(loader)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[list[int]]:
        loader = self._loader
        return loader._order.epoch_batches(loader, loader._current_epoch())

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
        set_epoch(self._loader, epoch)


def set_epoch(loader: StatefulDataLoader[Any, Any], epoch: int) -> None:
    """``sampler.set_epoch``: move the loader to the start of ``epoch`` unless it is the
    current one (a resumed position in it is kept)."""
    epoch = _int_arg("epoch", epoch, 0, SEED_WORD_LIMIT)
    close_failed_iterator(loader)
    current = loader._current_epoch()
    if epoch == current:
        return
    if loader._active_iterator() is not None:
        raise RuntimeError(
            f"sampler.set_epoch({epoch}) while an iterator of this loader is reading epoch "
            f"{current}: drain it or call its close() first"
        )
    loader._position.move(epoch, 0, loader.global_batch_size)
