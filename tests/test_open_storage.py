"""open_storage: a dataset opens without restating its kind or dtype; formats that cannot be
rebuilt from the records (user classes, GuideLoom data without records) need fmt=."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import guideloom_pipes
from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
    StreamWithMetaStorage,
    open_storage,
)
from tests.storage_formats import ChunkMetaFormat

FIXTURES = Path(__file__).parent / "data" / "guideloom-1.1"
DTYPE = np.dtype([("tokens", "<i4"), ("loss_mask", "u1")])


def _write_stream(path: Path) -> None:
    with StreamStorage(path, StreamNumpyFormat(DTYPE)).sync_writer() as writer:
        for shard in range(3):
            tokens = np.arange(10 * shard, 10 * shard + 10)
            writer.append(shard, {"tokens": tokens, "loss_mask": tokens % 2})


def test_open_storage_is_exported_from_the_package() -> None:
    assert guideloom_pipes.open_storage is open_storage
    assert "open_storage" in guideloom_pipes.__all__


def test_a_stream_opens_with_the_dtype_of_its_records(tmp_path: Path) -> None:
    _write_stream(tmp_path)
    storage = open_storage(tmp_path)
    assert type(storage) is StreamStorage
    assert storage.format == StreamNumpyFormat(DTYPE)
    with StreamDataset(storage, 5).sync_reader() as samples:
        assert samples[3]["tokens"].tolist() == [15, 16, 17, 18, 19]


def test_a_string_and_a_file_url_open_too(tmp_path: Path) -> None:
    _write_stream(tmp_path)
    assert open_storage(str(tmp_path)).dir == tmp_path
    assert open_storage(tmp_path.as_uri()).dir == tmp_path


def test_pickled_documents_open_with_document_pickle_format(tmp_path: Path) -> None:
    with DocumentStorage(tmp_path, DocumentPickleFormat()).sync_writer() as writer:
        writer.append(0, {"text": "a"})
        writer.append(1, [1, 2])
    storage = open_storage(tmp_path)
    assert type(storage) is DocumentStorage
    assert isinstance(storage.format, DocumentPickleFormat)
    with DocumentDataset(storage).sync_reader() as docs:
        assert list(docs) == [{"text": "a"}, [1, 2]]


def test_records_name_the_format_class(tmp_path: Path) -> None:
    _write_stream(tmp_path)
    record = json.loads((tmp_path / "0000000.shard.json").read_text())
    assert record["format"] == "guideloom_pipes.formats.StreamNumpyFormat"


def test_documents_of_records_without_a_format_field_open_when_they_are_pickles(
    tmp_path: Path,
) -> None:
    # records written before the format field existed
    with DocumentStorage(tmp_path, DocumentPickleFormat()).sync_writer() as writer:
        writer.append(0, "x")
    record_path = tmp_path / "0000000.shard.json"
    record = json.loads(record_path.read_text())
    del record["format"]
    record_path.write_text(json.dumps(record))
    assert isinstance(open_storage(tmp_path).format, DocumentPickleFormat)


class _RawBytes:
    def pack(self, data: bytes) -> bytes:
        return data

    def unpack(self, encoded_data: bytes, shard: int) -> bytes:
        return bytes(encoded_data)


def test_documents_of_a_user_format_need_fmt_and_the_error_names_it(tmp_path: Path) -> None:
    with DocumentStorage(tmp_path, _RawBytes()).sync_writer() as writer:
        writer.append(0, b"plain")
    with pytest.raises(ValueError, match=r"_RawBytes.*pass fmt="):
        open_storage(tmp_path)
    storage = open_storage(tmp_path, fmt=_RawBytes())
    with DocumentDataset(storage).sync_reader() as docs:
        assert docs[0] == b"plain"


def test_a_stream_with_metadata_needs_fmt(tmp_path: Path) -> None:
    with StreamWithMetaStorage(tmp_path, ChunkMetaFormat()).sync_writer() as writer:
        writer.append(0, {"doc": 0, "tokens": [1, 2], "chunk_ids": [0, 0]})
    with pytest.raises(ValueError, match=r"stream-with-metadata.*user class.*pass fmt="):
        open_storage(tmp_path)
    assert type(open_storage(tmp_path, fmt=ChunkMetaFormat())) is StreamWithMetaStorage


@pytest.mark.parametrize("kind", ["stream", "document", "stream_meta"])
def test_guideloom_data_without_records_needs_fmt(tmp_path: Path, kind: str) -> None:
    shutil.copytree(FIXTURES / kind, tmp_path / kind)
    with pytest.raises(ValueError, match="pass fmt="):
        open_storage(tmp_path / kind)


def test_guideloom_stream_opens_with_fmt(tmp_path: Path) -> None:
    storage = open_storage(FIXTURES / "stream", fmt=StreamNumpyFormat(DTYPE))
    assert type(storage) is StreamStorage
    with storage.sync_reader() as reader:
        assert reader.total_length == 37 + 50 + 23


def test_a_missing_directory_and_one_without_shards_are_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_storage(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="not a dataset"):
        open_storage(tmp_path)


def test_a_remote_url_with_a_read_interface_is_refused_with_the_way_to_open_it() -> None:
    pytest.importorskip("s3fs")
    from guideloom_pipes.io import SeekIO

    with pytest.raises(ValueError, match="Drop read_interface"):
        open_storage("s3://bucket/tokens", read_interface=SeekIO())


def test_the_optional_record_fields_round_trip_and_a_wrong_type_is_corrupt() -> None:
    from guideloom_pipes.storage.errors import CorruptShardError
    from guideloom_pipes.storage.records import FileRecord, ShardRecord

    record = ShardRecord("stream", 0, 1, {"in_band.bin": FileRecord(4, 1)}, format="m.F")
    record.fingerprint = "blake2b:00"
    again = ShardRecord.from_json(record.to_json(), "0000000.shard.json")
    assert (again.format, again.fingerprint) == ("m.F", "blake2b:00")
    without = json.loads(record.to_json())
    del without["format"], without["fingerprint"]  # a record of an earlier version
    older = ShardRecord.from_json(json.dumps(without).encode(), "0000000.shard.json")
    assert (older.format, older.fingerprint) == (None, None)
    broken = {**without, "fingerprint": 5}
    with pytest.raises(CorruptShardError, match="'fingerprint' must be a string"):
        ShardRecord.from_json(json.dumps(broken).encode(), "0000000.shard.json")
