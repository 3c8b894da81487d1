"""The remote-cache scenario: the bench's token stream served over HTTP by nginx on
loopback, read through the shard cache and in byte ranges, against the same stream read
from its local directory.

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
