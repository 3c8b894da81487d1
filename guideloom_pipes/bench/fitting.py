"""The ``packed-fit`` scenario: best-fit packing against cut-and-concatenate packing.

A document storage of ``sizes.documents`` documents whose lengths spread log-normally
(``exp(N(MU, SIGMA))`` tokens, at least 1: median about 490, mean about 1,000, a long tail
past the window), int32 token arrays pickled, in ``sizes.shards`` shards. For windows of
``LENGTH`` tokens:

- figures (``extra["packed-fit"]``): for ``packing="concat"``, ``"first_fit"`` and
  ``"best_fit"`` (the last two with the same look-ahead, ``LOOKAHEAD``), the windows, the
  fraction of their tokens that is padding, the documents split over more than one window
  (and, for concat, the tokens dropped at the end), and how long the one-time passes took
  (the prefix sums: a read of every document; each plan: from the sums); the two fits'
  padding with the smaller look-aheads of ``SWEEP`` too;
- rows: ``PackedDataset`` of each packing through ``StatefulDataLoader`` (batch 8,
  shuffled, ``collate_packed``) with 0 and 2 thread workers; the target is best fit at
  0.7x concat or more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from guideloom_pipes.bench.contenders import _ours_dataset_contender, dataset_row
from guideloom_pipes.bench.data import SEED, _count_tokens, _split
from guideloom_pipes.bench.harness import Row, Sizes, measure
from guideloom_pipes.formats import DocumentPickleFormat
from guideloom_pipes.storage import DocumentStorage

SCENARIO = "packed-fit"
#: The log-normal spread of the document lengths (of ``log(tokens)``).
MU, SIGMA = 6.2, 1.2
LENGTH, BATCH, LOOKAHEAD = 2048, 8, 1024
#: Smaller look-aheads whose padding is reported too (figures only, no rows).
SWEEP = (16, 128)
PAD = 0
CONCAT = "concat (packing='concat')"
BEST_FIT = "best fit (packing='best_fit')"
PACKINGS = {"concat": CONCAT, "best_fit": BEST_FIT}


def row(packing: str, workers: int) -> str:
    """The row name of ``packing`` through our loader with ``workers`` threads."""
    return dataset_row(PACKINGS[packing], workers)


def build_corpus(directory: Path, count: int, shards: int) -> tuple[DocumentStorage, np.ndarray]:
    """``count`` documents of log-normal lengths (int32 token arrays, pickled) in
    ``shards`` shards; the storage and the lengths."""
    rng = np.random.default_rng(SEED + 4)
    lengths = np.maximum(1, rng.lognormal(MU, SIGMA, count).astype(np.int64))
    pool = rng.integers(1, 50_000, int(lengths.max()) + 97, dtype=np.int32)
    storage = DocumentStorage(directory, DocumentPickleFormat())
    with storage.sync_writer() as writer:
        index = 0
        for shard, part in enumerate(_split(count, shards)):
            for _ in range(part):
                shift = index % 97
                writer.append(shard, pool[shift : shift + int(lengths[index])])
                index += 1
    return storage, lengths


def concat_figures(lengths: np.ndarray, length: int) -> dict[str, float]:
    """Windows, padding (none), documents split and tokens dropped of cut-and-concatenate."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    windows = int(ends[-1]) // length if len(ends) else 0
    split = (starts // length) != ((ends - 1) // length)
    return {
        "windows": windows,
        "padding_fraction": 0.0,
        "documents_split": int(np.count_nonzero(split)),
        "tokens_dropped": int(ends[-1]) - windows * length if len(ends) else 0,
    }


def fit_figures(
    lengths: np.ndarray, length: int, packing: str, lookahead: int = LOOKAHEAD
) -> dict[str, float]:
    """Windows, padding fraction and documents split of a fit, and its planning time."""
    from guideloom_pipes.packing_plan import plan_windows

    started = time.perf_counter()
    plan = plan_windows(lengths, length, packing=packing, lookahead=lookahead)
    seconds = time.perf_counter() - started
    tokens = int(plan.piece_sizes(lengths, length).sum())
    capacity = plan.windows * length
    pieces = np.bincount(plan.positions, minlength=len(lengths))
    return {
        "windows": plan.windows,
        "padding_fraction": (capacity - tokens) / capacity if capacity else 0.0,
        "documents_split": int(np.count_nonzero(pieces > 1)),
        "tokens_dropped": int(lengths.sum()) - tokens,
        "plan_s": seconds,
    }


def packed_fit_rows(
    root: Path, sizes: Sizes, log: Callable[[str], None], extra: dict[str, Any]
) -> list[Row]:
    """The scenario's figures into ``extra[SCENARIO]``, and its throughput rows."""
    from guideloom_pipes.packing import PackedDataset
    from guideloom_pipes.pipes.packed import collate_packed

    started = time.perf_counter()
    storage, lengths = build_corpus(root / SCENARIO, sizes.documents, sizes.shards)
    built = time.perf_counter() - started
    datasets = {
        "concat": PackedDataset(storage, LENGTH),
        "best_fit": PackedDataset(storage, LENGTH, packing="best_fit", pad_token=PAD),
    }
    started = time.perf_counter()
    len(datasets["concat"])  # the prefix sums: every document read once
    sums_s = time.perf_counter() - started
    started = time.perf_counter()
    windows = len(datasets["best_fit"])  # the plan from the sums, written beside them
    open_s = time.perf_counter() - started
    figures: dict[str, Any] = {
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "mu": MU,
        "sigma": SIGMA,
        "mean_length": float(lengths.mean()),
        "median_length": float(np.median(lengths)),
        "longer_than_window": int(np.count_nonzero(lengths > LENGTH)),
        "sequence_length": LENGTH,
        "lookahead": LOOKAHEAD,
        "build_s": built,
        "prefix_sums_s": sums_s,
        "best_fit_first_open_s": open_s,
        "concat": concat_figures(lengths, LENGTH),
        "first_fit": fit_figures(lengths, LENGTH, "first_fit"),
        "best_fit": fit_figures(lengths, LENGTH, "best_fit"),
        "sweep": {
            str(lookahead): {
                packing: fit_figures(lengths, LENGTH, packing, lookahead)
                for packing in ("first_fit", "best_fit")
            }
            for lookahead in SWEEP
        },
    }
    assert figures["best_fit"]["windows"] == windows
    extra[SCENARIO] = figures
    for packing in ("concat", "first_fit", "best_fit"):
        f = figures[packing]
        log(
            f"  {SCENARIO:<13} {packing:<9} {f['windows']:>9,} windows, padding "
            f"{f['padding_fraction']:.2%}, {f['documents_split']:,} documents split"
        )
    contenders = [
        _ours_dataset_contender(
            row(packing, workers),
            datasets[packing],
            collate_packed,
            _count_tokens(LENGTH),
            local_batch_size=BATCH,
            num_workers=workers,
            parallel_method="thread",
            prefetch=4,
        )
        for workers in (0, 2)
        for packing in ("concat", "best_fit")
    ]
    return measure(SCENARIO, contenders, sizes, log)


def figure_lines(extra: dict[str, Any]) -> list[list[str]]:
    """The report's lines of the scenario's figures (``[scenario, measure, value]``)."""
    figures = extra.get(SCENARIO)
    if not figures:
        return []
    lines = [
        [
            SCENARIO,
            f"corpus: {figures['documents']:,} documents, log-normal mu={figures['mu']}, "
            f"sigma={figures['sigma']}",
            f"mean {figures['mean_length']:,.0f} tokens, median {figures['median_length']:,.0f}"
            f"; {figures['longer_than_window']:,} longer than L={figures['sequence_length']}",
        ]
    ]
    for packing in ("concat", "first_fit", "best_fit"):
        f = figures[packing]
        what = packing if packing == "concat" else f"{packing}, lookahead={figures['lookahead']}"
        lines.append(
            [
                SCENARIO,
                what,
                f"{f['windows']:,} windows; padding {f['padding_fraction']:.2%}; "
                f"{f['documents_split']:,} documents split; {f['tokens_dropped']:,} tokens "
                f"dropped" + (f"; plan {f['plan_s']:.2f} s" if "plan_s" in f else ""),
            ]
        )
    for lookahead, fits in figures.get("sweep", {}).items():
        lines.append(
            [
                SCENARIO,
                f"lookahead={lookahead}: padding",
                "; ".join(
                    f"{packing} {f['padding_fraction']:.2%} ({f['windows']:,} windows)"
                    for packing, f in fits.items()
                ),
            ]
        )
    lines.append(
        [
            SCENARIO,
            "one-time passes",
            f"prefix sums {figures['prefix_sums_s']:.2f} s (every document read); best-fit "
            f"first open {figures['best_fit_first_open_s']:.2f} s (plan computed, written)",
        ]
    )
    return lines
