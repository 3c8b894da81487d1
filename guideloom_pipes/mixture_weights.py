"""Mixture weights that change with the position: :class:`WeightSchedule`, and the *parts* a
mixture routes by: a part is a schedule that applies from a position on (the first from 0;
a resume with other weights adds one), so a resumed run keeps the history it was read with.

The history is what a loader's state records (``history_state``) and what
:meth:`~guideloom_pipes.mixture.MixtureDataset.resume_history` takes back
(``parts_of_state``): a JSON-friendly list of dicts, one per part,
``{"from": position, "interpolation": "step" | "linear", "points": [[position, {name:
integer weight}], ...]}``. Each weight is the realised integer ``W_c`` of its point
(:func:`~guideloom_pipes.mixture_schedule._integer_weights`), so the proportions ``W_c /
sum(W)`` are exact and the routing rebuilt from them is the one that was read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.mixture_schedule import _integer_weights

__all__ = ["WeightSchedule"]

#: How weights go from one point of a schedule to the next.
INTERPOLATIONS = ("step", "linear")
#: ``(position, realised integer weights)``: a point of a part.
Point = tuple[int, tuple[int, ...]]


class WeightSchedule:
    """Mixture weights that change with the position: ``[(position, weights), ...]``.

    ``MixtureDataset(components, WeightSchedule([(0, {"web": 0.8, "code": 0.2}), (90_000,
    {"web": 0.5, "code": 0.5})]), seed=..., num_samples=100_000)`` reads 80/20 up to position
    90,000 and 50/50 from there. Positions are the mixture's (a step is ``position //
    global_batch_size``); a loader reading a schedule must not shuffle (``shuffle=False``):
    each component's own passes are shuffled already (``docs/mixtures.md``).

    Args:
        points: ``(position, weights)`` pairs: the first at position 0, positions strictly
            increasing ints, each ``weights`` a mapping name -> weight with exactly the
            mixture's component names, each finite and >= 0, not all 0 (a component with
            weight 0 gets no position in that phase).
        interpolation: ``"step"``: a point's weights hold until the next point.
            ``"linear"``: the normalised proportions go linearly from one point's to the
            next's (the last point's hold from there on).
    """

    def __init__(
        self,
        points: Sequence[tuple[int, Mapping[str, float]]],
        interpolation: str = "step",
    ) -> None:
        if interpolation not in INTERPOLATIONS:
            raise ValueError(
                f"interpolation must be one of {list(INTERPOLATIONS)}, got {interpolation!r}"
            )
        if isinstance(points, (str, bytes, Mapping)) or not isinstance(points, Sequence):
            raise TypeError(
                "points must be a list of (position, weights) pairs, e.g. [(0, {'web': 0.8, "
                f"'code': 0.2}}), (9000, {{'web': 0.5, 'code': 0.5}})], got {points!r}"
            )
        if not points:
            raise ValueError("points must hold at least one (position, weights) pair, at 0")
        checked: list[tuple[int, dict[str, float]]] = []
        for k, pair in enumerate(points):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"point {k} must be a (position, weights) pair, got {pair!r}")
            position = check_int(f"position of point {k}", pair[0], minimum=0)
            if not isinstance(pair[1], Mapping):
                raise TypeError(
                    f"weights of point {k} (position {position}) must be a mapping name -> "
                    f"weight, got {pair[1]!r}"
                )
            if k == 0 and position != 0:
                raise ValueError(
                    f"the first point must be at position 0 (the weights from the start), got "
                    f"{position}; add a point (0, weights) first"
                )
            if checked and position <= checked[-1][0]:
                raise ValueError(
                    f"positions must increase strictly: point {k} is at {position}, after a "
                    f"point at {checked[-1][0]}"
                )
            checked.append((position, dict(pair[1])))
        #: the ``(position, weights)`` points as given (weights as dicts)
        self.points: tuple[tuple[int, dict[str, float]], ...] = tuple(checked)
        #: ``"step"`` or ``"linear"``
        self.interpolation = interpolation

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WeightSchedule):
            return NotImplemented
        return self.points == other.points and self.interpolation == other.interpolation

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        points = ", ".join(f"({p}, {w!r})" for p, w in self.points)
        return f"WeightSchedule([{points}], interpolation={self.interpolation!r})"


def check_weights(
    names: list[str], weights: Any, *, zero_ok: bool = False, where: str = ""
) -> list[float]:
    """``weights`` (a mapping with exactly ``names``) as floats in the names' order, each
    finite and > 0 (>= 0 with ``zero_ok``, not all 0); ``where`` prefixes the messages."""
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"weights must be a mapping name -> weight with the components' names {names} "
            f"(or a WeightSchedule), got {type(weights).__name__}"
        )
    missing = [name for name in names if name not in weights]
    extra = [name for name in weights if name not in names]
    if missing or extra:
        parts = [f"missing {missing}" if missing else "", f"unknown {extra}" if extra else ""]
        raise ValueError(
            f"{where}weights must have exactly the components' names {names}: "
            + "; ".join(part for part in parts if part)
        )
    bound = ">= 0" if zero_ok else "> 0"
    out = []
    for name in names:
        value = weights[name]
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"{where}weight of {name!r} must be a number {bound}, got {value!r}")
        value = float(value)
        if not (math.isfinite(value) and (value > 0 or (zero_ok and value == 0))):
            fix = "" if zero_ok else "; drop the component instead of giving it weight 0"
            raise ValueError(
                f"{where}weight of {name!r} must be finite and {bound}, got {value!r}{fix}"
            )
        out.append(value)
    if not any(out):
        raise ValueError(f"{where}weights are all 0: give at least one component a weight > 0")
    return out


def realise(names: list[str], given: list[float], where: str = "") -> tuple[int, ...]:
    """The integer weights of ``given`` (see ``_integer_weights``); a weight > 0 too small to
    get a share is a ``ValueError``."""
    integers = _integer_weights(given)
    tiny = [c for c, w in enumerate(integers) if w == 0 and given[c] > 0]
    if tiny:
        c = tiny[0]
        raise ValueError(
            f"{where}weight of {names[c]!r} is below 2**-30 of the total ({given[c]!r} of "
            f"{sum(given)!r}): the schedule cannot give it a share; raise it or drop the "
            f"component"
        )
    return tuple(integers)


@dataclass(frozen=True)
class Part:
    """A schedule applying from ``start`` on: its points (realised), step or linear."""

    start: int
    points: tuple[Point, ...]
    linear: bool

    def relevant(self, end: int) -> tuple[Point, ...]:
        """The points that fix this part's routing before ``end``: those before it and the
        first at or after it (a phase's end fixes how the phase is read)."""
        before = tuple(point for point in self.points if point[0] < end)
        after = [point for point in self.points if point[0] >= end][:1]
        return before + tuple(after)

    def proportions_at(self, position: int) -> list[Fraction]:
        """The normalised weights in force at ``position`` (interpolated when linear)."""
        k = max(i for i, point in enumerate(self.points) if point[0] <= position)
        here = _proportions(self.points[k][1])
        if not self.linear or k + 1 == len(self.points):
            return here
        (p, _), (q, after) = self.points[k], self.points[k + 1]
        share = Fraction(position - p, q - p)
        return [a + (b - a) * share for a, b in zip(here, _proportions(after))]


def _proportions(weights: tuple[int, ...]) -> list[Fraction]:
    total = sum(weights)
    return [Fraction(w, total) for w in weights]


def part_of(names: list[str], weights: Any, start: int = 0) -> Part:
    """The part of a mixture's ``weights`` (a mapping or a :class:`WeightSchedule`) from
    ``start``, its weights checked against ``names``."""
    if not isinstance(weights, WeightSchedule):
        return Part(start, ((0, realise(names, check_weights(names, weights))),), False)
    points = []
    for position, given in weights.points:
        where = f"point at position {position}: "
        checked = check_weights(names, given, zero_ok=True, where=where)
        points.append((position, realise(names, checked, where)))
    return Part(start, tuple(points), weights.interpolation == "linear")


def history_state(parts: Sequence[Part], names: list[str], position: int) -> list[dict[str, Any]]:
    """The JSON-friendly history of ``parts`` up to ``position``: each part that starts
    before it, with the points that fix its routing there (``Part.relevant``)."""
    kept = [part for part in parts if part.start < position]
    out = []
    for k, part in enumerate(kept):
        end = kept[k + 1].start if k + 1 < len(kept) else position
        out.append(
            {
                "from": part.start,
                "interpolation": "linear" if part.linear else "step",
                "points": [[p, dict(zip(names, map(int, w)))] for p, w in part.relevant(end)],
            }
        )
    return out


def legacy_history(weights: Any) -> list[dict[str, Any]]:
    """The history of a state saved before the histories were (its ``"weights"``, the
    realised proportions, from position 0)."""
    if not isinstance(weights, Mapping):
        raise ValueError(f"a mixture state's weights must be a dict, got {weights!r}")
    names = list(weights)
    integers = _integer_weights(check_weights(names, weights))
    return [{"from": 0, "interpolation": "step", "points": [[0, dict(zip(names, integers))]]}]


def parts_of_state(history: Any, names: list[str]) -> list[Part]:
    """The parts of a saved history (``history_state``), checked: a ``ValueError`` names
    what is wrong with it."""
    if not isinstance(history, list):
        raise ValueError(
            f"a mixture history must be a list of parts (state_dict()), got {history!r}"
        )
    parts: list[Part] = []
    for k, entry in enumerate(history):
        what = f"mixture history part {k}"
        if not isinstance(entry, Mapping) or set(entry) != {"from", "interpolation", "points"}:
            raise ValueError(
                f"{what} must be a dict with 'from', 'interpolation' and 'points' "
                f"(state_dict()), got {entry!r}"
            )
        start = check_int(f"{what} 'from'", entry["from"], minimum=0)
        if parts and start <= parts[-1].start:
            raise ValueError(
                f"{what} starts at {start}, not after the part before ({parts[-1].start})"
            )
        if entry["interpolation"] not in INTERPOLATIONS or not entry["points"]:
            raise ValueError(f"{what} has interpolation {entry['interpolation']!r} or no points")
        points: list[Point] = []
        for pair in entry["points"]:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"{what}: a point must be [position, weights], got {pair!r}")
            position = check_int(f"{what}: a point's position", pair[0], minimum=0)
            weights = pair[1]
            if not isinstance(weights, Mapping) or set(weights) != set(names):
                raise ValueError(
                    f"{what}: the point at {position} has weights {weights!r}, not integer "
                    f"weights of the components {names}"
                )
            ints = tuple(check_int(f"{what}: a weight", weights[n], minimum=0) for n in names)
            if not 0 < sum(ints) <= 1 << 30 or (points and position <= points[-1][0]):
                raise ValueError(
                    f"{what}: the point at {position} is out of order, or its weights "
                    f"{weights!r} sum to 0 or past 2**30"
                )
            points.append((position, ints))
        if points[0][0] > start or (not parts and start):
            raise ValueError(
                f"{what}: no point at or before its start {start} (the first part starts at 0)"
            )
        parts.append(Part(start, tuple(points), entry["interpolation"] == "linear"))
    return parts


def resumed_parts(
    saved: list[Part], given: Part, is_schedule: bool, position: int, names: list[str]
) -> list[Part]:
    """The parts of a run resumed at ``position`` with the ``given`` weights: the ``saved``
    history up to there, then ``given`` from there (one part on, unless it reads the same
    up to ``position`` as the last part, which then goes on unchanged).

    A given :class:`WeightSchedule` must agree with the history before ``position``
    (``ValueError`` naming the first point that differs); a plain mapping applies from
    ``position`` whatever came before."""
    saved = [part for part in saved if part.start < position]
    if not saved:
        return [given]
    if is_schedule:
        _check_agreement(saved, given, position, names)
    last = saved[-1]
    if last.relevant(position) == given.relevant(position) and (
        last.linear == given.linear or len(given.relevant(position)) == 1
    ):
        return [*saved[:-1], Part(last.start, given.points, given.linear)]
    return [*saved, Part(position, given.points, given.linear)]


def flat_history(parts: Sequence[Part], position: int) -> list[tuple[int, list[Fraction], bool]]:
    """The history before ``position`` as points ``(position, proportions, linear)``: each
    part's points in its range, and one where a part starts with other weights."""
    out: list[tuple[int, list[Fraction], bool]] = []
    for k, part in enumerate(parts):
        end = parts[k + 1].start if k + 1 < len(parts) else position
        inside = [
            (p, _proportions(w), part.linear)
            for p, w in part.points
            if (k == 0 or p >= part.start) and p < end
        ]
        if k and not (inside and inside[0][0] == part.start):
            here = part.proportions_at(part.start)
            if (here, part.linear) != (out[-1][1], out[-1][2]):
                out.append((part.start, here, part.linear))
        out += inside
    return out


def _check_agreement(saved: list[Part], given: Part, position: int, names: list[str]) -> None:
    history = flat_history(saved, position)
    mine = [(p, _proportions(w), given.linear) for p, w in given.points if p < position]
    for k in range(max(len(history), len(mine))):
        theirs = history[k] if k < len(history) else None
        ours = mine[k] if k < len(mine) else None
        # the interpolation matters between two points of the history only
        same = (
            theirs is not None
            and ours is not None
            and theirs[:2] == ours[:2]
            and (theirs[2] == ours[2] or k + 1 >= len(history))
        )
        if same:
            continue
        shown = f"point {k} ({_shown(ours, names)})" if ours else f"no point {k}"
        expected = f"({_shown(theirs, names)})" if theirs else "none"
        raise ValueError(
            f"the WeightSchedule's {shown} differs from the run's history before position "
            f"{position}, whose point {k} is {expected}: the positions before {position} were "
            f"read with the history's weights. Give a schedule whose points before {position} "
            f"are the history's, or plain weights (a mapping), which apply from {position} on "
            f"(docs/mixtures.md, 'Changing the weights at a restart')"
        )


def _shown(point: tuple[int, list[Fraction], bool], names: list[str]) -> str:
    position, proportions, linear = point
    weights = {name: round(float(q), 6) for name, q in zip(names, proportions)}
    return f"position {position}, weights {weights}, {'linear' if linear else 'step'}"
