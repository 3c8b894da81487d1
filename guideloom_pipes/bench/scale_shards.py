"""The ``scale-shards`` scenario: what a dataset costs per shard, with and without a manifest.

Datasets of 10^3 to 10^6 shards of 1,000 int32 tokens each, with commit records (data files
sparse, written by the benchmark itself), each opened in fresh processes (``--child-shards``),
timed after imports (torch, torchdata, the package) from ``StreamStorage(...)``:

* open + first batch of a shuffled loader (``L=2048``, batch 8, ``prefetch=4``), and the peak
  RSS above the post-import RSS;
* resume + first batch: a new loader given a state halfway through the epoch;
* the file-system calls of the open and first batch (``strace -f -c``, where ``strace`` is
  installed): the calls of a child that opens minus those of one that only imports;
* at the largest count, shuffled throughput (samples/s over a bounded number of batches).

Without a manifest, counts above ``scale_listing_max`` are not opened (they take minutes and
gigabytes: the per-shard cost the manifest removes); the table says so.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guideloom_pipes.bench.data import SEED, TOKENS_DTYPE
from guideloom_pipes.storage.manifest import MANIFEST_DIR
from guideloom_pipes.storage.names import IN_BAND, RECORD, shard_name
from guideloom_pipes.storage.records import FileRecord, ShardRecord

TOKENS_PER_SHARD = 1000
LENGTH, BATCH = 2048, 8
#: batches of the throughput row (each window spans about three shards; a reader maps at
#: most an eighth of vm.max_map_count shards at a time, and lets older ones go)
THROUGHPUT_BATCHES = 1500
#: the system calls that touch files (those an open of a dataset makes)
FILE_CALLS = (
    "openat", "open", "close", "read", "pread64", "newfstatat", "fstat", "stat", "statx",
    "lstat", "getdents64", "mmap", "munmap", "readlink", "access", "flock",
)  # fmt: skip


def build_shards(directory: Path, count: int) -> None:
    """``count`` committed shards of zero tokens (sparse files) with their records."""
    directory.mkdir(parents=True)
    size = TOKENS_PER_SHARD * TOKENS_DTYPE.itemsize
    crc = zlib.crc32(bytes(size))
    base = os.fspath(directory)
    for shard in range(count):
        stem = os.path.join(base, shard_name(shard))
        fd = os.open(stem + IN_BAND, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, size)
        os.close(fd)
        record = ShardRecord(
            "stream", shard, TOKENS_PER_SHARD, {"in_band.bin": FileRecord(size, crc)},
            TOKENS_DTYPE,
        )  # fmt: skip
        with open(stem + RECORD, "wb") as file:
            file.write(record.to_json())


def shards_child(directory: Path, phase: str) -> dict[str, Any]:
    """In a fresh process: ``phase`` is ``import`` (nothing more), ``open`` (open + first
    batch), ``resume`` (the same, given a state halfway) or ``throughput``."""
    import torchdata.nodes  # noqa: F401  - part of "after imports"

    from guideloom_pipes.bench.contenders import CPU
    from guideloom_pipes.bench.data import collate_tokens
    from guideloom_pipes.bench.harness import _close_iterator
    from guideloom_pipes.bench.scale import _proc_status_kb, _reset_peak_rss
    from guideloom_pipes.formats import StreamNumpyFormat
    from guideloom_pipes.loader import StatefulDataLoader
    from guideloom_pipes.storage import StreamStorage

    if phase == "import":
        return {}
    gc.collect()
    base = _proc_status_kb("VmRSS") or 0
    _reset_peak_rss()
    started = time.perf_counter()
    storage = StreamStorage(directory, StreamNumpyFormat(TOKENS_DTYPE))
    loader = StatefulDataLoader.from_storage(
        storage, collate_tokens, sequence_length=LENGTH, local_batch_size=BATCH,
        num_workers=0, prefetch=4, shuffle=True, shuffle_seed=SEED, device=CPU,
    )  # fmt: skip
    with loader:
        if phase == "resume":
            half = (len(loader) // 2) * BATCH
            loader.load_state_dict(
                {"epoch": 0, "observation_offset": half, "shuffle": True,
                 "shuffle_seed": SEED, "drop_last": True}
            )  # fmt: skip
        iterator = iter(loader)
        next(iterator)
        first = time.perf_counter() - started
        peak = (_proc_status_kb("VmHWM") or 0) - base
        result: dict[str, Any] = {"first_batch_s": first, "peak_rss_above_import_mb": peak / 1024}
        if phase == "throughput":
            batches = min(THROUGHPUT_BATCHES, len(loader) - 1)
            mark = time.perf_counter()
            for _ in range(batches):
                next(iterator)
            result["samples_per_s"] = batches * BATCH / (time.perf_counter() - mark)
        _close_iterator(iterator)
    return result


def _child(directory: Path, phase: str, strace: str | None = None) -> dict[str, Any]:
    command = [sys.executable, "-m", "guideloom_pipes.bench", "--child-shards", str(directory),
               "--child-phase", phase]  # fmt: skip
    summary = None
    if strace is not None:
        summary = tempfile.mktemp(prefix="strace-", suffix=".txt")
        command = [strace, "-f", "-c", "-o", summary, *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"the scale-shards child failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if summary is not None:
        result["calls"] = _calls(Path(summary))
        os.unlink(summary)
    return result


def _calls(summary: Path) -> dict[str, int]:
    """System calls per name from an ``strace -c`` summary."""
    calls: dict[str, int] = {}
    for line in summary.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3])
    return calls


def _file_calls(opened: dict[str, int], imported: dict[str, int]) -> int:
    return sum(max(0, opened.get(c, 0) - imported.get(c, 0)) for c in FILE_CALLS)


def scale_shards_rows(
    root: Path, counts: tuple[int, ...], listing_max: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Build each dataset, measure it without and with its manifest; the figures by count."""
    from guideloom_pipes.formats import StreamNumpyFormat
    from guideloom_pipes.storage import StreamStorage

    strace = shutil.which("strace")
    imported = _child(root, "import", strace)["calls"] if strace else {}
    figures: dict[str, Any] = {"strace": strace is not None}
    for count in counts:
        directory = root / f"shards-{count}"
        mark = time.perf_counter()
        build_shards(directory, count)
        row: dict[str, Any] = {"build_s": time.perf_counter() - mark}
        if count <= listing_max:
            row["listing"] = _measure(directory, strace, imported)
        mark = time.perf_counter()
        StreamStorage(directory, StreamNumpyFormat(TOKENS_DTYPE)).index()
        row["index_s"] = time.perf_counter() - mark
        row["manifest_bytes"] = sum(p.stat().st_size for p in (directory / MANIFEST_DIR).iterdir())
        row["manifest"] = _measure(directory, strace, imported)
        if count == max(counts):
            row["throughput"] = _child(directory, "throughput")
        figures[str(count)] = row
        log(_line(count, row))
        shutil.rmtree(directory, ignore_errors=True)
    return figures


def _measure(directory: Path, strace: str | None, imported: dict[str, int]) -> dict[str, Any]:
    opened = _child(directory, "open")
    resumed = _child(directory, "resume")
    found = {
        "open_first_batch_s": opened["first_batch_s"],
        "peak_rss_above_import_mb": opened["peak_rss_above_import_mb"],
        "resume_first_batch_s": resumed["first_batch_s"],
    }
    if strace is not None:
        found["file_calls"] = _file_calls(_child(directory, "open", strace)["calls"], imported)
    return found


def _line(count: int, row: dict[str, Any]) -> str:
    def part(name: str) -> str:
        found = row.get(name)
        if found is None:
            return f"{name}: not opened"
        calls = f", {found['file_calls']:,} file calls" if "file_calls" in found else ""
        return (
            f"{name}: open+first {found['open_first_batch_s']:.3f} s, resume+first "
            f"{found['resume_first_batch_s']:.3f} s, "
            f"{found['peak_rss_above_import_mb']:.0f} MB{calls}"
        )

    speed = row.get("throughput")
    rate = f"; shuffled {speed['samples_per_s']:,.0f} samples/s" if speed else ""
    return f"  scale-shards  {count:>9,} shards  {part('listing')}  |  {part('manifest')}{rate}"
