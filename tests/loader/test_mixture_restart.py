"""A MixtureDataset read in order (``shuffle=False``) through StatefulDataLoader: weight
schedules, and restarts with other weights on another world size, where each component goes
on from where its draws stood (no sample repeated or skipped within a pass)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch

from guideloom_pipes import DataLoader, MixtureDataset, StatefulDataLoader, WeightSchedule
from guideloom_pipes.mixture_schedule import _name_key, _pass_key_seed
from guideloom_pipes.shuffle import FeistelPermutation

LENGTHS = {"web": 31, "code": 11, "math": 5, "books": 7}
SEED = 17


def _components(names: list[str]) -> dict[str, np.ndarray]:
    return {
        name: np.arange(LENGTHS[name]) + 1000 * k for k, name in enumerate(LENGTHS) if name in names
    }


def values(samples: list[Any]) -> list[int]:
    """The collate function: the samples as ints (each is 1000 * component + index)."""
    return [int(sample) for sample in samples]


def _run(
    mixture: MixtureDataset,
    world_size: int,
    batch: int,
    steps: int | None,
    state: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[list[int], dict[str, Any]]:
    """The samples delivered, in position order (rank batches interleaved), and the state
    after ``steps`` global steps (None: the epoch)."""
    loaders = [
        StatefulDataLoader(
            mixture,
            values,
            local_batch_size=batch,
            rank=rank,
            world_size=world_size,
            device="cpu",
            **options,
        )
        for rank in range(world_size)
    ]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    iterators = [iter(loader) for loader in loaders]
    out: list[int] = []
    taken = 0
    try:
        while steps is None or taken < steps:
            try:
                batches = [next(iterator) for iterator in iterators]
            except StopIteration:
                break
            out += [batches[r][t] for t in range(batch) for r in range(world_size)]
            taken += 1
        saved = loaders[0].state_dict()
    finally:
        for iterator in iterators:
            iterator.close()  # type: ignore[attr-defined]
        for loader in loaders:
            loader.close()
    return out, json.loads(json.dumps(saved))  # the state goes through JSON


def _check_passes(delivered: list[int], names: list[str]) -> None:
    """Each component's samples, in the order delivered, are its draws 0, 1, 2, ...: draw
    ``j`` is ``perm(seed, name, pass=j // len)[j % len]``, so no sample repeats within a
    pass and none is skipped."""
    for k, name in enumerate(LENGTHS):
        if name not in names:
            continue
        length = LENGTHS[name]
        got = [v - 1000 * k for v in delivered if 1000 * k <= v < 1000 * (k + 1)]
        expected = [
            FeistelPermutation(length, _pass_key_seed(SEED, _name_key(name), j // length))(
                j % length
            )
            for j in range(len(got))
        ]
        assert got == expected, name


def _random_weights(rng: random.Random, names: list[str], zero_ok: bool) -> dict[str, int]:
    weights = {name: rng.randint(0 if zero_ok else 1, 9) for name in names}
    if not any(weights.values()):
        weights[names[0]] = 1
    return weights


def _random_schedule(rng: random.Random, names: list[str], n: int) -> WeightSchedule:
    positions = sorted(rng.sample(range(1, n), rng.randint(0, 4)))
    points = [(p, _random_weights(rng, names, zero_ok=True)) for p in [0, *positions]]
    return WeightSchedule(points, rng.choice(["step", "linear"]))


@pytest.mark.parametrize("case", range(8))
def test_a_run_resumed_with_other_weights_on_another_world_size_goes_on_in_each_components_order(
    case,
):
    rng = random.Random(case)
    names = list(LENGTHS)[: rng.randint(2, 4)]
    n = 240
    before = MixtureDataset(
        _components(names), _random_schedule(rng, names, n), seed=SEED, num_samples=n
    )
    world_size, batch = rng.choice([(1, 4), (2, 3), (3, 2)])
    steps = rng.randint(1, n // (world_size * batch) - 1)
    head, state = _run(before, world_size, batch, steps)
    position = steps * world_size * batch
    assert state["observation_offset"] == position
    assert state["mixture"]["history"][0]["from"] == 0
    new: Any = _random_weights(rng, names, zero_ok=False)
    if case % 2:  # a schedule agreeing with the history before the position
        new = WeightSchedule(
            [*((p, w) for p, w in before.schedule.points if p < position), (position + 1, new)],
            before.schedule.interpolation,
        )
    after = MixtureDataset(_components(names), new, seed=SEED, num_samples=n)
    world_size, batch = rng.choice([(1, 5), (2, 2), (4, 1)])
    tail, _ = _run(after, world_size, batch, None, state=state)
    assert len(head) == position and len(head + tail) > n - world_size * batch
    _check_passes(head + tail, names)
    counts = np.bincount([v // 1000 for v in tail], minlength=len(LENGTHS))
    if not case % 2:
        shares = np.array([new.get(name, 0) for name in LENGTHS]) / sum(new.values())
        assert np.abs(counts - len(tail) * shares).max() <= 3


@pytest.mark.parametrize("options", [{}, {"num_workers": 2, "prefetch": 2}])
def test_a_schedule_resumed_unchanged_equals_the_uninterrupted_run(options):
    names = ["web", "code", "math"]
    schedule = WeightSchedule(
        [(0, {"web": 8, "code": 2, "math": 0}), (150, {"web": 2, "code": 5, "math": 3})], "linear"
    )
    mixture = MixtureDataset(_components(names), schedule, seed=SEED, num_samples=200)
    whole, _ = _run(mixture, 2, 4, None)
    head, state = _run(mixture, 2, 4, 9, **options)
    resumed = MixtureDataset(_components(names), schedule, seed=SEED, num_samples=200)
    tail, _ = _run(resumed, 4, 1, None, state=state, **options)
    assert head + tail == whole
    _check_passes(whole, names)


def test_process_workers_read_with_the_loaded_history():
    names = ["web", "code"]
    before = MixtureDataset(_components(names), {"web": 1, "code": 1}, seed=SEED, num_samples=120)
    head, state = _run(before, 1, 4, 10, generator=torch.Generator().manual_seed(3))
    after = MixtureDataset(_components(names), {"web": 1, "code": 4}, seed=SEED, num_samples=120)
    loader = StatefulDataLoader(
        after,
        values,
        local_batch_size=4,
        device="cpu",
        num_workers=2,
        parallel_method="process",
        persistent_workers=True,
        prefetch=1,
        generator=torch.Generator().manual_seed(3),  # the state's base seed: workers kept
    )
    with loader:
        next(iter(loader))  # the workers start with the mixture's weights alone
        loader.load_state_dict(state)
        tail = [v for batch in loader for v in batch]
    _check_passes(head + tail, names)


def test_a_scheduled_mixture_refuses_a_shuffling_loader():
    schedule = WeightSchedule([(0, {"web": 1, "code": 1}), (50, {"web": 1, "code": 3})])
    mixture = MixtureDataset(_components(["web", "code"]), schedule, seed=SEED, num_samples=100)
    match = r"WeightSchedule needs shuffle=False: .*shuffles each component itself"
    with pytest.raises(ValueError, match=match):
        StatefulDataLoader(mixture, shuffle=True, device="cpu")
    with pytest.raises(ValueError, match=match):
        DataLoader(mixture, batch_size=4, shuffle=True)
    StatefulDataLoader(mixture, shuffle=False, device="cpu")
    DataLoader(mixture, batch_size=4)


@pytest.mark.parametrize("shuffled", ["loader", "state"])
def test_other_weights_are_refused_when_the_loader_or_the_state_shuffles(shuffled):
    names = ["web", "code"]
    before = MixtureDataset(_components(names), {"web": 1, "code": 1}, seed=SEED, num_samples=100)
    _, state = _run(before, 1, 4, 3, shuffle=shuffled == "state", shuffle_seed=1)
    after = MixtureDataset(_components(names), {"web": 1, "code": 2}, seed=SEED, num_samples=100)
    loader = StatefulDataLoader(
        after, local_batch_size=4, device="cpu", shuffle=shuffled == "loader"
    )
    scattered = r"shuffles: a shuffled epoch delivers positions scattered"
    with pytest.raises(ValueError, match=scattered) as info:
        loader.load_state_dict(state)
    assert "weights {'web': 0.5, 'code': 0.5}, this one has weights" in str(info.value)
    assert loader.state_dict()["observation_offset"] == 0  # nothing of the state was taken


def test_a_schedule_that_disagrees_with_the_history_is_refused_and_nothing_is_taken():
    names = ["web", "code"]
    before = MixtureDataset(_components(names), {"web": 1, "code": 1}, seed=SEED, num_samples=100)
    _, state = _run(before, 1, 4, 10)
    late = WeightSchedule([(0, {"web": 1, "code": 1}), (20, {"web": 1, "code": 3})])
    after = MixtureDataset(_components(names), late, seed=SEED, num_samples=100)
    loader = StatefulDataLoader(after, local_batch_size=4, device="cpu")
    with pytest.raises(ValueError, match=r"point 1 \(position 20, .*history before position 40"):
        loader.load_state_dict(state)
    assert loader.state_dict()["observation_offset"] == 0
    assert loader.state_dict()["mixture"]["history"] == []


def test_a_state_saved_without_a_history_resumes_other_weights_from_its_position():
    names = ["web", "code", "math"]
    before = MixtureDataset(
        _components(names), {"web": 3, "code": 2, "math": 1}, seed=SEED, num_samples=150
    )
    head, state = _run(before, 1, 6, 7)
    state["mixture"] = {"seed": SEED, "weights": dict(before.weights)}  # the form of before
    after = MixtureDataset(
        _components(names), {"web": 1, "code": 1, "math": 4}, seed=SEED, num_samples=150
    )
    tail, _ = _run(after, 2, 3, None, state=state)
    _check_passes(head + tail, names)


def test_the_state_records_the_history_up_to_its_position():
    names = ["web", "code"]
    schedule = WeightSchedule(
        [(0, {"web": 3, "code": 1}), (40, {"web": 1, "code": 1}), (90, {"web": 1, "code": 3})]
    )
    mixture = MixtureDataset(_components(names), schedule, seed=SEED, num_samples=100)
    _, state = _run(mixture, 1, 4, 5)
    assert state["mixture"]["weights"] == {"web": 0.75, "code": 0.25}
    assert state["mixture"]["history"] == [
        {
            "from": 0,
            "interpolation": "step",
            "points": [[0, {"web": 3, "code": 1}], [40, {"web": 1, "code": 1}]],
        }
    ]
    _, state = _run(mixture, 1, 4, None)  # the epoch's end: the next epoch from position 0
    assert (state["epoch"], state["observation_offset"]) == (1, 0)
    assert state["mixture"]["history"] == []


def test_the_epoch_after_a_resume_reads_the_mixtures_own_weights_from_position_0():
    names = ["web", "code"]
    before = MixtureDataset(_components(names), {"web": 1, "code": 1}, seed=SEED, num_samples=60)
    _, state = _run(before, 1, 4, 5)
    after = MixtureDataset(_components(names), {"web": 1, "code": 3}, seed=SEED, num_samples=60)
    loader = StatefulDataLoader(after, values, local_batch_size=4, device="cpu")
    loader.load_state_dict(state)
    first = [v for batch in loader for v in batch]  # the rest of epoch 0, then epoch 1
    boundary = loader.state_dict()
    second = [v for batch in loader for v in batch]
    assert len(first) == 40 and len(second) == 60
    fresh = MixtureDataset(_components(names), {"web": 1, "code": 3}, seed=SEED, num_samples=60)
    assert second == _run(fresh, 1, 4, None)[0]
    again = MixtureDataset(_components(names), {"web": 1, "code": 3}, seed=SEED, num_samples=60)
    assert _run(again, 2, 2, None, state=boundary)[0] == second
