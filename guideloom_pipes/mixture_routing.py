"""The routing of a :class:`~guideloom_pipes.mixture.MixtureDataset` by *pieces*: position ->
``(component, draw)`` when the weights change with the position (a
:class:`~guideloom_pipes.mixture_weights.WeightSchedule`, or a resume with other weights).

A piece is a Huffman schedule (:class:`~guideloom_pipes.mixture_schedule._Schedule`) over
integer weights, from its start on, with each component's count of the positions before its
start: position ``x`` of the piece starting at ``s`` is the schedule's position ``x - s``,
and its draw is the component's count at ``s`` plus the schedule's draw. Plain weights are
one piece from 0 (exactly the fixed-weight schedule).

**The cuts.** Each part (a schedule from a position on) is cut into intervals: one per step
phase (between two points), ``K`` of equal length per linear ramp (``K`` = the ramp's length
up to 64 and ``sqrt(length / 8)`` beyond, at most 16,384), and the last phase, open-ended.
At the end ``e`` of each closed interval the components' counts are apportioned from the
integrated target ``T_c(e)`` (exact rationals): ``floor(T_c(e))`` or one more, by largest
remainder, and never fewer than at the interval's start, so they never decrease and stay
within 1 of the target; the interval's piece routes its integer quotas (the differences)
evenly. An interval longer than ``2**30`` positions (the schedule's integer arithmetic) is a
piece over the phase's own integer weights for whole periods, then a piece of quotas.
Memory: a few ints per piece and component, bounded by the schedule, never by its length.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from math import gcd, isqrt
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.mixture_schedule import _integer_weights, _Schedule
from guideloom_pipes.mixture_weights import Part

_I64 = npt.NDArray[np.int64]
#: Positions a piece of quotas holds at most (its integer weights sum to its length).
_QUOTA_LIMIT = 1 << 30
#: Intervals a linear ramp is cut into: its length up to the first, ``sqrt(length / 8)``
#: beyond (the curvature then moves a count by at most the ramp's change of proportion),
#: at most the second.
_RAMP_MIN, _RAMP_MAX = 64, 16384
#: Pieces whose routing is kept built (least recently used go first), and the length up
#: to which a piece keeps a table of its positions (4 bytes each) rather than its schedule.
_KEPT, _TABLE_LIMIT = 256, 4096


def apportion(
    previous: list[int], numerators: list[int], denominator: int, seats: int
) -> list[int]:
    """Counts summing to ``seats``, each at least ``previous`` and, wherever that allows,
    ``floor`` or ``ceil`` of its target ``numerators[c] / denominator`` (largest remainders
    first, ties to the lower index)."""
    low = [max(p, n // denominator) for p, n in zip(previous, numerators)]
    if sum(low) > seats:  # (the earlier counts stand too far above the targets)
        low = list(previous)
    left = seats - sum(low)
    deficit = [n - c * denominator for n, c in zip(numerators, low)]
    if left < len(low):
        for c in sorted(range(len(low)), key=lambda c: (-deficit[c], c))[:left]:
            low[c] += 1
        return low
    return _fill(low, deficit, denominator, left)


def _fill(low: list[int], deficit: list[int], denominator: int, left: int) -> list[int]:
    """``left`` seats to the largest deficits: ``ceil((deficit - t) / denominator)`` each
    (at least 0) for the least threshold ``t`` that gives out at most ``left``, the rest
    to those one short of it, by index."""

    def given(t: int) -> list[int]:
        return [max(0, -((t - d) // denominator)) for d in deficit]

    lo, hi = min(deficit) - (left + 1) * denominator, max(deficit)
    while lo < hi:  # the least t with sum(given(t)) <= left
        t = (lo + hi) // 2
        if sum(given(t)) <= left:
            hi = t
        else:
            lo = t + 1
    out, more = given(lo), given(lo - 1)
    left -= sum(out)
    for c in range(len(out)):
        if left and more[c] > out[c]:
            out[c] += 1
            left -= 1
    return [a + b for a, b in zip(low, out)]


class _Phase:
    """The integrated targets over one phase of a part (from ``x0``, where they are
    ``anchor / anchor_den``), as integer numerators over one ``denominator``."""

    def __init__(self, part: Part, i: int, x0: int, anchor: list[int], anchor_den: int) -> None:
        (self.p, self.a), (self.q, self.b) = part.points[i], part.points[i + 1]
        self.linear, self.x0 = part.linear, x0
        self.da, self.db, self.length = sum(self.a), sum(self.b), self.q - self.p
        self.scale = 2 * self.length * self.da * self.db if self.linear else self.da
        self.anchor = [n * self.scale for n in anchor]
        self.anchor_den = anchor_den
        self.denominator = anchor_den * self.scale

    def numerators(self, y: int) -> list[int]:
        """``T_c(y) * denominator`` for each component."""
        u, den = y - self.x0, self.anchor_den
        if not self.linear:
            return [n + u * w * den for n, w in zip(self.anchor, self.a)]
        squares = (y - self.p) ** 2 - (self.x0 - self.p) ** 2
        ramp, da, db = 2 * self.length * u * self.db, self.da, self.db
        return [
            n + (ramp * a + (b * da - a * db) * squares) * den
            for n, a, b in zip(self.anchor, self.a, self.b)
        ]

    def cuts(self) -> Iterator[tuple[int, int]]:
        """The intervals ``[s, e)`` of this phase from ``x0``."""
        if not self.linear:
            yield self.x0, self.q
            return
        n = self.length
        k = min(n, max(_RAMP_MIN, isqrt(n // 8) + 1), _RAMP_MAX)
        for j in range(k):
            end = self.p + (j + 1) * n // k
            if end > self.x0:
                yield max(self.x0, self.p + j * n // k), end

    def weights(self, s: int, e: int) -> list[int]:
        """Integer weights for whole periods of ``[s, e)``: the phase's own for a step, the
        interval's mean proportions for a ramp."""
        if not self.linear:
            return list(self.a)
        before, after = self.numerators(s), self.numerators(e)
        return _integer_weights(
            [(y - x) / self.denominator / (e - s) for x, y in zip(before, after)]
        )


class _Pieces:
    """The pieces being built: starts, counts at the starts, integer weights."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.bases: list[list[int]] = []
        self.weights: list[list[int]] = []

    def add(self, start: int, base: Sequence[int], weights: Sequence[int]) -> None:
        self.starts.append(start)
        self.bases.append(list(base))
        self.weights.append(list(weights))

    def counts_at(self, position: int) -> list[int]:
        """Each component's count of the positions before ``position`` (exact), after
        dropping the pieces that start at or after it."""
        while self.starts[-1] >= position:
            self.starts.pop(), self.bases.pop(), self.weights.pop()
        return _piece_counts(self.bases[-1], self.weights[-1], position - self.starts[-1])

    def part(self, part: Part, counts: list[int], end: int | None) -> None:
        """Add the pieces of ``part`` from its start (``counts`` there) until one would
        start at or after ``end`` (None: to the open-ended last phase)."""
        points, x = part.points, part.start
        i = max(k for k, point in enumerate(points) if point[0] <= x)
        anchor, anchor_den = list(counts), 1
        while end is None or x < end:
            if i + 1 == len(points):
                self.add(x, counts, points[i][1])
                return
            phase = _Phase(part, i, x, anchor, anchor_den)
            for s, e in phase.cuts():
                if end is not None and s >= end:
                    return
                counts = self._interval(phase, s, e, counts)
            anchor, anchor_den = _reduced(phase.numerators(phase.q), phase.denominator)
            x, i = phase.q, i + 1

    def _interval(self, phase: _Phase, s: int, e: int, counts: list[int]) -> list[int]:
        """The pieces of ``[s, e)``; the counts at ``e``."""
        if e - s > _QUOTA_LIMIT:
            weights = phase.weights(s, e)
            periods = (e - s) // sum(weights)
            self.add(s, counts, weights)
            counts = [c + periods * w for c, w in zip(counts, weights)]
            s += periods * sum(weights)
            if s == e:
                return counts
        new = apportion(counts, phase.numerators(e), phase.denominator, e)
        self.add(s, counts, [n - c for n, c in zip(new, counts)])
        return new


def _reduced(numerators: list[int], denominator: int) -> tuple[list[int], int]:
    common = gcd(denominator, *numerators)
    return [n // common for n in numerators], denominator // common


def _piece_counts(base: Sequence[int], weights: Sequence[int], m: int) -> list[int]:
    """A piece's counts after ``m`` of its positions."""
    index = [c for c, w in enumerate(weights) if w > 0]
    counts = _Schedule([weights[c] for c in index]).prefix_counts(m)
    out = list(base)
    for c, count in zip(index, counts):
        out[c] += count
    return out


class _PieceRoute:
    """How one piece routes its positions: by a table (component, draw) of its positions
    when it holds at most ``_TABLE_LIMIT`` of them, else by its schedule."""

    def __init__(self, start: int, base: _I64, weights: _I64, length: int | None) -> None:
        self.start, self.base = start, base
        index = np.flatnonzero(weights > 0)
        schedule = _Schedule(weights[index].tolist())
        self.schedule: _Schedule | None = schedule
        self.index = index
        if length is not None and length <= _TABLE_LIMIT and len(weights) < 1 << 15:
            component, draw = schedule.route(np.arange(length, dtype=np.int64))
            self.components = index[component].astype(np.int16)
            self.draws = draw.astype(np.int16)
            self.schedule = None

    def route(self, positions: _I64) -> tuple[_I64, _I64]:
        """``(component, draw)`` of positions of this piece."""
        m = positions - self.start
        if self.schedule is None:
            component = self.components[m].astype(np.int64)
            return component, self.draws[m] + self.base[component]
        component, draw = self.schedule.route(m)
        component = self.index[component]
        return component, draw + self.base[component]


class Routing:
    """Position -> ``(component, draw)`` over pieces (see the module docstring), vectorised;
    thread-safe. Built from the parts of a mixture (``Routing.of``)."""

    def __init__(self, starts: list[int], bases: list[list[int]], weights: list[list[int]]) -> None:
        count = len(bases[0])
        self.starts = np.array(starts, dtype=np.int64)
        self.bases = np.array(bases, dtype=np.int64).reshape(-1, count)
        self.weights = np.array(weights, dtype=np.int64).reshape(-1, count)
        positive = self.weights > 0
        #: per piece: its only component with a weight, else -1 (routed without a schedule)
        self.single = np.where(positive.sum(axis=1) == 1, positive.argmax(axis=1), -1)
        plain = len(starts) == 1 and bool(positive.all()) and not self.bases.any()
        #: the fixed-weight schedule, when this routing is one (the same function, as fast)
        self.plain = _Schedule(weights[0]) if plain else None
        self._starts: list[int] = list(starts)
        self._ends: list[float] = [*starts[1:], float("inf")]
        self._kept: OrderedDict[int, _PieceRoute] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, parts: Sequence[Part], count: int) -> Routing:
        """The routing of ``parts`` (each from its start to the next's) of ``count``
        components."""
        pieces = _Pieces()
        counts = [0] * count
        for k, part in enumerate(parts):
            if k:
                counts = pieces.counts_at(part.start)
            pieces.part(part, counts, parts[k + 1].start if k + 1 < len(parts) else None)
        return cls(pieces.starts, pieces.bases, pieces.weights)

    def __len__(self) -> int:
        return len(self.starts)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_kept"], state["_lock"] = OrderedDict(), None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _piece(self, piece: int) -> _PieceRoute:
        """How a piece routes (built on first use; the last ``_KEPT`` used are kept)."""
        with self._lock:
            found = self._kept.get(piece)
            if found is None:
                end = int(self.starts[piece + 1]) if piece + 1 < len(self.starts) else None
                start = int(self.starts[piece])
                found = _PieceRoute(
                    start,
                    self.bases[piece],
                    self.weights[piece],
                    None if end is None else end - start,
                )
                self._kept[piece] = found
                if len(self._kept) > _KEPT:
                    self._kept.popitem(last=False)
            else:
                self._kept.move_to_end(piece)
            return found

    def _route_piece(self, piece: int, positions: _I64) -> tuple[_I64, _I64]:
        return self._piece(piece).route(positions)

    def route(self, positions: _I64) -> tuple[_I64, _I64]:
        """``(component, draw)`` of each position (int64 arrays >= 0)."""
        if self.plain is not None:
            return self.plain.route(positions)
        if len(self.starts) == 1 or not len(positions):
            return self._route_piece(0, positions)
        first = bisect_right(self._starts, int(positions.min())) - 1
        if int(positions.max()) < self._ends[first]:  # (a batch in order: mostly one piece)
            return self._route_piece(first, positions)
        piece = np.searchsorted(self.starts, positions, side="right") - 1
        component, draw = np.empty_like(positions), np.empty_like(positions)
        single = self.single[piece]
        one = single >= 0
        if one.any():
            at, c = piece[one], single[one]
            component[one] = c
            draw[one] = self.bases[at, c] + positions[one] - self.starts[at]
        rest = np.flatnonzero(~one)
        if len(rest):
            rest = rest[np.argsort(piece[rest], kind="stable")]
            for group in np.split(rest, np.flatnonzero(np.diff(piece[rest])) + 1):
                component[group], draw[group] = self._route_piece(
                    int(piece[group[0]]), positions[group]
                )
        return component, draw

    def prefix_counts(self, k: int) -> list[int]:
        """How many of the first ``k`` positions go to each component (exact ints)."""
        if self.plain is not None:
            return self.plain.prefix_counts(k)
        piece = bisect_right(self._starts, k) - 1
        return _piece_counts(
            self.bases[piece].tolist(), self.weights[piece].tolist(), k - int(self.starts[piece])
        )
