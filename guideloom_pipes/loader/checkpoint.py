"""The loader's checkpoint, in one place: what :meth:`StatefulDataLoader.state_dict` holds,
how :meth:`~StatefulDataLoader.load_state_dict` checks and resumes it, and the dataset
fingerprints and mixture schedules a state is compared against (the words of a fingerprint
diff are :func:`guideloom_pipes.pipes.fingerprints.fingerprint_changes`, shared with the
shard listing's stage).

A state is GuideLoom's five keys (``epoch``, ``observation_offset``, ``shuffle``,
``shuffle_seed``, ``drop_last``) plus keys of ours: ``num_samples``, ``global_batch_size``,
``base_seed``, ``dataset_fingerprint`` (when the dataset can tell), ``mixture`` (for a
``MixtureDataset``) and the order's own keys (``ShardOrder.state``). GuideLoom's five keys
alone resume as GuideLoom does. The position is the loader's ``(epoch, offset)``: what was
delivered to the caller, never what was read ahead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from guideloom_pipes.datasets import open_reader, reader_fingerprint
from guideloom_pipes.loader.iterator import refuse_active
from guideloom_pipes.loader.orders import GLOBAL_BATCH_KEY, ORDER_KEY, mixture_epoch
from guideloom_pipes.loader.settings import SEED_WORD_LIMIT, _int_arg
from guideloom_pipes.mixture import MixtureDataset
from guideloom_pipes.mixture_weights import Part, legacy_history
from guideloom_pipes.pipes.fingerprints import fingerprint_changes, same_dataset

if TYPE_CHECKING:
    from guideloom_pipes.loader.stateful import StatefulDataLoader

#: GuideLoom's keys, the ones every state has.
STATE_KEYS = ("epoch", "observation_offset", "shuffle", "shuffle_seed", "drop_last")
#: Extra key of ours: the dataset size, to warn when it changed.
NUM_SAMPLES_KEY = "num_samples"
#: Extra key of ours: what identifies the dataset's version (shards, sizes, record
#: checksums; see ``ReaderBase.fingerprint``), so a state is not resumed on another one.
FINGERPRINT_KEY = "dataset_fingerprint"
#: Extra key of ours: the base seed (workers' and batches' seeds; the unseeded shuffle's).
BASE_SEED_KEY = "base_seed"
#: Extra key of ours for a ``MixtureDataset``: its seed and weights (``schedule_state()``),
#: so a state is not resumed on another blend (its positions would mean other samples), and
#: when the loader does not shuffle, the history of the weights before the state's position
#: (``MixtureDataset.weights_history``), so a resume with other weights goes on from there.
MIXTURE_KEY = "mixture"
# (GLOBAL_BATCH_KEY, from orders: the global batch size of the run that reached the
# offset. Padding takes an offset past the dataset's end by less than that, so it bounds
# a valid offset.)


@dataclass
class Position:
    """Where a loader stands between iterators: the one truth its state is taken from.

    An active iterator stands further on (its ``_position()``: the batches it delivered);
    it moves this position when it ends. The pipeline's stages hold no position of their
    own that the loader reads: each iterator builds its stages from this one."""

    #: The global batch size of the run that reached ``offset`` (padding takes an offset
    #: past the dataset's end by less than that, so it bounds a valid offset).
    batch: int
    epoch: int = 0
    offset: int = 0
    #: ``(epoch, global position)`` an iterator was closed early at, until state_dict()
    #: warns that the state taken then restarts the epoch.
    closed_early: tuple[int, int] | None = None
    #: The epoch a loaded mixture weights history belongs to: a later epoch reads the
    #: mixture's own weights from position 0 (``orders.mixture_epoch``).
    mixture_epoch: int | None = None

    def move(self, epoch: int, offset: int, batch: int) -> None:
        """Stand at ``(epoch, offset)``, reached with global batches of ``batch``."""
        self.epoch, self.offset, self.batch, self.closed_early = epoch, offset, batch, None


def state_of(loader: StatefulDataLoader[Any, Any]) -> dict[str, Any]:
    """``loader.state_dict()``: the position of what was delivered, and what it means."""
    iterator = loader._active_iterator()
    if iterator is not None:
        epoch, offset = iterator._epoch, iterator._position()
        offset_batch = iterator._offset_batch()
    else:
        here = loader._position
        epoch, offset, offset_batch = here.epoch, here.offset, here.batch
        if here.closed_early is not None:
            closed_epoch, position = here.closed_early
            here.closed_early = None
            warnings.warn(
                f"state_dict() after an iterator was closed early (at global position "
                f"{position} of epoch {closed_epoch}): as in GuideLoom, closing early "
                f"restarts the epoch, so this state (epoch {epoch}, observation_offset "
                f"{offset}) repeats the epoch from its start. To resume where the loop "
                "stopped, take state_dict() inside the loop, before breaking out of it",
                UserWarning,
                stacklevel=3,
            )
    settings = loader.settings
    state: dict[str, Any] = {
        "epoch": epoch,
        "observation_offset": offset,
        "shuffle": settings.shuffle,
        "shuffle_seed": loader.shuffle_seed,
        "drop_last": settings.drop_last,
        NUM_SAMPLES_KEY: loader._num_samples(),
        GLOBAL_BATCH_KEY: offset_batch,
        BASE_SEED_KEY: loader.base_seed,
    }
    fingerprint = dataset_fingerprint(loader)
    if fingerprint is not None:
        state[FINGERPRINT_KEY] = fingerprint
    if isinstance(loader.dataset, MixtureDataset):
        mixture_epoch(loader, epoch)  # (a later epoch than a loaded history's: none)
        # positions delivered in order (no shuffle): the weights history up to them
        delivered = None if settings.shuffle else min(offset, len(loader.dataset))
        state[MIXTURE_KEY] = loader.dataset.schedule_state(delivered)
    state.update(loader._order.state(loader))
    return state


def dataset_fingerprint(loader: StatefulDataLoader[Any, Any]) -> dict[str, Any] | None:
    """The dataset's fingerprint: from the open reader, or the last one the loader opened;
    before the first open, from a reader opened for the purpose."""
    held = loader._held
    if held.is_open or held.fingerprint is not None:
        return held.fingerprint
    reader, owns = open_reader(loader.dataset)
    try:
        held.fingerprint = reader_fingerprint(reader)
    finally:
        if owns:
            reader.close()
    return held.fingerprint


def load_into(loader: StatefulDataLoader[Any, Any], state_dict: Mapping[str, Any]) -> None:
    """``loader.load_state_dict(state_dict)``: check the state, then take its position."""
    refuse_active(loader, "load_state_dict()")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    missing = [key for key in STATE_KEYS if key not in state_dict]
    if missing:
        raise ValueError(
            f"state_dict is missing {missing}: expected the keys {list(STATE_KEYS)} of "
            "StatefulDataLoader.state_dict()"
        )
    epoch = _int_arg("state_dict['epoch']", state_dict["epoch"], 0, SEED_WORD_LIMIT)
    offset = _int_arg("state_dict['observation_offset']", state_dict["observation_offset"], 0)
    saved_base_seed = state_dict.get(BASE_SEED_KEY)
    if saved_base_seed is not None:
        saved_base_seed = _int_arg(
            f"state_dict[{BASE_SEED_KEY!r}]", saved_base_seed, 0, SEED_WORD_LIMIT
        )
    saved_batch = state_dict.get(GLOBAL_BATCH_KEY)
    if saved_batch is not None:
        saved_batch = _int_arg(f"state_dict[{GLOBAL_BATCH_KEY!r}]", saved_batch, 1)
    saved_order, order = state_dict.get(ORDER_KEY, "global"), loader._order.name
    if saved_order != order:
        raise ValueError(
            f"this state was taken with order={saved_order!r} and this loader reads in "
            f"order={order!r}: the position means other samples in the other order. "
            f"Build the loader with order={saved_order!r} to resume it"
        )
    use_mixture = None
    if isinstance(loader.dataset, MixtureDataset) or MIXTURE_KEY in state_dict:
        use_mixture = check_mixture(loader, state_dict, epoch, offset)
    seed_before = loader.shuffle_seed
    _compare_order_keys(loader, state_dict)
    try:
        _load_position(loader, state_dict, epoch, offset, saved_batch, saved_base_seed)
    except BaseException:
        loader.shuffle_seed = seed_before  # a refused state changes nothing
        raise
    if use_mixture is not None:
        use_mixture()


def _compare_order_keys(loader: StatefulDataLoader[Any, Any], state: Mapping[str, Any]) -> None:
    """Warn of a shuffle, seed or ``drop_last`` that differs from the state's; a loader
    built without ``shuffle_seed`` adopts the state's seed."""
    settings = loader.settings
    saved_shuffle, saved_seed = state["shuffle"], state["shuffle_seed"]
    if saved_shuffle != settings.shuffle:
        warnings.warn(
            f"the state was saved with shuffle={saved_shuffle}, this loader has "
            f"shuffle={settings.shuffle}: the order will differ from the saved run's",
            UserWarning,
            stacklevel=4,
        )
    elif settings.shuffle and saved_seed != loader.shuffle_seed:
        if saved_seed is None:
            warnings.warn(
                "the state comes from an unseeded GuideLoom run, whose order cannot be "
                f"reproduced; continuing with shuffle_seed={loader.shuffle_seed}",
                UserWarning,
                stacklevel=4,
            )
        elif not settings.seed_given:
            loader.shuffle_seed = _int_arg("state_dict['shuffle_seed']", saved_seed, 0)
        else:
            warnings.warn(
                f"the state was saved with shuffle_seed={saved_seed}, this loader has "
                f"shuffle_seed={loader.shuffle_seed}: the order will differ from the saved "
                "run's (build the loader with shuffle_seed=None to adopt the state's)",
                UserWarning,
                stacklevel=4,
            )
    if state["drop_last"] != settings.drop_last:
        warnings.warn(
            f"the state was saved with drop_last={state['drop_last']}, this loader has "
            f"drop_last={settings.drop_last}: epochs will have a different number of steps",
            UserWarning,
            stacklevel=4,
        )


def _load_position(
    loader: StatefulDataLoader[Any, Any],
    state_dict: Mapping[str, Any],
    epoch: int,
    offset: int,
    saved_batch: int | None,
    saved_base_seed: int | None,
) -> None:
    """The checks that need the state's seed in place (the shard order's plan follows it),
    then the position itself."""
    # The checks read the dataset (its fingerprint, its size): they read the loader's own
    # reader, opened now for the next iter() (a reader opened for them alone made a resume
    # open the dataset three times: fingerprint, size, iter())
    loader.open()
    saved_fingerprint = state_dict.get(FINGERPRINT_KEY)
    if saved_fingerprint is not None:
        check_fingerprint(loader, saved_fingerprint)
    if loader._order.check_state(loader, state_dict, epoch, offset):
        offset_batch = loader.global_batch_size
    else:
        saved_n = state_dict.get(NUM_SAMPLES_KEY)
        n = loader._num_samples()
        if saved_n is not None and saved_n != n:
            warnings.warn(
                f"the state was taken on a dataset of {saved_n} samples, this loader's has "
                f"{n}: the offset and the shuffled order now refer to other samples",
                UserWarning,
                stacklevel=4,
            )
        # Padding (drop_last=False) takes the offset past n by less than one global batch
        # of the run that reached it: a state of ours records that batch size; for
        # GuideLoom's five keys this loader's stands in.
        offset_batch = saved_batch or loader.global_batch_size
        limit = n + offset_batch - 1
        if offset > limit:
            raise ValueError(
                f"state_dict['observation_offset'] = {offset} is past the end of the epoch: "
                f"the dataset has {n} samples, and padding takes an offset past {n} by less "
                f"than one global batch ({offset_batch}), so at most to {limit}. The state "
                "belongs to another dataset (or was changed); to start the next epoch "
                f"instead, load it with 'epoch': {epoch + 1}, 'observation_offset': 0"
            )
    loader._position.move(epoch, offset, offset_batch)
    if saved_base_seed is not None and saved_base_seed != loader.base_seed:
        # The batches' seeds follow the saved run's (workers started with the old base
        # seed start again, so get_worker_info().seed agrees).
        loader.base_seed = saved_base_seed
        loader._held.stop_processes()


def check_mixture(
    loader: StatefulDataLoader[Any, Any], state: Mapping[str, Any], epoch: int, offset: int
) -> Callable[[], None]:
    """Check a state's ``mixture`` entry against the loader's ``MixtureDataset``; return what
    makes the mixture route as the state says (called once the state is taken).

    Another seed, other components or another nested mixture are refused (the positions
    read would draw other samples); so are other weights when the state or the loader
    shuffles. Without shuffling, the state's weights history stands before its position and
    the mixture's weights (or schedule) apply from there (``MixtureDataset.history_parts``).
    """
    dataset = loader.dataset
    saved = state.get(MIXTURE_KEY)
    if not isinstance(dataset, MixtureDataset):
        raise ValueError(
            f"this state was taken on a MixtureDataset ({MIXTURE_KEY!r}: {saved!r}), "
            f"this loader reads a {type(dataset).__name__}: resume on the same mixture"
        )
    now = dataset.schedule_state()
    if saved is None:  # GuideLoom's keys, or a state of another dataset: the weights alone
        return _use_history(loader, dataset.history_parts([], 0), epoch)
    changes = schedule_changes(saved, now, blend_only=True)
    if changes:
        raise ValueError(
            f"this state was taken on a MixtureDataset with {changes}. Resuming would draw "
            "other samples for the positions already read (repeating some, skipping "
            "others). Build the MixtureDataset with the state's seed and components to "
            "resume it. To start a new blend afresh, load {'epoch': "
            f"{epoch + 1}, 'observation_offset': 0}} with the state's other keys and without "
            f"{MIXTURE_KEY!r}"
        )
    history = saved.get("history")
    if loader.settings.shuffle or state.get("shuffle") or history is None:
        if same_schedule(saved, now):
            return _use_history(loader, dataset.history_parts([], 0), epoch)
        if history is None and not loader.settings.shuffle and not state.get("shuffle"):
            history = legacy_history(saved["weights"])  # a state of before the histories
        else:
            raise ValueError(
                f"this state was taken on a MixtureDataset with {schedule_changes(saved, now)}, "
                "and the state or this loader shuffles: a shuffled epoch delivers positions "
                "scattered over the whole epoch, so no prefix of them is done and other "
                "weights would draw other samples for positions already read (repeating "
                "some, skipping others). Resume with the state's weights; to change the "
                "weights mid-run, read the mixture with shuffle=False (it shuffles each "
                "component itself: docs/mixtures.md). To start the new blend afresh, load "
                f"{{'epoch': {epoch + 1}, 'observation_offset': 0}} with the state's other "
                f"keys and without {MIXTURE_KEY!r}"
            )
    position = min(offset, len(dataset))
    return _use_history(loader, dataset.history_parts(history, position), epoch)


def _use_history(
    loader: StatefulDataLoader[Any, Any], parts: list[Part], epoch: int
) -> Callable[[], None]:
    def use() -> None:
        if loader.dataset.use_parts(parts):
            loader._held.stop_processes()  # (they hold a copy of the mixture)
        loader._position.mixture_epoch = epoch

    return use


def check_fingerprint(loader: StatefulDataLoader[Any, Any], saved: Any) -> None:
    """Refuse a state taken on another version of the dataset, naming what changed."""
    now = dataset_fingerprint(loader)
    if now is None or same_dataset(saved, now):
        return
    if not isinstance(saved, Mapping):
        raise TypeError(
            f"state_dict[{FINGERPRINT_KEY!r}] must be a dict (from state_dict()), got {saved!r}"
        )
    raise ValueError(
        f"this state was taken on another version of the dataset: "
        f"{fingerprint_changes(saved, now)}. Its offset and order would refer to other "
        f"samples. Resume on the dataset the state was taken on; to continue on this one "
        f"anyway, drop the key first (state.pop({FINGERPRINT_KEY!r}))"
    )


def same_schedule(saved: Any, now: Mapping[str, Any], blend_only: bool = False) -> bool:
    """Whether a saved ``schedule_state()`` is ``now``'s: the same seed, the same weights
    (and schedule) in the same order (the order numbers the components), the same nested
    ones; with ``blend_only``, the same seed and components, whatever the weights."""
    return not schedule_changes(saved, now, blend_only=blend_only)


def schedule_changes(
    saved: Any, now: Mapping[str, Any], prefix: str = "", blend_only: bool = False
) -> str:
    """What differs between two ``schedule_state()`` dicts, in words (empty: nothing); with
    ``blend_only``, only the seed, the components and the nested mixtures count."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("weights"), Mapping):
        return f"{prefix}a schedule state {saved!r} that is not one (now {dict(now)!r})"
    parts = []
    if saved.get("seed") != now["seed"]:
        parts.append(f"{prefix}seed={saved.get('seed')!r}, this one has seed={now['seed']!r}")
    weights, here = dict(saved["weights"]), dict(now["weights"])
    if set(weights) != set(here):
        parts.append(f"{prefix}the components {list(weights)}, this one has {list(here)}")
    elif list(weights) != list(here):
        parts.append(
            f"{prefix}the components in the order {list(weights)}, this one in the order "
            f"{list(here)} (the order numbers them)"
        )
    elif not blend_only and weights != here:
        parts.append(f"{prefix}weights {weights}, this one has weights {here}")
    elif not blend_only and saved.get("schedule") != now.get("schedule"):
        parts.append(
            f"{prefix}the schedule {saved.get('schedule')!r}, this one has {now.get('schedule')!r}"
        )
    before, after = saved.get("components") or {}, now.get("components") or {}
    for name in sorted(set(before) | set(after), key=str):
        if name not in before or name not in after:
            where = "the state's" if name in before else "this one's"
            parts.append(f"{prefix}nested mixture {name!r} only in {where}")
        elif not same_schedule(before[name], after[name]):
            parts.append(schedule_changes(before[name], after[name], f"{prefix}{name!r}: "))
    return "; ".join(parts)
