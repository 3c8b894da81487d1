"""The command line: options, running the chosen scenarios, the printed report and the JSON.

``main`` also serves ``--child-scale``, the scale subprocess (see ``scale``), and
``--child-dataloader-memory``, a loader measured alone (see ``dataloader``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from guideloom_pipes.bench.harness import Row, Sizes
from guideloom_pipes.bench.reporting import report, targets
from guideloom_pipes.bench.scale import scale_child
from guideloom_pipes.bench.scenarios import SCENARIOS, Bench


def _machine() -> dict[str, Any]:
    import torchdata

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torchdata": getattr(torchdata, "__version__", "?"),
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _parser() -> argparse.ArgumentParser:
    defaults = Sizes()
    parser = argparse.ArgumentParser(
        prog="python -m guideloom_pipes.bench",
        description="Throughput of guideloom_pipes against a hand loop and torch's DataLoader.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny data, about a minute")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument(
        "--only",
        help=f"comma-separated scenarios to run (default all: {', '.join(SCENARIOS)})",
    )
    parser.add_argument("--tmpdir", type=Path, help="where to build the data (default: system)")
    sizes = parser.add_argument_group("sizes (defaults: the full run; --quick shrinks them)")
    for name, value in asdict(defaults).items():
        sizes.add_argument(
            "--" + name.replace("_", "-"), type=type(value), default=None, help=f"(full: {value})"
        )
    parser.add_argument("--child-scale", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-shards", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-phase", default="open", help=argparse.SUPPRESS)
    parser.add_argument("--child-dataloader-memory", help=argparse.SUPPRESS)
    parser.add_argument("--child-megatron-open", help=argparse.SUPPRESS)
    parser.add_argument("--child-first-batch", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0, even when targets are missed)."""
    args = _parser().parse_args(argv)
    if args.child_scale is not None:
        rounds = args.resume_rounds if args.resume_rounds is not None else 3
        print(json.dumps(scale_child(args.child_scale, rounds)))
        return 0
    if args.child_shards is not None:
        from guideloom_pipes.bench.scale_shards import shards_child

        print(json.dumps(shards_child(args.child_shards, args.child_phase)))
        return 0
    if args.child_dataloader_memory is not None:
        from guideloom_pipes.bench.dataloader import memory_child

        print(json.dumps(memory_child(json.loads(args.child_dataloader_memory))))
        return 0
    if args.child_first_batch is not None:
        from guideloom_pipes.bench.first_batch import first_batch_child

        print(json.dumps(first_batch_child(json.loads(args.child_first_batch))))
        return 0
    if args.child_megatron_open is not None:
        from guideloom_pipes.bench.corpora import open_child

        print(json.dumps(open_child(json.loads(args.child_megatron_open))))
        return 0
    sizes = Sizes.quick() if args.quick else Sizes()
    for name in asdict(sizes):
        value = getattr(args, name)
        if value is not None:
            setattr(sizes, name, value)
    only = SCENARIOS if not args.only else tuple(s.strip() for s in args.only.split(","))
    unknown = sorted(set(only) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    machine = _machine()
    root = Path(tempfile.mkdtemp(prefix="guideloom-bench-", dir=args.tmpdir))
    bench = Bench(root, sizes, log)
    log(f"guideloom_pipes benchmark in {root} ({'quick' if args.quick else 'full'})")
    try:
        steps: list[tuple[str, Callable[[], None]]] = [
            ("tokens-2048", lambda: bench.stream_scenario("tokens-2048", 2048, 8)),
            ("tokens-128", lambda: bench.stream_scenario("tokens-128", 128, 64)),
            ("meta", bench.meta_scenario),
            ("documents", bench.documents_scenario),
            ("slow-storage", bench.slow_scenario),
            ("shuffle", bench.shuffle_scenario),
            ("scale", bench.scale_scenario),
            ("scale-shards", bench.scale_shards_scenario),
            ("first-batch", bench.first_batch_scenario),
            ("train-loop", bench.train_loop_scenario),
            ("mixture", bench.mixture_scenario),
            ("packed", bench.packed_scenario),
            ("packed-fit", bench.packed_fit_scenario),
            ("parallel-write", bench.parallel_write_scenario),
            ("remote-cache", bench.remote_cache_scenario),
            ("remote-range", bench.remote_range_scenario),
            ("remote-s3", bench.remote_s3_scenario),
            ("shard-order", bench.shard_order_scenario),
            ("pinned-ring", bench.pinned_ring_scenario),
            *[
                (name, lambda name=name: bench.dataloader_scenario(name))
                for name in SCENARIOS
                if name.startswith("dataloader-")
            ],
            *[
                (name, lambda name=name: bench.megatron_scenario(name))
                for name in SCENARIOS
                if name.startswith("megatron-")
            ],
            ("convert-dask", bench.convert_scenario),
            ("parquet-documents", bench.parquet_scenario),
        ]
        for name, step in steps:
            if name in only or (name == "scale" and "resume" in only):
                mark = time.perf_counter()
                step()
                bench.timings[name] = time.perf_counter() - mark
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    goals = targets(bench.rows, bench.extra)
    print(report(bench.rows, bench.extra, goals, verdicts=not args.quick))
    total = time.perf_counter() - started
    print(
        f"\n{len(bench.rows)} rows in {total:.0f} s; load average {machine['loadavg_start']}"
        f" -> {machine['loadavg_end']} on {machine['cpus']} CPUs"
    )
    if args.json is not None:
        payload = {
            "mode": "quick" if args.quick else "full",
            "sizes": asdict(sizes),
            "machine": machine,
            "seconds": total,
            "timings": bench.timings,
            "scenarios": _by_scenario(bench.rows, bench.extra),
            "targets": [
                {**asdict(goal), "passed": None if args.quick else goal.passed} for goal in goals
            ],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def _by_scenario(rows: list[Row], extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        entry = out.setdefault(row.scenario, {"rows": []})
        if row.baseline:
            entry["baseline"] = row.contender
        entry["rows"].append(asdict(row))
    for name, figures in extra.items():  # beside the scenario's rows, where it has some
        out.setdefault(name, {}).update(figures)
    return out
