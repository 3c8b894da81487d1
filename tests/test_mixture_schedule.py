"""Weight schedules of a MixtureDataset (``WeightSchedule``): every prefix near its integrated
weights, routing a pure function of the position, fixed weights unchanged, the refusals of bad
schedules, and ``resume_history`` (the weights before a position kept, others after it)
(torch-free)."""

from __future__ import annotations

import json
import pickle
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom
from guideloom_pipes import MixtureDataset, WeightSchedule
from guideloom_pipes.mixture_routing import apportion
from guideloom_pipes.mixture_schedule import _integer_weights, _Schedule


def _components(count: int, length: int = 23) -> dict[str, np.ndarray]:
    return {f"c{c}": np.arange(length) + 1000 * c for c in range(count)}


@st.composite
def schedules(draw: Any, max_samples: int = 3000) -> tuple[int, list[tuple[int, dict]], str, int]:
    """(components, points with integer weights, interpolation, num_samples)."""
    count = draw(st.integers(1, 9))
    phases = draw(st.integers(1, 5))
    num_samples = draw(st.integers(phases + 1, max_samples))
    positions = sorted(
        draw(st.sets(st.integers(1, num_samples - 1), min_size=phases - 1, max_size=phases - 1))
    )
    points = []
    for position in [0, *positions]:
        weights = draw(st.lists(st.integers(0, 9), min_size=count, max_size=count))
        if not any(weights):
            weights[draw(st.integers(0, count - 1))] = draw(st.integers(1, 9))
        points.append((position, {f"c{c}": w for c, w in enumerate(weights)}))
    interpolation = draw(st.sampled_from(["step", "linear"]))
    return count, points, interpolation, num_samples


def _integrated(points: list[tuple[int, dict]], linear: bool, n: int) -> np.ndarray:
    """The integrated normalised weights at every prefix ``0 .. n`` (float64, exact enough)."""
    k = np.arange(n + 1, dtype=np.float64)[:, None]
    shares = [np.array(list(w.values()), dtype=np.float64) for _, w in points]
    shares = [q / q.sum() for q in shares]
    starts = [p for p, _ in points] + [np.inf]
    out = np.zeros((n + 1, len(shares[0])))
    for i, q in enumerate(shares):
        a, b = starts[i], starts[i + 1]
        within = np.clip(k, a, min(b, n)) - a
        out += within * q
        if linear and i + 1 < len(points):
            out += (shares[i + 1] - q) * within**2 / (2 * (b - a))
    return out


def _prefix_counts(component: np.ndarray, count: int) -> np.ndarray:
    counts = np.zeros((len(component) + 1, count), dtype=np.int64)
    counts[np.arange(1, len(component) + 1), component] = 1
    return counts.cumsum(axis=0)


@settings(max_examples=60, deadline=None)
@given(case=schedules())
def test_every_prefix_is_within_two_plus_the_points_passed_of_the_integrated_weights(case):
    count, points, interpolation, n = case
    mixture = MixtureDataset(
        _components(count), WeightSchedule(points, interpolation), seed=1, num_samples=n
    )
    component, _ = mixture.locate(np.arange(n))
    counts = _prefix_counts(component, count)
    error = np.abs(counts - _integrated(points, interpolation == "linear", n))
    passed = np.searchsorted([p for p, _ in points], np.arange(n + 1), side="left")
    assert (error <= 2 + passed[:, None] + 1e-9).all(), error.max()
    assert (counts.sum(axis=1) == np.arange(n + 1)).all()
    assert counts[-1].tolist() == list(mixture.prefix_counts(n).values())


@settings(max_examples=40, deadline=None)
@given(case=schedules(), data=st.data())
def test_routing_any_set_of_positions_equals_routing_them_one_by_one(case, data):
    count, points, interpolation, n = case
    schedule = WeightSchedule(points, interpolation)
    mixture = MixtureDataset(_components(count), schedule, seed=3, num_samples=n)
    positions = np.array(
        data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=60)), dtype=np.int64
    )
    component, index = mixture.locate(positions)
    alone = [mixture.locate(int(p)) for p in positions]
    assert component.tolist() == [int(c) for c, _ in alone]
    assert index.tolist() == [int(i) for _, i in alone]
    # a pure function of (seed, schedule, position): another object, another process's copy
    again = pickle.loads(
        pickle.dumps(MixtureDataset(_components(count), schedule, seed=3, num_samples=n))
    )
    assert [a.tolist() for a in again.locate(positions)] == [component.tolist(), index.tolist()]
    # and each draw is the number of earlier positions of its component
    everything, _ = mixture.locate(np.arange(n))
    _, draws = mixture._routing.route(positions)
    counts = _prefix_counts(everything, count)
    assert draws.tolist() == counts[positions, component].tolist()


@settings(max_examples=30, deadline=None)
@given(
    weights=st.lists(st.floats(1e-3, 1e3, allow_nan=False), min_size=1, max_size=9),
    positions=st.lists(st.integers(0, 2**62), min_size=1, max_size=50),
)
def test_fixed_weights_route_exactly_as_the_fixed_schedule(weights, positions):
    names = [f"c{c}" for c in range(len(weights))]
    mixture = MixtureDataset(
        _components(len(weights)), dict(zip(names, weights)), seed=0, num_samples=2**63 - 1
    )
    schedule = _Schedule(_integer_weights(weights))
    ids = np.array(positions, dtype=np.int64)
    assert [a.tolist() for a in mixture._routing.route(ids)] == [
        a.tolist() for a in schedule.route(ids)
    ]
    one_point = MixtureDataset(
        _components(len(weights)),
        WeightSchedule([(0, dict(zip(names, weights)))]),
        seed=0,
        num_samples=2**63 - 1,
    )
    assert [a.tolist() for a in one_point.locate(ids)] == [a.tolist() for a in mixture.locate(ids)]
    assert mixture.schedule is None and one_point.prefix_bounds == {}


@settings(max_examples=200, deadline=None)
@given(data=st.data(), count=st.integers(1, 9), denominator=st.integers(1, 10**6))
def test_apportioned_counts_sum_to_the_seats_never_decrease_and_stay_within_one(
    data, count, denominator
):
    seats = data.draw(st.integers(0, 10**4))
    cuts = sorted(
        data.draw(
            st.lists(st.integers(0, seats * denominator), min_size=count - 1, max_size=count - 1)
        )
    )
    numerators = [b - a for a, b in zip([0, *cuts], [*cuts, seats * denominator])]
    previous = [data.draw(st.integers(0, seats)) for _ in range(count)]
    while sum(previous) > seats:
        previous[previous.index(max(previous))] -= 1
    counts = apportion(previous, numerators, denominator, seats)
    assert sum(counts) == seats
    assert all(c >= p for c, p in zip(counts, previous))
    floors = [n // denominator for n in numerators]
    ceilings = [-(-n // denominator) for n in numerators]
    # the usual case: the counts before within 1 of (older, so lower) targets, leaving room
    if all(p <= c for p, c in zip(previous, ceilings)) and (
        sum(max(p, f) for p, f in zip(previous, floors)) <= seats
    ):
        assert all(f <= c <= top for f, c, top in zip(floors, counts, ceilings))


def test_weight_schedule_is_exported_under_both_names():
    assert guideloom.WeightSchedule is WeightSchedule
    schedule = WeightSchedule([(0, {"a": 1})], interpolation="linear")
    assert schedule == WeightSchedule([[0, {"a": 1}]], "linear")
    assert "linear" in repr(schedule)


def test_a_step_schedule_changes_the_shares_at_its_points():
    schedule = WeightSchedule([(0, {"c0": 8, "c1": 2}), (500, {"c0": 1, "c1": 1})])
    mixture = MixtureDataset(_components(2, 400), schedule, seed=0, num_samples=1000)
    assert mixture.prefix_counts(500) == {"c0": 400, "c1": 100}
    assert mixture.prefix_counts(1000) == {"c0": 650, "c1": 350}
    assert mixture.weights == {"c0": 0.8, "c1": 0.2}
    assert mixture.weights_at(499) == {"c0": 0.8, "c1": 0.2}
    assert mixture.weights_at(500) == {"c0": 0.5, "c1": 0.5}
    assert repr(mixture).startswith("MixtureDataset(WeightSchedule([(0, {'c0': 8, 'c1': 2})")


def test_a_linear_ramp_moves_the_shares_gradually():
    schedule = WeightSchedule([(0, {"c0": 1, "c1": 0}), (1000, {"c0": 0, "c1": 1})], "linear")
    mixture = MixtureDataset(_components(2, 50), schedule, seed=0, num_samples=1200)
    component, _ = mixture.locate(np.arange(1200))
    per_block = [int((component[b : b + 100] == 1).sum()) for b in range(0, 1000, 100)]
    assert per_block == sorted(per_block) and per_block[0] <= 10 and per_block[-1] >= 90
    assert (component[1000:] == 1).all()  # the last point's weights hold from there
    assert mixture.weights_at(250) == {"c0": 0.75, "c1": 0.25}


def test_a_component_with_weight_0_in_a_phase_gets_no_position_there():
    schedule = WeightSchedule([(0, {"c0": 1, "c1": 1}), (100, {"c0": 0, "c1": 1})])
    mixture = MixtureDataset(_components(2), schedule, seed=0, num_samples=300)
    component, index = mixture.locate(np.arange(300))
    assert (component[100:] == 1).all()
    assert index[component == 1].size == 250  # c1 goes on through its passes


def test_a_phase_longer_than_two_to_the_30_keeps_draws_and_counts_exact():
    weights = {"c0": 0.123456789, "c1": 1.0, "c2": 3.14159}
    schedule = WeightSchedule([(0, weights), (3 * 2**31 + 17, {"c0": 1, "c1": 1, "c2": 1})])
    mixture = MixtureDataset(_components(3), schedule, seed=0, num_samples=2**62)
    shares = [Fraction(w) / sum(map(Fraction, weights.values())) for w in weights.values()]
    for k in [2**30 + 3, 2**31 * 3 + 16, 2**31 * 3 + 17, 2**31 * 3 + 5000]:
        counts = list(mixture.prefix_counts(k).values())
        phase = min(k, 3 * 2**31 + 17)
        rest = k - phase
        for c in range(3):
            target = phase * shares[c] + Fraction(rest, 3)
            assert abs(counts[c] - target) < 3 + phase * Fraction(1, 2**29), (k, c)
    positions = np.arange(3 * 2**31, 3 * 2**31 + 40, dtype=np.int64)
    component, draw = mixture._routing.route(positions)
    counts = list(mixture.prefix_counts(int(positions[0])).values())
    for c, d in zip(component.tolist(), draw.tolist()):
        assert d == counts[c]
        counts[c] += 1


@pytest.mark.parametrize(
    ("points", "interpolation", "num_samples", "error", "match"),
    [
        (
            [(0, {"c0": 1, "c1": 1})],
            "cubic",
            10,
            ValueError,
            r"interpolation must be one of \['step', 'linear'\], got 'cubic'",
        ),
        ([], "step", 10, ValueError, "at least one"),
        ({0: {"c0": 1}}, "step", 10, TypeError, "list of \\(position, weights\\) pairs"),
        (
            [(5, {"c0": 1, "c1": 1})],
            "step",
            10,
            ValueError,
            "first point must be at position 0 .*got 5; add a point",
        ),
        (
            [(0, {"c0": 1, "c1": 1}), (4, {"c0": 1, "c1": 1}), (4, {"c0": 1, "c1": 2})],
            "step",
            10,
            ValueError,
            "point 2 is at 4, after a point at 4",
        ),
        (
            [(0, {"c0": 1, "c1": 1}), (-3, {"c0": 1, "c1": 1})],
            "step",
            10,
            ValueError,
            "position of point 1 must be >= 0, got -3",
        ),
        (
            [(0, {"c0": 1, "c1": 1}), (3, [1, 2])],
            "step",
            10,
            TypeError,
            r"weights of point 1 \(position 3\) must be a mapping",
        ),
        (
            [(0, {"c0": 1, "c1": 1}), (3, {"c0": 1})],
            "step",
            10,
            ValueError,
            r"point at position 3: weights must have exactly .*missing \['c1'\]",
        ),
        (
            [(0, {"c0": 1, "c1": 1}), (3, {"c0": -1, "c1": 1})],
            "step",
            10,
            ValueError,
            "point at position 3: weight of 'c0' must be finite and >= 0, got -1",
        ),
        (
            [(0, {"c0": 0, "c1": 0})],
            "step",
            10,
            ValueError,
            "point at position 0: weights are all 0",
        ),
        ([(0, {"c0": 1, "c1": float("nan")})], "step", 10, ValueError, "'c1' must be finite"),
        ([(0, {"c0": 1, "c1": 1e-12})], "step", 10, ValueError, "'c1' is below 2\\*\\*-30"),
        (
            [(0, {"c0": 1, "c1": 1}), (10, {"c0": 1, "c1": 2})],
            "step",
            10,
            ValueError,
            "point at position 10, at or after num_samples=10",
        ),
        ([(0, {"c0": 1, "c1": 1})], "step", None, ValueError, "WeightSchedule needs num_samples"),
    ],
)
def test_bad_schedules_are_refused_naming_the_point_and_the_fix(
    points, interpolation, num_samples, error, match
):
    with pytest.raises(error, match=match):
        MixtureDataset(
            _components(2), WeightSchedule(points, interpolation), seed=0, num_samples=num_samples
        )


# -- resume_history: the weights before a position kept, the mixture's own after it ----------


def _draw_order(mixture: MixtureDataset, n: int) -> dict[int, list[int]]:
    """Each component's draws, in position order."""
    component, _ = mixture.locate(np.arange(n))
    _, draws = mixture._routing.route(np.arange(n, dtype=np.int64))
    return {c: draws[component == c].tolist() for c in range(len(mixture.names))}


SCHEDULE = WeightSchedule(
    [
        (0, {"c0": 6, "c1": 3, "c2": 1}),
        (400, {"c0": 1, "c1": 1, "c2": 2}),
        (700, {"c0": 1, "c1": 0, "c2": 0}),
    ],
    "linear",
)


def test_resuming_with_the_same_schedule_routes_every_position_as_before():
    before = MixtureDataset(_components(3), SCHEDULE, seed=2, num_samples=1000)
    history = json.loads(json.dumps(before.weights_history(517)))  # JSON-friendly
    after = MixtureDataset(_components(3), SCHEDULE, seed=2, num_samples=1000)
    assert not after.resume_history(history, 517)  # nothing changes
    everything = np.arange(1000)
    assert [a.tolist() for a in after.locate(everything)] == [
        a.tolist() for a in before.locate(everything)
    ]


@pytest.mark.parametrize("position", [1, 399, 400, 401, 650, 999])
def test_resuming_with_other_weights_keeps_the_past_and_each_components_draws_go_on(position):
    before = MixtureDataset(_components(3), SCHEDULE, seed=2, num_samples=1000)
    after = MixtureDataset(_components(3), {"c0": 1, "c1": 5, "c2": 1}, seed=2, num_samples=1000)
    assert after.resume_history(before.weights_history(position), position)
    old, new = before.locate(np.arange(1000)), after.locate(np.arange(1000))
    assert old[0][:position].tolist() == new[0][:position].tolist()
    assert old[1][:position].tolist() == new[1][:position].tolist()
    for draws in _draw_order(after, 1000).values():
        assert draws == list(range(len(draws)))  # no draw repeated, none skipped
    tail = np.bincount(new[0][position:], minlength=3)
    expected = (1000 - position) * np.array([1, 5, 1]) / 7
    assert np.abs(tail - expected).max() <= 3
    assert after.weights_at(position) == {"c0": 1 / 7, "c1": 5 / 7, "c2": 1 / 7}


def test_a_schedule_that_agrees_before_the_position_applies_after_it():
    before = MixtureDataset(
        _components(2),
        WeightSchedule([(0, {"c0": 1, "c1": 1}), (900, {"c0": 1, "c1": 0})]),
        seed=0,
        num_samples=1000,
    )
    moved = WeightSchedule([(0, {"c0": 1, "c1": 1}), (600, {"c0": 1, "c1": 0})])
    after = MixtureDataset(_components(2), moved, seed=0, num_samples=1000)
    after.resume_history(before.weights_history(500), 500)
    component, _ = after.locate(np.arange(1000))
    assert (component[600:] == 0).all()
    assert component[:500].tolist() == before.locate(np.arange(500))[0].tolist()


def test_a_schedule_that_disagrees_with_the_history_names_the_first_point_that_differs():
    before = MixtureDataset(_components(2), {"c0": 1, "c1": 1}, seed=0, num_samples=1000)
    history = before.weights_history(500)
    other = WeightSchedule([(0, {"c0": 1, "c1": 1}), (300, {"c0": 3, "c1": 1})])
    after = MixtureDataset(_components(2), other, seed=0, num_samples=1000)
    with pytest.raises(
        ValueError,
        match=r"point 1 \(position 300, weights \{'c0': 0\.75, 'c1': 0\.25\}, step\) differs "
        r"from the run's history before position 500, whose point 1 is none",
    ):
        after.resume_history(history, 500)
    changed = WeightSchedule([(0, {"c0": 2, "c1": 1})])
    with pytest.raises(
        ValueError,
        match=r"point 0 \(position 0, weights \{'c0': 0\.666667, 'c1': 0\.333333\}, step\) "
        r"differs .* whose point 0 is \(position 0, weights \{'c0': 0\.5, 'c1': 0\.5\}, step\)",
    ):
        MixtureDataset(_components(2), changed, seed=0, num_samples=1000).resume_history(
            history, 500
        )


def test_a_second_resume_keeps_both_changes_and_a_schedule_naming_them_agrees():
    first = MixtureDataset(_components(2), {"c0": 1, "c1": 1}, seed=0, num_samples=1000)
    second = MixtureDataset(_components(2), {"c0": 3, "c1": 1}, seed=0, num_samples=1000)
    second.resume_history(first.weights_history(200), 200)
    history = second.weights_history(600)
    assert [part["from"] for part in history] == [0, 200]
    named = WeightSchedule(
        [(0, {"c0": 1, "c1": 1}), (200, {"c0": 3, "c1": 1}), (800, {"c0": 0, "c1": 1})]
    )
    third = MixtureDataset(_components(2), named, seed=0, num_samples=1000)
    third.resume_history(history, 600)
    assert third.locate(np.arange(600))[0].tolist() == second.locate(np.arange(600))[0].tolist()
    assert (third.locate(np.arange(800, 1000))[0] == 1).all()
    for draws in _draw_order(third, 1000).values():
        assert draws == list(range(len(draws)))
    assert third.resume_history([], 0)  # back to the weights alone
    assert third.weights_history(600)[-1]["from"] == 0


@pytest.mark.parametrize(
    ("history", "match"),
    [
        ({"from": 0}, "must be a list of parts"),
        ([{"from": 0, "points": []}], "must be a dict with 'from', 'interpolation' and 'points'"),
        (
            [{"from": 0, "interpolation": "step", "points": [[0, {"c0": 1}]]}],
            r"not integer weights of the components \['c0', 'c1'\]",
        ),
        ([{"from": 0, "interpolation": "step", "points": [[0, {"c0": 0, "c1": 0}]]}], "sum to 0"),
        (
            [{"from": 5, "interpolation": "step", "points": [[6, {"c0": 1, "c1": 1}]]}],
            "no point at or before its start 5",
        ),
        (
            [{"from": 5, "interpolation": "step", "points": [[0, {"c0": 1, "c1": 1}]]}],
            "the first part starts at 0",
        ),
        (
            [{"from": 0, "interpolation": "step", "points": [[0]]}],
            r"a point must be \[position, weights\], got \[0\]",
        ),
    ],
)
def test_a_malformed_history_is_refused(history, match):
    mixture = MixtureDataset(_components(2), {"c0": 1, "c1": 1}, seed=0, num_samples=100)
    with pytest.raises(ValueError, match=match):
        mixture.resume_history(history, 50)


def test_a_resumed_mixture_pickles_with_its_history():
    before = MixtureDataset(_components(3), SCHEDULE, seed=2, num_samples=1000)
    after = MixtureDataset(_components(3), {"c0": 1, "c1": 1, "c2": 1}, seed=2, num_samples=1000)
    after.resume_history(before.weights_history(450), 450)
    copy = pickle.loads(pickle.dumps(after))
    assert [a.tolist() for a in copy.locate(np.arange(1000))] == [
        a.tolist() for a in after.locate(np.arange(1000))
    ]
