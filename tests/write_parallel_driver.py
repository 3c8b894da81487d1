"""A write_parallel driver that tests/test_write_parallel_faults.py runs as a real process and
interrupts (Ctrl-C, SIGTERM, SIGKILL). ``python write_parallel_driver.py CONFIG.json``.

Item k becomes shard k: ``k + 3`` tokens ``100 * k, 100 * k + 1, ...``. Each item first writes
``"<k> <pid>\\n"`` to the fifo ``control/started`` (the test reads it, so it knows which items
run where without sleeping); while the file ``control/block`` exists, item ``BLOCKED`` then
waits on the fifo ``control/hold``, which nobody ever opens for writing. On success the
driver prints the report as one JSON line.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

DTYPE = np.dtype([("tokens", "<i4")])
ITEMS = 6
BLOCKED = 3


def expected(item: int) -> np.ndarray:
    return np.arange(100 * item, 100 * item + item + 3, dtype="<i4")


def convert(item: int, control: str) -> Iterator[dict[str, np.ndarray]]:
    started = os.open(os.path.join(control, "started"), os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(started, f"{item} {os.getpid()}\n".encode())
    finally:
        os.close(started)
    if item == BLOCKED and os.path.exists(os.path.join(control, "block")):
        with open(os.path.join(control, "hold"), "rb") as hold:  # blocks: no writer comes
            hold.read()
    yield {"tokens": expected(item)}


def storage(config: dict[str, Any]) -> Any:
    from guideloom_pipes import StreamNumpyFormat, StreamStorage

    options = config.get("options")
    if options is None:
        return StreamStorage(config["dataset"], StreamNumpyFormat(DTYPE))
    return StreamStorage(config["dataset"], StreamNumpyFormat(DTYPE), storage_options=options)


def main(config: dict[str, Any]) -> None:
    # the module by its importable name (not __main__), so that Dask's workers find it
    from write_parallel_driver import convert as importable

    from guideloom_pipes import write_parallel

    job = functools.partial(importable, control=config["control"])
    executor = config["executor"]
    target = storage(config)
    if executor == "own":
        report = write_parallel(target, range(ITEMS), job, max_workers=2, progress=False)
    elif executor == "pool":
        with cf.ProcessPoolExecutor(max_workers=2) as pool:
            report = write_parallel(target, range(ITEMS), job, executor=pool, progress=False)
    else:
        import distributed

        with (
            distributed.LocalCluster(
                n_workers=2,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                worker_dashboard_address=None,
            ) as cluster,
            distributed.Client(cluster) as client,
        ):
            report = write_parallel(
                target, range(ITEMS), job, executor=client.get_executor(), progress=False
            )
    print(json.dumps({"written": report.written, "skipped": report.skipped}), flush=True)


if __name__ == "__main__":
    with open(sys.argv[1]) as file:
        main(json.load(file))
