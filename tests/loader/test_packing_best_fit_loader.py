"""Best-fit packed documents through StatefulDataLoader: every token once per epoch, rebuilt
from ``cu_seqlens`` (padding its own sequence, labelled -100), and a run stopped at step k
resumed on another world size, with thread and process workers, giving the same batches."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np

from guideloom_pipes import (
    DocumentPickleFormat,
    DocumentStorage,
    PackedDataset,
    StatefulDataLoader,
    collate_packed,
)
from guideloom_pipes.packing import IGNORE_INDEX

PAD = -1
LENGTH = 16


def _storage(directory: Path) -> DocumentStorage:
    return DocumentStorage(directory, DocumentPickleFormat())


@pytest.fixture(scope="module")
def documents_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """Documents of distinct tokens (document k's token j is 1000 k + j), some longer than a
    window, in two shards."""
    rng = np.random.default_rng(7)
    sizes = np.minimum(np.maximum(1, rng.lognormal(2.0, 0.9, 150).astype(int)), 60)
    documents = [[1000 * k + j for j in range(int(size))] for k, size in enumerate(sizes)]
    directory = tmp_path_factory.mktemp("best-fit") / "docs"
    with _storage(directory).sync_writer() as writer:
        for k, document in enumerate(documents):
            writer.append(k * 2 // len(documents), document)
    return directory, documents


def _dataset(directory: Path) -> PackedDataset:
    return PackedDataset(
        _storage(directory), LENGTH, seed=3, packing="best_fit", pad_token=PAD, lookahead=32
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_holds_every_token_once_and_padding_is_its_own_sequence(documents_dir, workers):
    directory, documents = documents_dir
    dataset = _dataset(directory)
    loader = StatefulDataLoader(
        dataset,
        collate_packed,
        local_batch_size=4,
        shuffle=True,
        shuffle_seed=1,
        drop_last=False,
        num_workers=workers,
        prefetch=2,
        device="cpu",
    )
    pieces: dict[int, list[list[int]]] = {}
    padding = 0
    with loader:
        assert len(loader) == -(-len(dataset) // 4)
        for batch in loader:
            tokens = batch["tokens"].flatten().tolist()
            labels = batch["labels"].flatten().tolist()
            bounds = batch["cu_seqlens"].tolist()
            assert bounds[-1] == len(tokens)
            for a, b in itertools.pairwise(bounds):
                sequence = tokens[a:b]
                assert (b - a) <= batch["max_seqlen"]
                if sequence[0] == PAD:
                    assert set(sequence) == {PAD} and set(labels[a:b]) == {IGNORE_INDEX}
                    assert b % LENGTH == 0  # the end of its window
                    padding += b - a
                    continue
                assert PAD not in sequence
                assert labels[a : b - 1] == sequence[1:] and labels[b - 1] == IGNORE_INDEX
                pieces.setdefault(sequence[0] // 1000, []).append(sequence)
    total = sum(len(d) for d in documents)
    assert padding == len(dataset) * LENGTH - total
    assert sorted(pieces) == list(range(len(documents)))
    for k, document in enumerate(documents):
        got = sorted(pieces[k])  # (tokens rise along a document)
        assert [t for piece in got for t in piece] == document
        assert len(got) == -(-len(document) // LENGTH)  # a document that fits is not cut


def _run(
    dataset: PackedDataset,
    world_size: int,
    batch: int,
    steps: int | None = None,
    state: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """The windows (tokens) and each global step's ``cu_seqlens`` of ``steps`` steps on
    ``world_size`` ranks, rank rows interleaved as one global batch; and the state after."""
    loaders = [
        StatefulDataLoader(
            dataset,
            collate_packed,
            local_batch_size=batch,
            rank=rank,
            world_size=world_size,
            shuffle=True,
            shuffle_seed=5,
            device="cpu",
            **options,
        )
        for rank in range(world_size)
    ]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    iterators = [iter(loader) for loader in loaders]
    windows: list[list[int]] = []
    labels: list[list[int]] = []
    done = 0
    try:
        while steps is None or done < steps:
            try:
                batches = [next(it) for it in iterators]
            except StopIteration:
                break
            done += 1
            rows = [b["tokens"].tolist() for b in batches]
            label_rows = [b["labels"].tolist() for b in batches]
            for t in range(batch):
                for rank in range(world_size):
                    windows.append(rows[rank][t])
                    labels.append(label_rows[rank][t])
        saved = loaders[0].state_dict()
    finally:
        for it in iterators:
            it.close()  # type: ignore[attr-defined]
        for loader in loaders:
            loader.close()
    return windows, labels, saved


def test_a_stopped_run_resumes_on_another_world_size_with_the_same_batches(documents_dir):
    directory, _ = documents_dir
    dataset = _dataset(directory)
    whole, whole_labels, _ = _run(dataset, 2, 2)
    assert len(whole) == (len(dataset) // 4) * 4
    head, head_labels, state = _run(dataset, 2, 2, steps=3, num_workers=2, prefetch=1)
    assert head == whole[:12] and head_labels == whole_labels[:12]
    # a fresh dataset object (a restart): the plan comes from its sidecar
    tail, tail_labels, _ = _run(
        _dataset(directory), 1, 4, state=state, num_workers=2, parallel_method="process", prefetch=1
    )
    assert head + tail == whole
    assert head_labels + tail_labels == whole_labels
