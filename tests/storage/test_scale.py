"""Scale: more than 2**40 tokens in sparse shards, and thousands of shards under ulimit -n 1024."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage
from guideloom_pipes.io import MmapIO, PosixPreadIO, SeekIO

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
TOKENS = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))

# Sparse shards ------------------------------------------------------------------------------

BIG = 2**36  # elements per big shard: 256 GiB of <i4 each, all of it a hole
BIG_SHARDS = 16  # 2**40 tokens in the big shards
PLANTED_SHARD = 5
PLANTED_AT = 2**32 + 3 * 2048  # element offset inside that shard, past 2**32 (and 2**34 bytes)
PLANTED = np.arange(2 * 2048, dtype="<i4") + 7
TAIL = np.arange(3000, dtype="<i4") + 1_000_000  # shard 16, real bytes
TOTAL = BIG_SHARDS * BIG + len(TAIL)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GuideLoom-style sparse shards (no records) holding 2**40 + 3000 tokens."""
    path = tmp_path_factory.mktemp("sparse")
    try:
        for shard in range(BIG_SHARDS):
            with open(path / f"{shard:07d}.in_band.bin", "wb") as file:
                os.truncate(file.fileno(), BIG * 4)
    except OSError as error:
        pytest.skip(f"the file system of {path} refuses a sparse file of 2**38 bytes: {error}")
    fd = os.open(path / f"{PLANTED_SHARD:07d}.in_band.bin", os.O_WRONLY)
    try:
        os.pwrite(fd, PLANTED.tobytes(), PLANTED_AT * 4)
    finally:
        os.close(fd)
    (path / f"{BIG_SHARDS:07d}.in_band.bin").write_bytes(TAIL.tobytes())
    return path


BACKENDS = [MmapIO(), PosixPreadIO(), SeekIO()]


def test_sparse_shards_take_no_disk(sparse: Path) -> None:
    assert sum(p.stat().st_blocks * 512 for p in sparse.iterdir()) < 2**24
    assert sum(p.stat().st_size for p in sparse.iterdir()) == TOTAL * 4


def test_a_dataset_of_more_than_2_40_tokens_reports_its_length(sparse: Path) -> None:
    storage = StreamStorage(sparse, TOKENS)
    assert len(StreamDataset(storage, 2048)) == TOTAL // 2048 == 2**29 + 1
    with storage.sync_reader() as reader:
        assert reader.total_length == TOTAL
        assert reader.num_shards == BIG_SHARDS + 1
        assert reader.length(PLANTED_SHARD) == BIG


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
def test_windows_beyond_2_32_read_back_the_planted_bytes(sparse: Path, backend: Any) -> None:
    start = PLANTED_SHARD * BIG + PLANTED_AT
    assert start % 2048 == 0 and start > 2**38
    sample = start // 2048
    with StreamDataset(StreamStorage(sparse, TOKENS, backend), 2048).sync_reader() as reader:
        assert np.array_equal(reader[sample]["tokens"], PLANTED[:2048])
        assert np.array_equal(reader[sample + 1]["tokens"], PLANTED[2048:])
        assert not reader[sample + 2]["tokens"].any()  # the hole after them reads as zeros
        batch = reader.read_batch(np.array([sample + 1, 0, sample]))
        assert np.array_equal(batch[0]["tokens"], PLANTED[2048:])
        assert np.array_equal(batch[2]["tokens"], PLANTED[:2048])


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
def test_the_last_window_and_the_wrap_around_of_a_huge_stream(sparse: Path, backend: Any) -> None:
    storage = StreamStorage(sparse, TOKENS, backend)
    with StreamDataset(storage, 2048).sync_reader() as reader:
        assert np.array_equal(reader[len(reader) - 1]["tokens"], TAIL[:2048])
    with storage.sync_reader() as reader:
        across = reader.read(BIG_SHARDS * BIG - 4, 8)["tokens"]  # shard 15 into shard 16
        assert across.tolist() == [0, 0, 0, 0, *TAIL[:4].tolist()]
        wrapped = reader.read(TOTAL - 2, 4)["tokens"]  # past the end, back to shard 0
        assert wrapped.tolist() == [*TAIL[-2:].tolist(), 0, 0]
        exact = reader.read(PLANTED_SHARD * BIG + PLANTED_AT + 5, 3)["tokens"]
        assert exact.tolist() == PLANTED[5:8].tolist()


# Thousands of shards, few descriptors --------------------------------------------------------


def run_limited(script: str, limit: int, *args: str) -> dict[str, Any]:
    """Run ``script`` in a child whose descriptor limit is ``limit``; its JSON output."""
    prologue = f"""
        import resource
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, hard))
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(prologue) + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    result: dict[str, Any] = json.loads(child.stdout.splitlines()[-1])
    return result


READ_EVERY_SHARD = """
    import json, os, sys, time
    from pathlib import Path
    import numpy as np
    from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage
    from guideloom_pipes.io import PosixPreadIO

    path, shards = Path(sys.argv[1]), int(sys.argv[2])
    tokens = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
    # Shard k holds 3k, 3k+1, 3k+2: with windows of 3, sample k is shard k.
    expected = np.arange(3 * shards, dtype="<i4").reshape(shards, 3)
    times = {}

    def read_all(backend, name):
        started = time.perf_counter()
        with StreamDataset(StreamStorage(path, tokens, backend), 3).sync_reader() as reader:
            assert reader.storage_reader.num_shards == shards
            opened = time.perf_counter()
            got = np.stack([s["tokens"] for s in reader.read_batch(np.arange(shards))])
            assert np.array_equal(got, expected)
            one_by_one = [reader[k]["tokens"][0] for k in range(0, shards, 7)]
            assert one_by_one == list(range(0, 3 * shards, 21))
        times[name + "_open"] = opened - started
        times[name + "_read"] = time.perf_counter() - opened

    read_all(None, "mmap")
    read_all(PosixPreadIO(), "pread")
    times["open_fds"] = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    print(json.dumps(times))
"""


@pytest.mark.timeout(120)
def test_ten_thousand_guideloom_shards_open_and_read_under_ulimit_1024(tmp_path: Path) -> None:
    shards = 10_000
    for shard in range(shards):
        tokens = np.arange(3 * shard, 3 * shard + 3, dtype="<i4")
        (tmp_path / f"{shard:07d}.in_band.bin").write_bytes(tokens.tobytes())
    times = run_limited(READ_EVERY_SHARD, 1024, str(tmp_path), str(shards))
    assert times["open_fds"] < 16  # nothing left open either


WRITE_IN_BATCHES = """
    import json, os, sys, time
    from pathlib import Path
    import numpy as np
    from guideloom_pipes import StreamNumpyFormat, StreamStorage

    os.fsync = lambda fd: None  # durability is not under test here, only descriptors
    path, shards, batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    storage = StreamStorage(path, StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    started = time.perf_counter()
    for first in range(0, shards, batch):
        with storage.sync_writer() as writer:
            for shard in range(first, min(shards, first + batch)):
                writer.append(shard, {"tokens": np.arange(3 * shard, 3 * shard + 3)})
    print(json.dumps({"write": time.perf_counter() - started}))
"""


@pytest.mark.timeout(120)
def test_our_writer_in_batches_and_our_readers_work_under_ulimit_1024(tmp_path: Path) -> None:
    # 1,500 shards: more than the descriptor limit, so neither writing in batches nor
    # opening (commit records included) may hold a descriptor per shard.
    shards = 1_500
    run_limited(WRITE_IN_BATCHES, 1024, str(tmp_path), str(shards), "480")
    assert len(list(tmp_path.glob("*.shard.json"))) == shards
    run_limited(READ_EVERY_SHARD, 1024, str(tmp_path), str(shards))


TOO_MANY_FOR_ONE_WRITER = """
    import json, sys
    from pathlib import Path
    import numpy as np
    from guideloom_pipes import StreamNumpyFormat, StreamStorage

    storage = StreamStorage(Path(sys.argv[1]), StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    try:
        with storage.sync_writer() as writer:
            for shard in range(100):
                writer.append(shard, {"tokens": np.arange(3)})
    except OSError as error:
        print(json.dumps({"errno": error.errno, "message": str(error)}))
"""


@pytest.mark.timeout(60)
def test_a_writer_past_the_descriptor_limit_says_how_many_shards_fit(tmp_path: Path) -> None:
    result = run_limited(TOO_MANY_FOR_ONE_WRITER, 64, str(tmp_path))
    message = result["message"]
    assert "too many open files while starting shard 00000" in message
    assert "keeps 2 file descriptors open per shard" in message
    assert "the limit is 64 descriptors" in message
    assert "close it and open a new one" in message
    open_shards = int(message.split(" shards open")[0].rsplit(" ", 1)[1])
    assert f"at most about {open_shards - open_shards // 10} shards per writer" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the with block aborted it all


def test_a_reader_keeps_no_state_for_the_shards_it_has_not_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opened from its manifest, a reader of many shards holds their bounds (two int64
    arrays: 16 bytes a shard) and nothing per shard until a read touches it: its readers,
    mappings and grids are kept for the shards touched (lists of every shard cost 8 bytes a
    shard each, 40 MB at a million shards)."""
    import tracemalloc

    from guideloom_pipes.storage import window_grid

    # as past 65,536 shards: the bounds are not also kept as lists of Python ints
    monkeypatch.setattr(window_grid, "LISTED_SHARDS", 1)
    shards, per_shard = 5000, 64
    storage = StreamStorage(tmp_path / "d", TOKENS)
    with storage.sync_writer() as writer:
        for shard in range(shards):
            writer.append(shard, {"tokens": np.full(per_shard, shard, "<i4")})
    storage.index()
    tracemalloc.start()
    try:
        with storage.sync_reader() as reader:
            starts = np.array([0, 8 * per_shard - 5, (shards - 1) * per_shard])
            windows = reader.read_windows(starts, 16)["tokens"]
            held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert windows.shape == (3, 16)
    assert windows[:, 0].tolist() == [0, 7, shards - 1] and windows[1, -1] == 8  # 7 -> 8
    assert held < 24 * shards + 64 * 1024, f"{held / shards:.0f} bytes a shard"
