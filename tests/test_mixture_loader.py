"""A MixtureDataset through StatefulDataLoader: every rank's share, and resume from a
checkpoint (also on another world size, with workers) equal to the uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np

from guideloom_pipes import (
    MixtureDataset,
    StatefulDataLoader,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
)

L = 4


def _stream(directory: Path, start: int, samples: int) -> StreamDataset:
    storage = StreamStorage(directory, StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    with storage.sync_writer() as writer:
        values = np.arange(start, start + samples * L)
        writer.append(0, {"tokens": values[: len(values) // 2]})
        writer.append(1, {"tokens": values[len(values) // 2 :]})
    return StreamDataset(storage, L)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory: pytest.TempPathFactory) -> MixtureDataset:
    root = tmp_path_factory.mktemp("mixture")
    return MixtureDataset(
        {
            "web": _stream(root / "web", 0, 37),
            "code": _stream(root / "code", 100_000, 11),
            "books": _stream(root / "books", 200_000, 5),
        },
        {"web": 0.6, "code": 0.3, "books": 0.1},
        seed=11,
        num_samples=90,
    )


def _global_steps(
    mixture: MixtureDataset,
    world_size: int,
    local_batch_size: int,
    steps: int | None,
    state: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Each global step's samples (first token of each), rank batches interleaved in
    position order, and the state after ``steps`` steps (None: to the end of the epoch)."""
    loaders = [
        StatefulDataLoader(
            mixture,
            local_batch_size=local_batch_size,
            rank=rank,
            world_size=world_size,
            shuffle=True,
            shuffle_seed=5,
            device="cpu",
            **options,
        )
        for rank in range(world_size)
    ]
    out: list[list[int]] = []
    iterators = []
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
        iterators.append(iter(loader))
    try:
        while steps is None or len(out) < steps:
            try:
                batches = [next(iterator)["tokens"][:, 0].tolist() for iterator in iterators]
            except StopIteration:
                break
            out.append([batches[r][t] for t in range(local_batch_size) for r in range(world_size)])
        saved = loaders[0].state_dict()
    finally:
        for iterator in iterators:
            iterator.close()  # type: ignore[attr-defined]
        for loader in loaders:
            loader.close()
    return out, saved


def test_the_loader_reads_the_mixture_in_its_shuffled_order(mixture):
    steps, _ = _global_steps(mixture, 1, 6, None)
    assert len(steps) == 90 // 6
    with mixture.sync_reader() as reader:
        everything = [int(s["tokens"][0]) for s in reader]
    assert sorted(v for step in steps for v in step) == sorted(everything)


@pytest.mark.parametrize(
    ("before", "after", "options"),
    [
        ((2, 3), (2, 3), {}),
        ((2, 3), (3, 2), {}),
        ((1, 6), (3, 2), {"num_workers": 2, "prefetch": 1}),
        ((3, 2), (1, 6), {"num_workers": 2, "parallel_method": "process", "prefetch": 1}),
    ],
)
def test_a_resumed_blend_equals_the_uninterrupted_run(mixture, before, after, options):
    world_size, batch = before
    whole, _ = _global_steps(mixture, world_size, batch, None)
    head, state = _global_steps(mixture, world_size, batch, 4, **options)
    assert head == whole[:4]
    assert state["observation_offset"] == 4 * world_size * batch
    world_size, batch = after
    tail, _ = _global_steps(mixture, world_size, batch, None, state=state, **options)
    flat = [v for step in whole[4:] for v in step]
    assert [v for step in tail for v in step] == flat
