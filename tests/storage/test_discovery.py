"""Shard discovery: listing the directory, gaps, missing or empty directories, long ids."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePath

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shard_kinds import KINDS, SUFFIXES, expected, names, read, storage, write

from guideloom_pipes.storage import StaleWriteWarning
from guideloom_pipes.storage.io import MmapIO
from guideloom_pipes.storage.listing import discover
from guideloom_pipes.storage.names import SHARD_NAME, shard_name


def guideloom_stream(path: Path, lengths: Iterable[int], ids: Iterable[int] | None = None) -> None:
    """Stream shards written by hand, as GuideLoom does (raw ``<i4`` tokens, no records)."""
    path.mkdir(parents=True, exist_ok=True)
    start = 0
    lengths = list(lengths)
    for shard, length in zip(range(len(lengths)) if ids is None else ids, lengths):
        tokens = np.arange(start, start + length, dtype="<i4")
        (path / f"{shard_name(shard)}.in_band.bin").write_bytes(tokens.tobytes())
        start += length


# Gaps ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_gap_in_the_shard_ids_names_the_missing_shard_and_the_found_ones(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, {0: [1], 1: [2], 3: [4]})
    with pytest.raises(FileNotFoundError) as error:
        read(kind, tmp_path)
    assert "shard 0000002 is missing" in str(error.value)
    assert "(found 0, 1, 3)" in str(error.value)
    assert os.fspath(tmp_path) in str(error.value)


@settings(deadline=None, max_examples=60)
@given(ids=st.sets(st.integers(0, 40), min_size=1, max_size=12))
def test_discovery_accepts_exactly_the_ids_0_to_n_minus_1(ids: set[int]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        for shard in ids:
            (Path(directory) / f"{shard_name(shard)}.in_band.bin").touch()
        if ids == set(range(len(ids))):
            assert discover(MmapIO(), Path(directory), ".in_band.bin").num_shards == len(ids)
        else:
            first_missing = min(set(range(max(ids))) - ids)
            with pytest.raises(FileNotFoundError) as error:
                discover(MmapIO(), Path(directory), ".in_band.bin")
            assert f"shard {shard_name(first_missing)} is missing" in str(error.value)
            assert f"{max(ids) + 1 - len(ids)} missing in all" in str(error.value)


def test_a_gap_in_a_guideloom_dataset_is_found(tmp_path: Path) -> None:
    guideloom_stream(tmp_path, [3, 3, 3], ids=[0, 1, 3])
    with pytest.raises(FileNotFoundError, match=r"shard 0000002 is missing .*\(found 0, 1, 3\)"):
        read("stream", tmp_path)


def test_a_gap_error_counts_every_missing_shard(tmp_path: Path) -> None:
    guideloom_stream(tmp_path, [1, 1, 1], ids=[0, 4, 9])
    with pytest.raises(FileNotFoundError, match=r"shard 0000001 is missing .* 7 missing in all"):
        read("stream", tmp_path)


def test_a_dataset_without_shard_0_is_a_gap(tmp_path: Path) -> None:
    guideloom_stream(tmp_path, [1, 1], ids=[1, 2])
    with pytest.raises(FileNotFoundError, match=r"shard 0000000 is missing .*\(found 1, 2\)"):
        read("stream", tmp_path)


# No dataset here -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_directory_is_an_error_not_an_empty_dataset(tmp_path: Path, kind: str) -> None:
    with pytest.raises(FileNotFoundError) as error:
        read(kind, tmp_path)
    assert f"no shards in {tmp_path}" in str(error.value)
    assert f"*{SUFFIXES[kind][0]}" in str(error.value)


def test_a_directory_of_only_other_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("not a dataset")
    with pytest.raises(FileNotFoundError, match="no shards in"):
        read("stream", tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_a_missing_directory_is_an_error_naming_it(tmp_path: Path, kind: str) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"dataset directory {missing} does not exist"):
        read(kind, missing)


def test_a_path_that_is_a_file_is_an_error_naming_it(tmp_path: Path) -> None:
    file = tmp_path / "0000000.in_band.bin"
    file.write_bytes(b"\0" * 4)
    with pytest.raises(NotADirectoryError, match=f"{file} is not a directory"):
        read("stream", file)


# Names -----------------------------------------------------------------------------------


def test_files_that_are_not_shards_are_ignored(tmp_path: Path) -> None:
    guideloom_stream(tmp_path, [2, 3])
    for name in [
        "README.md",
        ".DS_Store",
        "0000000.in_band.bin.bak",
        "0000005.in_band.binx",
        "000005.in_band.bin",  # too few digits
        "00000005.in_band.bin",  # a leading zero past 7 digits: not a name we write
        "x0000005.in_band.bin",
        "0000005.other.bin",
    ]:
        (tmp_path / name).write_bytes(b"\0" * 4)
    (tmp_path / "0000007.in_band.bin").mkdir()  # a directory, not a shard file
    assert read("stream", tmp_path) == list(range(5))


def test_shard_names_have_seven_digits_and_more_past_9999999() -> None:
    assert shard_name(0) == "0000000"
    assert shard_name(42) == "0000042"
    assert shard_name(9_999_999) == "9999999"
    assert shard_name(10_000_000) == "10000000"
    assert shard_name(12_345_678) == "12345678"


@pytest.mark.parametrize(
    ("name", "shard"),
    [
        ("0000000.in_band.bin", 0),
        ("9999999.out_of_band.bin", 9_999_999),
        ("10000000.out_of_band.index", 10_000_000),
        ("12345678.in_band.bin", 12_345_678),
        ("123456789012.shard.json", 123_456_789_012),
        ("12345678.in_band.bin.tmp", 12_345_678),
    ],
)
def test_shard_file_names_parse_to_their_id(name: str, shard: int) -> None:
    match = SHARD_NAME.match(name)
    assert match is not None
    assert int(match.group(1)) == shard


@pytest.mark.parametrize(
    "name", ["000001.in_band.bin", "00000001.in_band.bin", "0000001.in_band", "1.in_band.bin"]
)
def test_names_shard_name_cannot_produce_do_not_parse(name: str) -> None:
    assert SHARD_NAME.match(name) is None


def test_every_parsed_name_is_the_one_shard_name_writes() -> None:
    for shard in [0, 1, 999, 9_999_999, 10_000_000, 2**40]:
        match = SHARD_NAME.match(shard_name(shard) + ".in_band.bin")
        assert match is not None and int(match.group(1)) == shard


def test_guideloom_style_empty_shards_are_discovered(tmp_path: Path) -> None:
    for shard in range(3):
        (tmp_path / f"000000{shard}.in_band.bin").touch()
    listing = discover(MmapIO(), tmp_path, ".in_band.bin")
    assert listing.num_shards == 3
    assert listing.sizes == {(k, ".in_band.bin"): 0 for k in range(3)}
    assert listing.records == {}


def test_writing_shard_10000000_writes_an_eight_digit_name(tmp_path: Path) -> None:
    write("stream", tmp_path, {10_000_000: [1, 2]})
    assert names(tmp_path) == [
        "10000000.in_band.bin",
        "10000000.shard.json",
    ]
    with pytest.raises(FileNotFoundError, match=r"shard 0000000 is missing .*\(found 10000000\)"):
        read("stream", tmp_path)


def test_eight_digit_ids_are_listed_beside_seven_digit_ones(tmp_path: Path) -> None:
    write("stream", tmp_path, {9_999_998: [1], 9_999_999: [2, 3], 10_000_000: [4]})
    with pytest.raises(FileNotFoundError) as error:
        read("stream", tmp_path)
    assert "(found 9999998, 9999999, 10000000); 9999998 missing in all" in str(error.value)


# Backends with and without a listing -------------------------------------------------------


class MemoryBackend:
    """Serves files from a dict (an object store, say); ``list_dir`` only if ``listing``."""

    holds_fd = False

    def __init__(self, files: dict[str, bytes], listing: bool) -> None:
        self.files = files
        if listing:
            self.list_dir = self._list_dir

    def _list_dir(self, path: PurePath) -> list[str]:
        prefix = os.fspath(path) + "/"
        names = [k[len(prefix) :] for k in self.files if k.startswith(prefix)]
        if not names:
            raise FileNotFoundError(os.fspath(path))
        return names

    def sync_reader(self) -> object:
        return lambda path: MemoryReader(self.files, os.fspath(path))


class MemoryReader:
    def __init__(self, files: dict[str, bytes], key: str) -> None:
        self.files, self.key = files, key

    def open(self) -> None:
        if self.key not in self.files:
            raise FileNotFoundError(self.key)

    def close(self) -> None:
        pass

    def filesize(self) -> int:
        return len(self.files[self.key])

    def read(self, offset: int, size: int) -> bytes:
        return self.files[self.key][offset : offset + size]


def memory_copy(path: Path) -> dict[str, bytes]:
    return {f"/bucket/data/{p.name}": p.read_bytes() for p in path.iterdir() if p.is_file()}


def test_a_backend_with_a_listing_finds_gaps(tmp_path: Path) -> None:
    write("stream", tmp_path, {0: [1], 1: [2], 3: [4]})
    backend = MemoryBackend(memory_copy(tmp_path), listing=True)
    with pytest.raises(FileNotFoundError, match="shard 0000002 is missing"):
        discover(backend, PurePath("/bucket/data"), ".in_band.bin")


def test_a_backend_without_a_listing_probes_ids_and_cannot_see_a_gap(tmp_path: Path) -> None:
    write("stream", tmp_path, {0: [1], 1: [2], 3: [4]})
    backend = MemoryBackend(memory_copy(tmp_path), listing=False)
    listing = discover(backend, PurePath("/bucket/data"), ".in_band.bin")
    assert listing.num_shards == 2  # as GuideLoom: shard 3 hides behind the gap
    assert sorted(listing.records) == [0, 1]
    assert not listing.listed


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13])
def test_probing_finds_every_shard_of_a_dataset_without_gaps(tmp_path: Path, count: int) -> None:
    write("stream", tmp_path, {k: [k] for k in range(count)})
    backend = MemoryBackend(memory_copy(tmp_path), listing=False)
    assert discover(backend, PurePath("/bucket/data"), ".in_band.bin").num_shards == count


def test_probing_an_empty_location_is_an_error(tmp_path: Path) -> None:
    backend = MemoryBackend({}, listing=False)
    with pytest.raises(FileNotFoundError, match=r"no shard 0000000\.in_band\.bin in /bucket/x"):
        discover(backend, PurePath("/bucket/x"), ".in_band.bin")


def test_a_dataset_served_by_a_listing_backend_reads_back(tmp_path: Path) -> None:
    shards_written = {0: [1, 2], 1: [3], 2: [4, 5, 6]}
    write("stream", tmp_path, shards_written)
    backend = MemoryBackend(memory_copy(tmp_path), listing=True)
    store = storage("stream", tmp_path)
    store.dir, store.read_interface = PurePath("/bucket/data"), backend
    with store.sync_reader() as reader:
        assert reader.read(0, 6)["tokens"].tolist() == expected("stream", shards_written)


# Shard numbers given to readers ----------------------------------------------------------


def test_reader_length_refuses_a_shard_that_is_not_an_int_and_names_it(tmp_path: Path) -> None:
    write("stream", tmp_path, {0: [1], 1: [2, 3]})
    with storage("stream", tmp_path).sync_reader() as reader:
        assert reader.length(np.int64(1)) == 2
        with pytest.raises(TypeError, match=r"shard must be an int, got '1' \(str\)"):
            reader.length("1")
        with pytest.raises(IndexError, match=r"shard -1 out of range: .* has shards 0\.\.1"):
            reader.length(-1)


# Leftovers -------------------------------------------------------------------------------


@pytest.mark.listing  # states what an open that lists the directory does
def test_a_leftover_pending_record_is_named_as_stale_and_ignored(tmp_path: Path) -> None:
    write("stream", tmp_path, {0: [1, 2]})
    (tmp_path / "0000000.shard.json.pending").write_text("{}")
    with pytest.warns(StaleWriteWarning, match=r"0000000\.shard\.json\.pending"):
        assert read("stream", tmp_path) == [1, 2]
    write("stream", tmp_path, {0: [3]})  # the next writer of shard 0 clears it
    assert names(tmp_path) == [
        "0000000.in_band.bin",
        "0000000.shard.json",
    ]
