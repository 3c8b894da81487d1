"""MixtureDataset: the schedule's prefix bound, passes without repeats, purity, locate, nested
mixtures, storage components, and the refusals of bad arguments (torch-free)."""

from __future__ import annotations

import pickle
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    MixtureDataset,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
)
from guideloom_pipes.mixture_schedule import (
    _floor_muldiv,
    _integer_weights,
    _name_key,
    _pass_key_seed,
    _Schedule,
)
from guideloom_pipes.shuffle import FeistelPermutation

weights_st = st.lists(
    st.one_of(
        st.integers(1, 1000).map(float),
        st.floats(1e-3, 1e3, allow_nan=False, allow_infinity=False),
    ),
    min_size=1,
    max_size=9,
)


def _components(lengths: list[int]) -> dict[str, np.ndarray]:
    return {f"c{c}": np.arange(n) + 1000 * c for c, n in enumerate(lengths)}


def _exact_errors(schedule: _Schedule, k: int) -> list[Fraction]:
    total = int(schedule.weight[schedule.root])
    counts = schedule.prefix_counts(k)
    return [
        abs(count - Fraction(k * int(schedule.weight[c]), total)) for c, count in enumerate(counts)
    ]


@settings(max_examples=80, deadline=None)
@given(weights=weights_st, k_max=st.integers(1, 600))
def test_every_prefix_is_within_the_documented_bound_of_its_share(weights, k_max):
    schedule = _Schedule(_integer_weights(weights))
    bounds = [schedule.bound(c) for c in range(len(weights))]
    limit = 0.5 if len(weights) <= 2 else 1.68
    assert all(bound <= limit for bound in bounds)
    components, _ = schedule.route(np.arange(k_max, dtype=np.int64))
    counts = np.zeros(len(weights), dtype=np.int64)
    total = int(schedule.weight[schedule.root])
    for k in range(k_max + 1):
        if k:
            counts[components[k - 1]] += 1
        for c, count in enumerate(counts.tolist()):
            error = abs(count - Fraction(k * int(schedule.weight[c]), total))
            assert error <= Fraction(bounds[c]) + Fraction(1, 10**12), (k, c, error)
    assert schedule.prefix_counts(k_max) == counts.tolist()


@settings(max_examples=60, deadline=None)
@given(weights=weights_st, k=st.integers(0, 2**62))
def test_the_bound_holds_at_huge_prefixes_and_two_components_stay_below_one(weights, k):
    schedule = _Schedule(_integer_weights(weights))
    errors = _exact_errors(schedule, k)
    for c, error in enumerate(errors):
        assert error <= Fraction(schedule.bound(c)) + Fraction(1, 10**12)
        assert error <= 2
        if len(weights) == 2:
            assert error < 1


@settings(max_examples=60, deadline=None)
@given(weights=weights_st, start=st.integers(0, 2**62 - 5000))
def test_the_draw_is_the_number_of_earlier_positions_of_the_same_component(weights, start):
    schedule = _Schedule(_integer_weights(weights))
    positions = np.arange(start, start + 300, dtype=np.int64)
    components, draws = schedule.route(positions)
    counts = schedule.prefix_counts(start)
    for component, draw in zip(components.tolist(), draws.tolist()):
        assert draw == counts[component]
        counts[component] += 1
    assert counts == schedule.prefix_counts(start + 300)


def test_exact_128_bit_arithmetic_matches_python_integers():
    rng = np.random.default_rng(5)
    d = rng.integers(1, 2**31, 2000)
    p = rng.integers(0, 2**31, 2000) % (d + 1)  # p <= d, as the schedule's are
    q = rng.integers(0, 2**31, 2000) % d
    m = rng.integers(0, 2**63 - 1, 2000)
    out = _floor_muldiv(m, p, q, d)
    expected = [(int(a) * int(b) + int(c)) // int(e) for a, b, c, e in zip(m, p, q, d)]
    assert out.tolist() == expected


def test_weights_that_are_small_ratios_are_realised_exactly():
    assert _integer_weights([0.7, 0.2, 0.1]) == [7, 2, 1]
    assert _integer_weights([1 / 3, 2 / 3]) == [1, 2]
    mixture = MixtureDataset(_components([10, 10, 10]), {"c0": 7, "c1": 2, "c2": 1}, seed=0)
    assert mixture.weights == {"c0": 0.7, "c1": 0.2, "c2": 0.1}
    assert mixture.prefix_counts(10) == {"c0": 7, "c1": 2, "c2": 1}
    assert mixture.prefix_counts(1000) == {"c0": 700, "c1": 200, "c2": 100}


def test_other_weights_are_rounded_to_two_to_the_minus_30():
    weights = [0.123456789, 1.0, 3.14159]
    integers = _integer_weights(weights)
    assert sum(integers) == 2**30
    for w, i in zip(weights, integers):
        assert abs(i / 2**30 - w / sum(weights)) < 2**-30


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    weights=st.lists(st.integers(1, 9), min_size=4, max_size=4),
    seed=st.integers(0, 2**40),
)
def test_a_component_uses_every_sample_once_per_pass_before_repeating(lengths, weights, seed):
    components = _components(lengths)
    names = list(components)
    mixture = MixtureDataset(
        components,
        dict(zip(names, weights)),
        seed=seed,
        num_samples=sum(lengths) * 3,
    )
    component, index = mixture.locate(np.arange(len(mixture)))
    for c, length in enumerate(lengths):
        drawn = index[component == c]
        for start in range(0, len(drawn), length):
            one_pass = drawn[start : start + length].tolist()
            assert len(set(one_pass)) == len(one_pass)
            if len(one_pass) == length:
                assert sorted(one_pass) == list(range(length))


def test_successive_passes_are_differently_ordered():
    mixture = MixtureDataset(
        {"a": np.arange(50), "b": np.arange(5)}, {"a": 1, "b": 1}, seed=1, num_samples=100
    )
    component, index = mixture.locate(np.arange(100))
    drawn = index[component == 1].tolist()
    passes = [drawn[i : i + 5] for i in range(0, len(drawn), 5)]
    assert len({tuple(p) for p in passes}) > 1


def test_a_sample_is_a_pure_function_of_the_seed_and_the_position():
    def build(seed):
        return MixtureDataset(
            {"a": np.arange(30), "b": np.arange(100, 107)}, {"a": 0.6, "b": 0.4}, seed=seed
        )

    positions = np.array([36, 0, 5, 17, 5])
    with build(7).sync_reader() as one, build(7).sync_reader() as two:
        assert [int(s) for s in one.read_batch(positions)] == [int(two[int(p)]) for p in positions]
        assert [int(s) for s in one[:]] == [int(s) for s in build(7)[:]]
    with build(8).sync_reader() as other:
        assert [int(s) for s in other[:]] != [int(s) for s in build(7)[:]]


def test_the_pass_key_depends_on_the_name_not_on_the_order_of_components():
    a = MixtureDataset({"x": np.arange(20), "y": np.arange(20)}, {"x": 1, "y": 1}, seed=3)
    b = MixtureDataset({"y": np.arange(20), "x": np.arange(20)}, {"y": 1, "x": 1}, seed=3)
    ca, ia = a.locate(np.arange(40))
    cb, ib = b.locate(np.arange(40))
    x_in_a = ia[ca == 0].tolist()
    x_in_b = ib[cb == 1].tolist()
    assert x_in_a == x_in_b


def test_locate_keeps_the_shape_and_refuses_positions_out_of_range():
    mixture = MixtureDataset(_components([4, 6]), {"c0": 1, "c1": 1}, seed=0)
    component, index = mixture.locate(3)
    assert component.shape == index.shape == ()
    assert component.dtype == index.dtype == np.int64
    component, index = mixture.locate(np.arange(6).reshape(2, 3))
    assert component.shape == (2, 3)
    with pytest.raises(IndexError, match="10"):
        mixture.locate(10)
    with pytest.raises(IndexError, match="-1"):
        mixture.locate(np.array([0, -1]))
    with mixture.sync_reader() as reader, pytest.raises(IndexError, match="12"):
        reader.read_batch(np.array([12]))


def test_num_samples_defaults_to_the_sum_of_lengths_and_can_be_set():
    assert len(MixtureDataset(_components([3, 4]), {"c0": 1, "c1": 1}, seed=0)) == 7
    assert (
        len(MixtureDataset(_components([3, 4]), {"c0": 1, "c1": 1}, seed=0, num_samples=50)) == 50
    )


def test_a_nested_mixture_is_a_component_and_locate_names_the_top_level():
    inner = MixtureDataset(_components([5, 5]), {"c0": 1, "c1": 3}, seed=1)
    outer = MixtureDataset(
        {"inner": inner, "other": np.arange(9000, 9020)}, {"inner": 1, "other": 1}, seed=2
    )
    component, index = outer.locate(np.arange(len(outer)))
    with outer.sync_reader() as reader, inner.sync_reader() as inner_reader:
        samples = reader.read_batch(np.arange(len(outer)))
        for c, i, sample in zip(component.tolist(), index.tolist(), samples):
            if c == 0:
                assert int(sample) == int(inner_reader[i])
            else:
                assert int(sample) == 9000 + i


def _write_tokens(directory: Path, values: np.ndarray, dtype: str = "<i4") -> StreamStorage:
    storage = StreamStorage(directory, StreamNumpyFormat(np.dtype([("tokens", dtype)])))
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": values})
    return storage


def test_token_streams_mix_and_read_batch_matches_the_components(tmp_path):
    web = StreamDataset(_write_tokens(tmp_path / "web", np.arange(400)), 8)
    code = StreamDataset(_write_tokens(tmp_path / "code", np.arange(10_000, 10_240)), 8)
    mixture = MixtureDataset({"web": web, "code": code}, {"web": 0.75, "code": 0.25}, seed=4)
    assert len(mixture) == 50 + 30
    component, index = mixture.locate(np.arange(len(mixture)))
    with mixture.sync_reader() as reader:
        samples = reader.read_batch(np.arange(len(mixture)))
    for c, i, sample in zip(component.tolist(), index.tolist(), samples):
        base = 0 if c == 0 else 10_000
        assert sample["tokens"].tolist() == list(range(base + 8 * i, base + 8 * i + 8))
    assert pickle.loads(pickle.dumps(mixture)).locate(7)[1] == index[7]


def test_components_whose_samples_differ_are_refused_naming_them_and_the_field(tmp_path):
    web = StreamDataset(_write_tokens(tmp_path / "web", np.arange(400)), 8)
    longer = StreamDataset(_write_tokens(tmp_path / "long", np.arange(400)), 16)
    wide = StreamDataset(_write_tokens(tmp_path / "wide", np.arange(400), "<i8"), 8)
    with pytest.raises(ValueError, match=r"'web' and 'long'.*'tokens'"):
        MixtureDataset({"web": web, "long": longer}, {"web": 1, "long": 1}, seed=0)
    with pytest.raises(ValueError, match=r"'web' and 'wide'.*int64"):
        MixtureDataset({"web": web, "wide": wide}, {"web": 1, "wide": 1}, seed=0)
    documents = DocumentStorage(tmp_path / "docs", DocumentPickleFormat())
    with documents.sync_writer() as writer:
        writer.append(0, {"text": "a"})
    with pytest.raises(ValueError, match=r"'web' and 'docs'.*'text'"):
        MixtureDataset(
            {"web": web, "docs": DocumentDataset(documents)}, {"web": 1, "docs": 1}, seed=0
        )


def test_a_component_whose_length_changed_is_refused_when_a_reader_opens(tmp_path):
    storage = _write_tokens(tmp_path / "web", np.arange(400))
    other = StreamDataset(_write_tokens(tmp_path / "other", np.arange(80)), 8)
    mixture = MixtureDataset(
        {"web": StreamDataset(storage, 8), "b": other}, {"web": 1, "b": 1}, seed=0
    )
    _write_tokens(tmp_path / "web", np.arange(480))
    with pytest.raises(ValueError, match=r"'web' has 60 samples now, 50 .*again"):
        mixture.sync_reader().open()


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": 1}, r"missing \['b'\]"),
        ({"a": 1, "b": 1, "c": 1}, r"unknown \['c'\]"),
        ({"a": 1, "b": 0}, "'b'.*> 0"),
        ({"a": 1, "b": -2.0}, "'b'.*> 0"),
        ({"a": float("nan"), "b": 1}, "'a'.*finite"),
        ({"a": float("inf"), "b": 1}, "'a'.*finite"),
        ({"a": "1", "b": 1}, "'a'.*number"),
        ({"a": 1e-12, "b": 1}, "'a' is below 2\\*\\*-30"),
    ],
)
def test_bad_weights_are_refused_naming_the_key(weights, message):
    with pytest.raises(ValueError, match=message):
        MixtureDataset({"a": np.arange(3), "b": np.arange(3)}, weights, seed=0)


def test_bad_seed_num_samples_and_components_are_refused():
    components = {"a": np.arange(3)}
    with pytest.raises(TypeError, match="seed"):
        MixtureDataset(components, {"a": 1}, seed=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed must be >= 0, got -1"):
        MixtureDataset(components, {"a": 1}, seed=-1)
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        MixtureDataset(components, {"a": 1}, seed=0, num_samples=0)
    with pytest.raises(ValueError, match=rf"num_samples must be < 2\*\*63 .*got {2**63}"):
        MixtureDataset(components, {"a": 1}, seed=0, num_samples=2**63)
    assert len(MixtureDataset(components, {"a": 1}, seed=0, num_samples=2**63 - 1)) == 2**63 - 1
    with pytest.raises(TypeError, match="non-empty mapping"):
        MixtureDataset({}, {}, seed=0)
    with pytest.raises(TypeError, match="names must be str"):
        MixtureDataset({1: np.arange(3)}, {1: 1}, seed=0)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="'e' is empty"):
        MixtureDataset({"a": np.arange(3), "e": np.arange(0)}, {"a": 1, "e": 1}, seed=0)


class _Huge:
    """A dataset too large for the Feistel tables (side > 2**17): sample i is i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("lengths", [[7, 1, 1000], [3, 2**36 + 5], [1]])
def test_the_batched_pass_permutations_are_exactly_guideloom_feistel(lengths):
    components = {f"c{c}": _Huge(n) for c, n in enumerate(lengths)}
    mixture = MixtureDataset(
        components, {name: 1 + c for c, name in enumerate(components)}, seed=9, num_samples=3000
    )
    positions = np.random.default_rng(1).permutation(3000)[:250]
    component, draw = mixture._schedule.route(positions)
    _, index = mixture.locate(positions)
    for c, j, i in zip(component.tolist(), draw.tolist(), index.tolist()):
        n = lengths[c]
        key = _pass_key_seed(9, _name_key(f"c{c}"), j // n)
        assert i == FeistelPermutation(n, key)(j % n)
