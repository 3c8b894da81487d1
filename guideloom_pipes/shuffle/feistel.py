"""``FeistelPermutation``, GuideLoom's permutation of ``[0, n)`` (by round tables or direct
Speck, a value at a time or vectorised, forward and inverse), and ``epoch_key_seed``, the key
of an epoch (the construction: :mod:`guideloom_pipes.shuffle`)."""

from __future__ import annotations

import math
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from guideloom_pipes.shuffle.passes import _U32, _U64, _combine, _cycle_walk, _table_pass
from guideloom_pipes.shuffle.speck import _MASK32, _speck_block, _speck_round_keys

__all__ = ["FeistelPermutation", "epoch_key_seed"]

_MASK64 = (1 << 64) - 1
#: Largest square side ``a`` for which the round functions are tabulated (memory:
#: ``rounds * a * 4`` bytes; build time: ``rounds * a`` Speck evaluations).
_TABLE_MAX_SIDE = 1 << 17
#: The direct Speck path works on this many values at a time (bounds its temporaries).
_CHUNK = 1 << 16
#: Up to this side ``a`` the round tables are computed in one Speck pass for all rounds.
_ROUNDS_TOGETHER = 2048
#: Arrays up to this size skip numpy on the Speck path (plain Python is faster for them).
_SMALL = 16
#: ids are int64, so n - 1 must fit in int64.
_MAX_N = 1 << 63


def epoch_key_seed(shuffle_seed: int | None, epoch: int) -> int:
    """The Feistel key of an epoch, exactly as GuideLoom 1.1 derives it.

    Args:
        shuffle_seed: the loader's seed (a non-negative int), or None for fresh entropy
            (then the result is not reproducible).
        epoch: the epoch number, ``>= 0``.

    Returns:
        ``key_seed`` in ``[0, 2**32)``.
    """
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if shuffle_seed is not None and shuffle_seed < 0:
        raise ValueError(f"shuffle_seed must be >= 0 or None, got {shuffle_seed}")
    sequence = np.random.SeedSequence(shuffle_seed, spawn_key=(epoch,))
    rng = np.random.Generator(np.random.Philox(sequence))
    return int(rng.integers(0, 2**32, dtype=np.uint64))


class FeistelPermutation:
    """GuideLoom's permutation of ``[0, n)``: 5-round Feistel on a square, cycle-walked.

    Calling it maps positions to sample ids; :meth:`inverse` maps ids back to positions. Both
    take an int (and return an int) or an integer array (and return an int64 array of the
    same shape). See :mod:`guideloom_pipes.shuffle` for the construction.

    Args:
        n: size of the permuted range, ``1 <= n <= 2**63``.
        key_seed: the key, ``0 <= key_seed < 2**64`` (GuideLoom's are below ``2**32``; see
            :func:`epoch_key_seed` and :meth:`for_epoch`).
        rounds: number of Feistel rounds (GuideLoom uses 5).
    """

    n: int
    key_seed: int
    rounds: int

    def __init__(self, n: int, key_seed: int, rounds: int = 5) -> None:
        n, key_seed, rounds = int(n), int(key_seed), int(rounds)
        if not 1 <= n <= _MAX_N:
            raise ValueError(f"n must be >= 1 (and <= 2**63), got {n}")
        if not 0 <= key_seed < 1 << 64:
            raise ValueError(f"key_seed must be in [0, 2**64), got {key_seed}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.n = n
        self.key_seed = key_seed
        self.rounds = rounds
        self._a = math.isqrt(n - 1) + 1
        self._a64 = np.uint64(self._a)
        # 2**64 mod a: what a wrapped sum L + F loses modulo a.
        self._wrap_mod_a = np.uint64((1 << 64) % self._a)
        # Sums L + F with F above this can wrap around 2**64 (L < a).
        self._wrap_from = np.uint64((1 << 64) - self._a)
        self._int_keys = [_speck_round_keys(key_seed, j) for j in range(rounds)]
        self._keys = [[np.uint32(k) for k in keys] for keys in self._int_keys]
        self._use_table = self._a <= min(_TABLE_MAX_SIDE, 1 << 31)
        self._tables: list[_U32] | None = None
        self._wraps: list[bool] = []

    @classmethod
    def for_epoch(cls, n: int, shuffle_seed: int | None, epoch: int) -> FeistelPermutation:
        """The permutation GuideLoom 1.1 uses for ``epoch`` of a dataset of ``n`` samples."""
        return cls(n, epoch_key_seed(shuffle_seed, epoch))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.n}, key_seed={self.key_seed}, rounds={self.rounds})"

    @overload
    def __call__(self, positions: int) -> int: ...
    @overload
    def __call__(self, positions: npt.ArrayLike) -> npt.NDArray[np.int64]: ...

    def __call__(self, positions: Any) -> Any:
        """Map positions in ``[0, n)`` to sample ids.

        Args:
            positions: an int, or an integer array of any shape.

        Returns:
            An int for an int, else an int64 array of the same shape.

        Raises:
            IndexError: a position is outside ``[0, n)`` (the message names it).
        """
        return self._apply(positions, "position", inverse=False)

    @overload
    def inverse(self, ids: int) -> int: ...
    @overload
    def inverse(self, ids: npt.ArrayLike) -> npt.NDArray[np.int64]: ...

    def inverse(self, ids: Any) -> Any:
        """Map sample ids in ``[0, n)`` back to their positions (the inverse permutation).

        Args:
            ids: an int, or an integer array of any shape.

        Returns:
            An int for an int, else an int64 array of the same shape.

        Raises:
            IndexError: an id is outside ``[0, n)`` (the message names it).
        """
        return self._apply(ids, "id", inverse=True)

    # -- plumbing -------------------------------------------------------------------------

    def _apply(self, values: Any, what: str, *, inverse: bool) -> Any:
        if isinstance(values, (int, np.integer)):
            value = int(values)
            self._check_range(value, value, what)
            if self._use_table:
                return int(self._walk(np.array([value], dtype=np.uint64), inverse=inverse)[0])
            return self._walk_scalar(value, inverse=inverse)
        arr = np.asarray(values)
        if arr.dtype.kind not in "iu":
            if arr.size:
                raise TypeError(f"{what}s must be integers, got an array of {arr.dtype}")
            arr = arr.astype(np.int64)
        if arr.size:
            self._check_range(int(arr.min()), int(arr.max()), what)
        if not self._use_table and arr.size <= _SMALL:
            # A vectorised Speck pass costs about a millisecond of call overhead; a few
            # values are quicker in plain Python.
            walked = [self._walk_scalar(int(x), inverse=inverse) for x in arr.reshape(-1)]
            return np.array(walked, dtype=np.int64).reshape(arr.shape)
        out = self._walk(arr.astype(np.uint64).reshape(-1), inverse=inverse)
        return out.view(np.int64).reshape(arr.shape)

    def _check_range(self, low: int, high: int, what: str) -> None:
        if low < 0 or high >= self.n:
            bad = low if low < 0 else high
            raise IndexError(f"{what} {bad} is out of range [0, {self.n})")

    # -- plain Python, for a few values at a time ---------------------------------------------

    def _speck_scalar(self, j: int, value: int) -> int:
        """``F_j(value)``, one value in plain Python."""
        lo, hi = value & _MASK32, value >> 32
        for k in self._int_keys[j]:
            hi = (((((hi >> 8) | (hi << 24)) & _MASK32) + lo) & _MASK32) ^ k
            lo = (((lo << 3) | (lo >> 29)) & _MASK32) ^ hi
        return (hi << 32) | lo

    def _walk_scalar(self, value: int, *, inverse: bool) -> int:
        """Cycle-walk one value (forward or inverse) in plain Python."""
        a, odd = self._a, self.rounds % 2 == 1
        # A bijection of [0, a*a) reaches [0, n) within a*a - n + 1 passes.
        for _ in range(a * a - self.n + 1):
            if not inverse:
                right, left = divmod(value, a)
                for j in range(self.rounds):
                    f = self._speck_scalar(j, right)
                    left, right = right, ((left + f) & _MASK64) % a
                value = a * left + right if odd else a * right + left
            else:
                left, right = divmod(value, a) if odd else divmod(value, a)[::-1]
                for j in reversed(range(self.rounds)):
                    left, right = self._inverse_round_scalar(j, left, right), left
                value = a * right + left
            if value < self.n:
                return value
        raise self._not_a_permutation()

    def _inverse_round_scalar(self, j: int, r: int, new: int) -> int:
        """The L with ``(L + F_j(r)) mod 2**64 mod a == new``, in plain Python."""
        a = self._a
        f = self._speck_scalar(j, r)
        old = (new - f) % a
        if (old + f) >> 64:
            # The forward sum wrapped around 2**64 if old L is larger by 2**64 mod a.
            alt = (old + (1 << 64)) % a
            if (alt + f) >> 64:
                old = alt
        return old

    def _not_a_permutation(self) -> RuntimeError:
        return RuntimeError(
            f"cycle walking did not return to [0, {self.n}): key_seed {self.key_seed} does "
            f"not give a permutation for n={self.n} (GuideLoom's construction is only valid "
            "up to about n = 2**48)"
        )

    def _walk(self, v: _U64, *, inverse: bool) -> _U64:
        """Cycle-walk ``v`` (uint64, every value < n); may reuse ``v``'s memory."""
        step = self._inverse_pass if inverse else self._pass
        return _cycle_walk(
            v,
            lambda values, rows: step(values),
            np.uint64(self.n),
            # A bijection of [0, a*a) reaches [0, n) within a*a - n + 1 passes.
            self._a * self._a - self.n,
            lambda rows: self._not_a_permutation(),
        )

    def _get_tables(self) -> tuple[list[_U32], list[bool]]:
        """``F_j(R) mod a`` for every round j and R in ``[0, a)``, built on first use.

        Also says, per round, whether some sum ``L + F_j(R)`` can wrap around ``2**64``
        (then the table, which holds ``F_j mod a``, is not enough and that round is computed
        exactly; this happens with probability about ``a**2 / 2**64``).
        """
        if self._tables is None:
            r = np.arange(self._a, dtype=np.uint64)
            if self._a <= _ROUNDS_TOGETHER:
                # every round's table in one Speck pass over a (rounds, a) array: for a small
                # side the numpy calls are the cost (a pass per round: 1.5 ms an epoch, 0.65
                # this way, at a = 221); for a large one, rows under a column of keys are
                # slower than one row under scalar keys (2x at a = 10,000)
                f = self._speck_rounds(r)
            else:
                f = np.stack([self._speck(r, j) for j in range(self.rounds)])
            self._wraps = [bool((row > self._wrap_from).any()) for row in f]
            np.remainder(f, self._a64, out=f)
            self._tables = list(f.astype(np.uint32))
        return self._tables, self._wraps

    def _speck_rounds(self, r: _U64) -> _U64:
        """``F_j(r)`` of every round ``j`` as the rows of a ``(rounds, len(r))`` uint64
        array, for values ``r < a``: one Speck pass, each row under its round's keys."""
        keys = [np.array(step, dtype=np.uint32)[:, None] for step in zip(*self._int_keys)]
        return _speck_block(np.broadcast_to(r, (self.rounds, len(r))), keys)

    def _speck(self, r: _U64, j: int) -> _U64:
        """``F_j(r)`` (uint64) for values ``r < a``, ``_CHUNK`` values at a time; values
        that span fewer than ``_SMALL`` numbers are computed once each, in plain Python,
        and spread (the first round of a block of consecutive positions: they share one or
        two values of ``R = v // a``)."""
        keys = self._keys[j]
        if r.size > _SMALL:
            low, high = int(r.min()), int(r.max())
            if high - low < _SMALL:
                each = [self._speck_scalar(j, value) for value in range(low, high + 1)]
                return np.take(np.array(each, dtype=np.uint64), r - np.uint64(low))
        if r.size <= _CHUNK:
            return _speck_block(r, keys)
        out = np.empty(r.shape, dtype=np.uint64)
        for start in range(0, r.size, _CHUNK):
            out[start : start + _CHUNK] = _speck_block(r[start : start + _CHUNK], keys)
        return out

    def _pass(self, v: _U64) -> _U64:
        """One forward pass of the Feistel network over ``[0, a*a)``."""
        if self._use_table:
            tables, wraps = self._get_tables()
            exact = self._round_exact if any(wraps) else None
            return _table_pass(
                v, tables, self._a64, np.uint32(self._a), self.rounds % 2 == 1, wraps, exact
            )
        right, left = np.divmod(v, self._a64)
        for j in range(self.rounds):
            f = self._speck(right, j)
            np.add(f, left, out=f)  # wraps modulo 2**64, as GuideLoom's sum does
            np.remainder(f, self._a64, out=f)
            left, right = right, f
        return self._combine(left, right)

    def _round_exact(self, j: int, left: _U32, right: _U32) -> None:
        f = self._speck(right.astype(np.uint64), j)
        np.add(f, left, out=f)
        np.remainder(f, self._a64, out=f)
        left[...] = f

    def _combine(self, left: _U64, right: _U64) -> _U64:
        return _combine(left, right, self._a64, self.rounds % 2 == 1)

    def _inverse_pass(self, v: _U64) -> _U64:
        """Undo one pass: the rounds in reverse order, each solved for the old left half."""
        if self.rounds % 2:
            left, right = np.divmod(v, self._a64)
        else:
            right, left = np.divmod(v, self._a64)
        # Each forward round maps (L, R) to (R, (L + F_j(R)) mod 2**64 mod a): here `left`
        # is the old R and `right` the new value, from which the old L is recovered.
        if self._use_table:
            tables, wraps = self._get_tables()
            a32 = np.uint32(self._a)
            left32 = left.astype(np.uint32)
            right32 = right.astype(np.uint32)
            tmp = np.empty_like(left32)
            for j in reversed(range(self.rounds)):
                if wraps[j]:
                    right32[...] = self._inverse_round_exact(
                        j, left32.astype(np.uint64), right32.astype(np.uint64)
                    )
                else:
                    # right - (F mod a), plus a where that went below zero (it wrapped).
                    np.take(tables[j], left32, out=tmp, mode="wrap")
                    np.subtract(right32, tmp, out=right32)
                    np.add(right32, a32, out=tmp)
                    np.minimum(right32, tmp, out=right32)
                left32, right32 = right32, left32
            left, right = left32.astype(np.uint64), right32.astype(np.uint64)
        else:
            for j in reversed(range(self.rounds)):
                left, right = self._inverse_round_exact(j, left, right), left
        np.multiply(right, self._a64, out=right)
        np.add(right, left, out=right)
        return right

    def _inverse_round_exact(self, j: int, r: _U64, new: _U64) -> _U64:
        """The L with ``(L + F_j(r)) mod 2**64 mod a == new``, computed from Speck."""
        a = self._a64
        f = self._speck(r, j)
        old = np.remainder(f, a)
        # old_L = (new - F) mod a, assuming the forward sum did not wrap around 2**64.
        np.subtract(a, old, out=old)
        np.add(old, new, out=old)
        np.remainder(old, a, out=old)
        risky = np.flatnonzero(f > self._wrap_from)
        if risky.size:
            # The forward sum wrapped iff old_L + F >= 2**64, and then old_L is larger by
            # 2**64 mod a (mod a). Keep the candidate that is consistent.
            fr, cand = f[risky], old[risky]
            alt = (cand + self._wrap_mod_a) % a
            use_alt = (cand + fr < fr) & (alt + fr < fr)
            cand[use_alt] = alt[use_alt]
            old[risky] = cand
        return old
