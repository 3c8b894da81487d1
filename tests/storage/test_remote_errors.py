"""A remote server that refuses a file (docs/remote.md, "When the server refuses"): against
real servers on loopback, nginx whose workers file modes bind (``chmod 000``: 403, a file
removed: 404) and moto's S3 server with IAM enforced (a policy that denies ``GetObject``:
``AccessDenied``), plus the fault proxy of ``remote_servers.py`` for a 401 and for a server
that ignores ``Range``.

A refused or missing file fails the open (or the read, mid-epoch) naming the URL, the shard
and the server's answer; it never shortens the dataset.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
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

from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage
from guideloom_pipes.storage.remote import RangeIgnoredError, RemoteReadError, RetryPolicy

#: These tests run against servers on loopback (nginx, moto, the fault proxy).
pytestmark = pytest.mark.remote

TOKENS = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
FAST = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.01, timeout=10)
SHARDS = 4
PER_SHARD = 1000
WINDOW = 16  # 1000 // 16 = 62 windows in a shard: 250 samples in 4 shards
ROOT = Path(__file__).resolve().parents[2]


def _write(directory: Path) -> np.ndarray:
    with StreamStorage(directory, TOKENS).sync_writer() as writer:
        for shard in range(SHARDS):
            start = shard * PER_SHARD
            writer.append(shard, {"tokens": np.arange(start, start + PER_SHARD, dtype="<i4")})
    return np.arange(SHARDS * PER_SHARD, dtype="<i4")


def _sample_in(shard: int) -> int:
    """A window wholly inside ``shard``."""
    return (shard * PER_SHARD) // WINDOW + 1


def _status(url: str) -> int:
    """The status nginx answers a GET of ``url`` with."""
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "guideloom_pipes", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


# --- HTTP: nginx whose workers file modes bind ----------------------------------------------


@pytest.fixture(scope="module")
def http() -> Iterator[HttpServer]:
    need_modules("aiohttp")
    base = Path(tempfile.mkdtemp(prefix="guideloom-nginx-"))  # its workers may enter it
    try:
        base.chmod(0o755)
        with nginx_server(base, unprivileged=True) as server:
            yield server
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _dataset(http: HttpServer, name: str) -> tuple[Path, str]:
    directory = http.root / name
    _write(directory)
    return directory, f"{http.url}/{name}"


def _forbid(path: Path, url: str) -> None:
    path.chmod(0)
    assert _status(url) == 403  # nginx really refuses it (its workers are not root)


@pytest.mark.parametrize(
    "name",
    ["0000000.in_band.bin", "0000002.in_band.bin", "0000000.shard.json", "0000001.shard.json"],
)
def test_an_http_file_answering_403_fails_the_open_naming_the_url_and_the_status(
    http: HttpServer, name: str
) -> None:
    directory, url = _dataset(http, "forbidden-" + name.replace(".", "-"))
    _forbid(directory / name, f"{url}/{name}")
    storage = StreamStorage(url, TOKENS, retry=FAST)
    with pytest.raises(PermissionError) as caught:
        StreamDataset(storage, WINDOW).sync_reader().open()
    message = str(caught.value)
    assert f"{url}/{name}" in message and "HTTP 403 Forbidden" in message
    assert f"shard {name[:7]}" in message
    assert caught.value.errno == errno.EACCES


def test_a_missing_last_data_file_over_http_fails_the_open_naming_it(http: HttpServer) -> None:
    directory, url = _dataset(http, "missing-last")
    (directory / "0000003.in_band.bin").unlink()  # its record is still there
    storage = StreamStorage(url, TOKENS, retry=FAST)
    with pytest.raises(FileNotFoundError) as caught:
        StreamDataset(storage, WINDOW).sync_reader().open()
    message = str(caught.value)
    assert f"shard 0000003 of {url} has no 0000003.in_band.bin" in message
    assert "404 Not Found" in message


@pytest.mark.parametrize("fault", ["403", "404"])
def test_verify_url_of_a_dataset_with_a_refused_or_missing_file_is_not_sound(
    http: HttpServer, fault: str
) -> None:
    directory, url = _dataset(http, f"verify-{fault}")
    if fault == "403":
        _forbid(directory / "0000002.in_band.bin", f"{url}/0000002.in_band.bin")
    else:
        (directory / "0000003.in_band.bin").unlink()
    done = _cli("verify", url, "--json")
    assert done.returncode == 1, done
    report = json.loads(done.stdout)
    assert report["sound"] is False
    (problem,) = report["problems"]
    assert problem["shard"] == (2 if fault == "403" else 3)
    assert (
        "HTTP 403 Forbidden" in problem["message"]
        if fault == "403"
        else "404 Not Found" in problem["message"]
    )


def test_an_http_data_file_answering_403_mid_epoch_is_a_permission_error(
    http: HttpServer,
) -> None:
    directory, url = _dataset(http, "forbidden-later")
    storage = StreamStorage(url, TOKENS, retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        assert len(reader) == 250
        reader[_sample_in(2)]  # read fine while it was readable
        _forbid(directory / "0000002.in_band.bin", f"{url}/0000002.in_band.bin")
        with pytest.raises(PermissionError) as caught:
            reader[_sample_in(2) + 1]
    message = str(caught.value)
    assert f"{url}/0000002.in_band.bin (shard 0000002)" in message
    assert "HTTP 403 Forbidden" in message


def test_the_loader_delivers_a_403_mid_epoch_from_its_worker_processes_as_a_permission_error(
    http: HttpServer,
) -> None:
    pytest.importorskip("torch")
    from guideloom_pipes import StatefulDataLoader

    directory, url = _dataset(http, "forbidden-loader")
    storage = StreamStorage(url, TOKENS, retry=FAST)
    loader = StatefulDataLoader.from_storage(
        storage,
        sequence_length=WINDOW,
        local_batch_size=8,
        num_workers=2,
        parallel_method="process",
        prefetch=1,
        device="cpu",
    )
    steps, delivered = len(loader), 0
    with loader, pytest.raises(PermissionError) as caught:
        for _ in loader:
            delivered += 1
            if delivered == 1:  # shard 2 is read from the 16th batch on
                _forbid(directory / "0000002.in_band.bin", f"{url}/0000002.in_band.bin")
    assert 1 <= delivered < steps
    message = str(caught.value)
    assert f"{url}/0000002.in_band.bin (shard 0000002)" in message
    assert "HTTP 403 Forbidden" in message


def test_an_http_data_file_removed_mid_epoch_names_the_shard_and_the_url(
    http: HttpServer,
) -> None:
    directory, url = _dataset(http, "removed-later")
    storage = StreamStorage(url, TOKENS, retry=FAST)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        reader[_sample_in(1)]
        (directory / "0000001.in_band.bin").unlink()
        with pytest.raises(FileNotFoundError) as caught:
            reader[_sample_in(1) + 1]
    message = str(caught.value)
    assert f"{url}/0000001.in_band.bin (shard 0000001)" in message
    assert "HTTP 404 Not Found" in message and "open the dataset again" in message


def test_an_http_401_mid_epoch_is_a_permission_error_naming_the_status(http: HttpServer) -> None:
    _dataset(http, "unauthorized")
    opened: list[bool] = []
    with fault_proxy(http.port, lambda n: "401" if opened else "pass") as proxy:
        storage = StreamStorage(f"{proxy.url}/unauthorized", TOKENS, retry=FAST)
        with StreamDataset(storage, WINDOW).sync_reader() as reader:
            reader[_sample_in(1)]
            opened.append(True)
            with pytest.raises(PermissionError) as caught:
                reader[_sample_in(1) + 1]
    message = str(caught.value)
    assert f"{proxy.url}/unauthorized/0000001.in_band.bin (shard 0000001)" in message
    assert "HTTP 401 Unauthorized" in message
    assert proxy.count("401") == 1  # a refusal is not retried


def test_another_4xx_mid_epoch_is_an_os_error_naming_the_status_that_pickles(
    http: HttpServer,
) -> None:
    _dataset(http, "bad-request")
    opened: list[bool] = []
    with fault_proxy(http.port, lambda n: "400" if opened else "pass") as proxy:
        storage = StreamStorage(f"{proxy.url}/bad-request", TOKENS, retry=FAST)
        with StreamDataset(storage, WINDOW).sync_reader() as reader:
            reader[_sample_in(1)]
            opened.append(True)
            with pytest.raises(OSError) as caught:
                reader[_sample_in(1) + 1]
    assert type(caught.value) is OSError  # not aiohttp's ClientResponseError
    message = str(caught.value)
    assert f"{proxy.url}/bad-request/0000001.in_band.bin (shard 0000001)" in message
    assert "HTTP 400 Bad Request" in message
    assert proxy.count("400") == 1  # not retried
    assert str(pickle.loads(pickle.dumps(caught.value))) == message  # crosses a process
    # and so do its cause and context, which tblib's pickling (installed by importing
    # dask.distributed) pickles with it: aiohttp's own error, which does not pickle, is neither
    for linked in (caught.value.__cause__, caught.value.__context__):
        assert linked is None or pickle.loads(pickle.dumps(linked)) is not None


def test_a_server_that_ignores_range_is_named_at_the_first_read(http: HttpServer) -> None:
    # shards of 400 KB: a window's read, widened to the 64 KiB blocks the record checks,
    # is still a small part of its shard
    per_shard = 100_000
    with StreamStorage(http.root / "no-range", TOKENS).sync_writer() as writer:
        for shard in range(2):
            start = shard * per_shard
            writer.append(shard, {"tokens": np.arange(start, start + per_shard, dtype="<i4")})
    with fault_proxy(http.port, lambda n: "ignore-range") as proxy:
        # records are read whole, so the open works; the first window is a part of a shard
        storage = StreamStorage(f"{proxy.url}/no-range", TOKENS, retry=FAST)
        reader = StreamDataset(storage, WINDOW).sync_reader()
        with reader, pytest.raises(RangeIgnoredError) as caught:
            reader[per_shard // WINDOW + 1]
    message = str(caught.value)
    assert f"{proxy.url}/no-range/0000001.in_band.bin (shard 0000001)" in message
    assert "ignored the HTTP Range header" in message and "whole object (400000 bytes)" in message
    assert not isinstance(caught.value, RemoteReadError)
    reads = [line for _, line in proxy.log if line.startswith("GET /no-range/0000001.in_band")]
    assert len(reads) == 1  # not retried


# --- S3: moto with IAM enforced -------------------------------------------------------------

BUCKET = "refusing"
#: objects the reader's IAM policy denies GetObject on
DENIED = ("denied-record/0000001.shard.json", "denied-data/0000001.in_band.bin")
#: storage_options of a user whose IAM policy denies listing the bucket (set by ``s3``)
BLIND: dict[str, Any] = {}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Server, dict[str, Any]]]:
    """moto's S3 server holding datasets ``denied-record``, ``denied-data`` and ``deleted``,
    then enforcing IAM: the options of a user whose policy allows everything but
    ``GetObject`` of :data:`DENIED`."""
    need_modules("boto3")
    import boto3

    with moto_server() as server:
        fs = server.filesystem()
        fs.mkdir(BUCKET)
        for prefix in ("denied-record", "denied-data", "deleted"):
            local = tmp_path_factory.mktemp(prefix)
            _write(local / "data")
            fs.put(f"{local / 'data'}/", f"{BUCKET}/{prefix}/", recursive=True)
        iam = boto3.client(
            "iam",
            endpoint_url=server.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        iam.create_user(UserName="reader")
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
                {
                    "Effect": "Deny",
                    "Action": "s3:GetObject",
                    "Resource": [f"arn:aws:s3:::{BUCKET}/{key}" for key in DENIED],
                },
            ],
        }
        iam.put_user_policy(UserName="reader", PolicyName="most", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        iam.create_user(UserName="blind")  # may read objects, not list the bucket
        blind_policy = {
            "Version": "2012-10-17",
            "Statement": [
                {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
                # IAM's action for a listing is s3:ListBucket; moto 5.2.6 and later check
                # the request's operation name instead (ListObjectsV2): deny both
                {
                    "Effect": "Deny",
                    "Action": ["s3:ListBucket", "s3:ListObjects", "s3:ListObjectsV2"],
                    "Resource": "*",
                },
            ],
        }
        iam.put_user_policy(
            UserName="blind", PolicyName="no-list", PolicyDocument=json.dumps(blind_policy)
        )
        blind = iam.create_access_key(UserName="blind")["AccessKey"]
        # from now on every request is authenticated and authorised by IAM
        request = urllib.request.Request(
            f"{server.endpoint}/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "text/plain"},  # not a form: the server reads the body
        )
        with urllib.request.urlopen(request, timeout=30):
            pass
        options = server.options(key=key["AccessKeyId"], secret=key["SecretAccessKey"])
        BLIND.update(server.options(key=blind["AccessKeyId"], secret=blind["SecretAccessKey"]))
        yield server, options


def _s3_storage(s3: tuple[S3Server, dict[str, Any]], prefix: str, **kw: Any) -> StreamStorage:
    return StreamStorage(f"s3://{BUCKET}/{prefix}", TOKENS, storage_options=s3[1], retry=FAST, **kw)


def test_s3_access_denied_on_a_record_fails_the_open_with_a_permission_error(
    s3: tuple[S3Server, dict[str, Any]],
) -> None:
    storage = _s3_storage(s3, "denied-record")
    with pytest.raises(PermissionError) as caught:
        StreamDataset(storage, WINDOW).sync_reader().open()
    message = str(caught.value)
    assert f"s3://{BUCKET}/denied-record/0000001.shard.json (shard 0000001)" in message
    assert "HTTP 403, S3 AccessDenied" in message
    assert caught.value.errno == errno.EACCES


def test_s3_access_denied_on_the_listing_fails_the_open_with_a_permission_error(
    s3: tuple[S3Server, dict[str, Any]],
) -> None:
    storage = StreamStorage(f"s3://{BUCKET}/deleted", TOKENS, storage_options=BLIND, retry=FAST)
    with pytest.raises(PermissionError) as caught:
        StreamDataset(storage, WINDOW).sync_reader().open()
    message = str(caught.value)
    assert f"listing s3://{BUCKET}/deleted (the dataset) was refused" in message
    assert "HTTP 403, S3 AccessDenied" in message


@pytest.mark.parametrize("cached", [False, True], ids=["range", "cache"])
def test_s3_access_denied_mid_epoch_is_a_permission_error_naming_the_shard(
    s3: tuple[S3Server, dict[str, Any]], tmp_path: Path, cached: bool
) -> None:
    extra = {"cache_dir": tmp_path / "cache"} if cached else {}
    storage = _s3_storage(s3, "denied-data", **extra)
    with StreamDataset(storage, WINDOW).sync_reader() as reader:  # sizes come from the listing
        assert len(reader) == 250
        assert reader[_sample_in(0)]["tokens"][0] == _sample_in(0) * WINDOW
        with pytest.raises(PermissionError) as caught:
            reader[_sample_in(1)]
    message = str(caught.value)
    assert f"s3://{BUCKET}/denied-data/0000001.in_band.bin (shard 0000001)" in message
    assert "HTTP 403, S3 AccessDenied" in message


def test_an_s3_key_deleted_mid_epoch_names_the_shard_and_the_url(
    s3: tuple[S3Server, dict[str, Any]],
) -> None:
    import s3fs

    storage = _s3_storage(s3, "deleted")
    with StreamDataset(storage, WINDOW).sync_reader() as reader:
        reader[_sample_in(2)]
        s3fs.S3FileSystem(**s3[1]).rm(f"{BUCKET}/deleted/0000002.in_band.bin")
        with pytest.raises(FileNotFoundError) as caught:
            reader[_sample_in(2) + 1]
    message = str(caught.value)
    assert f"s3://{BUCKET}/deleted/0000002.in_band.bin (shard 0000002)" in message
    assert "HTTP 404, S3 NoSuchKey" in message and "open the dataset again" in message
