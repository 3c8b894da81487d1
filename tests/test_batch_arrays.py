"""Batches as arrays (issue 9): ``Batch`` from the readers to our collates, the list of sample
dicts to a user's ``collate_fn``, the same samples either way, in every worker mode."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch
from batch_helpers import ArrayCollate, describe, list_collate
from loader_helpers import closed_at_the_end
from storage_formats import ChunkMetaFormat
from torch.utils.data import default_collate as torch_default_collate

from guideloom_pipes import (
    Batch,
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    PackedDataset,
    StatefulDataLoader,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
    StreamWithMetaStorage,
    collate_packed,
    pad_collate,
)
from guideloom_pipes.batch import LazyRows, accepts_batch_arrays, batch_arrays
from guideloom_pipes.io import PosixPreadIO
from guideloom_pipes.pipes import Prefetcher, ReadSamples, Shuffle
from guideloom_pipes.pipes.collate import default_collate
from guideloom_pipes.pipes.positions import RankPositions
from guideloom_pipes.pipes.workers.threads import ThreadPool
from guideloom_pipes.pipes.workers.transport import ResultRing, dump_result, load_result

TOKENS = np.dtype([("tokens", "<i4")])
TWO_FIELDS = np.dtype([("tokens", "<i4"), ("mask", "u1")])
#: Shard sizes (elements) of the streams: odd, so that windows cross shard boundaries.
SHARDS = (1000, 37, 1501, 703)
LENGTH = 16

#: (num_workers, parallel_method, prefetch): inline, the prefetch thread, threads, processes.
MODES = [(0, "thread", 0), (0, "thread", 2), (2, "thread", 2), (2, "process", 2)]


@pytest.fixture(autouse=True)
def _stages_closed_whatever_happens(monkeypatch: pytest.MonkeyPatch) -> Any:
    with closed_at_the_end(monkeypatch, (ReadSamples, Prefetcher, ThreadPool)):
        yield


def _stream(root: Path, dtype: np.dtype[Any], backend: Any = None) -> StreamStorage:
    storage = StreamStorage(root, StreamNumpyFormat(dtype), backend)
    start = 0
    with storage.sync_writer() as writer:
        for shard, size in enumerate(SHARDS):
            values = np.arange(start, start + size)
            data = {"tokens": values}
            if dtype.names and "mask" in dtype.names:
                data["mask"] = values % 251
            writer.append(shard, data)
            start += size
    return storage


def _meta(root: Path) -> StreamWithMetaStorage:
    storage = StreamWithMetaStorage(root, ChunkMetaFormat())
    with storage.sync_writer() as writer:
        for doc in range(30):
            tokens = list(range(doc * 100, doc * 100 + 40 + doc))
            chunks = [k // 7 for k in range(len(tokens))]
            writer.append(doc % 3, {"doc": doc, "tokens": tokens, "chunk_ids": chunks})
    return storage


def _documents(root: Path) -> DocumentStorage:
    storage = DocumentStorage(root, DocumentPickleFormat())
    rng = np.random.default_rng(5)
    with storage.sync_writer() as writer:
        for doc in range(90):
            size = int(rng.integers(1, 40))
            tokens = rng.integers(0, 1000, size=size)
            writer.append(doc % 4, tokens if doc % 2 else tokens.tolist())
    return storage


def _datasets(root: Path) -> dict[str, Any]:
    return {
        "tokens": StreamDataset(_stream(root / "tokens", TOKENS), LENGTH),
        "two fields": StreamDataset(_stream(root / "two", TWO_FIELDS), LENGTH),
        "meta": StreamDataset(_meta(root / "meta"), LENGTH),
        "documents": DocumentDataset(_documents(root / "documents")),
    }


def _epoch(dataset: Any, collate_fn: Any, mode: tuple[int, str, int], **kw: Any) -> list[Any]:
    workers, method, prefetch = mode
    loader: StatefulDataLoader[Any, Any] = StatefulDataLoader(
        dataset,
        collate_fn,
        local_batch_size=kw.pop("local_batch_size", 5),
        shuffle=True,
        shuffle_seed=3,
        num_workers=workers,
        parallel_method=method,
        prefetch=prefetch,
        device=torch.device("cpu"),
        **kw,
    )
    with loader:
        return list(loader)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


# -- the loader: arrays where a collate takes them, the list otherwise ------------------------


@pytest.mark.parametrize("mode", MODES, ids=["inline", "prefetch", "threads", "processes"])
def test_every_format_gives_the_same_samples_as_arrays_and_as_a_list(
    tmp_path: Path, mode: tuple[int, str, int]
) -> None:
    for name, dataset in _datasets(tmp_path).items():
        as_list = _epoch(dataset, list_collate, mode)
        as_arrays = _epoch(dataset, ArrayCollate(), mode)
        assert len(as_list) == len(as_arrays) > 1, name
        assert [b["samples"] for b in as_arrays] == [b["samples"] for b in as_list], name
        # a user collate gets a plain list of sample dicts, GuideLoom's contract
        assert {b["type"] for b in as_list} == {"list"}, name
        # an opting-in collate gets our Batch from the built-in formats that make one
        expected = "list" if name == "meta" else "Batch"
        assert {b["type"] for b in as_arrays} == {expected}, name


@pytest.mark.parametrize("mode", MODES, ids=["inline", "prefetch", "threads", "processes"])
def test_collate_fn_none_delivers_what_torch_default_collate_makes_of_the_list(
    tmp_path: Path, mode: tuple[int, str, int]
) -> None:
    for name in ("tokens", "two fields"):
        dataset = _datasets(tmp_path / name.replace(" ", "-"))[name]
        ours = _epoch(dataset, None, mode)
        theirs = _epoch(dataset, torch_default_collate, mode)
        assert len(ours) == len(theirs) > 1
        assert all(map(_equal, ours, theirs)), name
        assert all(value.is_contiguous() for batch in ours for value in batch.values())


def test_an_empty_rank_batch_is_an_empty_list_for_user_and_our_collates(tmp_path: Path) -> None:
    # 21 windows, 2 ranks of 2: the last global batch has one sample, for rank 0 only
    dataset = StreamDataset(_stream(tmp_path, TOKENS), 154)
    assert len(dataset) == 21
    common = {"local_batch_size": 2, "world_size": 2, "rank": 1, "drop_last": False}
    user = _epoch(dataset, list_collate, (0, "thread", 0), **common)
    assert user[-1] == {"type": "list", "samples": []}
    assert all(b["type"] == "list" for b in user)
    ours = _epoch(dataset, None, (0, "thread", 0), **common)
    assert ours[-1] == [] and isinstance(ours[0], dict)
    assert _epoch(dataset, ArrayCollate(), (0, "thread", 0), **common)[-1]["samples"] == []


def test_delivered_batches_never_share_memory_and_stay_valid(tmp_path: Path) -> None:
    dataset = StreamDataset(_stream(tmp_path, TWO_FIELDS), LENGTH)
    for mode in MODES[:3]:
        batches = _epoch(dataset, None, mode)
        # every batch's tensors have memory of their own: none is a buffer reused later
        pointers = [t.untyped_storage().data_ptr() for b in batches for t in b.values()]
        assert len(set(pointers)) == len(pointers)
        # and they still hold their windows (token k is k) after the whole epoch was read
        seen = [int(row[0]) for b in batches for row in b["tokens"]]
        assert len(set(seen)) == len(seen) == 5 * len(batches)
        steps = torch.arange(LENGTH, dtype=torch.int32)
        for batch in batches:
            tokens = batch["tokens"]
            assert torch.equal(tokens, tokens[:, :1] + steps) and not (tokens[:, 0] % LENGTH).any()
            assert torch.equal(batch["mask"].to(torch.int32), tokens % 251)


@pytest.mark.parametrize("view_bytes", [None, 100_000], ids=["views", "views then copies"])
def test_batches_from_process_workers_stay_valid_while_held_and_after_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, view_bytes: int | None
) -> None:
    # 32 KiB batches go through the workers' result rings; every batch of two epochs is
    # held while later ones are read, and after the loader is closed
    from guideloom_pipes.pipes.workers import transport as _transport

    if view_bytes is not None:  # beyond 3 batches held, batches are copied out of the ring
        monkeypatch.setattr(_transport, "VIEW_BYTES", view_bytes)
    storage = StreamStorage(tmp_path / "s", StreamNumpyFormat(TOKENS))
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(0, 120_000)})
        writer.append(1, {"tokens": np.arange(120_000, 200_000)})
    dataset = StreamDataset(storage, 1024)

    def two_epochs(**options: Any) -> list[Any]:
        loader: StatefulDataLoader[Any, Any] = StatefulDataLoader(
            dataset, None, local_batch_size=8, shuffle=True, shuffle_seed=3, **options
        )
        with loader:
            return list(loader) + list(loader)

    held = two_epochs(num_workers=2, parallel_method="process", prefetch=2)
    expected = two_epochs()
    assert len(held) == len(expected) == 2 * (200_000 // 1024 // 8)
    steps = torch.arange(1024, dtype=torch.int32)
    for batch, want in zip(held, expected):
        assert torch.equal(batch["tokens"], want["tokens"])
        assert torch.equal(batch["tokens"], batch["tokens"][:, :1] + steps)
    first = held[0]["tokens"]
    first += 1  # writable, its own
    assert torch.equal(first - 1, expected[0]["tokens"])


def test_a_batch_kept_for_good_does_not_stop_the_process_workers_rings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rings of 1 MiB: 32 KiB batches wrap around each many times while the first is kept;
    # every later batch still comes through its worker's ring (not torch's shared memory)
    from guideloom_pipes.pipes.workers import processes as _pool
    from guideloom_pipes.pipes.workers import transport as _transport

    create = _transport.ResultRing.create
    monkeypatch.setattr(
        _pool.ResultRing, "create_if_supported", classmethod(lambda cls: create(1 << 20))
    )
    storage = StreamStorage(tmp_path / "s", StreamNumpyFormat(TOKENS))
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(0, 200_000)})
    dataset = StreamDataset(storage, 1024)
    loader: StatefulDataLoader[Any, Any] = StatefulDataLoader(
        dataset,
        None,
        local_batch_size=8,
        shuffle=True,
        shuffle_seed=3,
        num_workers=2,
        parallel_method="process",
        prefetch=2,
    )
    steps = torch.arange(1024, dtype=torch.int32)
    with loader:
        batches = iter(loader.steps(8 * 24))  # 8 epochs of 24 batches
        kept = next(batches)["tokens"]
        expected = kept.clone()
        for batch in batches:
            tokens = batch["tokens"]
            assert not tokens.is_shared()  # (the slow way would be torch's shared memory)
            assert torch.equal(tokens, tokens[:, :1] + steps)
        del batch, tokens
    assert torch.equal(kept, expected)


def test_a_stage_with_arrays_and_no_collate_hands_on_the_batch(tmp_path: Path) -> None:
    dataset = StreamDataset(_stream(tmp_path, TOKENS), LENGTH)
    with dataset.sync_reader() as reader:
        n = len(reader)
        positions = RankPositions(n, 4)
        node = ReadSamples(Shuffle(positions, 7), dataset, reader=reader, arrays=True)
        plain = ReadSamples(Shuffle(RankPositions(n, 4), 7), dataset, reader=reader)
        try:
            got, expected = list(node), list(plain)
        finally:
            node.close()
            plain.close()
    assert {type(b) for b in got} == {Batch} and {type(b) for b in expected} == {list}
    assert [describe(b)["samples"] for b in got] == [describe(b)["samples"] for b in expected]


def test_process_workers_send_a_batch_as_its_arrays(tmp_path: Path) -> None:
    dataset = StreamDataset(_stream(tmp_path, TWO_FIELDS), LENGTH)
    n = len(dataset)
    options = {"num_workers": 2, "method": "process", "max_in_flight": 4}
    node = ReadSamples(Shuffle(RankPositions(n, 6), 7), dataset, arrays=True, **options)
    plain = ReadSamples(Shuffle(RankPositions(n, 6), 7), dataset, **options)
    try:
        got, expected = list(node), list(plain)
    finally:
        node.close()
        plain.close()
    assert len(got) == len(expected) > 1
    assert {type(b) for b in got} == {Batch} and {type(b) for b in expected} == {list}
    assert [describe(b)["samples"] for b in got] == [describe(b)["samples"] for b in expected]
    assert all(column.flags.c_contiguous for b in got for column in b.columns.values())


# -- the reader: read_arrays ------------------------------------------------------------------


@pytest.mark.parametrize("backend", [None, PosixPreadIO()], ids=["mmap", "pread"])
# a window at a time (a few, or fewer than 128 short ones), and gathered (many short ones)
@pytest.mark.parametrize("count", [3, 40, 200])
def test_read_arrays_is_read_batch_as_columns(tmp_path: Path, backend: Any, count: int) -> None:
    dataset = StreamDataset(_stream(tmp_path, TWO_FIELDS, backend), LENGTH)
    with dataset.sync_reader() as reader:
        rng = np.random.default_rng(count)
        crossing = [int(np.searchsorted(np.arange(len(reader)) * LENGTH, 1000)) - 1]
        ids = np.concatenate([crossing, rng.integers(0, len(reader), size=count)])
        batch = reader.read_arrays(ids)
        samples = reader.read_batch(ids)
    assert type(batch) is Batch and len(batch) == len(ids)
    assert batch.fields == ("tokens", "mask")
    for name in batch.fields:
        column = batch.columns[name]  # type: ignore[index]
        assert column.shape == (len(ids), LENGTH) and column.flags.c_contiguous
        assert np.array_equal(column, np.stack([s[name] for s in samples]))
        assert column.dtype == TWO_FIELDS[name]


@pytest.mark.parametrize("backend", [None, PosixPreadIO()], ids=["mmap", "pread"])
@pytest.mark.parametrize("element", ["<i4", ">i4", "<u2", "<i8", ">f8"])
def test_few_windows_of_a_one_field_stream_are_the_samples_whatever_the_ids_dtype(
    tmp_path: Path, backend: Any, element: str
) -> None:
    """A loader's batch of a one-field stream takes the row-copy path (the column is the
    copied windows, viewed as the field); it must give what the per-sample reads give, for
    windows across shard boundaries and the last one, and for ids of any integer dtype."""
    dtype = np.dtype([("tokens", element)])
    dataset = StreamDataset(_stream(tmp_path, dtype, backend), LENGTH)
    with dataset.sync_reader() as reader:
        assert reader._one_field == ("tokens", dtype["tokens"])
        starts = np.arange(len(reader)) * LENGTH
        crossing = np.flatnonzero(
            np.searchsorted(np.cumsum(SHARDS), starts, side="right")
            != np.searchsorted(np.cumsum(SHARDS), starts + LENGTH - 1, side="right")
        )
        assert len(crossing) >= 2
        ids = [int(crossing[0]), len(reader) - 1, 0, int(crossing[-1]), 5, 5]
        for kind in (np.int64, np.int32, np.uint64, np.uint16):
            batch = reader.read_arrays(np.array(ids, dtype=kind))
            column = batch.columns["tokens"]  # type: ignore[index]
            assert column.dtype == dtype["tokens"] and column.flags.c_contiguous
            expected = np.stack([reader[i]["tokens"] for i in ids])
            assert np.array_equal(column, expected)
            assert column.tolist() == [list(range(i * LENGTH, (i + 1) * LENGTH)) for i in ids]
        column[0, 0] = 7  # the batch owns its memory: the storage is untouched
        assert int(reader[ids[0]]["tokens"][0]) == ids[0] * LENGTH
        with pytest.raises(IndexError, match=f"sample index {len(reader)} out of range"):
            reader.read_arrays(np.array([0, len(reader)], dtype=np.uint32))
        with pytest.raises(TypeError, match="sample ids must be integers"):
            reader.read_arrays(np.array([0.0, 1.0]))


@pytest.mark.parametrize("backend", [None, PosixPreadIO()], ids=["mmap", "pread"])
@pytest.mark.parametrize(
    "shards", [(3000,), SHARDS, (5, 3, 400, 9, 250)], ids=["one", "odd", "shorter-than-L"]
)
def test_many_short_windows_gathered_a_shard_at_a_time_are_the_samples(
    tmp_path: Path, backend: Any, shards: tuple[int, ...]
) -> None:
    """A loader's batch of many short windows of a one-field stream is gathered a shard at a
    time (a ``WindowGrid``): in the batch's order, windows crossing shards (even shards
    shorter than a window) and repeated ids included, whatever the ids' dtype."""
    dtype = np.dtype([("tokens", "<i4")])
    storage = StreamStorage(tmp_path, StreamNumpyFormat(dtype), backend)
    with storage.sync_writer() as writer:
        start = 0
        for shard, size in enumerate(shards):
            writer.append(shard, {"tokens": np.arange(start, start + size)})
            start += size
    with StreamDataset(storage, LENGTH).sync_reader() as reader:
        rng = np.random.default_rng(len(shards))
        every = np.arange(len(reader))
        for ids in (rng.permutation(every), every[::-1], rng.integers(0, len(reader), 40)):
            for kind in (np.int64, np.int32, np.uint16):
                column = reader.read_arrays(ids.astype(kind)).columns["tokens"]  # type: ignore[index]
                assert column.flags.c_contiguous
                expected = [list(range(i * LENGTH, (i + 1) * LENGTH)) for i in ids.tolist()]
                assert column.tolist() == expected


def test_a_format_of_our_own_with_its_own_columns_is_asked_for_them(tmp_path: Path) -> None:
    class Doubled(StreamNumpyFormat):
        def unpack_columns(self, windows: np.ndarray) -> dict[str, np.ndarray]:
            return {"tokens": np.ascontiguousarray(windows["tokens"]) * 2}

    storage = StreamStorage(tmp_path, Doubled(TOKENS))
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(100)})
    with StreamDataset(storage, 10).sync_reader() as reader:
        assert reader._one_field is None
        batch = reader.read_arrays(np.array([3, 1], dtype=np.int64))
        assert batch.columns["tokens"][:, 0].tolist() == [60, 20]  # type: ignore[index]


def test_read_arrays_of_windows_inside_one_shard_gathers_them_in_one_copy(tmp_path: Path) -> None:
    storage = StreamStorage(tmp_path, StreamNumpyFormat(TOKENS))
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(5000)})
    with StreamDataset(storage, 10).sync_reader() as reader:
        ids = np.array([499, 0, 3, 3, 250], dtype=np.int64)
        batch = reader.read_arrays(ids)
        tokens = batch.columns["tokens"]
        mapped = [m for m in reader.storage_reader._mapped.values() if m is not False]
        assert mapped and not any(np.shares_memory(tokens, m) for m in mapped)
        assert tokens[:, 0].tolist() == (ids * 10).tolist()
        tokens[1, 0] = -1  # writable, and the storage is not touched
        assert int(reader[0]["tokens"][0]) == 0


def test_read_arrays_refuses_ids_out_of_range_naming_them(tmp_path: Path) -> None:
    with StreamDataset(_stream(tmp_path, TOKENS), LENGTH).sync_reader() as reader:
        with pytest.raises(IndexError, match="sample index 9999 out of range"):
            reader.read_arrays(np.array([1, 9999], dtype=np.int64))
        with pytest.raises(IndexError, match="sample index -1 out of range"):
            reader.read_arrays(np.array([-1], dtype=np.int64))


def test_documents_read_as_rows_with_their_lengths(tmp_path: Path) -> None:
    with DocumentDataset(_documents(tmp_path)).sync_reader() as reader:
        ids = np.array([4, 1, 88], dtype=np.int64)
        batch = reader.read_arrays(ids)
        samples = reader.read_batch(ids)
    assert type(batch) is Batch and batch.columns is None
    assert [np.asarray(r).tolist() for r in batch.samples()] == [
        np.asarray(s).tolist() for s in samples
    ]
    assert batch.lengths.tolist() == [len(s) for s in samples]


# -- the Batch type ----------------------------------------------------------------------------


def test_batch_slices_takes_concatenates_and_lists_its_samples() -> None:
    batch = Batch({"a": np.arange(12).reshape(4, 3), "b": np.arange(4, dtype=np.uint8)})
    assert len(batch) == 4 and batch.fields == ("a", "b")
    assert describe(batch[1:3])["samples"] == describe(batch.samples()[1:3])["samples"]
    assert batch[2]["a"].tolist() == [6, 7, 8] and int(batch[2]["b"]) == 2
    assert [int(s["b"]) for s in batch.take(np.array([3, 0]))] == [3, 0]
    both = Batch.concat([batch[:1], batch[3:]])
    assert both.columns["b"].tolist() == [0, 3]  # type: ignore[index]
    assert batch.lengths.tolist() == [3, 3, 3, 3]
    rows = Batch(rows=[[1, 2], [3]])
    assert rows.lengths.tolist() == [2, 1] and rows[1:].samples() == [[3]]
    assert Batch.concat([rows, rows]).samples() == [[1, 2], [3], [1, 2], [3]]


def test_batch_refuses_columns_of_different_lengths_and_neither_kind() -> None:
    with pytest.raises(ValueError, match="one length"):
        Batch({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(ValueError, match="exactly one of"):
        Batch()
    with pytest.raises(ValueError, match="exactly one of"):
        Batch({"a": np.zeros(3)}, rows=[1, 2, 3])
    with pytest.raises(ValueError, match="same columns"):
        Batch.concat([Batch({"a": np.zeros(1)}), Batch({"b": np.zeros(1)})])


def test_a_process_worker_sends_one_buffer_per_field_through_the_ring() -> None:
    batch = Batch({"tokens": np.arange(8 * 4096, dtype=np.int32).reshape(8, 4096)})
    batch.columns["mask"] = np.ones((8, 4096), dtype=np.uint8)  # type: ignore[index]
    ring = ResultRing.create(1 << 20)
    try:
        data, places = dump_result([batch], ring)
        assert len(places) == 2  # the two columns, not one buffer per sample
        assert len(data) < 4096
        (back,) = load_result(data, places, ring)
    finally:
        ring.close()
    assert type(back) is Batch
    assert all(np.array_equal(back.columns[k], batch.columns[k]) for k in batch.fields)  # type: ignore[index]
    assert pickle.loads(pickle.dumps(Batch(rows=[1]))).samples() == [1]


# -- collates that take arrays ------------------------------------------------------------------


def test_our_collates_take_arrays_and_a_marked_callable_does() -> None:
    assert accepts_batch_arrays(default_collate)
    assert accepts_batch_arrays(pad_collate) and accepts_batch_arrays(collate_packed)
    assert accepts_batch_arrays(ArrayCollate())
    import functools

    assert accepts_batch_arrays(functools.partial(pad_collate, pad_value=-1))
    assert not accepts_batch_arrays(list_collate) and not accepts_batch_arrays(None)
    assert not accepts_batch_arrays(torch_default_collate)
    marked = batch_arrays(lambda samples: samples)
    assert accepts_batch_arrays(marked)


def test_default_collate_of_a_batch_is_torch_default_collate_of_its_samples() -> None:
    rng = np.random.default_rng(1)
    batch = Batch(
        {
            "tokens": rng.integers(0, 9, (3, 5)).astype("<i4"),
            "mask": rng.integers(0, 2, (3, 5)).astype("u1"),
            "weights": rng.random((3, 5)).astype("<f4"),
        }
    )
    assert _equal(default_collate(batch), torch_default_collate(batch.samples()))
    assert default_collate(Batch(rows=[])) == []
    rows = Batch(rows=[np.arange(3), np.arange(3)])
    assert _equal(default_collate(rows), torch_default_collate(rows.samples()))


@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_collate_of_a_batch_is_pad_collate_of_its_samples(side: str) -> None:
    documents = [np.arange(5), [7, 8], np.arange(3, dtype=np.int32), []]
    batch = Batch(rows=documents)
    options = {"padding_side": side, "pad_value": -1, "pad_to_multiple_of": 4, "max_length": 4}
    got = pad_collate(batch, **options)
    assert _equal(got, pad_collate(documents, **options))
    assert got["tokens"].shape == (4, 4)
    assert got["lengths"].tolist() == [4, 2, 3, 0]
    real = got["attention_mask"]
    assert real.sum(dim=1).tolist() == [4, 2, 3, 0]
    assert (got["tokens"][~real] == -1).all()


def test_pad_collate_still_refuses_samples_without_token_arrays() -> None:
    with pytest.raises(ValueError, match="needs token arrays"):
        pad_collate([["a", "b"], ["c"]])
    with pytest.raises(ValueError, match="needs token arrays"):
        pad_collate(Batch(rows=[[[1, 2], [3]], [[4]]]))


def test_collate_packed_of_a_batch_is_collate_packed_of_its_samples(tmp_path: Path) -> None:
    storage = StreamStorage(tmp_path, StreamNumpyFormat(TOKENS))
    tokens = np.arange(1, 400) % 13  # documents end at each 0
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": tokens})
    with PackedDataset(storage, 32, eos_token=0).sync_reader() as reader:
        samples = reader.read_batch(np.array([3, 1, 7], dtype=np.int64))
    columns = {name: np.stack([s[name] for s in samples]) for name in samples[0]}
    got = collate_packed(Batch(columns))
    assert _equal(got, collate_packed([dict(s) for s in samples]))
    assert got["cu_seqlens"][-1] == 3 * 32


# -- mixtures ----------------------------------------------------------------------------------


def test_a_mixture_of_streams_reads_arrays_in_the_order_of_the_ids(tmp_path: Path) -> None:
    from guideloom_pipes import MixtureDataset

    first = StreamDataset(_stream(tmp_path / "a", TWO_FIELDS), LENGTH)
    second = StreamDataset(_stream(tmp_path / "b", TWO_FIELDS), LENGTH)
    mixture = MixtureDataset({"a": first, "b": second}, {"a": 0.7, "b": 0.3}, seed=4)
    ids = np.random.default_rng(2).integers(0, len(mixture), size=50)
    with mixture.sync_reader() as reader:
        batch = reader.read_arrays(ids)
        samples = reader.read_batch(ids)
    components, _ = mixture.locate(ids)
    assert set(components.tolist()) == {0, 1}  # both components in one batch
    assert type(batch) is Batch
    assert describe(batch)["samples"] == describe(samples)["samples"]


def test_a_mixture_with_a_component_without_arrays_reads_the_list(tmp_path: Path) -> None:
    from guideloom_pipes import MixtureDataset

    windows = StreamDataset(_stream(tmp_path / "a", TOKENS), LENGTH)
    with windows.sync_reader() as reader:
        plain = [dict(sample) for sample in reader[:]]  # a map-style list: no read_arrays
    mixture = MixtureDataset({"a": windows, "b": plain}, {"a": 0.5, "b": 0.5}, seed=4)
    ids = np.arange(len(mixture))
    with mixture.sync_reader() as reader:
        got = reader.read_arrays(ids)
        assert type(got) is list
        assert describe(got)["samples"] == describe(reader.read_batch(ids))["samples"]


_ARRAY_SAMPLES = {
    "int32 windows": [np.arange(i, i + 2048, dtype="<i4") for i in range(8)],
    "uint16 windows": [np.arange(i, i + 16, dtype="<u2") for i in range(3)],
    "bool masks": [np.arange(5) % (i + 2) == 0 for i in range(3)],
    "float16 images": [np.full((2, 3), i, dtype=np.float16) for i in range(4)],
    "complex": [np.array([1 + 2j, i]) for i in range(2)],
    "0-d": [np.array(i, dtype=np.int64) for i in range(5)],
    "read-only": [np.frombuffer(bytes(range(i, i + 4)), dtype=np.uint8) for i in range(3)],
    "strided views": [np.arange(40, dtype=np.int64).reshape(4, 10)[:, i] for i in range(3)],
    "memmap-like subclass": [np.arange(4).view(np.matrix) for _ in range(2)],
    "mixed dtypes": [np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64)],
    "dicts of arrays": [{"tokens": np.arange(4) + i, "mask": np.ones(4, "u1")} for i in range(3)],
}


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("name", list(_ARRAY_SAMPLES))
def test_default_collate_of_numpy_samples_is_torch_default_collate(name: str) -> None:
    """Samples of numpy arrays are stacked by numpy (one copy) into the tensor torch's
    function makes: values, dtype and shape."""
    samples = _ARRAY_SAMPLES[name]
    assert _equal(default_collate(samples), torch_default_collate(samples))


@pytest.mark.parametrize(
    "samples",
    [
        [np.arange(3), np.arange(4)],
        [np.arange(3, dtype=">i4"), np.arange(3, dtype=">i4")],
        [np.array(["a", "b"]), np.array(["c", "d"])],
        [np.array([object(), None]), np.array([None, None])],
    ],
    ids=["two shapes", "another byte order", "strings", "objects"],
)
def test_numpy_samples_torch_refuses_fail_with_torchs_error(samples: list[np.ndarray]) -> None:
    with pytest.raises(Exception) as theirs:
        torch_default_collate(samples)
    with pytest.raises(type(theirs.value)) as ours:
        default_collate(samples)
    assert str(ours.value) == str(theirs.value)


def test_default_collate_of_columns_torch_cannot_share_fails_as_torch_does() -> None:
    # torch refuses another byte order whether it gets the column or the samples: the same
    # error either way
    big_endian = Batch({"tokens": np.arange(6, dtype=">i4").reshape(2, 3)})
    with pytest.raises(ValueError, match="byte order") as ours:
        default_collate(big_endian)
    with pytest.raises(ValueError, match="byte order") as theirs:
        torch_default_collate(big_endian.samples())
    assert str(ours.value) == str(theirs.value)
    strings = Batch({"names": np.array([["a", "b"], ["c", "d"]])})
    with pytest.raises(TypeError) as ours_strings:
        default_collate(strings)
    with pytest.raises(TypeError) as theirs_strings:
        torch_default_collate(strings.samples())
    assert str(ours_strings.value) == str(theirs_strings.value)


def test_batches_of_columns_are_read_one_by_one_and_lists_a_chunk_at_a_time() -> None:
    from guideloom_pipes.datasets import BatchReads
    from guideloom_pipes.pipes.workers.tasks import ReadTask

    calls: list[int] = []

    def columns(ids: np.ndarray) -> Batch:
        calls.append(len(ids))
        return Batch({"tokens": np.repeat(ids[:, None], 3, axis=1)})

    def rows(ids: np.ndarray) -> list[int]:
        calls.append(len(ids))
        return ids.tolist()

    chunk = [np.arange(k, k + 2, dtype=np.int64) for k in (0, 2, 4)]
    task = ReadTask(BatchReads(columns), ArrayCollate())
    first = task.run(chunk)
    assert calls == [2, 2, 2]  # one read per batch: arrays the size of one batch
    assert [b["samples"][0]["tokens"][1] for b in first] == [[0, 0, 0], [2, 2, 2], [4, 4, 4]]
    calls.clear()
    task = ReadTask(BatchReads(rows), ArrayCollate())
    task.run(chunk[:1])  # the first read tells: no columns
    task.run(chunk)
    assert calls == [2, 6]  # then one read for the whole chunk
    calls.clear()
    ReadTask(BatchReads(rows), list_collate).run(chunk)
    assert calls == [6]  # a user collate: the list path, a chunk at a time, as before


def _lazy(decoded: list[tuple[int, int]], count: int = 10, fail_at: int | None = None) -> LazyRows:
    """LazyRows of the samples ``{"i": k}`` for k < count, noting each slice it decodes."""

    def decode(begin: int, end: int) -> list[Any]:
        decoded.append((begin, end))
        if fail_at is not None and begin <= fail_at < end:
            raise ValueError(f"sample {fail_at} cannot be decoded")
        return [{"i": k} for k in range(begin, end)]

    return LazyRows(count, decode)


def test_lazy_rows_decode_each_slice_when_asked_and_pickle_as_their_samples() -> None:
    decoded: list[tuple[int, int]] = []
    rows = _lazy(decoded)
    assert len(rows) == 10 and decoded == []
    assert rows[2:5] == [{"i": 2}, {"i": 3}, {"i": 4}] and decoded == [(2, 5)]
    assert rows[-1] == {"i": 9} and rows[8:3] == [] and rows[:] == [{"i": k} for k in range(10)]
    assert [s["i"] for s in rows] == list(range(10))
    assert pickle.loads(pickle.dumps(rows)) == [{"i": k} for k in range(10)]
    with pytest.raises(IndexError):
        rows[10]
    with pytest.raises(ValueError, match="step 2"):
        rows[::2]


def test_a_chunk_of_lazy_rows_is_decoded_batch_by_batch_or_at_delivery() -> None:
    from guideloom_pipes.datasets import BatchReads
    from guideloom_pipes.pipes.workers.tasks import Deferred, Failed, ReadTask

    decoded: list[tuple[int, int]] = []
    chunk = [np.arange(k, k + 2, dtype=np.int64) for k in (0, 2, 4, 6)]
    task = ReadTask(BatchReads(lambda ids: _lazy(decoded, len(ids), fail_at=5)), list_collate)
    outcomes = task.run(chunk)
    # one slice per batch; the batch whose slice raises fails alone
    assert decoded == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert type(outcomes[2]) is Failed and "sample 5" in str(outcomes[2].error)
    assert [o for k, o in enumerate(outcomes) if k != 2] == [
        list_collate([{"i": 0}, {"i": 1}]),
        list_collate([{"i": 2}, {"i": 3}]),
        list_collate([{"i": 6}, {"i": 7}]),
    ]
    decoded.clear()
    deferred = task.run(chunk, defer=True)
    assert decoded == [] and all(type(o) is Deferred for o in deferred)
    assert deferred[1].finish() == list_collate([{"i": 2}, {"i": 3}])
    assert decoded == [(2, 4)]
    with pytest.raises(ValueError, match="sample 5"):
        deferred[2].finish()


def test_only_our_readers_are_asked_for_lazy_rows(tmp_path: Path) -> None:
    from guideloom_pipes.datasets import batch_read_fn, batch_reads

    class UsersReader:
        def read_batch(self, ids: np.ndarray) -> list[int]:
            return ids.tolist()

        def read_rows(self, ids: np.ndarray) -> str:  # a method of the user's own
            return "not samples"

    assert batch_reads(UsersReader()).read(np.arange(3)) == [0, 1, 2]
    storage = StreamWithMetaStorage(tmp_path, ChunkMetaFormat())
    with storage.sync_writer() as writer:
        writer.append(0, {"doc": 0, "tokens": list(range(12)), "chunk_ids": [0] * 6 + [1] * 6})
    with StreamDataset(storage, 4).sync_reader() as reader:
        rows = batch_reads(reader).read(np.array([2, 0]))
        assert type(rows) is LazyRows
        assert [s["stream"] for s in rows[:]] == [[8, 9, 10, 11], [0, 1, 2, 3]]
        assert type(batch_read_fn(reader)(np.array([0]))) is list


# -- a one-field stream with default_collate: read and collated in one step --------------------


@pytest.mark.parametrize("mode", MODES[:3], ids=["inline", "prefetch", "threads"])
def test_a_one_field_stream_with_default_collate_is_read_straight_into_its_tensor(
    tmp_path: Path, mode: tuple[int, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = _datasets(tmp_path)["tokens"]
    expected = _epoch(dataset, torch_default_collate, mode)

    def no_batch(cls: Any, columns: Any) -> Any:
        raise AssertionError("a Batch was made for a one-field stream's default_collate")

    monkeypatch.setattr(Batch, "of_columns", classmethod(no_batch))
    ours = _epoch(dataset, None, mode)
    assert len(ours) == len(expected) > 1 and all(map(_equal, ours, expected))
    # drop_last=False on 2 ranks: the short and empty last batches take the general path
    common = {"local_batch_size": 7, "world_size": 2, "rank": 1, "drop_last": False}
    short = _epoch(dataset, None, mode, **common)
    assert short[-1] == [] or len(short[-1]["tokens"]) <= 7


def test_the_one_step_read_is_only_for_default_collate_over_one_numeric_field(
    tmp_path: Path,
) -> None:
    from guideloom_pipes.datasets import batch_reads
    from guideloom_pipes.pipes.workers.tasks import column_read

    def collated_read_fn(reader: Any, collate_fn: Any, out: Any = None) -> Any:
        """The one-step read a ReadTask makes of ``reader`` for ``collate_fn`` (or None)."""
        reads = batch_reads(reader, accepts_batch_arrays(collate_fn), out)
        one = column_read(reads, collate_fn)
        if one is None:
            return None
        read_column, collate_column = one

        def read(ids: np.ndarray) -> Any:
            column = read_column(ids)
            return None if column is None else collate_column(column)

        return read

    datasets = _datasets(tmp_path)
    swapped = StreamDataset(_stream(tmp_path / "swapped", np.dtype([("tokens", ">i4")])), LENGTH)
    readers = {name: dataset.sync_reader() for name, dataset in datasets.items()}
    readers["big-endian"] = swapped.sync_reader()
    for reader in readers.values():
        reader.open()
    try:
        tokens = readers["tokens"]
        read = collated_read_fn(tokens, default_collate)
        assert read is not None
        ids = np.array([3, 62, 0, 64, 158], dtype=np.int64)  # 62, 64, 158: across shards
        got = read(ids)
        want = default_collate(tokens.read_arrays(ids.copy()))
        assert _equal(got, want)
        # batches it does not read: the general read takes them (and names bad ids)
        for other in (ids[:0], np.array([len(tokens)]), np.array([-1]), ids.astype(float)):
            assert read(other) is None
        assert collated_read_fn(tokens, list_collate) is None
        assert collated_read_fn(tokens, default_collate, out=lambda shape, dtype: None) is None
        for name in ("two fields", "meta", "documents", "big-endian"):
            assert collated_read_fn(readers[name], default_collate) is None, name
    finally:
        for reader in readers.values():
            reader.close()
