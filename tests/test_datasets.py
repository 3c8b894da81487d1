"""StreamDataset / DocumentDataset: length, indexing, slices, batches, pickling, threads and
the refusals of bad arguments."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
from concurrent.futures import ProcessPoolExecutor
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
from guideloom_pipes.io import PosixPreadIO, SeekIO

TOKENS = np.dtype([("tokens", "<i4"), ("loss_mask", "u1")])
SHARD_LENGTHS = [10, 3, 0, 14]  # 27 elements
TOTAL = sum(SHARD_LENGTHS)
DOCUMENTS: dict[int, list[Any]] = {0: ["a", "b"], 1: [{"c": 3}], 2: [None, 4.5, "f"]}
ALL_DOCUMENTS = [d for k in sorted(DOCUMENTS) for d in DOCUMENTS[k]]


def write_stream(directory: Path) -> np.ndarray:
    values = np.arange(TOTAL) * 2
    with StreamStorage(directory, StreamNumpyFormat(TOKENS)).sync_writer() as writer:
        start = 0
        for shard, n in enumerate(SHARD_LENGTHS):
            part = values[start : start + n]
            writer.append(shard, {"tokens": part, "loss_mask": part % 3 == 0})
            start += n
    return values


def write_documents(directory: Path) -> None:
    with DocumentStorage(directory, DocumentPickleFormat()).sync_writer() as writer:
        for shard, documents in DOCUMENTS.items():
            for document in documents:
                writer.append(shard, document)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("datasets")
    write_stream(root / "stream")
    write_documents(root / "documents")
    with StreamWithMetaStorage(root / "meta", ChunkMetaFormat()).sync_writer() as writer:
        writer.append(0, {"doc": 0, "tokens": [0, 1, 2, 3], "chunk_ids": [0, 0, 1, 1]})
        writer.append(1, {"doc": 1, "tokens": [4, 5, 6], "chunk_ids": [0, 1, 1]})
    return root


def stream(root: Path, read_interface: Any = None) -> StreamStorage:
    return StreamStorage(root / "stream", StreamNumpyFormat(TOKENS), read_interface)


def documents(root: Path) -> DocumentStorage:
    return DocumentStorage(root / "documents", DocumentPickleFormat())


def window(i: int, length: int) -> list[int]:
    return list(range(2 * i * length, 2 * (i + 1) * length, 2))


def tokens(samples: list[dict[str, np.ndarray]]) -> list[list[int]]:
    return [s["tokens"].tolist() for s in samples]


# length, index, slices, batches ------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 4, 9, 27, 28, 100])
def test_stream_dataset_length_drops_the_trailing_partial_window(root: Path, length: int) -> None:
    dataset = StreamDataset(stream(root), length)
    assert len(dataset) == TOTAL // length
    with dataset.sync_reader() as reader:
        assert len(reader) == TOTAL // length


def test_document_dataset_length_is_the_document_count(root: Path) -> None:
    dataset = DocumentDataset(documents(root))
    assert len(dataset) == len(ALL_DOCUMENTS)
    with dataset.sync_reader() as reader:
        assert len(reader) == len(ALL_DOCUMENTS)


def test_stream_sample_i_is_elements_i_times_l_to_i_plus_one_times_l(root: Path) -> None:
    with StreamDataset(stream(root), 4).sync_reader() as reader:
        for i in range(len(reader)):
            sample = reader[i]
            assert sample["tokens"].tolist() == window(i, 4)
            assert sample["loss_mask"].tolist() == [int(t % 3 == 0) for t in window(i, 4)]


def test_index_accepts_numpy_integers(root: Path) -> None:
    with StreamDataset(stream(root), 4).sync_reader() as reader:
        assert reader[np.int32(2)]["tokens"].tolist() == window(2, 4)
    with DocumentDataset(documents(root)).sync_reader() as reader:
        assert reader[np.uint8(2)] == ALL_DOCUMENTS[2]


@pytest.mark.parametrize(
    "index", [slice(None), slice(1, 5), slice(None, None, 2), slice(5, 1, -1), slice(-2, None)]
)
def test_slices_return_a_list_like_a_list_slice(root: Path, index: slice) -> None:
    with StreamDataset(stream(root), 4).sync_reader() as reader:
        expected = [window(i, 4) for i in range(len(reader))][index]
        assert tokens(reader[index]) == expected
    with DocumentDataset(documents(root)).sync_reader() as reader:
        assert reader[index] == ALL_DOCUMENTS[index]


def test_slices_past_the_end_are_clamped_and_empty_slices_are_empty(root: Path) -> None:
    with StreamDataset(stream(root), 4).sync_reader() as reader:
        assert tokens(reader[4:100]) == [window(4, 4), window(5, 4)]
        assert reader[3:3] == []
        assert reader[100:] == []


@pytest.mark.parametrize("ids", [[5, 0, 5, 2], np.array([5, 0, 5, 2], dtype=np.uint16)])
def test_read_batch_returns_samples_in_the_order_of_the_ids(root: Path, ids: Any) -> None:
    with StreamDataset(stream(root), 4).sync_reader() as reader:
        assert tokens(reader.read_batch(ids)) == [window(i, 4) for i in [5, 0, 5, 2]]
    with DocumentDataset(documents(root)).sync_reader() as reader:
        assert reader.read_batch(ids) == [ALL_DOCUMENTS[i] for i in [5, 0, 5, 2]]


def test_read_batch_of_no_ids_is_an_empty_list(root: Path) -> None:
    with StreamDataset(stream(root), 4).sync_reader() as reader:
        assert reader.read_batch(np.array([], dtype=np.int64)) == []
        assert reader.read_batch([]) == []
    with DocumentDataset(documents(root)).sync_reader() as reader:
        assert reader.read_batch([]) == []


def test_batch_samples_are_independent_arrays(root: Path) -> None:
    with StreamDataset(stream(root), 4).sync_reader() as reader:
        first, second = reader.read_batch(np.array([1, 1]))
    first["tokens"][:] = -1
    assert second["tokens"].tolist() == window(1, 4)


def test_stream_meta_dataset_reads_windows_with_their_payloads(root: Path) -> None:
    storage = StreamWithMetaStorage(root / "meta", ChunkMetaFormat())
    with StreamDataset(storage, 3).sync_reader() as reader:
        assert len(reader) == 2
        assert reader.read_batch([1]) == [
            {
                "stream": [3, 4, 5],
                "document_shard": [0, 1, 1],
                "document_index": [0, 1, 2],
                "document_data": ["doc:0/chunk:1", "doc:1/chunk:0", "doc:1/chunk:1"],
            }
        ]


def test_a_window_longer_than_the_stream_gives_an_empty_dataset(root: Path) -> None:
    with StreamDataset(stream(root), TOTAL + 1).sync_reader() as reader:
        assert len(reader) == 0
        with pytest.raises(IndexError, match=r"sample index 0 out of range.*0 samples"):
            reader[0]


def test_a_closed_reader_opens_again(root: Path) -> None:
    reader = StreamDataset(stream(root), 5).sync_reader()
    with reader:
        first = reader[0]
    with reader:
        assert tokens([reader[0]]) == tokens([first])


# refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [6, 7, 10**6, -1, -6])
def test_an_index_out_of_range_is_an_index_error(root: Path, index: int) -> None:
    with (
        StreamDataset(stream(root), 4).sync_reader() as reader,
        pytest.raises(IndexError, match=rf"sample index {index} out of range.*6 samples"),
    ):
        reader[index]


@pytest.mark.parametrize("index", [-1, 6])
def test_a_document_index_out_of_range_is_an_index_error(root: Path, index: int) -> None:
    with (
        DocumentDataset(documents(root)).sync_reader() as reader,
        pytest.raises(IndexError, match=rf"sample index {index} out of range.*6 samples"),
    ):
        reader[index]


@pytest.mark.parametrize("index", [1.0, "1", None, (1, 2)])
def test_an_index_that_is_not_an_int_or_slice_is_a_type_error(root: Path, index: Any) -> None:
    with (
        StreamDataset(stream(root), 4).sync_reader() as reader,
        pytest.raises(TypeError, match="integers or slices"),
    ):
        reader[index]


def test_read_batch_refuses_ids_out_of_range_and_names_the_first(root: Path) -> None:
    with StreamDataset(stream(root), 4).sync_reader() as reader:
        with pytest.raises(IndexError, match=r"sample index 6 out of range.*6 samples"):
            reader.read_batch(np.array([0, 6, 9]))
        with pytest.raises(IndexError, match="sample index -1 out of range"):
            reader.read_batch([-1])
    document_reader = DocumentDataset(documents(root)).sync_reader()
    with document_reader, pytest.raises(IndexError, match="sample index 6 out of range"):
        document_reader.read_batch([6])


@pytest.mark.parametrize(
    "ids",
    [np.array([0, 2**63 + 1], dtype=np.uint64), [2**63 + 1], [0, 2**64 + 5]],
    ids=["uint64-array", "list-past-int64", "list-past-uint64"],
)
def test_read_batch_names_ids_past_int64_as_given_not_wrapped_negative(
    root: Path, ids: Any
) -> None:
    bad = max(int(i) for i in ids)
    for reader in (
        StreamDataset(stream(root), 4).sync_reader(),
        DocumentDataset(documents(root)).sync_reader(),
    ):
        with (
            reader,
            pytest.raises(IndexError, match=rf"sample index {bad} out of range.*valid: 0\.\.5"),
        ):
            reader.read_batch(ids)


def test_an_index_past_int64_names_it_and_the_valid_range(root: Path) -> None:
    with StreamDataset(stream(root), 4).sync_reader() as reader:
        for index in (2**63 + 1, np.uint64(2**63 + 1)):
            with pytest.raises(IndexError, match=r"9223372036854775809 .*valid: 0\.\.5"):
                reader[index]


@pytest.mark.parametrize("ids", [np.array([0.0, 1.0]), np.array([True, False]), ["0"]])
def test_read_batch_refuses_ids_that_are_not_integers(root: Path, ids: Any) -> None:
    with (
        StreamDataset(stream(root), 4).sync_reader() as reader,
        pytest.raises(TypeError, match=rf"sample ids must be integers.*{np.asarray(ids).dtype}"),
    ):
        reader.read_batch(ids)


@pytest.mark.parametrize("length", [0, -1, -2048])
def test_sequence_length_below_one_is_a_value_error(root: Path, length: int) -> None:
    with pytest.raises(ValueError, match=f"sequence_length must be >= 1, got {length}"):
        StreamDataset(stream(root), length)


@pytest.mark.parametrize("length", [2.0, "4", None, True])
def test_sequence_length_that_is_not_an_int_is_a_type_error(root: Path, length: Any) -> None:
    with pytest.raises(TypeError, match="sequence_length must be an int"):
        StreamDataset(stream(root), length)


def test_sequence_length_may_be_a_numpy_integer(root: Path) -> None:
    dataset = StreamDataset(stream(root), np.int64(9))
    assert dataset.sequence_length == 9 and type(dataset.sequence_length) is int
    assert len(dataset) == 3


def test_stream_dataset_of_a_document_storage_points_at_document_dataset(root: Path) -> None:
    with pytest.raises(TypeError, match=r"StreamDataset needs a StreamStorage.*DocumentDataset"):
        StreamDataset(documents(root), 4)  # type: ignore[arg-type]


def test_document_dataset_of_a_stream_storage_points_at_stream_dataset(root: Path) -> None:
    with pytest.raises(TypeError, match=r"DocumentDataset needs a DocumentStorage.*StreamDataset"):
        DocumentDataset(stream(root))  # type: ignore[arg-type]


def test_a_dataset_of_something_that_is_not_a_storage_is_a_type_error(root: Path) -> None:
    with pytest.raises(TypeError, match="got PosixPath"):
        StreamDataset(root / "stream", 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got str"):
        DocumentDataset("documents")  # type: ignore[arg-type]


def test_reading_before_open_is_a_runtime_error(root: Path) -> None:
    reader = StreamDataset(stream(root), 4).sync_reader()
    with pytest.raises(RuntimeError, match="not open"):
        reader[0]
    with pytest.raises(RuntimeError, match="not open"):
        reader.read_batch([0])
    with pytest.raises(RuntimeError, match="not open"):
        len(reader)


def test_reading_after_close_is_a_runtime_error(root: Path) -> None:
    with DocumentDataset(documents(root)).sync_reader() as reader:
        reader[0]
    with pytest.raises(RuntimeError, match="not open"):
        reader[0]
    with pytest.raises(RuntimeError, match="not open"):
        reader.read_batch([0])


# pickling and threads ----------------------------------------------------------------------


@pytest.mark.parametrize("read_interface", [None, PosixPreadIO(advice=True), SeekIO()])
def test_an_unpickled_stream_dataset_reads_the_same(root: Path, read_interface: Any) -> None:
    dataset = StreamDataset(stream(root, read_interface), 4)
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy.sequence_length == 4
    with copy.sync_reader() as reader:
        assert tokens(reader[:]) == [window(i, 4) for i in range(6)]


def test_an_unpickled_document_dataset_reads_the_same(root: Path) -> None:
    copy = pickle.loads(pickle.dumps(DocumentDataset(documents(root))))
    with copy.sync_reader() as reader:
        assert reader[:] == ALL_DOCUMENTS


def test_a_dataset_pickles_while_one_of_its_readers_is_open(root: Path) -> None:
    dataset = StreamDataset(stream(root), 4)
    with dataset.sync_reader() as reader:
        reader[0]
        copy = pickle.loads(pickle.dumps(dataset))
    assert len(copy) == 6


def _read_in_worker(dataset: StreamDataset, ids: list[int]) -> list[list[int]]:
    with dataset.sync_reader() as reader:
        return [s["tokens"].tolist() for s in reader.read_batch(ids)]


def test_a_dataset_is_read_in_a_spawned_process_worker(root: Path) -> None:
    dataset = StreamDataset(stream(root, PosixPreadIO()), 4)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        got = pool.submit(_read_in_worker, dataset, [3, 1]).result(timeout=60)
    assert got == [window(3, 4), window(1, 4)]


def write_many_shards(directory: Path, shards: int, per_shard: int) -> np.ndarray:
    """GuideLoom's layout written directly (fast): ``shards`` shards of ``per_shard`` elements."""
    directory.mkdir()
    reference = np.empty(shards * per_shard, dtype=TOKENS)
    reference["tokens"] = np.arange(len(reference))
    reference["loss_mask"] = np.arange(len(reference)) % 2
    for k in range(shards):
        reference[k * per_shard : (k + 1) * per_shard].tofile(directory / f"{k:07d}.in_band.bin")
    return reference


@pytest.mark.parametrize("read_interface", [None, PosixPreadIO(), SeekIO()])
def test_threads_sharing_one_reader_get_correct_batches(
    tmp_path: Path, read_interface: Any
) -> None:
    """Eight threads, one reader, shuffled batches over more shards than the 64 readers a
    descriptor-holding backend keeps open (so its readers are evicted and reopened)."""
    reference = write_many_shards(tmp_path / "many", shards=100, per_shard=7)
    length = 5
    storage = StreamStorage(tmp_path / "many", StreamNumpyFormat(TOKENS), read_interface)
    errors: list[BaseException] = []
    with StreamDataset(storage, length).sync_reader() as reader:
        count = len(reader)
        barrier = threading.Barrier(8)

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                barrier.wait()
                for _ in range(30):
                    ids = rng.integers(0, count, size=16)
                    for i, sample in zip(ids.tolist(), reader.read_batch(ids)):
                        expected = reference[i * length : (i + 1) * length]
                        assert sample["tokens"].tolist() == expected["tokens"].tolist()
                        assert sample["loss_mask"].tolist() == expected["loss_mask"].tolist()
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors[0]


def test_threads_sharing_one_document_reader_get_correct_documents(tmp_path: Path) -> None:
    with DocumentStorage(tmp_path, DocumentPickleFormat()).sync_writer() as writer:
        for i in range(300):
            writer.append(i % 3, i)
    expected = [i for shard in range(3) for i in range(shard, 300, 3)]
    errors: list[BaseException] = []
    with DocumentDataset(DocumentStorage(tmp_path, DocumentPickleFormat())).sync_reader() as r:

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(30):
                    ids = rng.integers(0, 300, size=20)
                    assert r.read_batch(ids) == [expected[i] for i in ids]
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors[0]
