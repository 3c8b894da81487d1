"""Document storage: round trip, GuideLoom's file layout, global numbering and refusals."""

from __future__ import annotations

import gc
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guideloom_pipes import DocumentPickleFormat, DocumentStorage
from guideloom_pipes.storage import CorruptShardError

SHARDS: dict[int, list[Any]] = {
    0: [{"id": 0, "text": "alpha"}, "", None],
    1: [list(range(50))],
    2: [b"raw", {"nested": {"x": 1.5}}, (1, 2), 3],
}
ALL = [d for shard in sorted(SHARDS) for d in SHARDS[shard]]


class BytesFormat:
    """Documents that are bytes already; ``unpack`` reports what it was given."""

    def pack(self, document: Any) -> Any:
        return document

    def unpack(self, buffer: Any, shard: int) -> tuple[Any, int]:
        return buffer, shard


def write(directory: Path, shards: dict[int, list[Any]] = SHARDS, format: Any = None) -> None:
    storage = DocumentStorage(directory, format or DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for shard, documents in shards.items():
            for document in documents:
                writer.append(shard, document)


def pickled(directory: Path) -> DocumentStorage:
    return DocumentStorage(directory, DocumentPickleFormat())


@pytest.fixture
def written(tmp_path: Path) -> Path:
    write(tmp_path)
    return tmp_path


def test_round_trip_over_several_shards(written: Path) -> None:
    with pickled(written).sync_reader() as reader:
        assert reader.num_shards == 3
        assert [reader.length(k) for k in range(3)] == [3, 1, 4]
        assert reader.total_length == len(ALL)
        assert [reader.read(i) for i in range(len(ALL))] == ALL


def test_read_many_returns_documents_in_the_order_asked_with_repeats(written: Path) -> None:
    order = [7, 0, 3, 3, 5, 0]
    with pickled(written).sync_reader() as reader:
        assert reader.read_many(order) == [ALL[i] for i in order]
        assert reader.read_many(np.array(order, dtype=np.int32)) == [ALL[i] for i in order]
        assert reader.read_many([]) == []


def test_files_use_guideloom_names_and_layout(tmp_path: Path) -> None:
    documents = [b"first", b"", b"third one"]
    write(tmp_path, {0: documents}, BytesFormat())
    data = (tmp_path / "0000000.out_of_band.bin").read_bytes()
    index = np.fromfile(tmp_path / "0000000.out_of_band.index", dtype="<i8")
    assert data == b"".join(documents)
    assert index.tolist() == [0, 5, 5, 14]  # n + 1 int64 offsets, the first 0
    assert (tmp_path / "0000000.out_of_band.index").stat().st_size == 8 * (len(documents) + 1)
    # (and our manifest's folder, which GuideLoom's listing passes over)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".json")) == [
        ".guideloom-manifest",
        "0000000.out_of_band.bin",
        "0000000.out_of_band.index",
    ]


def test_pickle_format_stores_plain_pickles(tmp_path: Path) -> None:
    write(tmp_path, {0: [{"a": 1}, [2]]})
    data = (tmp_path / "0000000.out_of_band.bin").read_bytes()
    first = pickle.dumps({"a": 1}, protocol=pickle.DEFAULT_PROTOCOL)
    assert data == first + pickle.dumps([2], protocol=pickle.DEFAULT_PROTOCOL)


def test_pickle_format_writes_the_protocol_it_is_given(tmp_path: Path) -> None:
    storage = DocumentStorage(tmp_path, DocumentPickleFormat(protocol=2))
    with storage.sync_writer() as writer:
        writer.append(0, {"a": 1})
    assert (tmp_path / "0000000.out_of_band.bin").read_bytes()[:2] == b"\x80\x02"
    with pickled(tmp_path).sync_reader() as reader:
        assert reader.read(0) == {"a": 1}


def test_pack_may_return_bytes_bytearray_or_memoryview(tmp_path: Path) -> None:
    write(tmp_path, {0: [b"ab", bytearray(b"cd"), memoryview(b"efgh")[1:3]]}, BytesFormat())
    storage = DocumentStorage(tmp_path, BytesFormat())
    with storage.sync_reader() as reader:
        assert [bytes(reader.read(i)[0]) for i in range(3)] == [b"ab", b"cd", b"fg"]


def test_pack_may_return_a_memoryview_of_a_non_byte_array(tmp_path: Path) -> None:
    values = np.arange(3, dtype="<i4")
    write(tmp_path, {0: [values.data]}, BytesFormat())
    with DocumentStorage(tmp_path, BytesFormat()).sync_reader() as reader:
        assert bytes(reader.read(0)[0]) == values.tobytes()


@pytest.mark.parametrize("bad", ["text", 5, [1, 2], np.arange(3)])
def test_pack_returning_something_other_than_bytes_is_a_type_error(
    tmp_path: Path, bad: Any
) -> None:
    storage = DocumentStorage(tmp_path, BytesFormat())
    with storage.sync_writer() as writer:
        with pytest.raises(
            TypeError, match=rf"BytesFormat.pack must return bytes.*{type(bad).__name__}"
        ):
            writer.append(0, bad)
        with pytest.raises(KeyError):
            writer.length(0)  # nothing was started


def test_unpack_gets_the_shard_of_the_document(tmp_path: Path) -> None:
    write(tmp_path, {0: [b"a"], 1: [b"b", b"c"]}, BytesFormat())
    with DocumentStorage(tmp_path, BytesFormat()).sync_reader() as reader:
        assert [shard for _, shard in reader.read_many([0, 1, 2])] == [0, 1, 1]


def test_documents_stay_valid_after_the_reader_is_closed(tmp_path: Path) -> None:
    write(tmp_path, {0: [b"kept bytes", b"more"]}, BytesFormat())
    with DocumentStorage(tmp_path, BytesFormat()).sync_reader() as reader:
        buffers = [reader.read(0)[0], *(b for b, _ in reader.read_many([1, 0]))]
    gc.collect()
    assert [bytes(b) for b in buffers] == [b"kept bytes", b"more", b"kept bytes"]


def test_writer_length_counts_documents_appended_in_this_session(tmp_path: Path) -> None:
    with pickled(tmp_path).sync_writer() as writer:
        for i in range(4):
            writer.append(1, i)
        writer.append(0, "x")
        assert (writer.length(0), writer.length(1)) == (1, 4)
        with pytest.raises(KeyError, match="shard 2"):
            writer.length(2)


@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
def test_a_writer_replaces_a_shard_instead_of_appending_to_it(written: Path) -> None:
    with pickled(written).sync_writer() as writer:
        writer.append(1, "replacement")
    with pickled(written).sync_reader() as reader:
        assert [reader.length(k) for k in range(3)] == [3, 1, 4]
        assert reader.read(3) == "replacement"
        assert reader.read_many(range(len(ALL))) == [*ALL[:3], "replacement", *ALL[4:]]


@pytest.mark.parametrize("index", [8, 9, 10**9, -1])
def test_read_refuses_an_index_out_of_range(written: Path, index: int) -> None:
    with (
        pickled(written).sync_reader() as reader,
        pytest.raises(IndexError, match=f"document index {index} out of range.*8 documents"),
    ):
        reader.read(index)


def test_read_many_refuses_an_index_out_of_range_and_names_it(written: Path) -> None:
    with pickled(written).sync_reader() as reader:
        with pytest.raises(IndexError, match="document index 8 out of range"):
            reader.read_many([0, 8, 1])
        with pytest.raises(IndexError, match="document index -2 out of range"):
            reader.read_many(np.array([-2]))


def test_read_many_names_an_index_past_int64_as_given(written: Path) -> None:
    with pickled(written).sync_reader() as reader:
        for ids in (np.array([2**63 + 1], dtype=np.uint64), [1, 2**63 + 1], [2**64]):
            bad = max(int(i) for i in ids)
            with pytest.raises(IndexError, match=rf"document index {bad} out of range.*0\.\.7"):
                reader.read_many(ids)


def test_read_refuses_an_index_that_is_not_an_int(written: Path) -> None:
    with pickled(written).sync_reader() as reader:
        with pytest.raises(TypeError, match=r"global_index must be an int, got 1\.5"):
            reader.read(1.5)
        with pytest.raises(TypeError, match=r"must be integers.*float64"):
            reader.read_many([0, 1.5])


def test_reading_before_open_or_after_close_is_a_runtime_error(written: Path) -> None:
    reader = pickled(written).sync_reader()
    with pytest.raises(RuntimeError, match="not open"):
        reader.read(0)
    with pytest.raises(RuntimeError, match="not open"):
        reader.length(0)
    with reader:
        reader.read(0)
    with pytest.raises(RuntimeError, match="not open"):
        reader.read_many([0])


def test_storage_refuses_a_format_without_pack_and_unpack(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"not a document format.*unpack"):
        DocumentStorage(tmp_path, type("PackOnly", (), {"pack": bytes})())


# GuideLoom-layout files (no commit records) ------------------------------------------------


def write_raw(directory: Path, shard: int, documents: list[bytes], offsets: Any = None) -> None:
    directory.mkdir(exist_ok=True)
    (directory / f"{shard:07d}.out_of_band.bin").write_bytes(b"".join(documents))
    if offsets is None:
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in documents])])
    np.asarray(offsets, dtype="<i8").tofile(directory / f"{shard:07d}.out_of_band.index")


def test_a_shard_without_documents_is_skipped_in_the_global_numbering(tmp_path: Path) -> None:
    write_raw(tmp_path, 0, [b"a", b"b"])
    write_raw(tmp_path, 1, [])
    write_raw(tmp_path, 2, [b"c"])
    with DocumentStorage(tmp_path, BytesFormat()).sync_reader() as reader:
        assert [reader.length(k) for k in range(3)] == [2, 0, 1]
        assert reader.read_many([0, 1, 2]) == [(b"a", 0), (b"b", 0), (b"c", 2)]


def test_an_index_that_does_not_match_its_data_file_is_refused(tmp_path: Path) -> None:
    write_raw(tmp_path, 0, [b"abc", b"de"], offsets=[0, 3, 9])
    reader = DocumentStorage(tmp_path, BytesFormat()).sync_reader()
    with reader, pytest.raises(CorruptShardError, match=r"0000000.out_of_band.index.*0 to 9.*5"):
        reader.read(0)


def test_an_index_whose_size_is_not_whole_offsets_is_refused(tmp_path: Path) -> None:
    write_raw(tmp_path, 0, [b"abc"])
    with (tmp_path / "0000000.out_of_band.index").open("ab") as index:
        index.write(b"\x00\x00\x00")
    with pytest.raises(CorruptShardError, match=r"0000000.out_of_band.index is 19 bytes"):
        DocumentStorage(tmp_path, BytesFormat()).sync_reader().open()


def test_decreasing_offsets_are_refused(tmp_path: Path) -> None:
    write_raw(tmp_path, 0, [b"abc", b"de"], offsets=[0, 4, 2, 5])
    reader = DocumentStorage(tmp_path, BytesFormat()).sync_reader()
    with reader, pytest.raises(CorruptShardError, match="decreasing offsets at document 1"):
        reader.read(1)


def test_an_offset_past_the_end_of_the_data_file_is_refused(tmp_path: Path) -> None:
    write_raw(tmp_path, 0, [b"abc", b"de"], offsets=[0, 9, 2, 5])  # first and last look fine
    reader = DocumentStorage(tmp_path, BytesFormat()).sync_reader()
    with reader, pytest.raises(CorruptShardError, match=r"outside the 5-byte data file.*\[0, 9\)"):
        reader.read(0)


@pytest.mark.parametrize("copies", [1, 5], ids=["few", "many"])
def test_read_many_equals_single_reads_and_hands_out_owned_copies(
    written: Path, copies: int
) -> None:
    """A batch of documents (across shards, repeated, a few read one by one, many all at
    once) decodes as single reads do; each ``unpack`` gets a memoryview of a copy."""
    ids = np.random.default_rng(copies).permutation(np.tile(np.arange(len(ALL)), copies))
    with DocumentStorage(written, BytesFormat()).sync_reader() as reader:
        many = reader.read_many(ids)
        singles = [reader.read(int(i)) for i in ids]
    assert [(bytes(b), s) for b, s in many] == [(bytes(b), s) for b, s in singles]
    assert all(type(b) is memoryview and type(b.obj) is bytearray for b, _ in many)
    with pickled(written).sync_reader() as reader:
        assert reader.read_many(ids) == [ALL[i] for i in ids]


@pytest.mark.parametrize("copies", [1, 20], ids=["few", "many"])
@pytest.mark.parametrize(
    ("offsets", "message"),
    [([0, 4, 2, 5], "decreasing offsets at document 1"), ([0, 9, 2, 5], "outside the 5-byte")],
)
def test_bad_offsets_are_named_by_read_many(
    tmp_path: Path, offsets: list[int], message: str, copies: int
) -> None:
    write_raw(tmp_path, 0, [b"abc", b"de"], offsets=offsets)
    reader = DocumentStorage(tmp_path, BytesFormat()).sync_reader()
    with reader, pytest.raises(CorruptShardError, match=message):
        reader.read_many(np.tile([2, 0, 1], copies))


def test_read_many_accepts_any_iterable_of_ints(written: Path) -> None:
    with pickled(written).sync_reader() as reader:
        assert reader.read_many(i for i in (2, 0)) == [ALL[2], ALL[0]]
        assert reader.read_many(range(3)) == ALL[:3]
