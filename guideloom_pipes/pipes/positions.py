"""Rank position sharding: the global positions one rank reads, a local batch at a time."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from torchdata.nodes import BaseNode

from guideloom_pipes.checks import check_int

__all__ = ["Positions", "RankPositions", "num_steps"]


class Positions(NamedTuple):
    """One local batch of global positions of one epoch, as :class:`RankPositions` emits it.

    ``positions`` is an int64 array of positions ``< num_samples`` (padding slots removed, so
    it may be short or empty with ``drop_last=False``), evenly spaced by ``stride`` (the world
    size): :class:`~guideloom_pipes.pipes.Shuffle` uses that to compute ahead.
    """

    epoch: int
    num_samples: int
    positions: npt.NDArray[np.int64]
    stride: int


#: Steps whose positions :class:`RankPositions` computes at once.
_BLOCK_STEPS = 256
_NO_BLOCK = np.zeros((0, 0), dtype=np.int64)


def num_steps(num_samples: int, offset: int, global_batch_size: int, drop_last: bool) -> int:
    """How many global batches an epoch has left from global position ``offset`` (SPEC §5).

    Args:
        num_samples: The dataset size ``n``.
        offset: The global position the epoch resumes at (it may exceed ``n`` after padding).
        global_batch_size: ``local_batch_size * world_size``.
        drop_last: Drop the incomplete final global batch instead of padding it.
    """
    left = num_samples - offset
    if left <= 0:
        return 0
    if drop_last:
        return left // global_batch_size
    return -(-left // global_batch_size)


class RankPositions(BaseNode[Positions]):
    """Emits this rank's global positions, one local batch per step (GuideLoom's order).

    For an epoch resumed at global offset ``o`` with ``r = n - o`` samples left there are
    ``r // G`` steps (``ceil(r / G)`` with ``drop_last=False``), ``G = local_batch_size *
    world_size``. Rank ``k`` takes positions ``o + k, o + k + world_size, ...`` up to
    ``o + steps * G``, ``local_batch_size`` at a time; positions ``>= n`` (padding, only with
    ``drop_last=False``) are left out, so a final batch may be short or empty while every rank
    takes the same number of steps.

    The stage owns the epoch and the offset; its state is ``{"epoch", "observation_offset",
    "num_samples"}``, the offset counting every global batch emitted (padding included).
    As with torchdata's nodes, a state saved after the epoch ran out means "exhausted": the
    offset is the epoch's end, and a node reset to it yields nothing more (a
    ``torchdata.nodes.Loader`` then starts the next epoch, with its default
    ``restart_on_stop_iteration=True``). ``reset()`` without a state moves to the start of
    the next epoch once the current one ran out (``next()`` raised ``StopIteration``);
    after a partly consumed epoch it restarts that epoch at offset 0 (GuideLoom's rule for
    an iterator closed early); otherwise it starts where the node was built or last reset to.

    Args:
        num_samples: The dataset size ``n``.
        local_batch_size: Positions per step on this rank.
        rank: This rank, ``0 <= rank < world_size``.
        world_size: Number of ranks sharing the dataset.
        drop_last: Drop the incomplete final global batch (True) or pad it (False).
        epoch: Epoch to start at.
        observation_offset: Global position to start the epoch at.
    """

    EPOCH_KEY = "epoch"
    OFFSET_KEY = "observation_offset"
    NUM_SAMPLES_KEY = "num_samples"

    def __init__(
        self,
        num_samples: int,
        local_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        epoch: int = 0,
        observation_offset: int = 0,
    ) -> None:
        super().__init__()
        self.num_samples = check_int("num_samples", num_samples, minimum=0)
        self.local_batch_size = check_int("local_batch_size", local_batch_size, minimum=1)
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank must be < world_size ({self.world_size}), got {self.rank}: "
                "ranks count from 0 to world_size - 1"
            )
        self.drop_last = bool(drop_last)
        self.global_batch_size = self.local_batch_size * self.world_size
        self._epoch = check_int("epoch", epoch, minimum=0)
        self._start = check_int("observation_offset", observation_offset, minimum=0)
        # Position j of a step is base + lane[j]; only the last lane can reach past n.
        self._lane = np.arange(self.local_batch_size, dtype=np.int64) * self.world_size
        self._last_lane = int(self._lane[-1])
        self._started = False
        self._begin(self._epoch, self._start)

    def _begin(self, epoch: int, offset: int) -> None:
        self._epoch = epoch
        self._start = offset
        self._step = 0
        # the positions of steps _block_step.. as rows of one read-only array (a row is a
        # view: cheaper than an addition per step)
        self._block_step = 0
        self._block = _NO_BLOCK
        self._steps = num_steps(self.num_samples, offset, self.global_batch_size, self.drop_last)
        self._exhausted = False  # next() found the epoch's end

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            epoch = check_int("state epoch", initial_state[self.EPOCH_KEY], minimum=0)
            offset = check_int(
                "state observation_offset", initial_state[self.OFFSET_KEY], minimum=0
            )
            saved_n = initial_state.get(self.NUM_SAMPLES_KEY)
            if saved_n is not None and saved_n != self.num_samples:
                warnings.warn(
                    f"resuming a state taken on a dataset of {saved_n} samples on one of "
                    f"{self.num_samples}: the offset and the shuffled order refer to different "
                    "samples now",
                    UserWarning,
                    stacklevel=2,
                )
            self._begin(epoch, offset)
        elif self._exhausted:
            self._begin(self._epoch + 1, 0)
        elif self._started:
            self._begin(self._epoch, 0)
        else:
            self._begin(self._epoch, self._start)
        self._started = False

    def next_span(self) -> tuple[int, int]:
        """:meth:`next` as ``(first, count)``: the step's positions are ``first + world_size
        * i`` for ``i < count`` (for a stage that needs no array of them: a
        :class:`~guideloom_pipes.pipes.Shuffle` slices its block of permuted positions).
        The node moves on exactly as :meth:`next` moves it."""
        step = self._step
        if step >= self._steps:
            # The epoch is over; the state stays at its end ("exhausted"), and a reset()
            # without a state starts the next one.
            self._exhausted = True
            raise StopIteration()
        self._step = step + 1
        self._started = True
        n = self.num_samples
        base = self._start + step * self.global_batch_size + self.rank
        if base + self._last_lane >= n:  # (only then can a position reach past n)
            return base, 0 if base >= n else (n - 1 - base) // self.world_size + 1
        return base, self.local_batch_size

    def next(self) -> Positions:
        step = self._step
        base, count = self.next_span()
        if count < self.local_batch_size:
            positions = (self._lane + base)[:count]
        else:
            row = step - self._block_step
            if row >= len(self._block):
                ahead = min(_BLOCK_STEPS, self._steps - step)
                bases = base + self.global_batch_size * np.arange(ahead, dtype=np.int64)
                self._block = bases[:, None] + self._lane
                self._block.flags.writeable = False
                self._block_step, row = step, 0
            positions = self._block[row]
        return Positions(self._epoch, self.num_samples, positions, self.world_size)

    def get_state(self) -> dict[str, Any]:
        return self.state_at(self.mark())

    def mark(self) -> tuple[int, int]:
        """Where the node is, without building its state: ``(epoch, offset)``. A stage that
        keeps the state after every batch (``ReadSamples``) keeps these and builds the state
        of the one asked for (:meth:`state_at`)."""
        return self._epoch, self._start + self._step * self.global_batch_size

    def state_at(self, mark: tuple[int, int]) -> dict[str, Any]:
        """The state (as :meth:`state_dict`) of the node when it gave ``mark``."""
        return {
            self.EPOCH_KEY: mark[0],
            self.OFFSET_KEY: mark[1],
            self.NUM_SAMPLES_KEY: self.num_samples,
        }
