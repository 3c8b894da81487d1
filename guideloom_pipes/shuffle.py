"""The GuideLoom-exact per-epoch shuffle: a Feistel permutation of ``[0, n)``, vectorised.

The shuffled order of an epoch maps a position ``p`` in ``[0, n)`` to the sample id
``perm(p)``. It is reproduced bit for bit from GuideLoom 1.1 (SPEC §5, "Shuffle"):

* **Seeding.** Epoch ``e`` draws ``key_seed`` from
  ``Generator(Philox(SeedSequence(shuffle_seed, spawn_key=(e,)))).integers(0, 2**32,
  dtype=uint64)`` (:func:`epoch_key_seed`); ``shuffle_seed=None`` draws fresh entropy.
* **Domain.** The positions are laid on a square of side ``a = isqrt(n - 1) + 1``
  (``a * a >= n``): ``v = a * R + L``.
* **Round function.** Round ``j`` keys Speck64/128 with the 128-bit key whose 32-bit words,
  low to high, are ``key_seed & 0xffffffff``, ``key_seed >> 32``, ``j & 0xffffffff`` and
  ``j >> 32`` (the standard 27-step Speck64/128 key schedule), and ``F_j(R)`` is the Speck64
  encryption of the 64-bit block ``R``.
* **One pass.** ``L, R = v mod a, v // a``; for each round ``j``:
  ``L, R = R, ((L + F_j(R)) mod 2**64) mod a``; the result is ``a * L + R`` (5 rounds, an
  odd count; ``a * R + L`` for an even count).
* **Cycle walking.** A pass permutes ``[0, a*a)``; values that land in ``[n, a*a)`` are
  passed again until they fall below ``n``. :meth:`FeistelPermutation.inverse` undoes the
  passes the same way.

Validity: the sum ``L + F_j(R)`` wraps modulo ``2**64`` before the reduction modulo ``a``,
which makes a round non-invertible with probability about ``a / 2**64`` per round key and
value of ``R``, so about ``5 n / 2**64`` in all. GuideLoom's order is therefore a permutation
only with overwhelming probability, for ``n`` up to about ``2**48``; beyond that it is not
guaranteed (we reproduce it anyway, wrap-around included). Should a key fail to give a
permutation so that cycle walking cannot return below ``n``, a ``RuntimeError`` says so
instead of looping forever.

Speed: ``F_j`` only ever sees ``R < a``, and ``a`` is about ``sqrt(n)``. When ``a`` is small
(``a <= _TABLE_MAX_SIDE = 2**17``, so ``n`` up to about ``1.7e10``) the values
``F_j(R) mod a`` of all rounds are tabulated on first use (``rounds * a`` 32-bit words), so
a pass is a few gathers, additions and comparisons.
Otherwise Speck runs vectorised on uint32 arrays, a chunk of positions at a time (and in
plain Python for a handful of values, where numpy's per-call overhead dominates). Nothing of
the size of the dataset is ever allocated; compute blocks of thousands of positions per call,
as each call has a fixed overhead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt

__all__ = ["FeistelPermutation", "FeistelStack", "epoch_key_seed"]

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_SPECK_STEPS = 27
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

_U64 = npt.NDArray[np.uint64]
_U32 = npt.NDArray[np.uint32]


def _rol32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _ror32(x: int, r: int) -> int:
    return ((x >> r) | (x << (32 - r))) & _MASK32


def _speck_round_keys(key_seed: int, j: int) -> list[int]:
    """The 27 Speck64/128 round keys of Feistel round ``j``."""
    b = key_seed & _MASK32
    words = [(key_seed >> 32) & _MASK32, j & _MASK32, (j >> 32) & _MASK32]
    keys = [b]
    for i in range(_SPECK_STEPS - 1):
        x = ((_ror32(words[i % 3], 8) + b) & _MASK32) ^ i
        b = _rol32(b, 3) ^ x
        words[i % 3] = x
        keys.append(b)
    return keys


def _speck_block(values: _U64, keys: Sequence[Any]) -> _U64:
    """Speck64 encryption of blocks ``values < 2**32`` (so the high word starts at 0), under
    the round keys ``keys``: uint32 scalars, or arrays that broadcast against ``values``
    (a column of keys per row of a 2-D ``values``)."""
    lo = values.astype(np.uint32)
    t = np.empty_like(lo)
    # Step 0 with hi = 0: hi = (ror(0, 8) + lo) ^ k0.
    hi = np.bitwise_xor(lo, keys[0])
    np.right_shift(lo, 29, out=t)
    np.left_shift(lo, 3, out=lo)
    np.bitwise_or(lo, t, out=lo)
    np.bitwise_xor(lo, hi, out=lo)
    for k in keys[1:]:
        np.right_shift(hi, 8, out=t)
        np.left_shift(hi, 24, out=hi)
        np.bitwise_or(hi, t, out=hi)
        np.add(hi, lo, out=hi)
        np.bitwise_xor(hi, k, out=hi)
        np.right_shift(lo, 29, out=t)
        np.left_shift(lo, 3, out=lo)
        np.bitwise_or(lo, t, out=lo)
        np.bitwise_xor(lo, hi, out=lo)
    out = hi.astype(np.uint64)
    np.left_shift(out, np.uint64(32), out=out)
    np.bitwise_or(out, lo, out=out)
    return out


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
    same shape). See the module docstring for the construction.

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


class FeistelStack:
    """Several :class:`FeistelPermutation` applied in one call, each element by its own.

    ``stack(which, positions)`` maps ``positions[i]`` by ``permutations[which[i]]``, exactly
    as that permutation's own call does. The round tables of the permutations that have
    them are laid end to end, so a batch that mixes many permutations costs the few numpy
    operations of one; a permutation without tables (side ``a > 2**17``) or with a round
    whose sum can wrap around ``2**64`` is called by itself on its elements. Immutable once
    built (the tables are built here), so one stack may serve several threads.

    Args:
        permutations: the permutations, numbered by their order (at least one; all with
            the same number of rounds).
    """

    permutations: tuple[FeistelPermutation, ...]

    def __init__(self, permutations: Sequence[FeistelPermutation]) -> None:
        self.permutations = tuple(permutations)
        if not self.permutations:
            raise ValueError("FeistelStack needs at least one permutation, got none")
        rounds = sorted({p.rounds for p in self.permutations})
        if len(rounds) > 1:
            raise ValueError(
                f"the permutations of a FeistelStack must have the same number of rounds, "
                f"got {rounds}; stack those with the same count together"
            )
        self._odd = rounds[0] % 2 == 1
        fast = [p._use_table and not any(p._get_tables()[1]) for p in self.permutations]
        self._fast = np.array(fast, dtype=bool)
        # A permutation served by itself keeps a placeholder of side 1 in the stack.
        sides = [p._a if f else 1 for p, f in zip(self.permutations, fast)]
        self._offsets = np.zeros(len(sides), dtype=np.uint64)
        np.cumsum(sides[:-1], out=self._offsets[1:])
        self._tables = [
            np.concatenate(
                [
                    p._get_tables()[0][j] if f else np.zeros(1, np.uint32)
                    for p, f in zip(self.permutations, fast)
                ]
            )
            for j in range(rounds[0])
        ]
        self._side64 = np.array(sides, dtype=np.uint64)
        self._side32 = self._side64.astype(np.uint32)
        self._sizes = np.array([p.n for p in self.permutations], dtype=np.uint64)
        # Cycle walking of any stacked permutation ends within this many passes after the
        # first (see FeistelPermutation._walk).
        self._budget = max(
            (p._a * p._a - p.n for p, f in zip(self.permutations, fast) if f), default=0
        )

    def __len__(self) -> int:
        return len(self.permutations)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.permutations)} permutations)"

    def __call__(self, which: npt.ArrayLike, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Map each position by the permutation ``which`` names.

        Args:
            which: the permutation of each element, an integer array of numbers in
                ``[0, len(stack))``.
            positions: an integer array of the shape of ``which``, each in ``[0, n)`` of
                its permutation.

        Returns:
            The sample ids, an int64 array of that shape.

        Raises:
            IndexError: a number or a position is out of range (the message names it).
        """
        slot = np.asarray(which)
        given = np.asarray(positions)
        if slot.shape != given.shape:
            raise ValueError(
                f"which and positions must have the same shape, got {slot.shape} and {given.shape}"
            )
        for name, arr in (("which", slot), ("positions", given)):
            if arr.size and arr.dtype.kind not in "iu":
                raise TypeError(f"{name} must be integers, got an array of {arr.dtype}")
        shape = given.shape
        slot = slot.reshape(-1).astype(np.int64, copy=False)
        offset = given.reshape(-1).astype(np.int64, copy=False)
        if not offset.size:
            return np.empty(shape, dtype=np.int64)
        self._check(slot, offset)
        quick = self._fast[slot]
        if quick.all():
            return self._walk(slot, offset).view(np.int64).reshape(shape)
        out = np.empty(len(offset), dtype=np.int64)
        for s in np.unique(slot[~quick]).tolist():
            rows = np.flatnonzero(slot == s)
            out[rows] = self.permutations[s](offset[rows])
        rows = np.flatnonzero(quick)
        if len(rows):
            out[rows] = self._walk(slot[rows], offset[rows]).view(np.int64)
        return out.reshape(shape)

    def _check(self, slot: npt.NDArray[np.int64], offset: npt.NDArray[np.int64]) -> None:
        low, high = int(slot.min()), int(slot.max())
        if low < 0 or high >= len(self.permutations):
            bad = low if low < 0 else high
            raise IndexError(
                f"permutation {bad} is out of range [0, {len(self.permutations)}) of this stack"
            )
        outside = (offset < 0) | (offset.astype(np.uint64) >= self._sizes[slot])
        if outside.any():
            i = int(np.flatnonzero(outside)[0])
            raise IndexError(
                f"position {int(offset[i])} is out of range [0, {int(self._sizes[slot[i]])}) "
                f"of permutation {int(slot[i])}"
            )

    def _walk(self, slot: npt.NDArray[np.int64], offset: npt.NDArray[np.int64]) -> _U64:
        """Cycle-walk positions of stacked permutations (each ``slot`` has tables)."""
        tables, odd = self._tables, self._odd
        offsets, side64, side32 = self._offsets[slot], self._side64[slot], self._side32[slot]

        def step(values: _U64, rows: npt.NDArray[np.intp] | None) -> _U64:
            if rows is None:
                return _table_pass(values, tables, side64, side32, odd, offset=offsets)
            return _table_pass(
                values, tables, side64[rows], side32[rows], odd, offset=offsets[rows]
            )

        def fail(rows: npt.NDArray[np.intp]) -> RuntimeError:
            return self.permutations[int(slot[rows[0]])]._not_a_permutation()

        return _cycle_walk(offset.astype(np.uint64), step, self._sizes[slot], self._budget, fail)


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
