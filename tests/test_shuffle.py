"""The epoch shuffle: GuideLoom 1.1's Feistel permutation, reproduced exactly and vectorised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom_pipes.shuffle import FeistelPermutation, FeistelStack, epoch_key_seed, feistel

EXPECTED = Path(__file__).parent / "data" / "guideloom-1.1" / "expected.json"
REPO_ROOT = Path(__file__).resolve().parent.parent
FEISTEL = json.loads(EXPECTED.read_text())["feistel"]
PATHS = ["table", "speck"]


@contextmanager
def compute_path(kind: str) -> Iterator[None]:
    """Force the tabulated round functions ("table") or direct Speck ("speck") for new perms.

    A plain context manager rather than monkeypatch, so hypothesis tests can use it.
    """
    saved = feistel._TABLE_MAX_SIDE
    feistel._TABLE_MAX_SIDE = 1 << 31 if kind == "table" else 0
    try:
        yield
    finally:
        feistel._TABLE_MAX_SIDE = saved


def make(n: int, key_seed: int, kind: str) -> FeistelPermutation:
    with compute_path(kind):
        perm = FeistelPermutation(n, key_seed)
    assert perm._use_table == (kind == "table")
    return perm


def case_id(case: dict[str, Any]) -> str:
    return f"n{case['length']}-seed{case['seed']}-epoch{case['epoch']}"


# -- GuideLoom's order ------------------------------------------------------------------------


def test_expected_json_uses_five_rounds() -> None:
    assert FEISTEL["rounds"] == 5
    assert len(FEISTEL["cases"]) == 81


@pytest.mark.parametrize("kind", PATHS)
@pytest.mark.parametrize("case", FEISTEL["cases"], ids=case_id)
def test_reproduces_guideloom_permutation(case: dict[str, Any], kind: str) -> None:
    n = case["length"]
    with compute_path(kind):
        perm = FeistelPermutation.for_epoch(n, case["seed"], case["epoch"])
    assert perm.rounds == FEISTEL["rounds"]
    assert perm(np.arange(n)).tolist() == case["permutation"]


@pytest.mark.parametrize("case", FEISTEL["cases"][::7], ids=case_id)
def test_reproduces_guideloom_permutation_one_int_at_a_time(case: dict[str, Any]) -> None:
    perm = FeistelPermutation.for_epoch(case["length"], case["seed"], case["epoch"])
    assert [perm(p) for p in range(case["length"])] == case["permutation"]


def test_for_epoch_uses_epoch_key_seed() -> None:
    perm = FeistelPermutation.for_epoch(1000, 42, 3)
    assert perm.n == 1000
    assert perm.key_seed == epoch_key_seed(42, 3)
    assert perm.rounds == 5


# -- epoch keys -------------------------------------------------------------------------------


def test_epoch_key_seed_matches_seed_sequence_derivation() -> None:
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence(7, spawn_key=(2,))))
    assert epoch_key_seed(7, 2) == int(rng.integers(0, 2**32, dtype=np.uint64))


def test_epoch_key_seed_is_deterministic_per_seed_and_epoch() -> None:
    assert epoch_key_seed(123, 5) == epoch_key_seed(123, 5)
    assert isinstance(epoch_key_seed(123, 5), int)
    assert 0 <= epoch_key_seed(123, 5) < 2**32


def test_epoch_key_seed_differs_across_epochs_and_seeds() -> None:
    keys = {epoch_key_seed(123, e) for e in range(50)}
    assert len(keys) == 50
    assert epoch_key_seed(1, 0) != epoch_key_seed(2, 0)


def test_epoch_key_seed_without_seed_draws_fresh_entropy() -> None:
    keys = {epoch_key_seed(None, 0) for _ in range(5)}
    assert len(keys) > 1
    assert all(0 <= k < 2**32 for k in keys)


@pytest.mark.parametrize(("seed", "epoch"), [(-1, 0), (0, -1)])
def test_epoch_key_seed_rejects_negative_values(seed: int, epoch: int) -> None:
    with pytest.raises(ValueError, match="-1"):
        epoch_key_seed(seed, epoch)


# -- permutation and inverse ----------------------------------------------------------------


@settings(deadline=None, max_examples=60)
@given(
    n=st.integers(1, 3000),
    key_seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(PATHS),
)
def test_is_a_permutation_with_its_inverse(n: int, key_seed: int, kind: str) -> None:
    perm = make(n, key_seed, kind)
    positions = np.arange(n)
    ids = perm(positions)
    assert np.array_equal(np.sort(ids), positions)
    assert np.array_equal(perm.inverse(ids), positions)
    assert np.array_equal(perm(perm.inverse(positions)), positions)


@settings(deadline=None, max_examples=25)
@given(
    n=st.integers(2**20, 2**62),
    key_seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_inverse_undoes_the_permutation_for_large_n(
    n: int, key_seed: int, data: st.DataObject
) -> None:
    seed = data.draw(st.integers(0, 2**32 - 1))
    positions = np.random.default_rng(seed).integers(0, n, size=2000)
    perm = FeistelPermutation(n, key_seed)
    ids = perm(positions)
    assert ids.min() >= 0
    assert ids.max() < n
    assert np.array_equal(perm.inverse(ids), positions)


@pytest.mark.parametrize("kind", PATHS)
def test_inverse_undoes_the_permutation_at_2_to_the_40(kind: str) -> None:
    n = 2**40 + 7
    perm = make(n, epoch_key_seed(42, 0), kind)
    positions = np.random.default_rng(0).integers(0, n, size=20_000)
    positions[:3] = [0, 1, n - 1]
    ids = perm(positions)
    assert ((ids >= 0) & (ids < n)).all()
    assert len(np.unique(ids)) == len(np.unique(positions))
    assert np.array_equal(perm.inverse(ids), positions)


def test_even_round_counts_are_permutations_too() -> None:
    perm = FeistelPermutation(777, 99, rounds=4)
    ids = perm(np.arange(777))
    assert np.array_equal(np.sort(ids), np.arange(777))
    assert np.array_equal(perm.inverse(ids), np.arange(777))


def test_n_of_one_maps_zero_to_zero() -> None:
    for kind in PATHS:
        perm = make(1, 5, kind)
        assert perm(0) == 0
        assert perm.inverse(0) == 0
        assert perm(np.zeros(3, dtype=np.int64)).tolist() == [0, 0, 0]


def test_works_at_the_largest_n() -> None:
    n = 2**63
    perm = FeistelPermutation(n, 3)
    positions = np.array([0, 1, n - 2, n - 1, 2**62], dtype=np.uint64)
    ids = perm(positions)
    assert ids.dtype == np.int64
    assert (ids >= 0).all()
    assert np.array_equal(perm.inverse(ids).astype(np.uint64), positions)


# -- the two computations agree ----------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 10, 4097, 10**6 + 3, 2**33 + 1])
def test_table_and_speck_paths_agree(n: int) -> None:
    table, speck = make(n, 12345, "table"), make(n, 12345, "speck")
    positions = np.random.default_rng(n).integers(0, n, size=5000)
    ids = table(positions)
    assert np.array_equal(ids, speck(positions))
    assert np.array_equal(table.inverse(ids), speck.inverse(ids))


@pytest.mark.parametrize("n", [10, 4097, 2**40 + 7, 2**63])
def test_plain_python_and_numpy_agree(n: int) -> None:
    perm = FeistelPermutation(n, 2024)
    positions = np.random.default_rng(1).integers(0, n, size=100, dtype=np.uint64)
    ids = perm(positions)  # more than _SMALL values: numpy
    assert [perm(int(p)) for p in positions] == ids.tolist()
    assert [perm.inverse(int(i)) for i in ids] == positions.tolist()
    assert perm(positions[:5]).tolist() == ids[:5].tolist()


@pytest.mark.parametrize("start", [0, 2**20 * 5 - 300, 2**40 - 1000])
def test_consecutive_positions_on_the_speck_path_agree_with_plain_python(start: int) -> None:
    """A block of consecutive positions (as the loader computes them) shares one or two
    values of R in the first round, which are computed once each; the ids are those of
    plain Python, one position at a time (the second block crosses from one R to the
    next), and the inverse gives the positions back."""
    n = 2**40
    perm = make(n, 77, "speck")
    positions = np.arange(start, start + 1000, dtype=np.int64)
    ids = perm(positions)
    assert [perm(int(p)) for p in positions[::97]] == ids[::97].tolist()
    assert np.array_equal(perm.inverse(ids), positions)


def test_the_first_round_of_a_block_computes_its_few_values_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 2**40
    perm = make(n, 77, "speck")
    positions = np.arange(10**6, 10**6 + 4096, dtype=np.int64)  # one value of R = v // a
    expected = perm(positions)
    sizes: list[int] = []
    real = feistel._speck_block

    def counting(values: np.ndarray, keys: Any) -> np.ndarray:
        sizes.append(values.size)
        return real(values, keys)

    monkeypatch.setattr(feistel, "_speck_block", counting)
    assert np.array_equal(perm(positions), expected)
    assert sizes == [4096] * (perm.rounds - 1)  # rounds 1-4 vectorised, round 0 once


def test_large_speck_inputs_are_computed_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 2**40 + 7
    positions = np.random.default_rng(2).integers(0, n, size=3000)
    expected = make(n, 8, "speck")(positions)
    monkeypatch.setattr(feistel, "_CHUNK", 256)
    assert np.array_equal(make(n, 8, "speck")(positions), expected)


# -- the 64-bit wrap-around of L + F_j(R) ---------------------------------------------------------


def _huge_f(j: int, r: int) -> int:
    """A stand-in round function whose values are so close to 2**64 that L + F often wraps."""
    return 2**64 - 1 - ((r * 2654435761 + 97 * j) % 1000)


def _patched_speck(self: FeistelPermutation, r: np.ndarray, j: int) -> np.ndarray:
    return np.array([_huge_f(j, int(x)) for x in r], dtype=np.uint64)


def _patched_speck_rounds(self: FeistelPermutation, r: np.ndarray) -> np.ndarray:
    return np.stack([_patched_speck(self, r, j) for j in range(self.rounds)])


def _patched_speck_scalar(self: FeistelPermutation, j: int, value: int) -> int:
    return _huge_f(j, value)


def _reference_pass(v: int, a: int, rounds: int, wrap: bool = True) -> int:
    left, right = v % a, v // a
    for j in range(rounds):
        total = left + _huge_f(j, right)
        left, right = right, (total % 2**64 if wrap else total) % a
    return a * left + right


@pytest.mark.parametrize("kind", PATHS)
def test_round_sums_wrap_around_2_to_the_64(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    # n = a*a, so a single pass maps [0, n) into itself and no cycle walking happens.
    a = 50
    n = a * a
    assert 2**64 % a != 0  # so the wrap-around changes the result modulo a

    monkeypatch.setattr(FeistelPermutation, "_speck", _patched_speck)
    monkeypatch.setattr(FeistelPermutation, "_speck_rounds", _patched_speck_rounds)
    monkeypatch.setattr(FeistelPermutation, "_speck_scalar", _patched_speck_scalar)
    perm = make(n, 0, kind)
    expected = [_reference_pass(v, a, 5) for v in range(n)]
    assert expected != [_reference_pass(v, a, 5, wrap=False) for v in range(n)]

    ids = perm(np.arange(n))
    assert ids.tolist() == expected
    assert [perm(p) for p in range(0, n, 37)] == expected[::37]


def test_inverse_rounds_undo_sums_that_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    a = 50
    monkeypatch.setattr(FeistelPermutation, "_speck", _patched_speck)
    monkeypatch.setattr(FeistelPermutation, "_speck_scalar", _patched_speck_scalar)
    perm = make(a * a, 0, "speck")
    pairs = [(x, r) for x in range(a) for r in range(a)]  # (old L, R)
    rights = np.array([r for _, r in pairs], dtype=np.uint64)
    for j in range(5):
        outputs = [(x + _huge_f(j, r)) % 2**64 % a for x, r in pairs]
        assert any(x + _huge_f(j, r) >= 2**64 for x, r in pairs)
        found = perm._inverse_round_exact(j, rights, np.array(outputs, dtype=np.uint64)).tolist()
        found_scalar = [
            perm._inverse_round_scalar(j, r, y) for (_, r), y in zip(pairs, outputs, strict=True)
        ]
        assert found == found_scalar
        # Such rounds are not bijective, but each answer must be a preimage of the output,
        # and the one preimage where there is only one.
        counts = Counter(zip(rights.tolist(), outputs, strict=True))
        for (x, r), y, x_found in zip(pairs, outputs, found, strict=True):
            assert (x_found + _huge_f(j, r)) % 2**64 % a == y
            if counts[r, y] == 1:
                assert x_found == x


# -- inputs and errors ----------------------------------------------------------------------


def test_int_in_gives_int_out() -> None:
    for kind in PATHS:
        perm = make(1000, 1, kind)
        for value in (5, np.int32(5), np.uint64(5)):
            out = perm(value)
            assert type(out) is int
            assert out == int(perm(np.array([5]))[0])
            assert type(perm.inverse(out)) is int
            assert perm.inverse(out) == 5


@pytest.mark.parametrize("kind", PATHS)
def test_arrays_keep_their_shape_and_become_int64(kind: str) -> None:
    perm = make(1000, 1, kind)
    for dtype in (np.int32, np.int64, np.uint16, np.uint64):
        positions = np.arange(60, dtype=dtype).reshape(3, 4, 5)
        ids = perm(positions)
        assert ids.shape == (3, 4, 5)
        assert ids.dtype == np.int64
        assert np.array_equal(ids.ravel(), perm(np.arange(60)))
        assert np.array_equal(perm.inverse(ids), positions)
    assert perm([3, 1, 2]).tolist() == perm(np.array([3, 1, 2])).tolist()


def test_does_not_modify_its_input() -> None:
    perm = FeistelPermutation(1000, 1)
    positions = np.arange(100, dtype=np.uint64)
    perm(positions)
    perm.inverse(positions)
    assert np.array_equal(positions, np.arange(100))


def test_empty_input_gives_empty_int64_output() -> None:
    perm = FeistelPermutation(10, 1)
    empties: list[Any] = [np.array([], dtype=np.int64), []]
    for empty in empties:
        out = perm(empty)
        assert out.shape == (0,)
        assert out.dtype == np.int64


@pytest.mark.parametrize("kind", PATHS)
@pytest.mark.parametrize("bad", [-1, 10, 11, 2**70])
def test_out_of_range_position_raises_naming_it(kind: str, bad: int) -> None:
    perm = make(10, 1, kind)
    with pytest.raises(IndexError, match=rf"position {bad} .*\[0, 10\)"):
        perm(bad)
    with pytest.raises(IndexError, match=rf"id {bad} "):
        perm.inverse(bad)
    if bad < 2**63:
        with pytest.raises(IndexError, match=rf"position {bad} "):
            perm(np.array([0, 3, bad, 2]))
        with pytest.raises(IndexError, match=rf"id {bad} "):
            perm.inverse(np.array([bad] * 100))


def test_non_integer_arrays_are_refused() -> None:
    with pytest.raises(TypeError, match="float64"):
        FeistelPermutation(10, 1)(np.array([1.0, 2.0]))


@pytest.mark.parametrize("n", [0, -3])
def test_n_below_one_raises_naming_it(n: int) -> None:
    with pytest.raises(ValueError, match=rf"n must be >= 1.*got {n}"):
        FeistelPermutation(n, 1)
    with pytest.raises(ValueError, match=rf"got {n}"):
        FeistelPermutation.for_epoch(n, 0, 0)


def test_bad_key_seed_and_rounds_raise_naming_them() -> None:
    with pytest.raises(ValueError, match="-5"):
        FeistelPermutation(10, -5)
    with pytest.raises(ValueError, match=str(2**64)):
        FeistelPermutation(10, 2**64)
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        FeistelPermutation(10, 1, rounds=0)


def test_n_beyond_int64_ids_raises() -> None:
    with pytest.raises(ValueError, match=str(2**63 + 1)):
        FeistelPermutation(2**63 + 1, 1)


def test_tables_are_built_lazily_and_small() -> None:
    perm = FeistelPermutation(10**9, 1)
    assert perm._use_table
    assert perm._tables is None
    perm(0)
    assert perm._tables is not None
    assert sum(t.nbytes for t in perm._tables) <= 5 * 4 * (10**9) ** 0.5 + 5 * 4


def test_repr_names_the_parameters() -> None:
    assert repr(FeistelPermutation(10, 3)) == "FeistelPermutation(n=10, key_seed=3, rounds=5)"


# -- layering ---------------------------------------------------------------------------------


def test_import_does_not_import_torch() -> None:
    code = "import sys, guideloom_pipes.shuffle; assert 'torch' not in sys.modules"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT)


@pytest.mark.parametrize("n", [2, 48_828, 10**9, 2**40 + 17])
def test_the_tables_of_all_rounds_at_once_equal_each_rounds_own_speck_pass(n: int) -> None:
    perm = FeistelPermutation.for_epoch(n, 7, 3)
    r = np.arange(min(perm._a, 3000), dtype=np.uint64)
    rows = perm._speck_rounds(r)
    assert rows.shape == (perm.rounds, len(r))
    for j in range(perm.rounds):
        assert rows[j].tolist() == perm._speck(r, j).tolist()
        assert rows[j][:50].tolist() == [perm._speck_scalar(j, int(x)) for x in r[:50]]


def test_a_feistel_stack_maps_each_element_by_its_own_permutation():
    # table-served sides, a side beyond the table limit, n = 1 and a power of two
    sizes = [1, 2, 17, 256, 1000, (1 << 34) + 5]
    perms = [FeistelPermutation(n, 1000 + i) for i, n in enumerate(sizes)]
    stack = FeistelStack(perms)
    assert len(stack) == len(sizes)
    rng = np.random.default_rng(0)
    which = rng.integers(0, len(sizes), 5000)
    positions = (rng.random(5000) * np.array(sizes, dtype=float)[which]).astype(np.int64)
    got = stack(which, positions)
    assert got.dtype == np.int64
    for s, perm in enumerate(perms):
        rows = which == s
        assert np.array_equal(got[rows], perm(positions[rows]))
    assert np.array_equal(
        stack(which.reshape(50, 100), positions.reshape(50, 100)), got.reshape(50, 100)
    )
    assert stack(np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0,)


def test_a_feistel_stack_refuses_what_it_cannot_map():
    stack = FeistelStack([FeistelPermutation(10, 1), FeistelPermutation(20, 2)])
    with pytest.raises(IndexError, match=r"position 10 is out of range \[0, 10\) of permutation 0"):
        stack(np.array([1, 0]), np.array([19, 10]))
    with pytest.raises(IndexError, match=r"permutation 2 is out of range \[0, 2\)"):
        stack(np.array([2]), np.array([0]))
    with pytest.raises(ValueError, match="same shape"):
        stack(np.array([0, 1]), np.array([0]))
    with pytest.raises(ValueError, match="same number of rounds"):
        FeistelStack([FeistelPermutation(10, 1), FeistelPermutation(10, 1, rounds=4)])
    with pytest.raises(ValueError, match="at least one"):
        FeistelStack([])
