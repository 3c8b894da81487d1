"""Every dataset GuideLoom 1.1 wrote into ``tests/data/guideloom-1.1`` reads back as
``expected.json`` says, through the storage readers and through the datasets.

These tests only read; the fixture directories are opened where they lie (which also shows
that reading needs no write access to a dataset).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from storage_formats import ChunkMetaFormat

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
    StreamWithMetaStorage,
)

FIXTURES = Path(__file__).parent / "data" / "guideloom-1.1"
EXPECTED: dict[str, Any] = json.loads((FIXTURES / "expected.json").read_text())
STREAM = EXPECTED["stream"]
DOCUMENT = EXPECTED["document"]
META = EXPECTED["stream_meta"]
STREAM_LENGTHS = sorted(int(length) for length in STREAM["windows"])
META_LENGTHS = sorted(int(length) for length in META["windows"])


def stream_storage() -> StreamStorage:
    dtype = np.dtype([(name, code) for name, code in STREAM["dtype"]])
    return StreamStorage(FIXTURES / "stream", StreamNumpyFormat(dtype))


def meta_storage() -> StreamWithMetaStorage:
    return StreamWithMetaStorage(FIXTURES / "stream_meta", ChunkMetaFormat())


def document_storage() -> DocumentStorage:
    return DocumentStorage(FIXTURES / "document", DocumentPickleFormat())


def as_lists(sample: dict[str, np.ndarray]) -> dict[str, list[int]]:
    return {name: column.tolist() for name, column in sample.items()}


def shuffled(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n).astype(np.int64)


# stream ------------------------------------------------------------------------------------


def test_fixture_stream_shard_lengths_and_total_length() -> None:
    with stream_storage().sync_reader() as reader:
        assert reader.num_shards == len(STREAM["shard_lengths"])
        assert [reader.length(k) for k in range(reader.num_shards)] == STREAM["shard_lengths"]
        assert reader.total_length == sum(STREAM["shard_lengths"])


@pytest.mark.parametrize("length", STREAM_LENGTHS)
def test_fixture_stream_windows_through_storage_read(length: int) -> None:
    expected = STREAM["windows"][str(length)]
    with stream_storage().sync_reader() as reader:
        got = [as_lists(reader.read(i * length, length)) for i in range(len(expected))]
    assert got == expected


@pytest.mark.parametrize("length", STREAM_LENGTHS)
def test_fixture_stream_windows_through_dataset_index(length: int) -> None:
    expected = STREAM["windows"][str(length)]
    with StreamDataset(stream_storage(), length).sync_reader() as reader:
        assert len(reader) == len(expected)
        assert [as_lists(reader[i]) for i in range(len(reader))] == expected


@pytest.mark.parametrize("length", STREAM_LENGTHS)
def test_fixture_stream_windows_through_dataset_slices(length: int) -> None:
    expected = STREAM["windows"][str(length)]
    with StreamDataset(stream_storage(), length).sync_reader() as reader:
        assert [as_lists(s) for s in reader[:]] == expected
        assert [as_lists(s) for s in reader[1::2]] == expected[1::2]
        assert [as_lists(s) for s in reader[::-1]] == expected[::-1]


@pytest.mark.parametrize("length", STREAM_LENGTHS)
def test_fixture_stream_windows_through_read_batch_in_shuffled_order(length: int) -> None:
    expected = STREAM["windows"][str(length)]
    order = shuffled(len(expected), seed=length)
    with StreamDataset(stream_storage(), length).sync_reader() as reader:
        got = [as_lists(s) for s in reader.read_batch(order)]
    assert got == [expected[i] for i in order]


def test_fixture_stream_dataset_drops_the_trailing_partial_window() -> None:
    total = sum(STREAM["shard_lengths"])
    for length in STREAM_LENGTHS:
        assert len(StreamDataset(stream_storage(), length)) == total // length


@pytest.mark.parametrize(
    "case",
    STREAM["wrapping_reads"],
    ids=[f"{c['global_index']}+{c['global_length']}" for c in STREAM["wrapping_reads"]],
)
def test_fixture_stream_wrapping_reads(case: dict[str, Any]) -> None:
    with stream_storage().sync_reader() as reader:
        sample = reader.read(case["global_index"], case["global_length"])
    assert sample["tokens"].tolist() == case["tokens"]
    assert len(sample["loss_mask"]) == case["global_length"]


# document ----------------------------------------------------------------------------------


def test_fixture_document_shard_counts() -> None:
    with document_storage().sync_reader() as reader:
        assert reader.num_shards == len(DOCUMENT["shard_counts"])
        assert [reader.length(k) for k in range(reader.num_shards)] == DOCUMENT["shard_counts"]
        assert reader.total_length == len(DOCUMENT["documents"])


def test_fixture_document_read_every_document() -> None:
    with document_storage().sync_reader() as reader:
        got = [reader.read(i) for i in range(reader.total_length)]
    assert got == DOCUMENT["documents"]


def test_fixture_document_read_many_in_shuffled_order() -> None:
    order = shuffled(len(DOCUMENT["documents"]), seed=3)
    with document_storage().sync_reader() as reader:
        got = reader.read_many(order)
    assert got == [DOCUMENT["documents"][i] for i in order]


def test_fixture_document_dataset_index_slices_and_read_batch() -> None:
    documents = DOCUMENT["documents"]
    order = shuffled(len(documents), seed=4)
    dataset = DocumentDataset(document_storage())
    assert len(dataset) == len(documents)
    with dataset.sync_reader() as reader:
        assert [reader[i] for i in range(len(reader))] == documents
        assert reader[2:9:3] == documents[2:9:3]
        assert reader.read_batch(order) == [documents[i] for i in order]


# stream with metadata ----------------------------------------------------------------------


def meta_shard_lengths() -> list[int]:
    lengths: dict[int, int] = {}
    for record in META["records"]:
        lengths[record["shard"]] = lengths.get(record["shard"], 0) + len(record["tokens"])
    return [lengths[k] for k in sorted(lengths)]


def test_fixture_stream_meta_shard_lengths_and_total_length() -> None:
    with meta_storage().sync_reader() as reader:
        assert [reader.length(k) for k in range(reader.num_shards)] == meta_shard_lengths()
        assert reader.total_length == sum(meta_shard_lengths())


@pytest.mark.parametrize("length", META_LENGTHS)
def test_fixture_stream_meta_windows_through_storage_read(length: int) -> None:
    expected = META["windows"][str(length)]
    with meta_storage().sync_reader() as reader:
        got = [reader.read(i * length, length) for i in range(len(expected))]
    assert got == expected


@pytest.mark.parametrize("length", META_LENGTHS)
def test_fixture_stream_meta_windows_through_dataset(length: int) -> None:
    expected = META["windows"][str(length)]
    order = shuffled(len(expected), seed=length)
    with StreamDataset(meta_storage(), length).sync_reader() as reader:
        assert len(reader) == len(expected)
        assert [reader[i] for i in range(len(reader))] == expected
        assert reader[:] == expected
        assert reader.read_batch(order) == [expected[i] for i in order]


def test_fixture_stream_meta_wrapping_read() -> None:
    case = META["wrapping_read"]
    assert case["global_index"] == "total_length - 2"  # the fixture states it relative to the end
    with meta_storage().sync_reader() as reader:
        got = reader.read(reader.total_length - 2, case["global_length"])
    assert got == case["result"]


# every backend -----------------------------------------------------------------------------


BACKENDS = [None, "MmapIO", "PosixPreadIO", "SeekIO"]


def backend(name: str | None) -> Any:
    from guideloom_pipes import io

    return None if name is None else getattr(io, name)()


@pytest.mark.parametrize("name", BACKENDS)
def test_fixture_datasets_read_the_same_through_every_backend(name: str | None) -> None:
    dtype = np.dtype([(field, code) for field, code in STREAM["dtype"]])
    stream = StreamStorage(FIXTURES / "stream", StreamNumpyFormat(dtype), backend(name))
    with StreamDataset(stream, 7).sync_reader() as reader:
        assert [as_lists(s) for s in reader[:]] == STREAM["windows"]["7"]
    documents = DocumentStorage(FIXTURES / "document", DocumentPickleFormat(), backend(name))
    with DocumentDataset(documents).sync_reader() as reader:
        assert reader[:] == DOCUMENT["documents"]
    meta = StreamWithMetaStorage(FIXTURES / "stream_meta", ChunkMetaFormat(), backend(name))
    with StreamDataset(meta, 3).sync_reader() as reader:
        assert reader[:] == META["windows"]["3"]


def test_fixture_windows_through_async_dataset_readers() -> None:
    import asyncio

    async def main() -> tuple[list[Any], list[Any]]:
        async with StreamDataset(meta_storage(), 4).async_reader() as reader:
            meta = await reader.read_batch(np.arange(len(reader)))
        async with StreamDataset(stream_storage(), 16).async_reader() as reader:
            stream = [await reader.read(i) for i in range(len(reader))]
        return meta, stream

    meta, stream = asyncio.run(main())
    assert meta == META["windows"]["4"]
    assert [as_lists(s) for s in stream] == STREAM["windows"]["16"]
