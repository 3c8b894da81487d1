"""The remote scenarios. remote-cache: the bench's token stream served over HTTP by nginx
on loopback, read through the shard cache and in byte ranges, against the same stream read
from its local directory. remote-range: byte ranges through a proxy that adds 20 ms to
every request (1 thread worker against 32), and a cold first batch. remote-s3: byte ranges
from moto's S3 server, with the CPU each request costs.

The cache is filled by a first pass (every shard downloaded whole, timed on its own); the
rows then measure the second and later epochs, which read the memory-mapped copies. nginx
must be installed (``apt-get install nginx``) and the ``[remote]`` extra too; without them
the scenario records why it did not run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from guideloom_pipes.bench.contenders import _ours_contender
from guideloom_pipes.bench.data import TOKENS_DTYPE, _count_tokens, collate_tokens
from guideloom_pipes.bench.harness import Row, Sizes, measure
from guideloom_pipes.formats import StreamNumpyFormat
from guideloom_pipes.storage import StreamStorage

#: the rows of the scenario (the first is the baseline)
LOCAL = "local directory, workers=2"
CACHED = "shard cache (HTTP), second epoch, workers=2"
RANGE = "range reads (HTTP), workers=8 threads"

_CONF = """\
{user}daemon off;
master_process on;
worker_processes 2;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


class Unavailable(RuntimeError):
    """What the scenario needs is not installed here (nginx, fsspec, aiohttp)."""


@contextlib.contextmanager
def nginx(root: Path, workdir: Path) -> Iterator[str]:
    """nginx serving ``root`` on a loopback port; yields its URL. The listening socket is
    made here and inherited by nginx (its ``NGINX`` variable), so there is no port race."""
    binary = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if binary is None:
        raise Unavailable("nginx is not installed (apt-get install nginx)")
    workdir.mkdir(parents=True, exist_ok=True)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    # nginx takes an inherited socket as it is: a blocking one left a worker that lost the
    # race for a connection blocked in accept(), its own accepted connections unanswered
    # until the next one came (a 60 s stall, 1 cold start in 13 here)
    listener.setblocking(False)
    port = int(listener.getsockname()[1])
    user = "user root root;\n" if os.geteuid() == 0 else ""
    conf = workdir / "nginx.conf"
    conf.write_text(_CONF.format(user=user, tmp=workdir, port=port, root=root))
    fd = listener.fileno()
    command = [binary, "-e", str(workdir / "error.log"), "-p", str(workdir), "-c", str(conf)]
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "NGINX": f"{fd};"},
        pass_fds=(fd,),
    )
    listener.close()  # nginx holds it now
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGQUIT)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _fill(storage: StreamStorage) -> int:
    """Touch every shard once (each downloaded into the cache); the bytes cached."""
    with storage.sync_reader() as reader:
        for shard in range(reader.num_shards):
            if reader.length(shard):
                reader.read(int(reader.shard_starts[shard]), 1)
    cache = storage.backend.cache
    return int(cache.size())


def remote_cache_rows(
    local: StreamStorage,
    root: Path,
    sizes: Sizes,
    log: Callable[[str], None],
    extra: dict[str, Any],
) -> list[Row]:
    """The rows (local directory, shard cache's second epoch, range reads) over the stream
    ``local``, served from ``local.dir``'s parent; figures of the first pass in
    ``extra["remote-cache"]``. No rows (and the reason in ``extra``) where nginx or the
    ``[remote]`` extra is missing."""
    try:
        import aiohttp  # noqa: F401
        import fsspec  # noqa: F401
    except ImportError as error:
        extra["remote-cache"] = {"skipped": f"needs the [remote] extra: {error}"}
        log(f"  remote-cache  skipped: {extra['remote-cache']['skipped']}")
        return []
    directory = Path(os.fspath(local.dir))
    try:
        server = nginx(directory.parent, root / "nginx")
        url = server.__enter__()
    except Unavailable as error:
        extra["remote-cache"] = {"skipped": str(error)}
        log(f"  remote-cache  skipped: {error}")
        return []
    try:
        cached = StreamStorage(
            f"{url}/{directory.name}",
            StreamNumpyFormat(TOKENS_DTYPE),
            cache_dir=root / "shard-cache",
        )
        started = time.perf_counter()
        cached_bytes = _fill(cached)
        filled = time.perf_counter() - started
        extra["remote-cache"] = {
            "first_pass_s": filled,
            "cached_bytes": cached_bytes,
            "download_mb_per_s": cached_bytes / filled / 1e6 if filled > 0 else 0.0,
        }
        log(
            f"  remote-cache  first pass {filled:.2f} s for {cached_bytes / 1e6:.0f} MB "
            f"({extra['remote-cache']['download_mb_per_s']:.0f} MB/s into the cache)"
        )
        length, batch = 2048, 8
        stream = {
            "sequence_length": length,
            "local_batch_size": batch,
            "num_workers": 2,
            "parallel_method": "thread",
            "prefetch": 4,
        }
        count = _count_tokens(length)
        contenders = [
            _ours_contender(LOCAL, local, collate_tokens, count, **stream),
            _ours_contender(CACHED, cached, collate_tokens, count, **stream),
            _ours_contender(
                RANGE,
                StreamStorage(f"{url}/{directory.name}", StreamNumpyFormat(TOKENS_DTYPE)),
                collate_tokens,
                count,
                **{**stream, "num_workers": 8, "prefetch": 8},
            ),
        ]
        return measure("remote-cache", contenders, sizes, log)
    finally:
        server.__exit__(None, None, None)


# --- range reads over a slow link, and over S3 -------------------------------------------------

#: the rows of the remote-range scenario (the first of each pair is its baseline)
RANGE_1 = "range reads (HTTP, +20 ms a request), 1 thread worker"
RANGE_32 = "range reads (HTTP, +20 ms a request), 32 thread workers"
S3_1 = "range reads (S3 on moto), 1 thread worker"
S3_8 = "range reads (S3 on moto), 8 thread workers"
#: latency the proxy adds to every request (a request to an object store in another zone)
LATENCY_S = 0.02


class LatencyProxy:
    """A TCP proxy on loopback in front of an HTTP server that holds each request for
    ``delay`` seconds before forwarding it: one request per connection (it forwards with
    ``Connection: close``), a thread per connection."""

    def __init__(self, upstream_port: int, delay: float) -> None:
        import threading

        self.upstream_port = upstream_port
        self.delay = delay
        self.requests = 0
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(1024)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, name="latency-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import threading

        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            client.settimeout(60)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(65536)
                if not chunk:
                    return
                head += chunk
            lines = head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
            kept = [line for line in lines if not line.lower().startswith(b"connection:")]
            request = b"\r\n".join([*kept, b"Connection: close", b"", b""])
            with self._lock:
                self.requests += 1
            time.sleep(self.delay)
            with socket.create_connection(("127.0.0.1", self.upstream_port), timeout=60) as up:
                up.sendall(request)
                while chunk := up.recv(1 << 20):
                    client.sendall(chunk)
        except OSError:
            pass
        finally:
            client.close()

    def close(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(10)


@contextlib.contextmanager
def moto_s3(workdir: Path) -> Iterator[tuple[str, int]]:
    """moto's standalone S3 server on a loopback port; yields its endpoint and process id."""
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as error:
        raise Unavailable(f"needs moto[server] and s3fs: {error}") from None
    workdir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    log = (workdir / "moto.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise Unavailable(f"moto's server did not start (see {workdir / 'moto.log'})")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


def _process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cold_first_batch(url: str, length: int, batch: int) -> float:
    """Seconds from nothing (no storage, no open dataset) to the first batch of a shuffled
    loader over the dataset at ``url``, in range mode."""
    from guideloom_pipes.loader import StatefulDataLoader

    started = time.perf_counter()
    storage = StreamStorage(url, StreamNumpyFormat(TOKENS_DTYPE))
    loader = StatefulDataLoader.from_storage(
        storage, collate_tokens, sequence_length=length, local_batch_size=batch,
        shuffle=True, shuffle_seed=1, num_workers=8, prefetch=8, device="cpu",
    )  # fmt: skip
    with loader:
        next(iter(loader))
    return time.perf_counter() - started


def remote_range_rows(
    root: Path,
    sizes: Sizes,
    log: Callable[[str], None],
    extra: dict[str, Any],
    cold_bytes: int,
) -> list[Row]:
    """Range reads through a proxy that adds 20 ms to every request, with 1 thread worker
    and with 32; the cold first batch of a ``cold_bytes`` dataset through it (figures and
    reasons for what did not run in ``extra["remote-range"]``)."""
    from guideloom_pipes.bench.data import build_tokens

    figures: dict[str, Any] = {"latency_s": LATENCY_S}
    extra["remote-range"] = figures
    try:
        import aiohttp  # noqa: F401
        import fsspec  # noqa: F401
    except ImportError as error:
        figures["skipped"] = f"needs the [remote] extra: {error}"
        log(f"  remote-range  skipped: {figures['skipped']}")
        return []
    tokens = cold_bytes // TOKENS_DTYPE.itemsize
    local = build_tokens(root / "remote-range" / "tokens", tokens, 8)
    directory = Path(os.fspath(local.dir))
    length, batch = 2048, 8
    count = _count_tokens(length)
    rows: list[Row] = []
    try:
        server = nginx(directory.parent, root / "nginx-range")
        url = server.__enter__()
    except Unavailable as error:
        figures["skipped"] = str(error)
        log(f"  remote-range  skipped: {error}")
        return []
    try:
        port = int(url.rpartition(":")[2])
        proxy = LatencyProxy(port, LATENCY_S)
        try:
            slow = f"{proxy.url}/{directory.name}"
            figures["cold_first_batch_s"] = _cold_first_batch(slow, length, batch)
            figures["cold_dataset_bytes"] = tokens * TOKENS_DTYPE.itemsize
            log(
                f"  remote-range  cold first batch of a {cold_bytes / 2**30:.2f} GiB dataset "
                f"through +{LATENCY_S * 1000:.0f} ms: {figures['cold_first_batch_s']:.2f} s"
            )
            stream = {"sequence_length": length, "local_batch_size": batch}
            contenders = [
                _ours_contender(
                    name,
                    StreamStorage(slow, StreamNumpyFormat(TOKENS_DTYPE)),
                    collate_tokens,
                    count,
                    num_workers=workers,
                    prefetch=workers,
                    **stream,
                )
                for name, workers in ((RANGE_1, 1), (RANGE_32, 32))
            ]
            rows += measure("remote-range", contenders, sizes, log)
        finally:
            proxy.close()
    finally:
        server.__exit__(None, None, None)
    return rows


def remote_s3_rows(
    root: Path,
    sizes: Sizes,
    log: Callable[[str], None],
    extra: dict[str, Any],
    data_bytes: int,
) -> list[Row]:
    """Range reads from moto's S3 server (a token stream of ``data_bytes`` in 4 shards
    uploaded there), 1 thread worker against 8, with the CPU each request costs: ours in
    the rows, the server's in ``extra["remote-s3"]``. No target: on 2 CPUs the server signs
    and serves every request beside the reader."""
    from guideloom_pipes.bench.data import build_tokens

    figures: dict[str, Any] = {}
    extra["remote-s3"] = figures
    try:
        server = moto_s3(root / "moto")
        endpoint, pid = server.__enter__()
    except Unavailable as error:
        figures["skipped"] = str(error)
        log(f"  remote-s3  skipped: {error}")
        return []
    length, batch = 2048, 8
    local = build_tokens(root / "remote-s3" / "tokens", data_bytes // TOKENS_DTYPE.itemsize, 4)
    try:
        import s3fs

        options = {
            "endpoint_url": endpoint,
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"region_name": "eu-west-1"},
        }
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("bench")
        directory = Path(os.fspath(local.dir))
        for name in sorted(os.listdir(directory)):
            fs.put_file(str(directory / name), f"bench/tokens/{name}")
        count = _count_tokens(length)
        stream = {"sequence_length": length, "local_batch_size": batch}
        contenders = [
            _ours_contender(
                name,
                StreamStorage(
                    "s3://bench/tokens", StreamNumpyFormat(TOKENS_DTYPE), storage_options=options
                ),
                collate_tokens,
                count,
                num_workers=workers,
                prefetch=workers,
                **stream,
            )
            for name, workers in ((S3_1, 1), (S3_8, 8))
        ]
        server_cpu = _process_cpu_s(pid)
        rows = measure("remote-s3", contenders, sizes, log)
        server_cpu = _process_cpu_s(pid) - server_cpu
        served = sum(row.samples_per_s for row in rows)  # rough: requests are samples
        figures["server_cpu_s"] = server_cpu
        for row in rows:
            # one ranged request per window: CPU per request is CPU per sample
            figures[f"{row.contender}: our CPU ms per request"] = row.cpu_s_per_1m_samples / 1e3
        log(f"  remote-s3  moto's server used {server_cpu:.1f} CPU-s over the rounds")
        figures["note"] = (
            "a request per window; the server's CPU is moto's over every round "
            f"({served:.0f} samples/s summed over the rows)"
        )
        return rows
    finally:
        server.__exit__(None, None, None)
