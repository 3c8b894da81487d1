"""Weighted mixtures: ``MixtureDataset``, a blend of map-style datasets in set proportions.

Position ``i`` of a mixture maps to ``(component, draw)`` by a deterministic schedule that
needs O(number of components) memory and O(depth) vectorised arithmetic per lookup; no array
of ``num_samples`` entries is ever built. Component ``c``'s ``j``-th draw is its sample
``perm(seed, key(name), pass=j // len_c)[j % len_c]`` (GuideLoom's Feistel permutation, keyed
by a stable hash of the name), so an upsampled component uses all its samples before any
repeats. See ``docs/mixtures.md`` for the semantics and the proof of the prefix bound.

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
grow at least as the Fibonacci numbers). :attr:`MixtureDataset.prefix_bounds` gives each
component's bound. All arithmetic is on integers (exact, the same on every machine).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.batch import Batch
from guideloom_pipes.checks import check_int
from guideloom_pipes.datasets import (
    DatasetReaderBase,
    _as_ids,
    _AsyncDatasetReader,
    batch_read_fn,
    open_reader,
    reader_code,
    reader_fingerprint,
)
from guideloom_pipes.shuffle import FeistelPermutation, FeistelStack

__all__ = ["MixtureDataset"]

_I64 = npt.NDArray[np.int64]
#: The denominator weights are rounded to when they are not ratios of small integers.
_DENOMINATOR = 1 << 30
#: Largest denominator of one weight taken as an exact ratio (0.7 -> 7/10).
_SMALL_DENOMINATOR = 1 << 16
#: Bound of ``num_samples``: ``len()`` and the positions are int64.
_MAX_SAMPLES = 1 << 63
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
        count = self._dataset._schedule.num_components
        key = pass_ * count + component
        pairs, inverse = np.unique(key, return_inverse=True)
        with self._lock:
            wanted = [(k % count, k // count) for k in pairs.tolist()]
            slots = np.array(self._slots_of(wanted), dtype=np.int64)
            if self._stack is None:
                self._stack = FeistelStack(self._permutations)
            stack = self._stack
        return stack(slots[inverse.reshape(-1)], offset)


def _check_seed(seed: Any) -> int:
    return check_int("seed", seed, minimum=0)


def _check_weights(names: list[str], weights: Any) -> list[float]:
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"weights must be a mapping name -> weight with the components' names {names}, "
            f"got {type(weights).__name__}"
        )
    missing = [name for name in names if name not in weights]
    extra = [name for name in weights if name not in names]
    if missing or extra:
        raise ValueError(
            f"weights must have exactly the components' names {names}: "
            + "; ".join(
                part
                for part in (
                    f"missing {missing}" if missing else "",
                    f"unknown {extra}" if extra else "",
                )
                if part
            )
        )
    out = []
    for name in names:
        value = weights[name]
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"weight of {name!r} must be a number > 0, got {value!r}")
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"weight of {name!r} must be finite and > 0, got {value!r}; drop the component "
                f"instead of giving it weight 0"
            )
        out.append(value)
    return out


def _field_signature(value: Any, fixed: bool) -> str:
    if isinstance(value, np.ndarray):
        shape = f"shape {value.shape}" if fixed else f"{value.ndim}-D"
        return f"{value.dtype} {shape}"
    return type(value).__name__


def _signature(sample: Any, fixed: bool) -> dict[str, str]:
    if isinstance(sample, Mapping):
        return {str(key): _field_signature(value, fixed) for key, value in sample.items()}
    return {_SAMPLE: _field_signature(sample, fixed)}


def _is_fixed_length(dataset: Any) -> bool:
    if isinstance(dataset, MixtureDataset):
        return dataset._fixed
    return hasattr(dataset, "sequence_length")


class MixtureDataset:
    """A blend of map-style datasets in set proportions; itself a map-style dataset.

    Position ``i`` is a pure function of ``(seed, i)``: the schedule picks its component
    (over every prefix of ``k`` positions each component ``c`` has ``k * w_c`` positions,
    within :attr:`prefix_bounds`: <= 1/2 with two components, < 1.68 with any number) and
    how many draws of that component came before it, ``j``; the sample is
    ``perm(seed, name, pass=j // len_c)[j % len_c]`` with GuideLoom's Feistel permutation.
    The loader's shuffle reorders positions per epoch, so ``StatefulDataLoader(mixture,
    ...)`` and its ``state_dict()`` resume a blend exactly, on another world size too.

    Component lengths are read once, here; a reader refuses components whose length has
    changed since (build the mixture again: see ``docs/mixtures.md``). Samples of all
    components must have the same fields and dtypes (and shapes, for fixed-length
    components such as ``StreamDataset`` and ``PackedDataset``): a mismatch is a
    ``ValueError`` naming the components and the fields.

    Args:
        components: name -> map-style dataset (ours, with ``sync_reader()``; any object
            with ``len`` and ``[i]``; or another ``MixtureDataset``). The order of the
            mapping numbers the components (``locate`` returns these numbers).
        weights: name -> weight, exactly the names of ``components``; each finite and > 0
            (normalised to sum to 1).
        seed: An int >= 0; fixes the Feistel permutation of every pass of every component.
        num_samples: Length of the mixture; ``None`` is the sum of the components' lengths.
            Set it to cover a run that should see more of a downsampled component.
    """

    def __init__(
        self,
        components: Mapping[str, Any],
        weights: Mapping[str, float],
        *,
        seed: int,
        num_samples: int | None = None,
    ) -> None:
        if not isinstance(components, Mapping) or not components:
            raise TypeError(
                "components must be a non-empty mapping name -> dataset, e.g. "
                f"{{'web': web, 'code': code}}, got {components!r}"
            )
        names = list(components)
        bad_names = [name for name in names if not isinstance(name, str)]
        if bad_names:
            raise TypeError(
                f"component names must be str (they key each component's passes), got {bad_names!r}"
            )
        self.seed = _check_seed(seed)
        self.names: list[str] = names
        self.components: dict[str, Any] = dict(components)
        given = _check_weights(names, weights)
        self._integer_weights = _integer_weights(given)
        tiny = [c for c, w in enumerate(self._integer_weights) if w == 0]
        if tiny:
            raise ValueError(
                f"weight of {names[tiny[0]]!r} is below 2**-30 of the total ({given[tiny[0]]!r} "
                f"of {sum(given)!r}): the schedule cannot give it a share; raise it or drop the "
                f"component"
            )
        denominator = sum(self._integer_weights)
        #: the realised proportions ``W_c / D`` (module docstring), by name
        self.weights: dict[str, float] = {
            name: w / denominator for name, w in zip(names, self._integer_weights)
        }
        self._schedule = _Schedule(self._integer_weights)
        #: each component's bound on ``|count_c(k) - k * w_c|`` over every prefix ``k``
        self.prefix_bounds: dict[str, float] = {
            name: self._schedule.bound(c) for c, name in enumerate(names)
        }
        self._keys = [_name_key(name) for name in names]
        #: field (``"(sample)"`` for an array sample) -> dtype of the first component's
        #: sample 0: every batch's samples are checked against it (``MixtureReader``)
        self._dtypes: dict[str, np.dtype[Any]] = {}
        self._fixed = all(_is_fixed_length(self.components[name]) for name in names)
        self.lengths: list[int] = self._check_components()
        self._lengths_array = np.array(self.lengths, dtype=np.int64)
        num_samples = check_int("num_samples", num_samples, minimum=1, allow_none=True)
        if num_samples is None:
            num_samples = sum(self.lengths)
        if num_samples >= _MAX_SAMPLES:
            raise ValueError(
                f"num_samples must be < 2**63 (a dataset's len() and positions are int64), "
                f"got {num_samples}"
            )
        self.num_samples = int(num_samples)

    def _check_components(self) -> list[int]:
        """Each component's length, after checking its samples' fields agree."""
        lengths: list[int] = []
        first: tuple[str, dict[str, str]] | None = None
        for name in self.names:
            reader, opened = open_reader(self.components[name])
            try:
                length = len(reader)
                if length < 1:
                    raise ValueError(
                        f"component {name!r} is empty (0 samples); drop it or write its data"
                    )
                sample = batch_read_fn(reader)(np.zeros(1, dtype=np.int64))[0]
            finally:
                if opened:
                    reader.close()
            lengths.append(length)
            signature = _signature(sample, self._fixed)
            if first is None:
                first = (name, signature)
                self._dtypes = _array_dtypes(sample)
                continue
            other, expected = first
            if signature != expected:
                fields = sorted(
                    key
                    for key in set(signature) | set(expected)
                    if signature.get(key) != expected.get(key)
                )
                detail = "; ".join(
                    f"{key!r}: {expected.get(key, 'absent')} in {other!r}, "
                    f"{signature.get(key, 'absent')} in {name!r}"
                    for key in fields
                )
                raise ValueError(
                    f"components {other!r} and {name!r} have samples with different fields "
                    f"({detail}); mix components whose samples have the same fields and dtypes "
                    f"(and, for windows, the same sequence_length)"
                )
        return lengths

    # -- the map-style dataset ---------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    @property
    def sequence_length(self) -> int | None:
        """The components' ``sequence_length`` when they all have the same one, else None."""
        values = {getattr(self.components[n], "sequence_length", None) for n in self.names}
        value = values.pop() if len(values) == 1 else None
        return value if isinstance(value, int) else None

    def sync_reader(self) -> MixtureReader:
        """A reader (context manager) with ``len``, ``[i]``, slices and ``read_batch(ids)``."""
        return MixtureReader(self)

    def async_reader(self) -> _AsyncDatasetReader:
        """An ``async`` reader (``async with``) with ``read`` and ``read_batch``."""
        return _AsyncDatasetReader(MixtureReader(self))

    def __getitem__(self, index: int | slice) -> Any:
        """Sample ``index`` (or a list for a slice), through a reader opened for this call;
        use :meth:`sync_reader` for many reads."""
        with self.sync_reader() as reader:
            return reader[index]

    def read_batch(self, ids: Sequence[int] | np.ndarray) -> list[Any]:
        """The samples at ``ids``, through a reader opened for this call.

        Args:
            ids: Positions of the mixture, an integer array or sequence in ``[0, len)``.
        """
        with self.sync_reader() as reader:
            return reader.read_batch(ids)

    def __iter__(self) -> Iterator[Any]:
        with self.sync_reader() as reader:
            yield from reader

    def _check_ids(self, ids: Any) -> _I64:
        return _as_ids(ids, self.num_samples)

    def locate(self, ids: int | npt.ArrayLike) -> tuple[_I64, _I64]:
        """Where positions come from: ``(component numbers, sample indexes in them)``.

        Args:
            ids: A position or an integer array of positions in ``[0, len)``.

        Returns:
            Two int64 arrays of the shape of ``ids``: the component's number (the order of
            ``components``; for a nested mixture, the top-level component) and the sample's
            index in that component.

        Raises:
            IndexError: A position outside ``[0, len)`` (the message names it).
        """
        shape = np.shape(ids)
        flat = self._check_ids(np.reshape(np.asarray(ids), -1) if shape else [ids])
        component, draw = self._schedule.route(flat)
        index = self._sample_indexes(component, draw, _PassPermutations(self))
        return component.reshape(shape), index.reshape(shape)

    def _sample_indexes(self, component: _I64, draw: _I64, passes: _PassPermutations) -> _I64:
        """Component sample index of each (component, draw): the draw's pass, permuted."""
        lengths = self._lengths_array[component]
        pass_, offset = np.divmod(draw, lengths)
        return passes.apply(component, pass_, offset)

    def schedule_state(self) -> dict[str, Any]:
        """What fixes the schedule besides the components: ``{"seed": ..., "weights":
        {name: realised weight, ...}}`` (in the components' order), and ``"components"``:
        name -> this dict of each nested ``MixtureDataset``. A loader's ``state_dict()``
        records it, and ``load_state_dict`` refuses a state taken with another one."""
        state: dict[str, Any] = {"seed": self.seed, "weights": dict(self.weights)}
        nested = {
            name: component.schedule_state()
            for name, component in self.components.items()
            if isinstance(component, MixtureDataset)
        }
        if nested:
            state["components"] = nested
        return state

    def prefix_counts(self, k: int) -> dict[str, int]:
        """How many of positions ``0 .. k-1`` each component gets (exact).

        Args:
            k: The prefix length, >= 0 (may exceed ``len``: the schedule goes on).

        Returns:
            name -> count; the counts sum to ``k``.
        """
        k = check_int("k", k, minimum=0)
        return dict(zip(self.names, self._schedule.prefix_counts(k)))

    def __repr__(self) -> str:
        parts = ", ".join(f"{n!r}: {self.weights[n]:.4g}" for n in self.names)
        return f"MixtureDataset({{{parts}}}, seed={self.seed}, num_samples={self.num_samples})"


class MixtureReader(DatasetReaderBase):
    """Reader of a :class:`MixtureDataset`: opens a reader of every component.

    ``read_batch(ids)`` routes the ids (vectorised), reads each component's share with one
    call of that component's reader (its ``read_batch`` when it has one), and returns the
    samples in the order of ``ids``. Thread-safe when the components' readers are.
    """

    def __init__(self, dataset: MixtureDataset) -> None:
        super().__init__(None)
        self.dataset = dataset
        self._readers: list[tuple[Any, bool]] = []
        self._reads: list[Callable[[_I64], list[Any]]] = []
        self._array_reads: list[Callable[[_I64], Any]] = []
        self._passes = _PassPermutations(dataset)

    def open(self) -> None:
        """Open every component's reader and check its length is the one the mixture knows."""
        if self._length >= 0:
            return
        dataset = self.dataset
        opened: list[tuple[Any, bool]] = []
        try:
            for c, name in enumerate(dataset.names):
                reader, own = open_reader(dataset.components[name])
                opened.append((reader, own))
                now = len(reader)
                if now != dataset.lengths[c]:
                    raise ValueError(
                        f"component {name!r} has {now} samples now, {dataset.lengths[c]} when "
                        f"this MixtureDataset was built: its passes would refer to other "
                        f"samples. Build the MixtureDataset again (docs/mixtures.md, 'When a "
                        f"component changes size')"
                    )
        except BaseException:
            for reader, own in opened:
                if own:
                    reader.close()
            raise
        self._readers = opened
        self._reads = [batch_read_fn(reader) for reader, _ in opened]
        self._array_reads = [batch_read_fn(reader, arrays=True) for reader, _ in opened]
        self._length = dataset.num_samples

    def code_parts(self) -> list[Any]:
        """Itself and what its components' readers run."""
        return [self] + [part for reader, _ in self._readers for part in reader_code(reader)]

    def fingerprint(self) -> dict[str, Any] | None:
        """Each component's fingerprint by name (``None`` if one cannot tell)."""
        self._check_open()
        parts = [reader_fingerprint(reader) for reader, _ in self._readers]
        if any(part is None for part in parts):
            return None
        return {"components": dict(zip(self.dataset.names, parts))}

    def close(self) -> None:
        """Close the component readers this reader opened."""
        readers, self._readers, self._reads = self._readers, [], []
        self._array_reads = []
        for reader, own in readers:
            if own:
                reader.close()
        self._length = -1

    def _compute_length(self) -> int:
        return self.dataset.num_samples

    def read_batch(self, ids: Sequence[int] | np.ndarray) -> list[Any]:
        """The samples at ``ids`` (positions of the mixture), in that order.

        Args:
            ids: An integer array or sequence of positions in ``[0, len)``; one out of range
                raises ``IndexError`` naming it.
        """
        return self._read(ids, arrays=False)

    def read_arrays(self, ids: Sequence[int] | np.ndarray) -> Batch | list[Any]:
        """The samples at ``ids`` as a :class:`~guideloom_pipes.batch.Batch` when every
        component's share comes as one (with the same columns: their rows gathered back
        into the order of ``ids``), else as :meth:`read_batch`'s list."""
        return self._read(ids, arrays=True)

    def _read(self, ids: Sequence[int] | np.ndarray, arrays: bool) -> Any:
        self._check_open()
        dataset = self.dataset
        positions = dataset._check_ids(ids)
        component, draw = dataset._schedule.route(positions)
        indexes = dataset._sample_indexes(component, draw, self._passes)
        reads = self._array_reads if arrays else self._reads
        if dataset._schedule.num_components == 1:
            found = reads[0](indexes)
            self._check_dtypes(found, 0, indexes)
            return found if type(found) is Batch else list(found)
        # group the rows by component (one read each), then put the samples back in order
        order = np.argsort(component, kind="stable")
        ends = np.cumsum(np.bincount(component, minlength=len(self._reads))).tolist()
        parts: list[Any] = []
        slots: list[_I64] = []
        start = 0
        for c, end in enumerate(ends):
            if end > start:
                drawn = indexes[order[start:end]]
                parts.append(reads[c](drawn))
                self._check_dtypes(parts[-1], c, drawn)
                slots.append(order[start:end])
            start = end
        if arrays and _same_columns(parts) and sum(map(len, parts)) == len(positions):
            # each component's rows copied once, straight to their places in the batch
            columns = {}
            for name, column in parts[0].columns.items():
                out = np.empty((len(positions), *column.shape[1:]), dtype=column.dtype)
                for part, slot in zip(parts, slots):
                    out[slot] = part.columns[name]
                columns[name] = out
            return Batch.of_columns(columns)
        where = np.empty_like(order)
        where[order] = np.arange(len(order))
        grouped: list[Any] = []
        for part in parts:
            grouped += part.samples() if type(part) is Batch else part
        if len(grouped) != len(positions):
            raise RuntimeError(
                f"a component's reader returned {len(grouped)} samples for {len(positions)} ids"
            )
        return list(map(grouped.__getitem__, where.tolist()))

    def _check_dtypes(self, part: Any, component: int, indexes: _I64) -> None:
        """Refuse a component's samples (at ``indexes``) whose arrays have another dtype than
        the mixture's first sample: a batch of both would be promoted to a third dtype.
        One dtype comparison per array field of each sample (per column for columns)."""
        expected = self.dataset._dtypes
        if not expected:
            return
        if type(part) is Batch and part.columns is not None:
            for field, column in part.columns.items():
                want = expected.get(field)
                if want is not None and column.dtype != want:
                    self._wrong_dtype(component, int(indexes[0]), field, column.dtype, want)
            return
        rows = part.rows if type(part) is Batch else part
        assert rows is not None
        for field, want in expected.items():
            try:  # the quick way: samples of the first one's kind
                if field == _SAMPLE:
                    same = all([sample.dtype == want for sample in rows])
                else:
                    same = all([sample[field].dtype == want for sample in rows])
            except (AttributeError, KeyError, IndexError, TypeError):
                same = False
            if not same:
                self._find_wrong_dtype(rows, component, indexes, field, want)

    def _find_wrong_dtype(
        self, rows: Sequence[Any], component: int, indexes: _I64, field: str, want: Any
    ) -> None:
        """Raise for the first of ``rows`` whose ``field`` is not an array of ``want``."""
        for k, sample in enumerate(rows):
            if field == _SAMPLE:
                value = sample
            elif isinstance(sample, Mapping):
                value = sample.get(field)
            else:
                continue  # (its fields were checked once; a sample of another kind fails later)
            if getattr(value, "dtype", None) != want:
                self._wrong_dtype(component, int(indexes[k]), field, value, want)

    def _wrong_dtype(
        self, component: int, index: int, field: str, got: Any, want: np.dtype[Any]
    ) -> None:
        dataset = self.dataset
        if not isinstance(got, np.dtype):
            dtype = getattr(got, "dtype", None)
            got = dtype if isinstance(dtype, np.dtype) else f"none ({type(got).__name__})"
        what = "the sample" if field == _SAMPLE else f"field {field!r}"
        raise ValueError(
            f"component {dataset.names[component]!r} sample {index}: {what} has dtype {got}, "
            f"the mixture's samples have {want} (sample 0 of {dataset.names[0]!r}); a batch "
            f"of both would silently become another dtype. Write every document of a "
            f"component with one dtype, or cast them in a dataset that wraps the component"
        )


#: The field name of a sample that is one array (``_signature``'s).
_SAMPLE = "(sample)"


def _array_dtypes(sample: Any) -> dict[str, np.dtype[Any]]:
    """The dtype of each array field of ``sample`` (``"(sample)"``: the sample itself)."""
    if isinstance(sample, np.ndarray):
        return {_SAMPLE: sample.dtype}
    if isinstance(sample, Mapping):
        return {str(k): v.dtype for k, v in sample.items() if isinstance(v, np.ndarray)}
    return {}


def _same_columns(parts: list[Any]) -> bool:
    """Whether ``parts`` are all batches of columns with the same names, dtypes and shapes
    past the batch axis (so that they stack)."""
    first = parts[0]
    if type(first) is not Batch or first.columns is None:
        return False
    shape = {name: (c.dtype, c.shape[1:]) for name, c in first.columns.items()}
    return all(
        type(part) is Batch
        and part.columns is not None
        and {name: (c.dtype, c.shape[1:]) for name, c in part.columns.items()} == shape
        for part in parts
    )
