"""PackedDataset's batch path (``read_arrays`` -> a ``Batch`` of four int64 columns, what the
loader hands ``collate_packed``) against its per-sample path (``read_batch``, what a user's
collate gets) and the slow reference: random streams and documents, window lengths and ids,
through the loader (inline, threads, processes, resumed) and as a MixtureDataset component;
the reader's reused output memory is never handed out while a batch still uses it."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_packing import EOS, reference_documents, reference_stream

from guideloom_pipes import (
    Batch,
    DocumentPickleFormat,
    DocumentStorage,
    MixtureDataset,
    PackedDataset,
    StatefulDataLoader,
    StreamNumpyFormat,
    StreamStorage,
    collate_packed,
)
from guideloom_pipes.packing import FIELDS
from guideloom_pipes.packing_index import _order_key
from guideloom_pipes.shuffle import FeistelPermutation


def _check_batch(batch: Any, ids: np.ndarray, length: int) -> None:
    assert type(batch) is Batch
    assert batch.fields == FIELDS
    for column in batch.columns.values():
        assert column.dtype == np.int64
        assert column.shape == (len(ids), length)


def _same_as_samples(batch: Batch, samples: list[Any]) -> None:
    """Row ``i`` of every column equals field ``i`` of the per-sample path."""
    assert len(batch) == len(samples)
    for row, sample in zip(batch.samples(), samples):
        assert set(sample) == set(FIELDS)
        for name in FIELDS:
            assert sample[name].dtype == np.int64
            assert row[name].tolist() == sample[name].tolist()


def _reference_rows(expected: list[dict[str, Any]], ids: np.ndarray) -> dict[str, list[Any]]:
    return {name: [expected[i][name] for i in ids.tolist()] for name in FIELDS}


ids_st = st.lists(st.integers(0, 10_000), min_size=1, max_size=9)


@settings(max_examples=120, deadline=None)
@given(
    documents=st.lists(st.lists(st.integers(0, 50), max_size=15), max_size=25),
    length=st.integers(1, 12),
    eos=st.sampled_from([None, EOS]),
    seed=st.one_of(st.none(), st.integers(0, 2**40)),
    picks=ids_st,
)
def test_document_batches_equal_the_samples_and_the_reference(documents, length, eos, seed, picks):
    order = list(range(len(documents)))
    if seed is not None and documents:
        permutation = FeistelPermutation(len(documents), _order_key(seed))
        order = [permutation(p) for p in order]
    expected = reference_documents(documents, length, eos, order)
    dataset = PackedDataset(documents, length, eos_token=eos, seed=seed)
    if not expected:
        return
    ids = np.array([p % len(expected) for p in picks], dtype=np.int64)  # any order, repeats
    with dataset.sync_reader() as reader:
        batch = reader.read_arrays(ids)
        _check_batch(batch, ids, length)
        _same_as_samples(batch, reader.read_batch(ids))
    reference = _reference_rows(expected, ids)
    for name in FIELDS:
        assert batch.columns[name].tolist() == reference[name]


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.sampled_from([1, 2, 3, EOS]), min_size=1, max_size=150),
    length=st.integers(1, 12),
    split=st.integers(0, 150),
    dtype=st.sampled_from(["<i4", "<u2", "<i8"]),
    picks=ids_st,
)
def test_stream_batches_equal_the_samples_and_the_reference(tokens, length, split, dtype, picks):
    expected = reference_stream(tokens, length, EOS)
    if not expected:
        return
    with tempfile.TemporaryDirectory() as tmp:
        storage = StreamStorage(Path(tmp), StreamNumpyFormat(np.dtype([("tokens", dtype)])))
        split = min(split, len(tokens))
        with storage.sync_writer() as writer:  # windows may cross the shard boundary
            writer.append(0, {"tokens": np.array(tokens[:split] or tokens, dtype=dtype)})
            if split and tokens[split:]:
                writer.append(1, {"tokens": np.array(tokens[split:], dtype=dtype)})
        ids = np.array([p % len(expected) for p in picks], dtype=np.int64)
        with PackedDataset(storage, length, eos_token=EOS).sync_reader() as reader:
            batch = reader.read_arrays(ids)
            _check_batch(batch, ids, length)
            _same_as_samples(batch, reader.read_batch(ids))
    reference = _reference_rows(expected, ids)
    for name in FIELDS:
        assert batch.columns[name].tolist() == reference[name]


def test_a_multi_field_stream_packs_its_field():
    dtype = np.dtype([("tokens", "<i4"), ("mask", "u1")])
    tokens = [5, 6, EOS, 7, 8, 9, EOS, 1, 2, EOS, 3, 4]
    with tempfile.TemporaryDirectory() as tmp:
        storage = StreamStorage(Path(tmp), StreamNumpyFormat(dtype))
        rows = np.zeros(len(tokens), dtype=dtype)
        rows["tokens"] = tokens
        rows["mask"] = 1
        with storage.sync_writer() as writer:
            writer.append(0, {"tokens": rows["tokens"], "mask": rows["mask"]})
        ids = np.array([2, 0, 1])
        with PackedDataset(storage, 4, eos_token=EOS).sync_reader() as reader:
            batch = reader.read_arrays(ids)
            _same_as_samples(batch, reader.read_batch(ids))
    reference = _reference_rows(reference_stream(tokens, 4, EOS), ids)
    assert {name: batch.columns[name].tolist() for name in FIELDS} == reference


def test_an_empty_batch_has_four_empty_columns():
    with PackedDataset([[1, 2, 3, 4]], 2).sync_reader() as reader:
        batch = reader.read_arrays(np.zeros(0, dtype=np.int64))
    _check_batch(batch, np.zeros(0), 2)
    assert len(batch) == 0


@settings(max_examples=60, deadline=None)
@given(
    documents=st.lists(st.lists(st.integers(1, 9), max_size=12), min_size=1, max_size=20),
    length=st.integers(1, 10),
    eos=st.sampled_from([None, 0]),
    picks=ids_st,
)
def test_collate_packed_of_a_batch_equals_collate_packed_of_its_samples(
    documents, length, eos, picks
):
    dataset = PackedDataset(documents, length, eos_token=eos)
    with dataset.sync_reader() as reader:
        if len(reader) == 0:
            return
        ids = np.array([p % len(reader) for p in picks], dtype=np.int64)
        batch = reader.read_arrays(ids)
        samples = [dict(s) for s in reader.read_batch(ids)]  # plain dicts: stacked
    # the read's own columns (their starts known from the read), and a slice of them
    # (starts found from the positions)
    for part, rows in ((batch, samples), (batch[1:], samples[1:]), (batch[:1], samples[:1])):
        if not rows:
            continue
        ours, theirs = collate_packed(part), collate_packed(rows)
        assert set(ours) == set(theirs)
        for name in (*FIELDS, "cu_seqlens"):
            assert ours[name].dtype == theirs[name].dtype
            assert torch.equal(ours[name], theirs[name])
        assert ours["cu_seqlens"].dtype == torch.int32
        assert type(ours["max_seqlen"]) is int
        assert ours["max_seqlen"] == theirs["max_seqlen"]


# -- the reader's output memory ---------------------------------------------------------


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _documents_dataset() -> PackedDataset:
    rng = np.random.default_rng(3)
    documents = [rng.integers(1, 90, rng.integers(1, 40)).tolist() for _ in range(300)]
    return PackedDataset(documents, 16, eos_token=0, seed=5)


def test_a_batch_in_use_is_never_overwritten():
    with _documents_dataset().sync_reader() as reader:
        first = reader.read_arrays(np.arange(0, 4))
        kept = {name: column.copy() for name, column in first.columns.items()}
        sample = reader.read_batch(np.arange(4, 8))[1]  # one row keeps its read's memory
        sample_kept = {name: sample[name].copy() for name in FIELDS}
        tensors = collate_packed(reader.read_arrays(np.arange(8, 12)))
        tensors_kept = {name: tensors[name].clone() for name in FIELDS}
        for start in range(12, 200, 4):  # many reads while those three are alive
            later = reader.read_arrays(np.arange(start, start + 4))
            for name in FIELDS:
                assert not np.shares_memory(later.columns[name], first.columns[name])
        for name in FIELDS:
            assert np.array_equal(first.columns[name], kept[name])
            assert np.array_equal(sample[name], sample_kept[name])
            assert torch.equal(tensors[name], tensors_kept[name])


def test_the_memory_of_a_released_batch_is_reused():
    with _documents_dataset().sync_reader() as reader:
        first = reader.read_arrays(np.arange(0, 4))
        where = _address(first.columns["tokens"])
        expected = reader.read_batch(np.arange(4, 8))  # its own memory: still alive
        del first
        again = reader.read_arrays(np.arange(4, 8))
        assert _address(again.columns["tokens"]) == where
        _same_as_samples(again, expected)


# -- through the loader and in a mixture ------------------------------------------------


def _eos_stream(directory: Path, rng: np.random.Generator, count: int) -> StreamStorage:
    storage = StreamStorage(directory, StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    tokens = rng.integers(1, 1000, count).astype(np.int32)
    tokens[rng.random(count) < 1 / 9] = 0
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": tokens[: count // 3]})
        writer.append(1, {"tokens": tokens[count // 3 :]})
    return storage


def collate_samples(samples: list[Any]) -> dict[str, Any]:
    """A user's collate (not marked as taking arrays): it gets the per-sample dicts."""
    for sample in samples:
        assert isinstance(sample, dict) and list(sample) == list(FIELDS)
        assert all(v.dtype == np.int64 and v.ndim == 1 for v in sample.values())
    return collate_packed([dict(sample) for sample in samples])


def _run(dataset: Any, collate: Any, steps: int, state: Any = None, **options: Any) -> Any:
    loader = StatefulDataLoader(
        dataset,
        collate,
        local_batch_size=3,
        shuffle=True,
        shuffle_seed=7,
        device="cpu",
        **options,
    )
    if state is not None:
        loader.load_state_dict(state)
    try:
        iterator = loader.steps(steps)
        batches = [{k: v for k, v in b.items()} for b in iterator]
        return batches, loader.state_dict()
    finally:
        loader.close()


def _equal(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for name in (*FIELDS, "cu_seqlens"):
            assert torch.equal(x[name], y[name])
        assert x["max_seqlen"] == y["max_seqlen"]


@pytest.fixture(scope="module")
def packed_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PackedDataset]:
    root = tmp_path_factory.mktemp("packed-batch")
    rng = np.random.default_rng(8)
    stream = PackedDataset(_eos_stream(root / "stream", rng, 700), 10, eos_token=0)
    storage = DocumentStorage(root / "docs", DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for k in range(90):
            writer.append(k // 45, rng.integers(1, 50, rng.integers(1, 25)).tolist())
    documents = PackedDataset(DocumentStorage(root / "docs", DocumentPickleFormat()), 10, seed=3)
    return {"stream": stream, "documents": documents}


@pytest.mark.parametrize("source", ["stream", "documents"])
@pytest.mark.parametrize(
    "options",
    [
        {"num_workers": 0, "prefetch": 0},
        {"num_workers": 0, "prefetch": 2},
        {"num_workers": 2, "parallel_method": "thread", "prefetch": 1},
        {"num_workers": 2, "parallel_method": "process", "prefetch": 1},
    ],
    ids=["inline", "background", "threads", "processes"],
)
def test_the_loader_gives_the_same_batches_on_both_paths_and_resumes(
    packed_sources, source, options
):
    dataset = packed_sources[source]
    steps = 2 * (len(dataset) // 3) + 4  # across an epoch end
    reference, _ = _run(dataset, collate_samples, steps)  # per-sample path, inline
    batches, _ = _run(dataset, collate_packed, steps, **options)  # the Batch path
    _equal(batches, reference)
    head, state = _run(dataset, collate_packed, 5, **options)
    tail, _ = _run(dataset, collate_packed, steps - 5, state=state, **options)
    _equal(head + tail, reference)


def test_packed_batches_as_mixture_components(packed_sources):
    stream, documents = packed_sources["stream"], packed_sources["documents"]
    mixture = MixtureDataset({"s": stream, "d": documents}, {"s": 2, "d": 1}, seed=9)
    ids = np.random.default_rng(0).permutation(len(mixture))[:40]
    component, index = mixture.locate(ids)
    with mixture.sync_reader() as reader:
        batch = reader.read_arrays(ids)
        _check_batch(batch, ids, 10)
        _same_as_samples(batch, reader.read_batch(ids))
    parts = [stream, documents]
    for row, (c, i) in enumerate(zip(component.tolist(), index.tolist())):
        with parts[c].sync_reader() as part:
            alone = part.read_batch(np.array([i]))[0]
        for name in FIELDS:
            assert batch.columns[name][row].tolist() == alone[name].tolist()
    reference, _ = _run(mixture, collate_samples, 12)
    batches, _ = _run(mixture, collate_packed, 12, num_workers=2, prefetch=1)
    _equal(batches, reference)
