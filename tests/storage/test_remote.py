"""Datasets at a URL (docs/remote.md): byte-range reads through fsspec from real servers on
loopback (moto's S3 server through s3fs, nginx over HTTP), the same checks as a local open,
and retries of transient failures injected by a fault proxy.

The server tests skip when the ``[remote]`` packages or nginx are missing, except under
``GUIDELOOM_PIPES_REQUIRE_SERVERS=1`` (CI), where a server that does not start fails them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pytest
from remote_servers import (
    HttpServer,
    S3Server,
    fault_proxy,
    moto_server,
    need_modules,
    nginx_server,
)
from storage_formats import ChunkMetaFormat

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
    StreamWithMetaStorage,
    write_parallel,
)
from guideloom_pipes.io import MmapIO, SeekIO
from guideloom_pipes.storage import CorruptShardError, StorageError, UncommittedShardError
from guideloom_pipes.storage.remote import (
    RemotePath,
    RemoteReadError,
    RetryPolicy,
    is_transient,
)

#: These tests run against servers on loopback (nginx, moto, the fault proxy).
pytestmark = pytest.mark.remote

FIXTURES = Path(__file__).parents[1] / "data" / "guideloom-1.1"
EXPECTED: dict[str, Any] = json.loads((FIXTURES / "expected.json").read_text())
STREAM_DTYPE = np.dtype([tuple(field) for field in EXPECTED["stream"]["dtype"]])
TOKENS = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
#: retries fast enough for tests (the default waits 0.2 s, 0.4 s, ...)
# (a 10 s request deadline: a rare request to nginx that is never answered costs a retry)
FAST = RetryPolicy(attempts=6, base_delay=0.001, max_delay=0.01, timeout=10)
BUCKET = "guideloom"


def _storages(location: str, **kw: Any) -> dict[str, Any]:
    return {
        "stream": StreamStorage(f"{location}/stream", StreamNumpyFormat(STREAM_DTYPE), **kw),
        "document": DocumentStorage(f"{location}/document", DocumentPickleFormat(), **kw),
        "stream_meta": StreamWithMetaStorage(f"{location}/stream_meta", ChunkMetaFormat(), **kw),
    }


def _local_storages() -> dict[str, Any]:
    return {
        "stream": StreamStorage(FIXTURES / "stream", StreamNumpyFormat(STREAM_DTYPE)),
        "document": DocumentStorage(FIXTURES / "document", DocumentPickleFormat()),
        "stream_meta": StreamWithMetaStorage(FIXTURES / "stream_meta", ChunkMetaFormat()),
    }


def _everything(storage: Any) -> list[Any]:
    """Every sample of a storage, read as the loader would: the stream and stream-meta
    fixtures in windows of 5 and 3, in a shuffled order, documents all of them."""
    if isinstance(storage, DocumentStorage):
        dataset: Any = DocumentDataset(storage)
    else:
        dataset = StreamDataset(storage, 5 if isinstance(storage, StreamStorage) else 3)
    with dataset.sync_reader() as reader:
        order = np.random.default_rng(0).permutation(len(reader)).astype(np.int64)
        batch = reader.read_batch(order)
    return [_plain(sample) for sample in batch]


def _plain(sample: Any) -> Any:
    if isinstance(sample, dict):
        return {key: _plain(value) for key, value in sample.items()}
    if isinstance(sample, np.ndarray):
        return sample.tolist()
    if isinstance(sample, (list, tuple)):
        return [_plain(value) for value in sample]
    return sample


def _write_tokens(directory: Path, shards: int = 3, per_shard: int = 1000) -> np.ndarray:
    with StreamStorage(directory, TOKENS).sync_writer() as writer:
        for shard in range(shards):
            start = shard * per_shard
            writer.append(shard, {"tokens": np.arange(start, start + per_shard, dtype="<i4")})
    return np.arange(shards * per_shard, dtype="<i4")


# --- servers (one each per session) ---------------------------------------------------------


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    with moto_server() as server:
        fs = server.filesystem()
        fs.mkdir(BUCKET)
        for kind in ("stream", "document", "stream_meta"):
            fs.put(f"{FIXTURES / kind}/", f"{BUCKET}/fixtures/{kind}/", recursive=True)
        yield server


@pytest.fixture(scope="session")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    need_modules("aiohttp")
    with nginx_server(tmp_path_factory.mktemp("nginx")) as server:
        for kind in ("stream", "document", "stream_meta"):
            shutil.copytree(FIXTURES / kind, server.root / "fixtures" / kind)
        yield server


def _upload(s3: S3Server, local: Path, prefix: str) -> str:
    s3.filesystem().put(f"{local}/", f"{BUCKET}/{prefix}/", recursive=True)
    return f"s3://{BUCKET}/{prefix}"


# --- locations: URL, file:// and Path -------------------------------------------------------


def test_a_path_is_always_local_even_when_it_looks_like_a_url() -> None:
    storage = StreamStorage(Path("s3://bucket/data"), TOKENS)
    assert type(storage.dir) is not RemotePath and isinstance(storage.backend, MmapIO)


def test_a_file_url_is_the_local_memory_mapped_path(tmp_path: Path) -> None:
    tokens = _write_tokens(tmp_path / "data")
    storage = StreamStorage((tmp_path / "data").as_uri(), TOKENS)
    assert storage.dir == tmp_path / "data" and isinstance(storage.backend, MmapIO)
    with StreamDataset(storage, 100).sync_reader() as reader:
        assert reader[12]["tokens"].tolist() == tokens[1200:1300].tolist()


def test_a_file_url_keeps_the_read_interface_it_is_given(tmp_path: Path) -> None:
    _write_tokens(tmp_path / "data")
    storage = StreamStorage((tmp_path / "data").as_uri(), TOKENS, SeekIO())
    assert isinstance(storage.backend, SeekIO)


def test_read_interface_with_a_remote_url_is_a_value_error() -> None:
    need_modules("fsspec")
    with pytest.raises(ValueError, match="read_interface=SeekIO"):
        StreamStorage("http://127.0.0.1:1/data", TOKENS, SeekIO())


def test_a_remote_path_joins_names_and_gives_the_url_back() -> None:
    path = RemotePath("http://127.0.0.1:8080/data/set")
    assert str(path / "0000000.in_band.bin") == "http://127.0.0.1:8080/data/set/0000000.in_band.bin"
    assert os.fspath(path) == "http://127.0.0.1:8080/data/set"
    assert isinstance(path / "x", RemotePath)
    assert pickle.loads(pickle.dumps(path / "x")) == path / "x"
    assert str(pickle.loads(pickle.dumps(path / "x"))) == "http://127.0.0.1:8080/data/set/x"


def test_a_remote_storage_pickles_with_its_url_and_options() -> None:
    need_modules("fsspec", "s3fs")
    storage = StreamStorage("s3://bucket/data", TOKENS, storage_options={"anon": True}, retry=FAST)
    copy = pickle.loads(pickle.dumps(storage))
    assert str(copy.dir) == "s3://bucket/data"
    assert copy.backend.storage_options == {"anon": True} and copy.backend.retry == FAST


def test_a_writer_to_a_url_stages_in_the_temporary_directory_and_removes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    need_modules("fsspec", "s3fs")
    monkeypatch.chdir(tmp_path)
    storage = StreamStorage("s3://bucket/data", TOKENS)
    writer = storage.sync_writer()  # no request yet: the URL is listed at open
    staging = Path(writer.directory)
    assert staging.parent == Path(tempfile.gettempdir()) and staging.is_dir()
    assert list(tmp_path.iterdir()) == []  # nothing under the working directory
    writer.abort()
    assert not staging.exists()


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_the_storage_layer_imports_fsspec_only_when_a_url_is_used(tmp_path: Path) -> None:
    _write_tokens(tmp_path / "data")
    result = _run_python(
        f"""
import sys
import guideloom_pipes
from guideloom_pipes import StreamStorage, StreamNumpyFormat, StreamDataset
import numpy as np
fmt = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
with StreamDataset(StreamStorage({str(tmp_path / "data")!r}, fmt), 10).sync_reader() as r:
    r[3]
print("fsspec" in sys.modules)
"""
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_url_without_fsspec_says_to_install_the_remote_extra() -> None:
    result = _run_python(
        """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "fsspec":
            raise ModuleNotFoundError(f"blocked: {name}", name=name)
        return None

sys.meta_path.insert(0, Block())
import numpy as np
from guideloom_pipes import StreamStorage, StreamNumpyFormat
try:
    StreamStorage("s3://bucket/data", StreamNumpyFormat(np.dtype([("t", "<i4")])))
except ImportError as error:
    print(error)
"""
    )
    assert result.returncode == 0, result.stderr
    assert "pip install guideloom_pipes[remote]" in result.stdout
    assert "s3://bucket/data" in result.stdout


# --- the retry policy -----------------------------------------------------------------------


def test_retry_delays_double_up_to_the_maximum_with_jitter() -> None:
    policy = RetryPolicy(attempts=8, base_delay=0.1, max_delay=1.0, jitter=0.5)
    rng = random.Random(0)
    for failures, full in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (7, 1.0)]:
        delays = [policy.delay(failures, rng) for _ in range(200)]
        assert all(full * 0.5 <= d <= full for d in delays)
        assert max(delays) - min(delays) > full * 0.3  # jittered, not in step
    assert RetryPolicy(jitter=0).delay(3) == pytest.approx(0.8)


@pytest.mark.parametrize(
    "kwargs",
    [{"attempts": 0}, {"base_delay": -1}, {"max_delay": float("nan")}, {"jitter": 1.5}],
)
def test_a_retry_policy_refuses_meaningless_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def _caused(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionResetError(errno.ECONNRESET, "reset"), True),
        (TimeoutError("timed out"), True),
        (OSError(errno.EBUSY, "Please reduce your request rate."), True),  # s3fs SlowDown/503
        (OSError(errno.EREMOTEIO, "We encountered an internal error"), True),  # s3fs 500
        (_caused(FileNotFoundError("http://x/0000001.in_band.bin"), TimeoutError()), True),
        (FileNotFoundError("http://x/0000001.in_band.bin"), False),
        (PermissionError(errno.EACCES, "denied"), False),
        (ValueError("bad"), False),
    ],
    ids=["reset", "timeout", "slowdown", "internal", "size-timed-out", "404", "403", "other"],
)
def test_which_failures_are_transient(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def test_an_aiohttp_5xx_is_transient_and_a_404_is_not() -> None:
    need_modules("aiohttp")
    from aiohttp import ClientResponseError, RequestInfo
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    info = RequestInfo(URL("http://x/a"), "GET", CIMultiDictProxy(CIMultiDict()))

    def failed(status: int) -> ClientResponseError:
        return ClientResponseError(info, (), status=status)

    assert is_transient(failed(503)) and is_transient(failed(429))
    assert is_transient(_caused(FileNotFoundError("x"), failed(502)))  # fsspec's size lookup
    assert not is_transient(_caused(FileNotFoundError("x"), failed(404)))


# --- S3 (moto) ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["stream", "document", "stream_meta"])
def test_guideloom_fixtures_on_s3_read_back_as_local(s3: S3Server, kind: str) -> None:
    remote = _storages(f"s3://{BUCKET}/fixtures", storage_options=s3.options())[kind]
    assert _everything(remote) == _everything(_local_storages()[kind])


def test_fixture_stream_windows_on_s3_are_guideloom_s(s3: S3Server) -> None:
    storage = _storages(f"s3://{BUCKET}/fixtures", storage_options=s3.options())["stream"]
    with storage.sync_reader() as reader:
        for length, expected in EXPECTED["stream"]["windows"].items():
            size = int(length)
            got = [_plain(reader.read(i * size, size)) for i in range(len(expected))]
            assert got == expected


def test_an_s3_dataset_is_read_a_byte_range_per_window(s3: S3Server, tmp_path: Path) -> None:
    tokens = _write_tokens(tmp_path / "data", shards=2, per_shard=100_000)
    url = _upload(s3, tmp_path / "data", "ranged")
    port = int(s3.endpoint.rpartition(":")[2])
    with fault_proxy(port, lambda n: "pass") as proxy:
        storage = StreamStorage(url, TOKENS, storage_options=s3.options(proxy.url))
        with StreamDataset(storage, 1000).sync_reader() as reader:
            ids = np.array([150, 3, 99, 100])  # 99 and 100 on either side of the shard edge
            batch = reader.read_batch(ids)
    for sample, i in zip(batch, ids):
        assert sample["tokens"].tolist() == tokens[i * 1000 : (i + 1) * 1000].tolist()
    data_gets = [line for action, line in proxy.log if "in_band.bin" in line and "GET" in line]
    assert len(data_gets) == 4  # one ranged request per window, no whole-shard download


def test_an_s3_dataset_with_a_gap_names_the_missing_shard(s3: S3Server, tmp_path: Path) -> None:
    _write_tokens(tmp_path / "data", shards=3)
    for name in ("0000001.in_band.bin", "0000001.shard.json"):
        (tmp_path / "data" / name).unlink()
    url = _upload(s3, tmp_path / "data", "gap")
    with (
        pytest.raises(FileNotFoundError, match="shard 0000001 is missing"),
        StreamStorage(url, TOKENS, storage_options=s3.options()).sync_reader(),
    ):
        pass


def test_an_s3_object_whose_size_differs_from_its_record_is_refused(
    s3: S3Server, tmp_path: Path
) -> None:
    _write_tokens(tmp_path / "data")
    url = _upload(s3, tmp_path / "data", "truncated")
    data = (tmp_path / "data" / "0000002.in_band.bin").read_bytes()
    s3.filesystem().pipe(f"{BUCKET}/truncated/0000002.in_band.bin", data[:-8])
    with (
        pytest.raises(CorruptShardError, match="was committed with 4000 bytes"),
        StreamStorage(url, TOKENS, storage_options=s3.options()).sync_reader(),
    ):
        pass


def test_an_s3_shard_uploaded_without_its_record_is_refused(s3: S3Server, tmp_path: Path) -> None:
    _write_tokens(tmp_path / "data")
    (tmp_path / "data" / "0000002.shard.json").unlink()  # an upload that stopped before it
    url = _upload(s3, tmp_path / "data", "unrecorded")
    with (
        pytest.raises(UncommittedShardError, match="shard 0000002"),
        StreamStorage(url, TOKENS, storage_options=s3.options()).sync_reader(),
    ):
        pass


def test_an_s3_prefix_with_nothing_under_it_is_not_found(s3: S3Server) -> None:
    storage = StreamStorage(f"s3://{BUCKET}/nothing-here", TOKENS, storage_options=s3.options())
    with pytest.raises(FileNotFoundError), storage.sync_reader():
        pass


def test_an_s3_dataset_rewritten_with_more_shards_is_listed_again(
    s3: S3Server, tmp_path: Path
) -> None:
    _write_tokens(tmp_path / "a", shards=2)
    url = _upload(s3, tmp_path / "a", "grows")
    storage = StreamStorage(url, TOKENS, storage_options=s3.options())
    with storage.sync_reader() as reader:
        assert reader.num_shards == 2
    _write_tokens(tmp_path / "b", shards=3)
    _upload(s3, tmp_path / "b", "grows")
    with storage.sync_reader() as reader:  # no stale listing from the first open
        assert reader.num_shards == 3


@pytest.mark.slow  # (~11 s alone: every fault kind, retried against moto)
def test_faults_on_s3_are_retried_and_reads_return_exactly_the_bytes(
    s3: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="guideloom_pipes.remote")
    tokens = _write_tokens(tmp_path / "data", shards=3, per_shard=20_000)
    url = _upload(s3, tmp_path / "data", "faulty")
    faults = ["503", "reset", "pass", "truncate", "delay", "pass"]
    port = int(s3.endpoint.rpartition(":")[2])
    with fault_proxy(port, lambda n: faults[n % len(faults)]) as proxy:
        options = s3.options(proxy.url, config_kwargs={"retries": {"max_attempts": 1}})
        storage = StreamStorage(url, TOKENS, storage_options=options, retry=FAST)
        with StreamDataset(storage, 500).sync_reader() as reader:
            ids = np.random.default_rng(1).permutation(len(reader))[:40]
            batch = reader.read_batch(ids)
    for sample, i in zip(batch, ids):
        assert sample["tokens"].tolist() == tokens[i * 500 : (i + 1) * 500].tolist()
    assert proxy.count("503") > 3 and proxy.count("reset") > 3 and proxy.count("truncate") > 3
    # retries are logged (the client takes some faults itself: fsspec's HTTP size probe
    # falls back from HEAD to GET, s3fs retries a dropped connection)
    retries = [r for r in caplog.records if r.name == "guideloom_pipes.remote"]
    assert 0 < len(retries) <= proxy.count("503") + proxy.count("reset") + proxy.count("truncate")


def test_the_loader_over_s3_orders_like_guideloom(s3: S3Server) -> None:
    pytest.importorskip("torch")
    from loader_helpers import stream_ids_collate

    from guideloom_pipes import StatefulDataLoader

    orders = EXPECTED["loader_orders"]
    storage = _storages(f"s3://{BUCKET}/fixtures", storage_options=s3.options())["stream"]
    for run in orders["runs"][::9]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = StatefulDataLoader.from_storage(
                storage,
                stream_ids_collate,
                sequence_length=orders["sequence_length"],
                device="cpu",
                num_workers=2,
                **run["config"],
            )
        with loader:
            epochs = [list(loader) for _ in range(3)]
        assert epochs == run["epochs"]
        state = loader.state_dict()
        assert {key: state[key] for key in run["final_state"]} == run["final_state"]


def test_the_loader_over_s3_saves_and_resumes_like_guideloom(s3: S3Server) -> None:
    pytest.importorskip("torch")
    from loader_helpers import stream_ids_collate

    from guideloom_pipes import StatefulDataLoader

    storage = _storages(f"s3://{BUCKET}/fixtures", storage_options=s3.options())["stream"]
    length = EXPECTED["loader_orders"]["sequence_length"]

    def loader(config: dict[str, Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return StatefulDataLoader.from_storage(
                storage, stream_ids_collate, sequence_length=length, device="cpu",
                num_workers=2, **config,
            )  # fmt: skip

    for case in EXPECTED["resumes"]:
        first = loader(case["config"])
        with first:
            it = iter(first)
            assert [next(it) for _ in case["batches_before_save"]] == case["batches_before_save"]
            state = first.state_dict()
            assert {key: state[key] for key in case["state_dict"]} == case["state_dict"]
            it.close()
        for resumed in case["resumed"]:
            second = loader(resumed["config"])
            second.load_state_dict(case["state_dict"])
            with second:
                epochs = [list(second) for _ in resumed["epochs_after_resume"]]
            assert epochs == resumed["epochs_after_resume"]


# --- HTTP (nginx) ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["stream", "document", "stream_meta"])
def test_guideloom_fixtures_over_http_read_back_as_local(http: HttpServer, kind: str) -> None:
    remote = _storages(f"{http.url}/fixtures")[kind]
    assert _everything(remote) == _everything(_local_storages()[kind])


def test_an_http_dataset_is_found_by_probing_and_its_records_are_checked(
    http: HttpServer, tmp_path: Path
) -> None:
    _write_tokens(http.root / "probed", shards=5)
    storage = StreamStorage(f"{http.url}/probed", TOKENS)
    with storage.sync_reader() as reader:
        assert reader.num_shards == 5 and reader.total_length == 5000
    (http.root / "probed" / "0000003.shard.json").unlink()  # an upload cut short
    with pytest.raises(UncommittedShardError, match="shard 0000003"), storage.sync_reader():
        pass


def test_an_http_object_whose_size_differs_from_its_record_is_refused(http: HttpServer) -> None:
    _write_tokens(http.root / "short", shards=2)
    data = http.root / "short" / "0000001.in_band.bin"
    data.write_bytes(data.read_bytes()[:-4])
    with (
        pytest.raises(CorruptShardError, match=r"0000001\.in_band\.bin"),
        StreamStorage(f"{http.url}/short", TOKENS).sync_reader(),
    ):
        pass


def test_an_http_url_with_no_dataset_is_not_found(http: HttpServer) -> None:
    storage = StreamStorage(f"{http.url}/missing", TOKENS, retry=FAST)
    with pytest.raises(FileNotFoundError, match="no shard 0000000"), storage.sync_reader():
        pass


def test_faults_over_http_are_retried_and_reads_return_exactly_the_bytes(
    http: HttpServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="guideloom_pipes.remote")
    tokens = _write_tokens(http.root / "faulty", shards=3, per_shard=20_000)
    faults = ["reset", "503", "pass", "truncate", "delay", "pass", "pass"]
    with fault_proxy(http.port, lambda n: faults[n % len(faults)]) as proxy:
        storage = StreamStorage(f"{proxy.url}/faulty", TOKENS, retry=FAST)
        with StreamDataset(storage, 500).sync_reader() as reader:
            assert len(reader) == 120
            ids = np.random.default_rng(2).permutation(len(reader))[:40]
            batch = reader.read_batch(ids)
    for sample, i in zip(batch, ids):
        assert sample["tokens"].tolist() == tokens[i * 500 : (i + 1) * 500].tolist()
    assert proxy.count("503") > 3 and proxy.count("reset") > 3 and proxy.count("truncate") > 3
    # retries are logged (the client takes some faults itself: fsspec's HTTP size probe
    # falls back from HEAD to GET, s3fs retries a dropped connection)
    retries = [r for r in caplog.records if r.name == "guideloom_pipes.remote"]
    assert 0 < len(retries) <= proxy.count("503") + proxy.count("reset") + proxy.count("truncate")


def test_a_stalled_request_times_out_and_is_retried(http: HttpServer) -> None:
    need_modules("aiohttp")
    import aiohttp

    tokens = _write_tokens(http.root / "stalled", shards=1)
    stalls = {4}  # the first ranged read of data, after the manifest, the probes, the record
    with fault_proxy(http.port, lambda n: "stall" if n in stalls else "pass") as proxy:
        options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=1)}}
        storage = StreamStorage(f"{proxy.url}/stalled", TOKENS, storage_options=options, retry=FAST)
        with StreamDataset(storage, 100).sync_reader() as reader:
            got = [reader[i]["tokens"].tolist() for i in range(len(reader))]
    assert got == [tokens[i * 100 : (i + 1) * 100].tolist() for i in range(10)]
    assert proxy.count("stall") == 1


def test_the_retry_policys_timeout_abandons_a_stalled_request_and_retries_it(
    http: HttpServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="guideloom_pipes.remote")
    # no client timeout of the user's: the policy's deadline alone ends the stalled read
    tokens = _write_tokens(http.root / "stalled-policy", shards=1)
    stalls = {4}  # the first ranged read of data, after the manifest, the probes, the record
    policy = RetryPolicy(attempts=6, base_delay=0.001, max_delay=0.01, timeout=2)
    with fault_proxy(http.port, lambda n: "stall" if n in stalls else "pass") as proxy:
        storage = StreamStorage(f"{proxy.url}/stalled-policy", TOKENS, retry=policy)
        with StreamDataset(storage, 100).sync_reader() as reader:
            got = [reader[i]["tokens"].tolist() for i in range(len(reader))]
    assert got == [tokens[i * 100 : (i + 1) * 100].tolist() for i in range(10)]
    assert proxy.count("stall") == 1
    # the retry is logged with the shard, the attempt and the error
    (retry,) = [r for r in caplog.records if r.name == "guideloom_pipes.remote"]
    assert retry.levelno == logging.INFO
    message = retry.getMessage()
    assert "/stalled-policy/0000000." in message and "(shard 0000000)" in message
    assert "attempt 1 of 6 failed" in message and "(FSTimeoutError)" in message


def test_a_server_that_never_answers_fails_after_the_attempts_naming_the_timeout(
    http: HttpServer,
) -> None:
    _write_tokens(http.root / "never", shards=1)
    policy = RetryPolicy(attempts=2, base_delay=0.001, max_delay=0.01, timeout=0.3)
    with fault_proxy(http.port, lambda n: "stall") as proxy:
        storage = StreamStorage(f"{proxy.url}/never", TOKENS, retry=policy)
        with pytest.raises(RemoteReadError, match=r"failed 2 time\(s\).*FSTimeoutError"):
            StreamDataset(storage, 100).sync_reader().open()
    assert proxy.count("stall") == 2


@pytest.mark.parametrize("timeout", [0, -1.0, "30", True])
def test_a_retry_timeout_that_is_not_positive_seconds_is_refused(timeout: object) -> None:
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        RetryPolicy(timeout=timeout)  # type: ignore[arg-type]


def test_persistent_failures_raise_an_error_naming_url_shard_and_attempts(
    http: HttpServer,
) -> None:
    _write_tokens(http.root / "failing", shards=2)
    opened = []

    def schedule(n: int) -> str:
        return "503" if opened else "pass"  # the open succeeds, every read after it fails

    with fault_proxy(http.port, schedule) as proxy:
        policy = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.01)
        storage = StreamStorage(f"{proxy.url}/failing", TOKENS, retry=policy)
        with StreamDataset(storage, 100).sync_reader() as reader:
            reader[15]  # shard 1's object is found (its size) and read once
            opened.append(True)
            with pytest.raises(RemoteReadError) as caught:
                reader[16]  # a ranged read of shard 1
    message = str(caught.value)
    assert f"{proxy.url}/failing/0000001.in_band.bin" in message
    assert "shard 0000001" in message and "3 time(s)" in message and "attempts=" in message
    assert proxy.count("503") == 3  # exactly the attempts the policy allows
    assert isinstance(caught.value, OSError)


def test_a_missing_object_is_not_retried(http: HttpServer) -> None:
    _write_tokens(http.root / "notfound", shards=1)
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        storage = StreamStorage(f"{proxy.url}/notfound", TOKENS, retry=FAST)
        reader = storage.backend.sync_reader()(storage.dir / "0000009.in_band.bin")
        with pytest.raises(FileNotFoundError):
            reader.open()
    assert len(proxy.log) <= 2  # fsspec's HEAD, then its GET: no retries of a 404


def test_a_remote_loader_with_thread_workers_reads_what_a_local_one_does(
    http: HttpServer, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from guideloom_pipes import StatefulDataLoader

    _write_tokens(http.root / "loader", shards=4, per_shard=2500)
    batches = []
    for storage in (
        StreamStorage(http.root / "loader", TOKENS),
        StreamStorage(f"{http.url}/loader", TOKENS, retry=FAST),
    ):
        loader = StatefulDataLoader.from_storage(
            storage, sequence_length=64, batch_size=8, shuffle=True, shuffle_seed=3,
            num_workers=8, prefetch=1, device="cpu", drop_last=True,
        )  # fmt: skip
        with loader:
            batches.append([batch["tokens"].tolist() for batch in loader])
    assert batches[0] == batches[1] and len(batches[0]) == 10_000 // 64 // 8


def test_a_remote_storage_reads_in_process_workers(http: HttpServer) -> None:
    pytest.importorskip("torch")
    from guideloom_pipes import StatefulDataLoader

    tokens = _write_tokens(http.root / "processes", shards=2, per_shard=640)
    storage = StreamStorage(f"{http.url}/processes", TOKENS, retry=FAST)
    loader = StatefulDataLoader.from_storage(
        storage, sequence_length=64, batch_size=4, num_workers=2, prefetch=1,
        parallel_method="process", device="cpu",
    )  # fmt: skip
    with loader:
        got = np.concatenate([batch["tokens"].numpy().ravel() for batch in loader])
    assert got.tolist() == tokens[: len(got)].tolist() and len(got) == 1280


def test_remote_paths_are_plain_posix_paths_to_the_rest_of_the_storage_layer() -> None:
    assert isinstance(RemotePath("s3://b/x"), PurePosixPath)


def test_a_server_that_cannot_start_skips_or_fails_where_servers_are_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import remote_servers

    monkeypatch.setattr(remote_servers, "REQUIRE", False)
    with pytest.raises(pytest.skip.Exception, match="nginx is not installed"):
        remote_servers.unavailable("nginx is not installed")
    monkeypatch.setattr(remote_servers, "REQUIRE", True)
    with pytest.raises(pytest.fail.Exception, match="GUIDELOOM_PIPES_REQUIRE_SERVERS=1"):
        remote_servers.unavailable("nginx is not installed")


def _record_get(line: str) -> bool:
    return line.startswith("GET") and ".shard.json" in line


def test_an_http_open_reads_its_records_and_sizes_concurrently(http: HttpServer) -> None:
    _write_tokens(http.root / "concurrent", shards=8, per_shard=100)

    def shard_record_get(line: str) -> bool:  # not the probe for a record past the end
        return _record_get(line) and "/0000008." not in line

    with fault_proxy(http.port, lambda n: "pass", together=shard_record_get, parties=4) as proxy:
        storage = StreamStorage(f"{proxy.url}/concurrent", TOKENS)
        with storage.sync_reader() as reader:
            assert reader.num_shards == 8
    # sequential reads would meet no other request at the barrier: "alone", after 30 s
    # (an open that checks its snapshot again under load may read a record twice: alone)
    assert proxy.count("together") == 8


def test_an_s3_open_reads_its_records_concurrently(s3: S3Server, tmp_path: Path) -> None:
    _write_tokens(tmp_path / "data", shards=8, per_shard=100)
    url = _upload(s3, tmp_path / "data", "concurrent")
    port = int(s3.endpoint.rpartition(":")[2])
    with fault_proxy(port, lambda n: "pass", together=_record_get, parties=4) as proxy:
        storage = StreamStorage(url, TOKENS, storage_options=s3.options(proxy.url))
        with storage.sync_reader() as reader:
            assert reader.num_shards == 8
    assert proxy.count("together") == 8 and proxy.count("alone") == 0


# --- writing to a URL -----------------------------------------------------------------------


def _s3_storages(s3: S3Server, prefix: str) -> dict[str, Any]:
    return _storages(f"s3://{BUCKET}/{prefix}", storage_options=s3.options(), retry=FAST)


def _write_each_kind(storage: Any) -> None:
    """The same appends for a storage of each kind: three shards of known content."""
    with storage.sync_writer() as writer:
        for shard in range(3):
            if isinstance(storage, DocumentStorage):
                for i in range(4):
                    writer.append(shard, {"shard": shard, "i": i, "text": "x" * (i * 7)})
            elif isinstance(storage, StreamWithMetaStorage):
                tokens = list(range(shard * 100, shard * 100 + 30))
                writer.append(
                    shard, {"doc": shard, "tokens": tokens, "chunk_ids": [t // 8 for t in tokens]}
                )
            else:
                tokens = np.arange(shard * 50, shard * 50 + 40)
                writer.append(shard, {"tokens": tokens, "loss_mask": tokens % 2})


@pytest.mark.parametrize("kind", ["stream", "document", "stream_meta"])
def test_a_dataset_written_to_s3_is_byte_for_byte_the_one_written_to_a_directory(
    s3: S3Server, kind: str, tmp_path: Path
) -> None:
    remote = _s3_storages(s3, "written")[kind]
    local = _storages(str(tmp_path / "local"))[kind]
    _write_each_kind(remote)
    _write_each_kind(local)
    assert _everything(remote) == _everything(local)
    fs = s3.filesystem()
    fs.get(f"{BUCKET}/written/{kind}/", f"{tmp_path / 'downloaded'}/", recursive=True)
    downloaded = sorted((tmp_path / "downloaded").iterdir())
    written = sorted(p for p in (tmp_path / "local" / kind).iterdir() if p.is_file())
    # the same names (canonical, a settled record per shard, no versioned file left) and
    # the same bytes, records included (both are generation 1)
    assert [p.name for p in downloaded] == [p.name for p in written]
    assert [p.read_bytes() for p in downloaded] == [p.read_bytes() for p in written]


def test_a_rewrite_to_s3_replaces_the_shard_and_counts_its_generation(s3: S3Server) -> None:
    storage = StreamStorage(
        f"s3://{BUCKET}/rewrite", TOKENS, storage_options=s3.options(), retry=FAST
    )
    for value in (1, 2):
        with storage.sync_writer() as writer:
            writer.append(0, {"tokens": np.full(10, value, dtype="<i4")})
    with StreamDataset(storage, 10).sync_reader() as reader:
        assert reader[0]["tokens"].tolist() == [2] * 10
    record = json.loads(s3.filesystem().cat_file(f"{BUCKET}/rewrite/0000000.shard.json"))
    assert record["generation"] == 2 and not record.get("versioned")


def test_a_failed_upload_leaves_the_remote_dataset_as_it_was(s3: S3Server) -> None:
    storage = StreamStorage(
        f"s3://{BUCKET}/failed", TOKENS, storage_options=s3.options(), retry=FAST
    )
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(10, dtype="<i4")})
    # a writer that opens through the proxy, whose every request then fails (reset)
    port = int(s3.endpoint.rpartition(":")[2])
    action = {"now": "pass"}
    with fault_proxy(port, lambda n: action["now"]) as proxy:
        broken = StreamStorage(
            f"s3://{BUCKET}/failed",
            TOKENS,
            storage_options=s3.options(proxy.url, config_kwargs={"retries": {"max_attempts": 1}}),
            retry=RetryPolicy(attempts=2, base_delay=0.001, max_delay=0.01, timeout=10),
        )
        writer = broken.sync_writer()
        writer.append(0, {"tokens": np.full(10, 7, dtype="<i4")})
        staging = writer.directory
        action["now"] = "reset"
        with pytest.raises(RemoteReadError):
            writer.close()
        assert proxy.count("reset") >= 2 and proxy.count("pass") >= 1
    assert not os.path.exists(staging)  # the local staging directory is gone too
    with StreamDataset(storage, 10).sync_reader() as reader:
        assert reader[0]["tokens"].tolist() == list(range(10))


@pytest.mark.slow
def test_an_upload_failing_at_any_request_leaves_the_old_shard_or_the_new_one(
    s3: S3Server,
) -> None:
    """For every n: the close's first n requests succeed, every later one fails. Each shard
    then reads as its old version or its new one, whole, and a later writer completes it.
    The loop ends at the first n with which the close succeeds."""
    port = int(s3.endpoint.rpartition(":")[2])
    old = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]
    new = [[7] * 5, [7] * 5, [8] * 5]
    outcomes = []
    for passing in range(200):
        url = f"s3://{BUCKET}/partial/{passing}"
        storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
        with storage.sync_writer() as writer:
            writer.append(0, {"tokens": np.arange(10, dtype="<i4")})
            writer.append(1, {"tokens": np.arange(5, dtype="<i4")})
        closing: dict[str, int | None] = {"from": None}

        def schedule(
            n: int, closing: dict[str, int | None] = closing, passing: int = passing
        ) -> str:
            first = closing["from"]
            return "pass" if first is None or n < first + passing else "reset"

        with fault_proxy(port, schedule) as proxy:
            options = s3.options(proxy.url, config_kwargs={"retries": {"max_attempts": 1}})
            writer = StreamStorage(
                url, TOKENS, storage_options=options, retry=RetryPolicy(attempts=1, timeout=10)
            ).sync_writer()
            writer.append(0, {"tokens": np.full(10, 7, dtype="<i4")})
            writer.append(1, {"tokens": np.full(5, 8, dtype="<i4")})
            closing["from"] = len(proxy.log)
            try:
                writer.close()
                failed = False
            except RemoteReadError:
                failed = True
        with StreamDataset(storage, 5).sync_reader() as reader:
            got = [reader[i]["tokens"].tolist() for i in range(len(reader))]
        assert got[:2] in (old[:2], new[:2]) and got[2:] in (old[2:], new[2:]), passing
        outcomes.append((got[:2] == new[:2], got[2:] == new[2:]))
        with storage.sync_writer() as writer:
            writer.append(0, {"tokens": np.full(10, 3, dtype="<i4")})
            writer.append(1, {"tokens": np.full(5, 4, dtype="<i4")})
        names = sorted(p.rpartition("/")[2] for p in s3.filesystem().ls(url[5:]))
        assert names == [
            "0000000.in_band.bin", "0000000.shard.json", "0000001.in_band.bin",
            "0000001.shard.json",
        ], passing  # fmt: skip
        with StreamDataset(storage, 5).sync_reader() as reader:
            assert [reader[i]["tokens"].tolist() for i in range(3)] == [[3] * 5, [3] * 5, [4] * 5]
        if not failed:
            break
    else:
        raise AssertionError("the close never succeeded")
    # the failures fell before the commit points, between them and after them
    assert outcomes[0] == (False, False) and outcomes[-1] == (True, True)
    assert (True, False) in outcomes


def test_an_aborted_writer_to_s3_uploads_nothing(s3: S3Server) -> None:
    storage = StreamStorage(
        f"s3://{BUCKET}/aborted", TOKENS, storage_options=s3.options(), retry=FAST
    )
    with pytest.raises(KeyError), storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(10, dtype="<i4")})
        staging = writer.directory
        raise KeyError("stop")
    assert not os.path.exists(staging)
    assert not s3.filesystem().exists(f"{BUCKET}/aborted")


def test_writer_modes_on_s3(s3: S3Server) -> None:
    url = f"s3://{BUCKET}/modes"
    storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
    with storage.sync_writer() as writer:
        for shard in range(3):
            writer.append(shard, {"tokens": np.full(4, shard, dtype="<i4")})
    with pytest.raises(FileExistsError, match="mode='create'"):
        storage.sync_writer(mode="create").open()
    warns = pytest.warns(UserWarning, match=r"remain above it.*0000001, 0000002")
    with warns, storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.full(4, 9, dtype="<i4")})
    with storage.sync_writer(mode="overwrite") as writer:
        writer.append(0, {"tokens": np.full(4, 5, dtype="<i4")})
    names = sorted(p.rpartition("/")[2] for p in s3.filesystem().ls(f"{BUCKET}/modes"))
    assert names == ["0000000.in_band.bin", "0000000.shard.json"]
    with StreamDataset(storage, 4).sync_reader() as reader:
        assert len(reader) == 1 and reader[0]["tokens"].tolist() == [5] * 4


def test_an_update_writer_to_s3_refuses_another_dtype_than_the_committed_shards(
    s3: S3Server,
) -> None:
    url = f"s3://{BUCKET}/one-dtype"
    storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
    with storage.sync_writer() as writer:
        for shard in range(2):
            writer.append(shard, {"tokens": np.full(4, shard, dtype="<i4")})
    before = sorted(s3.filesystem().ls(f"{BUCKET}/one-dtype"))
    u2 = StreamNumpyFormat(np.dtype([("tokens", "<u2")]))
    other = StreamStorage(url, u2, storage_options=s3.options(), retry=FAST)
    with other.sync_writer() as writer, pytest.raises(StorageError) as error:
        writer.append(2, {"tokens": np.arange(4, dtype="<u2")})
    message = str(error.value)
    assert "[('tokens', '<u2')]" in message and "[('tokens', '<i4')]" in message
    assert url in message and "shard 0000000" in message
    with pytest.raises(StorageError, match="'<u2'"):  # before any item runs
        write_parallel(other, [3, 4], _u2_tokens, mode="update", progress=False)
    assert sorted(s3.filesystem().ls(f"{BUCKET}/one-dtype")) == before  # nothing uploaded
    with other.sync_writer(mode="overwrite") as writer:  # a new dtype replaces the dataset
        writer.append(0, {"tokens": np.arange(4, dtype="<u2")})
    with StreamDataset(other, 4).sync_reader() as reader:
        assert len(reader) == 1 and reader[0]["tokens"].tolist() == [0, 1, 2, 3]


def _u2_tokens(n: int) -> Iterator[dict[str, np.ndarray]]:
    yield {"tokens": np.arange(n, dtype="<u2")}


def test_a_record_naming_versioned_files_on_s3_reads_the_new_shard(s3: S3Server) -> None:
    # an upload stopped between its commit point and the canonical copies: readers read the
    # versioned files the record names, and the next write of the shard cleans them up
    url = f"s3://{BUCKET}/stopped"
    storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.full(4, 1, dtype="<i4")})
    fs = s3.filesystem()
    record = json.loads(fs.cat_file(f"{BUCKET}/stopped/0000000.shard.json"))
    fs.pipe_file(f"{BUCKET}/stopped/0000000.v2.in_band.bin", np.full(4, 2, "<i4").tobytes())
    import zlib

    record.update(
        generation=2,
        versioned=True,
        guideloom_pipes_record=2,
        files={"in_band.bin": {"size": 16, "crc32": zlib.crc32(np.full(4, 2, "<i4").tobytes())}},
    )
    fs.pipe_file(f"{BUCKET}/stopped/0000000.shard.json", json.dumps(record).encode())
    with StreamDataset(storage, 4).sync_reader() as reader:
        assert reader[0]["tokens"].tolist() == [2] * 4
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.full(4, 3, dtype="<i4")})
    names = sorted(p.rpartition("/")[2] for p in fs.ls(f"{BUCKET}/stopped"))
    assert names == ["0000000.in_band.bin", "0000000.shard.json"]
    with StreamDataset(storage, 4).sync_reader() as reader:
        assert reader[0]["tokens"].tolist() == [3] * 4


def test_writing_to_an_http_url_is_refused_naming_the_fix(http: HttpServer) -> None:
    storage = StreamStorage(f"{http.url}/readonly", TOKENS)
    with pytest.raises(ValueError, match="HTTP server is read-only"):
        storage.sync_writer()


def _count_to(item: int) -> Iterator[dict[str, np.ndarray]]:
    """write_parallel's convert: item k becomes k + 1 records of k + 1 tokens."""
    for _ in range(item + 1):
        yield {"tokens": np.full(item + 1, item, dtype="<i4")}


def test_write_parallel_to_s3_writes_resumes_and_overwrites(s3: S3Server, tmp_path: Path) -> None:
    from guideloom_pipes import write_parallel

    url = f"s3://{BUCKET}/parallel"
    storage = StreamStorage(url, TOKENS, storage_options=s3.options(), retry=FAST)
    report = write_parallel(storage, [0, 1, 2, 3], _count_to, max_workers=2, progress=False)
    assert report.written == [0, 1, 2, 3] and not report.skipped
    local = StreamStorage(tmp_path / "local", TOKENS)
    write_parallel(local, [0, 1, 2, 3], _count_to, max_workers=2, progress=False)
    fs = s3.filesystem()
    # the same files as a local run (its manifest aside: written for local datasets only)
    for path in sorted(p for p in (tmp_path / "local").iterdir() if p.is_file()):
        assert fs.cat_file(f"{BUCKET}/parallel/{path.name}") == path.read_bytes(), path.name
    # a rerun skips what did not change; fewer items remove the shards above them
    again = write_parallel(storage, [0, 1, 2, 3], _count_to, max_workers=2, progress=False)
    assert again.skipped == [0, 1, 2, 3] and not again.written
    fewer = write_parallel(storage, [0, 5], _count_to, max_workers=2, progress=False)
    assert fewer.skipped == [0] and fewer.written == [1] and fewer.removed == [2, 3]
    with StreamDataset(storage, 1).sync_reader() as reader:
        assert [int(reader[i]["tokens"][0]) for i in range(len(reader))] == [0] + [5] * 36
    with pytest.raises(FileExistsError, match="mode='create'"):
        write_parallel(storage, [0], _count_to, mode="create", progress=False)
