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

The package: :mod:`~guideloom_pipes.shuffle.speck` (the round function),
:mod:`~guideloom_pipes.shuffle.passes` (a pass by round tables, cycle walking),
:mod:`~guideloom_pipes.shuffle.feistel` (:class:`FeistelPermutation`, :func:`epoch_key_seed`)
and :mod:`~guideloom_pipes.shuffle.stack` (:class:`FeistelStack`).
"""

from __future__ import annotations

from guideloom_pipes.shuffle.feistel import FeistelPermutation, epoch_key_seed
from guideloom_pipes.shuffle.stack import FeistelStack

__all__ = ["FeistelPermutation", "FeistelStack", "epoch_key_seed"]
