"""A MixtureDataset through StatefulDataLoader: every rank's share, and resume from a
checkpoint (also on another world size, with workers) equal to the uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    MixtureDataset,
    StatefulDataLoader,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
    pad_collate,
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


def _components(mixture: MixtureDataset) -> dict[str, Any]:
    return mixture.components


def _state_after(mixture: MixtureDataset, steps: int = 2) -> dict[str, Any]:
    _, state = _global_steps(mixture, 1, 6, steps)
    return state


def test_the_state_records_the_mixtures_weights_and_seed(mixture):
    state = _state_after(mixture)
    assert state["mixture"] == {"seed": 11, "weights": mixture.weights}
    loader = StatefulDataLoader(mixture, local_batch_size=6, device="cpu", shuffle=True)
    loader.load_state_dict(state)  # the same blend: accepted
    # and weights that realise the same proportions are the same blend
    same = MixtureDataset(
        _components(mixture), {"web": 6, "code": 3, "books": 1}, seed=11, num_samples=90
    )
    StatefulDataLoader(same, local_batch_size=6, device="cpu", shuffle=True).load_state_dict(state)


@pytest.mark.parametrize(
    ("weights", "seed", "match"),
    [
        (
            {"web": 0.5, "code": 0.3, "books": 0.2},
            11,
            r"weights \{'web': 0\.6, 'code': 0\.3, 'books': 0\.1\}, this one has weights "
            r"\{'web': 0\.5, 'code': 0\.3, 'books': 0\.2\}",
        ),
        ({"web": 0.6, "code": 0.3, "books": 0.1}, 12, "seed=11, this one has seed=12"),
        (
            {"code": 0.3, "web": 0.6, "books": 0.1},
            11,
            r"the components in the order \['web', 'code', 'books'\], this one in the order "
            r"\['code', 'web', 'books'\]",
        ),
    ],
)
def test_a_state_of_another_blend_is_refused_naming_the_difference(mixture, weights, seed, match):
    state = _state_after(mixture)
    components = _components(mixture)
    other = MixtureDataset(
        {name: components[name] for name in weights}, weights, seed=seed, num_samples=90
    )
    loader = StatefulDataLoader(other, local_batch_size=6, device="cpu", shuffle=True)
    with pytest.raises(ValueError, match=match) as info:
        loader.load_state_dict(state)
    assert "'epoch': 1, 'observation_offset': 0" in str(info.value)  # the way forward
    assert loader.state_dict()["observation_offset"] == 0  # nothing of the state was taken


def test_a_nested_mixtures_other_weights_are_refused_too(mixture):
    components = _components(mixture)

    def outer(inner_weights: dict[str, float]) -> MixtureDataset:
        inner = MixtureDataset(
            {"code": components["code"], "books": components["books"]}, inner_weights, seed=3
        )
        return MixtureDataset(
            {"web": components["web"], "rest": inner}, {"web": 1, "rest": 1}, seed=4
        )

    loader = StatefulDataLoader(outer({"code": 1, "books": 1}), local_batch_size=4, device="cpu")
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    iterator.close()
    other = StatefulDataLoader(outer({"code": 3, "books": 1}), local_batch_size=4, device="cpu")
    with pytest.raises(ValueError, match=r"'rest': weights \{'code': 0\.5, 'books': 0\.5\}"):
        other.load_state_dict(state)


def test_a_guideloom_state_or_one_without_the_mixture_key_still_loads(mixture, recwarn):
    state = _state_after(mixture)
    loader = StatefulDataLoader(mixture, local_batch_size=6, device="cpu", shuffle=True)
    guideloom = {key: state[key] for key in list(state)[:5]}
    loader.load_state_dict(guideloom)
    older = {key: value for key, value in state.items() if key != "mixture"}
    loader.load_state_dict(older)
    assert loader.state_dict()["observation_offset"] == 12


def test_a_mixture_state_on_another_dataset_is_refused(mixture, tmp_path):
    state = _state_after(mixture)
    state.pop("dataset_fingerprint", None)
    loader = StatefulDataLoader(_stream(tmp_path / "s", 0, 90), local_batch_size=6, device="cpu")
    with pytest.raises(ValueError, match=r"taken on a MixtureDataset .* reads a StreamDataset"):
        loader.load_state_dict(state)


# -- each batch's documents against the first dtype ------------------------------------------


def _documents(directory: Path, dtypes: list[str]) -> DocumentDataset:
    storage = DocumentStorage(directory, DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for i, dtype in enumerate(dtypes):
            writer.append(0, {"tokens": np.arange(3 + i, dtype=dtype)})
    return DocumentDataset(storage)


@pytest.mark.parametrize("late", ["int64", "float32"])
def test_a_later_document_of_another_dtype_fails_its_batch_naming_it(tmp_path, late):
    blend = MixtureDataset(
        {
            "a": _documents(tmp_path / "a", ["int32"] * 8),
            "b": _documents(tmp_path / "b", ["int32"] * 5 + [late] + ["int32"] * 2),
        },
        {"a": 1, "b": 1},
        seed=0,
    )
    loader = StatefulDataLoader(blend, pad_collate, local_batch_size=4, device="cpu")
    batches = []
    with pytest.raises(
        ValueError,
        match=rf"component 'b' sample 5: field 'tokens' has dtype {late}, the mixture's "
        r"samples have int32 \(sample 0 of 'a'\)",
    ):
        for batch in loader:
            batches.append(batch)
    assert batches  # the batches before it were delivered, none of them promoted
    assert all(batch["tokens"].dtype == torch.int32 for batch in batches)
    loader.close()
    with pytest.raises(ValueError, match="sample 5"), blend.sync_reader() as reader:
        reader.read_batch(np.arange(16))


def test_a_single_component_of_array_documents_is_checked_too(tmp_path):
    storage = DocumentStorage(tmp_path / "d", DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for dtype in ["<i4", "<i4", "<i8"]:
            writer.append(0, np.arange(4, dtype=dtype))
    blend = MixtureDataset({"d": DocumentDataset(storage)}, {"d": 1}, seed=0)
    with blend.sync_reader() as reader:
        assert 2 in blend.locate(np.arange(3))[1]  # one pass: every document is read
        with pytest.raises(ValueError, match="component 'd' sample 2: the sample has dtype int64"):
            reader.read_arrays(np.arange(3))
