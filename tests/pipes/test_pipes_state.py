"""Every ``pipes`` stage keeps torchdata's ``BaseNode`` state contract, at every step.

The runner below checks what torchdata's own node tests check, in our words: a state saved
before any item, after each item and after the end, loaded into a fresh pipeline, gives
exactly the rest of that epoch; a state saved after the end means "exhausted" (nothing more
with ``Loader(restart_on_stop_iteration=False)``, the next epoch with the default ``True``);
and after a resumed epoch the next one is the uninterrupted run's next epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch
import torchdata.nodes as tn
from loader_helpers import Ids, closed_at_the_end, expected_batches, ids_collate

from guideloom_pipes.pipes import (
    Collate,
    PinMemory,
    Prefetcher,
    RankPositions,
    ReadSamples,
    Shuffle,
    ToDevice,
    close_pipeline,
)
from guideloom_pipes.pipes.shuffle import state_marks
from guideloom_pipes.pipes.workers.threads import ThreadPool


@pytest.fixture(autouse=True)
def _stages_closed_whatever_happens(monkeypatch):
    with closed_at_the_end(monkeypatch, (ReadSamples, Prefetcher, ThreadPool)):
        yield


def _plain(item: Any) -> Any:
    """An item as plain lists and ints, to compare (arrays, tensors, Positions)."""
    positions = getattr(item, "positions", None)
    if positions is not None:
        return (item.epoch, positions.tolist())
    if isinstance(item, (np.ndarray, torch.Tensor)):
        return item.tolist()
    if isinstance(item, (list, tuple)):
        return [_plain(x) for x in item]
    return item


def _epoch(loader: tn.Loader[Any]) -> tuple[list[Any], list[dict[str, Any]]]:
    """One epoch of ``loader``: its items, and its state before each item, after the last
    one and once more after the end was reached (``StopIteration``)."""
    items: list[Any] = []
    states = []
    iterator = iter(loader)
    while True:
        states.append(loader.state_dict())
        try:
            items.append(_plain(next(iterator)))
        except StopIteration:
            states.append(loader.state_dict())
            return items, states


def run_save_load_state(make: Callable[[], Any]) -> list[list[Any]]:
    """Check ``make()``'s pipeline against the contract; return its first two epochs.

    ``make`` builds a fresh pipeline each time (stages with threads or processes cannot be
    copied).
    """
    roots = []

    def fresh(restart: bool = True) -> tn.Loader[Any]:
        roots.append(make())
        return tn.Loader(roots[-1], restart_on_stop_iteration=restart)

    try:
        loader = fresh()
        epoch0, states0 = _epoch(loader)
        epoch1, states1 = _epoch(loader)
        assert epoch0, "the pipeline must yield something"
        assert len(states0) == len(epoch0) + 2

        for step, state in enumerate(states0):
            step = min(step, len(epoch0))  # the last two: after the last item, after the end
            # the rest of the epoch, and nothing more when the loader does not restart
            once = fresh(restart=False)
            once.load_state_dict(state)
            assert [_plain(x) for x in once] == epoch0[step:], step
            assert [_plain(x) for x in once] == epoch1, step  # a plain iter(): the next epoch

            # a restarting loader: the rest (the next epoch when nothing is left), then on
            again = fresh()
            again.load_state_dict(state)
            rest = [_plain(x) for x in again]
            if step < len(epoch0):
                assert rest == epoch0[step:], step
                assert [_plain(x) for x in again] == epoch1, step
            else:
                assert rest == epoch1, step

        for step, state in enumerate(states1):
            step = min(step, len(epoch1))
            resumed = fresh(restart=False)
            resumed.load_state_dict(state)
            assert [_plain(x) for x in resumed] == epoch1[step:], step
        return [epoch0, epoch1]
    finally:
        for root in roots:
            close_pipeline(root)


def _ids(n: int, seed: int | None, epochs: int = 2, **kw: Any) -> list[list[list[int]]]:
    return [expected_batches(n, shuffle_seed=seed, epoch=e, **kw) for e in range(epochs)]


SHARDS = [
    {"world_size": 2, "local_batch_size": 3, "rank": 1, "drop_last": True},
    {"world_size": 3, "local_batch_size": 2, "rank": 2, "drop_last": False},
]


def _positions(n: int, shard: dict[str, Any]) -> RankPositions:
    return RankPositions(
        n,
        shard["local_batch_size"],
        rank=shard["rank"],
        world_size=shard["world_size"],
        drop_last=shard["drop_last"],
    )


@pytest.mark.parametrize("shard", SHARDS)
def test_rank_positions(shard):
    epochs = run_save_load_state(lambda: _positions(23, shard))
    assert [[ids for _, ids in epoch] for epoch in epochs] == _ids(23, None, **shard)
    assert [epoch[0][0] for epoch in epochs] == [0, 1]


@pytest.mark.parametrize("shard", SHARDS)
def test_shuffle(shard):
    epochs = run_save_load_state(lambda: Shuffle(_positions(23, shard), 5))
    assert epochs == _ids(23, 5, **shard)
    assert epochs[0] != epochs[1]


@pytest.mark.parametrize(
    "workers",
    [
        {},
        {"num_workers": 2},
        {"num_workers": 2, "chunk_seconds": 10.0, "max_chunk": 3},
        {"num_workers": 1, "max_in_flight": 1, "timeout": 60.0},
    ],
    ids=["inline", "threads", "thread-chunks", "one-thread-with-timeout"],
)
@pytest.mark.parametrize("shard", SHARDS)
def test_read_samples(shard, workers):
    def make() -> ReadSamples:
        return ReadSamples(
            Shuffle(_positions(23, shard), 5), Ids(23), collate_fn=ids_collate, **workers
        )

    assert run_save_load_state(make) == _ids(23, 5, **shard)


@pytest.mark.timeout(300)
def test_read_samples_with_process_workers():
    shard = SHARDS[1]

    def make() -> ReadSamples:
        return ReadSamples(
            Shuffle(_positions(17, shard), 5),
            Ids(17),
            num_workers=1,
            method="process",
            collate_fn=ids_collate,
        )

    assert run_save_load_state(make) == _ids(17, 5, **shard)


def test_collate():
    shard = SHARDS[0]
    epochs = run_save_load_state(
        lambda: Collate(ReadSamples(Shuffle(_positions(23, shard), 5), Ids(23)))
    )
    assert epochs == _ids(23, 5, **shard)  # default_collate: tensors of the ids


@pytest.mark.parametrize("workers", [0, 2])
def test_prefetcher(workers):
    shard = SHARDS[1]

    def make() -> Prefetcher:
        read = ReadSamples(
            Shuffle(_positions(23, shard), 5), Ids(23), num_workers=workers, collate_fn=ids_collate
        )
        return Prefetcher(read, 2)

    assert run_save_load_state(make) == _ids(23, 5, **shard)


def test_to_device():
    shard = SHARDS[0]
    epochs = run_save_load_state(
        lambda: ToDevice(Collate(ReadSamples(Shuffle(_positions(23, shard), 5), Ids(23))), "cpu")
    )
    assert epochs == _ids(23, 5, **shard)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA device")
def test_pin_memory_then_to_device():
    shard = SHARDS[0]

    def make() -> ToDevice:
        read = Collate(ReadSamples(Shuffle(_positions(23, shard), 5), Ids(23)))
        return ToDevice(Prefetcher(PinMemory(read), 2), "cuda")

    assert run_save_load_state(make) == _ids(23, 5, **shard)


def test_mixed_with_torchdata_nodes():
    shard = SHARDS[1]

    def make() -> Any:
        read = ReadSamples(
            Shuffle(_positions(23, shard), 5), Ids(23), num_workers=2, collate_fn=ids_collate
        )
        return tn.Prefetcher(tn.Mapper(read, lambda batch: [x * 10 for x in batch]), 2)

    expected = [[[x * 10 for x in b] for b in epoch] for epoch in _ids(23, 5, **shard)]
    assert run_save_load_state(make) == expected


@pytest.mark.parametrize("seeded", [False, True], ids=["positions", "shuffled"])
@pytest.mark.parametrize("shard", SHARDS)
def test_the_mark_of_our_sources_gives_their_state_at_every_step(shard, seeded):
    node = Shuffle(_positions(23, shard), 5) if seeded else _positions(23, shard)
    marks = state_marks(node)
    assert marks is not None
    mark, state_at = marks
    node.reset()
    for _epoch_number in range(2):
        seen = []
        while True:
            seen.append((mark(), node.state_dict()))
            try:
                next(node)
            except StopIteration:
                seen.append((mark(), node.state_dict()))
                break
        assert [state_at(m) for m, _ in seen] == [state for _, state in seen]
        node.reset()
    # a state taken mid-epoch and loaded: the marks go on from it
    node.reset(seen[3][1])
    assert state_at(mark()) == seen[3][1]


def test_a_shuffle_that_adopts_a_seed_gives_marks_of_that_seed():
    unseeded = Shuffle(_positions(23, SHARDS[0]), None)
    mark, state_at = state_marks(unseeded)  # type: ignore[misc]
    saved = Shuffle(_positions(23, SHARDS[0]), 7)
    saved.reset()
    next(saved)
    unseeded.reset(saved.state_dict())
    assert state_at(mark()) == saved.state_dict()
    assert state_at(mark())[Shuffle.SEED_KEY] == 7


def test_other_sources_and_subclasses_of_ours_give_no_marks():
    class MyPositions(RankPositions):
        def get_state(self) -> dict[str, Any]:
            return {**super().get_state(), "mine": 1}

    assert state_marks(MyPositions(23, 2)) is None
    assert state_marks(Shuffle(MyPositions(23, 2), 1)) is None
    assert state_marks(tn.IterableWrapper(range(3))) is None


@pytest.mark.parametrize("workers", [{"num_workers": 1}, {"num_workers": 2, "max_chunk": 3}])
def test_read_samples_keeps_the_state_of_a_source_of_its_own_kind(workers):
    """A source none of ours (its own state kept after each batch) and a RankPositions
    alone (marks): both resume exactly."""
    shard = SHARDS[1]
    expected = _ids(23, None, **shard)

    def make_ours() -> ReadSamples:
        return ReadSamples(_positions(23, shard), Ids(23), collate_fn=ids_collate, **workers)

    assert run_save_load_state(make_ours) == expected

    def make_other() -> ReadSamples:
        source = tn.Mapper(_positions(23, shard), lambda item: item.positions)
        return ReadSamples(source, Ids(23), collate_fn=ids_collate, **workers)

    assert run_save_load_state(make_other) == expected
