"""Properties of the loader's order and checkpoints for all sizes, ranks, seeds and stop points."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("torch")

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from loader_helpers import Ids, expected_batches, ids_collate

from guideloom_pipes import StatefulDataLoader
from guideloom_pipes.shuffle import FeistelPermutation


def _loader(n: int, **kw: Any) -> StatefulDataLoader:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return StatefulDataLoader(Ids(n), ids_collate, device="cpu", **kw)


@st.composite
def _configs(draw: Any) -> dict[str, Any]:
    world_size = draw(st.integers(1, 4))
    local_batch_size = draw(st.integers(1, 5))
    n = draw(st.integers(world_size * local_batch_size, 90))
    shuffle = draw(st.booleans())
    return {
        "n": n,
        "world_size": world_size,
        "local_batch_size": local_batch_size,
        "drop_last": draw(st.booleans()),
        "shuffle": shuffle,
        "shuffle_seed": draw(st.integers(0, 2**64)) if shuffle else None,
        "num_workers": draw(st.sampled_from([0, 0, 2])),
        "prefetch": draw(st.sampled_from([0, 1])),
    }


def _rank_configs(config: dict[str, Any]) -> list[dict[str, Any]]:
    shared = {k: v for k, v in config.items() if k not in ("n", "world_size")}
    return [
        {**shared, "world_size": config["world_size"], "rank": rank}
        for rank in range(config["world_size"])
    ]


@settings(deadline=None, max_examples=100)
@given(config=_configs(), epoch=st.integers(0, 3))
def test_ranks_together_deliver_every_sample_once_per_epoch(config, epoch):
    n, world_size = config["n"], config["world_size"]
    global_batch = world_size * config["local_batch_size"]
    delivered: Counter[int] = Counter()
    steps = set()
    for rank_config in _rank_configs(config):
        loader = _loader(n, **rank_config)
        loader.load_state_dict(
            {
                "epoch": epoch,
                "observation_offset": 0,
                "shuffle": config["shuffle"],
                "shuffle_seed": config["shuffle_seed"],
                "drop_last": config["drop_last"],
            }
        )
        batches = list(loader)
        steps.add(len(batches))
        delivered.update(sample for batch in batches for sample in batch)
    assert len(steps) == 1  # every rank takes the same number of steps
    assert max(delivered.values()) == 1
    if not config["drop_last"]:
        assert sorted(delivered) == list(range(n))
    else:
        kept = n // global_batch * global_batch
        tail = range(kept, n)  # the dropped positions
        if config["shuffle"]:
            perm = FeistelPermutation.for_epoch(n, config["shuffle_seed"], epoch)
            tail = [int(perm(p)) for p in tail]
        assert sorted(delivered) == sorted(set(range(n)) - set(tail))


@settings(deadline=None, max_examples=100)
@given(config=_configs(), stop=st.integers(0, 30), data=st.data())
def test_stop_save_resume_equals_the_uninterrupted_run(config, stop, data):
    n = config["n"]
    rank = data.draw(st.integers(0, config["world_size"] - 1))
    kw = {k: v for k, v in config.items() if k != "n"}
    steps = len(_loader(n, **kw, rank=rank))
    stop = min(stop, steps)
    uninterrupted = _loader(n, **kw, rank=rank)
    reference = list(uninterrupted) + list(uninterrupted)

    first = _loader(n, **kw, rank=rank)
    it = iter(first)
    head = [next(it) for _ in range(stop)]
    state = first.state_dict()
    it.close()
    resumed = _loader(n, **{**kw, "shuffle_seed": None}, rank=rank)  # adopts the saved seed
    resumed.load_state_dict(state)
    assert head + list(resumed) + list(resumed) == reference


@settings(deadline=None, max_examples=100)
@given(config=_configs(), stop=st.integers(0, 30), data=st.data())
def test_resuming_on_another_world_size_continues_the_global_order(config, stop, data):
    n = config["n"]
    kw = {k: v for k, v in config.items() if k != "n"}
    steps = len(_loader(n, **kw))
    stop = min(stop, steps)
    first = _loader(n, **kw)
    it = iter(first)
    for _ in range(stop):
        next(it)
    state = first.state_dict()
    offset = state["observation_offset"]
    it.close()

    world_size = data.draw(st.integers(1, 4))
    local_batch_size = data.draw(st.integers(1, 5))
    assume(n >= world_size * local_batch_size)
    new = {**kw, "world_size": world_size, "local_batch_size": local_batch_size}
    delivered: list[int] = []
    for rank_config in _rank_configs({**new, "n": n}):
        loader = _loader(n, **rank_config)
        loader.load_state_dict(state)
        batches = list(loader)
        assert batches == expected_batches(
            n,
            world_size=world_size,
            local_batch_size=local_batch_size,
            rank=rank_config["rank"],
            drop_last=config["drop_last"],
            shuffle_seed=config["shuffle_seed"],
            offset=offset,
        )
        delivered.extend(sample for batch in batches for sample in batch)
    # Together the new ranks deliver exactly the samples of the positions left, once each.
    global_batch = world_size * local_batch_size
    left = max(0, n - offset)
    end = offset + (left // global_batch * global_batch if config["drop_last"] else left)
    positions = range(offset, end)
    if config["shuffle"]:
        perm = FeistelPermutation.for_epoch(n, config["shuffle_seed"], 0)
        expected = [int(perm(p)) for p in positions]
    else:
        expected = list(positions)
    assert sorted(delivered) == sorted(expected)


@settings(deadline=None, max_examples=60)
@given(config=_configs(), data=st.data())
def test_every_state_the_loader_produces_loads_on_any_world_and_batch_size(config, data):
    n = config["n"]
    kw = {k: v for k, v in config.items() if k != "n"}
    kw["drop_last"] = data.draw(st.sampled_from([False, False, True]))  # mostly padded
    loader = _loader(n, **kw)
    start = data.draw(st.integers(0, n - 1))  # e.g. where a run of another batch size stopped
    loader.load_state_dict({**loader.state_dict(), "observation_offset": start})
    states = [loader.state_dict()]
    it = iter(loader)
    states.append(loader.state_dict())
    for _ in it:
        states.append(loader.state_dict())  # inside the loop, the last one padded
    states.append(loader.state_dict())  # drained: the next epoch
    for state in states:
        world_size = data.draw(st.integers(1, 4))
        local_batch_size = data.draw(st.integers(1, 5))
        assume(n >= world_size * local_batch_size)
        other = {**kw, "world_size": world_size, "local_batch_size": local_batch_size}
        resumed = _loader(n, **other)
        resumed.load_state_dict(state)
        again = resumed.state_dict()  # saved again before any batch: loads again too
        _loader(n, **{**other, "local_batch_size": 1, "world_size": 1}).load_state_dict(again)
        guideloom = {
            k: v for k, v in state.items() if k not in ("num_samples", "global_batch_size")
        }
        _loader(n, **kw).load_state_dict(guideloom)  # GuideLoom's keys, on the same sizes
