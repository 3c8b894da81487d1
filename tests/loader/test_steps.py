"""loader.steps(n): exactly n batches across epoch ends, continued by the next call, resumed
from a checkpoint mid-way (also on another world size), refusals."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom_pipes import StatefulDataLoader


def ints(samples: list[Any]) -> list[int]:
    return [int(s) for s in samples]


def make(n: int = 10, **options: Any) -> StatefulDataLoader:
    options.setdefault("local_batch_size", 3)
    options.setdefault("shuffle", True)
    options.setdefault("shuffle_seed", 7)
    return StatefulDataLoader(list(range(n)), ints, device="cpu", **options)


def epochs(loader: StatefulDataLoader, count: int) -> list[list[int]]:
    out: list[list[int]] = []
    for _ in range(count):
        out += list(loader)
    return out


def test_steps_runs_exactly_n_batches_across_epoch_ends():
    expected = epochs(make(), 3)  # 3 steps per epoch (10 samples, batch 3, drop_last)
    assert len(expected) == 9
    loader = make()
    got = list(loader.steps(7))
    assert got == expected[:7]
    assert got[0] != got[3]  # a new epoch, a new order
    state = loader.state_dict()
    assert (state["epoch"], state["observation_offset"]) == (2, 3)


def test_a_call_that_ends_on_an_epoch_end_moves_to_the_next_epoch():
    loader = make()
    assert len(list(loader.steps(3))) == 3
    state = loader.state_dict()
    assert (state["epoch"], state["observation_offset"]) == (1, 0)
    assert list(loader) == epochs(make(), 2)[3:]


def test_repeated_calls_continue_where_the_last_stopped():
    expected = epochs(make(), 4)
    loader = make()
    got = list(loader.steps(2)) + list(loader.steps(5)) + list(loader.steps(1))
    assert got == expected[:8]
    # plain iteration continues the current epoch, as before
    assert list(loader) == expected[8:9]


def test_state_dict_between_steps_counts_only_delivered_batches():
    loader = make(num_workers=2, prefetch=2)
    iterator = loader.steps(5)
    next(iterator)
    next(iterator)
    assert loader.state_dict()["observation_offset"] == 6
    with pytest.raises(RuntimeError, match="active"):
        iter(loader)
    iterator.close()  # stopped early: the position of what was delivered stays
    state = loader.state_dict()
    assert (state["epoch"], state["observation_offset"]) == (0, 6)


def _rank_loader(*args: Any, **kwargs: Any) -> StatefulDataLoader:
    """A rank's loader, built after seeding torch alike on every rank (as DDP scripts do), so
    the ranks draw the same base seed and report the same state."""
    torch.manual_seed(0)
    return make(*args, **kwargs)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(4, 23),
    before=st.sampled_from([(1, 4), (2, 2), (4, 1)]),
    after=st.sampled_from([(1, 4), (2, 2), (4, 1)]),
    total=st.integers(1, 14),
    cut=st.integers(0, 14),
    drop_last=st.booleans(),
    workers=st.sampled_from([0, 2]),
)
def test_steps_resumed_mid_way_on_another_world_size_equal_the_uninterrupted_run(
    n, before, after, total, cut, drop_last, workers
):
    cut = min(cut, total)

    def run(shape, steps, state=None):
        world_size, batch = shape
        loaders = [
            _rank_loader(
                n,
                local_batch_size=batch,
                rank=rank,
                world_size=world_size,
                drop_last=drop_last,
                num_workers=workers,
                prefetch=2 if workers else 0,
            )
            for rank in range(world_size)
        ]
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        if steps == 0:
            return [], loaders[0].state_dict()
        per_rank = [list(loader.steps(steps)) for loader in loaders]
        out = []
        for step in range(steps):
            batches = [per_rank[r][step] for r in range(world_size)]
            width = max(len(b) for b in batches)
            out.append(
                [
                    batches[r][t]
                    for t in range(width)
                    for r in range(world_size)
                    if t < len(batches[r])
                ]
            )
        states = [loader.state_dict() for loader in loaders]
        assert all(s == states[0] for s in states)
        return out, states[0]

    whole, _ = run(before, total)
    head, state = run(before, cut)
    tail, _ = run(after, total - cut, state)
    flat = [sample for step in head + tail for sample in step]
    assert flat == [sample for step in whole for sample in step]


@pytest.mark.parametrize(("n", "error"), [(0, ValueError), (-3, ValueError), (1.5, TypeError)])
def test_n_below_one_or_not_an_int_is_refused(n, error):
    with pytest.raises(error, match="n must be"):
        make().steps(n)


# -- loader.skip(n) ------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [1, 2, 3, 4, 7, 9])
@pytest.mark.parametrize("drop_last", [True, False])
def test_skip_moves_past_n_batches_unread_and_steps_go_on_with_the_rest(skip, drop_last):
    expected = epochs(make(drop_last=drop_last), 5)
    loader = make(drop_last=drop_last)
    loader.skip(skip)
    assert list(loader.steps(4)) == expected[skip : skip + 4]
    resumed = make(drop_last=drop_last)
    resumed.load_state_dict(loader.state_dict())
    assert list(resumed.steps(2)) == expected[skip + 4 : skip + 6]


def test_skip_between_steps_to_an_epoch_end_stands_at_the_next_epochs_start():
    expected = epochs(make(), 4)
    loader = make()
    got = list(loader.steps(2))
    loader.skip(1)  # (to the epoch's end: the next epoch's start)
    state = loader.state_dict()
    assert (state["epoch"], state["observation_offset"]) == (1, 0)
    got += list(loader.steps(2))
    assert got == expected[:2] + expected[3:5]


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(4, 23),
    before=st.sampled_from([(1, 4), (2, 2), (4, 1)]),
    after=st.sampled_from([(1, 4), (2, 2), (4, 1)]),
    skip=st.integers(1, 9),
)
def test_a_skip_resumed_on_another_world_size_reads_what_the_uninterrupted_run_reads_after(
    n, before, after, skip
):
    # the skip is in global batches of the run that skips; the rest goes on in positions
    def ranks(shape, state=None):
        world_size, batch = shape
        loaders = [
            _rank_loader(n, local_batch_size=batch, rank=r, world_size=world_size)
            for r in range(world_size)
        ]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        return loaders

    def flat(loaders, steps):
        per_rank = [list(loader.steps(steps)) for loader in loaders]
        return sorted(s for batches in per_rank for batch in batches for s in batch)

    skipping = ranks(before)
    for loader in skipping:
        loader.skip(skip)
    states = [loader.state_dict() for loader in skipping]
    assert all(s == states[0] for s in states)
    walked = ranks(before)
    for loader in walked:
        list(loader.steps(skip))
    assert walked[0].state_dict() == states[0]
    assert flat(ranks(after, states[0]), 2) == flat(ranks(after, walked[0].state_dict()), 2)


def test_skip_is_refused_while_an_iterator_is_active_and_for_a_bad_n():
    loader = make()
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(RuntimeError, match="skip"):
        loader.skip(1)
    iterator.close()
    with pytest.raises(ValueError, match="n must be"):
        loader.skip(0)
    with pytest.raises(TypeError, match="n must be"):
        loader.skip(1.5)
