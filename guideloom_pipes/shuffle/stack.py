"""``FeistelStack``: several :class:`~guideloom_pipes.shuffle.FeistelPermutation` applied in
one vectorised call, each element by its own (a mixture's passes, a batch at a time)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from guideloom_pipes.shuffle.feistel import FeistelPermutation
from guideloom_pipes.shuffle.passes import _U64, _cycle_walk, _table_pass

__all__ = ["FeistelStack"]


class FeistelStack:
    """Several :class:`FeistelPermutation` applied in one call, each element by its own.

    ``stack(which, positions)`` maps ``positions[i]`` by ``permutations[which[i]]``, exactly
    as that permutation's own call does. The round tables of the permutations that have
    them are laid end to end, so a batch that mixes many permutations costs the few numpy
    operations of one; a permutation without tables (side ``a > 2**17``) or with a round
    whose sum can wrap around ``2**64`` is called by itself on its elements. Immutable once
    built (the tables are built here), so one stack may serve several threads.

    Args:
        permutations: the permutations, numbered by their order (at least one; all with
            the same number of rounds).
    """

    permutations: tuple[FeistelPermutation, ...]

    def __init__(self, permutations: Sequence[FeistelPermutation]) -> None:
        self.permutations = tuple(permutations)
        if not self.permutations:
            raise ValueError("FeistelStack needs at least one permutation, got none")
        rounds = sorted({p.rounds for p in self.permutations})
        if len(rounds) > 1:
            raise ValueError(
                f"the permutations of a FeistelStack must have the same number of rounds, "
                f"got {rounds}; stack those with the same count together"
            )
        self._odd = rounds[0] % 2 == 1
        fast = [p._use_table and not any(p._get_tables()[1]) for p in self.permutations]
        self._fast = np.array(fast, dtype=bool)
        # A permutation served by itself keeps a placeholder of side 1 in the stack.
        sides = [p._a if f else 1 for p, f in zip(self.permutations, fast)]
        self._offsets = np.zeros(len(sides), dtype=np.uint64)
        np.cumsum(sides[:-1], out=self._offsets[1:])
        self._tables = [
            np.concatenate(
                [
                    p._get_tables()[0][j] if f else np.zeros(1, np.uint32)
                    for p, f in zip(self.permutations, fast)
                ]
            )
            for j in range(rounds[0])
        ]
        self._side64 = np.array(sides, dtype=np.uint64)
        self._side32 = self._side64.astype(np.uint32)
        self._sizes = np.array([p.n for p in self.permutations], dtype=np.uint64)
        # Cycle walking of any stacked permutation ends within this many passes after the
        # first (see FeistelPermutation._walk).
        self._budget = max(
            (p._a * p._a - p.n for p, f in zip(self.permutations, fast) if f), default=0
        )

    def __len__(self) -> int:
        return len(self.permutations)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.permutations)} permutations)"

    def __call__(self, which: npt.ArrayLike, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Map each position by the permutation ``which`` names.

        Args:
            which: the permutation of each element, an integer array of numbers in
                ``[0, len(stack))``.
            positions: an integer array of the shape of ``which``, each in ``[0, n)`` of
                its permutation.

        Returns:
            The sample ids, an int64 array of that shape.

        Raises:
            IndexError: a number or a position is out of range (the message names it).
        """
        slot = np.asarray(which)
        given = np.asarray(positions)
        if slot.shape != given.shape:
            raise ValueError(
                f"which and positions must have the same shape, got {slot.shape} and {given.shape}"
            )
        for name, arr in (("which", slot), ("positions", given)):
            if arr.size and arr.dtype.kind not in "iu":
                raise TypeError(f"{name} must be integers, got an array of {arr.dtype}")
        shape = given.shape
        slot = slot.reshape(-1).astype(np.int64, copy=False)
        offset = given.reshape(-1).astype(np.int64, copy=False)
        if not offset.size:
            return np.empty(shape, dtype=np.int64)
        self._check(slot, offset)
        quick = self._fast[slot]
        if quick.all():
            return self._walk(slot, offset).view(np.int64).reshape(shape)
        out = np.empty(len(offset), dtype=np.int64)
        for s in np.unique(slot[~quick]).tolist():
            rows = np.flatnonzero(slot == s)
            out[rows] = self.permutations[s](offset[rows])
        rows = np.flatnonzero(quick)
        if len(rows):
            out[rows] = self._walk(slot[rows], offset[rows]).view(np.int64)
        return out.reshape(shape)

    def _check(self, slot: npt.NDArray[np.int64], offset: npt.NDArray[np.int64]) -> None:
        low, high = int(slot.min()), int(slot.max())
        if low < 0 or high >= len(self.permutations):
            bad = low if low < 0 else high
            raise IndexError(
                f"permutation {bad} is out of range [0, {len(self.permutations)}) of this stack"
            )
        outside = (offset < 0) | (offset.astype(np.uint64) >= self._sizes[slot])
        if outside.any():
            i = int(np.flatnonzero(outside)[0])
            raise IndexError(
                f"position {int(offset[i])} is out of range [0, {int(self._sizes[slot[i]])}) "
                f"of permutation {int(slot[i])}"
            )

    def _walk(self, slot: npt.NDArray[np.int64], offset: npt.NDArray[np.int64]) -> _U64:
        """Cycle-walk positions of stacked permutations (each ``slot`` has tables)."""
        tables, odd = self._tables, self._odd
        offsets, side64, side32 = self._offsets[slot], self._side64[slot], self._side32[slot]

        def step(values: _U64, rows: npt.NDArray[np.intp] | None) -> _U64:
            if rows is None:
                return _table_pass(values, tables, side64, side32, odd, offset=offsets)
            return _table_pass(
                values, tables, side64[rows], side32[rows], odd, offset=offsets[rows]
            )

        def fail(rows: npt.NDArray[np.intp]) -> RuntimeError:
            return self.permutations[int(slot[rows[0]])]._not_a_permutation()

        return _cycle_walk(offset.astype(np.uint64), step, self._sizes[slot], self._budget, fail)
