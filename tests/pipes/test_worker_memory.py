"""A worker process keeps small-object memory mapped for its batches
(``reserve_small_object_memory``): batches that decode into many small objects, dead after
the collate, do not fault fresh pages in every time (CPython unmaps an empty arena at once
and keeps at most one)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from loader_helpers import ListsOfInts, faults_collate

from guideloom_pipes import StatefulDataLoader

# ~3 MB of ints and lists per "batch", freed after it: several arenas each time
_CHURN = textwrap.dedent(
    """
    import resource, sys
    from guideloom_pipes.pipes.workers.process_main import reserve_small_object_memory
    keep = reserve_small_object_memory() if sys.argv[1] == "reserve" else None
    def batch():
        docs = [list(range(100_000 + k * 1000, 101_000 + k * 1000)) for k in range(96)]
        return sum(map(len, docs))
    for _ in range(5):
        batch()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        batch()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


def test_the_reserve_keeps_a_churning_process_from_faulting_pages_in_again():
    without = _faults("none")
    if without < 40 * 50:
        pytest.skip(f"this interpreter's allocator keeps its memory ({without} faults)")
    with_reserve = _faults("reserve")
    assert with_reserve * 10 < without, (with_reserve, without)


def test_process_workers_keep_small_object_memory_for_their_batches():
    loader = StatefulDataLoader(
        ListsOfInts(96 * 30),
        faults_collate,
        local_batch_size=96,
        shuffle=False,
        device="cpu",
        num_workers=1,
        parallel_method="process",
        prefetch=1,
    )
    with loader:
        faults = list(loader)[5:]  # after the worker's start
    # without the reserve each batch maps ~3 MB of fresh arenas: ~500 faults
    assert sum(faults) / len(faults) < 100, faults


def test_a_loader_reading_in_this_process_holds_one_shared_reserve_while_open():
    import gc

    from guideloom_pipes.pipes.workers import process_main as _worker

    gc.collect()  # (loaders of earlier tests left open are released)
    holders = _worker._reserve_holders  # (0 unless a loader elsewhere is still open)
    options = {"local_batch_size": 4, "prefetch": 1}
    inline = StatefulDataLoader(ListsOfInts(200), faults_collate, **options)
    threads = StatefulDataLoader(ListsOfInts(200), faults_collate, num_workers=2, **options)
    processes = StatefulDataLoader(
        ListsOfInts(200), faults_collate, num_workers=1, parallel_method="process", **options
    )
    processes.open()  # its samples are decoded in the workers: it holds no reserve
    assert _worker._reserve_holders == holders
    inline.open()
    reserve = _worker._reserve
    assert reserve is not None and len(reserve) >= 16  # a block in each arena of 16 MiB
    threads.open()
    assert _worker._reserve is reserve and _worker._reserve_holders == holders + 2
    inline.close()
    inline.close()  # (a second close releases nothing more)
    assert _worker._reserve is reserve and _worker._reserve_holders == holders + 1
    threads.close()
    assert _worker._reserve_holders == holders
    assert (_worker._reserve is None) == (holders == 0)  # the last holder drops it
    processes.close()
    inline.open()
    assert _worker._reserve_holders == holders + 1
    del inline  # a loader garbage-collected while open releases it too
    gc.collect()
    assert _worker._reserve_holders == holders


def test_a_forked_worker_keeps_the_reserve_its_parent_holds(tmp_path, monkeypatch):
    """A worker forked while this process holds a reserve shares it (copy-on-write) and
    makes none of its own (that would map another 16 MiB in every worker)."""
    import multiprocessing

    from guideloom_pipes.pipes.workers import process_main as _worker

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    made = tmp_path / "made"
    reserve = _worker.reserve_small_object_memory

    def counted(*args, **kwargs):
        with open(made, "a") as handle:  # (seen from the forked worker too)
            handle.write("x")
        return reserve(*args, **kwargs)

    monkeypatch.setattr(_worker, "reserve_small_object_memory", counted)
    release = _worker.hold_small_object_reserve()  # (made here, unless already held)
    try:
        before = made.read_text() if made.exists() else ""
        loader = StatefulDataLoader(
            ListsOfInts(40),
            faults_collate,
            local_batch_size=4,
            shuffle=False,
            device="cpu",
            num_workers=1,
            parallel_method="process",
            multiprocessing_context="fork",
            prefetch=1,
        )
        with loader:
            assert len(list(loader)) == 10
        after = made.read_text() if made.exists() else ""
    finally:
        release()
    assert after == before, "the forked worker made a reserve of its own"
