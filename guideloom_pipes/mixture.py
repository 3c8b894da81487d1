"""Weighted mixtures: ``MixtureDataset``, a blend of map-style datasets in set proportions.

Position ``i`` of a mixture maps to ``(component, draw)`` by a deterministic schedule that
needs O(number of components) memory and O(depth) vectorised arithmetic per lookup; no array
of ``num_samples`` entries is ever built. Component ``c``'s ``j``-th draw is its sample
``perm(seed, key(name), pass=j // len_c)[j % len_c]`` (GuideLoom's Feistel permutation, keyed
by a stable hash of the name), so an upsampled component uses all its samples before any
repeats. See ``docs/mixtures.md`` for the semantics and the proof of the prefix bound.

The schedule (a Huffman tree over the weights realised as integers, and its prefix bound) is
:mod:`guideloom_pipes.mixture_schedule`'s; the reader, :mod:`guideloom_pipes.mixture_reader`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.checks import check_int
from guideloom_pipes.mixture_reader import _SAMPLE, MixtureReader, _array_dtypes
from guideloom_pipes.mixture_schedule import (
    _integer_weights,
    _name_key,
    _PassPermutations,
    _Schedule,
)
from guideloom_pipes.reader_base import _as_ids, _AsyncDatasetReader, batch_read_fn, open_reader

__all__ = ["MixtureDataset"]

_I64 = npt.NDArray[np.int64]
#: Bound of ``num_samples``: ``len()`` and the positions are int64.
_MAX_SAMPLES = 1 << 63


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
        #: the realised proportions ``W_c / D`` (:mod:`guideloom_pipes.mixture_schedule`), by name
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
