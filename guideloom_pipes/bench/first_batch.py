"""The first-batch scenario (issue 31): how long a fresh process waits for its first batch.

Each contender runs in a fresh process of its own, in alternating rounds (A B C A B C ...):
once the imports are done (torch, torchdata, ours), the child times building the storage
and the loader, and the first batch of the tokens (shuffled, ``L=2048`` batch 8,
``collate_tokens``): ours with ``prefetch=4`` and without; the same two resumed from a state
an earlier run saved mid-epoch (``load_state_dict``, then the first batch); and torch's
``DataLoader(num_workers=0)`` over the memmap-backed ``Dataset`` of the token scenarios.
``python -m guideloom_pipes.bench --child-first-batch JSON`` is the child.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from guideloom_pipes.storage import StreamStorage

__all__ = [
    "SCENARIO",
    "first_batch_child",
    "first_batch_figures",
    "first_batch_lines",
    "first_batch_targets",
    "ours_loader",
    "saved_state",
]

SCENARIO = "first-batch"
LENGTH, BATCH = 2048, 8
#: Batches the earlier run delivers before it saves the state a resumed contender loads.
SAVED_AFTER = 10
#: Contenders: row name -> what the child builds.
OURS_4, OURS_0 = "ours prefetch=4", "ours prefetch=0"
RESUMED_4, RESUMED_0 = "ours resumed, prefetch=4", "ours resumed, prefetch=0"
TORCH_0 = "torch DataLoader workers=0"
CONTENDERS: dict[str, dict[str, Any]] = {
    OURS_4: {"who": "ours", "prefetch": 4, "resume": False},
    OURS_0: {"who": "ours", "prefetch": 0, "resume": False},
    RESUMED_4: {"who": "ours", "prefetch": 4, "resume": True},
    RESUMED_0: {"who": "ours", "prefetch": 0, "resume": True},
    TORCH_0: {"who": "torch"},
}


def ours_loader(storage: StreamStorage, prefetch: int) -> Any:
    """Our loader of the scenario (shuffled, the bench's seed) with ``prefetch``."""
    from guideloom_pipes.bench.contenders import CPU
    from guideloom_pipes.bench.data import SEED, collate_tokens
    from guideloom_pipes.loader import StatefulDataLoader

    return StatefulDataLoader.from_storage(
        storage,
        collate_tokens,
        sequence_length=LENGTH,
        local_batch_size=BATCH,
        shuffle=True,
        shuffle_seed=SEED,
        prefetch=prefetch,
        device=CPU,
    )


def saved_state(storage: StreamStorage) -> dict[str, Any]:
    """The state of an earlier run after ``SAVED_AFTER`` batches."""
    with ours_loader(storage, 0) as loader:
        iterator = iter(loader)
        for _ in range(SAVED_AFTER):
            next(iterator)
        state = loader.state_dict()
        iterator.close()
    return state


def first_batch_child(arguments: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: seconds from building the storage and the loader to the first
    batch, for the contender ``arguments`` describe (see ``CONTENDERS``)."""
    import numpy as np
    import torch
    import torchdata.nodes  # noqa: F401  - the imports are done before the clock starts

    from guideloom_pipes.bench.contenders import MemmapWindows
    from guideloom_pipes.bench.data import TOKENS_DTYPE, collate_tokens
    from guideloom_pipes.formats import StreamNumpyFormat
    from guideloom_pipes.loader import StatefulDataLoader  # noqa: F401

    directory, state = Path(arguments["directory"]), arguments.get("state")
    started = time.perf_counter()
    storage = StreamStorage(directory, StreamNumpyFormat(TOKENS_DTYPE))
    if arguments["who"] == "torch":
        loader: Any = torch.utils.data.DataLoader(
            MemmapWindows(storage, LENGTH),
            batch_size=BATCH,
            shuffle=True,
            num_workers=0,
            collate_fn=collate_tokens,
            drop_last=True,
        )
    else:
        loader = ours_loader(storage, arguments["prefetch"])
        if arguments["resume"]:
            loader.load_state_dict(state)
    iterator = iter(loader)
    batch = next(iterator)
    seconds = time.perf_counter() - started
    assert tuple(batch.shape) == (BATCH, LENGTH)
    figures = {"seconds": seconds, "first": np.asarray(batch[0, :4]).tolist()}
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
    return figures


def _run_child(arguments: dict[str, Any]) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "guideloom_pipes.bench",
        "--child-first-batch",
        json.dumps(arguments),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(
            f"the first-batch child failed ({result.returncode}):\n{result.stderr[-4000:]}"
        )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def first_batch_figures(storage: StreamStorage, rounds: int, log: Any) -> dict[str, Any]:
    """Every contender's first batch in a fresh process, ``rounds`` alternating rounds;
    median milliseconds each."""
    state = saved_state(storage)
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    firsts: dict[str, list[int]] = {}
    for _ in range(rounds):
        for name, contender in CONTENDERS.items():
            arguments = {**contender, "directory": str(storage.dir), "state": state}
            figures = _run_child(arguments)
            times[name].append(figures["seconds"] * 1e3)
            firsts[name] = figures["first"]
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        log(f"  {SCENARIO:<13} {name:<34} first batch {median:8.2f} ms (median)")
    return {
        "length": LENGTH,
        "batch": BATCH,
        "saved_after": SAVED_AFTER,
        "rounds": rounds,
        "median_ms": medians,
        "ms": times,
        # the first tokens of each contender's first batch: a resumed loader's differ
        "first_tokens": firsts,
    }


def first_batch_lines(extra: dict[str, Any]) -> list[list[str]]:
    """The scenario's rows of the report's latency table."""
    figures = extra.get(SCENARIO, {})
    return [
        [SCENARIO, f"{name}: build + first batch (median)", f"{median:.2f} ms"]
        for name, median in figures.get("median_ms", {}).items()
    ]


def first_batch_targets(extra: dict[str, Any]) -> list[tuple[str, float, float]]:
    """Issue 31's targets as ``(name, measured, threshold)``, lower is better: the first
    batch within 2x torch's ``workers=0``, a resumed loader within 1.1x of a new one."""
    medians = extra.get(SCENARIO, {}).get("median_ms")
    if not medians:
        return []
    torch0 = medians[TORCH_0]
    return [
        (f"{SCENARIO}: {OURS_4} / {TORCH_0}", medians[OURS_4] / torch0, 2.0),
        (f"{SCENARIO}: {OURS_0} / {TORCH_0}", medians[OURS_0] / torch0, 2.0),
        (f"{SCENARIO}: {RESUMED_4} / {OURS_4}", medians[RESUMED_4] / medians[OURS_4], 1.1),
        (f"{SCENARIO}: {RESUMED_0} / {OURS_0}", medians[RESUMED_0] / medians[OURS_0], 1.1),
    ]
