"""seal(): a dataset written by GuideLoom (files, no commit records) gets records, so shards
this package commits next can live beside its shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from shard_kinds import KINDS, TOKENS, expected, read, storage, write

from guideloom_pipes import StreamNumpyFormat, StreamStorage
from guideloom_pipes.storage import CorruptShardError, UncommittedShardError

# (these tests change shard files behind the manifest's back: its StaleManifestWarning is
# the expected fallback, asserted where it matters, and would flood the report)
pytestmark = pytest.mark.filterwarnings(
    "ignore::guideloom_pipes.storage.errors.StaleManifestWarning"
)


def strip_records(path: Path) -> None:
    """Make a dataset look as GuideLoom writes it: no commit records."""
    for record in path.glob("*.shard.json"):
        record.unlink()


@pytest.mark.parametrize("kind", KINDS)
def test_seal_records_every_shard_of_a_guideloom_dataset(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, {0: [1, 2, 3], 1: [4], 2: [5, 6]})
    records = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.shard.json")}
    strip_records(tmp_path)
    assert storage(kind, tmp_path).seal() == [0, 1, 2]
    assert {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.shard.json")} == records
    assert storage(kind, tmp_path).verify()["shards"] == 3


@pytest.mark.parametrize("kind", KINDS)
def test_after_seal_a_new_shard_of_ours_lives_beside_guideloom_shards(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, {0: [1, 2], 1: [3]})
    strip_records(tmp_path)
    write(kind, tmp_path, {2: [7, 8]})  # our writer commits shard 2 next to them
    with pytest.raises(UncommittedShardError, match=r"storage\.seal\(\)"):
        read(kind, tmp_path)
    assert storage(kind, tmp_path).seal() == [0, 1]
    assert read(kind, tmp_path) == expected(kind, {0: [1, 2], 1: [3], 2: [7, 8]})


@pytest.mark.parametrize("kind", KINDS)
def test_seal_leaves_committed_shards_alone_and_returns_nothing_to_do(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, {0: [1], 1: [2]})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert storage(kind, tmp_path).seal() == []
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_seal_refuses_a_truncated_stream_shard(tmp_path: Path) -> None:
    write("stream", tmp_path, {0: [1, 2], 1: [3, 4]})
    strip_records(tmp_path)
    with open(tmp_path / "0000001.in_band.bin", "r+b") as shard:
        shard.truncate(6)  # one and a half <i4 elements
    with pytest.raises(CorruptShardError, match="not a multiple"):
        storage("stream", tmp_path).seal()
    assert not list(tmp_path.glob("*.shard.json"))


@pytest.mark.parametrize("kind", ["document", "stream_meta"])
def test_seal_refuses_an_index_that_does_not_match_its_data(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, {0: [1, 2, 3]})
    strip_records(tmp_path)
    with open(tmp_path / "0000000.out_of_band.bin", "ab") as data:
        data.write(b"junk")
    with pytest.raises(CorruptShardError, match="does not match its data file"):
        storage(kind, tmp_path).seal()
    assert not list(tmp_path.glob("*.shard.json"))


def test_seal_refuses_stream_records_pointing_past_the_payload_index(tmp_path: Path) -> None:
    write("stream_meta", tmp_path, {0: [1, 2]})
    strip_records(tmp_path)
    records = np.fromfile(
        tmp_path / "0000000.in_band.bin", dtype=[("index", "<i4"), ("user", "<i4")]
    )
    records["index"][-1] = 99
    records.tofile(tmp_path / "0000000.in_band.bin")
    with pytest.raises(CorruptShardError, match=r"outside 0\.\.1"):
        storage("stream_meta", tmp_path).seal()


def test_seal_needs_a_local_directory(tmp_path: Path) -> None:
    class Remote:
        def sync_reader(self) -> object:
            def reader(path: object) -> object:
                raise FileNotFoundError(str(path))

            return reader

    write("stream", tmp_path, {0: [1]})
    remote = StreamStorage(tmp_path, StreamNumpyFormat(TOKENS), read_interface=Remote())
    with pytest.raises(TypeError, match="local directory"):
        remote.seal()
