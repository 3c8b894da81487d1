"""The shard order over HTTP (nginx, through the tests' proxy that logs requests): a stream
shard is one ranged request per epoch in range mode, one download with the shard cache, and
the batches are the local dataset's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from remote_servers import HttpServer, fault_proxy

pytest.importorskip("torch")

from guideloom_pipes import StatefulDataLoader, StreamNumpyFormat, StreamStorage
from guideloom_pipes.storage.remote import RetryPolicy

#: These tests run against servers on loopback (nginx, moto, the fault proxy).
pytestmark = pytest.mark.remote

TOKENS = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
FAST = RetryPolicy(attempts=6, base_delay=0.001, max_delay=0.01, timeout=10)
SHARDS, PER_SHARD, WINDOW = 4, 1000, 50


def _write(directory: Path) -> None:
    with StreamStorage(directory, TOKENS).sync_writer() as writer:
        for shard in range(SHARDS):
            first = shard * PER_SHARD
            writer.append(shard, {"tokens": np.arange(first, first + PER_SHARD, dtype="<i4")})


def _data_gets(proxy: Any) -> list[str]:
    names = {f"/{shard:07d}.in_band.bin " for shard in range(SHARDS)}
    return [
        line
        for _, line in proxy.log
        if line.startswith("GET") and any(name in line for name in names)
    ]


def _epochs(storage: StreamStorage, epochs: int, **kw: Any) -> list[list[list[int]]]:
    loader = StatefulDataLoader.from_storage(
        storage,
        sequence_length=WINDOW,
        batch_size=4,
        shuffle=True,
        shuffle_seed=9,
        device="cpu",
        drop_last=False,
        order="shards",
        shuffle_buffer=30,
        **kw,
    )
    with loader:
        return [[batch["tokens"][:, 0].tolist() for batch in loader] for _ in range(epochs)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_range_mode_reads_each_shard_in_one_request_per_epoch(
    http: HttpServer, num_workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="guideloom_pipes.remote")
    name = f"ranged{num_workers}"
    _write(http.root / name)
    local = _epochs(StreamStorage(http.root / name, TOKENS), 2)
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        remote = StreamStorage(f"{proxy.url}/{name}", TOKENS, retry=FAST)
        assert _epochs(remote, 2, num_workers=num_workers, prefetch=num_workers) == local
    # the global order would make one request per window: 80 per epoch here. A request
    # that failed (on a loaded machine one can outlast the policy's timeout) was tried
    # again, and that retry is logged
    retries = [
        r.getMessage()
        for r in caplog.records
        if r.name == "guideloom_pipes.remote" and r.getMessage().startswith("reading bytes")
    ]
    assert len(_data_gets(proxy)) == 2 * SHARDS + len(retries), (proxy.log, retries)


def test_with_the_shard_cache_each_shard_is_downloaded_once(
    http: HttpServer, tmp_path: Path
) -> None:
    _write(http.root / "cached")
    local = _epochs(StreamStorage(http.root / "cached", TOKENS), 2)
    with fault_proxy(http.port, lambda n: "pass") as proxy:
        remote = StreamStorage(
            f"{proxy.url}/cached", TOKENS, cache_dir=tmp_path / "cache", retry=FAST
        )
        assert _epochs(remote, 2) == local
    assert len(_data_gets(proxy)) == SHARDS
