"""The schedule of a :class:`~guideloom_pipes.mixture.MixtureDataset`: position ``i`` ->
``(component, draw)`` by a Huffman tree over integer weights, and each draw -> the component's
sample by the Feistel permutation of its pass (keyed by a stable hash of the name).

**The schedule.** The weights are realised as integers ``W_c`` over ``D = sum(W)`` (exactly,
when they are ratios of small integers such as 0.7/0.2/0.1; otherwise rounded to
``D = 2**30``). The components are the leaves of a Huffman tree over those integers (the two
lightest nodes are merged first; ties by order). At an inner node ``N`` with children ``L``
and ``R``, the ``m``-th position that reaches ``N`` (``m`` from 0) goes to ``L`` iff
``f(m + 1) > f(m)`` with ``f(m) = floor(m * W_L / W_N + 1/2)``: ``f(m)`` positions of the
first ``m`` went to ``L``, ``m - f(m)`` to ``R`` (each within 1/2 of its share). Over every
prefix of ``k`` positions, with ``q_c = W_c / D``::

    |count_c(k) - k * q_c|  <=  (1 + sum over the inner ancestors A of c, root excluded,
                                 of W_c / W_A) / 2

which is ``<= 1/2`` with two components and ``< 1.68`` with any number (Huffman ancestors
grow at least as the Fibonacci numbers).
:attr:`~guideloom_pipes.mixture.MixtureDataset.prefix_bounds` gives each component's bound.
All arithmetic is on integers (exact, the same on every machine).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import threading
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.shuffle import FeistelPermutation, FeistelStack

if TYPE_CHECKING:
    from guideloom_pipes.mixture import MixtureDataset

_I64 = npt.NDArray[np.int64]
#: The denominator weights are rounded to when they are not ratios of small integers.
_DENOMINATOR = 1 << 30
#: Largest denominator of one weight taken as an exact ratio (0.7 -> 7/10).
_SMALL_DENOMINATOR = 1 << 16
#: Feistel permutations (component, pass) kept by a reader.
_PERMUTATIONS_KEPT = 64


def _name_key(name: str) -> int:
    """A stable 64-bit key of a component name (BLAKE2b, never Python's ``hash()``)."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _pass_key_seed(seed: int, name_key: int, pass_: int) -> int:
    """The Feistel key of one pass of one component: a pure function of its arguments."""
    sequence = np.random.SeedSequence(
        seed, spawn_key=(name_key & 0xFFFFFFFF, name_key >> 32, pass_)
    )
    return int(sequence.generate_state(1, dtype=np.uint64)[0])


def _integer_weights(weights: Sequence[float]) -> list[int]:
    """Integer weights ``W_c`` whose ratios are the given weights' (see the module docstring).

    Exact when every weight is (the float nearest to) a ratio with denominator up to
    ``2**16`` and the common denominator keeps the sum within ``2**30``; otherwise the
    normalised weights rounded to ``2**-30`` by largest remainders.
    """
    fractions = [Fraction(w).limit_denominator(_SMALL_DENOMINATOR) for w in weights]
    if all(abs(float(f) - w) <= 1e-12 * w for f, w in zip(fractions, weights)):
        common = math.lcm(*(f.denominator for f in fractions))
        integers = [int(f * common) for f in fractions]
        divisor = math.gcd(*integers)
        integers = [i // divisor for i in integers]
        if sum(integers) <= _DENOMINATOR:
            return integers
    exact = [Fraction(w) for w in weights]
    total = sum(exact)
    shares = [w * _DENOMINATOR / total for w in exact]
    integers = [math.floor(s) for s in shares]
    left = _DENOMINATOR - sum(integers)
    by_remainder = sorted(range(len(shares)), key=lambda c: (-(shares[c] - integers[c]), c))
    for c in by_remainder[:left]:
        integers[c] += 1
    return integers


def _floor_muldiv(m: np.ndarray, p: Any, q: Any, d: Any) -> _I64:
    """``floor((m * p + q) / d)`` exactly, elementwise, for ``0 <= m < 2**63`` and
    ``0 <= q < d <= 2**31``, ``0 <= p <= 2**31`` (128-bit products done in two halves)."""
    if not len(m) or int(m.max()) < (1 << 31):
        return (m * p + q) // d
    mu = m.astype(np.uint64)
    pu, qu, du = (np.asarray(x).astype(np.uint64) for x in (p, q, d))
    high, low = mu >> np.uint64(32), mu & np.uint64(0xFFFFFFFF)
    quotient_high, rest_high = np.divmod(high * pu, du)  # high * p < 2**62
    # rest_high * 2**32 + low * p + q < 2**64: fits in uint64
    rest = (rest_high << np.uint64(32)) + low * pu + qu
    out = (quotient_high << np.uint64(32)) + rest // du
    return out.astype(np.int64)


class _Schedule:
    """The Huffman-tree schedule of integer weights: position -> (component, draw)."""

    def __init__(self, weights: Sequence[int]) -> None:
        n = len(weights)
        self.num_components = n
        total = 2 * n - 1
        self.weight = np.zeros(total, dtype=np.int64)
        self.weight[:n] = weights
        self.left = np.full(total, -1, dtype=np.int64)
        self.right = np.full(total, -1, dtype=np.int64)
        self.parent = np.full(total, -1, dtype=np.int64)
        heap = [(int(w), c) for c, w in enumerate(weights)]
        heapq.heapify(heap)
        node = n
        while len(heap) > 1:
            w_left, left = heapq.heappop(heap)
            w_right, right = heapq.heappop(heap)
            self.weight[node] = w_left + w_right
            self.left[node], self.right[node] = left, right
            self.parent[left] = self.parent[right] = node
            heapq.heappush(heap, (w_left + w_right, node))
            node += 1
        self.root = heap[0][1]
        self.is_leaf = self.left < 0
        # Per inner node: f(m) = floor((m * 2 W_L + W_N) / (2 W_N)).
        self._p = np.where(self.is_leaf, 0, 2 * self.weight[np.maximum(self.left, 0)])
        self._q = self.weight.copy()
        self._d = 2 * self.weight

    def bound(self, component: int) -> float:
        """This component's prefix bound ``(1 + sum of W_c / W_A) / 2`` (module docstring)."""
        total = Fraction(1)
        node = int(self.parent[component])
        while node >= 0 and node != self.root:
            total += Fraction(int(self.weight[component]), int(self.weight[node]))
            node = int(self.parent[node])
        return float(total / 2)

    def route(self, positions: _I64) -> tuple[_I64, _I64]:
        """``(component, draw)`` of each position: the draw is how many earlier positions
        went to the same component."""
        count = positions.astype(np.int64, copy=True)
        if self.is_leaf[self.root]:
            return np.full(positions.shape, self.root, dtype=np.int64), count
        # counts only shrink down the tree: one check picks exact int64 or 128-bit arithmetic
        small = not len(count) or int(count.max()) < (1 << 31)
        node = np.empty_like(count)
        active: _I64 | None = None  # None: every position (all at the root)
        while True:
            if active is None:
                at: Any = self.root
                m = count
            else:
                at = node[active]
                m = count[active]
            p, q, d = self._p[at], self._q[at], self._d[at]
            if small:
                before = m * p + q
                after = before + p
                before //= d
                after //= d
            else:
                before = _floor_muldiv(m, p, q, d)
                after = _floor_muldiv(m + 1, p, q, d)
            to_left = after > before
            chosen = np.where(to_left, self.left[at], self.right[at])
            drawn = np.where(to_left, before, m - before)
            if active is None:
                node, count = chosen, drawn
                active = np.flatnonzero(~self.is_leaf[chosen])
            else:
                node[active] = chosen
                count[active] = drawn
                active = active[~self.is_leaf[chosen]]
            if not len(active):
                return node, count

    def prefix_counts(self, k: int) -> list[int]:
        """How many of the first ``k`` positions go to each component (exact Python ints)."""
        counts = [0] * len(self.weight)
        counts[self.root] = k
        stack = [self.root]
        while stack:
            node = stack.pop()
            if self.is_leaf[node]:
                continue
            m, w_left = counts[node], int(self.weight[self.left[node]])
            w_node = int(self.weight[node])
            to_left = (2 * m * w_left + w_node) // (2 * w_node)
            counts[int(self.left[node])] = to_left
            counts[int(self.right[node])] = m - to_left
            stack += [int(self.left[node]), int(self.right[node])]
        return counts[: self.num_components]


class _PassPermutations:
    """The Feistel permutations of (component, pass) pairs, applied in one vectorised walk.

    Each pair's :class:`~guideloom_pipes.shuffle.FeistelPermutation` is built on first use
    (at most ``_PERMUTATIONS_KEPT`` are kept); a :class:`~guideloom_pipes.shuffle.FeistelStack`
    of them evaluates every pair of a batch in one call. Thread-safe.
    """

    def __init__(self, dataset: MixtureDataset) -> None:
        self._dataset = dataset
        self._lock = threading.Lock()
        self._slots: dict[tuple[int, int], int] = {}
        self._permutations: list[FeistelPermutation] = []
        self._stack: FeistelStack | None = None

    def _slots_of(self, pairs: list[tuple[int, int]]) -> list[int]:
        """The slots of (component, pass) pairs, building the permutations not kept yet
        (all of them are kept until the call returns, however many)."""
        new = [pair for pair in pairs if pair not in self._slots]
        if new and len(self._permutations) + len(new) > _PERMUTATIONS_KEPT:
            self._slots.clear()
            self._permutations.clear()
            new = pairs
        dataset = self._dataset
        for component, pass_ in new:
            seed = _pass_key_seed(dataset.seed, dataset._keys[component], pass_)
            self._slots[(component, pass_)] = len(self._permutations)
            self._permutations.append(FeistelPermutation(dataset.lengths[component], seed))
            self._stack = None
        return [self._slots[pair] for pair in pairs]

    def apply(self, component: _I64, pass_: _I64, offset: _I64) -> _I64:
        """``perm(component, pass)[offset]`` for each element (int64 arrays of one shape)."""
        if not len(offset):
            return np.empty(0, dtype=np.int64)
        count = len(self._dataset.names)
        key = pass_ * count + component
        pairs, inverse = np.unique(key, return_inverse=True)
        with self._lock:
            wanted = [(k % count, k // count) for k in pairs.tolist()]
            slots = np.array(self._slots_of(wanted), dtype=np.int64)
            if self._stack is None:
                self._stack = FeistelStack(self._permutations)
            stack = self._stack
        return stack(slots[inverse.reshape(-1)], offset)
