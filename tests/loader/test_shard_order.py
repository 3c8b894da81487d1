"""The shard-streaming order (``order="shards"``): ranks read whole shards, each once, mixed in
a seeded buffer; the run resumes exactly from any step, reading one buffer's shards again."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StatefulDataLoader,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
)
from guideloom_pipes.datasets import StreamDatasetReader
from guideloom_pipes.pipes import ListShards, close_pipeline
from guideloom_pipes.pipes.shards import shard_spans

TOKENS = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
L = 4
#: elements per shard: uneven, and not multiples of L (windows cross shard ends)
SIZES = [37, 50, 12, 61, 44, 29, 53, 18]


def _write(directory: Path, sizes: list[int] = SIZES) -> StreamStorage:
    storage = StreamStorage(directory, TOKENS)
    with storage.sync_writer() as writer:
        base = 0
        for shard, size in enumerate(sizes):
            writer.append(shard, {"tokens": np.arange(base, base + size, dtype="<i4")})
            base += size
    return storage


def _loader(storage: Any, **kw: Any) -> StatefulDataLoader:
    options: dict[str, Any] = {
        "sequence_length": L,
        "batch_size": 3,
        "shuffle": True,
        "shuffle_seed": 11,
        "device": "cpu",
        "order": "shards",
        "shuffle_buffer": 20,
        **kw,
    }
    return StatefulDataLoader.from_storage(storage, **options)


def _ids(batch: Any) -> list[int]:
    """The sample ids of a batch: a window's first token over L."""
    return (batch["tokens"][:, 0] // L).tolist() if len(batch) else []


def _epoch(loader: StatefulDataLoader) -> list[list[int]]:
    return [_ids(batch) for batch in loader]


@pytest.fixture
def storage(tmp_path: Path) -> StreamStorage:
    return _write(tmp_path / "data")


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_get_disjoint_samples_and_the_same_steps(
    storage: StreamStorage, world_size: int, drop_last: bool
) -> None:
    runs = [
        _epoch(_loader(storage, rank=rank, world_size=world_size, drop_last=drop_last))
        for rank in range(world_size)
    ]
    with StreamDataset(storage, L).sync_reader() as reader:
        n = len(reader)
    steps = {len(run) for run in runs}
    assert len(steps) == 1  # every rank takes the same number of steps
    every = [i for run in runs for batch in run for i in batch]
    assert len(every) == len(set(every))  # no sample twice in an epoch
    if drop_last:
        assert all(len(batch) == 3 for run in runs for batch in run)
    else:
        assert sorted(every) == list(range(n))  # every sample once
        # a rank's batches are full until its samples run out, then short, then empty
        for run in runs:
            lengths = [len(batch) for batch in run]
            assert lengths == sorted(lengths, reverse=True)


def test_each_rank_reads_each_of_its_shards_once_in_one_call(
    storage: StreamStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    original = StreamDatasetReader.read_range

    def counting(self: StreamDatasetReader, first: int, count: int) -> list[Any]:
        calls.append((first, count))
        return original(self, first, count)

    monkeypatch.setattr(StreamDatasetReader, "read_range", counting)
    monkeypatch.setattr(
        StreamDatasetReader, "read_batch", lambda *a: pytest.fail("a per-batch read")
    )
    loader = _loader(storage, world_size=2, rank=1, drop_last=False)
    plan = loader._order.plan(loader, 0)
    delivered = _epoch(loader)
    assert calls == [(span.first, span.size) for span in plan.spans]
    assert sorted(i for batch in delivered for i in batch) == sorted(
        i for first, count in calls for i in range(first, first + count)
    )


@pytest.mark.parametrize(
    ("world_size", "drop_last", "num_workers", "buffer"),
    [(1, True, 0, 20), (2, False, 0, 20), (3, True, 2, 1), (2, True, 2, 1000), (1, False, 1, 7)],
)
def test_a_run_stopped_at_any_step_resumes_exactly(
    storage: StreamStorage, world_size: int, drop_last: bool, num_workers: int, buffer: int
) -> None:
    def make(rank: int, **kw: Any) -> StatefulDataLoader:
        return _loader(
            storage,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            num_workers=num_workers,
            prefetch=num_workers,
            shuffle_buffer=buffer,
            **kw,
        )

    for rank in range(world_size):
        whole = make(rank)
        uninterrupted = _epoch(whole) + _epoch(whole)  # two epochs
        for k in range(len(uninterrupted)):
            loader = make(rank)
            batches = [_ids(batch) for batch in itertools.islice(loader.steps(k or 1), k)]
            state = loader.state_dict()
            resumed = make(rank, shuffle_seed=None)  # adopts the state's seed
            len(resumed)  # (its own seed's plan, before the state's replaces it)
            resumed.load_state_dict(state)
            rest = [_ids(batch) for batch in resumed.steps(len(uninterrupted) - k)]
            assert batches + rest == uninterrupted, (rank, k)


@pytest.mark.parametrize("world_size", [1, 2])
def test_skip_moves_past_batches_unread_and_the_rest_is_the_uninterrupted_runs(
    storage: StreamStorage, world_size: int
) -> None:
    for rank in range(world_size):
        whole = _loader(storage, rank=rank, world_size=world_size)
        uninterrupted = _epoch(whole) + _epoch(whole)  # two epochs
        for k in range(1, len(uninterrupted)):
            loader = _loader(storage, rank=rank, world_size=world_size)
            loader.skip(k)
            rest = [_ids(batch) for batch in loader.steps(len(uninterrupted) - k)]
            assert rest == uninterrupted[k:], (rank, k)


def test_a_state_is_the_same_on_every_rank(storage: StreamStorage) -> None:
    states = []
    for rank in range(2):
        loader = _loader(storage, rank=rank, world_size=2)
        list(loader.steps(3))
        state = loader.state_dict()
        del state["base_seed"]  # (each loader draws its own unless given a generator)
        states.append(state)
    assert states[0] == states[1]


def test_a_resume_reads_only_the_shards_of_the_buffer_in_progress(
    storage: StreamStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = _loader(storage, shuffle_buffer=20)
    plan = loader._order.plan(loader, 0)
    k = len(loader) // 2
    list(loader.steps(k))
    state = loader.state_dict()
    calls: list[int] = []
    original = StreamDatasetReader.read_range

    def counting(self: StreamDatasetReader, first: int, count: int) -> list[Any]:
        calls.append(first)
        return original(self, first, count)

    monkeypatch.setattr(StreamDatasetReader, "read_range", counting)
    resumed = _loader(storage, shuffle_buffer=20)
    resumed.load_state_dict(state)
    next(iter(resumed))
    position, skip = plan.resume_point(k * 3)
    assert skip > 0  # the resume falls inside a buffer: its delivered samples are re-read
    # the reads start at the buffer's first shard and go on from there, each shard once
    assert calls == [span.first for span in plan.spans[position:]][: len(calls)]
    buffer = plan.buffer_of[position]
    held = plan.buffer_starts[buffer + 1] - plan.buffer_starts[buffer]
    # what is read again: one buffer, under buffer_size plus one shard
    assert skip < held < 20 + max(span.size for span in plan.spans)


def test_epochs_shuffle_shards_and_samples_by_seed(storage: StreamStorage) -> None:
    loader = _loader(storage)
    first, second = _epoch(loader), _epoch(loader)
    assert first != second
    assert _epoch(_loader(storage)) == first  # same seed, same order
    assert _epoch(_loader(storage, shuffle_seed=12)) != first
    plan = loader._order.plan(loader, 0)
    # a buffer of several shards mixes their samples (not one shard after the other)
    held = plan.buffer_starts[1]
    ids = [i for batch in first for i in batch][:held]
    shards = [next(s.shard for s in plan.spans if s.first <= i < s.first + s.size) for i in ids]
    assert len(set(shards)) > 1 and shards != sorted(shards, key=shards.index)


def test_without_shuffle_each_rank_reads_its_shards_in_order(storage: StreamStorage) -> None:
    loader = _loader(storage, shuffle=False, world_size=2, rank=0, drop_last=False)
    ids = [i for batch in _epoch(loader) for i in batch]
    spans = loader._order.plan(loader, 0).spans
    assert [s.shard for s in spans] == sorted(s.shard for s in spans)
    assert ids == [i for s in spans for i in range(s.first, s.first + s.size)]


def test_documents_stream_by_shard(tmp_path: Path) -> None:
    storage = DocumentStorage(tmp_path / "docs", DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for shard, count in enumerate([5, 9, 3, 7]):
            for j in range(count):
                writer.append(shard, {"shard": shard, "j": j})
    loader = StatefulDataLoader.from_storage(
        storage,
        lambda samples: [(d["shard"], d["j"]) for d in samples],
        batch_size=2,
        shuffle=True,
        shuffle_seed=3,
        device="cpu",
        drop_last=False,
        order="shards",
        shuffle_buffer=4,
    )
    delivered = [pair for batch in loader for pair in batch]
    assert sorted(delivered) == sorted((s, j) for s, c in enumerate([5, 9, 3, 7]) for j in range(c))


def test_read_range_is_the_samples_of_read_batch(storage: StreamStorage) -> None:
    with StreamDataset(storage, L).sync_reader() as reader:
        for span in shard_spans(reader):
            whole = reader.read_range(span.first, span.size)
            one_by_one = reader.read_batch(np.arange(span.first, span.first + span.size))
            assert len(whole) == len(one_by_one) == span.size
            for a, b in zip(whole, one_by_one):
                np.testing.assert_array_equal(a["tokens"], b["tokens"])


def test_the_listing_stage_refuses_a_state_of_another_listing(tmp_path: Path) -> None:
    storage = _write(tmp_path / "data")
    with StreamDataset(storage, L).sync_reader() as reader:
        stage = ListShards(reader)
        spans = list(stage)
        assert [s.size for s in spans] == [s.size for s in shard_spans(reader)]
        state = stage.state_dict()
    with storage.sync_writer() as writer:  # the dataset grows by a shard
        writer.append(len(SIZES), {"tokens": np.arange(5, dtype="<i4")})
    with StreamDataset(storage, L).sync_reader() as reader:
        stage = ListShards(reader)
        with pytest.raises(ValueError, match=rf"shards {len(SIZES)} -> {len(SIZES) + 1}"):
            stage.reset(state)


def test_a_loader_refuses_a_state_of_another_dataset(tmp_path: Path) -> None:
    storage = _write(tmp_path / "data")
    loader = _loader(storage)
    list(loader.steps(2))
    state = loader.state_dict()
    with storage.sync_writer() as writer:
        writer.append(len(SIZES), {"tokens": np.arange(5, dtype="<i4")})
    with pytest.raises(ValueError, match="another version of the dataset"):
        _loader(storage).load_state_dict(state)


def test_another_world_size_or_order_or_buffer_is_refused(storage: StreamStorage) -> None:
    loader = _loader(storage, world_size=2)
    list(loader.steps(2))
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"world_size=2, this loader has world_size=3"):
        _loader(storage, world_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match=r"shuffle_buffer=20, this loader has shuffle_buffer=5"):
        _loader(storage, world_size=2, shuffle_buffer=5).load_state_dict(state)
    with pytest.raises(ValueError, match=r"order='shards' and this loader reads in order='global'"):
        StatefulDataLoader.from_storage(
            storage, sequence_length=L, batch_size=3, world_size=2, device="cpu"
        ).load_state_dict(state)
    glob = StatefulDataLoader.from_storage(
        storage, sequence_length=L, batch_size=3, device="cpu", drop_last=True
    )
    list(glob.steps(1))
    with pytest.raises(ValueError, match=r"order='global' and this loader reads in order='shards'"):
        _loader(storage).load_state_dict(glob.state_dict())


def test_bad_arguments_name_the_value_and_the_fix(storage: StreamStorage) -> None:
    with pytest.raises(ValueError, match=r"order must be one of .*got 'shard'"):
        _loader(storage, order="shard")
    with pytest.raises(ValueError, match=r"shuffle_buffer=10 applies to order='shards' only"):
        _loader(storage, order="global", shuffle_buffer=10)
    with pytest.raises(ValueError, match=r"shuffle_buffer must be >= 1, got 0"):
        _loader(storage, shuffle_buffer=0)
    with pytest.raises(ValueError, match=r"parallel_method='thread'"):
        _loader(storage, num_workers=2, parallel_method="process")
    with pytest.raises(ValueError, match=r"timeout=5 is not supported with order='shards'"):
        _loader(storage, timeout=5)
    with pytest.raises(ValueError, match=r"8 non-empty shards for world_size=9"):
        len(_loader(storage, world_size=9, batch_size=1))
    with pytest.raises(TypeError, match=r"needs a StreamDataset or DocumentDataset"):
        shard_spans([1, 2, 3])


def test_the_global_order_is_unchanged_by_the_option(storage: StreamStorage) -> None:
    plain = StatefulDataLoader.from_storage(
        storage,
        sequence_length=L,
        batch_size=3,
        shuffle=True,
        shuffle_seed=11,
        device="cpu",
        drop_last=True,
    )
    named = StatefulDataLoader.from_storage(
        storage,
        sequence_length=L,
        batch_size=3,
        shuffle=True,
        shuffle_seed=11,
        device="cpu",
        drop_last=True,
        order="global",
    )
    assert _epoch(plain) == _epoch(named)
    assert "order" not in plain.state_dict()
    assert isinstance(plain.dataset, StreamDataset) and not isinstance(
        plain.dataset, DocumentDataset
    )


def _stages(reader: Any, world_size: int, rank: int, size: int = 1) -> Any:
    from guideloom_pipes.pipes import BatchSamples, RankShards, ReadShards, ShuffleBuffer

    node: Any = RankShards(
        ListShards(reader),
        3,
        rank=rank,
        world_size=world_size,
        drop_last=False,
        seed=4,
        buffer_size=15,
    )
    return BatchSamples(ShuffleBuffer(ReadShards(node, reader, num_workers=2), size=size), 3)


@pytest.mark.parametrize(("rank", "size"), [(0, 1), (1, 1), (1, 3)])
def test_the_stages_checkpoint_through_torchdata_loader(
    storage: StreamStorage, rank: int, size: int
) -> None:
    from torchdata.nodes import Loader

    def ids(batch: list[Any]) -> list[int]:
        return [int(sample["tokens"][0]) // L for sample in batch]

    with StreamDataset(storage, L).sync_reader() as reader:
        loader = Loader(_stages(reader, 2, rank, size))
        uninterrupted = [ids(b) for b in loader] + [ids(b) for b in loader]  # two epochs
        close_pipeline(loader.root)
        assert uninterrupted[: len(uninterrupted) // 2] != uninterrupted[len(uninterrupted) // 2 :]
        for k in range(1, len(uninterrupted)):
            loader = Loader(_stages(reader, 2, rank, size))
            run = iter(loader)
            got = []
            while len(got) < k:
                try:
                    got.append(ids(next(run)))
                except StopIteration:
                    run = iter(loader)
            state = loader.state_dict()
            resumed = Loader(_stages(reader, 2, rank, size))
            resumed.load_state_dict(state)
            run = iter(resumed)
            while len(got) < len(uninterrupted):
                try:
                    got.append(ids(next(run)))
                except StopIteration:
                    run = iter(resumed)
            assert got == uninterrupted, k
            close_pipeline(loader.root)
            close_pipeline(resumed.root)


def test_reading_threads_stop_with_the_iterator(storage: StreamStorage) -> None:
    from loader_helpers import threads_end

    loader = _loader(storage, num_workers=2, prefetch=1, shuffle_buffer=1)
    iterator = iter(loader)
    next(iterator)
    assert any(t.name.startswith("guideloom-read-shards") for t in threading.enumerate())
    iterator.close()
    assert threads_end() == []
    assert len(_epoch(loader)) == len(loader)
    assert threads_end() == []


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_collate_that_draws_draws_the_same_after_a_resume(
    storage: StreamStorage, prefetch: int
) -> None:
    from guideloom_pipes.pipes import batch_rng

    def drawing(samples: list[Any]) -> tuple[list[int], int]:
        rng = batch_rng()
        assert rng is not None  # the batch's generators are set while it is collated
        return [int(s["tokens"][0]) // L for s in samples], int(rng.numpy.integers(1 << 30))

    def make(**kw: Any) -> StatefulDataLoader:
        return _loader(storage, collate_fn=drawing, prefetch=prefetch, **kw)

    whole = make()
    uninterrupted = list(whole)
    assert len({draw for _, draw in uninterrupted}) > 1
    loader = make()
    loader.load_state_dict(whole.state_dict() | {"epoch": 0, "observation_offset": 0})
    first = list(itertools.islice(loader.steps(5), 5))
    resumed = make(shuffle_seed=None)
    resumed.load_state_dict(loader.state_dict())
    assert first + list(resumed) == uninterrupted


def test_the_sampler_describes_the_rank_epoch(storage: StreamStorage) -> None:
    loader = _loader(storage, world_size=2, rank=1, drop_last=False)
    ids = list(loader.sampler)
    assert len(loader.sampler) == len(ids)
    assert ids == [i for batch in _epoch(loader) for i in batch]
    assert len(loader.batch_sampler) == len(loader)
