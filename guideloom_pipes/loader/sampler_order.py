"""The sampler order of :class:`~guideloom_pipes.DataLoader`: torch's, drawn from the
loader's index sampler (its ``batch_sampler``, or its ``sampler`` with ``batch_size=None``)
in the main process, as torch draws it.

A step is one item of the index sampler (a batch of indices, or one index unbatched), so an
epoch's position counts the items delivered. What an epoch's start draws is kept
(:class:`EpochStart`): the states of the generators the sampler may draw from, captured
before it starts, so a state taken mid-epoch resumes by drawing the same indices again and
skipping those delivered (or, for a sampler with ``state_dict()``, torchdata's protocol, by
loading the sampler's own state as of the last batch delivered).
"""

from __future__ import annotations

import base64
import collections
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

if TYPE_CHECKING:
    from guideloom_pipes.loader.torch_loader import DataLoader

#: What identifies a state of this order (``state_dict()['kind']``), and its version.
KIND = "guideloom_pipes.DataLoader/sampler"
VERSION = 1


def sampler_generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """The generators the loader's samplers draw from besides torch's global one: the
    loader's ``generator`` and each ``generator`` of the index sampler and the samplers it
    wraps (``BatchSampler.sampler``), once each, in that order."""
    found: list[torch.Generator] = []
    if isinstance(loader.generator, torch.Generator):
        found.append(loader.generator)
    sampler: Any = loader._index_sampler
    for _ in range(8):  # (a chain of wrappers; a cycle would stop here)
        generator = getattr(sampler, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
        sampler = getattr(sampler, "sampler", None)
        if sampler is None:
            break
    return found


def epoch_sampler(sampler: Any) -> Any:
    """The sampler with ``set_epoch`` (a ``DistributedSampler``) in the chain of ``sampler``
    and the samplers it wraps (``BatchSampler.sampler``), or None."""
    for _ in range(8):  # (a chain of wrappers; a cycle would stop here)
        if sampler is None:
            return None
        if callable(getattr(sampler, "set_epoch", None)) and isinstance(
            getattr(sampler, "epoch", None), int
        ):
            return sampler
        sampler = getattr(sampler, "sampler", None)
    return None


class EpochStart:
    """The generator states an epoch's draws start from: torch's global CPU generator's and
    those of :func:`sampler_generators`, taken before the epoch's first draw."""

    def __init__(self, default: torch.Tensor, others: list[torch.Tensor]) -> None:
        self.default = default
        self.others = others

    @classmethod
    def now(cls, loader: DataLoader[Any]) -> EpochStart:
        return cls(
            torch.default_generator.get_state(),
            [g.get_state() for g in sampler_generators(loader)],
        )

    def state(self) -> dict[str, Any]:
        """The states as text (base64 of each generator's state bytes), so that the whole
        ``state_dict()`` goes through ``json.dumps`` as well as ``torch.save``."""
        return {"default": _text(self.default), "others": [_text(t) for t in self.others]}

    @classmethod
    def of_state(cls, saved: Any, loader: DataLoader[Any]) -> EpochStart:
        try:
            if not isinstance(saved, Mapping):
                raise ValueError
            default = _tensor(saved["default"])
            others = [_tensor(state) for state in saved.get("others", [])]
        except (KeyError, ValueError, TypeError):
            raise ValueError(
                f"state_dict['generators'] = {saved!r} is not the generator states of a "
                "guideloom_pipes.DataLoader state: pass a dict from its state_dict()"
            ) from None
        now = sampler_generators(loader)
        if len(others) != len(now):
            raise ValueError(
                f"the state holds {len(others)} sampler generator state(s), this loader's "
                f"samplers draw from {len(now)} generator(s) besides torch's global one: "
                "build the loader with the same generator= and sampler as the saved run"
            )
        return cls(default, others)

    def restore(self, loader: DataLoader[Any], *, default: bool) -> None:
        """Put the loader's sampler generators (and, with ``default``, torch's global one)
        back to these states."""
        if default:
            torch.default_generator.set_state(self.default)
        for generator, state in zip(sampler_generators(loader), self.others, strict=True):
            generator.set_state(state)


def _text(state: torch.Tensor) -> str:
    """A generator's state (a ``uint8`` tensor) as base64 text."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _tensor(saved: Any) -> torch.Tensor:
    """A generator's state from :func:`_text`'s text (or the tensor itself)."""
    if isinstance(saved, torch.Tensor):
        return saved
    if not isinstance(saved, str):
        raise TypeError(saved)
    data = base64.b64decode(saved.encode("ascii"), validate=True)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class SamplerBatches(BaseNode[np.ndarray]):
    """The index sampler's items of one epoch as int64 id arrays, from an iterator already
    started (the loader starts it before drawing the epoch's base seed, as torch does).

    With ``keep_states`` the sampler's ``state_dict()`` after each item is kept, to be taken
    (:meth:`sampler_state`) as of the last batch delivered."""

    def __init__(
        self, items: Iterator[Any], sampler: Any, *, batched: bool, keep_states: bool
    ) -> None:
        super().__init__()
        self._items = items
        self._sampler = sampler
        self._batched = batched
        self._keep = keep_states
        self.drawn = 0
        #: The ``epoch`` of the sampler with ``set_epoch`` that the pass was drawn with
        #: (read at its first item), or None.
        self.pass_epoch: int | None = None
        #: ``(items drawn, sampler state after them)``, oldest first
        self._states: collections.deque[tuple[int, Any]] = collections.deque()

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            raise ValueError("SamplerBatches resumes through its loader, not from a state")

    def next(self) -> np.ndarray:
        item = next(self._items)
        self.drawn += 1
        if self.drawn == 1:
            epochs = epoch_sampler(self._sampler)
            self.pass_epoch = None if epochs is None else epochs.epoch
        if self._keep:
            self._states.append((self.drawn, self._sampler.state_dict()))
        try:
            ids = np.asarray(item if self._batched else [item], dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as error:
            what = "batch of indices" if self._batched else "index"
            raise TypeError(
                f"the sampler gave the {what} {item!r}, which is not made of integers: "
                "guideloom_pipes.DataLoader reads map-style datasets by integer index (as "
                "torch's samplers give them); map other keys to integers in the dataset"
            ) from error
        if ids.ndim != 1:
            raise TypeError(
                f"the batch sampler gave {item!r}: each batch must be a flat sequence of "
                "integer indices"
            )
        return ids

    def get_state(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def sampler_state(self, delivered: int) -> Any:
        """The sampler's state after the ``delivered``-th item (None: not kept)."""
        states = self._states
        while len(states) > 1 and states[1][0] <= delivered:
            states.popleft()
        if states and states[0][0] == delivered:
            return states[0][1]
        return None


def check_header(
    state: Mapping[str, Any],
    *,
    kind: str,
    version: int,
    over: str,
    instead: str,
    counts: tuple[str, ...],
) -> None:
    """Refuse a state that is not of the order ``kind`` (a loader ``over`` what it reads;
    ``instead``: where such a state does load), of another version, or whose ``counts``
    are not ints >= 0."""
    found = state.get("kind")
    if found != kind:
        raise ValueError(
            f"state_dict['kind'] = {found!r}: this is not a state of a "
            f"guideloom_pipes.DataLoader over {over} ({kind!r}); pass a dict from its "
            f"state_dict() ({instead})"
        )
    if state.get("version") != version:
        raise ValueError(
            f"state_dict['version'] = {state.get('version')!r}: this release reads "
            f"version {version} of these DataLoader states"
        )
    if not isinstance(state.get("started", False), bool):
        raise ValueError(
            f"state_dict['started'] = {state.get('started')!r} must be a bool: the state was "
            "changed, or is not a DataLoader state"
        )
    for key in counts:
        value = state.get(key)
        if type(value) is not int or value < 0:
            raise ValueError(
                f"state_dict[{key!r}] = {value!r} must be an int >= 0: the state was "
                "changed, or is not a DataLoader state"
            )


class SamplerOrder:
    """The order a :class:`~guideloom_pipes.DataLoader` reads a map-style dataset in: its
    index sampler's, one step per item."""

    name = "sampler"

    def forget(self) -> None:
        """(Nothing is kept from an open reader.)"""

    def steps(self, loader: DataLoader[Any], epoch: int) -> int:
        return len(loader._index_sampler)

    def steps_left(self, loader: DataLoader[Any], epoch: int, offset: int) -> int:
        """Items left after ``offset`` delivered; 1 for a sampler of unknown length (its
        end is seen when it ends)."""
        try:
            return max(len(loader._index_sampler) - offset, 0)
        except TypeError:
            return 1

    def check_state(self, loader: DataLoader[Any], state: Mapping[str, Any]) -> None:
        """Refuse a state that is not of this order, or past the sampler's length."""
        check_header(
            state,
            kind=KIND,
            version=VERSION,
            over="a map-style dataset",
            instead="a StatefulDataLoader's state loads into a StatefulDataLoader",
            counts=("epoch", "batches"),
        )
        sampler_epoch = state.get("sampler_epoch")
        if sampler_epoch is not None and type(sampler_epoch) is not int:
            raise ValueError(
                f"state_dict['sampler_epoch'] = {sampler_epoch!r} must be an int or None: "
                "the state was changed, or is not a DataLoader state"
            )
        try:
            length = len(loader._index_sampler)
        except TypeError:
            return
        if state["batches"] > length:
            raise ValueError(
                f"state_dict['batches'] = {state['batches']} is past the end of this "
                f"loader's epoch ({length} batches): the state belongs to another dataset, "
                "sampler or batch size"
            )


def replay_pass(
    loader: DataLoader[Any],
    sampler: Any,
    start: EpochStart,
    resume: Mapping[str, Any],
    offset: int,
) -> Iterator[Any]:
    """The rest of a saved epoch's pass: what it drew from its start drawn again, and
    the ``offset`` items delivered skipped, at the first ``next()`` (where torch's
    sampler starts its pass: a ``set_epoch()`` made after ``iter()``, as Lightning
    makes it, counts); torch's global generator goes back to the caller's state."""
    caller = torch.default_generator.get_state()
    start.restore(loader, default=True)
    epochs, saved_epoch = epoch_sampler(sampler), resume.get("sampler_epoch")
    if epochs is not None and isinstance(saved_epoch, int) and epochs.epoch != saved_epoch:
        # the pass is drawn as it was, whenever the trainer calls set_epoch (Lightning
        # asks for a resumed loader's first batch before it does)
        epochs.set_epoch(saved_epoch)
    try:
        items = iter(sampler)
        if resume.get("drew_base_seed"):
            loader._draw_base_seed()
        for skipped in range(offset):
            try:
                next(items)
            except StopIteration:
                raise ValueError(
                    f"the state's position ({offset} batches into epoch "
                    f"{resume['epoch']}) is past the end of this sampler's pass "
                    f"({skipped} batches): the state belongs to another dataset, "
                    "sampler or batch size"
                ) from None
        # the next item too: a sampler draws its pass's seed at its first item, and it
        # must come from the saved start (offset 0: nothing was skipped to draw it)
        following = next(items, _END)
    finally:
        torch.default_generator.set_state(caller)
    if following is _END:
        return
    yield following
    yield from items


#: The end of a sampler's pass (``next(items, _END)``).
_END = object()
