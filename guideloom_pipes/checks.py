"""Argument checks shared by the package's layers (standard library and numpy only).

:func:`check_int` is the one place that decides what an integer argument is: a Python int
or anything with ``__index__`` (numpy integers, a 0-d integer array), never a bool (``True``
is an ``int`` to Python, never a count or an id to us). Its messages name the parameter, what
it must be and the value given, e.g. ``num_workers must be >= 0, got -1`` or ``shard id must
be an int, got 1.0 (float)``.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Literal, overload

import numpy as np

__all__ = ["check_int"]


@overload
def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: Literal[False] = False,
    hint: str = "",
    kind: str = "an int",
    not_int: type[Exception] = TypeError,
) -> int: ...
@overload
def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: Literal[True],
    hint: str = "",
    kind: str = "an int",
    not_int: type[Exception] = TypeError,
) -> int | None: ...


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
    hint: str = "",
    kind: str = "an int",
    not_int: type[Exception] = TypeError,
) -> int | None:
    """``value`` as an ``int``, checked: an integer (not a bool) within the bounds.

    Args:
        name: the parameter's name, as the caller spells it (it starts each message).
        value: what was passed.
        minimum: the smallest value allowed, or None for no lower bound.
        maximum: the largest value allowed, or None for no upper bound.
        allow_none: whether None is allowed (then it is returned as is).
        hint: a phrase added after the bound in a bound's message (why the bound, or what
            a value means), e.g. ``"(1: no retries)"``.
        kind: what the value must be, in the type's message (``"an int token id"``).
        not_int: the exception for a value that is no integer (``TypeError``; a few
            parameters have always raised ``ValueError`` for it, and still do).

    Returns:
        The value as a Python ``int`` (None for None when ``allow_none``).

    Raises:
        TypeError: (or ``not_int``) not an integer, or a bool: ``{name} must be {kind},
            got {value!r} ({type})`` (``{kind} or None`` when ``allow_none``).
        ValueError: out of bounds: ``{name} must be >= {minimum}, got {value}`` (or
            ``<= {maximum}``), the hint after the bound.
    """
    if value is None and allow_none:
        return None
    number: int | None = None
    if not isinstance(value, (bool, np.bool_)):
        with contextlib.suppress(TypeError):
            number = operator.index(value)
    if number is None:
        wanted = f"{kind} or None" if allow_none else kind
        raise not_int(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})")
    extra = f" {hint}" if hint else ""
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}{extra}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}{extra}, got {number}")
    return number
