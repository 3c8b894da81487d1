"""``MegatronIndexedStorage``: Megatron-LM's indexed datasets, written by megatron-core's own
``IndexedDatasetBuilder``, read in place: every token and every document equal to what
megatron-core's ``IndexedDataset`` reads back, and every bad file refused by name."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from corpus_writers import megatron, megatron_read_back, random_documents, write_megatron

megatron()  # (the module skips without megatron-core)

from guideloom_pipes import (  # noqa: E402
    DocumentDataset,
    MegatronIndexedStorage,
    PackedDataset,
    StreamDataset,
    open_storage,
)
from guideloom_pipes.storage import CorruptShardError, StorageError  # noqa: E402

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "uint16"]


def _stream(prefix: Path) -> np.ndarray:
    sequences, _ = megatron_read_back(prefix)
    return np.concatenate(sequences) if sequences else np.empty(0)


def _documents(storage: Any) -> list[np.ndarray]:
    with DocumentDataset(storage).sync_reader() as reader:
        return [sample["tokens"] for sample in reader]


@pytest.mark.parametrize("dtype", DTYPES)
def test_windows_and_documents_are_what_megatron_reads_for_every_dtype(
    tmp_path: Path, dtype: str
) -> None:
    prefix = write_megatron(tmp_path / "corpus", random_documents(1, 60, dtype), dtype)
    storage = MegatronIndexedStorage(prefix)
    stream = _stream(prefix)
    _, documents = megatron_read_back(prefix)
    with StreamDataset(storage, 7).sync_reader() as reader:
        assert len(reader) == len(stream) // 7
        windows = np.stack([sample["tokens"] for sample in reader])
        assert windows.dtype == np.dtype(dtype)
        assert np.array_equal(windows.reshape(-1), stream[: len(reader) * 7])
        batch = reader.read_arrays(np.array([3, 0, len(reader) - 1]))
        assert np.array_equal(batch.columns["tokens"], windows[[3, 0, len(reader) - 1]])
    got = _documents(storage)
    assert len(got) == len(documents) == 60
    for mine, theirs in zip(got, documents):
        assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs)


@pytest.mark.parametrize(
    "layout",
    ["several sequences a document", "empty sequences and documents", "no sequence at all"],
)
def test_documents_are_the_sequences_the_index_groups(tmp_path: Path, layout: str) -> None:
    if layout == "no sequence at all":
        documents: list[list[np.ndarray]] = []
    else:
        documents = random_documents(2, 30, "int32", sequences=3, empty=layout.startswith("empty"))
        if layout.startswith("empty"):
            documents.insert(4, [])  # a document of no sequence
    prefix = write_megatron(tmp_path / "corpus", documents, "int32")
    # (megatron-core cannot map an empty .bin: what it wrote is the expectation there)
    _, expected = megatron_read_back(prefix) if documents else ([], [])
    got = _documents(MegatronIndexedStorage(prefix))
    assert [d.tolist() for d in got] == [d.tolist() for d in expected]
    tokens = len(_stream(prefix)) if documents else 0
    with StreamDataset(MegatronIndexedStorage(prefix), 5).sync_reader() as reader:
        assert len(reader) == tokens // 5


def test_several_prefixes_are_one_stream_in_the_order_given(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    first = write_megatron(tmp_path / "a", random_documents(3, 20, "uint16"), "uint16")
    second = write_megatron(tmp_path / "b" / "c", random_documents(4, 25, "uint16"), "uint16")
    storage = MegatronIndexedStorage([second, f"{first}.bin"])
    stream = np.concatenate([_stream(second), _stream(first)])
    with StreamDataset(storage, 9).sync_reader() as reader:
        assert reader.storage_reader.num_shards == 2
        got = np.concatenate([sample["tokens"] for sample in reader])
    assert np.array_equal(got, stream[: len(got)]) and len(got) == len(stream) // 9 * 9
    expected = megatron_read_back(second)[1] + megatron_read_back(first)[1]
    assert [d.tolist() for d in _documents(storage)] == [d.tolist() for d in expected]


def test_tokens_are_read_as_the_dtype_asked_for(tmp_path: Path) -> None:
    prefix = write_megatron(tmp_path / "corpus", random_documents(5, 30, "uint16"), "uint16")
    wide = MegatronIndexedStorage(prefix, dtype="int32")
    with StreamDataset(wide, 8).sync_reader() as reader:
        assert reader[0]["tokens"].dtype == np.int32
        columns = reader.read_arrays(np.arange(len(reader))).columns["tokens"]
        assert columns.dtype == np.int32
        assert np.array_equal(columns.reshape(-1), _stream(prefix)[: columns.size])
    assert all(d.dtype == np.int32 for d in _documents(wide))


def test_a_token_past_the_dtype_asked_for_is_refused_naming_the_file_and_the_value(
    tmp_path: Path,
) -> None:
    documents = [[np.array([1, 2, 3], np.uint16)], [np.array([4, 40000, 5], np.uint16)]]
    prefix = write_megatron(tmp_path / "corpus", documents, "uint16")
    narrow = MegatronIndexedStorage(prefix, dtype="int16")
    with StreamDataset(narrow, 3).sync_reader() as reader:
        assert reader[0]["tokens"].tolist() == [1, 2, 3]  # what fits is read
        with pytest.raises(StorageError) as caught:
            reader[1]
        with pytest.raises(StorageError):
            reader.read_arrays(np.array([0, 1]))
    message = str(caught.value)
    assert "token 40000 at element 4 of" in message and f"{prefix}.bin" in message
    assert "does not fit dtype=int16" in message and "dtype='uint16'" in message
    with pytest.raises(StorageError, match="token 40000"):
        narrow.verify()
    assert MegatronIndexedStorage(prefix).verify() == {"shards": 1, "tokens": 6}


def test_prefixes_of_two_dtypes_are_refused_with_the_way_to_blend_them(tmp_path: Path) -> None:
    small = write_megatron(tmp_path / "small", random_documents(6, 3, "uint16"), "uint16")
    large = write_megatron(tmp_path / "large", random_documents(7, 3, "int32"), "int32")
    with pytest.raises(StorageError, match=r"different dtypes.*MixtureDataset"):
        MegatronIndexedStorage([small, large])


def _corrupt(prefix: Path, offset: int, data: bytes) -> None:
    with open(f"{prefix}.idx", "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


@pytest.mark.parametrize(
    ("damage", "error", "match"),
    [
        ("version", CorruptShardError, r"corpus\.idx is index version 2"),
        ("magic", CorruptShardError, r"does not start with b'MMIDIDX"),
        ("truncated index", CorruptShardError, r"corpus\.idx is \d+ bytes, but its header"),
        ("truncated data", CorruptShardError, r"corpus\.bin is \d+ bytes, but its index"),
        ("missing data", FileNotFoundError, r"corpus\.bin does not exist"),
        ("dtype code", CorruptShardError, r"names dtype code 9"),
    ],
)
def test_a_damaged_corpus_is_refused_naming_the_file_and_the_fix(
    tmp_path: Path, damage: str, error: type[Exception], match: str
) -> None:
    prefix = write_megatron(tmp_path / "corpus", random_documents(8, 10, "int32"), "int32")
    if damage == "version":
        _corrupt(prefix, 9, struct.pack("<Q", 2))
    elif damage == "magic":
        _corrupt(prefix, 0, b"NOTANIDX!")
    elif damage == "truncated index":
        data = Path(f"{prefix}.idx").read_bytes()
        Path(f"{prefix}.idx").write_bytes(data[:-8])
    elif damage == "truncated data":
        data = Path(f"{prefix}.bin").read_bytes()
        Path(f"{prefix}.bin").write_bytes(data[:-4])
    elif damage == "missing data":
        Path(f"{prefix}.bin").unlink()
    else:
        _corrupt(prefix, 17, bytes([9]))
    with pytest.raises(error, match=match) as caught:
        MegatronIndexedStorage(prefix).verify()
    if error is CorruptShardError:
        assert "IndexedDatasetBuilder" in str(caught.value)


def test_float_and_multimodal_indexes_are_refused_by_name(tmp_path: Path) -> None:
    import torch

    module = megatron()
    floats = tmp_path / "floats"
    builder = module.IndexedDatasetBuilder(f"{floats}.bin", dtype=np.float32)
    builder.add_item(torch.tensor([0.5, 1.5]))
    builder.end_document()
    builder.finalize(f"{floats}.idx")
    with pytest.raises(ValueError, match="float32 values \\(dtype code 7\\)"):
        MegatronIndexedStorage(floats)
    modes = tmp_path / "modes"
    builder = module.IndexedDatasetBuilder(f"{modes}.bin", dtype=np.int32, multimodal=True)
    builder.add_item(torch.tensor([1, 2, 3]), mode=1)
    builder.end_document()
    builder.finalize(f"{modes}.idx")
    with pytest.raises(ValueError, match="multimodal index"):
        MegatronIndexedStorage(modes).verify()


def test_open_storage_recognises_a_prefix_and_either_file(tmp_path: Path) -> None:
    prefix = write_megatron(tmp_path / "corpus", random_documents(9, 10, "uint16"), "uint16")
    for given in (prefix, f"{prefix}.bin", str(prefix) + ".idx"):
        storage = open_storage(given)
        assert isinstance(storage, MegatronIndexedStorage)
        assert storage.prefixes == [prefix]
    assert open_storage(prefix, dtype="int64").dtype == np.int64
    with pytest.raises(TypeError, match="is read-only"):
        open_storage(prefix).sync_writer()


def test_the_fingerprint_changes_with_the_corpus(tmp_path: Path) -> None:
    prefix = write_megatron(tmp_path / "corpus", random_documents(10, 10, "int32"), "int32")
    with StreamDataset(MegatronIndexedStorage(prefix), 4).sync_reader() as reader:
        before = reader.fingerprint()
    with StreamDataset(MegatronIndexedStorage(prefix), 4).sync_reader() as reader:
        assert reader.fingerprint() == before
    write_megatron(prefix, random_documents(11, 12, "int32"), "int32")
    with StreamDataset(MegatronIndexedStorage(prefix), 4).sync_reader() as reader:
        assert reader.fingerprint() != before


def test_packing_takes_the_document_lengths_from_the_index(tmp_path: Path) -> None:
    from guideloom_pipes import DocumentPickleFormat, DocumentStorage

    documents = random_documents(12, 40, "int32", sequences=2)
    prefix = write_megatron(tmp_path / "corpus", documents, "int32")
    copy = DocumentStorage(tmp_path / "copy", DocumentPickleFormat())
    with copy.sync_writer() as writer:
        for document in megatron_read_back(prefix)[1]:
            writer.append(0, {"tokens": document})
    for seed in (None, 3):
        packed = PackedDataset(MegatronIndexedStorage(prefix), 16, eos_token=0, seed=seed)
        reference = PackedDataset(copy, 16, eos_token=0, seed=seed)
        with packed.sync_reader() as mine, reference.sync_reader() as theirs:
            assert len(mine) == len(theirs) > 5
            for a, b in zip(mine, theirs):
                assert all(np.array_equal(a[k], b[k]) for k in b)
    # no sidecar next to the corpus: its lengths came from the index
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "corpus.bin", "corpus.idx"]


def test_a_megatron_corpus_blends_with_a_stream_of_ours_at_one_dtype(tmp_path: Path) -> None:
    from guideloom_pipes import MixtureDataset, StreamNumpyFormat, StreamStorage

    prefix = write_megatron(tmp_path / "corpus", random_documents(13, 50, "uint16"), "uint16")
    ours = StreamStorage(tmp_path / "ours", StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    with ours.sync_writer() as writer:
        writer.append(0, {"tokens": -np.arange(1, 401, dtype=np.int32)})
    windows = {
        "megatron": StreamDataset(MegatronIndexedStorage(prefix, dtype="int32"), 8),
        "ours": StreamDataset(ours, 8),
    }
    mixture = MixtureDataset(windows, {"megatron": 0.5, "ours": 0.5}, seed=1)
    with mixture.sync_reader() as reader:
        batch = reader.read_arrays(np.arange(len(reader)))
        components, _ = mixture.locate(np.arange(len(reader)))
    tokens = batch.columns["tokens"]
    assert tokens.dtype == np.int32
    assert set(components.tolist()) == {0, 1}
    # our stream's tokens are negative, Megatron's not: each row is its component's
    assert ((tokens < 0).all(axis=1) == (components == 1)).all()
    with (
        pytest.raises((TypeError, ValueError), match="dtype"),
        MixtureDataset(
            {"megatron": StreamDataset(MegatronIndexedStorage(prefix), 8), "ours": windows["ours"]},
            {"megatron": 0.5, "ours": 0.5},
            seed=1,
        ).sync_reader() as reader,
    ):
        reader.read_arrays(np.arange(len(reader)))
