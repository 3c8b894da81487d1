"""Seeded shuffle: positions -> sample ids through GuideLoom's per-epoch Feistel permutation."""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.random  # (imported now, not in the first batch: see below)
import numpy.typing as npt
from torchdata.nodes import BaseNode

from guideloom_pipes.checks import check_int
from guideloom_pipes.pipes.positions import Positions, RankPositions
from guideloom_pipes.shuffle import FeistelPermutation

__all__ = ["Shuffle", "draw_seed", "state_marks"]

# numpy imports numpy.random lazily, on first use: here it is the epoch's Feistel key
# (FeistelPermutation.for_epoch), so without the import above the first batch of a shuffled
# loader would pay for it (10-100 ms), after the loader was built.
_I64 = npt.NDArray[np.int64]
_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def draw_seed() -> int:
    """A fresh shuffle seed (63 random bits, so it also fits an int64 tensor)."""
    return secrets.randbits(63)


def _check_seed(seed: Any) -> int | None:
    return check_int(
        "shuffle_seed",
        seed,
        minimum=0,
        allow_none=True,
        hint="(numpy's SeedSequence takes no negative seeds)",
    )


class Shuffle(BaseNode[_I64]):
    """Maps each :class:`Positions` batch to sample ids with the epoch's Feistel permutation.

    Position ``p`` of epoch ``e`` becomes sample ``FeistelPermutation.for_epoch(n, seed,
    e)(p)``, GuideLoom's shuffled order bit for bit. The permutation is evaluated for blocks
    of ``block_size`` upcoming positions of the rank at a time (a vectorised call costs about
    the same for 8 positions as for thousands), and batches are slices of the current block.

    The stage holds only its seed: its state is ``{"source": ..., "shuffle_seed": seed}``.
    Built with ``seed=None`` it draws a seed once and adopts the seed of a state it is reset
    to; built with a seed it keeps it and warns when a state carries another.

    Args:
        source: Emits :class:`Positions` (e.g. :class:`RankPositions`).
        seed: The shuffle seed (``shuffle_seed`` in GuideLoom); ``None`` draws one.
        block_size: How many positions to permute per vectorised call.
    """

    SOURCE_KEY = "source"
    SEED_KEY = "shuffle_seed"

    def __init__(
        self, source: BaseNode[Positions], seed: int | None = None, block_size: int = 8192
    ) -> None:
        super().__init__()
        self.source = source
        checked = _check_seed(seed)
        self._seed_given = checked is not None
        self.seed: int = draw_seed() if checked is None else checked
        self.block_size = check_int("block_size", block_size, minimum=1, not_int=ValueError)
        self._clear()

    def _clear(self) -> None:
        self._perm: FeistelPermutation | None = None
        self._perm_key: tuple[int, int] = (-1, -1)
        self._block_key: tuple[int, int, int] = (-1, -1, -1)  # epoch, n, stride
        self._block_start = 0
        self._block: _I64 = _EMPTY

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            saved = _check_seed(initial_state.get(self.SEED_KEY))
            if saved is not None and saved != self.seed:
                if self._seed_given:
                    warnings.warn(
                        f"the state was shuffled with shuffle_seed={saved}, this stage uses "
                        f"{self.seed}: the order will differ from the saved run's",
                        UserWarning,
                        stacklevel=2,
                    )
                else:
                    self.seed = saved
                    self._clear()
            self.source.reset(initial_state[self.SOURCE_KEY])
        else:
            self.source.reset()

    def _permutation(self, epoch: int, n: int) -> FeistelPermutation:
        if self._perm is None or self._perm_key != (epoch, n):
            self._perm = FeistelPermutation.for_epoch(n, self.seed, epoch)
            self._perm_key = (epoch, n)
        return self._perm

    def next(self) -> _I64:
        source = self.source
        if type(source) is RankPositions:
            # (reset with this stage: its positions as ints, no array or Positions made)
            first, count = source.next_span()
            if count == 0:
                return _EMPTY
            epoch, n, stride = source._epoch, source.num_samples, source.world_size
            ids = self._from_block(epoch, n, stride, first, count)
            if ids is not None:
                return ids
            positions = first + stride * np.arange(count, dtype=np.int64)
            return self._compute(Positions(epoch, n, positions, stride), first, count)
        item = next(source)
        positions = item.positions
        count = len(positions)
        if count == 0:
            return _EMPTY
        first = int(positions[0])
        ids = self._from_block(item.epoch, item.num_samples, item.stride, first, count)
        return ids if ids is not None else self._compute(item, first, count)

    def _from_block(self, epoch: int, n: int, stride: int, first: int, count: int) -> _I64 | None:
        """The ids of ``count`` positions from ``first`` (``stride`` apart) out of the block
        computed ahead, or None where the block does not hold them."""
        if self._block_key == (epoch, n, stride):
            index, rem = divmod(first - self._block_start, stride)
            if rem == 0 and index >= 0 and index + count <= len(self._block):
                return self._block[index : index + count]
        return None

    def _compute(self, item: Positions, first: int, count: int) -> _I64:
        n, stride = item.num_samples, item.stride
        perm = self._permutation(item.epoch, n)
        positions = item.positions
        if stride < 1 or int(positions[-1]) != first + stride * (count - 1):
            # Not evenly spaced (a custom source): permute just these positions.
            return perm(positions)
        if first + stride * (count - 1) >= n:
            raise ValueError(
                f"position {first + stride * (count - 1)} is out of range for a dataset of "
                f"{n} samples: positions must be < num_samples"
            )
        ahead = min(max(self.block_size, count), (n - 1 - first) // stride + 1)
        block = perm(first + stride * np.arange(ahead, dtype=np.int64))
        block.flags.writeable = False
        self._block_key = (item.epoch, n, stride)
        self._block_start = first
        self._block = block
        return block[:count]

    def get_state(self) -> dict[str, Any]:
        return self.state_over(self.source.state_dict())

    def state_over(self, source_state: dict[str, Any]) -> dict[str, Any]:
        """This stage's state when its source's is ``source_state`` (see :func:`state_marks`)."""
        return {self.SOURCE_KEY: source_state, self.SEED_KEY: self.seed}


def state_marks(
    node: BaseNode[Any],
) -> tuple[Callable[[], Any], Callable[[Any], dict[str, Any]]] | None:
    """``(mark, state_at)`` for a source whose state a stage keeps after every batch:
    ``mark()`` says cheaply where the source is now, ``state_at(m)`` is the state it had
    then (its ``state_dict()`` then, built only when asked for). For this package's
    :class:`RankPositions` and a :class:`Shuffle` of one (their ``state_dict()`` builds two
    dicts, ~0.5 us of a quick batch's ~15); None for any other node (its ``state_dict()``
    is kept). A mark holds while the node is not reset (the seed a :class:`Shuffle` adopts
    on a reset is the state's)."""
    shuffle = node if type(node) is Shuffle else None
    positions = node.source if shuffle is not None else node
    if type(positions) is not RankPositions:
        return None
    inner = positions.state_at
    if shuffle is None:
        return positions.mark, inner

    def state_at(mark: Any) -> dict[str, Any]:
        return shuffle.state_over(inner(mark))

    return positions.mark, state_at
