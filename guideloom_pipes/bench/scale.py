"""The scale / resume child, run in a fresh process by the scale scenario.

``python -m guideloom_pipes.bench --child-scale DIR`` opens the sparse dataset in ``DIR``
and prints, as JSON, the first batch's latency, peak memory and the first batch after
``load_state_dict``.
"""

from __future__ import annotations

import gc
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from guideloom_pipes.bench.contenders import CPU
from guideloom_pipes.bench.data import SEED, TOKENS_DTYPE, collate_tokens
from guideloom_pipes.bench.harness import _close_iterator
from guideloom_pipes.formats import StreamNumpyFormat
from guideloom_pipes.storage import StreamStorage


def _proc_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _max_rss_kb() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def scale_child(directory: Path, resume_rounds: int) -> dict[str, Any]:
    """In a fresh process: open the sparse dataset, first batch, peak RSS, resume timings."""
    import torchdata.nodes  # noqa: F401  - part of "after importing torch and our package"

    import guideloom_pipes
    from guideloom_pipes.loader import StatefulDataLoader

    assert guideloom_pipes.__version__
    gc.collect()
    base_rss = _proc_status_kb("VmRSS")
    reset = base_rss is not None and _reset_peak_rss()
    base_max = _max_rss_kb()
    length, batch = 2048, 8
    started = time.perf_counter()
    storage = StreamStorage(directory, StreamNumpyFormat(TOKENS_DTYPE))
    loader = StatefulDataLoader.from_storage(
        storage,
        collate_tokens,
        sequence_length=length,
        local_batch_size=batch,
        num_workers=0,
        prefetch=4,
        shuffle=True,
        shuffle_seed=SEED,
        device=CPU,
    )
    loader.__enter__()
    opened = time.perf_counter()
    iterator = iter(loader)
    first = next(iterator)
    first_batch_s = time.perf_counter() - started
    assert tuple(first.shape) == (batch, length)
    _close_iterator(iterator)
    if reset and base_rss is not None:
        hwm = _proc_status_kb("VmHWM") or 0
        peak_kb, method = hwm - base_rss, "VmHWM after clear_refs"
    else:
        peak_kb, method = _max_rss_kb() - base_max, "ru_maxrss delta"
    samples = len(loader) * batch
    near_end = (samples // batch - 1) * batch
    timings: dict[int, list[float]] = {0: [], near_end: []}
    for round_index in range(resume_rounds):
        offsets = [0, near_end] if round_index % 2 == 0 else [near_end, 0]
        for offset in offsets:
            state = {
                "epoch": 0,
                "observation_offset": offset,
                "shuffle": True,
                "shuffle_seed": SEED,
                "drop_last": True,
            }
            mark = time.perf_counter()
            loader.load_state_dict(state)
            iterator = iter(loader)
            next(iterator)
            timings[offset].append(time.perf_counter() - mark)
            _close_iterator(iterator)
    loader.__exit__(None, None, None)
    zero, end = statistics.median(timings[0]), statistics.median(timings[near_end])
    return {
        "first_batch_s": first_batch_s,
        "open_s": opened - started,
        "peak_rss_above_import_mb": peak_kb / 1024,
        "post_import_rss_mb": (base_rss or 0) / 1024,
        "rss_method": method,
        "samples": samples,
        "resume_offset0_s": zero,
        "resume_near_end_s": end,
        "resume_near_end_offset": near_end,
        "resume_ratio": end / zero if zero > 0 else 0.0,
        "resume_rounds": {str(k): v for k, v in timings.items()},
    }
