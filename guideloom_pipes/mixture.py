"""Weighted mixtures: ``MixtureDataset``, a blend of map-style datasets in set proportions.

Position ``i`` of a mixture maps to ``(component, draw)`` by a deterministic schedule that
needs O(number of components) memory and O(depth) vectorised arithmetic per lookup; no array
of ``num_samples`` entries is ever built. Component ``c``'s ``j``-th draw is its sample
``perm(seed, key(name), pass=j // len_c)[j % len_c]`` (GuideLoom's Feistel permutation, keyed
by a stable hash of the name), so an upsampled component uses all its samples before any
repeats. See ``docs/mixtures.md`` for the semantics and the proof of the prefix bound.

The schedule (a Huffman tree over the weights realised as integers, and its prefix bound) is
:mod:`guideloom_pipes.mixture_schedule`'s; weights that change with the position
(:class:`~guideloom_pipes.mixture_weights.WeightSchedule`, and the history a resumed run keeps)
are :mod:`guideloom_pipes.mixture_weights`'s, routed by :mod:`guideloom_pipes.mixture_routing`;
the reader, :mod:`guideloom_pipes.mixture_reader`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.checks import check_int
from guideloom_pipes.mixture_reader import _SAMPLE, MixtureReader, _array_dtypes
from guideloom_pipes.mixture_routing import Routing
from guideloom_pipes.mixture_schedule import _name_key, _PassPermutations, _Schedule
from guideloom_pipes.mixture_weights import (
    Part,
    WeightSchedule,
    history_state,
    part_of,
    parts_of_state,
    resumed_parts,
)
from guideloom_pipes.reader_base import _as_ids, _AsyncDatasetReader, batch_read_fn, open_reader

__all__ = ["MixtureDataset"]

_I64 = npt.NDArray[np.int64]
#: Bound of ``num_samples``: ``len()`` and the positions are int64.
_MAX_SAMPLES = 1 << 63


def _check_seed(seed: Any) -> int:
    return check_int("seed", seed, minimum=0)


def _field_signature(value: Any, fixed: bool) -> str:
    if isinstance(value, np.ndarray):
        shape = f"shape {value.shape}" if fixed else f"{value.ndim}-D"
        return f"{value.dtype} {shape}"
    return type(value).__name__


def _signature(sample: Any, fixed: bool) -> dict[str, str]:
    if isinstance(sample, Mapping):
        return {str(key): _field_signature(value, fixed) for key, value in sample.items()}
    return {_SAMPLE: _field_signature(sample, fixed)}


def _check_schedule_length(schedule: WeightSchedule, num_samples: int | None) -> None:
    """A schedule's points must fall within the run: ``num_samples`` given, and above them."""
    if num_samples is None:
        raise ValueError(
            "a WeightSchedule needs num_samples: its points are positions of the run, so "
            "the run's length must be set (e.g. steps * global batch size)"
        )
    last = schedule.points[-1][0]
    if last >= num_samples:
        raise ValueError(
            f"the WeightSchedule has a point at position {last}, at or after num_samples="
            f"{num_samples}: it would never apply. Drop it, or raise num_samples to cover it"
        )


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
    ...)`` and its ``state_dict()`` resume a blend exactly, on another world size too; read
    in order (``shuffle=False``), a run resumes with other weights from where each component
    stood (:meth:`resume_history`).

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
            (normalised to sum to 1). Or a :class:`~guideloom_pipes.WeightSchedule`: weights
            that change with the position (it needs ``num_samples``, and a loader that
            does not shuffle: ``docs/mixtures.md``, "Weight schedules").
        seed: An int >= 0; fixes the Feistel permutation of every pass of every component.
        num_samples: Length of the mixture; ``None`` is the sum of the components' lengths.
            Set it to cover a run that should see more of a downsampled component.
    """

    def __init__(
        self,
        components: Mapping[str, Any],
        weights: Mapping[str, float] | WeightSchedule,
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
        #: the ``WeightSchedule`` given for ``weights`` (None: fixed weights)
        self.schedule: WeightSchedule | None = None
        self._given = part_of(names, weights)  # (checked, realised)
        if isinstance(weights, WeightSchedule):
            self.schedule = weights
        first = self._given.points[0][1]
        #: the realised proportions ``W_c / D`` (:mod:`guideloom_pipes.mixture_schedule`) by
        #: name; of the schedule's first point for a ``WeightSchedule``
        self.weights: dict[str, float] = {name: w / sum(first) for name, w in zip(names, first)}
        #: the parts the positions are routed by: the given weights from 0, and after
        #: :meth:`resume_history` the run's history before them
        self._parts: list[Part] = [self._given]
        self._routing = Routing.of(self._parts, len(names))
        #: each component's bound on ``|count_c(k) - k * w_c|`` over every prefix ``k``
        #: (fixed weights; empty for a schedule: see ``docs/mixtures.md``)
        self.prefix_bounds: dict[str, float] = {}
        if self.schedule is None:
            self._schedule = _Schedule(list(first))
            self.prefix_bounds = {name: self._schedule.bound(c) for c, name in enumerate(names)}
        self._keys = [_name_key(name) for name in names]
        #: field (``"(sample)"`` for an array sample) -> dtype of the first component's
        #: sample 0: every batch's samples are checked against it (``MixtureReader``)
        self._dtypes: dict[str, np.dtype[Any]] = {}
        self._fixed = all(_is_fixed_length(self.components[name]) for name in names)
        self.lengths: list[int] = self._check_components()
        self._lengths_array = np.array(self.lengths, dtype=np.int64)
        num_samples = check_int("num_samples", num_samples, minimum=1, allow_none=True)
        if self.schedule is not None:
            _check_schedule_length(self.schedule, num_samples)
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
        component, draw = self._routing.route(flat)
        index = self._sample_indexes(component, draw, _PassPermutations(self))
        return component.reshape(shape), index.reshape(shape)

    def _sample_indexes(self, component: _I64, draw: _I64, passes: _PassPermutations) -> _I64:
        """Component sample index of each (component, draw): the draw's pass, permuted."""
        lengths = self._lengths_array[component]
        pass_, offset = np.divmod(draw, lengths)
        return passes.apply(component, pass_, offset)

    def schedule_state(self, position: int | None = None) -> dict[str, Any]:
        """What fixes the schedule besides the components: ``{"seed": ..., "weights":
        {name: realised weight, ...}}`` (in the components' order; a schedule's first
        point's), ``"schedule"`` for a ``WeightSchedule`` (its interpolation and points, with
        realised integer weights), and ``"components"``: name -> this dict of each nested
        ``MixtureDataset``. A loader's ``state_dict()`` records it.

        Args:
            position: With a position (a loader that does not shuffle passes the positions
                it delivered), ``"weights"`` are those in force there and ``"history"`` is
                :meth:`weights_history` up to it.
        """
        state: dict[str, Any] = {"seed": self.seed, "weights": dict(self.weights)}
        if self.schedule is not None:
            points = self._given.points
            state["schedule"] = {
                "interpolation": self.schedule.interpolation,
                "points": [[p, dict(zip(self.names, w))] for p, w in points],
            }
        if position is not None:
            state["weights"] = self.weights_at(position)
            state["history"] = self.weights_history(position)
        nested = {
            name: component.schedule_state()
            for name, component in self.components.items()
            if isinstance(component, MixtureDataset)
        }
        if nested:
            state["components"] = nested
        return state

    def weights_at(self, position: int) -> dict[str, float]:
        """The realised proportions in force at ``position`` (interpolated on a linear ramp;
        after :meth:`resume_history`, the run's)."""
        position = check_int("position", position, minimum=0)
        part = [part for part in self._parts if part.start <= position][-1]
        return dict(zip(self.names, map(float, part.proportions_at(position))))

    def weights_history(self, position: int) -> list[dict[str, Any]]:
        """The weights the positions before ``position`` are read with, JSON-friendly: a
        list of parts ``{"from": position, "interpolation": "step" | "linear", "points":
        [[position, {name: integer weight}], ...]}``, each applying from its ``"from"`` to
        the next one's (the first from 0, one more for each resume with other weights),
        with the points that fix its routing there (its points before the end, and the
        first at or after it). Empty at position 0."""
        position = check_int("position", position, minimum=0)
        return history_state(self._parts, self.names, position)

    def history_parts(self, history: Any, position: int) -> list[Part]:
        """The parts of a run resumed at ``position`` with this mixture's weights: the saved
        ``history`` (:meth:`weights_history`) before ``position``, then these weights (or
        this schedule) from there. Checks only; :meth:`use_parts` applies them.

        Raises:
            ValueError: A malformed history, or a ``WeightSchedule`` whose points before
                ``position`` are not the history's (naming the first that differs).
        """
        position = check_int("position", position, minimum=0)
        saved = parts_of_state(history, self.names)
        return resumed_parts(saved, self._given, self.schedule is not None, position, self.names)

    def use_parts(self, parts: list[Part]) -> bool:
        """Route by ``parts`` (from :meth:`history_parts`) from now on; whether that changes
        the routing (a loader then restarts its worker processes, which hold a copy)."""
        if parts == self._parts:
            return False
        self._parts = list(parts)
        self._routing = Routing.of(self._parts, len(self.names))
        return True

    def resume_history(self, history: Any, position: int) -> bool:
        """Go on from a saved run: the positions before ``position`` keep the weights of
        ``history`` (:meth:`weights_history` of that run), and this mixture's weights apply
        from there, so each component goes on from where its draws stood (within a pass no
        sample repeats and none is skipped). ``StatefulDataLoader.load_state_dict`` calls
        it; call it yourself when you feed positions to the mixture in your own loop.
        ``resume_history([], 0)`` goes back to the weights alone. Returns whether the
        routing changed. Raises as :meth:`history_parts`."""
        return self.use_parts(self.history_parts(history, position))

    def prefix_counts(self, k: int) -> dict[str, int]:
        """How many of positions ``0 .. k-1`` each component gets (exact).

        Args:
            k: The prefix length, >= 0 (may exceed ``len``: the schedule goes on).

        Returns:
            name -> count; the counts sum to ``k``.
        """
        k = check_int("k", k, minimum=0)
        return dict(zip(self.names, self._routing.prefix_counts(k)))

    def __repr__(self) -> str:
        parts = ", ".join(f"{n!r}: {self.weights[n]:.4g}" for n in self.names)
        weights = f"{{{parts}}}" if self.schedule is None else repr(self.schedule)
        return f"MixtureDataset({weights}, seed={self.seed}, num_samples={self.num_samples})"
