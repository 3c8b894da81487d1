"""The drop-in scenarios: ``guideloom_pipes.DataLoader`` against
``torch.utils.data.DataLoader`` given the same dataset and the same arguments.

- ``dataloader-tokens``: the token windows of ``tokens-2048`` as a map-style torch
  ``Dataset`` (``MemmapWindows``), ``batch_size=8, shuffle=True``, ``collate_fn`` left out
  (torch's ``default_collate``), 0 and 2 workers.
- ``dataloader-documents``: the pickled documents (``MemmapDocuments``), ``batch_size=32``,
  the padding collate, 0 and 2 workers.
- ``dataloader-iterable``: the same documents as an ``IterableDataset`` (each worker reads
  every ``num_workers``-th document), 2 workers.
- ``dataloader-memory``: the total PSS of each loader's process tree (the process and its
  workers, shared memory counted once), each loader in a fresh process of its own
  (``--child-dataloader-memory``), alternating.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from guideloom_pipes.bench.contenders import MemmapDocuments, MemmapWindows
from guideloom_pipes.bench.data import (
    SEED,
    TOKENS_DTYPE,
    _count_padded,
    _count_tokens,
    collate_pad,
)
from guideloom_pipes.bench.harness import (
    Contender,
    Row,
    Sizes,
    descendants,
    measure,
    process_table,
)
from guideloom_pipes.formats import StreamNumpyFormat
from guideloom_pipes.storage import DocumentStorage, StreamStorage

TOKENS_SCENARIO = "dataloader-tokens"
DOCUMENTS_SCENARIO = "dataloader-documents"
ITERABLE_SCENARIO = "dataloader-iterable"
MEMORY_SCENARIO = "dataloader-memory"
#: The token windows' length and batch (as ``tokens-2048``), the documents' batch.
LENGTH, TOKENS_BATCH, DOCUMENTS_BATCH = 2048, 8, 32


def row(ours: bool, workers: int) -> str:
    """A row's name: whose ``DataLoader``, with how many workers."""
    who = "guideloom_pipes.DataLoader" if ours else "torch DataLoader"
    return f"{who} workers={workers}"


class DocumentStream(torch.utils.data.IterableDataset):
    """The documents as an ``IterableDataset``: worker ``k`` of ``n`` yields documents
    ``k, k + n, ...`` (all of them without workers), as torch's docs shard a stream."""

    def __init__(self, documents: MemmapDocuments) -> None:
        self.documents = documents

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(first, len(self.documents), step):
            yield self.documents[index]


def _loader(ours: bool, dataset: Any, workers: int, **arguments: Any) -> Any:
    """torch's or our ``DataLoader`` over ``dataset`` with the same arguments."""
    from guideloom_pipes import DataLoader

    cls = DataLoader if ours else torch.utils.data.DataLoader
    return cls(dataset, num_workers=workers, **arguments)


def _contender(
    ours: bool, dataset: Any, workers: int, count: Callable[[Any], Any], **arguments: Any
) -> Contender:
    loader = _loader(ours, dataset, workers, **arguments)
    # both keep prefetch_factor (2) batches per worker in flight
    return Contender(
        row(ours, workers),
        lambda: iter(loader),
        count,
        teardown=getattr(loader, "close", lambda: None),
        ahead=2 * workers,
    )


def _map_arguments(batch: int, collate: Any = None) -> dict[str, Any]:
    arguments: dict[str, Any] = {"batch_size": batch, "shuffle": True, "collate_fn": collate}
    # a generator per loader, seeded alike: both draw the same order
    arguments["generator"] = torch.Generator().manual_seed(SEED)
    return arguments


def _map_rows(
    scenario: str,
    dataset: Callable[[], Any],
    batch: int,
    collate: Any,
    count: Any,
    sizes: Sizes,
    log: Any,
) -> list[Row]:
    """A map-style scenario: torch's loader and ours, 0 and 2 workers, each over its own
    ``dataset()``; torch's with 0 workers is the baseline."""
    contenders = [
        _contender(ours, dataset(), workers, count, **_map_arguments(batch, collate))
        for workers in (0, 2)
        for ours in (False, True)
    ]
    return measure(scenario, contenders, sizes, log)


def tokens_rows(storage: StreamStorage, sizes: Sizes, log: Any) -> list[Row]:
    """``dataloader-tokens``: windows, ``collate_fn`` left out (torch's default)."""
    return _map_rows(
        TOKENS_SCENARIO,
        lambda: MemmapWindows(storage, LENGTH),
        TOKENS_BATCH,
        None,
        _count_tokens(LENGTH),
        sizes,
        log,
    )


def documents_rows(storage: DocumentStorage, sizes: Sizes, log: Any) -> list[Row]:
    """``dataloader-documents``: the padding collate."""
    return _map_rows(
        DOCUMENTS_SCENARIO,
        lambda: MemmapDocuments(storage),
        DOCUMENTS_BATCH,
        collate_pad,
        _count_padded,
        sizes,
        log,
    )


def iterable_rows(storage: DocumentStorage, sizes: Sizes, log: Any) -> list[Row]:
    """``dataloader-iterable``: torch's loader with 2 workers is the baseline."""
    contenders = [
        _contender(
            ours,
            DocumentStream(MemmapDocuments(storage)),
            2,
            _count_padded,
            batch_size=DOCUMENTS_BATCH,
            collate_fn=collate_pad,
        )
        for ours in (False, True)
    ]
    return measure(ITERABLE_SCENARIO, contenders, sizes, log)


# Memory -------------------------------------------------------------------------------------

#: What the memory children read: ``(data, workers)``.
MEMORY_CASES = (("tokens", 2), ("documents", 2))


def _pss_kb(pid: int) -> int:
    """The PSS of process ``pid`` (``/proc/PID/smaps_rollup``), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pss_mb(pid: int | None = None) -> float:
    """The total PSS of ``pid`` (this process) and its descendants, in MB: shared memory
    (a result ring, a library) counted once over the processes that map it."""
    root = os.getpid() if pid is None else pid
    tree = [root, *descendants(root, process_table()[0])]
    return sum(_pss_kb(p) for p in tree) / 1e6 * 1024


def memory_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: one loader reads ``spec["batches"]`` batches; the peak of its
    process tree's PSS, sampled every 10 batches after the first epoch's start."""
    data, ours, workers = spec["data"], spec["ours"], spec["workers"]
    if data == "tokens":
        storage: Any = StreamStorage(Path(spec["dir"]), StreamNumpyFormat(TOKENS_DTYPE))
        loader = _loader(
            ours, MemmapWindows(storage, LENGTH), workers, **_map_arguments(TOKENS_BATCH)
        )
    else:
        from guideloom_pipes.formats import DocumentPickleFormat

        storage = DocumentStorage(Path(spec["dir"]), DocumentPickleFormat())
        loader = _loader(
            ours,
            MemmapDocuments(storage),
            workers,
            **_map_arguments(DOCUMENTS_BATCH, collate_pad),
        )
    before = tree_pss_mb()
    peak, taken = 0.0, 0
    iterator = iter(loader)
    while taken < spec["batches"]:
        try:
            next(iterator)
        except StopIteration:
            iterator = iter(loader)
            continue
        taken += 1
        if taken % 10 == 0:
            peak = max(peak, tree_pss_mb())
    peak = max(peak, tree_pss_mb())
    del iterator
    getattr(loader, "close", lambda: None)()
    return {"pss_before_mb": before, "pss_peak_mb": peak}


def memory_figures(
    directories: dict[str, Path], sizes: Sizes, log: Callable[[str], None]
) -> dict[str, Any]:
    """``dataloader-memory``: for each case of :data:`MEMORY_CASES`, torch's and our
    loader each in a fresh process, alternating ``sizes.resume_rounds`` times; the medians
    of their trees' peak PSS."""
    batches = 200 if sizes.tokens >= 10_000_000 else 40
    figures: dict[str, Any] = {}
    for data, workers in MEMORY_CASES:
        peaks: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(max(1, sizes.resume_rounds)):
            for ours in (False, True):
                spec = {
                    "data": data,
                    "dir": str(directories[data]),
                    "ours": ours,
                    "workers": workers,
                    "batches": batches,
                }
                command = [
                    sys.executable,
                    "-m",
                    "guideloom_pipes.bench",
                    "--child-dataloader-memory",
                    json.dumps(spec),
                ]
                done = subprocess.run(command, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise RuntimeError(
                        f"the dataloader-memory child failed ({done.returncode}):\n"
                        f"{done.stderr[-4000:]}"
                    )
                result = json.loads(done.stdout.strip().splitlines()[-1])
                peaks[ours].append(result["pss_peak_mb"])
        theirs, mine = statistics.median(peaks[False]), statistics.median(peaks[True])
        case = f"{data} workers={workers}"
        figures[case] = {
            "torch_pss_mb": theirs,
            "ours_pss_mb": mine,
            "ratio": mine / theirs,
            "rounds": {"torch": peaks[False], "ours": peaks[True]},
        }
        log(
            f"  {MEMORY_SCENARIO}  {case}: torch {theirs:.0f} MB, ours {mine:.0f} MB "
            f"({mine / theirs:.2f}x)"
        )
    return figures
