"""A dataset at a URL opens from its manifest's whole table with one request (docs/remote.md),
against real servers on loopback: nginx over HTTP and moto's S3 server, the fault proxy of
``remote_servers.py`` in front of them logging every request. Each shard is checked against
its row when a reader first touches it, before any of its bytes are delivered.

The server tests skip when the ``[remote]`` packages or nginx are missing, except under
``GUIDELOOM_PIPES_REQUIRE_SERVERS=1`` (CI), where a server that does not start fails them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from remote_servers import (
    HttpServer,
    S3Server,
    fault_proxy,
)

from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage
from guideloom_pipes.storage import CorruptShardError, DatasetChangedError, StaleManifestWarning
from guideloom_pipes.storage import base as storage_base
from guideloom_pipes.storage.manifest import MAIN, MANIFEST_DIR
from guideloom_pipes.storage.manifest_remote import RemoteManifestListing
from guideloom_pipes.storage.remote import RetryPolicy
from guideloom_pipes.storage.shard_listing import ShardListing

#: These tests run against servers on loopback (nginx, moto, the fault proxy).
pytestmark = pytest.mark.remote

TOKENS = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
FAST = RetryPolicy(attempts=6, base_delay=0.001, max_delay=0.01, timeout=10)
BUCKET = "manifests"
SHARDS, PER_SHARD, WINDOW = 6, 1000, 100


def _refuse_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opens that list the dataset fail from now on: what an open from the manifest must
    not do."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the open listed the dataset")

    monkeypatch.setattr(storage_base, "discover", refuse)


def _write(directory: Path, shards: int = SHARDS, start: int = 0, index: bool = True) -> None:
    """``shards`` shards of ``PER_SHARD`` tokens counting from ``start``; indexed (a whole
    table in the manifest) unless not ``index``."""
    with StreamStorage(directory, TOKENS).sync_writer() as writer:
        for shard in range(shards):
            first = start + shard * PER_SHARD
            writer.append(shard, {"tokens": np.arange(first, first + PER_SHARD, dtype="<i4")})
    if index:
        StreamStorage(directory, TOKENS).index()


def _upload(s3: S3Server, local: Path, prefix: str) -> str:
    s3.filesystem().put(f"{local}/", f"{BUCKET}/{prefix}/", recursive=True)
    return f"s3://{BUCKET}/{prefix}"


def _port(s3: S3Server) -> int:
    return int(s3.endpoint.rpartition(":")[2])


def _listing(storage: Any) -> ShardListing:
    with storage.sync_reader() as reader:
        assert reader.listing is not None
        return reader.listing


def _windows(storage: Any, ids: list[int]) -> list[list[int]]:
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        return [sample["tokens"].tolist() for sample in reader.read_batch(np.array(ids))]


def _tokens(ids: list[int], start: int = 0) -> list[list[int]]:
    return [list(range(start + i * WINDOW, start + (i + 1) * WINDOW)) for i in ids]


def _shard_requests(proxy: Any) -> set[str]:
    """The names of the shard files (and records) the proxy saw requests for."""
    names = set()
    for _, line in proxy.log:
        name = line.split(" ")[1].rpartition("/")[2].partition("?")[0]
        if name[:7].isdigit():
            names.add(name)
    return names


# --- one request for the open ---------------------------------------------------------------


def test_an_http_dataset_with_a_manifest_opens_with_one_request(http: HttpServer) -> None:
    _write(http.root / "one")
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        storage = StreamStorage(f"{proxy.url}/one", TOKENS, retry=FAST)
        with StreamDataset(storage, WINDOW).sync_reader() as reader:
            assert len(reader) == SHARDS * PER_SHARD // WINDOW
            assert [line for _, line in proxy.log] == [f"GET /one/{MANIFEST_DIR}/{MAIN} HTTP/1.1"]
            batch = reader.read_batch(np.array([12, 3]))  # shards 1 and 0
    assert [s["tokens"].tolist() for s in batch] == _tokens([12, 3])
    # the touched shards only: each its record, its size and its bytes
    assert _shard_requests(proxy) == {
        f"000000{k}.{what}" for k in (0, 1) for what in ("shard.json", "in_band.bin")
    }


def test_an_s3_dataset_with_a_manifest_opens_with_one_request(s3: S3Server, tmp_path: Path) -> None:
    _write(tmp_path / "data")
    url = _upload(s3, tmp_path / "data", "one")
    with fault_proxy(_port(s3), lambda n: "pass") as proxy:
        storage = StreamStorage(url, TOKENS, storage_options=s3.options(proxy.url), retry=FAST)
        with StreamDataset(storage, WINDOW).sync_reader() as reader:
            assert len(reader) == SHARDS * PER_SHARD // WINDOW
            opened = [line for _, line in proxy.log]
            batch = reader.read_batch(np.array([55]))  # shard 5
    assert len(opened) == 1 and opened[0].startswith(f"GET /{BUCKET}/one/{MANIFEST_DIR}/{MAIN}")
    assert [s["tokens"].tolist() for s in batch] == _tokens([55])
    assert _shard_requests(proxy) == {"0000005.shard.json", "0000005.in_band.bin"}


def test_windows_and_the_loader_order_over_a_url_are_the_local_ones(
    http: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    from guideloom_pipes import StatefulDataLoader

    _write(http.root / "order")
    _refuse_listing(monkeypatch)  # the local open reads the manifest too
    local = StreamStorage(http.root / "order", TOKENS)
    remote = StreamStorage(f"{http.url}/order", TOKENS, retry=FAST)
    assert isinstance(_listing(remote), RemoteManifestListing)
    ids = list(np.random.default_rng(0).permutation(SHARDS * PER_SHARD // WINDOW)[:25])
    assert _windows(remote, ids) == _windows(local, ids)

    def batches(storage: Any) -> tuple[list[Any], dict[str, Any]]:
        loader = StatefulDataLoader.from_storage(
            storage,
            lambda samples: [s["tokens"][0].item() for s in samples],
            sequence_length=WINDOW,
            local_batch_size=4,
            shuffle=True,
            shuffle_seed=7,
            num_workers=2,
            prefetch=1,
            device="cpu",
        )
        with loader:
            found = list(loader)
            state = loader.state_dict()
        state.pop("base_seed")  # drawn from torch's global generator
        return found, state

    assert batches(remote) == batches(local)


# --- checked at a shard's first touch -------------------------------------------------------


def test_a_shard_truncated_after_the_manifest_is_refused_before_its_bytes_are_read(
    http: HttpServer,
) -> None:
    _write(http.root / "truncated")
    victim = http.root / "truncated" / "0000003.in_band.bin"
    os.truncate(victim, 4 * PER_SHARD - 8)
    storage = StreamStorage(f"{http.url}/truncated", TOKENS, retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        assert isinstance(
            reader._storage_reader.listing, RemoteManifestListing
        )  # opened from the manifest
        assert [s["tokens"].tolist() for s in reader.read_batch(np.array([2]))] == _tokens([2])
        with pytest.raises(CorruptShardError) as error:
            reader.read_batch(np.array([31]))  # shard 3
    message = str(error.value)
    assert "0000003.in_band.bin" in message and "truncated" in message
    assert f"is {4 * PER_SHARD - 8} bytes but was committed with {4 * PER_SHARD} bytes" in message


def test_a_shard_recommitted_after_the_manifest_is_refused_naming_the_manifest(
    s3: S3Server, tmp_path: Path
) -> None:
    _write(tmp_path / "data")
    url = _upload(s3, tmp_path / "data", "recommitted")
    other = tmp_path / "other"
    _write(other, shards=3, start=10**6, index=False)  # files of the same sizes
    fs = s3.filesystem()
    for name in ("0000002.in_band.bin", "0000002.shard.json"):  # as a copy by another tool
        fs.put(str(other / name), f"{BUCKET}/recommitted/{name}")
    storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        assert isinstance(reader._storage_reader.listing, RemoteManifestListing)
        assert [s["tokens"].tolist() for s in reader.read_batch(np.array([19]))] == _tokens([19])
        with pytest.raises(DatasetChangedError) as error:
            reader.read_batch(np.array([20]))  # shard 2: nothing of it is delivered
    message = str(error.value)
    assert "shard 0000002" in message and "committed again" in message
    assert f"{MANIFEST_DIR}/{MAIN}" in message and "guideloom-pipes index" in message


def test_a_shard_replaced_after_the_manifest_without_a_new_record_is_refused(
    http: HttpServer,
) -> None:
    _write(http.root / "replaced")
    victim = http.root / "replaced" / "0000001.in_band.bin"
    data = bytearray(victim.read_bytes())
    data[8:12] = b"\xff\xff\xff\xff"  # same size, one token spoiled (as by rsync)
    victim.write_bytes(bytes(data))
    storage = StreamStorage(f"{http.url}/replaced", TOKENS, retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        assert isinstance(reader._storage_reader.listing, RemoteManifestListing)
        with pytest.raises(CorruptShardError, match=r"0000001\.in_band\.bin"):
            reader.read_batch(np.array([10]))  # its block checksum, from the record


# --- when the manifest is not used ----------------------------------------------------------


def _manifest_gets(proxy: Any) -> list[str]:
    return [line for _, line in proxy.log if f"/{MANIFEST_DIR}/" in line]


def test_a_dataset_without_a_whole_table_opens_by_listing_as_before(http: HttpServer) -> None:
    _write(http.root / "fragments", index=False)  # a writer's fragment, no manifest.bin
    names = os.listdir(http.root / "fragments" / MANIFEST_DIR)
    assert MAIN not in names and any(n.startswith("fragment-") for n in names)
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        storage = StreamStorage(f"{proxy.url}/fragments", TOKENS, retry=FAST)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a missing table is no reason to warn
            listing = _listing(storage)
        assert _windows(storage, [7, 59]) == _tokens([7, 59])
    assert type(listing) is ShardListing and listing.num_shards == SHARDS
    assert _manifest_gets(proxy)[0] == f"GET /fragments/{MANIFEST_DIR}/{MAIN} HTTP/1.1"


def test_a_dataset_with_no_manifest_folder_opens_by_listing_as_before(
    s3: S3Server, tmp_path: Path
) -> None:
    _write(tmp_path / "data", index=False)
    shutil.rmtree(tmp_path / "data" / MANIFEST_DIR)  # as GuideLoom leaves a dataset
    url = _upload(s3, tmp_path / "data", "bare")
    with fault_proxy(_port(s3), lambda n: "pass") as proxy:
        storage = StreamStorage(url, TOKENS, storage_options=s3.options(proxy.url), retry=FAST)
        assert type(_listing(storage)) is ShardListing
        assert _windows(storage, [7, 59]) == _tokens([7, 59])
    assert len(_manifest_gets(proxy)) == 2  # one look per open, answered 404


def test_a_whole_table_with_unmerged_fragments_after_it_is_not_trusted(
    http: HttpServer,
) -> None:
    _write(http.root / "appended")
    with StreamStorage(http.root / "appended", TOKENS).sync_writer() as writer:  # one more
        writer.append(SHARDS, {"tokens": np.arange(-PER_SHARD, 0, dtype="<i4")})
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        storage = StreamStorage(f"{proxy.url}/appended", TOKENS, retry=FAST)
        listing = _listing(storage)
        last = _windows(storage, [SHARDS * PER_SHARD // WINDOW])
    assert type(listing) is ShardListing and listing.num_shards == SHARDS + 1
    assert last == [list(range(-PER_SHARD, -900))]
    assert len(_manifest_gets(proxy)) == 2  # one look per open, answered 404


def test_a_damaged_manifest_is_not_used_with_a_warning(http: HttpServer) -> None:
    _write(http.root / "damaged")
    main = http.root / "damaged" / MANIFEST_DIR / MAIN
    main.write_bytes(main.read_bytes()[:-8])
    storage = StreamStorage(f"{http.url}/damaged", TOKENS, retry=FAST)
    with pytest.warns(StaleManifestWarning, match=r"manifest\.bin was not used: .* damaged"):
        listing = _listing(storage)
        windows = _windows(storage, [0, 59])  # (opened again: warns again)
    assert type(listing) is ShardListing
    assert windows == _tokens([0, 59])


def test_a_writer_to_s3_deletes_the_whole_table_before_it_commits(
    s3: S3Server, tmp_path: Path
) -> None:
    _write(tmp_path / "data")
    url = _upload(s3, tmp_path / "data", "rewritten")
    storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
    assert isinstance(_listing(storage), RemoteManifestListing)
    with storage.sync_writer() as writer:
        writer.append(SHARDS, {"tokens": np.arange(-PER_SHARD, 0, dtype="<i4")})
    assert not s3.filesystem().exists(f"{BUCKET}/rewritten/{MANIFEST_DIR}/{MAIN}")
    listing = _listing(storage)
    assert type(listing) is ShardListing and listing.num_shards == SHARDS + 1


# --- an index at an object store records the ETags --------------------------------------------


def test_an_s3_index_records_etags_so_first_reads_ask_for_no_size(
    s3: S3Server, tmp_path: Path
) -> None:
    _write(tmp_path / "data", index=False)
    url = _upload(s3, tmp_path / "data", "indexed")
    storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
    assert type(_listing(storage)) is ShardListing  # only a writer's fragment: listed
    assert storage.index() == SHARDS
    with fault_proxy(_port(s3), lambda n: "pass") as proxy:
        proxied = StreamStorage(url, TOKENS, storage_options=s3.options(proxy.url), retry=FAST)
        assert _windows(proxied, [25, 26]) == _tokens([25, 26])
    lines = [line for _, line in proxy.log]
    assert lines[0].startswith(f"GET /{BUCKET}/indexed/{MANIFEST_DIR}/{MAIN}")
    assert not [line for line in lines if line.startswith("HEAD")]  # pinned from the table
    assert _shard_requests(proxy) == {"0000002.shard.json", "0000002.in_band.bin"}


def test_the_index_command_indexes_a_dataset_at_an_s3_url(s3: S3Server, tmp_path: Path) -> None:
    """``guideloom-pipes index s3://...``, the store named by the AWS environment variables
    as a user's shell names it, writes the whole table there: the next open is one GET."""
    _write(tmp_path / "data", index=False)
    url = _upload(s3, tmp_path / "data", "by-cli")
    command = [sys.executable, "-m", "guideloom_pipes", "index", url, "--json"]
    env = {**os.environ, **s3.environment()}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["shards"] == SHARDS
    with fault_proxy(_port(s3), lambda n: "pass") as proxy:
        proxied = StreamStorage(url, TOKENS, storage_options=s3.options(proxy.url), retry=FAST)
        assert _windows(proxied, [25, 26]) == _tokens([25, 26])
    lines = [line for _, line in proxy.log]
    assert lines[0].startswith(f"GET /{BUCKET}/by-cli/{MANIFEST_DIR}/{MAIN}")
    assert _shard_requests(proxy) == {"0000002.shard.json", "0000002.in_band.bin"}


def test_an_object_replaced_after_an_s3_index_is_refused_before_its_bytes_are_read(
    s3: S3Server, tmp_path: Path
) -> None:
    _write(tmp_path / "data", index=False)
    url = _upload(s3, tmp_path / "data", "pinned")
    storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
    storage.index()
    key = f"{BUCKET}/pinned/0000001.in_band.bin"
    fs = s3.filesystem()
    data = bytearray(fs.cat_file(key))
    data[8:12] = b"\xff\xff\xff\xff"  # same size, its record left as it was
    fs.pipe_file(key, bytes(data))
    with (
        StreamDataset(storage, WINDOW).sync_reader() as reader,
        pytest.raises(DatasetChangedError, match=r"0000001\.in_band\.bin.*ETag") as error,
    ):
        reader.read_batch(np.array([10]))
    assert f"{MANIFEST_DIR}/{MAIN}" in str(error.value)


def test_a_dataset_changed_while_it_is_indexed_keeps_no_table(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guideloom_pipes.storage import ShardLockedError, manifest_remote

    _write(tmp_path / "data", index=False)
    url = _upload(s3, tmp_path / "data", "moving")
    fs = s3.filesystem()
    listed = manifest_remote.discover

    def discover_then_commit(*args: Any) -> Any:
        found = listed(*args)
        fs.pipe_file(f"{BUCKET}/moving/0000000.shard.json", b"{}")  # as a writer's commit
        return found

    monkeypatch.setattr(manifest_remote, "discover", discover_then_commit)
    storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
    with pytest.raises(ShardLockedError, match="changed while it was indexed"):
        storage.index()
    assert not fs.exists(f"{BUCKET}/moving/{MANIFEST_DIR}/{MAIN}")


def test_an_http_url_cannot_be_indexed(http: HttpServer) -> None:
    _write(http.root / "readonly", index=False)
    with pytest.raises(ValueError, match=r"index the directory it serves"):
        StreamStorage(f"{http.url}/readonly", TOKENS, retry=FAST).index()
