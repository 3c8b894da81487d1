"""Range reads checked against the committed content (docs/remote.md, "What a range read
checks"): each commit record keeps the CRC-32 of every 64 KiB block of each file, a ranged
read is widened to whole blocks and each block compared, and bytes that differ (spoiled on
the way, or an object replaced in place without a new commit) are a ``CorruptShardError``
naming the shard, the URL and the byte range, never samples.

Against real servers on loopback: moto's S3 server and nginx, with the fault proxy of
``remote_servers.py`` inverting a byte of chosen answers. They skip when the ``[remote]``
packages or nginx are missing, except under ``GUIDELOOM_PIPES_REQUIRE_SERVERS=1``.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from remote_servers import (
    HttpServer,
    S3Server,
    fault_proxy,
)

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
)
from guideloom_pipes.storage import CorruptShardError, DatasetChangedError
from guideloom_pipes.storage.checksums import BlockCrc32, crc32_combine
from guideloom_pipes.storage.records import ShardRecord
from guideloom_pipes.storage.remote import RetryPolicy

#: These tests run against servers on loopback (nginx, moto, the fault proxy).
pytestmark = pytest.mark.remote

TOKENS = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
FAST = RetryPolicy(attempts=6, base_delay=0.001, max_delay=0.01, timeout=10)
BUCKET = "verified"
PER_SHARD = 100_000  # 400,000 bytes a shard: 7 blocks of 64 KiB
WINDOW = 1000  # 4,000 bytes
#: window 150: tokens 150,000..151,000, bytes 200,000..204,000 of shard 1, inside its block
#: 3 (bytes 196,608..262,144), which a ranged read of the window reads whole
SAMPLE, ASKED, BLOCK = 150, "200000..204000", "196608..262144"


# --- the block checksums --------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(max_size=5000),
    cuts=st.lists(st.integers(0, 5000), max_size=6),
    block=st.sampled_from([1, 7, 64, 1000]),
    most=st.integers(1, 40),
)
def test_block_checksums_fed_in_any_pieces_are_zlibs_of_each_block_and_of_the_whole(
    data: bytes, cuts: list[int], block: int, most: int
) -> None:
    checksums = BlockCrc32(block)
    edges = [0, *sorted(c for c in cuts if c <= len(data)), len(data)]
    for start, end in itertools.pairwise(edges):
        checksums.update(data[start:end])
    assert checksums.size == len(data)
    assert checksums.crc32 == zlib.crc32(data)
    blocks = checksums.blocks(most)
    assert len(blocks) <= most
    assert blocks.block_size >= block and blocks.fits(len(data))
    size = blocks.block_size
    assert [blocks.crc(k) for k in range(len(blocks))] == [
        zlib.crc32(data[k : k + size]) for k in range(0, len(data), size)
    ]


def test_crc32_combine_is_the_crc_of_the_concatenation() -> None:
    first, second = b"range reads are ", b"checked against their commit record"
    combined = crc32_combine(zlib.crc32(first), zlib.crc32(second), len(second))
    assert combined == zlib.crc32(first + second)


def test_a_file_past_4096_blocks_gets_coarser_blocks_and_a_bounded_record() -> None:
    checksums = BlockCrc32()
    checksums.update(bytes(4097 << 16))  # one block more than 4096 of 64 KiB
    blocks = checksums.blocks()
    assert (blocks.block_size, len(blocks)) == (1 << 17, 2049)


def test_a_record_keeps_its_block_checksums_through_json(tmp_path: Path) -> None:
    _write_tokens(tmp_path, shards=1)
    raw = (tmp_path / "0000000.shard.json").read_bytes()
    record = ShardRecord.from_json(raw, "0000000.shard.json")
    blocks = record.files["in_band.bin"].blocks
    data = (tmp_path / "0000000.in_band.bin").read_bytes()
    assert blocks is not None and blocks.block_size == 1 << 16
    assert [blocks.crc(k) for k in range(len(blocks))] == [
        zlib.crc32(data[k : k + (1 << 16)]) for k in range(0, len(data), 1 << 16)
    ]
    assert record.to_json() == raw


def test_a_sealed_shard_gets_block_checksums_too(tmp_path: Path) -> None:
    _write_tokens(tmp_path, shards=2)
    written = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.shard.json")}
    for path in tmp_path.glob("*.shard.json"):
        path.unlink()  # as GuideLoom leaves a dataset
    assert StreamStorage(tmp_path, TOKENS).seal() == [0, 1]
    for name, record in written.items():
        sealed = json.loads((tmp_path / name).read_text())
        assert sealed["files"] == record["files"]


# --- servers --------------------------------------------------------------------------------


def _write_tokens(directory: Path, shards: int = 2, seed: int = 0) -> np.ndarray:
    """A stream of ``shards`` shards of random tokens (``seed``); all its tokens."""
    tokens = np.random.default_rng(seed).integers(0, 2**31, shards * PER_SHARD, dtype="<i4")
    with StreamStorage(directory, TOKENS).sync_writer() as writer:
        for shard in range(shards):
            writer.append(shard, {"tokens": tokens[shard * PER_SHARD : (shard + 1) * PER_SHARD]})
    return tokens


def _window(tokens: np.ndarray, sample: int) -> list[int]:
    return tokens[sample * WINDOW : (sample + 1) * WINDOW].tolist()


class Spoiler:
    """A fault proxy's schedule: every request passes until :meth:`spoil` is called, then
    the answers it names are each given one inverted byte."""

    def __init__(self) -> None:
        self.flip: Callable[[int], bool] = lambda n: False

    def __call__(self, n: int) -> str:
        return "flip" if self.flip(n) else "pass"

    def spoil(self, proxy: Any, answers: int | None = None) -> None:
        """Spoil the next ``answers`` answers of ``proxy`` (None: all of them)."""
        first = len(proxy.log)  # the open's requests are over: the next is a data read
        last = float("inf") if answers is None else first + answers
        self.flip = lambda n: first <= n < last


@pytest.fixture(params=["http", "s3"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, int]]:
    """("http", nginx, its port) or ("s3", moto, its port)."""
    if request.param == "http":
        served = request.getfixturevalue("http")
        yield "http", served, served.port
    else:
        served = request.getfixturevalue("s3")
        yield "s3", served, int(served.endpoint.rpartition(":")[2])


def _open(kind: str, served: Any, directory: Path, prefix: str, proxy: Any) -> tuple[str, Any]:
    if kind == "http":
        os.replace(directory, served.root / prefix)
        url = f"{proxy.url}/{prefix}"
        return url, StreamStorage(url, TOKENS, retry=FAST)
    served.filesystem().put(f"{directory}/", f"{BUCKET}/{prefix}/", recursive=True)
    url = f"s3://{BUCKET}/{prefix}"
    return url, StreamStorage(url, TOKENS, retry=FAST, storage_options=served.options(proxy.url))


def _names_shard_url_and_range(error: BaseException, url: str) -> None:
    message = str(error)
    assert f"bytes {BLOCK} of {url}/0000001.in_band.bin (shard 0000001)" in message
    assert f"read for bytes {ASKED}" in message
    assert re.search(r"crc32 0x[0-9a-f]{8}, committed 0x[0-9a-f]{8}", message)


# --- bytes spoiled on the way ---------------------------------------------------------------


def test_a_window_spoiled_on_every_read_is_refused_naming_shard_url_and_range(
    server: tuple[str, Any, int], tmp_path: Path
) -> None:
    kind, served, port = server
    tokens = _write_tokens(tmp_path / "data")
    schedule = Spoiler()
    with fault_proxy(port, schedule) as proxy:
        url, storage = _open(kind, served, tmp_path / "data", f"spoiled-{kind}", proxy)
        with StreamDataset(storage, WINDOW).sync_reader() as reader:
            assert reader[3]["tokens"].tolist() == _window(tokens, 3)
            schedule.spoil(proxy)
            with pytest.raises(CorruptShardError) as caught:
                reader[SAMPLE]
    _names_shard_url_and_range(caught.value, url)
    spoiled = [line for action, line in proxy.log if action == "flip" and "in_band.bin" in line]
    assert len(spoiled) == 2  # read again once, then refused


def test_a_window_spoiled_once_is_read_again_and_returned_exactly(
    server: tuple[str, Any, int], tmp_path: Path
) -> None:
    kind, served, port = server
    tokens = _write_tokens(tmp_path / "data")
    schedule = Spoiler()
    with fault_proxy(port, schedule) as proxy:
        _, storage = _open(kind, served, tmp_path / "data", f"once-{kind}", proxy)
        with StreamDataset(storage, WINDOW).sync_reader() as reader:
            schedule.spoil(proxy, answers=1)
            assert reader[SAMPLE]["tokens"].tolist() == _window(tokens, SAMPLE)
    assert proxy.count("flip") == 1


def test_every_window_of_a_dataset_reads_exactly_through_the_checks(
    server: tuple[str, Any, int], tmp_path: Path
) -> None:
    kind, served, port = server
    tokens = _write_tokens(tmp_path / "data")
    with fault_proxy(port, lambda n: "pass") as proxy:
        _, storage = _open(kind, served, tmp_path / "data", f"exact-{kind}", proxy)
        with StreamDataset(storage, WINDOW).sync_reader() as reader:
            got = np.concatenate([reader[i]["tokens"] for i in range(len(reader))])
    assert got.tolist() == tokens.tolist()


#: a document read reads its offsets (the index file) and its bytes: either is refused
SPOILED_DOCUMENT = (
    r"bytes \d+\.\.\d+ of http://[^ ]+/docs/0000000\.out_of_band\.(index|bin) \(shard"
)


def test_a_document_spoiled_on_the_way_is_refused(http: HttpServer, tmp_path: Path) -> None:
    storage = DocumentStorage(tmp_path / "docs", DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for k in range(200):
            writer.append(0, {"k": k, "text": "x" * 1000})
    os.replace(tmp_path / "docs", http.root / "docs")
    schedule = Spoiler()
    with fault_proxy(http.port, schedule) as proxy:
        remote = DocumentStorage(f"{proxy.url}/docs", DocumentPickleFormat(), retry=FAST)
        with DocumentDataset(remote).sync_reader() as reader:
            assert reader[0]["k"] == 0  # the index file is read (and checked) here
            schedule.spoil(proxy)
            with pytest.raises(CorruptShardError, match=SPOILED_DOCUMENT):
                reader[150]


# --- objects replaced in place, keeping their size ------------------------------------------


def _same_size_other_content(path: Path) -> None:
    """Replace ``path`` by a file of the same size with other bytes and the same
    modification time, as ``rsync -a`` of a rewritten shard would: nginx's ETag (the time
    in seconds and the size) stays the same."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)  # the second half zeroed
    temporary = path.with_name(path.name + ".new")
    temporary.write_bytes(bytes(data))
    os.utime(temporary, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(temporary, path)


def test_a_file_replaced_keeping_size_and_mtime_is_refused_by_the_next_reader(
    http: HttpServer, tmp_path: Path
) -> None:
    _write_tokens(tmp_path / "data")
    os.replace(tmp_path / "data", http.root / "rsynced")
    _same_size_other_content(http.root / "rsynced" / "0000001.in_band.bin")
    url = f"{http.url}/rsynced"
    storage = StreamStorage(url, TOKENS, retry=FAST)
    with (
        StreamDataset(storage, WINDOW).sync_reader() as reader,
        pytest.raises(CorruptShardError) as caught,
    ):
        reader[SAMPLE]
    _names_shard_url_and_range(caught.value, url)


def test_a_file_replaced_keeping_size_and_mtime_under_an_open_reader_is_refused(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(tmp_path / "data")
    os.replace(tmp_path / "data", http.root / "rsynced-open")
    url = f"{http.url}/rsynced-open"
    storage = StreamStorage(url, TOKENS, retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        assert reader[101]["tokens"].tolist() == _window(tokens, 101)  # shard 1 is open
        _same_size_other_content(http.root / "rsynced-open" / "0000001.in_band.bin")
        with pytest.raises(CorruptShardError) as caught:
            reader[SAMPLE]
    _names_shard_url_and_range(caught.value, url)


def test_an_s3_object_replaced_by_one_of_the_same_size_is_refused_by_the_next_reader(
    s3: S3Server, tmp_path: Path
) -> None:
    _write_tokens(tmp_path / "data")
    fs = s3.filesystem()
    fs.put(f"{tmp_path / 'data'}/", f"{BUCKET}/replaced/", recursive=True)
    other = _write_tokens(tmp_path / "other", seed=1)  # same sizes, other tokens
    fs.put_file(
        str(tmp_path / "other" / "0000001.in_band.bin"), f"{BUCKET}/replaced/0000001.in_band.bin"
    )
    url = f"s3://{BUCKET}/replaced"
    storage = StreamStorage(url, TOKENS, retry=FAST, storage_options=s3.options())
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        assert reader[0]["tokens"].tolist() != _window(other, 0)  # shard 0 is the old one
        with pytest.raises(CorruptShardError) as caught:
            reader[SAMPLE]
    _names_shard_url_and_range(caught.value, url)


def test_a_shard_recommitted_and_replaced_keeping_size_and_mtime_under_an_open_reader_is_a_change(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(tmp_path / "data")
    other = _write_tokens(tmp_path / "other", seed=1)  # the same sizes, other tokens
    served = http.root / "recommitted"
    os.replace(tmp_path / "data", served)
    url = f"{http.url}/recommitted"
    storage = StreamStorage(url, TOKENS, retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        assert reader[101]["tokens"].tolist() == _window(tokens, 101)
        # shard 1 copied from a rewrite, its data file keeping size and mtime (nginx's ETag)
        stat = (served / "0000001.in_band.bin").stat()
        for name in ("0000001.in_band.bin", "0000001.shard.json"):
            shutil.copyfile(tmp_path / "other" / name, served / name)
        os.utime(served / "0000001.in_band.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
        with pytest.raises(DatasetChangedError, match="Open the dataset again") as caught:
            reader[SAMPLE]
    _names_shard_url_and_range(caught.value, url)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:  # a new reader: the new shard
        assert reader[SAMPLE]["tokens"].tolist() == _window(other, SAMPLE)


# --- records written before block checksums -------------------------------------------------


def _drop_block_checksums(directory: Path) -> None:
    """Rewrite the records as earlier versions wrote them: no block checksums."""
    for path in directory.glob("*.shard.json"):
        record = json.loads(path.read_text())
        for entry in record["files"].values():
            del entry["block_size"], entry["block_crc32"]
        path.write_text(json.dumps(record, sort_keys=True) + "\n")


def test_records_without_block_checksums_still_read_exactly(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(tmp_path / "data")
    _drop_block_checksums(tmp_path / "data")
    os.replace(tmp_path / "data", http.root / "older")
    storage = StreamStorage(f"{http.url}/older", TOKENS, retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        got = np.concatenate([reader[i]["tokens"] for i in range(len(reader))])
    assert got.tolist() == tokens.tolist()


def test_without_block_checksums_a_read_of_a_whole_file_is_checked_by_its_crc32(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(tmp_path / "data")
    _drop_block_checksums(tmp_path / "data")
    os.replace(tmp_path / "data", http.root / "older-whole")
    schedule = Spoiler()
    with fault_proxy(http.port, schedule) as proxy:
        url = f"{proxy.url}/older-whole"
        with StreamStorage(url, TOKENS, retry=FAST).sync_reader() as reader:
            assert (
                reader.read(PER_SHARD, PER_SHARD)["tokens"].tolist() == tokens[PER_SHARD:].tolist()
            )
            schedule.spoil(proxy)
            with pytest.raises(CorruptShardError) as caught:
                reader.read(PER_SHARD, PER_SHARD)  # all of shard 1: one read of the file
    committed = zlib.crc32(tokens[PER_SHARD:].tobytes())
    assert f"bytes 0..400000 of {url}/0000001.in_band.bin (shard 0000001)" in str(caught.value)
    assert f"committed {committed:#010x}" in str(caught.value)


def test_a_record_with_block_checksums_keeps_the_format_version_earlier_readers_read(
    tmp_path: Path,
) -> None:
    tokens = _write_tokens(tmp_path / "data", shards=1)
    record = json.loads((tmp_path / "data" / "0000000.shard.json").read_text())
    entry = record["files"]["in_band.bin"]
    assert record["guideloom_pipes_record"] == 1  # readers before block checksums read it
    assert entry["crc32"] == zlib.crc32(tokens.tobytes())
    assert len(base64.b64decode(entry["block_crc32"])) == 4 * 7  # 400,000 bytes: 7 blocks
