"""One forward Feistel pass by round tables of ``F_j mod a``, how the halves of a pass combine,
and cycle walking: what :class:`~guideloom_pipes.shuffle.FeistelPermutation` and
:class:`~guideloom_pipes.shuffle.FeistelStack` share (the construction:
:mod:`guideloom_pipes.shuffle`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

_U64 = npt.NDArray[np.uint64]
_U32 = npt.NDArray[np.uint32]


def _cycle_walk(
    v: _U64,
    step: Callable[[_U64, npt.NDArray[np.intp] | None], _U64],
    n: Any,
    budget: int,
    fail: Callable[[npt.NDArray[np.intp]], Exception],
) -> _U64:
    """Cycle walking: passes of ``v`` until every value is below its bound ``n``.

    Args:
        v: the values (uint64), each below its bound; may be reused.
        step: one pass, ``step(values, rows)``: ``rows`` are the values' indices in ``v``
            (for per-element parameters), ``None`` for all of ``v``.
        n: the bound, a uint64, or one per element of ``v`` (a uint64 array).
        budget: the passes allowed after the first; a permutation needs at most its
            ``a*a - n``.
        fail: the error to raise when the budget is spent, given the rows still above.
    """
    per_element = isinstance(n, np.ndarray)
    v = step(v, None)
    todo = np.flatnonzero(v >= n)
    while todo.size:
        if budget <= 0:
            raise fail(todo)
        budget -= 1
        w = step(v[todo], todo)
        v[todo] = w
        todo = todo[w >= (n[todo] if per_element else n)]
    return v


def _table_pass(
    v: _U64,
    tables: Sequence[_U32],
    side64: Any,
    side32: Any,
    odd: bool,
    wraps: Sequence[bool] = (),
    exact: Callable[[int, _U32, _U32], None] | None = None,
    *,
    offset: _U64 | None = None,
) -> _U64:
    """One forward Feistel pass over ``[0, a*a)`` by round tables of ``F_j mod a``.

    Args:
        v: the values, uint64.
        tables: per round ``j``, ``F_j(R) mod a`` at ``R`` (uint32), or at ``offset + R``.
        side64, side32: the side ``a`` as uint64 and uint32: a scalar, or one per value.
        odd: whether the round count is odd (how the halves combine).
        wraps: per round, whether it is computed by ``exact(j, left, right)`` (in place on
            ``left``) instead of the table: a sum ``L + F_j(R)`` may wrap around ``2**64``.
        offset: where each value's permutation starts in the tables (a stack of them).
    """
    right64, left64 = np.divmod(v, side64)
    left = left64.astype(np.uint32)
    right = right64.astype(np.uint32)
    tmp = np.empty_like(left)
    for j, table in enumerate(tables):
        # left = (left + F_j(right)) mod 2**64 mod a, in place.
        if exact is not None and wraps[j]:
            exact(j, left, right)
        else:
            index = right if offset is None else offset + right
            np.take(table, index, out=tmp, mode="wrap")
            # left + (F mod a) < 2a <= 2**32, and s - a wraps above s when s < a.
            np.add(left, tmp, out=left)
            np.subtract(left, side32, out=tmp)
            np.minimum(left, tmp, out=left)
        left, right = right, left
    return _combine(left.astype(np.uint64), right.astype(np.uint64), side64, odd)


def _combine(left: _U64, right: _U64, side: Any, odd: bool) -> _U64:
    """The value of the halves after a pass: ``a * L + R`` for an odd round count, else
    ``a * R + L`` (``side``: ``a``, a uint64 or one per value); reuses their memory."""
    if odd:
        np.multiply(left, side, out=left)
        np.add(left, right, out=left)
        return left
    np.multiply(right, side, out=right)
    np.add(right, left, out=right)
    return right
