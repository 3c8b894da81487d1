"""The shard cache of remote datasets and the pinning of the objects a reader opened
(docs/remote.md), against real servers on loopback: nginx over HTTP and moto's S3 server,
with the fault proxy of ``remote_servers.py`` counting (and cutting) requests.

The server tests skip when the ``[remote]`` packages or nginx are missing, except under
``GUIDELOOM_PIPES_REQUIRE_SERVERS=1`` (CI), where a server that does not start fails them.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from remote_servers import (
    LOOPBACK,
    HttpServer,
    S3Server,
    _close_connection,
    _read_request,
    fault_proxy,
    need_modules,
)
from remote_servers import _read_all as _read_all_socket

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
    open_storage,
)
from guideloom_pipes.storage import CorruptShardError, DatasetChangedError
from guideloom_pipes.storage.cache import ShardCache
from guideloom_pipes.storage.remote import RemoteReadError, RetryPolicy

#: These tests run against servers on loopback (nginx, moto, the fault proxy).
pytestmark = pytest.mark.remote

TOKENS = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
#: retries fast enough for tests; a request that hangs is abandoned after 10 s and tried
#: again (here a request on a kept-alive connection to nginx has, rarely, never been answered)
FAST = RetryPolicy(attempts=6, base_delay=0.001, max_delay=0.01, timeout=10)
BUCKET = "cached"
WINDOW = 100


def _write_tokens(directory: Path, shards: int = 3, per_shard: int = 1000, start: int = 0) -> Any:
    with StreamStorage(directory, TOKENS).sync_writer() as writer:
        for shard in range(shards):
            first = start + shard * per_shard
            writer.append(shard, {"tokens": np.arange(first, first + per_shard, dtype="<i4")})
    return np.arange(start, start + shards * per_shard, dtype="<i4")


def _read_all(storage: Any) -> list[int]:
    """Every token, window by window, with a fresh reader."""
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        return np.concatenate([reader[i]["tokens"] for i in range(len(reader))]).tolist()


def _data_gets(proxy: Any, shards: int) -> list[str]:
    """The GETs of the data files of shards ``0..shards-1`` (an HTTP open's probes of the
    ids past the last shard are GETs answered 404)."""
    names = {f"/{shard:07d}.in_band.bin " for shard in range(shards)}
    return [
        line
        for _, line in proxy.log
        if line.startswith("GET") and any(name in line for name in names)
    ]


def _entries(cache_dir: Path) -> list[str]:
    return sorted(name.partition("-")[2] for name in os.listdir(cache_dir / "entries"))


def _replace(path: Path, data: bytes) -> None:
    """Overwrite a served file as an upload does (a new file under the name), with another
    modification time (nginx's ETag is the time in seconds and the size)."""
    stat = path.stat()
    temporary = path.with_name(path.name + ".new")
    temporary.write_bytes(data)
    os.utime(temporary, (stat.st_atime + 10, stat.st_mtime + 10))
    os.replace(temporary, path)


# --- the cache over HTTP --------------------------------------------------------------------


def test_a_cached_shard_is_downloaded_once_and_read_again_without_data_requests(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(http.root / "once", shards=3)
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        storage = StreamStorage(
            f"{proxy.url}/once", TOKENS, cache_dir=tmp_path / "cache", retry=FAST
        )
        assert _read_all(storage) == tokens.tolist()
        first = len(_data_gets(proxy, 3))
        assert _read_all(storage) == tokens.tolist()  # a new reader: the open only
        second = len(_data_gets(proxy, 3)) - first
    assert first == 3  # one whole-file download per shard, however many windows
    assert second == 0
    assert _entries(tmp_path / "cache") == [f"000000{k}.in_band.bin" for k in range(3)]


def test_range_mode_makes_a_request_per_window_where_the_cache_makes_one_per_shard(
    http: HttpServer,
) -> None:
    tokens = _write_tokens(http.root / "ranged", shards=2)
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        storage = StreamStorage(f"{proxy.url}/ranged", TOKENS, retry=FAST)
        assert _read_all(storage) == tokens.tolist()
    assert len(_data_gets(proxy, 2)) == 2000 // WINDOW


def test_a_cached_copy_is_read_memory_mapped(http: HttpServer, tmp_path: Path) -> None:
    tokens = _write_tokens(http.root / "mapped", shards=1)
    storage = StreamStorage(f"{http.url}/mapped", TOKENS, cache_dir=tmp_path / "cache", retry=FAST)
    with storage.sync_reader() as reader:
        reader.read(0, 10)
        array = reader._files[".in_band.bin"].array(0, np.dtype("<i4"))
    assert array is not None and array.tolist() == tokens.tolist()


def test_processes_opening_one_shard_together_download_it_once(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(http.root / "shared", shards=2, per_shard=50_000)
    context = multiprocessing.get_context("spawn")
    parties = 3
    barrier = context.Barrier(parties)
    results = context.Queue()
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        url = f"{proxy.url}/shared"
        workers = [
            context.Process(
                target=_read_in_process, args=(url, str(tmp_path / "cache"), barrier, results)
            )
            for _ in range(parties)
        ]
        for worker in workers:
            worker.start()
        got = [results.get(timeout=120) for _ in workers]
        for worker in workers:
            worker.join(60)
        downloads = _data_gets(proxy, 2)
    assert [worker.exitcode for worker in workers] == [0] * parties
    assert got == [tokens.tolist()] * parties
    assert len(downloads) == 2  # each shard file once, for all processes together


def _read_in_process(url: str, cache_dir: str, barrier: Any, results: Any) -> None:
    storage = StreamStorage(url, TOKENS, cache_dir=cache_dir, retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:  # the open: before the wait
        barrier.wait(60)  # every process asks for the same shards now
        results.put(np.concatenate([reader[i]["tokens"] for i in range(len(reader))]).tolist())


def test_downloads_of_different_shards_run_in_parallel(http: HttpServer, tmp_path: Path) -> None:
    tokens = _write_tokens(http.root / "parallel", shards=2)
    names = ("/0000000.in_band.bin ", "/0000001.in_band.bin ")

    def download(line: str) -> bool:
        return line.startswith("GET") and any(name in line for name in names)

    # a request deadline longer than the proxy's 30 s barrier: a download held there while
    # the other shard's is slow to come (a loaded machine) must not be retried, or the retry
    # meets the held one and the count is off
    patient = RetryPolicy(attempts=6, base_delay=0.001, max_delay=0.01, timeout=60)
    with fault_proxy(http.port, lambda n: "pass", together=download, parties=2) as proxy:
        storage = StreamStorage(
            f"{proxy.url}/parallel", TOKENS, cache_dir=tmp_path / "cache", retry=patient
        )
        with (
            StreamDataset(storage, WINDOW).sync_reader() as reader,
            ThreadPoolExecutor(2) as pool,
        ):
            got = list(pool.map(lambda i: reader[i]["tokens"].tolist(), [0, 10]))
    assert got == [tokens[:100].tolist(), tokens[1000:1100].tolist()]
    # one download waiting for the other would meet nobody at the proxy's barrier: "alone"
    assert proxy.count("together") == 2 and proxy.count("alone") == 0


def test_a_loader_with_process_workers_shares_the_cache_and_reads_what_a_local_one_does(
    http: HttpServer, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from guideloom_pipes import StatefulDataLoader

    _write_tokens(http.root / "loader", shards=4, per_shard=2500)
    batches = []
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        for storage in (
            StreamStorage(http.root / "loader", TOKENS),
            StreamStorage(f"{proxy.url}/loader", TOKENS, cache_dir=tmp_path / "c", retry=FAST),
        ):
            loader = StatefulDataLoader.from_storage(
                storage, sequence_length=64, batch_size=8, shuffle=True, shuffle_seed=3,
                num_workers=2, parallel_method="process", prefetch=2, device="cpu", drop_last=True,
            )  # fmt: skip
            with loader:
                for _ in range(2):  # two epochs
                    batches.append([batch["tokens"].tolist() for batch in loader])
    assert batches[2:] == batches[:2] and len(batches[0]) == 10_000 // 64 // 8
    assert len(_data_gets(proxy, 4)) == 4  # each shard once, for both workers and epochs


def test_the_cache_keeps_its_bound_evicting_the_least_recently_used(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(http.root / "bounded", shards=5)
    file_size = 4000
    cache_dir = tmp_path / "cache"
    storage = StreamStorage(
        f"{http.url}/bounded",
        TOKENS,
        cache_dir=cache_dir,
        cache_limit_bytes=2 * file_size + 100,
        retry=FAST,
    )
    cache = ShardCache(cache_dir, 2 * file_size + 100)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        got = []
        for i in range(len(reader)):
            got += reader[i]["tokens"].tolist()
            assert cache.size() <= 2 * file_size + 100
    assert got == tokens.tolist()  # evicted files stay readable while mapped
    assert _entries(cache_dir) == ["0000003.in_band.bin", "0000004.in_band.bin"]
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        assert reader[30]["tokens"].tolist() == tokens[3000:3100].tolist()  # 3: used now
        assert reader[0]["tokens"].tolist() == tokens[:100].tolist()  # 0: downloaded
    assert _entries(cache_dir) == ["0000000.in_band.bin", "0000003.in_band.bin"]


def test_a_download_whose_checksum_differs_from_the_record_is_refused_and_not_cached(
    http: HttpServer, tmp_path: Path
) -> None:
    _write_tokens(http.root / "corrupt", shards=2)
    data = http.root / "corrupt" / "0000001.in_band.bin"
    damaged = bytearray(data.read_bytes())
    damaged[100] ^= 0xFF  # same size: the open's checks pass, the checksum does not
    _replace(data, bytes(damaged))
    storage = StreamStorage(f"{http.url}/corrupt", TOKENS, cache_dir=tmp_path / "cache", retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        reader[0]
        with pytest.raises(CorruptShardError, match=r"0000001\.in_band\.bin.*crc32"):
            reader[10]
    assert _entries(tmp_path / "cache") == ["0000000.in_band.bin"]
    assert os.listdir(tmp_path / "cache" / "partial") == []


def test_a_download_cut_midway_leaves_nothing_read_as_data(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(http.root / "cut", shards=1, per_shard=100_000)
    cutting = [False]

    def schedule(n: int) -> str:
        return "truncate" if cutting[0] else "pass"

    once = RetryPolicy(attempts=1)
    with fault_proxy(http.port, schedule) as proxy:
        storage = StreamStorage(
            f"{proxy.url}/cut", TOKENS, cache_dir=tmp_path / "cache", retry=once
        )
        reader = StreamDataset(storage, WINDOW).sync_reader()
        reader.open()
        cutting[0] = True  # the open went through; the download is cut
        with pytest.raises(RemoteReadError, match=r"0000000\.in_band\.bin"):
            reader[0]
        assert proxy.count("truncate") == 1
        assert _entries(tmp_path / "cache") == []
        assert os.listdir(tmp_path / "cache" / "partial") == []
        cutting[0] = False
        assert reader[999]["tokens"].tolist() == tokens[99_900:].tolist()
        reader.close()
    assert _entries(tmp_path / "cache") == ["0000000.in_band.bin"]


def test_a_download_killed_midway_is_never_read_and_is_cleaned_up(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(http.root / "killed", shards=1, per_shard=100_000)
    cache_dir = tmp_path / "cache"
    stalled = []

    def schedule(n: int) -> str:
        return "stall" if stalled else "pass"

    with fault_proxy(http.port, schedule) as proxy:
        code = f"""
import numpy as np, sys
from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
    open_storage,
)
fmt = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
storage = StreamStorage({proxy.url + "/killed"!r}, fmt, cache_dir={str(cache_dir)!r})
with StreamDataset(storage, 100).sync_reader() as reader:
    print("open", flush=True)
    sys.stdin.readline()
    reader[0]
"""
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        child = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "open"
            stalled.append(True)  # the download's request never gets an answer
            child.stdin.write("go\n")
            child.stdin.flush()
            while proxy.count("stall") == 0:  # the download has started
                assert child.poll() is None
                time.sleep(0.05)
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait(60)
    assert _entries(cache_dir) == []  # the partial download has no entry's name
    storage = StreamStorage(f"{http.url}/killed", TOKENS, cache_dir=cache_dir, retry=FAST)
    assert _read_all(storage) == tokens.tolist()
    assert os.listdir(cache_dir / "partial") == []  # what the killed one left is gone


def test_a_replaced_shard_gets_a_new_cache_entry_never_the_stale_one(
    http: HttpServer, tmp_path: Path
) -> None:
    _write_tokens(http.root / "replaced", shards=2)
    storage = StreamStorage(
        f"{http.url}/replaced", TOKENS, cache_dir=tmp_path / "cache", retry=FAST
    )
    _read_all(storage)
    newer = tmp_path / "newer"
    tokens = _write_tokens(newer, shards=2, start=50_000)
    files = [p for p in newer.iterdir() if p.is_file()]
    for path in sorted(files, key=lambda p: p.suffix == ".json"):  # records last
        _replace(http.root / "replaced" / path.name, path.read_bytes())
    assert _read_all(storage) == tokens.tolist()
    assert len(_entries(tmp_path / "cache")) == 4  # the old copies are kept until evicted


# --- entries checked when mapped -------------------------------------------------------------


def _damage(entry: Path, how: str) -> None:
    if how == "flip":  # one byte rewritten in place, as an editor or a bad disk would
        with open(entry, "r+b") as file:
            file.seek(100)
            byte = file.read(1)[0]
            file.seek(100)
            file.write(bytes([byte ^ 0xFF]))
    elif how == "truncate":
        os.truncate(entry, 2000)
    else:
        os.truncate(entry, 0)


def _entry(cache_dir: Path, name: str) -> Path:
    (entry,) = [p for p in (cache_dir / "entries").iterdir() if p.name.endswith("-" + name)]
    return entry


@pytest.mark.parametrize("how", ["flip", "truncate", "empty"])
def test_a_damaged_cache_entry_is_deleted_with_a_warning_and_downloaded_again(
    http: HttpServer, tmp_path: Path, how: str
) -> None:
    tokens = _write_tokens(http.root / f"damaged-{how}", shards=3)
    cache_dir = tmp_path / "cache"
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        storage = StreamStorage(
            f"{proxy.url}/damaged-{how}", TOKENS, cache_dir=cache_dir, retry=FAST
        )
        assert _read_all(storage) == tokens.tolist()
        entry = _entry(cache_dir, "0000001.in_band.bin")
        _damage(entry, how)
        with pytest.warns(UserWarning, match=rf"shard cache entry {entry} .* is damaged") as seen:
            assert _read_all(storage) == tokens.tolist()  # the next epoch's reader
        downloads = _data_gets(proxy, 3)
    assert len(seen) == 1 and "downloaded again" in str(seen[0].message)
    assert len(downloads) == 4 and "/0000001.in_band.bin " in downloads[3]
    assert (
        _entry(cache_dir, "0000001.in_band.bin").read_bytes()
        == (http.root / f"damaged-{how}" / "0000001.in_band.bin").read_bytes()
    )


def test_processes_meeting_a_damaged_entry_download_it_again_once(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(http.root / "damaged-shared", shards=2, per_shard=50_000)
    cache_dir = tmp_path / "cache"
    context = multiprocessing.get_context("spawn")
    parties = 3
    barrier = context.Barrier(parties)
    results = context.Queue()
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        url = f"{proxy.url}/damaged-shared"
        _read_all(StreamStorage(url, TOKENS, cache_dir=cache_dir, retry=FAST))
        _damage(_entry(cache_dir, "0000001.in_band.bin"), "flip")
        workers = [
            context.Process(target=_read_in_process, args=(url, str(cache_dir), barrier, results))
            for _ in range(parties)
        ]
        for worker in workers:
            worker.start()
        got = [results.get(timeout=120) for _ in workers]
        for worker in workers:
            worker.join(60)
        downloads = _data_gets(proxy, 2)
    assert [worker.exitcode for worker in workers] == [0] * parties
    assert got == [tokens.tolist()] * parties
    assert len(downloads) == 3 and "/0000001.in_band.bin " in downloads[2]  # 2: the fill


def test_a_byte_changed_with_its_modification_time_put_back_is_found(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(http.root / "sneaky", shards=2)
    cache_dir = tmp_path / "cache"
    storage = StreamStorage(f"{http.url}/sneaky", TOKENS, cache_dir=cache_dir, retry=FAST)
    _read_all(storage)
    entry = _entry(cache_dir, "0000000.in_band.bin")
    before = entry.stat()
    _damage(entry, "flip")
    os.utime(entry, ns=(before.st_atime_ns, before.st_mtime_ns))  # as rsync -a or touch -r
    assert entry.stat().st_size == before.st_size  # only the change time tells
    with pytest.warns(UserWarning, match="is damaged: its crc32 is"):
        assert _read_all(storage) == tokens.tolist()


def test_an_entry_is_checksummed_once_then_mapped_on_its_marker(
    http: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zlib

    from guideloom_pipes.storage import cache as cache_module

    tokens = _write_tokens(http.root / "marked", shards=2)
    cache_dir = tmp_path / "cache"
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        storage = StreamStorage(f"{proxy.url}/marked", TOKENS, cache_dir=cache_dir, retry=FAST)
        _read_all(storage)
        for marker in (cache_dir / "verified").iterdir():
            marker.unlink()  # as a cache written before markers, or a marker lost
        summed: list[int] = []
        original = zlib.crc32

        def crc32(data: Any, value: int = 0) -> int:
            summed.append(len(data))
            return original(data, value)

        monkeypatch.setattr(cache_module.zlib, "crc32", crc32)
        assert _read_all(storage) == tokens.tolist()  # checked whole, not downloaded
        assert summed == [4000, 4000] and len(_data_gets(proxy, 2)) == 2
        assert len(os.listdir(cache_dir / "verified")) == 2
        assert _read_all(storage) == tokens.tolist()  # unchanged since: the marker only
        assert summed == [4000, 4000] and len(_data_gets(proxy, 2)) == 2


def test_s3_bytes_failing_the_stores_checksum_in_cache_mode_name_the_shard(
    s3: S3Server, tmp_path: Path
) -> None:
    _write_tokens(tmp_path / "data", shards=2)
    s3.filesystem().put(f"{tmp_path / 'data'}/", f"{BUCKET}/flipped/", recursive=True)
    port = int(s3.endpoint.rpartition(":")[2])

    def flip(line: str) -> bool:
        return line.startswith("GET") and "/0000001.in_band.bin" in line

    url = f"s3://{BUCKET}/flipped"
    with _flipping_proxy(port, flip) as (proxy_url, flipped):
        storage = StreamStorage(
            url, TOKENS, storage_options=s3.options(proxy_url), cache_dir=tmp_path / "c", retry=FAST
        )
        with StreamDataset(storage, WINDOW).sync_reader() as reader:
            assert reader[0]["tokens"].tolist() == list(range(100))
            with pytest.raises(CorruptShardError, match=rf"{url}/0000001\.in_band\.bin") as caught:
                reader[10]
    assert flipped  # the proxy did alter the download
    assert _entries(tmp_path / "c") == ["0000000.in_band.bin"]
    import botocore

    if tuple(int(part) for part in botocore.__version__.split(".")[:2]) < (1, 36):
        return  # botocore checks no response checksum: the record's CRC-32 caught it
    message = str(caught.value)
    assert f"{url}/0000001.in_band.bin (shard 0000001): bytes 0..4000 as received" in message
    assert "checksum the store keeps" in message and "FlexibleChecksumError" in message


@contextlib.contextmanager
def _flipping_proxy(
    upstream_port: int, flip: Callable[[str], bool]
) -> Iterator[tuple[str, list[str]]]:
    """A proxy on loopback that flips the last byte of the answers to the requests
    ``flip(request_line)`` picks; yields its URL and the request lines it altered."""
    listener = socket.create_server((LOOPBACK, 0))
    flipped: list[str] = []

    def serve(client: socket.socket) -> None:
        with client:
            head, body = _read_request(client)
            if head is None:
                return
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            with socket.create_connection((LOOPBACK, upstream_port), timeout=30) as up:
                up.sendall(_close_connection(head) + body)
                answer = bytearray(_read_all_socket(up))
            if flip(line) and not answer.endswith(b"\r\n\r\n"):  # a body to alter
                answer[-1] ^= 0x01
                flipped.append(line)
            client.sendall(answer)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(client,), daemon=True).start()

    accepter = threading.Thread(target=accept, daemon=True)
    accepter.start()
    try:
        yield f"http://{LOOPBACK}:{listener.getsockname()[1]}", flipped
    finally:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        accepter.join(10)


# --- a cache that cannot be written ---------------------------------------------------------

_CHILD = """
import ctypes, json, os, resource, signal, sys
url, cache_dir, file_limit, drop = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if drop == "1":
    # root: drop the capabilities that override permission bits (CAP_DAC_OVERRIDE,
    # CAP_DAC_READ_SEARCH) from the bounding set, then exec: the new image lacks them
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            sys.exit(f"cannot drop capability {capability}: {os.strerror(ctypes.get_errno())}")
    os.execv(sys.executable, [sys.executable, "-c", os.environ["CHILD"], *sys.argv[1:4], "dropped"])
with open("/proc/self/status") as status:
    effective = next(int(l.split()[1], 16) for l in status if l.startswith("CapEff"))
if drop == "dropped" and effective & 0b110:
    sys.exit(f"still overrides permission bits (CapEff {effective:#x})")
if file_limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, resource.RLIM_INFINITY))
import numpy as np
from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage
from guideloom_pipes.storage.remote import RetryPolicy
fmt = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
storage = StreamStorage(url, fmt, cache_dir=cache_dir, retry=RetryPolicy(attempts=1))
try:
    with StreamDataset(storage, 100).sync_reader() as reader:
        print(json.dumps({"tokens": reader[0]["tokens"].tolist()}))
except OSError as error:
    print(json.dumps({"type": type(error).__name__, "errno": error.errno, "text": str(error)}))
"""


def _read_in_child(url: str, cache_dir: Path, file_limit: int = 0, read_only: bool = False) -> Any:
    """Window 0 of ``url`` read through the cache in a new process (with a file size
    limit; or held to permission bits, also as root): its tokens, or its ``OSError``."""
    import json

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.update(CHILD=_CHILD, PYTHONDONTWRITEBYTECODE="1")
    drop = "1" if read_only and os.geteuid() == 0 else "0"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, url, str(cache_dir), str(file_limit), drop],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_full_disk_under_the_cache_names_the_path_and_the_fix(
    http: HttpServer, tmp_path: Path
) -> None:
    # a file size limit (ulimit -f) fails the download's writes as a full disk does
    # (EFBIG for ENOSPC), on any machine and without root
    _write_tokens(http.root / "full", shards=1, per_shard=10_000)
    cache_dir = tmp_path / "cache"
    got = _read_in_child(f"{http.url}/full", cache_dir, file_limit=16_000)
    assert got["errno"] == errno.EFBIG, got
    assert got["type"] == "OSError"
    assert f"the shard cache could not write the 40000 bytes of {http.url}/full/" in got["text"]
    assert str(cache_dir / "partial") in got["text"]
    assert "is full" in got["text"] and "cache_limit_bytes=" in got["text"]
    assert os.listdir(cache_dir / "partial") == [] and _entries(cache_dir) == []


def test_a_read_only_cache_names_the_path_and_still_serves_what_it_holds(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(http.root / "ro-held", shards=1)
    _write_tokens(http.root / "ro-new", shards=1)
    cache_dir = tmp_path / "cache"
    _read_all(StreamStorage(f"{http.url}/ro-held", TOKENS, cache_dir=cache_dir, retry=FAST))
    directories = [cache_dir, *(path for path in cache_dir.rglob("*") if path.is_dir())]
    for path in directories:  # (a chmod of an entry would change it: checked whole again)
        path.chmod(0o555)
    try:
        held = _read_in_child(f"{http.url}/ro-held", cache_dir, read_only=True)
        assert held == {"tokens": tokens[:100].tolist()}
        new = _read_in_child(f"{http.url}/ro-new", cache_dir, read_only=True)
    finally:
        for path in directories:
            path.chmod(0o755)
    assert new["type"] == "PermissionError" and new["errno"] == errno.EACCES, new
    assert f"the shard cache could not open the lock file {cache_dir}/locks/" in new["text"]
    assert "is read-only for this process" in new["text"]


# --- the cache over S3 ----------------------------------------------------------------------


def test_an_s3_shard_is_cached_once(s3: S3Server, tmp_path: Path) -> None:
    tokens = _write_tokens(tmp_path / "data", shards=2)
    s3.filesystem().put(f"{tmp_path / 'data'}/", f"{BUCKET}/once/", recursive=True)
    port = int(s3.endpoint.rpartition(":")[2])
    with fault_proxy(port, lambda n: "pass") as proxy:
        storage = StreamStorage(
            f"s3://{BUCKET}/once",
            TOKENS,
            storage_options=s3.options(proxy.url),
            cache_dir=tmp_path / "cache",
            retry=FAST,
        )
        assert _read_all(storage) == tokens.tolist()
        assert _read_all(storage) == tokens.tolist()
    assert len(_data_gets(proxy, 2)) == 2


# --- pinning --------------------------------------------------------------------------------


def test_an_http_object_replaced_under_an_open_reader_is_refused(http: HttpServer) -> None:
    _write_tokens(http.root / "pinned", shards=2)
    url = f"{http.url}/pinned"
    storage = StreamStorage(url, TOKENS, retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        reader[0]  # shard 0 read; shard 1 only listed
        for shard in (0, 1):
            path = http.root / "pinned" / f"000000{shard}.in_band.bin"
            _replace(path, bytes(reversed(path.read_bytes())))
        with pytest.raises(DatasetChangedError, match="Open the dataset again") as caught:
            reader[1]
        assert f"{url}/0000000.in_band.bin" in str(caught.value)
        with pytest.raises(DatasetChangedError, match=rf"{url}/0000001\.in_band\.bin"):
            reader[10]


def test_a_reader_opened_after_a_replacement_reads_the_new_version(
    http: HttpServer, tmp_path: Path
) -> None:
    _write_tokens(http.root / "renewed", shards=1)
    storage = StreamStorage(f"{http.url}/renewed", TOKENS, retry=FAST)
    _read_all(storage)
    tokens = _write_tokens(tmp_path / "newer", shards=1, start=7)
    for name in ("0000000.in_band.bin", "0000000.shard.json"):
        _replace(http.root / "renewed" / name, (tmp_path / "newer" / name).read_bytes())
    assert _read_all(storage) == tokens.tolist()


def test_an_s3_object_replaced_under_an_open_reader_is_refused(
    s3: S3Server, tmp_path: Path
) -> None:
    _write_tokens(tmp_path / "data", shards=2)
    fs = s3.filesystem()
    fs.put(f"{tmp_path / 'data'}/", f"{BUCKET}/pinned/", recursive=True)
    url = f"s3://{BUCKET}/pinned"
    storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        reader[0]
        data = (tmp_path / "data" / "0000001.in_band.bin").read_bytes()
        fs.pipe(f"{BUCKET}/pinned/0000001.in_band.bin", bytes(reversed(data)))
        with pytest.raises(DatasetChangedError, match=rf"{url}/0000001\.in_band\.bin"):
            reader[10]
        assert reader[1]["tokens"].tolist() == list(range(100, 200))  # shard 0 unchanged


def test_a_weak_etag_is_checked_when_a_reader_opens_not_sent_as_if_match(http: HttpServer) -> None:
    from guideloom_pipes.storage.records import ExpectedFile

    tokens = _write_tokens(http.root / "weak", shards=1)
    storage = StreamStorage(f"{http.url}/weak", TOKENS, retry=FAST)
    url = storage.dir / "0000000.in_band.bin"
    strong = storage.backend.sync_reader()(url)
    strong.open()
    weak = f"W/{strong.etag}"  # as a server that compresses on the fly would tag it
    with pytest.raises(DatasetChangedError, match="changed after this reader opened"):
        storage.backend.shard_reader(url, ExpectedFile(4000, None, weak)).open()
    same = storage.backend.shard_reader(url, ExpectedFile(4000, None, strong.etag))
    same.open()
    assert np.frombuffer(same.read(40, 8), "<i4").tolist() == tokens[10:12].tolist()


def test_a_shard_replaced_before_its_download_is_refused_and_not_cached(
    http: HttpServer, tmp_path: Path
) -> None:
    _write_tokens(http.root / "pinned-cache", shards=2)
    storage = StreamStorage(
        f"{http.url}/pinned-cache", TOKENS, cache_dir=tmp_path / "cache", retry=FAST
    )
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        path = http.root / "pinned-cache" / "0000001.in_band.bin"
        _replace(path, bytes(reversed(path.read_bytes())))
        with pytest.raises(DatasetChangedError, match=r"0000001\.in_band\.bin"):
            reader[10]
    assert _entries(tmp_path / "cache") == []


# --- open_storage with a URL ----------------------------------------------------------------


def test_open_storage_opens_an_http_dataset_from_its_records(
    http: HttpServer, tmp_path: Path
) -> None:
    tokens = _write_tokens(http.root / "opened", shards=3)
    storage = open_storage(f"{http.url}/opened", retry=FAST, cache_dir=tmp_path / "cache")
    assert type(storage) is StreamStorage and storage.format.stream_dtype == TOKENS.stream_dtype
    assert storage.backend.retry == FAST
    assert _read_all(storage) == tokens.tolist()
    assert len(_entries(tmp_path / "cache")) == 3


def test_open_storage_opens_an_s3_dataset_with_its_options(s3: S3Server, tmp_path: Path) -> None:
    with DocumentStorage(tmp_path / "docs", DocumentPickleFormat()).sync_writer() as writer:
        for shard in range(2):
            for i in range(5):
                writer.append(shard, {"id": shard * 5 + i})
    s3.filesystem().put(f"{tmp_path / 'docs'}/", f"{BUCKET}/docs/", recursive=True)
    storage = open_storage(f"s3://{BUCKET}/docs", storage_options=s3.options())
    assert type(storage) is DocumentStorage and isinstance(storage.format, DocumentPickleFormat)
    with DocumentDataset(storage).sync_reader() as reader:
        assert [reader[i]["id"] for i in range(len(reader))] == list(range(10))


def test_open_storage_of_a_url_with_no_dataset_is_not_found(http: HttpServer, s3: S3Server) -> None:
    with pytest.raises(FileNotFoundError, match="is not a dataset"):
        open_storage(f"{http.url}/nothing-here", retry=FAST)
    with pytest.raises(FileNotFoundError, match="is not a dataset"):
        open_storage(f"s3://{BUCKET}/nothing-here", storage_options=s3.options())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, "-m", "guideloom_pipes", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_the_cli_verifies_and_shows_a_dataset_at_a_url(http: HttpServer) -> None:
    tokens = _write_tokens(http.root / "cli", shards=3)
    url = f"{http.url}/cli"
    head = _cli("head", url, "-n", "2")
    assert head.returncode == 0, head.stderr
    assert head.stdout.splitlines()[1].split("\t")[1] == "tokens=" + str(
        tokens[16:32].tolist()
    ).replace(" ", "")
    assert _cli("verify", url).returncode == 0
    data = http.root / "cli" / "0000002.in_band.bin"
    damaged = bytearray(data.read_bytes())
    damaged[8] ^= 1
    _replace(data, bytes(damaged))
    verify = _cli("verify", url)
    assert verify.returncode == 1 and "0000002.in_band.bin fails its checksum" in verify.stdout
    info = _cli("info", url)
    assert info.returncode == 2 and "run verify or head on it" in info.stderr


# --- arguments ------------------------------------------------------------------------------


def test_a_cache_limit_without_a_cache_dir_is_refused() -> None:
    with pytest.raises(ValueError, match="pass cache_dir="):
        StreamStorage("http://127.0.0.1:1/data", TOKENS, cache_limit_bytes=10**9)


@pytest.mark.parametrize("limit", [0, -5, 1.5, True])
def test_a_cache_limit_that_is_not_positive_bytes_is_refused(limit: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_limit_bytes must be a number of bytes > 0"):
        StreamStorage(
            "http://127.0.0.1:1/data", TOKENS, cache_dir=tmp_path, cache_limit_bytes=limit
        )


def test_a_cache_dir_that_is_a_url_is_refused() -> None:
    with pytest.raises(ValueError, match="the shard cache is a local directory"):
        StreamStorage("http://127.0.0.1:1/data", TOKENS, cache_dir="s3://bucket/cache")


def test_a_cached_storage_pickles_with_its_cache(tmp_path: Path) -> None:
    import pickle

    need_modules("fsspec", "aiohttp")
    storage = StreamStorage(
        "http://127.0.0.1:1/data", TOKENS, cache_dir=tmp_path, cache_limit_bytes=1000
    )
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.backend.cache.directory == tmp_path and copy.backend.cache.limit_bytes == 1000


def test_a_local_location_ignores_the_cache(tmp_path: Path) -> None:
    tokens = _write_tokens(tmp_path / "data", shards=1)
    storage = StreamStorage(tmp_path / "data", TOKENS, cache_dir=tmp_path / "cache")
    assert _read_all(storage) == tokens.tolist()
    assert not (tmp_path / "cache").exists()
