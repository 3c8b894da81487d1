"""Real servers on loopback for the remote-storage tests: moto's S3 server (a subprocess),
nginx (a subprocess with its own configuration, serving a temporary directory) and a small
TCP fault proxy (threads) that delays, resets or answers 503 on a schedule.

Everything listens on 127.0.0.1 only. A server that cannot start skips its tests, unless
``GUIDELOOM_PIPES_REQUIRE_SERVERS=1`` (CI), where it fails them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

LOOPBACK = "127.0.0.1"
REQUIRE = os.environ.get("GUIDELOOM_PIPES_REQUIRE_SERVERS") == "1"
#: seconds a server may take to start before its tests are skipped (failed under REQUIRE)
START_TIMEOUT = 60


def unavailable(reason: str) -> None:
    """Skip the test, or fail it where servers are required (CI)."""
    if REQUIRE:
        pytest.fail(f"{reason} (GUIDELOOM_PIPES_REQUIRE_SERVERS=1: servers must start)")
    pytest.skip(reason)


def need_modules(*names: str) -> None:
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        unavailable(
            f"needs {', '.join(missing)} (pip install guideloom_pipes[remote] installs them)"
        )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _stop(process: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


# --- moto's S3 server -----------------------------------------------------------------------


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen[Any]

    def options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        """s3fs storage_options for this server (or for a proxy in front of it)."""
        return {
            "endpoint_url": endpoint or self.endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "eu-west-1"},
            "skip_instance_cache": True,
            **extra,
        }

    def environment(self) -> dict[str, str]:
        """The AWS environment variables that name this server and its credentials, as a
        user's shell names a store for a command (``AWS_ENDPOINT_URL``, ...)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "eu-west-1",
        }

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.options())


@contextlib.contextmanager
def moto_server() -> Iterator[S3Server]:
    need_modules("moto", "s3fs", "flask", "werkzeug")
    port = free_port()
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "eu-west-1",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stderr is not None
        lines: queue.Queue[str | None] = queue.Queue()

        def drain() -> None:  # the server logs every request: keep its pipe empty
            assert process.stderr is not None
            for line in process.stderr:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=drain, name="moto-log", daemon=True).start()
        seen = []
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                unavailable(f"moto's S3 server did not start: {''.join(seen)[-2000:]}")
            assert line is not None
            seen.append(line)
            if "Running on" in line:  # printed once the socket listens
                break
        yield S3Server(f"http://{LOOPBACK}:{port}", process)
    finally:
        _stop(process)


# --- nginx ----------------------------------------------------------------------------------


@dataclass
class HttpServer:
    url: str
    root: Path
    process: subprocess.Popen[Any]
    port: int


_NGINX_CONF = """\
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
    keepalive_requests 100000;
    server {{
        listen {host}:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def _unprivileged_user() -> str:
    """nginx's ``user`` line for workers that file modes bind: as root, the ``nobody``
    user (root reads a ``chmod 000`` file; nobody gets 403 for it); otherwise the caller's
    own user, already bound by them."""
    if os.geteuid() != 0:
        return ""
    import grp
    import pwd

    nobody = pwd.getpwnam("nobody")
    return f"user {nobody.pw_name} {grp.getgrgid(nobody.pw_gid).gr_name};\n"


@contextlib.contextmanager
def nginx_server(tmp: Path, *, unprivileged: bool = False) -> Iterator[HttpServer]:
    """nginx serving ``tmp/root`` on a loopback port. Its listening socket is made here and
    handed to nginx (nginx's ``NGINX`` variable for inherited sockets), so connections queue
    from the start: no port race and no wait for it to bind.

    ``unprivileged``: its workers are bound by file modes even where the tests run as root
    (they run as ``nobody``), so a ``chmod 000`` file is answered 403. ``tmp`` must then be
    a directory every user may enter (``tempfile.mkdtemp`` under ``/tmp``, mode 0755).
    """
    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if nginx is None:
        unavailable("nginx is not installed (apt-get install -y nginx)")
    assert nginx is not None
    root = tmp / "root"
    root.mkdir()
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(512)
    # nginx takes an inherited socket as it is: a blocking one leaves a worker that lost
    # the race for a connection blocked in accept(), the connections it holds unanswered
    listener.setblocking(False)
    port = int(listener.getsockname()[1])
    if unprivileged:
        user = _unprivileged_user()
    else:
        user = "user root root;\n" if os.geteuid() == 0 else ""
    conf = tmp / "nginx.conf"
    conf.write_text(_NGINX_CONF.format(user=user, tmp=tmp, host=LOOPBACK, port=port, root=root))
    fd = listener.fileno()
    command = [nginx, "-e", str(tmp / "error.log"), "-p", str(tmp), "-c", str(conf)]
    env = {**os.environ, "NGINX": f"{fd};"}
    check = subprocess.run(
        [*command, "-t"], capture_output=True, text=True, env=env, pass_fds=(fd,), timeout=60
    )
    if check.returncode != 0:
        listener.close()
        unavailable(f"nginx refuses its configuration: {check.stderr[-2000:]}")
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, pass_fds=(fd,)
    )
    listener.close()  # nginx holds it now
    try:
        yield HttpServer(f"http://{LOOPBACK}:{port}", root, process, port)
    finally:
        _stop(process, signal.SIGQUIT)


# --- the fault proxy ------------------------------------------------------------------------

_S3_503 = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
    b"<Message>Please reduce your request rate.</Message></Error>"
)
#: Statuses the proxy answers itself (action = the status), with their reasons.
_REFUSALS = {
    "400": b"Bad Request",
    "401": b"Unauthorized",
    "403": b"Forbidden",
    "404": b"Not Found",
}
#: What the proxy does with one request: "pass", "delay" (then pass), "reset" (the
#: connection is reset, nothing answered), "503" (a 503 SlowDown answer), "truncate" (half
#: the answer, then a reset), "stall" (no answer until the client gives up), "400", "401",
#: "403", "404" (that status answered, nothing forwarded), "ignore-range" (forwarded without its
#: Range header: the whole object answered with 200, as a server that ignores Range does),
#: "flip" (the answer with one byte of its body inverted: data spoiled on the way, or on the
#: server).
ACTIONS = ("pass", "delay", "reset", "503", "truncate", "stall", *_REFUSALS, "ignore-range", "flip")


@dataclass
class FaultProxy:
    """A TCP proxy on loopback in front of an HTTP server, one request per connection.

    ``schedule(n)`` says what to do with the n-th request (0-based): one of
    :data:`ACTIONS`. Each request is forwarded with ``Connection: close``, so every request
    has its own connection and its own fate. At most ``max_connections`` are served at once.
    ``log`` records (action, request line) of every request.
    """

    upstream_port: int
    schedule: Callable[[int], str] = lambda n: "pass"
    delay: float = 0.02
    max_connections: int = 64
    log: list[tuple[str, str]] = field(default_factory=list)
    #: requests (by request line) held until ``parties`` of them are in flight together,
    #: logged "together" (or "alone" if the others never came within 10 s)
    together: Callable[[str], bool] | None = None
    parties: int = 4

    def __post_init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(256)
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._lock = threading.Lock()
        self._count = 0
        self._stopped = threading.Event()
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._barrier = threading.Barrier(self.parties)
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._accepter.start()

    def count(self, action: str) -> int:
        with self._lock:
            return sum(1 for done, _ in self.log if done == action)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._slots.acquire()
            thread = threading.Thread(
                target=self._serve, args=(client,), name="fault-proxy-conn", daemon=True
            )
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        try:
            client.settimeout(30)
            head, body = _read_request(client)
            if head is None:
                return
            with self._lock:
                number = self._count
                self._count += 1
            action = self.schedule(number)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            if self.together is not None and self.together(request_line):
                try:
                    # generous: on a loaded machine the other requests of a concurrent open
                    # can take seconds to arrive; sequential ones never do
                    self._barrier.wait(timeout=30)
                    action = "together"
                except threading.BrokenBarrierError:
                    action = "alone"
                    self._barrier.reset()
            with self._lock:
                self.log.append((action, request_line))
            if action == "reset":
                _reset(client)
                return
            if action == "503":
                client.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(_S3_503) + _S3_503
                )
                return
            if action in _REFUSALS:
                client.sendall(_refusal(action))
                return
            if action == "ignore-range":
                head = _without_header(head, b"range")
            if action == "stall":
                self._stopped.wait(30)  # until the client gives up (it closes) or we stop
                return
            if action == "delay":
                time.sleep(self.delay)  # the fault itself: latency added to this request
            with socket.create_connection((LOOPBACK, self.upstream_port), timeout=30) as up:
                up.sendall(_close_connection(head) + body)
                answer = _read_all(up)
            if action == "flip":
                answer = _flip_body(answer)
            if action == "truncate":
                client.sendall(answer[: max(1, len(answer) // 2)])
                _reset(client)
                return
            client.sendall(answer)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                client.close()
            self._slots.release()

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close() does not)
        self._listener.close()
        self._accepter.join(10)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(10)


def _reset(connection: socket.socket) -> None:
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


def _read_request(client: socket.socket) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = client.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
        if len(data) > 1 << 20:
            return None, b""
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    kept = [head.split(b"\r\n")[0]]
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
        if name.strip().lower() == b"expect" and value.strip().lower() == b"100-continue":
            # the client sends the body only once told to (botocore's uploads); the request
            # is then forwarded whole, without the Expect header
            if not body:
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            continue
        kept.append(line)
    head = b"\r\n".join(kept)
    while len(body) < length:
        chunk = client.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n", body


def _refusal(status: str) -> bytes:
    reason = _REFUSALS[status]
    body = b"%s %s\n" % (status.encode(), reason)
    return (
        b"HTTP/1.1 %s %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n" % (status.encode(), reason, len(body))
    ) + body


def _without_header(head: bytes, name: bytes) -> bytes:
    """The request ``head`` without its ``name`` header (lower case)."""
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    kept = [lines[0]] + [
        line for line in lines[1:] if line.partition(b":")[0].strip().lower() != name
    ]
    return b"\r\n".join([*kept, b"", b""])


def _close_connection(head: bytes) -> bytes:
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    kept = [lines[0]] + [
        line
        for line in lines[1:]
        if line.partition(b":")[0].strip().lower() not in (b"connection", b"keep-alive")
    ]
    return b"\r\n".join([*kept, b"Connection: close", b"", b""])


def _flip_body(answer: bytes) -> bytes:
    """``answer`` with the middle byte of its body inverted (one without a body as it is)."""
    head, separator, body = answer.partition(b"\r\n\r\n")
    if not separator or not body:
        return answer
    spoiled = bytearray(body)
    spoiled[len(spoiled) // 2] ^= 0xFF
    return head + separator + bytes(spoiled)


def _read_all(connection: socket.socket) -> bytes:
    chunks = []
    while chunk := connection.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def fault_proxy(
    upstream_port: int, schedule: Callable[[int], str], **kw: Any
) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream_port, schedule, **kw)
    try:
        yield proxy
    finally:
        proxy.close()
