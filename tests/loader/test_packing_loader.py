"""collate_packed (the varlen attention inputs, cu_seqlens checked against a slow reference)
and a PackedDataset through StatefulDataLoader, resumed from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import guideloom_pipes
from guideloom_pipes import (
    DocumentPickleFormat,
    DocumentStorage,
    PackedDataset,
    StatefulDataLoader,
    collate_packed,
)


def _cu_seqlens_reference(document_ids: list[list[int]]) -> list[int]:
    """Boundaries over the flattened tokens: each window start and each document change."""
    out, flat = [], 0
    for window in document_ids:
        for j, doc in enumerate(window):
            if j == 0 or doc != window[j - 1]:
                out.append(flat)
            flat += 1
    return [*out, flat]


@settings(max_examples=80, deadline=None)
@given(
    documents=st.lists(st.lists(st.integers(1, 9), max_size=12), min_size=1, max_size=20),
    length=st.integers(1, 10),
    batch=st.integers(1, 4),
    eos=st.sampled_from([None, 0]),
)
def test_cu_seqlens_mark_every_document_and_window_start(documents, length, batch, eos):
    dataset = PackedDataset(documents, length, eos_token=eos)
    with dataset.sync_reader() as reader:
        samples = reader[: min(batch, len(reader))]
    if not samples:
        return
    out = collate_packed(samples)
    for name in ("tokens", "position_ids", "document_ids", "labels"):
        assert out[name].dtype == torch.int64
        assert out[name].shape == (len(samples), length)
        assert out[name].tolist() == [s[name].tolist() for s in samples]
    expected = _cu_seqlens_reference([s["document_ids"].tolist() for s in samples])
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens"].tolist() == expected
    assert isinstance(out["max_seqlen"], int)
    assert out["max_seqlen"] == max(np.diff(expected))
    shuffled = samples[::-1]  # not consecutive rows of one read: stacked
    again = collate_packed(shuffled)
    assert again["tokens"].tolist() == [s["tokens"].tolist() for s in shuffled]
    reference = _cu_seqlens_reference([s["document_ids"].tolist() for s in shuffled])
    assert again["cu_seqlens"].tolist() == reference
    plain = collate_packed([dict(s) for s in samples])  # plain dicts: stacked too
    assert plain["cu_seqlens"].tolist() == expected


def test_collate_packed_by_hand_and_from_stacked_arrays():
    dataset = PackedDataset([[5, 6, 7], [8], [9, 10, 11, 12]], 4, eos_token=0)
    with dataset.sync_reader() as reader:
        samples = reader[:2]
    out = collate_packed(samples)
    # windows: [5 6 7 0] [8 0 | 9 10]: starts at 0, 4, 6; then 8
    assert out["cu_seqlens"].tolist() == [0, 4, 6, 8]
    assert out["max_seqlen"] == 4
    stacked = {k: np.stack([s[k] for s in samples]) for k in samples[0]}
    again = collate_packed(stacked)
    assert again["cu_seqlens"].tolist() == [0, 4, 6, 8]
    assert torch.equal(again["labels"], out["labels"])
    assert collate_packed([]) == []
    assert guideloom_pipes.pipes.collate_packed is collate_packed


def test_collate_packed_refuses_samples_of_different_lengths():
    with pytest.raises(ValueError, match="one length"):
        collate_packed(
            [
                {k: np.zeros(3, np.int64) for k in ("tokens", "position_ids", "labels")}
                | {"document_ids": np.zeros((1, 3, 1), np.int64)}
            ]
        )


def _storage(directory: Path) -> DocumentStorage:
    return DocumentStorage(directory, DocumentPickleFormat())


def test_packed_documents_resume_through_the_loader_on_another_world_size(tmp_path):
    rng = np.random.default_rng(1)
    documents = [rng.integers(1, 50, rng.integers(1, 30)).tolist() for _ in range(80)]
    with _storage(tmp_path / "docs").sync_writer() as writer:
        for k, document in enumerate(documents):
            writer.append(k // 40, document)
    dataset = PackedDataset(_storage(tmp_path / "docs"), 8, eos_token=0, seed=4)

    def run(world_size, batch, steps=None, state=None, **options):
        loaders = [
            StatefulDataLoader(
                dataset,
                collate_packed,
                local_batch_size=batch,
                rank=r,
                world_size=world_size,
                shuffle=True,
                shuffle_seed=2,
                device="cpu",
                **options,
            )
            for r in range(world_size)
        ]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        iterators = [iter(loader) for loader in loaders]
        out: list[list[int]] = []
        done = 0
        try:
            while steps is None or done < steps:
                try:
                    batches = [next(it) for it in iterators]
                except StopIteration:
                    break
                done += 1
                rows = [b["tokens"].tolist() for b in batches]
                out += [rows[r][t] for t in range(batch) for r in range(world_size)]
                for b in batches:
                    assert b["cu_seqlens"][-1] == batch * 8
            saved = loaders[0].state_dict()
        finally:
            for it in iterators:
                it.close()  # type: ignore[attr-defined]
            for loader in loaders:
                loader.close()
        return out, saved

    whole, _ = run(2, 2)
    head, state = run(2, 2, steps=3, num_workers=2, prefetch=1)
    assert head == whole[: 3 * 4]
    tail, _ = run(1, 4, state=state, num_workers=2, parallel_method="process", prefetch=1)
    assert head + tail == whole


def _packed_stage(dataset: PackedDataset, **options):
    from guideloom_pipes.pipes import RankPositions, ReadSamples, Shuffle

    source = Shuffle(RankPositions(len(dataset), 3, drop_last=False), 5)
    return ReadSamples(source, dataset, collate_fn=collate_packed, **options)


@pytest.mark.parametrize("fails", [False, True])
def test_a_chunk_of_packed_batches_is_read_together_and_each_batch_is_the_same(monkeypatch, fails):
    """Jobs of several batches read their packed windows with one ``read_arrays_many``
    (each batch its own output block and ``cu_seqlens``); if that call raises, each batch is
    read alone, with the same results. Batch by batch the stage's state is the reference's."""
    from guideloom_pipes.packing import PackedReader

    rng = np.random.default_rng(2)
    documents = [rng.integers(1, 50, rng.integers(1, 30)).tolist() for _ in range(120)]
    dataset = PackedDataset(documents, 8, eos_token=0, seed=1)
    chunks: list[int] = []
    read_many = PackedReader.read_arrays_many

    def spy(self, batches):
        chunks.append(len(batches))
        if fails:
            raise OSError("a chunk read that fails")
        return read_many(self, batches)

    monkeypatch.setattr(PackedReader, "read_arrays_many", spy)
    reference = _packed_stage(dataset)
    node = _packed_stage(dataset, num_workers=1, chunk_seconds=10.0, max_chunk=5)
    steps = 0
    for expected in reference:
        got = next(node)
        for name in ("tokens", "position_ids", "document_ids", "labels", "cu_seqlens"):
            assert torch.equal(got[name], expected[name]), name
        assert got["max_seqlen"] == expected["max_seqlen"]
        assert node.state_dict() == reference.state_dict()
        steps += 1
    with pytest.raises(StopIteration):
        next(node)
    node.close()
    reference.close()
    assert steps == -(-len(dataset) // 3) and chunks and max(chunks) > 1
