"""Windows of a stream at multiples of their length, gathered by numpy from mapped shards.

A loader's samples are the windows ``[w * L, (w + 1) * L)`` of the stream. Those that lie
inside shard ``k`` are the rows of one C-contiguous ``(m, L)`` array of its mapping (the
shard's elements from the first multiple of ``L`` in it), so a batch of them is one
``np.take`` per shard it touches: no index arrays built per window, no copy of the mapping
(``np.take`` copies a non-contiguous source, such as a ``sliding_window_view``, whole).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["WindowGrid"]


class WindowGrid:
    """The windows of ``length`` elements at multiples of ``length`` in a stream's shards.

    Args:
        starts: The global index of each shard's first element (``num_shards + 1`` values,
            the last the stream's length).
        length: The window length ``L`` (``>= 1``).
        mapped: ``shard -> `` its mapped elements as a 1-D array (of an unsigned integer
            dtype of the element's size), or None where the shard is not mapped.
    """

    def __init__(
        self, starts: np.ndarray, length: int, mapped: Callable[[int], np.ndarray | None]
    ) -> None:
        bounds = [int(start) for start in starts.tolist()]
        self.length = length
        # window numbers: the first one starting in each shard (and the stream's end), and
        # the end of those lying inside it (a window from there to the next shard's first
        # one crosses into a later shard)
        self._firsts = [-(-start // length) for start in bounds]
        self._ends = [end // length for end in bounds[1:]]
        self._starts = bounds
        #: The windows in the stream.
        self.windows = bounds[-1] // length
        self._mapped = mapped
        self._grids: list[np.ndarray | None] = [None] * (len(bounds) - 1)

    def _grid(self, shard: int) -> np.ndarray | None:
        """Shard ``shard``'s windows as rows of a ``(m, L)`` view of its mapping (row ``r``
        is window ``firsts[shard] + r``); None where the shard is not mapped."""
        grid = self._grids[shard]
        if grid is None:
            array = self._mapped(shard)
            if array is None:
                return None
            length, first = self.length, self._firsts[shard]
            rows = max(self._ends[shard] - first, 0)
            begin = first * length - self._starts[shard]
            grid = self._grids[shard] = array[begin : begin + rows * length].reshape(rows, length)
        return grid

    def gather(
        self,
        numbers: np.ndarray,
        out: np.ndarray,
        across: Callable[[np.ndarray, int, int, int], Any],
    ) -> bool:
        """Windows ``numbers`` (a non-empty int64 array of window numbers) into the rows of
        ``out`` (a C-contiguous ``(len(numbers), L)`` array of the mapped arrays'
        dtype): one ``np.take`` per shard they touch. ``across(row, start, shard, L)``
        copies a window that begins in ``shard`` at element ``start`` and ends in a later one
        into ``row``. False, with nothing written, where a number is not a window of the stream
        (``0 <= n < windows``) or a shard they touch is not mapped."""
        firsts, ends, grids = self._firsts, self._ends, self._grids
        order = numbers.argsort(kind="stable")
        ordered = numbers[order]
        listed = ordered.tolist()
        count = len(listed)
        if listed[0] < 0 or listed[-1] >= self.windows:
            return False
        pieces: list[tuple[np.ndarray, int, int, int, int]] = []
        begin = 0
        while begin < count:
            shard = bisect.bisect_right(firsts, listed[begin], 0, len(ends)) - 1
            end = bisect.bisect_left(listed, firsts[shard + 1], begin)
            inside = bisect.bisect_left(listed, ends[shard], begin, end)
            grid = grids[shard] if grids[shard] is not None else self._grid(shard)
            if grid is None:
                return False
            pieces.append((grid, shard, begin, inside, end))
            begin = end
        if len(pieces) == 1 and pieces[0][3] == count:
            # one shard, no window crossing out of it: straight into out, in the batch's order
            grid, shard = pieces[0][:2]
            grid.take(numbers - firsts[shard], 0, out, "clip")
            return True
        # shard by shard into a scratch array in sorted order, then into out's rows (a take
        # by the inverse order: contiguous rows, faster than out[order] = scratch)
        scratch = np.empty_like(out)
        for grid, shard, begin, inside, end in pieces:
            grid.take(ordered[begin:inside] - firsts[shard], 0, scratch[begin:inside], "clip")
            for row in range(inside, end):  # (windows crossing into the next shard)
                across(scratch[row], listed[row] * self.length, shard, self.length)
        scratch.take(order.argsort(), 0, out, "clip")
        return True
