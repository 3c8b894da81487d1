"""Stream with metadata: round trip, file layout, the pack protocol's refusals, and payloads
decoded for any window (across shards and the wrap-around)."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from storage_formats import ChunkMetaFormat, ScriptedMetaFormat

from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage, StreamWithMetaStorage
from guideloom_pipes.batch import LazyRows
from guideloom_pipes.io import MmapIO, PosixPreadIO
from guideloom_pipes.storage import stream_meta
from guideloom_pipes.storage.errors import CorruptShardError

RECORD = np.dtype([("index", "<i4"), ("user", "<i4")])


def scripted(directory: Path) -> StreamWithMetaStorage:
    return StreamWithMetaStorage(directory, ScriptedMetaFormat())


def runs_record(runs: list[tuple[Any, bytes, int]], first_value: int = 0) -> tuple[Any, ...]:
    """A ScriptedMetaFormat record: ``runs`` of (key, payload, length); values count up."""
    pairs: list[tuple[Any, Any]] = []
    for key, payload, length in runs:
        pairs += [(key, payload)] + [(key, None)] * (length - 1)
    stream = np.arange(first_value, first_value + len(pairs), dtype="<i4")
    return pairs, stream


class Reference:
    """What every element of a written stream-with-metadata dataset should decode to."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.payloads: list[tuple[int, int, bytes]] = []  # (shard, local id, payload)
        self.element_payload: list[int] = []  # index into self.payloads
        self._per_shard: dict[int, int] = {}

    def add(self, shard: int, runs: list[tuple[Any, bytes, int]]) -> None:
        for _, payload, length in runs:
            local = self._per_shard.get(shard, 0)
            self._per_shard[shard] = local + 1
            self.payloads.append((shard, local, payload))
            for _ in range(length):
                self.element_payload.append(len(self.payloads) - 1)
                self.values.append(len(self.values))

    def window(self, start: int, length: int) -> dict[str, Any]:
        total = len(self.values)
        positions = [(start + t) % total for t in range(length)]
        first_use: dict[int, int] = {}
        for p in positions:
            first_use.setdefault(self.element_payload[p], len(first_use))
        used = sorted(first_use, key=first_use.__getitem__)
        return {
            "stream": [self.values[p] for p in positions],
            "document_shard": [self.payloads[j][0] for j in used],
            "document_index": [first_use[self.element_payload[p]] for p in positions],
            "document_data": [self.payloads[j][2] for j in used],
        }


def as_plain(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "document_index": [int(i) for i in sample["document_index"]]}


def write_runs(
    directory: Path, appends: list[tuple[int, list[tuple[Any, bytes, int]]]]
) -> Reference:
    """Write appends shard by shard in id order (so values count up through the stream)."""
    reference = Reference()
    by_shard: dict[int, list[list[tuple[Any, bytes, int]]]] = {}
    for shard, runs in appends:
        by_shard.setdefault(shard, []).append(runs)
    with scripted(directory).sync_writer() as writer:
        for shard in sorted(by_shard):
            for runs in by_shard[shard]:
                writer.append(shard, runs_record(runs, len(reference.values)))
                reference.add(shard, runs)
    return reference


APPENDS: list[tuple[int, list[tuple[Any, bytes, int]]]] = [
    (0, [("a", b"p0", 2), ("b", b"p1", 3)]),
    (0, [("a", b"p2", 1)]),  # key "a" again, in a new append: a new payload
    (1, [(7, b"q0", 4)]),
    (2, [(0, b"r0", 1), (1, b"r1", 2), (2, b"", 1)]),
]


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, Reference]:
    return tmp_path, write_runs(tmp_path, APPENDS)


# round trip and layout ---------------------------------------------------------------------


def test_round_trip_of_every_window(written: tuple[Path, Reference]) -> None:
    directory, reference = written
    total = len(reference.values)
    with scripted(directory).sync_reader() as reader:
        assert reader.total_length == total == 14
        assert [reader.length(k) for k in range(3)] == [6, 4, 4]
        for start in range(total):
            for length in (0, 1, 3, total, total + 5):
                got = as_plain(reader.read(start, length))
                assert got == reference.window(start, length), (start, length)


def test_files_use_guideloom_names_and_layout(written: tuple[Path, Reference]) -> None:
    directory, _ = written
    records = np.fromfile(directory / "0000000.in_band.bin", dtype=RECORD)
    assert records["index"].tolist() == [0, 0, 1, 1, 1, 2]
    assert records["user"].tolist() == list(range(6))
    assert (directory / "0000000.out_of_band.bin").read_bytes() == b"p0p1p2"
    index = np.fromfile(directory / "0000000.out_of_band.index", dtype="<i8")
    assert index.tolist() == [0, 2, 4, 6]
    assert np.fromfile(directory / "0000002.out_of_band.index", dtype="<i8").tolist() == [
        0,
        2,
        4,
        4,
    ]
    names = sorted(p.name for p in directory.iterdir() if p.name.startswith("0000001"))
    assert [n for n in names if not n.endswith(".json")] == [
        "0000001.in_band.bin",
        "0000001.out_of_band.bin",
        "0000001.out_of_band.index",
    ]


def test_runs_do_not_continue_across_appends(tmp_path: Path) -> None:
    with scripted(tmp_path).sync_writer() as writer:
        writer.append(0, runs_record([("k", b"one", 2)]))
        writer.append(0, runs_record([("k", b"two", 2)], 2))
    with scripted(tmp_path).sync_reader() as reader:
        got = reader.read(0, 4)
    assert got["document_data"] == [b"one", b"two"]
    assert got["document_index"].tolist() == [0, 0, 1, 1]


def test_equal_payloads_of_different_runs_stay_distinct(tmp_path: Path) -> None:
    write_runs(tmp_path, [(0, [("a", b"same", 1), ("b", b"same", 2)])])
    with scripted(tmp_path).sync_reader() as reader:
        got = reader.read(0, 3)
    assert got["document_data"] == [b"same", b"same"]
    assert got["document_index"].tolist() == [0, 1, 1]


class RawScriptedFormat(ScriptedMetaFormat):
    """Returns ``unpack``'s arguments as they came."""

    def unpack(self, *arguments: Any) -> Any:
        return arguments


def test_unpack_gets_int32_document_index_and_int64_document_shard(
    written: tuple[Path, Reference],
) -> None:
    directory, _ = written
    with StreamWithMetaStorage(directory, RawScriptedFormat()).sync_reader() as reader:
        _, document_shard, document_index, _ = reader.read(4, 5)
    assert document_index.dtype == np.int32
    assert len(document_index) == 5
    assert document_shard.dtype == np.int64


def test_unpack_gets_payloads_as_memoryviews_of_owned_copies(
    written: tuple[Path, Reference],
) -> None:
    directory, reference = written
    with StreamWithMetaStorage(directory, RawScriptedFormat()).sync_reader() as reader:
        _, _, _, document_data = reader.read(4, 5)
    assert all(type(d) is memoryview and type(d.obj) is bytearray for d in document_data)
    assert [bytes(d) for d in document_data] == reference.window(4, 5)["document_data"]


def test_payloads_are_decoded_for_windows_crossing_shards(
    written: tuple[Path, Reference],
) -> None:
    directory, _ = written
    with scripted(directory).sync_reader() as reader:
        got = as_plain(reader.read(5, 6))
    assert got == {
        "stream": [5, 6, 7, 8, 9, 10],
        "document_shard": [0, 1, 2],
        "document_index": [0, 1, 1, 1, 1, 2],
        "document_data": [b"p2", b"q0", b"r0"],
    }


def test_dataset_windows_decode_their_payloads(written: tuple[Path, Reference]) -> None:
    directory, reference = written
    with StreamDataset(scripted(directory), 4).sync_reader() as reader:
        assert len(reader) == 3
        batch = reader.read_batch(np.array([2, 0, 1, 2]))
        single = reader[1]
    assert [as_plain(s) for s in batch] == [reference.window(4 * i, 4) for i in (2, 0, 1, 2)]
    assert as_plain(single) == reference.window(4, 4)


def test_payloads_may_be_memoryviews_or_bytearrays(tmp_path: Path) -> None:
    pairs = [(0, memoryview(b"mv")), (0, None), (1, bytearray(b"ba"))]
    with scripted(tmp_path).sync_writer() as writer:
        writer.append(0, (pairs, np.arange(3, dtype="<i4")))
    with scripted(tmp_path).sync_reader() as reader:
        assert reader.read(0, 3)["document_data"] == [b"mv", b"ba"]


def test_writer_length_counts_elements_appended_in_this_session(tmp_path: Path) -> None:
    with scripted(tmp_path).sync_writer() as writer:
        writer.append(3, runs_record([("a", b"x", 3)]))
        writer.append(3, runs_record([("a", b"y", 2)]))
        assert writer.length(3) == 5
        with pytest.raises(KeyError, match="shard 0"):
            writer.length(0)


@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
def test_a_writer_replaces_a_shard_instead_of_appending_to_it(
    written: tuple[Path, Reference],
) -> None:
    directory, _ = written
    with scripted(directory).sync_writer() as writer:
        writer.append(1, runs_record([("z", b"new", 2)], 100))
    with scripted(directory).sync_reader() as reader:
        assert reader.length(1) == 2
        got = reader.read(6, 2)
    assert got["stream"] == [100, 101]
    assert got["document_data"] == [b"new"]


# hypothesis: any window --------------------------------------------------------------------

runs_strategy = st.lists(
    st.tuples(st.binary(max_size=4), st.integers(1, 4)), min_size=1, max_size=4
).map(lambda runs: [(i, payload, n) for i, (payload, n) in enumerate(runs)])
appends_strategy = st.lists(st.tuples(st.integers(0, 3), runs_strategy), min_size=1, max_size=6)


@settings(deadline=None, max_examples=40)
@given(appends=appends_strategy, data=st.data())
def test_any_window_decodes_to_the_reference(
    appends: list[tuple[int, list[tuple[Any, bytes, int]]]], data: st.DataObject
) -> None:
    shards = sorted({shard for shard, _ in appends})
    renumber = {shard: i for i, shard in enumerate(shards)}  # no gaps
    appends = [(renumber[shard], runs) for shard, runs in appends]
    directory = Path(tempfile.mkdtemp(prefix="meta-prop-"))
    reference = write_runs(directory, appends)
    total = len(reference.values)
    with scripted(directory).sync_reader() as reader:
        for _ in range(4):
            start = data.draw(st.integers(0, total - 1), label="start")
            length = data.draw(st.integers(0, 2 * total + 1), label="length")
            assert as_plain(reader.read(start, length)) == reference.window(start, length)


@settings(deadline=None, max_examples=40)
@given(appends=appends_strategy, data=st.data())
def test_any_batch_of_dataset_windows_decodes_to_the_reference(
    appends: list[tuple[int, list[tuple[Any, bytes, int]]]], data: st.DataObject
) -> None:
    """``read_batch`` decodes a batch at once (rows inside one shard together, rows crossing
    shards one by one): every row is the window the reference says."""
    shards = sorted({shard for shard, _ in appends})
    renumber = {shard: i for i, shard in enumerate(shards)}
    appends = [(renumber[shard], runs) for shard, runs in appends]
    directory = Path(tempfile.mkdtemp(prefix="meta-batch-"))
    reference = write_runs(directory, appends)
    total = len(reference.values)
    length = data.draw(st.integers(1, total), label="sequence_length")
    with StreamDataset(scripted(directory), length).sync_reader() as reader:
        ids = data.draw(st.lists(st.integers(0, len(reader) - 1), max_size=8), label="ids")
        batch = reader.read_batch(np.array(ids, dtype=np.int64))
    assert [as_plain(s) for s in batch] == [reference.window(i * length, length) for i in ids]


def test_a_batch_row_whose_payload_numbers_decrease_decodes_like_a_single_read(
    tmp_path: Path,
) -> None:
    """Files from elsewhere may number a window's payloads out of order: such a row is
    decoded on its own (first use order), the other rows of the batch together."""
    write_runs(tmp_path, [(0, [("a", b"p0", 2), ("b", b"p1", 2), ("c", b"p2", 4)])])
    path = tmp_path / "0000000.in_band.bin"
    records = np.fromfile(path, dtype=RECORD)
    records["index"][:4] = [1, 1, 0, 0]  # the first window points at p1, then p0
    records.tofile(path)
    storage = scripted(tmp_path)
    with StreamDataset(storage, 4).sync_reader() as reader, storage.sync_reader() as stream:
        batch = reader.read_batch(np.array([0, 1, 0]))
        singles = [stream.read(0, 4), stream.read(4, 4), stream.read(0, 4)]
    assert [as_plain(s) for s in batch] == [as_plain(s) for s in singles]
    assert as_plain(batch[0])["document_data"] == [b"p1", b"p0"]
    assert as_plain(batch[0])["document_index"] == [0, 0, 1, 1]


def test_a_batch_row_whose_payload_numbers_jump_decodes_like_a_single_read(
    tmp_path: Path,
) -> None:
    """A row whose payload numbers skip one (files from elsewhere) touches payloads that are
    not back to back: it is decoded on its own, the rows around it together."""
    write_runs(tmp_path, [(0, [("a", b"p0", 2), ("b", b"p1", 2), ("c", b"p2", 4)])])
    path = tmp_path / "0000000.in_band.bin"
    records = np.fromfile(path, dtype=RECORD)
    records["index"][2:4] = 2  # the first window now points at p0, then p2 (p1 skipped)
    records.tofile(path)
    storage = scripted(tmp_path)
    with StreamDataset(storage, 4).sync_reader() as reader, storage.sync_reader() as stream:
        batch = reader.read_batch(np.array([1, 0, 1]))
        singles = [stream.read(4, 4), stream.read(0, 4), stream.read(4, 4)]
    assert [as_plain(s) for s in batch] == [as_plain(s) for s in singles]
    assert as_plain(batch[1])["document_data"] == [b"p0", b"p2"]
    assert as_plain(batch[1])["document_index"] == [0, 0, 1, 1]


@pytest.mark.parametrize("backend", [MmapIO, PosixPreadIO])
@pytest.mark.parametrize("length", [1, 2, 3, 5, 14])
def test_a_batch_of_windows_equals_their_single_reads(
    written: tuple[Path, Reference], backend: type, length: int
) -> None:
    """Every window of a batch (shard boundaries, runs spanning windows, a batch touching
    several shards, ids repeated) decodes as a single read of its span does, over mapped
    files (the batch path) and over ``pread`` (payloads read run by run)."""
    directory, _ = written
    storage = StreamWithMetaStorage(directory, ScriptedMetaFormat(), backend())
    with StreamDataset(storage, length).sync_reader() as reader, storage.sync_reader() as stream:
        ids = np.random.default_rng(length).permutation(np.repeat(np.arange(len(reader)), 2))
        batch = reader.read_batch(ids)
        singles = [stream.read(int(i) * length, length) for i in ids]
    assert [as_plain(s) for s in batch] == [as_plain(s) for s in singles]


def test_the_payloads_of_a_batch_are_memoryviews_of_one_owned_copy(
    written: tuple[Path, Reference],
) -> None:
    """The payloads a batch read hands ``unpack`` are memoryviews over a copy the read made
    (a ``bytearray``), never over the mapped file, and stay valid after the reader closes."""
    directory, reference = written
    seen: list[Sequence[Any]] = []

    class Keeping(ScriptedMetaFormat):
        def unpack(self, stream_data: Any, shards: Any, index: Any, data: Any) -> Any:
            seen.append(data)
            return super().unpack(stream_data, shards, index, data)

    with StreamDataset(StreamWithMetaStorage(directory, Keeping()), 2).sync_reader() as reader:
        reader.read_batch(np.array([0, 1, 6, 2]))
    payloads = [payload for data in seen for payload in data]
    assert all(type(p) is memoryview and type(p.obj) is bytearray for p in payloads)
    assert [bytes(p) for p in payloads] == [
        bytes(d) for i in (0, 1, 6, 2) for d in reference.window(2 * i, 2)["document_data"]
    ]


@pytest.mark.parametrize("backend", [MmapIO, PosixPreadIO])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda o: o.__setitem__(slice(1, 3), o[2:0:-1].copy()), "decreasing offsets at"),
        (lambda o: o.__setitem__(2, 10_000), "offsets outside the"),
    ],
    ids=["decreasing", "past-the-end"],
)
@pytest.mark.parametrize("copies", [1, 8], ids=["few-rows", "many-rows"])
def test_bad_payload_offsets_are_named_by_a_batch_read(
    written: tuple[Path, Reference], backend: type, change: Any, message: str, copies: int
) -> None:
    """The batch path checks the offsets it gathers and names the index file (a few rows
    are read one by one, many all at once)."""
    directory, _ = written
    index_path = directory / "0000000.out_of_band.index"
    offsets = np.fromfile(index_path, dtype="<i8")
    change(offsets)
    offsets.tofile(index_path)
    storage = StreamWithMetaStorage(directory, ScriptedMetaFormat(), backend())
    pattern = rf"0000000\.out_of_band\.index has {message}"
    with (
        StreamDataset(storage, 2).sync_reader() as reader,
        pytest.raises(CorruptShardError, match=pattern),
    ):
        reader.read_batch(np.tile([0, 1, 2], copies))


@pytest.mark.parametrize("copies", [1, 12], ids=["few-rows", "many-rows"])
def test_a_batch_row_pointing_past_its_payloads_is_named(
    written: tuple[Path, Reference], copies: int
) -> None:
    directory, _ = written
    path = directory / "0000000.in_band.bin"
    records = np.fromfile(path, dtype=RECORD)
    records["index"][2:4] = [3, 4]  # shard 0 holds payloads 0..2; steps of 1
    records.tofile(path)
    pattern = r"pointing at payload 4, but .* 3 entries"
    with (
        StreamDataset(scripted(directory), 2).sync_reader() as reader,
        pytest.raises(CorruptShardError, match=pattern),
    ):
        reader.read_batch(np.tile([0, 1], copies))


def test_a_failing_unpack_in_a_batch_names_the_payloads_of_its_row(
    written: tuple[Path, Reference],
) -> None:
    directory, _ = written

    class Failing(ScriptedMetaFormat):
        def unpack(self, stream_data: Any, shards: Any, index: Any, data: Any) -> Any:
            if bytes(data[0]) == b"p1":
                raise ValueError("bad payload")
            return super().unpack(stream_data, shards, index, data)

    storage = StreamWithMetaStorage(directory, Failing())
    pattern = r"payload 1 of .*0000000\.out_of_band\.bin"
    with (
        StreamDataset(storage, 2).sync_reader() as reader,
        pytest.raises(CorruptShardError, match=pattern),
    ):
        reader.read_batch(np.array([0, 1]))  # window 1 is elements 2, 3: payload 1


# refusals ----------------------------------------------------------------------------------


def test_a_key_repeating_after_another_key_is_refused(tmp_path: Path) -> None:
    pairs = [(0, b"a"), (1, b"b"), (0, b"c")]
    with (
        scripted(tmp_path).sync_writer() as writer,
        pytest.raises(ValueError, match=r"key 0 repeats after another key at element 2"),
    ):
        writer.append(0, (pairs, np.arange(3, dtype="<i4")))


@pytest.mark.parametrize("payload", [None, "text", 5])
def test_the_first_pair_of_a_run_must_carry_bytes(tmp_path: Path, payload: Any) -> None:
    pairs = [(0, b"a"), (1, payload), (1, None)]
    with (
        scripted(tmp_path).sync_writer() as writer,
        pytest.raises(ValueError, match=rf"run of key 1 \(element 1\).*{type(payload).__name__}"),
    ):
        writer.append(0, (pairs, np.arange(3, dtype="<i4")))


def test_pack_yielding_fewer_pairs_than_size_is_refused(tmp_path: Path) -> None:
    pairs, stream = runs_record([(0, b"a", 2)])
    with (
        scripted(tmp_path).sync_writer() as writer,
        pytest.raises(ValueError, match="yielded 2 pairs but size"),
    ):
        writer.append(0, (pairs, stream, 3))


def test_pack_yielding_more_pairs_than_size_is_refused(tmp_path: Path) -> None:
    pairs, stream = runs_record([(0, b"a", 3)])
    with (
        scripted(tmp_path).sync_writer() as writer,
        pytest.raises(ValueError, match="more than size"),
    ):
        writer.append(0, (pairs, stream, 2))


def test_pack_returning_a_stream_of_another_length_is_refused(tmp_path: Path) -> None:
    pairs, _ = runs_record([(0, b"a", 3)])
    with (
        scripted(tmp_path).sync_writer() as writer,
        pytest.raises(ValueError, match="stream of 2 elements but size"),
    ):
        writer.append(0, (pairs, np.arange(2, dtype="<i4")))


def test_pack_returning_a_stream_of_the_wrong_dtype_is_refused(tmp_path: Path) -> None:
    pairs, _ = runs_record([(0, b"a", 3)])
    with (
        scripted(tmp_path).sync_writer() as writer,
        pytest.raises(TypeError, match=r"float64.*int32"),
    ):
        writer.append(0, (pairs, np.zeros(3)))


def test_pack_that_is_not_a_generator_is_refused(tmp_path: Path) -> None:
    class ListFormat(ScriptedMetaFormat):
        def pack(self, data: Any) -> Any:
            return list(data[0])

    storage = StreamWithMetaStorage(tmp_path, ListFormat())
    with (
        storage.sync_writer() as writer,
        pytest.raises(TypeError, match=r"must be a generator.*got list"),
    ):
        writer.append(0, runs_record([(0, b"a", 1)]))


def test_too_many_payloads_in_a_shard_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_meta, "MAX_PAYLOADS", 3)
    with scripted(tmp_path).sync_writer() as writer:
        writer.append(0, runs_record([(0, b"a", 1), (1, b"b", 1)]))
        with pytest.raises(ValueError, match="shard 0 would hold 4 payloads, more than 3"):
            writer.append(0, runs_record([(0, b"c", 1), (1, b"d", 1)]))
        writer.append(0, runs_record([(0, b"e", 2)], 2))
    with scripted(tmp_path).sync_reader() as reader:
        assert reader.read(0, 4)["document_data"] == [b"a", b"b", b"e"]


def test_a_shard_whose_only_append_was_refused_keeps_its_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with scripted(tmp_path).sync_writer() as writer:
        writer.append(0, runs_record([(0, b"old", 2)]))
    monkeypatch.setattr(stream_meta, "MAX_PAYLOADS", 1)
    with (
        scripted(tmp_path).sync_writer() as writer,
        pytest.raises(ValueError, match="more than 1"),
    ):
        writer.append(0, runs_record([(0, b"a", 1), (1, b"b", 1)]))
    # close() committed nothing for shard 0: it is not replaced by an empty shard
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []
    with scripted(tmp_path).sync_reader() as reader:
        assert reader.total_length == 2
        assert reader.read(0, 2)["document_data"] == [b"old"]


BAD_RECORDS = {
    "non-contiguous key": ([(0, b"a"), (1, b"b"), (0, None)], np.arange(3, dtype="<i4")),
    "run without payload": ([(0, None)], np.arange(1, dtype="<i4")),
    "short stream": ([(0, b"a"), (0, None)], np.arange(1, dtype="<i4")),
    "size mismatch": ([(0, b"a")], np.arange(1, dtype="<i4"), 2),
}


@pytest.mark.parametrize("bad", list(BAD_RECORDS))
def test_a_refused_append_leaves_the_shard_as_it_was(
    written: tuple[Path, Reference], bad: str
) -> None:
    directory, reference = written
    before = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    with scripted(directory).sync_writer() as writer:
        with pytest.raises(ValueError):
            writer.append(1, BAD_RECORDS[bad])
        with pytest.raises(KeyError):
            writer.length(1)  # the shard was never started
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} == before
    with scripted(directory).sync_reader() as reader:
        assert as_plain(reader.read(0, 14)) == reference.window(0, 14)


def test_a_refused_append_keeps_the_earlier_appends_of_the_session(tmp_path: Path) -> None:
    with scripted(tmp_path).sync_writer() as writer:
        writer.append(0, runs_record([("a", b"first", 2)]))
        with pytest.raises(ValueError):
            writer.append(0, BAD_RECORDS["non-contiguous key"])
        writer.append(0, runs_record([("a", b"second", 1)], 2))
        assert writer.length(0) == 3
    with scripted(tmp_path).sync_reader() as reader:
        got = reader.read(0, 3)
    assert got["stream"] == [0, 1, 2]
    assert got["document_data"] == [b"first", b"second"]
    assert got["document_index"].tolist() == [0, 0, 1]


def test_storage_refuses_a_format_without_size(tmp_path: Path) -> None:
    class NoSize:
        stream_dtype = np.dtype("<i4")
        pack = ChunkMetaFormat.pack
        unpack = ChunkMetaFormat.unpack

    with pytest.raises(TypeError, match=r"not a stream format.*missing size"):
        StreamWithMetaStorage(tmp_path, NoSize())


@pytest.mark.parametrize("item", [b"payload", (0, b"a", 1), 5])
def test_pack_yielding_something_other_than_pairs_is_a_type_error(
    tmp_path: Path, item: Any
) -> None:
    with (
        scripted(tmp_path).sync_writer() as writer,
        pytest.raises(TypeError, match=r"must yield \(key, payload\) pairs; element 0 is"),
    ):
        writer.append(0, ([item], np.arange(1, dtype="<i4")))


def test_an_unhashable_key_is_a_type_error(tmp_path: Path) -> None:
    with (
        scripted(tmp_path).sync_writer() as writer,
        pytest.raises(TypeError, match=r"keys must be hashable, got \[1\] \(list\) at element 0"),
    ):
        writer.append(0, ([([1], b"a")], np.arange(1, dtype="<i4")))


@pytest.mark.parametrize(("size", "error"), [(-1, ValueError), (1.0, TypeError)])
def test_size_must_be_a_non_negative_int(tmp_path: Path, size: Any, error: type) -> None:
    with scripted(tmp_path).sync_writer() as writer, pytest.raises(error, match="size"):
        writer.append(0, ([], np.arange(0, dtype="<i4"), size))


def test_an_append_of_no_elements_writes_an_empty_shard(tmp_path: Path) -> None:
    with scripted(tmp_path).sync_writer() as writer:
        writer.append(0, runs_record([("a", b"x", 2)]))
        writer.append(1, ([], np.arange(0, dtype="<i4")))
        writer.append(2, runs_record([("b", b"y", 1)], 2))
    with scripted(tmp_path).sync_reader() as reader:
        assert [reader.length(k) for k in range(3)] == [2, 0, 1]
        assert reader.read(1, 3)["document_data"] == [b"x", b"y"]


# a read prepared at once, decoded a slice at a time (read_rows) ------------------------------


class Counting(ScriptedMetaFormat):
    """Notes the first stream value of each window it decodes; fails on payload ``fail``."""

    def __init__(self, fail: bytes | None = None) -> None:
        self.decoded: list[int] = []
        self.fail = fail

    def unpack(self, stream_data: Any, shards: Any, index: Any, data: Any) -> Any:
        self.decoded.append(int(stream_data[0]))
        if self.fail is not None and any(bytes(p) == self.fail for p in data):
            raise ValueError("bad payload")
        return super().unpack(stream_data, shards, index, data)


@pytest.mark.parametrize("copies", [1, 6], ids=["few-rows", "many-rows"])
def test_read_rows_decodes_only_the_rows_of_each_slice(
    written: tuple[Path, Reference], copies: int
) -> None:
    """``read_rows`` does the read's shared work at once and calls ``unpack`` only for the
    rows a slice asks for; the slices hold what ``read_batch`` gives (rows inside a shard,
    rows crossing shards, ids repeated)."""
    directory, _ = written
    counting = Counting()
    storage = StreamWithMetaStorage(directory, counting)
    with StreamDataset(storage, 3).sync_reader() as reader:
        ids = np.tile(np.arange(len(reader)), copies)  # windows 2 and 3 cross shards
        expected = [as_plain(s) for s in reader.read_batch(ids)]
        counting.decoded.clear()
        rows = reader.read_rows(ids)
        assert type(rows) is LazyRows and len(rows) == len(ids)
        assert counting.decoded == []
        got = []
        for begin in range(0, len(ids), 4):
            got += [as_plain(s) for s in rows[begin : begin + 4]]
            assert len(counting.decoded) == min(begin + 4, len(ids))
    assert got == expected


def test_a_failing_unpack_fails_only_the_slice_of_its_row(
    written: tuple[Path, Reference],
) -> None:
    directory, _ = written
    storage = StreamWithMetaStorage(directory, Counting(fail=b"p1"))
    with StreamDataset(storage, 2).sync_reader() as reader:
        rows = reader.read_rows(np.tile([0, 1, 4], 8))  # window 1: elements 2, 3 (payload 1)
        assert [s["document_data"] for s in rows[0:1]] == [[b"p0"]]
        with pytest.raises(CorruptShardError, match=r"payload 1 of .*0000000\.out_of_band"):
            rows[0:2]
        assert [s["document_data"] for s in rows[2:3]] == [[b"q0"]]


def test_read_rows_of_a_stream_without_metadata_is_read_batch(tmp_path: Path) -> None:
    storage = StreamStorage(tmp_path, StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(12)})
    with StreamDataset(storage, 3).sync_reader() as reader:
        rows = reader.read_rows(np.array([2, 0]))
        assert type(rows) is list
        assert [s["tokens"].tolist() for s in rows] == [[6, 7, 8], [0, 1, 2]]
