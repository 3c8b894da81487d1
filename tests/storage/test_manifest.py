"""The dataset manifest: writers keep it, opens read it instead of listing the directory,
and any change it does not describe is caught (at open, or when a shard is first read)."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shard_kinds import KINDS, SUFFIXES, expected, read, storage, write

from guideloom_pipes.storage import CorruptShardError, StaleManifestWarning
from guideloom_pipes.storage import base as storage_base
from guideloom_pipes.storage.manifest import MAIN, MANIFEST_DIR, MARKER_PREFIX, ManifestTable
from guideloom_pipes.storage.manifest_open import ManifestListing
from guideloom_pipes.storage.shard_listing import ShardListing

SHARDS = {k: list(range(10 * k, 10 * k + 4 + k)) for k in range(5)}


def _listing(kind: str, path: Path) -> ShardListing:
    with storage(kind, path).sync_reader() as reader:
        assert reader.listing is not None
        return reader.listing


def _fingerprint(kind: str, path: Path) -> dict[str, Any]:
    with storage(kind, path).sync_reader() as reader:
        return reader.fingerprint()


@pytest.fixture
def no_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opens that list the directory fail: what opens from the manifest must not do."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the open listed the directory")

    monkeypatch.setattr(storage_base, "discover", refuse)


@pytest.mark.parametrize("kind", KINDS)
def test_a_written_dataset_opens_from_its_manifest_as_the_listing_opens_it(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(kind, tmp_path, SHARDS)
    listed = tmp_path.parent / (tmp_path.name + "-listed")
    shutil.copytree(tmp_path, listed, ignore=shutil.ignore_patterns(MANIFEST_DIR))
    assert type(_listing(kind, listed)) is ShardListing
    by_listing = read(kind, listed), _fingerprint(kind, listed)
    monkeypatch.setattr(storage_base, "discover", None)  # an open that lists fails
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(_listing(kind, tmp_path), ManifestListing)
        assert (read(kind, tmp_path), _fingerprint(kind, tmp_path)) == by_listing
        assert list(_fingerprint(kind, tmp_path).items()) == list(by_listing[1].items())
    assert by_listing[0] == expected(kind, SHARDS)


@pytest.mark.parametrize("kind", KINDS)
def test_shards_appended_by_later_writers_are_in_the_manifest(
    tmp_path: Path, kind: str, no_listing: None
) -> None:
    write(kind, tmp_path, {0: [1, 2], 1: [3]})
    write(kind, tmp_path, {2: [4, 5, 6]})
    with pytest.warns(UserWarning, match=r"1 shard\(s\) it did not write remain"):
        write(kind, tmp_path, {1: [7, 8]})  # a shard rewritten (shard 2 stays above it)
    assert isinstance(_listing(kind, tmp_path), ManifestListing)
    assert read(kind, tmp_path) == expected(kind, {0: [1, 2], 1: [7, 8], 2: [4, 5, 6]})


def _fragments(path: Path) -> list[str]:
    return [n for n in os.listdir(path / MANIFEST_DIR) if n.startswith("fragment-")]


def test_many_writers_leave_one_merged_table(tmp_path: Path, no_listing: None) -> None:
    for shard in range(8):
        write("stream", tmp_path, {shard: [shard]})
    assert MAIN in os.listdir(tmp_path / MANIFEST_DIR) and not _fragments(tmp_path)
    for shard in range(8, 12):
        write("stream", tmp_path, {shard: [shard]})
    assert len(_fragments(tmp_path)) < 8
    assert read("stream", tmp_path) == expected("stream", {k: [k] for k in range(12)})


def test_a_writer_renames_the_whole_table_to_a_fragment_before_it_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write("stream", tmp_path, SHARDS)
    storage("stream", tmp_path).index()
    assert MAIN in os.listdir(tmp_path / MANIFEST_DIR)
    write("stream", tmp_path, {5: [5, 6]})
    # a reader at a URL reads only the whole table: it lists the dataset until the next
    # merge or index; a local open reads the renamed table with the new fragment
    assert MAIN not in os.listdir(tmp_path / MANIFEST_DIR) and len(_fragments(tmp_path)) == 2
    monkeypatch.setattr(storage_base, "discover", None)  # an open that lists fails
    assert read("stream", tmp_path) == expected("stream", {**SHARDS, 5: [5, 6]})


def _write_shards(path: str, shards: list[int], barrier: Any) -> None:
    target = Path(path)
    with storage("stream", target).sync_writer() as writer:
        for shard in shards:
            writer.append(shard, {"tokens": np.arange(shard, shard + 3, dtype=np.int32)})
        barrier.wait()  # every writer appended: they all commit at once


def test_a_manifest_from_concurrent_writers_is_complete(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(4)
    parts = [[w, w + 4, w + 8] for w in range(4)]
    writers = [
        context.Process(target=_write_shards, args=(str(tmp_path), part, barrier)) for part in parts
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    assert not [n for n in os.listdir(tmp_path / MANIFEST_DIR) if n.startswith(MARKER_PREFIX)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        listing = _listing("stream", tmp_path)
    assert isinstance(listing, ManifestListing) and listing.num_shards == 12
    assert read("stream", tmp_path) == expected(
        "stream", {k: list(range(k, k + 3)) for k in range(12)}
    )


# --- a manifest made stale -----------------------------------------------------------------


def _stale(kind: str, path: Path) -> list[Any]:
    """What reading the dataset gives, with the warning that the manifest was not used."""
    with pytest.warns(StaleManifestWarning, match=r"guideloom-pipes index"):
        found = read(kind, path)
        listing = _listing(kind, path)  # (opened again: warns again)
    assert type(listing) is ShardListing
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_a_shard_added_by_hand_is_seen(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, SHARDS)
    other = tmp_path.parent / (tmp_path.name + "-other")
    write(kind, other, {5: [99, 98]})
    for suffix in (*SUFFIXES[kind], ".shard.json"):
        shutil.copy(other / f"0000005{suffix}", tmp_path / f"0000005{suffix}")
    assert _stale(kind, tmp_path) == expected(kind, {**SHARDS, 5: [99, 98]})


@pytest.mark.parametrize("kind", KINDS)
def test_a_shard_replaced_by_hand_is_read_as_replaced(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, SHARDS)
    other = tmp_path.parent / (tmp_path.name + "-other")
    write(kind, other, {2: [77] * 6})  # as many elements: files of the same sizes
    for suffix in (*SUFFIXES[kind], ".shard.json"):
        os.replace(other / f"0000002{suffix}", tmp_path / f"0000002{suffix}")
    assert _stale(kind, tmp_path) == expected(kind, {**SHARDS, 2: [77] * 6})


@pytest.mark.parametrize("kind", KINDS)
def test_a_deleted_last_shard_is_gone_and_a_deleted_middle_one_is_a_gap(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, SHARDS)
    for suffix in (*SUFFIXES[kind], ".shard.json"):
        (tmp_path / f"0000004{suffix}").unlink()
    assert _stale(kind, tmp_path) == expected(kind, {k: SHARDS[k] for k in range(4)})
    for suffix in (*SUFFIXES[kind], ".shard.json"):
        (tmp_path / f"0000001{suffix}").unlink()
    with pytest.warns(StaleManifestWarning), pytest.raises(FileNotFoundError, match="0000001"):
        read(kind, tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_truncated_in_place_is_refused_before_its_bytes_are_read(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, SHARDS)
    victim = tmp_path / f"0000003{SUFFIXES[kind][0]}"
    size = victim.stat().st_size
    os.truncate(victim, size - 1)  # in place: the directory does not change
    reader = storage(kind, tmp_path).sync_reader()
    reader.open()  # the manifest is read; the shard's files are checked when first read
    assert isinstance(reader.listing, ManifestListing)
    reader.close()
    with pytest.raises(CorruptShardError) as error:
        read(kind, tmp_path)
    assert f"is {size - 1} bytes but was committed with {size} bytes" in str(error.value)
    assert "truncated" in str(error.value)


@pytest.mark.parametrize("kind", KINDS)
def test_a_record_edited_in_place_is_checked_again_when_its_shard_is_read(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, SHARDS)
    record = tmp_path / "0000002.shard.json"
    data = json.loads(record.read_bytes())
    data["shard"] = 3  # as if copied from another shard
    with open(record, "r+b") as file:  # in place: same inode, same directory
        file.write(json.dumps(data).encode())
        file.truncate()
    with pytest.raises(CorruptShardError, match=r"0000002\.shard\.json .* belongs to shard 3"):
        read(kind, tmp_path)
    record.write_bytes(b"\x00 garbage")
    with pytest.raises(CorruptShardError, match=r"0000002\.shard\.json is unreadable"):
        read(kind, tmp_path)


def test_a_writer_that_stopped_mid_commit_makes_opens_list_until_indexed(
    tmp_path: Path,
) -> None:
    write("stream", tmp_path, SHARDS)
    dead = tmp_path / MANIFEST_DIR / (MARKER_PREFIX + "0-1-dead")
    dead.write_bytes(b"")  # a marker no writer holds: its writer stopped
    assert _stale("stream", tmp_path) == expected("stream", SHARDS)
    assert storage("stream", tmp_path).index() == len(SHARDS)
    assert not dead.exists()
    assert isinstance(_listing("stream", tmp_path), ManifestListing)


def test_a_dataset_written_without_a_manifest_is_indexed_by_the_cli(tmp_path: Path) -> None:
    write("stream", tmp_path, SHARDS)
    shutil.rmtree(tmp_path / MANIFEST_DIR)  # as GuideLoom, or an earlier version, left it
    for record in tmp_path.glob("*.shard.json"):
        record.unlink()  # GuideLoom writes no records
    assert type(_listing("stream", tmp_path)) is ShardListing
    done = subprocess.run(
        [sys.executable, "-m", "guideloom_pipes", "index", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["shards"] == len(SHARDS)
    assert isinstance(_listing("stream", tmp_path), ManifestListing)
    assert read("stream", tmp_path) == expected("stream", SHARDS)


def test_write_parallel_leaves_a_whole_checked_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guideloom_pipes import write_parallel

    target = storage("stream", tmp_path)
    write_parallel(target, list(range(6)), _tokens, max_workers=2, progress=False)
    names = os.listdir(tmp_path / MANIFEST_DIR)
    assert MAIN in names and not [n for n in names if n.startswith(("fragment-", "writing-"))]
    monkeypatch.setattr(storage_base, "discover", None)  # an open that lists fails
    assert read("stream", tmp_path) == expected("stream", {k: [k, k + 1] for k in range(6)})


def _tokens(item: int) -> list[dict[str, np.ndarray]]:
    return [{"tokens": np.array([item, item + 1], dtype=np.int32)}]


def test_a_damaged_manifest_block_is_named_when_a_shard_in_it_is_first_read(
    tmp_path: Path,
) -> None:
    write("stream", tmp_path, SHARDS)
    main = tmp_path / MANIFEST_DIR / MAIN
    storage("stream", tmp_path).index()
    table = ManifestTable.read(str(main))
    offset = main.stat().st_size - 8 * table.rows * len(table.columns)
    names = list(table.header["columns"])
    at = offset + 8 * table.rows * names.index("record_mtime") + 8 * 2  # shard 2
    raw = bytearray(main.read_bytes())
    raw[at] ^= 0xFF
    main.write_bytes(bytes(raw))  # in place: the directory does not change
    with pytest.raises(CorruptShardError, match=r"manifest .* is damaged .*'record_mtime'"):
        read("stream", tmp_path)


def test_a_reader_of_many_shards_keeps_their_bounds_in_an_array_and_reads_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guideloom_pipes.storage import window_grid

    write("stream", tmp_path, SHARDS)
    listed = read("stream", tmp_path)
    monkeypatch.setattr(window_grid, "LISTED_SHARDS", 1)  # as past 65,536 shards
    with storage("stream", tmp_path).sync_reader() as reader:
        assert not isinstance(reader._bounds, list)
        windows = reader.read_windows(np.array([0, 3, 5, 9, 13]), 4)["tokens"].tolist()
    assert windows == [listed[s : s + 4] for s in (0, 3, 5, 9, 13)]
    assert read("stream", tmp_path) == listed
