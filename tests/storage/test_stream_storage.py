"""Stream storage: our writers' round trip and files, reads across shards and wrap-around,
samples that outlive their reader, and every refusal with a message naming the value."""

from __future__ import annotations

import gc
import itertools
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_array_equal
from storage_formats import RecordingStreamFormat, pieces_of, windows_of

from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage

TOKENS = np.dtype([("tokens", "<i4"), ("loss_mask", "u1")])
WIDE = np.dtype([("tokens", "<i8"), ("weight", "<f4"), ("mask", "u1"), ("segment", "<u2")])


def record(start: int, n: int, dtype: np.dtype[Any] = TOKENS) -> dict[str, np.ndarray]:
    """Field columns of ``n`` elements whose values encode their position."""
    assert dtype.names is not None
    positions = np.arange(start, start + n)
    return {
        name: (positions * (i + 1) % 251).astype(dtype[name]) for i, name in enumerate(dtype.names)
    }


def structured(columns: dict[str, np.ndarray], dtype: np.dtype[Any]) -> np.ndarray:
    out = np.empty(len(next(iter(columns.values()))), dtype=dtype)
    for name, column in columns.items():
        out[name] = column
    return out


def write_shards(
    directory: Path, shard_lengths: Sequence[int], dtype: np.dtype[Any] = TOKENS
) -> np.ndarray:
    """Write shards of the given lengths with our writer; the reference concatenation."""
    storage = StreamStorage(directory, StreamNumpyFormat(dtype))
    pieces = []
    start = 0
    with storage.sync_writer() as writer:
        for shard, n in enumerate(shard_lengths):
            columns = record(start, n, dtype)
            writer.append(shard, columns)
            pieces.append(structured(columns, dtype))
            start += n
    return np.concatenate(pieces)


def tokens_storage(directory: Path, read_interface: Any = None) -> StreamStorage:
    return StreamStorage(directory, StreamNumpyFormat(TOKENS), read_interface)


@pytest.fixture
def three_shards(tmp_path: Path) -> tuple[Path, np.ndarray]:
    return tmp_path, write_shards(tmp_path, [5, 8, 3])


# round trip and files ----------------------------------------------------------------------


def test_writer_round_trip_of_a_multi_field_dtype_over_several_appends_and_shards(
    tmp_path: Path,
) -> None:
    storage = StreamStorage(tmp_path, StreamNumpyFormat(WIDE))
    appends = {0: [3, 4], 1: [1, 0, 6], 2: [2]}
    expected = []
    start = 0
    with storage.sync_writer() as writer:
        for shard, sizes in appends.items():
            for n in sizes:
                columns = record(start, n, WIDE)
                writer.append(shard, columns)
                expected.append(structured(columns, WIDE))
                start += n
    reference = np.concatenate(expected)
    with storage.sync_reader() as reader:
        assert reader.num_shards == 3
        assert [reader.length(k) for k in range(3)] == [7, 7, 2]
        assert reader.total_length == len(reference)
        sample = reader.read(0, reader.total_length)
    assert list(sample) == list(WIDE.names or ())
    for name in sample:
        assert sample[name].dtype == WIDE[name]
        np.testing.assert_array_equal(sample[name], reference[name])


def test_writer_length_counts_elements_appended_in_this_session(tmp_path: Path) -> None:
    with tokens_storage(tmp_path).sync_writer() as writer:
        writer.append(2, record(0, 4))
        writer.append(2, record(4, 3))
        writer.append(0, record(0, 0))
        assert writer.length(2) == 7
        assert writer.length(0) == 0


def test_writer_length_of_an_untouched_shard_is_a_key_error(tmp_path: Path) -> None:
    with tokens_storage(tmp_path).sync_writer() as writer:
        writer.append(0, record(0, 4))
        with pytest.raises(KeyError, match="shard 1"):
            writer.length(1)


def test_shard_files_use_guideloom_names_and_raw_bytes(tmp_path: Path) -> None:
    storage = tokens_storage(tmp_path)
    first, second = record(0, 5), record(5, 2)
    with storage.sync_writer() as writer:
        writer.append(0, first)
        writer.append(0, second)
        writer.append(1, record(7, 4))
    bins = sorted(p.name for p in tmp_path.glob("*.bin"))
    assert bins == ["0000000.in_band.bin", "0000001.in_band.bin"]
    expected = np.concatenate([structured(first, TOKENS), structured(second, TOKENS)])
    assert (tmp_path / "0000000.in_band.bin").read_bytes() == expected.tobytes()
    assert (tmp_path / "0000001.in_band.bin").read_bytes() == structured(
        record(7, 4), TOKENS
    ).tobytes()
    assert TOKENS.itemsize == 5  # packed, no padding: GuideLoom's layout
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
def test_a_writer_replaces_a_shard_instead_of_appending_to_it(tmp_path: Path) -> None:
    storage = tokens_storage(tmp_path)
    with storage.sync_writer() as writer:
        writer.append(0, record(0, 9))
        writer.append(1, record(9, 4))
    with storage.sync_writer() as writer:
        writer.append(0, record(100, 2))
    with storage.sync_reader() as reader:
        assert [reader.length(k) for k in range(2)] == [2, 4]
        assert reader.read(0, 2)["tokens"].tolist() == record(100, 2)["tokens"].tolist()
        assert reader.read(2, 4)["tokens"].tolist() == record(9, 4)["tokens"].tolist()


def test_reader_opens_a_dataset_written_without_our_commit_records(tmp_path: Path) -> None:
    reference = structured(record(0, 10), TOKENS)
    reference[:6].tofile(tmp_path / "0000000.in_band.bin")
    reference[6:].tofile(tmp_path / "0000001.in_band.bin")
    with tokens_storage(tmp_path).sync_reader() as reader:
        assert reader.read(0, 10)["tokens"].tolist() == reference["tokens"].tolist()


# reads: property tests ---------------------------------------------------------------------

shard_lengths_strategy = st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(
    lambda lengths: sum(lengths) > 0
)


def fresh_directory() -> Path:
    return Path(tempfile.mkdtemp(prefix="stream-prop-"))


@settings(deadline=None, max_examples=60)
@given(lengths=shard_lengths_strategy, data=st.data())
def test_any_read_equals_the_same_slice_of_the_tiled_reference(
    lengths: list[int], data: st.DataObject
) -> None:
    directory = fresh_directory()
    reference = write_shards(directory, lengths)
    total = len(reference)
    with tokens_storage(directory).sync_reader() as reader:
        assert reader.total_length == total
        for _ in range(5):
            start = data.draw(st.integers(0, total - 1), label="start")
            length = data.draw(st.integers(0, 3 * total + 2), label="length")
            sample = reader.read(start, length)
            expected = windows_of(reference, start, length)
            assert sample["tokens"].tolist() == expected["tokens"].tolist()
            assert sample["loss_mask"].tolist() == expected["loss_mask"].tolist()


@settings(deadline=None, max_examples=60)
@given(lengths=shard_lengths_strategy, data=st.data())
def test_unpack_gets_the_shard_lengths_and_shards_of_the_span(
    lengths: list[int], data: st.DataObject
) -> None:
    directory = fresh_directory()
    reference = write_shards(directory, lengths)
    total = len(reference)
    storage = StreamStorage(directory, RecordingStreamFormat(TOKENS))
    with storage.sync_reader() as reader:
        for _ in range(5):
            start = data.draw(st.integers(0, total - 1), label="start")
            length = data.draw(st.integers(0, 3 * total + 2), label="length")
            stream, shard_lengths, shards = reader.read(start, length)
            assert (shard_lengths, shards) == pieces_of(lengths, start, length)
            assert all(n > 0 for n in shard_lengths)
            assert sum(shard_lengths) == length == len(stream)


@settings(deadline=None, max_examples=60)
@given(
    lengths=shard_lengths_strategy,
    sequence_length=st.integers(1, 12),
    data=st.data(),
)
def test_read_windows_and_read_batch_equal_the_reference_windows(
    lengths: list[int], sequence_length: int, data: st.DataObject
) -> None:
    directory = fresh_directory()
    reference = write_shards(directory, lengths)
    count = len(reference) // sequence_length
    ids = np.asarray(
        data.draw(st.lists(st.integers(0, max(count - 1, 0)), max_size=8 if count else 0)),
        dtype=np.int64,
    )
    windows = [reference[i * sequence_length : (i + 1) * sequence_length] for i in ids]
    storage = tokens_storage(directory)
    with storage.sync_reader() as reader:
        raw = reader.read_windows(ids * sequence_length, sequence_length)
        assert raw.shape == (len(ids), sequence_length)
        assert [row.tolist() for row in raw] == [w.tolist() for w in windows]
    with StreamDataset(storage, sequence_length).sync_reader() as reader:
        assert len(reader) == count
        samples = reader.read_batch(ids)
    assert [s["tokens"].tolist() for s in samples] == [w["tokens"].tolist() for w in windows]
    assert [s["loss_mask"].tolist() for s in samples] == [w["loss_mask"].tolist() for w in windows]


#: Record sizes copied through an unsigned integer (1, 2, 4, 8 bytes, either byte order)
#: and through a void (3, 7 bytes).
ELEMENT_DTYPES = [
    np.dtype([("tokens", "u1")]),
    np.dtype([("tokens", ">u2")]),
    np.dtype([("tokens", ">i4")]),
    np.dtype([("tokens", "<f8")]),
    np.dtype([("tokens", "<u2"), ("mask", "u1")]),
    np.dtype([("tokens", ">i4"), ("mask", "u1"), ("segment", "<u2")]),
]


@pytest.mark.parametrize("dtype", ELEMENT_DTYPES, ids=lambda d: f"{d.itemsize}B-{d.descr}")
# a few windows or fewer than 128 short ones (row copies), many short ones (gathers)
@pytest.mark.parametrize("count", [3, 40, 200])
def test_windows_of_every_element_size_and_byte_order_read_back_as_written(
    tmp_path: Path, dtype: np.dtype[Any], count: int
) -> None:
    reference = write_shards(tmp_path, [50, 7, 0, 61, 33], dtype)
    length = 6
    ids = np.random.default_rng(count).integers(0, len(reference) // length, count)
    expected = [reference[i * length : (i + 1) * length] for i in ids]
    storage = StreamStorage(tmp_path, StreamNumpyFormat(dtype))
    with storage.sync_reader() as reader:
        raw = reader.read_windows(ids * length, length)
    with StreamDataset(storage, length).sync_reader() as reader:
        batch = reader.read_arrays(ids)
        samples = reader.read_batch(ids)
    assert raw.dtype == dtype
    for name in dtype.names or ():
        column = np.stack([window[name] for window in expected])
        assert_array_equal(raw[name], column)
        assert batch.columns is not None and batch.columns[name].dtype == dtype[name]
        assert_array_equal(batch.columns[name], column)
        assert_array_equal(np.stack([sample[name] for sample in samples]), column)


@pytest.mark.parametrize(
    ("count", "length", "gathered"),
    [
        (15, 6, False),  # a handful
        (127, 6, False),  # short ones, fewer than 128
        (128, 6, True),  # many short ones: one gather per shard
        (200, 1024, False),  # 4 KB windows, 800 KB in all: row by row
        (300, 1024, True),  # 1.2 MB in all: gathered (numpy's copy lets threads run)
    ],
)
def test_windows_are_copied_row_by_row_unless_many_short_ones_or_over_a_megabyte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int, length: int, gathered: bool
) -> None:
    from guideloom_pipes.storage.stream import StreamReader

    dtype = np.dtype([("tokens", "<i4")])
    storage = StreamStorage(tmp_path, StreamNumpyFormat(dtype))
    with storage.sync_writer() as writer:
        for shard in range(3):
            writer.append(shard, {"tokens": np.arange(shard * 10**5, (shard + 1) * 10**5)})
    calls: list[str] = []
    for name in ("_copy_rows", "_gather_rows"):
        method = getattr(StreamReader, name)

        def spy(self: Any, *args: Any, _method: Any = method, _name: str = name) -> Any:
            calls.append(_name)
            return _method(self, *args)

        monkeypatch.setattr(StreamReader, name, spy)
    starts = np.random.default_rng(count).integers(0, 3 * 10**5 - length, count)
    with storage.sync_reader() as reader:
        windows = reader.read_windows(starts, length)
    assert windows["tokens"].tolist() == [list(range(a, a + length)) for a in starts.tolist()]
    assert calls == (["_gather_rows"] if gathered else ["_copy_rows"])


@settings(deadline=None, max_examples=40)
@given(lengths=shard_lengths_strategy, sequence_length=st.integers(1, 12))
def test_read_batch_of_a_format_without_unpack_batch_gets_each_windows_pieces(
    lengths: list[int], sequence_length: int
) -> None:
    directory = fresh_directory()
    reference = write_shards(directory, lengths)
    storage = StreamStorage(directory, RecordingStreamFormat(TOKENS))
    with StreamDataset(storage, sequence_length).sync_reader() as reader:
        ids = np.arange(len(reader))[::-1]
        for i, (stream, shard_lengths, shards) in zip(ids, reader.read_batch(ids)):
            start = int(i) * sequence_length
            assert stream.tolist() == reference[start : start + sequence_length].tolist()
            assert (shard_lengths, shards) == pieces_of(lengths, start, sequence_length)


def test_a_read_longer_than_the_stream_wraps_around_repeatedly(
    three_shards: tuple[Path, np.ndarray],
) -> None:
    directory, reference = three_shards
    with tokens_storage(directory).sync_reader() as reader:
        sample = reader.read(14, 40)
    expected = np.tile(reference["tokens"], 4)[14:54]
    assert sample["tokens"].tolist() == expected.tolist()


# samples outlive their reader --------------------------------------------------------------


def test_samples_stay_valid_after_the_reader_is_closed(
    three_shards: tuple[Path, np.ndarray],
) -> None:
    directory, reference = three_shards
    storage = tokens_storage(directory)
    reader = storage.sync_reader()
    reader.open()
    one = reader.read(3, 7)
    with StreamDataset(storage, 4).sync_reader() as dataset_reader:
        batch = dataset_reader.read_batch(np.array([3, 0, 1]))
        single = dataset_reader[2]
    reader.close()
    del reader, dataset_reader
    gc.collect()
    assert one["tokens"].tolist() == reference["tokens"][3:10].tolist()
    assert [b["tokens"].tolist() for b in batch] == [
        reference["tokens"][s : s + 4].tolist() for s in (12, 0, 4)
    ]
    assert single["loss_mask"].tolist() == reference["loss_mask"][8:12].tolist()


def test_unpacked_fields_are_c_contiguous_and_own_their_memory(
    three_shards: tuple[Path, np.ndarray],
) -> None:
    directory, _ = three_shards
    with tokens_storage(directory).sync_reader() as reader:
        sample = reader.read(2, 9)
    for column in sample.values():
        assert column.flags.c_contiguous
        assert column.flags.owndata
        assert column.flags.writeable
        assert memoryview(column).c_contiguous


def test_batch_samples_are_contiguous_and_share_memory_only_within_their_batch(
    three_shards: tuple[Path, np.ndarray],
) -> None:
    directory, _ = three_shards
    with StreamDataset(tokens_storage(directory), 4).sync_reader() as reader:
        first = reader.read_batch(np.array([0, 2]))
        second = reader.read_batch(np.array([1]))
        files = reader.storage_reader._files
        mapped = [a for f in files.values() for a in f._arrays.values()]
    for sample in first + second:
        for column in sample.values():
            assert memoryview(column).c_contiguous
            assert not any(np.shares_memory(column, m) for m in mapped)
    for a, b in itertools.product(first, second):
        assert not np.shares_memory(a["tokens"], b["tokens"])


def test_samples_do_not_share_memory_with_the_memory_map(
    three_shards: tuple[Path, np.ndarray],
) -> None:
    directory, _ = three_shards
    with tokens_storage(directory).sync_reader() as reader:
        sample = reader.read(0, 5)  # a whole shard: the easiest one to hand out as a view
        mapped = [a for f in reader._files.values() for a in f._arrays.values()]
        assert mapped, "the default backend maps the shard files"
        for column in sample.values():
            assert not any(np.shares_memory(column, m) for m in mapped)


# refusals ----------------------------------------------------------------------------------


def test_stream_numpy_format_refuses_a_dtype_without_fields() -> None:
    with pytest.raises(ValueError, match=r"structured dtype.*int32"):
        StreamNumpyFormat(np.dtype("<i4"))


def test_pack_refuses_missing_fields_and_names_them() -> None:
    with pytest.raises(ValueError, match=r"missing \['loss_mask'\]"):
        StreamNumpyFormat(TOKENS).pack({"tokens": np.arange(3)})


def test_pack_ignores_keys_that_are_not_fields_as_guideloom_does() -> None:
    columns = {**record(0, 3), "position": np.arange(3), "text": "abc"}
    assert_array_equal(
        StreamNumpyFormat(TOKENS).pack(columns), StreamNumpyFormat(TOKENS).pack(record(0, 3))
    )


def test_pack_broadcasts_scalars_and_length_one_fields_as_guideloom_does() -> None:
    packed = StreamNumpyFormat(TOKENS).pack({"tokens": np.arange(4), "loss_mask": 1})
    assert packed["loss_mask"].tolist() == [1, 1, 1, 1]
    packed = StreamNumpyFormat(TOKENS).pack({"tokens": np.arange(4), "loss_mask": np.ones(1)})
    assert packed["loss_mask"].tolist() == [1, 1, 1, 1]


def test_pack_refuses_records_made_only_of_scalars() -> None:
    with pytest.raises(ValueError, match="at least one field given as a 1-D array"):
        StreamNumpyFormat(TOKENS).pack({"tokens": 3, "loss_mask": 1})


def test_pack_refuses_a_field_that_is_not_one_dimensional() -> None:
    columns = {"tokens": np.zeros((2, 3), "<i4"), "loss_mask": np.zeros(6, "u1")}
    with pytest.raises(ValueError, match=r"'tokens' must be a 1-D array, got shape \(2, 3\)"):
        StreamNumpyFormat(TOKENS).pack(columns)


def test_pack_refuses_fields_of_unequal_lengths() -> None:
    columns = {"tokens": np.zeros(4, "<i4"), "loss_mask": np.zeros(3, "u1")}
    with pytest.raises(ValueError, match=r"equal lengths.*'tokens': 4.*'loss_mask': 3"):
        StreamNumpyFormat(TOKENS).pack(columns)


def test_pack_refuses_something_that_is_not_a_mapping() -> None:
    with pytest.raises(TypeError, match=r"mapping.*got list"):
        StreamNumpyFormat(TOKENS).pack([1, 2, 3])  # type: ignore[arg-type]


def test_pack_refuses_integers_that_do_not_fit_the_field() -> None:
    columns = {"tokens": np.array([1, 2**40]), "loss_mask": np.zeros(2, "u1")}
    with pytest.raises(ValueError, match=r"'tokens'.*1099511627776.*int32"):
        StreamNumpyFormat(TOKENS).pack(columns)


def test_pack_refuses_negative_integers_for_an_unsigned_field() -> None:
    columns = {"tokens": np.arange(2), "loss_mask": np.array([0, -1])}
    with pytest.raises(ValueError, match=r"'loss_mask'.*-1.*uint8"):
        StreamNumpyFormat(TOKENS).pack(columns)


@pytest.mark.parametrize(
    ("tokens", "shown", "problem"),
    [
        ([1.0, 2.5e10], "25000000000.0", r"does not fit its dtype int32 \(-2147483648\.\."),
        ([2.0**31], "2147483648.0", "does not fit its dtype int32"),
        ([1.0, 2.5], "2.5", "is not a whole number"),
        ([float("nan")], "nan", "is not a whole number"),
        ([-float("inf")], "-inf", "is not a whole number"),
        (np.array([3, 1e12], dtype=np.float32), "999999995904.0", "does not fit"),
    ],
)
def test_pack_refuses_floats_an_integer_field_would_change(
    tokens: Any, shown: str, problem: str
) -> None:
    columns = {"tokens": np.asarray(tokens), "loss_mask": 0}
    with pytest.raises(ValueError, match=rf"field 'tokens' holds {shown} .*{problem}"):
        StreamNumpyFormat(TOKENS).pack(columns)


def test_pack_refuses_a_negative_float_for_an_unsigned_field() -> None:
    columns = {"tokens": np.arange(2), "loss_mask": np.array([0.0, -1.0])}
    with pytest.raises(ValueError, match=r"'loss_mask' holds -1\.0 .*uint8 \(0\.\.255\)"):
        StreamNumpyFormat(TOKENS).pack(columns)


def test_pack_accepts_whole_floats_that_fit_the_field_exactly() -> None:
    columns = {"tokens": np.array([-(2.0**31), 0.0, 2.0**31 - 1]), "loss_mask": np.float32(1)}
    packed = StreamNumpyFormat(TOKENS).pack(columns)
    assert packed["tokens"].tolist() == [-(2**31), 0, 2**31 - 1]
    assert packed["loss_mask"].tolist() == [1, 1, 1]


def test_pack_accepts_python_ints_and_bools_that_fit() -> None:
    packed = StreamNumpyFormat(TOKENS).pack({"tokens": [1, 2, 3], "loss_mask": [True, False, True]})
    assert packed.dtype == TOKENS
    assert packed["tokens"].tolist() == [1, 2, 3]
    assert packed["loss_mask"].tolist() == [1, 0, 1]


class ShapelessFormat:
    stream_dtype = np.dtype("<i4")

    def __init__(self, output: Any) -> None:
        self.output = output

    def pack(self, data: Any) -> Any:
        return self.output

    def unpack(self, stream: np.ndarray, shard_lengths: Any, shards: Any) -> np.ndarray:
        return stream


def test_append_refuses_a_pack_result_that_is_not_one_dimensional(tmp_path: Path) -> None:
    storage = StreamStorage(tmp_path, ShapelessFormat(np.zeros((2, 2), "<i4")))
    with storage.sync_writer() as writer, pytest.raises(ValueError, match=r"1-D.*\(2, 2\)"):
        writer.append(0, None)


def test_append_refuses_a_pack_result_of_the_wrong_dtype(tmp_path: Path) -> None:
    storage = StreamStorage(tmp_path, ShapelessFormat(np.zeros(3, "<i8")))
    with storage.sync_writer() as writer, pytest.raises(TypeError, match=r"int64.*int32"):
        writer.append(0, None)


def test_append_refuses_a_pack_result_that_is_not_an_array(tmp_path: Path) -> None:
    storage = StreamStorage(tmp_path, ShapelessFormat([1, 2, 3]))
    with storage.sync_writer() as writer, pytest.raises(TypeError, match="got list"):
        writer.append(0, None)


def test_a_refused_append_writes_nothing(tmp_path: Path) -> None:
    storage = tokens_storage(tmp_path)
    with storage.sync_writer() as writer:
        writer.append(0, record(0, 4))
    with storage.sync_writer() as writer:
        with pytest.raises(ValueError):
            writer.append(0, {"tokens": np.arange(2)})
        with pytest.raises(KeyError):
            writer.length(0)
    with storage.sync_reader() as reader:
        assert reader.length(0) == 4


@pytest.mark.parametrize("shard", [-1, -100])
def test_append_refuses_a_negative_shard_id(tmp_path: Path, shard: int) -> None:
    with (
        tokens_storage(tmp_path).sync_writer() as writer,
        pytest.raises(ValueError, match=f"shard id must be >= 0, got {shard}"),
    ):
        writer.append(shard, record(0, 2))


@pytest.mark.parametrize("shard", [1.0, "1", None, True])
def test_append_refuses_a_shard_id_that_is_not_an_int(tmp_path: Path, shard: Any) -> None:
    with (
        tokens_storage(tmp_path).sync_writer() as writer,
        pytest.raises(TypeError, match="shard id must be an int"),
    ):
        writer.append(shard, record(0, 2))


def test_append_accepts_a_numpy_integer_shard_id(tmp_path: Path) -> None:
    with tokens_storage(tmp_path).sync_writer() as writer:
        writer.append(np.int64(1), record(0, 2))
        writer.append(0, record(0, 1))
    with tokens_storage(tmp_path).sync_reader() as reader:
        assert reader.length(1) == 2


@pytest.mark.parametrize("global_index", [16, 17, 10**12, -1])
def test_read_refuses_a_global_index_outside_the_stream(
    three_shards: tuple[Path, np.ndarray], global_index: int
) -> None:
    directory, _ = three_shards
    with (
        tokens_storage(directory).sync_reader() as reader,
        pytest.raises(IndexError, match=rf"global_index {global_index} out of range.*16"),
    ):
        reader.read(global_index, 1)


def test_read_refuses_a_negative_length(three_shards: tuple[Path, np.ndarray]) -> None:
    directory, _ = three_shards
    with (
        tokens_storage(directory).sync_reader() as reader,
        pytest.raises(IndexError, match="global_length must be >= 0, got -1"),
    ):
        reader.read(0, -1)


@pytest.mark.parametrize("bad", [1.5, "3", None])
def test_read_refuses_a_global_index_that_is_not_an_int(
    three_shards: tuple[Path, np.ndarray], bad: Any
) -> None:
    directory, _ = three_shards
    with tokens_storage(directory).sync_reader() as reader:
        with pytest.raises(TypeError, match="global_index must be an int"):
            reader.read(bad, 2)
        with pytest.raises(TypeError, match="global_length must be an int"):
            reader.read(0, bad)


def test_read_accepts_numpy_integers(three_shards: tuple[Path, np.ndarray]) -> None:
    directory, reference = three_shards
    with tokens_storage(directory).sync_reader() as reader:
        sample = reader.read(np.int64(4), np.int32(3))
    assert sample["tokens"].tolist() == reference["tokens"][4:7].tolist()


def test_read_windows_refuses_a_window_past_the_end(
    three_shards: tuple[Path, np.ndarray],
) -> None:
    directory, _ = three_shards
    with (
        tokens_storage(directory).sync_reader() as reader,
        pytest.raises(IndexError, match=r"window \[14, 18\).*16 elements"),
    ):
        reader.read_windows(np.array([0, 14]), 4)


@pytest.mark.parametrize("length", [2**62, 2**40])
def test_read_refuses_a_length_larger_than_memory_and_names_it(
    three_shards: tuple[Path, np.ndarray], length: int
) -> None:
    directory, _ = three_shards
    with (
        tokens_storage(directory).sync_reader() as reader,
        pytest.raises(ValueError, match=rf"global_length {length} is too large.*bytes of memory"),
    ):
        reader.read(0, length)


@pytest.mark.parametrize(
    "starts",
    [np.array([0, 2**63 + 1], dtype=np.uint64), [2**63 + 1], [2**64]],
    ids=["uint64-array", "list-past-int64", "list-past-uint64"],
)
def test_read_windows_names_starts_past_int64_as_given(
    three_shards: tuple[Path, np.ndarray], starts: Any
) -> None:
    directory, _ = three_shards
    bad = max(int(s) for s in starts)
    with (
        tokens_storage(directory).sync_reader() as reader,
        pytest.raises(IndexError, match=rf"window \[{bad}, {bad + 4}\).*start at 0\.\.12"),
    ):
        reader.read_windows(starts, 4)


@pytest.mark.parametrize("length", [17, 2**62])
def test_read_windows_refuses_a_window_longer_than_the_stream(
    three_shards: tuple[Path, np.ndarray], length: int
) -> None:
    directory, _ = three_shards
    with (
        tokens_storage(directory).sync_reader() as reader,
        pytest.raises(IndexError, match=rf"window \[0, {length}\).*16 elements.*longer than"),
    ):
        reader.read_windows(np.array([0]), length)


def test_read_windows_refuses_a_negative_length(three_shards: tuple[Path, np.ndarray]) -> None:
    directory, _ = three_shards
    with (
        tokens_storage(directory).sync_reader() as reader,
        pytest.raises(IndexError, match="window length must be >= 0, got -1"),
    ):
        reader.read_windows(np.array([0]), -1)


def test_reading_before_open_is_a_runtime_error(
    three_shards: tuple[Path, np.ndarray],
) -> None:
    directory, _ = three_shards
    reader = tokens_storage(directory).sync_reader()
    with pytest.raises(RuntimeError, match="not open"):
        reader.read(0, 1)
    with pytest.raises(RuntimeError, match="not open"):
        reader.total_length  # noqa: B018
    with pytest.raises(RuntimeError, match="not open"):
        reader.length(0)


def test_reading_after_close_is_a_runtime_error(
    three_shards: tuple[Path, np.ndarray],
) -> None:
    directory, _ = three_shards
    with tokens_storage(directory).sync_reader() as reader:
        reader.read(0, 1)
    with pytest.raises(RuntimeError, match="not open"):
        reader.read(0, 1)
    with pytest.raises(RuntimeError, match="not open"):
        reader.read_windows(np.array([0]), 2)


def test_a_closed_reader_opens_again(three_shards: tuple[Path, np.ndarray]) -> None:
    directory, reference = three_shards
    reader = tokens_storage(directory).sync_reader()
    with reader:
        reader.read(0, 1)
    with reader:
        assert reader.read(5, 2)["tokens"].tolist() == reference["tokens"][5:7].tolist()


def test_reader_length_refuses_a_shard_out_of_range(
    three_shards: tuple[Path, np.ndarray],
) -> None:
    directory, _ = three_shards
    with tokens_storage(directory).sync_reader() as reader:
        for shard in (3, -1):
            with pytest.raises(IndexError, match=rf"shard {shard} out of range.*0..2"):
                reader.length(shard)


def test_storage_refuses_a_format_without_the_stream_protocol(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"not a stream format.*missing unpack"):
        StreamStorage(tmp_path, type("PackOnly", (), {"stream_dtype": TOKENS, "pack": len})())


def test_the_builtin_formats_satisfy_the_format_protocols() -> None:
    from storage_formats import ChunkMetaFormat

    from guideloom_pipes import DocumentPickleFormat
    from guideloom_pipes.types import (
        BatchStreamFormat,
        DocumentStorageFormat,
        StreamStorageFormat,
        StreamWithMetaStorageFormat,
    )

    assert isinstance(StreamNumpyFormat(TOKENS), StreamStorageFormat)
    assert isinstance(StreamNumpyFormat(TOKENS), BatchStreamFormat)
    assert isinstance(RecordingStreamFormat(), StreamStorageFormat)
    assert isinstance(DocumentPickleFormat(), DocumentStorageFormat)
    assert isinstance(ChunkMetaFormat(), StreamWithMetaStorageFormat)


def test_stream_numpy_format_pickles_and_compares_by_dtype() -> None:
    import pickle

    format = StreamNumpyFormat(TOKENS)
    copy = pickle.loads(pickle.dumps(format))
    assert copy == format and hash(copy) == hash(format)
    assert copy != StreamNumpyFormat(WIDE)
    assert copy.fields == ("tokens", "loss_mask")
