"""The parallel-write scenario: ``write_parallel`` with a CPU-bound conversion on a process
pool of 2 workers against 1, and on a Dask ``LocalCluster`` of 2 worker processes against 1
(when Dask is installed); items per second, records and bytes."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from guideloom_pipes.bench.harness import Row, Sizes
from guideloom_pipes.formats import StreamNumpyFormat
from guideloom_pipes.parallel import write_parallel
from guideloom_pipes.storage import StreamStorage

#: rows of the scenario
POOL_1, POOL_2 = "process pool, 1 worker", "process pool, 2 workers"
DASK_1, DASK_2 = "Dask LocalCluster, 1 worker", "Dask LocalCluster, 2 workers"
#: rounds of mixing per token: the conversion's CPU cost (about 0.1 s per item of 250k tokens)
MIX_ROUNDS = 512


def convert_cpu_bound(item: tuple[int, int]) -> Iterator[dict[str, np.ndarray]]:
    """A CPU-bound conversion (a stand-in for tokenising): ``count`` tokens drawn from
    ``seed``, each mixed ``MIX_ROUNDS`` times in place (no temporaries: the cost is the
    arithmetic, not the allocator), in records of 64k tokens."""
    seed, count = item
    state = np.arange(seed * count, (seed + 1) * count, dtype=np.int64)
    shifted = np.empty_like(state)
    for _ in range(MIX_ROUNDS):
        np.multiply(state, 1103515245, out=state)
        np.add(state, 12345, out=state)
        np.bitwise_and(state, 0x7FFFFFFF, out=state)
        np.right_shift(state, 7, out=shifted)
        np.bitwise_xor(state, shifted, out=state)
    tokens = (state % 50_000).astype("<i4")
    for start in range(0, count, 1 << 16):
        yield {"tokens": tokens[start : start + (1 << 16)]}


def _items(sizes: Sizes) -> list[tuple[int, int]]:
    # 24 items of tokens/400 tokens (250k each in a full run: about 0.1 s of CPU each)
    per_item = max(sizes.tokens // 400, 5_000)
    return [(seed, per_item) for seed in range(24)]


def _measure(
    name: str,
    root: Path,
    items: list[tuple[int, int]],
    executor: cf.Executor,
    rounds: int,
) -> dict[str, Any]:
    storage = StreamStorage(root / name.replace(" ", "_"), StreamNumpyFormat([("tokens", "<i4")]))
    write_parallel(storage, items[:2], convert_cpu_bound, executor=executor, progress=False)
    walls = []
    for _ in range(rounds):
        started = time.perf_counter()
        report = write_parallel(
            storage, items, convert_cpu_bound, executor=executor, progress=False, resume=False
        )
        walls.append(time.perf_counter() - started)
    shutil.rmtree(storage.dir, ignore_errors=True)
    wall = statistics.median(walls)
    return {
        "contender": name,
        "wall_s": wall,
        "items_per_s": len(items) / wall,
        "tokens_per_s": sum(count for _, count in items) / wall,
        "records": report.records,
        "bytes": report.bytes,
        "rounds": [
            {"wall_s": w, "items": len(items), "tokens_per_item": items[0][1]} for w in walls
        ],
    }


def _pool(workers: int) -> cf.ProcessPoolExecutor:
    pool = cf.ProcessPoolExecutor(max_workers=workers)
    list(pool.map(abs, range(4 * workers)))  # start the workers
    return pool


@contextlib.contextmanager
def _dask(workers: int) -> Iterator[cf.Executor]:
    from dask.distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        worker_dashboard_address=None,
    )
    try:
        with Client(cluster) as client:
            yield client.get_executor()
    finally:
        cluster.close()


def parallel_write_rows(root: Path, sizes: Sizes, log: Callable[[str], None]) -> list[Row]:
    """The rows of the scenario (each round: its wall time, the items and their tokens)."""
    items = _items(sizes)
    results: list[dict[str, Any]] = []
    for workers, name in ((1, POOL_1), (2, POOL_2)):
        with _pool(workers) as pool:
            results.append(_measure(name, root, items, pool, sizes.rounds))
    try:
        import dask.distributed  # noqa: F401
    except ImportError:
        log("  parallel-write: no Dask rows (pip install 'guideloom-pipes[dask]')")
    else:
        for workers, name in ((1, DASK_1), (2, DASK_2)):
            with _dask(workers) as executor:
                results.append(_measure(name, root, items, executor, sizes.rounds))
    rows = []
    for result in results:
        base = results[0] if result["contender"].startswith("process") else results[2]
        ratio = base["wall_s"] / result["wall_s"]
        log(
            f"  parallel-write {result['contender']:<30} {result['items_per_s']:8.1f} items/s, "
            f"{result['tokens_per_s'] / 1e6:6.1f} M tokens/s ({ratio:.2f}x one worker)"
        )
        rows.append(
            Row(
                scenario="parallel-write",
                contender=result["contender"],
                samples_per_s=result["items_per_s"],
                tokens_per_s=result["tokens_per_s"],
                cpu_s_per_1m_samples=float("nan"),
                ratio_to_baseline=ratio,
                baseline=result is base,
                first_batch_s=0.0,
                rounds=result["rounds"],
            )
        )
    return rows
