"""Windows of a stream at multiples of their length, gathered by numpy from mapped shards.

A loader's samples are the windows ``[w * L, (w + 1) * L)`` of the stream. Those that lie
inside shard ``k`` are the rows of one C-contiguous ``(m, L)`` array of its mapping (the
shard's elements from the first multiple of ``L`` in it), so a batch of them is one
``np.take`` per shard it touches: no index arrays built per window, no copy of the mapping
(``np.take`` copies a non-contiguous source, such as a ``sliding_window_view``, whole).

Sorting a batch's windows by shard costs more than its copies when the windows are short.
A loader's batches are consecutive slices of one read-only block of shuffled ids (the
shuffle stage computes thousands ahead), so a batch that is such a slice is looked up in a
:class:`BlockPlan` made once for the whole block: each of its batches already sorted by
shard, with where each shard's run ends and the order back. Each batch is checked to equal
its planned row (a byte compare), so a plan never gives what was not asked for.

Short batches go further: a plan sorts each *unit* of a few consecutive batches (up to
``_UNIT_BYTES`` of windows) by shard as one, and the first of them asked for gathers the
whole unit with one ``np.take`` per shard, into one array whose rows are handed out, a
batch's at a time, as the unit's batches are asked for: a gather's numpy and Python costs
are paid once a unit (64 windows of 128 tokens: ~11 -> ~7 us of copies a batch). A batch
delivered so is a view of its unit's array, which lives as long as any of its batches.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["LISTED_SHARDS", "BlockPlan", "WindowGrid", "searchable"]

#: up to this many shard bounds, a plan keys a block's ids by one compare per bound
_COMPARED_BOUNDS = 16
#: up to this many (row, shard) ranks in a block, a plan sorts them as 16-bit integers
_NARROW_RANKS = (1 << 15) - 1

#: a unit of a plan holds at most this many bytes of windows, and at most _UNIT_BATCHES
#: batches (one each where a batch is larger)
_UNIT_BYTES = 256 << 10
_UNIT_BATCHES = 16
#: the units of a plan whose batches are kept for their turn, at most
_UNITS_KEPT = 4
#: (a unit not gathered yet)
_NOT_YET: Any = object()

#: up to this many shards, a stream's shard bounds are kept as lists of Python ints (for
#: ``bisect``, a third of numpy's time per lookup); past it, as the int64 arrays themselves
LISTED_SHARDS = 1 << 16


def searchable(bounds: np.ndarray, shards: int) -> Any:
    """A stream's per-shard ``bounds`` (an int64 array) as ``bisect`` searches them: a list
    of Python ints for a stream of up to :data:`LISTED_SHARDS` shards (a third of numpy's
    time per lookup), else the array itself (a little slower; a list costs 40 bytes a
    value, 40 MB for a million shards)."""
    return bounds.tolist() if shards <= LISTED_SHARDS else bounds


class WindowGrid:
    """The windows of ``length`` elements at multiples of ``length`` in a stream's shards.

    Args:
        starts: The global index of each shard's first element (``num_shards + 1`` values,
            the last the stream's length).
        length: The window length ``L`` (``>= 1``).
        mapped: ``shard -> `` its mapped elements as a 1-D array (of an unsigned integer
            dtype of the element's size), or None where the shard is not mapped.
        dtype: The dtype of the mapped arrays (windows are gathered through it; arrays
            from the gather's ``make`` may be of another dtype of its size).
    """

    def __init__(
        self,
        starts: np.ndarray,
        length: int,
        mapped: Callable[[int], np.ndarray | None],
        dtype: np.dtype[Any],
    ) -> None:
        self.length, self.dtype = length, dtype
        # window numbers: the first one starting in each shard (and the stream's end), and
        # the end of those lying inside it (a window from there to the next shard's first
        # one crosses into a later shard), each as bisect searches them (see searchable)
        firsts = -(-starts // length)
        ends = starts[1:] // length
        shards = len(starts) - 1
        self._firsts: Any = searchable(firsts, shards)
        self._ends: Any = searchable(ends, shards)
        self._starts: Any = searchable(starts, shards)
        #: The windows in the stream.
        self.windows = int(starts[-1]) // length
        self._mapped = mapped
        # per shard gathered from: its grid (the shards touched, not a list of them all)
        self._grids: dict[int, np.ndarray] = {}
        self._plan: BlockPlan | None = None
        # (plan, unit) -> its batches not handed out yet (None: it could not be gathered)
        self._units: dict[tuple[BlockPlan, int], dict[int, np.ndarray] | None] = {}
        self._lock = threading.Lock()
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None

    def _grid(self, shard: int) -> np.ndarray | None:
        """Shard ``shard``'s windows as rows of a ``(m, L)`` view of its mapping (row ``r``
        is window ``firsts[shard] + r``); None where the shard is not mapped."""
        grid = self._grids.get(shard)
        if grid is None:
            array = self._mapped(shard)
            if array is None:
                return None
            length, first = self.length, int(self._firsts[shard])
            rows = max(int(self._ends[shard]) - first, 0)
            begin = first * length - int(self._starts[shard])
            grid = self._grids[shard] = array[begin : begin + rows * length].reshape(rows, length)
        return grid

    def forget(self, shard: int) -> None:
        """Drop the grid kept of shard ``shard`` (its mapping was let go)."""
        self._grids.pop(shard, None)

    def gather(
        self,
        numbers: np.ndarray,
        make: Callable[[tuple[int, ...]], np.ndarray],
        across: Callable[[np.ndarray, int, int, int], Any],
    ) -> np.ndarray | None:
        """Windows ``numbers`` (a non-empty int64 array of window numbers) as the rows of a
        C-contiguous ``(len(numbers), L)`` array, gathered with one ``np.take`` per shard
        they touch into arrays from ``make(shape)`` (C-contiguous, of a dtype the size of an
        element, used by nothing else; the result is of its dtype). A batch of a planned
        block (see :class:`BlockPlan`) may come as its row of its unit's ``(batches,
        len(numbers), L)`` array, gathered whole when the unit's first batch was asked for;
        each row is handed out once. ``across(row, start, shard, L)`` copies a window that
        begins in ``shard`` at element ``start`` and ends in a later one into ``row``. None
        where a number is not a window of the stream (``0 <= n < windows``) or a shard they
        touch is not mapped."""
        plan = self._plan
        if plan is None or numbers.base is not plan.base:
            plan = self._planned(numbers)
        if plan is not None:
            row = plan.row_of(numbers)
            if row >= 0 and plan.per == 1:
                out = self._gather_unit(plan, row, make, across)
                return None if out is None else out[0]
            if row >= 0:
                rows = self._unit_row(plan, row, make, across)
                if rows is not None:
                    return rows
        return self._gather_sorted(numbers, make, across)

    def _gather_sorted(
        self,
        numbers: np.ndarray,
        make: Callable[[tuple[int, ...]], np.ndarray],
        across: Callable[[np.ndarray, int, int, int], Any],
    ) -> np.ndarray | None:
        """:meth:`gather` of any ``numbers``: sorted by shard here, then a take per shard."""
        firsts, ends = self._firsts, self._ends
        order = numbers.argsort(kind="stable")
        ordered = numbers[order]
        listed = ordered.tolist()
        count = len(listed)
        if listed[0] < 0 or listed[-1] >= self.windows:
            return None
        pieces: list[tuple[np.ndarray, int, int, int, int]] = []
        begin = 0
        while begin < count:
            shard = bisect.bisect_right(firsts, listed[begin], 0, len(ends)) - 1
            end = bisect.bisect_left(listed, firsts[shard + 1], begin)
            inside = bisect.bisect_left(listed, ends[shard], begin, end)
            grid = self._grid(shard)
            if grid is None:
                return None
            pieces.append((grid, shard, begin, inside, end))
            begin = end
        made = make((count, self.length))
        out = made.view(self.dtype)
        if len(pieces) == 1 and pieces[0][3] == count:
            # one shard, no window crossing out of it: straight into out, in the batch's order
            grid, shard = pieces[0][:2]
            grid.take(numbers - firsts[shard], 0, out, "clip")
            return made
        # shard by shard into a scratch array in sorted order, then into out's rows (a take
        # by the inverse order: contiguous rows, faster than out[order] = scratch)
        scratch = make((count, self.length)).view(self.dtype)
        for grid, shard, begin, inside, end in pieces:
            grid.take(ordered[begin:inside] - firsts[shard], 0, scratch[begin:inside], "clip")
            for row in range(inside, end):  # (windows crossing into the next shard)
                across(scratch[row], listed[row] * self.length, shard, self.length)
        scratch.take(order.argsort(), 0, out, "clip")
        return made

    def _planned(self, numbers: np.ndarray) -> BlockPlan | None:
        """A plan of the block ``numbers`` is a slice of (kept as the grid's plan), or None
        where it is not one (see :meth:`BlockPlan.of`)."""
        plan = BlockPlan.of(numbers, self)
        if plan is not None:
            self._plan = plan
        return plan

    def bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(firsts, ends, keyed)`` as int64 arrays, made once (a plan of each block uses
        them). ``keyed`` interleaves them (``firsts[1], ends[1], firsts[2], ...`` after
        ``ends[0]``) where that is in order, so that the count of its values up to a window
        number is the window's key (``2 * shard``, plus 1 where it crosses into a later
        shard); None where a shard shorter than the windows breaks the order."""
        arrays = self._arrays
        if arrays is None:
            firsts = np.asarray(self._firsts, dtype=np.int64)
            ends = np.asarray(self._ends, dtype=np.int64)
            keyed: np.ndarray | None = np.empty(2 * len(ends) - 1, dtype=np.int64)
            assert keyed is not None
            keyed[0::2] = ends
            keyed[1::2] = firsts[1 : len(ends)]
            if len(keyed) > 1 and bool((keyed[1:] < keyed[:-1]).any()):
                keyed = None
            arrays = self._arrays = (firsts, ends, keyed)
        return arrays

    def _unit_row(
        self,
        plan: BlockPlan,
        row: int,
        make: Callable[[tuple[int, ...]], np.ndarray],
        across: Callable[[np.ndarray, int, int, int], Any],
    ) -> np.ndarray | None:
        """Batch ``row`` of ``plan`` as its row of its unit's array, the unit gathered now
        where this is the first of its batches asked for (one thread at a time: the others
        asking for its batches wait for it); None where the unit could not be gathered or
        this batch was handed out before (then the general gather reads it)."""
        key = (plan, row // plan.per)
        with self._lock:
            units = self._units
            rows = units.get(key, _NOT_YET)
            if rows is _NOT_YET:
                rows = units[key] = self._unit_rows(plan, key[1], make, across)
                if len(units) > _UNITS_KEPT:
                    del units[next(iter(units))]  # (the unit made longest ago)
            return None if rows is None else rows.pop(row, None)

    def _unit_rows(
        self,
        plan: BlockPlan,
        unit: int,
        make: Callable[[tuple[int, ...]], np.ndarray],
        across: Callable[[np.ndarray, int, int, int], Any],
    ) -> dict[int, np.ndarray] | None:
        """Unit ``unit`` of ``plan`` gathered, as ``row -> its batch``; None where it cannot
        be: a shard it touches is not mapped, or failed its first touch (a batch of the unit
        touching it then names the error in its own read, and only that batch)."""
        try:
            out = self._gather_unit(plan, unit, make, across)
        except Exception:
            return None
        if out is None:
            return None
        first = unit * plan.per
        return {first + index: batch for index, batch in enumerate(out)}

    def _gather_unit(
        self,
        plan: BlockPlan,
        unit: int,
        make: Callable[[tuple[int, ...]], np.ndarray],
        across: Callable[[np.ndarray, int, int, int], Any],
    ) -> np.ndarray | None:
        """The batches of unit ``unit`` of ``plan`` into one ``(batches, count, L)`` array
        from ``make``: its runs, sorted by shard across them; None where a shard it touches
        is not mapped."""
        low, high = plan.unit_at[unit], plan.unit_at[unit + 1]
        keys, begins, ends = plan.keys, plan.begins, plan.ends
        length, count = self.length, plan.batches.shape[1]
        start = unit * plan.per * count
        stop = min(start + plan.per * count, plan.local.size)
        local, inverse = plan.local[start:stop], plan.inverse[start:stop]
        grids = []
        for run in range(low, high):
            grid = self._grid(keys[run] >> 1)
            if grid is None:
                return None
            grids.append(grid)
        out = make(((stop - start) // count, count, length))
        flat = out.view(self.dtype).reshape(stop - start, length)
        if high - low == 1 and not keys[low] & 1:
            # one shard, no window crossing out of it: straight into out, in the batches' order
            grids[0].take(local.take(inverse), 0, flat, "clip")
            return out
        scratch = make((stop - start, length)).view(self.dtype)
        for grid, run in zip(grids, range(low, high)):
            key, begin, end = keys[run], begins[run], ends[run]
            if not key & 1:
                grid.take(local[begin:end], 0, scratch[begin:end], "clip")
                continue
            shard = key >> 1
            first = int(self._firsts[shard])
            for place in range(begin, end):  # (windows crossing into a later shard)
                across(scratch[place], (int(local[place]) + first) * length, shard, length)
        scratch.take(inverse, 0, flat, "clip")
        return out


class BlockPlan:
    """Every batch of a read-only block of window numbers, sorted by shard at once.

    The batches are the block's consecutive slices of ``count`` numbers from ``phase``
    (``batches``, row ``r`` batch ``r``), in *units* of ``per`` consecutive batches (the
    last one maybe fewer). Each unit is sorted by shard (and within a shard, windows inside
    it before those crossing into a later one, each in the batches' order): ``local`` holds
    each sorted window's row in its shard's grid, ``inverse`` where each window of the
    unit's batches, in their order, lies among the sorted ones (both flat, unit ``u`` at
    ``u * per * count`` on). Its runs of one shard are ``keys`` (``2 * shard +
    crossing``), ``begins`` and ``ends`` (from the unit's start), those of unit ``u`` at
    ``unit_at[u]:unit_at[u + 1]`` (Python lists: the gather loops over them). A block whose
    numbers are not all windows of the stream gets no plan (the general gather names what
    is wrong).
    """

    #: Blocks larger than this are not planned (a shuffle stage's block is 8,192 ids; a
    #: plan holds about 30 bytes per id).
    MOST = 1 << 17

    __slots__ = (
        "_firsts",
        "base",
        "batches",
        "begins",
        "ends",
        "inverse",
        "keys",
        "local",
        "per",
        "unit_at",
    )

    def __init__(
        self, base: np.ndarray, phase: int, count: int, grid: WindowGrid, per: int = 1
    ) -> None:
        rows = (len(base) - phase) // count
        numbers = base.view(np.int64)[phase : phase + rows * count].reshape(rows, count)
        firsts, ends, keyed = grid.bounds()
        # key 2k: inside shard k; 2k + 1: starts in k and crosses into a later one
        if keyed is not None and len(keyed) <= _COMPARED_BOUNDS:
            # (a few shards: a compare per bound costs less than a binary search per id)
            keys = np.zeros(numbers.shape, dtype=np.int64)
            for bound in keyed.tolist():
                keys += numbers >= bound
        elif keyed is not None:
            keys = np.searchsorted(keyed, numbers, side="right")
        else:
            keys = (np.searchsorted(firsts[: len(ends)], numbers, side="right") - 1) * 2
            keys += numbers >= ends[keys >> 1]
        # one stable sort of the whole block by (unit, key): a radix sort where that fits
        # 16 bits (4x faster than of int64), and its flat order sorts each unit by shard
        span, units, size = 2 * len(ends), -(-rows // per), per * count
        wide = units * span > _NARROW_RANKS
        ranked = keys + (np.arange(rows, dtype=np.int64) // per * span)[:, None]
        ranked = ranked.ravel() if wide else ranked.astype(np.int16).ravel()
        flat = np.argsort(ranked, kind="stable")
        self.base, self.per = base, per
        self.batches = numbers.copy()  # (as planned: the block's owner may be written since)
        self.local = (numbers - firsts[keys >> 1]).ravel().take(flat)
        self.inverse = np.empty(rows * count, dtype=np.int64)
        self.inverse.put(flat, np.arange(rows * count, dtype=np.int64) % size)
        #: the first number of each batch -> its row (a block's numbers are distinct)
        self._firsts = dict(zip(numbers[:, 0].tolist(), range(rows)))
        # the runs: where the sorted rank changes (a unit's first included: its rank differs
        # from the unit before's), each ending where the next begins (a unit's last, at its end)
        ranked = ranked.take(flat)
        edges = np.empty(len(ranked), dtype=bool)
        edges[0] = True
        np.not_equal(ranked[1:], ranked[:-1], out=edges[1:])
        at = np.flatnonzero(edges)
        at_units = at // size
        run_ends = np.empty_like(at)
        run_ends[:-1] = at[1:]
        run_ends[-1] = len(ranked)
        origin = at_units * size
        self.keys = (ranked[at] - at_units * span).tolist()
        self.begins = (at - origin).tolist()
        self.ends = (run_ends - origin).tolist()
        self.unit_at = np.searchsorted(at_units, np.arange(units + 1)).tolist()

    @classmethod
    def of(cls, numbers: np.ndarray, grid: WindowGrid) -> BlockPlan | None:
        """The plan of the block ``numbers`` is a read-only slice of: a 1-D array of 8-byte
        integers (its owner, an int64 view of which the slice is) of at most :data:`MOST`
        numbers, all windows of ``grid``, holding at least two batches; else None. (Each
        batch is compared with its row anyway: a block changed since is never trusted.)
        Its units hold as many batches as fit ``_UNIT_BYTES`` (at most ``_UNIT_BATCHES``)."""
        owner = numbers.base
        count = len(numbers)
        if (
            type(owner) is not np.ndarray
            or numbers.flags.writeable  # (a shuffle stage hands its blocks out read-only)
            or owner.ndim != 1
            or owner.dtype.kind not in "iu"
            or owner.dtype.itemsize != 8
            or not 2 * count <= len(owner) <= cls.MOST
            or numbers.dtype != np.int64
            or not numbers.flags.c_contiguous
        ):
            return None
        base = owner.view(np.int64)
        at = np.flatnonzero(base == numbers[0])
        if len(at) != 1:
            return None
        start = int(at[0])
        if start + count > len(base) or base[start : start + count].tobytes() != numbers.tobytes():
            return None
        low, high = int(base.min()), int(base.max())
        if low < 0 or high >= grid.windows:
            return None
        per = _UNIT_BYTES // (count * grid.length * grid.dtype.itemsize)
        return cls(owner, start % count, count, grid, max(1, min(per, _UNIT_BATCHES)))

    def row_of(self, numbers: np.ndarray) -> int:
        """The row of the batch ``numbers``, or -1 where it is not one of the plan's."""
        row = self._firsts.get(int(numbers[0]), -1)
        if row < 0 or len(numbers) != self.batches.shape[1]:
            return -1
        # (a byte compare: ~0.2 us for a batch of 64 ids)
        return row if self.batches[row].tobytes() == numbers.tobytes() else -1
