"""check_int: the package's one check of an integer argument."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from guideloom_pipes.checks import check_int


@pytest.mark.parametrize(
    "value", [3, np.int64(3), np.uint8(3), np.int32(3), np.array(3), np.uint64(3)]
)
def test_ints_and_numpy_ints_are_accepted_as_python_ints(value: Any) -> None:
    out = check_int("count", value)
    assert out == 3 and type(out) is int


@pytest.mark.parametrize(
    "value", [True, False, np.True_, 1.0, "3", None, np.float64(2.0), [1], np.array([1])]
)
def test_bools_and_non_integers_are_a_type_error_naming_the_value(value: Any) -> None:
    with pytest.raises(TypeError) as error:
        check_int("shard id", value, minimum=0)
    assert str(error.value) == f"shard id must be an int, got {value!r} ({type(value).__name__})"


def test_the_type_message_is_exact() -> None:
    with pytest.raises(TypeError) as error:
        check_int("shard id", True)
    assert str(error.value) == "shard id must be an int, got True (bool)"


def test_none_is_returned_when_allowed_and_the_message_says_so() -> None:
    assert check_int("seed", None, minimum=0, allow_none=True) is None
    with pytest.raises(TypeError, match=r"^seed must be an int or None, got 1\.5 \(float\)$"):
        check_int("seed", 1.5, allow_none=True)
    assert check_int("seed", np.int16(4), allow_none=True) == 4


def test_the_bounds_are_named_with_the_value() -> None:
    assert check_int("rank", 0, minimum=0) == 0
    assert check_int("rank", 7, minimum=0, maximum=7) == 7
    with pytest.raises(ValueError, match=r"^rank must be >= 0, got -1$"):
        check_int("rank", -1, minimum=0)
    with pytest.raises(ValueError, match=r"^rank must be <= 7, got 8$"):
        check_int("rank", np.int64(8), minimum=0, maximum=7)
    with pytest.raises(ValueError, match=r"^size must be >= 1, got 0$"):
        check_int("size", 0, minimum=1, allow_none=True)


def test_a_hint_follows_the_bound() -> None:
    with pytest.raises(ValueError, match=r"^attempts must be >= 1 \(1: no retries\), got 0$"):
        check_int("attempts", 0, minimum=1, hint="(1: no retries)")
    # ... and only there: the type's message is the same for every parameter
    with pytest.raises(TypeError, match=r"^attempts must be an int, got 'x' \(str\)$"):
        check_int("attempts", "x", minimum=1, hint="(1: no retries)")


def test_no_bound_takes_any_int() -> None:
    assert check_int("offset", -(2**70)) == -(2**70)
    assert check_int("offset", 2**70) == 2**70


def test_kind_names_what_the_value_must_be() -> None:
    with pytest.raises(TypeError, match=r"^eos_token must be an int token id or None, got 'a'"):
        check_int("eos_token", "a", allow_none=True, kind="an int token id")


def test_parameters_that_always_raised_value_error_for_a_non_int_still_do() -> None:
    # Shuffle's block_size and ShuffleBuffer's size have raised ValueError for a non-int
    # since they were written: the shared check keeps their exception type.
    with pytest.raises(ValueError, match=r"^block_size must be an int, got 1\.5 \(float\)$"):
        check_int("block_size", 1.5, minimum=1, not_int=ValueError)
    pytest.importorskip("torch")  # (the stages below need torch; the check above does not)
    from guideloom_pipes.pipes import Shuffle
    from guideloom_pipes.pipes.shards import ShuffleBuffer

    with pytest.raises(ValueError, match="block_size"):
        Shuffle(None, 7, block_size=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size"):
        ShuffleBuffer(None, size="4")  # type: ignore[arg-type]
