"""Commit records (the ``.shard.json`` sidecars) and the checks readers make with them.

Readers check on open what the records make cheap (kind, dtype, sizes, a missing file) and
the checksums on request (``verify``); datasets written by GuideLoom, without records, open
with the checks their file sizes allow.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shard_kinds
from shard_kinds import GUIDELOOM_NAME, KINDS, SUFFIXES, append, expected, read, storage, write

from guideloom_pipes import (
    DocumentPickleFormat,
    DocumentStorage,
    StreamNumpyFormat,
    StreamStorage,
    StreamWithMetaStorage,
)
from guideloom_pipes.storage import CorruptShardError, StorageError, UncommittedShardError

# (these tests change shard files behind the manifest's back: its StaleManifestWarning is
# the expected fallback, asserted where it matters, and would flood the report)
pytestmark = pytest.mark.filterwarnings(
    "ignore::guideloom_pipes.storage.errors.StaleManifestWarning"
)

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "guideloom-1.1"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
FIXTURE_DTYPE = np.dtype([tuple(field) for field in EXPECTED["stream"]["dtype"]])
SHARDS = {0: [1, 2, 3, 4], 1: [5, 6], 2: [7, 8, 9]}
ALL_FILES = [(kind, suffix) for kind in KINDS for suffix in SUFFIXES[kind]]


def record_of(path: Path, shard: int = 0) -> dict[str, Any]:
    return json.loads((path / f"{shard:07d}.shard.json").read_text())


def guideloom_copy(tmp_path: Path, name: str) -> Path:
    """A copy of a dataset GuideLoom 1.1 wrote (no commit records)."""
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def guideloom_storage(kind: str, path: Path) -> Any:
    if kind == "stream":
        return StreamStorage(path, StreamNumpyFormat(FIXTURE_DTYPE))
    if kind == "document":
        return DocumentStorage(path, DocumentPickleFormat())
    return StreamWithMetaStorage(path, shard_kinds.PayloadPerElement("<i4"))


def drop_records(path: Path) -> None:
    for record in path.glob("*.shard.json"):
        record.unlink()


# What a record holds ---------------------------------------------------------------------


def file_entry(data: bytes, block: int = 65536) -> dict[str, Any]:
    """A file's entry in its record: size, CRC-32, and the CRC-32 of each 64 KiB block."""
    crcs = [zlib.crc32(data[k : k + block]) for k in range(0, len(data), block)]
    return {
        "size": len(data),
        "crc32": zlib.crc32(data),
        "block_size": block,
        "block_crc32": base64.b64encode(struct.pack(f"<{len(crcs)}I", *crcs)).decode(),
    }


def test_a_stream_record_holds_kind_dtype_count_sizes_and_crc32(tmp_path: Path) -> None:
    write("stream", tmp_path, {0: list(range(10))})
    record = record_of(tmp_path)
    data = (tmp_path / "0000000.in_band.bin").read_bytes()
    assert record["kind"] == "stream"
    assert record["state"] == "committed"
    assert record["shard"] == 0
    assert record["count"] == 10
    assert np.lib.format.descr_to_dtype([tuple(f) for f in record["dtype"]]) == np.dtype(
        [("tokens", "<i4")]
    )
    assert record["files"] == {"in_band.bin": file_entry(data)}


def test_a_document_record_holds_kind_count_sizes_and_crc32(tmp_path: Path) -> None:
    write("document", tmp_path, {0: [1, 2, 3]})
    record = record_of(tmp_path)
    assert record["kind"] == "document"
    assert record["count"] == 3
    assert record["dtype"] is None
    for suffix in SUFFIXES["document"]:
        data = (tmp_path / f"0000000{suffix}").read_bytes()
        assert record["files"][suffix.lstrip(".")] == file_entry(data)


def test_a_stream_meta_record_holds_kind_dtype_counts_sizes_and_crc32(tmp_path: Path) -> None:
    write("stream_meta", tmp_path, {0: [1, 2, 3, 4, 5]})
    record = record_of(tmp_path)
    assert record["kind"] == "stream_meta"
    assert record["count"] == 5
    assert record["payloads"] == 5
    assert record["dtype"] == "<i4"
    assert set(record["files"]) == {s.lstrip(".") for s in SUFFIXES["stream_meta"]}
    data = (tmp_path / "0000000.in_band.bin").read_bytes()
    assert record["files"]["in_band.bin"] == file_entry(data)


def test_the_record_of_a_rewritten_shard_describes_the_new_files(tmp_path: Path) -> None:
    write("stream", tmp_path, {0: [1, 2, 3]})
    write("stream", tmp_path, {0: [4, 5]})
    assert record_of(tmp_path)["count"] == 2
    assert record_of(tmp_path)["files"]["in_band.bin"]["size"] == 8


# Datasets without records ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "lengths"),
    [
        ("stream", EXPECTED["stream"]["shard_lengths"]),
        ("document", EXPECTED["document"]["shard_counts"]),
    ],
)
def test_a_guideloom_dataset_without_records_opens(
    tmp_path: Path, name: str, lengths: list[int]
) -> None:
    path = guideloom_copy(tmp_path, name)
    with guideloom_storage(name, path).sync_reader() as reader:
        assert reader.num_shards == len(lengths)
        assert [reader.length(k) for k in range(reader.num_shards)] == lengths


def test_a_guideloom_stream_meta_dataset_without_records_opens(tmp_path: Path) -> None:
    path = guideloom_copy(tmp_path, "stream_meta")
    records = EXPECTED["stream_meta"]["records"]
    with guideloom_storage("stream_meta", path).sync_reader() as reader:
        assert reader.num_shards == 2
        assert reader.total_length == sum(len(r["tokens"]) for r in records)


@pytest.mark.parametrize("kind", KINDS)
def test_a_dataset_whose_records_were_all_deleted_reads_the_same(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, SHARDS)
    drop_records(tmp_path)
    assert read(kind, tmp_path) == expected(kind, SHARDS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_shard_without_a_record_among_committed_shards_is_uncommitted(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, SHARDS)
    (tmp_path / "0000001.shard.json").unlink()
    with pytest.raises(UncommittedShardError) as error:
        read(kind, tmp_path)
    assert "shard 0000001" in str(error.value)
    assert "0000001.shard.json" in str(error.value)


@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
def test_a_guideloom_shard_added_to_a_committed_dataset_is_uncommitted(tmp_path: Path) -> None:
    path = guideloom_copy(tmp_path, "stream")
    (path / "0000002.in_band.bin").rename(path / "0000003.in_band.bin")
    with StreamStorage(path, StreamNumpyFormat(FIXTURE_DTYPE)).sync_writer() as writer:
        writer.append(2, {"tokens": np.arange(4), "loss_mask": np.ones(4)})
    with pytest.raises(UncommittedShardError, match=r"shard 0000000 .*no commit record"):
        StreamStorage(path, StreamNumpyFormat(FIXTURE_DTYPE)).sync_reader().open()


# Dtype -----------------------------------------------------------------------------------


def test_reading_a_stream_with_another_dtype_names_both_and_the_fix(tmp_path: Path) -> None:
    write("stream", tmp_path, SHARDS)
    wrong = np.dtype([("tokens", "<i8")])
    with pytest.raises(ValueError) as error:
        storage("stream", tmp_path, wrong).sync_reader().open()
    message = str(error.value)
    assert "[('tokens', '<i4')]" in message and "[('tokens', '<i8')]" in message
    assert "StreamNumpyFormat(np.dtype([('tokens', '<i4')]))" in message
    assert "shard 0000000" in message


def test_reading_fields_under_other_names_is_a_dtype_mismatch(tmp_path: Path) -> None:
    write("stream", tmp_path, SHARDS)
    with pytest.raises(ValueError, match="ids"):
        storage("stream", tmp_path, np.dtype([("ids", "<i4")])).sync_reader().open()


def test_reading_stream_meta_with_another_dtype_names_both(tmp_path: Path) -> None:
    write("stream_meta", tmp_path, SHARDS)
    with pytest.raises(ValueError) as error:
        storage("stream_meta", tmp_path, "<i2").sync_reader().open()
    assert "int32" in str(error.value) and "int16" in str(error.value)
    assert "'<i4'" in str(error.value)


# Sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "suffix"), ALL_FILES)
def test_a_truncated_file_is_corrupt_and_named_with_both_sizes(
    tmp_path: Path, kind: str, suffix: str
) -> None:
    write(kind, tmp_path, SHARDS)
    file = tmp_path / f"0000001{suffix}"
    size = file.stat().st_size
    with file.open("r+b") as handle:
        handle.truncate(size - 1)
    with pytest.raises(CorruptShardError) as error:
        read(kind, tmp_path)
    message = str(error.value)
    assert f"0000001{suffix}" in message
    assert f"is {size - 1} bytes but was committed with {size} bytes" in message
    assert "the file was truncated after it was written" in message


@pytest.mark.parametrize(("kind", "suffix"), ALL_FILES)
def test_a_grown_file_is_corrupt_and_named_with_both_sizes(
    tmp_path: Path, kind: str, suffix: str
) -> None:
    write(kind, tmp_path, SHARDS)
    file = tmp_path / f"0000002{suffix}"
    size = file.stat().st_size
    with file.open("ab") as handle:
        handle.write(b"\0" * 8)
    with pytest.raises(CorruptShardError) as error:
        read(kind, tmp_path)
    assert f"0000002{suffix}" in str(error.value)
    assert f"is {size + 8} bytes but was committed with {size} bytes" in str(error.value)
    assert "the file grew after it was written" in str(error.value)


@pytest.mark.parametrize(("kind", "suffix"), ALL_FILES)
def test_a_missing_file_of_a_committed_shard_is_named(
    tmp_path: Path, kind: str, suffix: str
) -> None:
    write(kind, tmp_path, SHARDS)
    (tmp_path / f"0000001{suffix}").unlink()
    with pytest.raises(FileNotFoundError, match=f"has no 0000001{re.escape(suffix)}"):
        read(kind, tmp_path)


@pytest.mark.parametrize(("kind", "suffix"), [(k, s) for k, s in ALL_FILES if len(SUFFIXES[k]) > 1])
def test_a_missing_file_of_a_multi_file_shard_without_records_is_named(
    tmp_path: Path, kind: str, suffix: str
) -> None:
    write(kind, tmp_path, SHARDS)
    drop_records(tmp_path)
    (tmp_path / f"0000001{suffix}").unlink()
    with pytest.raises(FileNotFoundError, match=f"has no 0000001{re.escape(suffix)}"):
        read(kind, tmp_path)


def test_a_stream_file_that_is_not_a_whole_number_of_elements_is_corrupt(tmp_path: Path) -> None:
    path = guideloom_copy(tmp_path, "stream")
    with (path / "0000001.in_band.bin").open("ab") as handle:
        handle.write(b"\1\2")
    with pytest.raises(CorruptShardError) as error:
        guideloom_storage("stream", path).sync_reader().open()
    assert "0000001.in_band.bin" in str(error.value)
    assert f"{50 * 5 + 2} bytes, not a multiple of the 5-byte element" in str(error.value)


@pytest.mark.parametrize("change", ["grown", "truncated"])
def test_a_document_index_that_disagrees_with_its_data_file_is_corrupt_on_first_read(
    tmp_path: Path, change: str
) -> None:
    path = guideloom_copy(tmp_path, "document")
    data = path / "0000002.out_of_band.bin"
    size = data.stat().st_size
    with data.open("r+b") as handle:
        handle.truncate(size + 3 if change == "grown" else size - 3)
    with DocumentStorage(path, DocumentPickleFormat()).sync_reader() as reader:
        reader.read(0)  # shard 0 is intact
        with pytest.raises(CorruptShardError) as error:
            reader.read(reader.total_length - 1)
    assert "0000002.out_of_band.index" in str(error.value)
    assert f"to {size}" in str(error.value)


# Checksums -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_verify_passes_on_intact_data_and_counts_what_it_checked(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, SHARDS)
    counts = storage(kind, tmp_path).verify()
    size = sum((tmp_path / f"{k:07d}{s}").stat().st_size for k in SHARDS for s in SUFFIXES[kind])
    assert counts == {
        "shards": 3,
        "files": 3 * len(SUFFIXES[kind]),
        "bytes": size,
        "unrecorded": 0,
    }


def test_verify_warns_that_a_dataset_without_records_cannot_be_verified(tmp_path: Path) -> None:
    path = guideloom_copy(tmp_path, "stream")
    with pytest.warns(UserWarning, match="3 of the 3 shards .* have no commit record"):
        counts = guideloom_storage("stream", path).verify()
    assert counts == {"shards": 0, "files": 0, "bytes": 0, "unrecorded": 3}


@pytest.mark.parametrize(("kind", "suffix"), ALL_FILES)
def test_verify_names_a_file_with_a_flipped_byte(tmp_path: Path, kind: str, suffix: str) -> None:
    write(kind, tmp_path, SHARDS)
    file = tmp_path / f"0000002{suffix}"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x40
    file.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError) as error:
        storage(kind, tmp_path).verify()
    assert f"0000002{suffix}: crc32" in str(error.value)
    assert "checksum mismatch" in str(error.value)


def test_opening_does_not_read_whole_files_for_checksums(tmp_path: Path) -> None:
    write("stream", tmp_path, SHARDS)
    file = tmp_path / "0000000.in_band.bin"
    data = bytearray(file.read_bytes())
    data[0] ^= 1
    file.write_bytes(bytes(data))
    assert read("stream", tmp_path)[0] == 0  # same size: only verify() can tell
    with pytest.raises(CorruptShardError):
        storage("stream", tmp_path).verify()


# Records themselves ----------------------------------------------------------------------


def test_an_unreadable_record_is_corrupt_and_named(tmp_path: Path) -> None:
    write("stream", tmp_path, SHARDS)
    (tmp_path / "0000001.shard.json").write_text("{not json")
    with pytest.raises(CorruptShardError, match=r"0000001\.shard\.json is unreadable"):
        read("stream", tmp_path)


def test_a_record_copied_from_another_shard_is_corrupt(tmp_path: Path) -> None:
    write("stream", tmp_path, {0: [1, 2], 1: [3, 4]})
    shutil.copy(tmp_path / "0000000.shard.json", tmp_path / "0000001.shard.json")
    with pytest.raises(CorruptShardError, match="belongs to shard 0, not 1"):
        read("stream", tmp_path)


def test_a_record_of_a_newer_format_version_asks_for_an_upgrade(tmp_path: Path) -> None:
    write("stream", tmp_path, SHARDS)
    record = record_of(tmp_path)
    record["guideloom_pipes_record"] = 99
    (tmp_path / "0000000.shard.json").write_text(json.dumps(record))
    with pytest.raises(StorageError, match=r"version 99.*upgrade guideloom_pipes"):
        read("stream", tmp_path)


#: a valid entry of an 8-byte file in one block (the fields below break it one at a time)
BLOCK = {"size": 8, "crc32": 0, "block_size": 65536, "block_crc32": "AAAAAA=="}
BLOCK_SIZE, BLOCK_CRCS = "files.in_band.bin.block_size", "files.in_band.bin.block_crc32"
MALFORMED = [
    ("files", [], "files"),
    ("files", "in_band.bin", "files"),
    ("files", {"in_band.bin": [8, 0]}, "files.in_band.bin"),
    ("files", {"in_band.bin": {"size": 1e999, "crc32": 0}}, "files.in_band.bin.size"),
    ("files", {"in_band.bin": {"size": -8, "crc32": 0}}, "files.in_band.bin.size"),
    ("files", {"in_band.bin": {"size": 8.0, "crc32": 0}}, "files.in_band.bin.size"),
    ("files", {"in_band.bin": {"size": 8, "crc32": "0x1"}}, "files.in_band.bin.crc32"),
    ("files", {"in_band.bin": {"size": 8}}, "files.in_band.bin.crc32"),
    ("files", {"in_band.bin": {**BLOCK, "block_size": 0}}, BLOCK_SIZE),
    ("files", {"in_band.bin": {**BLOCK, "block_crc32": "no base64"}}, BLOCK_CRCS),
    ("files", {"in_band.bin": {**BLOCK, "block_crc32": 12}}, BLOCK_CRCS),
    # two CRCs for a file of one block, or three bytes of one
    ("files", {"in_band.bin": {**BLOCK, "block_crc32": "AAAAAAAAAAA="}}, BLOCK_CRCS),
    ("files", {"in_band.bin": {**BLOCK, "block_crc32": "AAAA"}}, BLOCK_CRCS),
    ("files", {"in_band.bin": {"size": 8, "crc32": 0, "block_size": 8}}, BLOCK_CRCS),
    ("files", {"in_band.bin": {"size": 8, "crc32": 0, "block_crc32": ""}}, BLOCK_SIZE),
    ("count", "2", "count"),
    ("count", 1e999, "count"),
    ("count", True, "count"),
    ("shard", None, "shard"),
    ("kind", 5, "kind"),
    ("state", 1, "state"),
    ("state", "half", "state"),
    ("dtype", 42, "dtype"),
    ("dtype", [["tokens"]], "dtype"),
    ("payloads", -1, "payloads"),
    ("generation", "1", "generation"),
    ("versioned", "yes", "versioned"),
    ("guideloom_pipes_record", "1", "guideloom_pipes_record"),
]


@pytest.mark.parametrize(("field", "value", "named"), MALFORMED)
def test_a_record_with_a_malformed_field_is_corrupt_naming_file_field_and_fix(
    tmp_path: Path, field: str, value: Any, named: str
) -> None:
    write("stream", tmp_path, {0: [1, 2], 1: [3, 4]})
    record = record_of(tmp_path, 1)
    record[field] = value
    (tmp_path / "0000001.shard.json").write_text(json.dumps(record))
    with pytest.raises(CorruptShardError) as error:
        read("stream", tmp_path)
    message = str(error.value)
    assert os.fspath(tmp_path / "0000001.shard.json") in message
    assert f"field {named!r}" in message
    assert "Rewrite the shard" in message


@pytest.mark.parametrize("field", ["kind", "shard", "count", "files", "state"])
def test_a_record_missing_a_field_is_corrupt_naming_it(tmp_path: Path, field: str) -> None:
    write("stream", tmp_path, {0: [1, 2]})
    record = record_of(tmp_path)
    del record[field]
    (tmp_path / "0000000.shard.json").write_text(json.dumps(record))
    with pytest.raises(CorruptShardError, match=f"field '{field}' must be .* got nothing"):
        read("stream", tmp_path)


def test_a_record_that_is_not_a_json_object_is_corrupt(tmp_path: Path) -> None:
    write("stream", tmp_path, {0: [1, 2]})
    (tmp_path / "0000000.shard.json").write_text("[1, 2]")
    with pytest.raises(CorruptShardError, match="must be a JSON object"):
        read("stream", tmp_path)


def test_a_rewrite_replaces_a_malformed_record(tmp_path: Path) -> None:
    write("stream", tmp_path, {0: [1, 2]})
    (tmp_path / "0000000.shard.json").write_text('{"guideloom_pipes_record": 1, "files": []}')
    write("stream", tmp_path, {0: [5]})
    assert read("stream", tmp_path) == [5]


# Another storage class -------------------------------------------------------------------

CROSSINGS = [(a, b) for a in KINDS for b in KINDS if a != b]
CLASS = {"stream": "StreamStorage", "document": "DocumentStorage", "stream_meta": "Stream"}


@pytest.mark.parametrize(("written", "opened"), CROSSINGS)
def test_opening_our_dataset_with_another_storage_class_names_the_right_one(
    tmp_path: Path, written: str, opened: str
) -> None:
    write(written, tmp_path, SHARDS)
    with pytest.raises(ValueError) as error:
        read(opened, tmp_path)
    message = str(error.value)
    assert f"written as '{written}' data" in message
    assert f"opened as '{opened}'" in message
    assert {"stream": "(StreamStorage)", "document": "(DocumentStorage)"}.get(
        written, "(StreamWithMetaStorage)"
    ) in message


@pytest.mark.parametrize(
    ("written", "opened", "looks_like"),
    [
        ("document", "stream", "DocumentStorage or StreamWithMetaStorage"),
        ("stream_meta", "stream", "DocumentStorage or StreamWithMetaStorage"),
        ("stream", "document", "StreamStorage or StreamWithMetaStorage"),
        ("stream_meta", "document", "StreamStorage or StreamWithMetaStorage"),
    ],
)
def test_opening_a_guideloom_dataset_with_another_storage_class_is_a_clear_error(
    tmp_path: Path, written: str, opened: str, looks_like: str
) -> None:
    path = guideloom_copy(tmp_path, written)
    with pytest.raises(ValueError) as error:
        read(opened, path)
    opener = {"stream": "StreamStorage", "document": "DocumentStorage"}[opened]
    assert f"which a {opener} dataset does not have" in str(error.value)
    assert f"looks like a {looks_like} dataset" in str(error.value)
    assert "Open it with the storage class it was written with" in str(error.value)


def test_opening_a_guideloom_stream_as_stream_meta_names_the_missing_index(
    tmp_path: Path,
) -> None:
    path = guideloom_copy(tmp_path, "stream")
    with pytest.raises(FileNotFoundError, match=r"has no 0000000\.out_of_band\.index"):
        read("stream_meta", path)


# Our files beside GuideLoom's --------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_our_own_files_all_end_in_shard_json_tmp_or_pending(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, SHARDS)
    with storage(kind, tmp_path).sync_writer() as writer:  # a rewrite in progress
        append(kind, writer, 1, [7, 7])
        append(kind, writer, 3, [8])
        during = shard_kinds.names(tmp_path)
    after = shard_kinds.names(tmp_path)
    for name in during + after:
        assert GUIDELOOM_NAME.match(name) or name.endswith((".shard.json", ".tmp", ".pending"))
    guideloom_after = [n for n in after if GUIDELOOM_NAME.match(n)]
    assert guideloom_after == sorted(f"{k:07d}{s}" for k in range(4) for s in SUFFIXES[kind])


def test_our_document_files_hold_guideloom_bytes(tmp_path: Path) -> None:
    documents = [{"n": 1}, {"n": 22}, {"n": 333}]
    write("document", tmp_path, {0: [1, 22, 333]})
    blobs = [DocumentPickleFormat().pack(d) for d in documents]
    offsets = np.cumsum([0] + [len(b) for b in blobs]).astype("<i8")
    assert (tmp_path / "0000000.out_of_band.bin").read_bytes() == b"".join(blobs)
    assert (tmp_path / "0000000.out_of_band.index").read_bytes() == offsets.tobytes()


class RawFormat:
    """A stream format whose records are already arrays of its dtype (any dtype at all)."""

    def __init__(self, dtype: np.dtype) -> None:
        self.stream_dtype = dtype

    def pack(self, data: np.ndarray) -> np.ndarray:
        return data

    def unpack(self, stream: np.ndarray, shard_lengths: object, shards: object) -> np.ndarray:
        return stream


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype([("tokens", "<i4")]),
        np.dtype([("tokens", ">u2"), ("mask", "?")]),
        np.dtype([("window", "<i4", (3,))]),
        np.dtype([("pos", [("x", "<f8"), ("tag", "S3")]), ("n", "<i8")]),
        np.dtype([(("the title", "t"), "<i4"), ("u", [("q", "<u2", (2,))], (2,))]),
        np.dtype({"names": ["a", "b"], "formats": ["<i4", "<i2"], "offsets": [0, 8]}),
        np.dtype([("when", "<M8[s]"), ("name", "<U4")]),
        np.dtype("<f2"),
    ],
    ids=str,
)
def test_any_dtype_is_recorded_so_that_the_dataset_reopens_with_it(
    tmp_path: Path, dtype: np.dtype
) -> None:
    values = np.zeros(4, dtype=dtype)
    with StreamStorage(tmp_path, RawFormat(dtype)).sync_writer() as writer:
        writer.append(0, values)
    with StreamStorage(tmp_path, RawFormat(dtype)).sync_reader() as reader:
        assert reader.read(0, 4).dtype == dtype
        assert (reader.read(0, 4) == values).all()
    assert (tmp_path / "0000000.in_band.bin").read_bytes() == values.tobytes()


def test_an_array_of_python_objects_is_refused(tmp_path: Path) -> None:
    dtype = np.dtype([("o", "O")])
    writer = StreamStorage(tmp_path, RawFormat(dtype)).sync_writer()
    with pytest.raises(TypeError, match="holds Python objects"), writer:
        writer.append(0, np.zeros(2, dtype=dtype))
    assert list(tmp_path.iterdir()) == []
