"""write_parallel: item k -> shard k on a process pool and on a real Dask LocalCluster, byte
for byte what a serial run writes; resume skips only unchanged items; an unpicklable convert is
refused before any work; failures are collected, reported and left uncommitted."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import os
import pickle
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import guideloom_pipes
from guideloom_pipes import (
    DocumentPickleFormat,
    DocumentStorage,
    StreamNumpyFormat,
    StreamStorage,
    WriteParallelError,
    write_parallel,
)
from guideloom_pipes.storage import StaleManifestWarning

DTYPE = np.dtype([("tokens", "<i4")])


def tokenize_file(path: str) -> Iterator[dict[str, np.ndarray]]:
    """A CPU-light convert: a text file -> one record of its bytes per line."""
    with open(path, "rb") as file:
        for line in file:
            yield {"tokens": np.frombuffer(line, dtype=np.uint8).astype("<i4")}


def numbers(item: tuple[int, int], scale: int = 1) -> Iterator[dict[str, np.ndarray]]:
    start, stop = item
    for chunk in range(start, stop, 7):
        yield {"tokens": np.arange(chunk, min(chunk + 7, stop)) * scale}


def fail_on_odd(item: int) -> Iterator[dict[str, np.ndarray]]:
    if item % 2:
        raise ValueError(f"item {item} is odd")
    yield {"tokens": np.full(3, item)}


def documents(item: int) -> Iterator[dict[str, Any]]:
    for i in range(item):
        yield {"item": item, "i": i}


def nothing(item: int) -> Iterator[dict[str, np.ndarray]]:
    if item:
        yield {"tokens": np.arange(item)}


class SerialExecutor(cf.Executor):
    """Runs every job at once in the caller: the serial reference."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        future: cf.Future[Any] = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:
            future.set_exception(error)
        return future


def _storage(path: Path) -> StreamStorage:
    return StreamStorage(path, StreamNumpyFormat(DTYPE))


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture
def corpus(tmp_path: Path) -> list[str]:
    directory = tmp_path / "corpus"
    directory.mkdir()
    paths = []
    for i in range(6):
        path = directory / f"{i}.txt"
        path.write_text("".join(f"line {j} of file {i}\n" for j in range(i * 3 + 1)))
        paths.append(str(path))
    return paths


def test_write_parallel_is_exported_from_the_package() -> None:
    assert guideloom_pipes.write_parallel is write_parallel
    assert "write_parallel" in guideloom_pipes.__all__


def test_a_process_pool_writes_byte_for_byte_what_a_serial_run_writes(
    tmp_path: Path, corpus: list[str]
) -> None:
    serial = write_parallel(
        _storage(tmp_path / "serial"), corpus, tokenize_file, executor=SerialExecutor()
    )
    parallel = write_parallel(_storage(tmp_path / "parallel"), corpus, tokenize_file, max_workers=2)
    assert _files(tmp_path / "parallel") == _files(tmp_path / "serial")
    assert parallel.written == serial.written == list(range(6))
    assert (parallel.records, parallel.bytes) == (serial.records, serial.bytes)
    assert parallel.records == sum(3 * i + 1 for i in range(6))


def test_item_k_becomes_shard_k_with_the_data_a_hand_loop_writes(
    tmp_path: Path, corpus: list[str]
) -> None:
    write_parallel(_storage(tmp_path / "parallel"), corpus, tokenize_file, max_workers=2)
    with _storage(tmp_path / "loop").sync_writer() as writer:
        for shard, path in enumerate(corpus):
            for record in tokenize_file(path):
                writer.append(shard, record)
    data = [p for p in _files(tmp_path / "loop") if p.endswith(".bin")]
    assert data == [f"{k:07d}.in_band.bin" for k in range(6)]
    for name in data:
        assert (tmp_path / "parallel" / name).read_bytes() == (
            tmp_path / "loop" / name
        ).read_bytes()


def test_records_carry_the_item_fingerprint_and_no_timestamp(
    tmp_path: Path, corpus: list[str]
) -> None:
    write_parallel(_storage(tmp_path), corpus[:1], tokenize_file, progress=False)
    record = json.loads((tmp_path / "0000000.shard.json").read_text())
    assert record["fingerprint"].startswith("blake2b:")
    assert set(record) == {
        "guideloom_pipes_record",
        "generation",
        "state",
        "kind",
        "shard",
        "count",
        "dtype",
        "files",
        "format",
        "fingerprint",
    }


def test_a_rerun_skips_unchanged_items_and_rewrites_a_changed_one(
    tmp_path: Path, corpus: list[str]
) -> None:
    storage = _storage(tmp_path / "out")
    write_parallel(storage, corpus, tokenize_file, max_workers=2, progress=False)
    again = write_parallel(storage, corpus, tokenize_file, max_workers=2, progress=False)
    assert (again.written, again.skipped) == ([], list(range(6)))
    Path(corpus[2]).write_text("a changed file\nof another size\n")
    changed = write_parallel(storage, corpus, tokenize_file, max_workers=2, progress=False)
    assert (changed.written, changed.skipped) == ([2], [0, 1, 3, 4, 5])
    fresh = _storage(tmp_path / "fresh")
    write_parallel(fresh, corpus, tokenize_file, executor=SerialExecutor(), progress=False)
    for k in range(6):  # the same data as a fresh run (the rewritten record's generation differs)
        name = f"{k:07d}.in_band.bin"
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()


def test_a_rerun_rewrites_a_shard_whose_file_was_damaged(tmp_path: Path, corpus: list[str]) -> None:
    storage = _storage(tmp_path)
    write_parallel(storage, corpus, tokenize_file, executor=SerialExecutor(), progress=False)
    (tmp_path / "0000003.in_band.bin").write_bytes(b"")
    again = write_parallel(
        storage, corpus, tokenize_file, executor=SerialExecutor(), progress=False
    )
    assert again.written == [3]


def test_another_convert_rewrites_everything_and_resume_false_too(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    items = [(0, 10), (10, 30)]
    serial = SerialExecutor()
    write_parallel(storage, items, numbers, executor=serial, progress=False)
    other = functools.partial(numbers, scale=2)
    assert write_parallel(storage, items, other, executor=serial, progress=False).written == [0, 1]
    assert write_parallel(storage, items, other, executor=serial, progress=False).written == []
    forced = write_parallel(storage, items, other, executor=serial, progress=False, resume=False)
    assert forced.written == [0, 1]


def test_an_unpicklable_convert_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"cannot be pickled.*top level of a module"):
        write_parallel(_storage(tmp_path / "out"), [1, 2], lambda item: [], progress=False)
    assert not (tmp_path / "out").exists()


def test_failed_items_are_listed_after_the_others_are_written_and_stay_uncommitted(
    tmp_path: Path,
) -> None:
    storage = _storage(tmp_path)
    with pytest.raises(WriteParallelError) as caught:
        write_parallel(storage, range(5), fail_on_odd, max_workers=2, progress=False)
    error = caught.value
    assert [(index, item) for index, item, _ in error.failures] == [(1, 1), (3, 3)]
    assert all(isinstance(e, ValueError) for _, _, e in error.failures)
    assert "item 1 (1): ValueError: item 1 is odd" in str(error)
    assert "item 3 (3): ValueError: item 3 is odd" in str(error)
    assert (error.report.written, error.report.failed) == ([0, 2, 4], [1, 3])
    names = {p.name for p in tmp_path.iterdir()}
    assert {"0000000.shard.json", "0000002.shard.json", "0000004.shard.json"} <= names
    assert not any(name.startswith(("0000001", "0000003")) for name in names)


def test_a_failed_item_keeps_the_shard_an_earlier_run_committed(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    serial = SerialExecutor()
    write_parallel(storage, [0, 2], fail_on_odd, executor=serial, progress=False)
    before = (tmp_path / "0000001.in_band.bin").read_bytes()
    with pytest.raises(WriteParallelError):
        write_parallel(storage, [0, 1], fail_on_odd, executor=serial, progress=False)
    assert (tmp_path / "0000001.in_band.bin").read_bytes() == before


def test_an_item_without_records_is_an_empty_shard_not_a_gap(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    write_parallel(storage, [3, 0, 2], nothing, executor=SerialExecutor(), progress=False)
    with storage.sync_reader() as reader:
        assert (reader.num_shards, reader.total_length, reader.length(1)) == (3, 5, 0)


def test_documents_are_written_in_parallel_too(tmp_path: Path) -> None:
    storage = DocumentStorage(tmp_path, DocumentPickleFormat())
    report = write_parallel(storage, [2, 0, 3], documents, max_workers=2, progress=False)
    assert report.records == 5
    with storage.sync_reader() as reader:
        assert [reader.read(i) for i in range(5)][2:] == [
            {"item": 3, "i": 0},
            {"item": 3, "i": 1},
            {"item": 3, "i": 2},
        ]


def test_overwrite_removes_shards_above_the_items_and_update_warns(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    serial = SerialExecutor()
    write_parallel(storage, [(0, 5)] * 4, numbers, executor=serial, progress=False)
    with pytest.warns(UserWarning, match="remain from an earlier write"):
        write_parallel(storage, [(0, 5)] * 2, numbers, executor=serial, mode="update")
    with storage.sync_reader() as reader:
        assert reader.num_shards == 4
    report = write_parallel(storage, [(0, 5)] * 2, numbers, executor=serial, progress=False)
    assert report.removed == [2, 3]
    with storage.sync_reader() as reader:
        assert reader.num_shards == 2


def test_create_refuses_a_directory_that_holds_shards(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    write_parallel(storage, [(0, 5)], numbers, executor=SerialExecutor(), progress=False)
    with pytest.raises(FileExistsError, match="mode='create'"):
        write_parallel(storage, [(0, 5)], numbers, mode="create", progress=False)


def test_a_thread_pool_works_as_an_executor_and_writers_do_not_warn(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    with cf.ThreadPoolExecutor(3) as pool, warnings.catch_warnings():
        warnings.simplefilter("error")
        report = write_parallel(storage, [(i, i + 20) for i in range(8)], numbers, executor=pool)
    assert report.written == list(range(8))


def test_progress_without_tqdm_prints_items_records_and_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails: as if not installed
    write_parallel(_storage(tmp_path), [(0, 10), (0, 4)], numbers, executor=SerialExecutor())
    err = capsys.readouterr().err
    assert "write_parallel done: 2 items of 2 items (100%), records 3, bytes 56 B" in err


def test_an_executor_that_is_not_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="get_executor"):
        write_parallel(_storage(tmp_path), [], numbers, executor=object())  # type: ignore[arg-type]


def test_the_error_pickles_with_its_failures() -> None:
    error = WriteParallelError([(1, "x", ValueError("bad"))], guideloom_pipes.WriteReport())
    again = pickle.loads(pickle.dumps(error))
    assert again.failures[0][:2] == (1, "x") and str(again) == str(error)


# --- Dask ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dask_client() -> Iterator[Any]:
    distributed = pytest.importorskip("dask.distributed")
    cluster = distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        worker_dashboard_address=None,
    )
    try:
        client = distributed.Client(cluster)
        try:
            yield client
        finally:
            client.close()
    finally:
        cluster.close()


def test_a_dask_local_cluster_writes_byte_for_byte_what_a_serial_run_writes(
    tmp_path: Path, corpus: list[str], dask_client: Any
) -> None:
    pids = set(dask_client.run(os.getpid).values())
    assert len(pids) == 2 and os.getpid() not in pids  # real worker processes
    serial = write_parallel(
        _storage(tmp_path / "serial"), corpus, tokenize_file, executor=SerialExecutor()
    )
    report = write_parallel(
        _storage(tmp_path / "dask"), corpus, tokenize_file, executor=dask_client.get_executor()
    )
    assert _files(tmp_path / "dask") == _files(tmp_path / "serial")
    assert (report.written, report.records) == (serial.written, serial.records)


def test_dask_failures_are_reported_and_a_rerun_skips_the_written_items(
    tmp_path: Path, dask_client: Any
) -> None:
    storage = _storage(tmp_path)
    executor = dask_client.get_executor()
    with pytest.raises(WriteParallelError) as caught:
        write_parallel(storage, range(4), fail_on_odd, executor=executor, progress=False)
    assert [index for index, _, _ in caught.value.failures] == [1, 3]
    with pytest.raises(WriteParallelError) as again:
        write_parallel(storage, range(4), fail_on_odd, executor=executor, progress=False)
    assert again.value.report.skipped == [0, 2]


def test_a_writer_started_on_a_shard_commits_it_empty_for_every_kind(tmp_path: Path) -> None:
    from guideloom_pipes import StreamWithMetaStorage
    from tests.storage_formats import ChunkMetaFormat

    meta = StreamWithMetaStorage(tmp_path / "meta", ChunkMetaFormat())
    with meta.sync_writer() as writer:
        writer.start(0)
        writer.append(1, {"doc": 0, "tokens": [1, 2], "chunk_ids": [0, 0]})
    with meta.sync_reader() as reader:
        assert (reader.num_shards, reader.length(0), reader.length(1)) == (2, 0, 2)
    docs = DocumentStorage(tmp_path / "docs", DocumentPickleFormat())
    with docs.sync_writer() as writer:
        writer.start(0)
        writer.start(0)  # twice is once
    with docs.sync_reader() as reader:
        assert (reader.num_shards, reader.total_length) == (1, 0)


def test_progress_with_tqdm_shows_a_bar_of_items_records_and_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tqdm")
    write_parallel(_storage(tmp_path), [(0, 10), (0, 4)], numbers, executor=SerialExecutor())
    err = capsys.readouterr().err
    assert "write_parallel: 100%" in err and "2/2" in err and "records 3" in err


def test_another_dtype_rewrites_every_shard(tmp_path: Path) -> None:
    items = [(0, 10), (10, 30)]
    serial = SerialExecutor()
    write_parallel(_storage(tmp_path), items, numbers, executor=serial, progress=False)
    wider = StreamStorage(tmp_path, StreamNumpyFormat(np.dtype([("tokens", "<i8")])))
    assert write_parallel(wider, items, numbers, executor=serial, progress=False).written == [0, 1]
    with wider.sync_reader() as reader:
        assert reader.total_length == 30


# --- workers that die, interrupts, reruns -------------------------------------------------------


def killed_at_2(item: int, flag: str) -> Iterator[dict[str, np.ndarray]]:
    """Item 2 kills its own worker process while the file ``flag`` exists."""
    if item == 2 and os.path.exists(flag):
        os.kill(os.getpid(), signal.SIGKILL)
    yield {"tokens": np.full(item + 1, item)}


def interrupted_at_2(item: int, flag: str) -> Iterator[dict[str, np.ndarray]]:
    """Item 2 raises KeyboardInterrupt (Ctrl-C in the driver's thread pool) while ``flag``
    exists."""
    if item == 2 and os.path.exists(flag):
        raise KeyboardInterrupt
    yield {"tokens": np.full(item + 1, item)}


def fails_at_1(item: int, flag: str) -> Iterator[dict[str, np.ndarray]]:
    if item == 1 and os.path.exists(flag):
        raise ValueError(f"item 1 fails while {flag} exists")
    yield {"tokens": np.full(item + 1, item)}


@pytest.mark.parametrize("executor", ["own", "pool"])
def test_a_worker_killed_mid_item_is_a_report_naming_the_items_in_flight_and_a_rerun_finishes(
    tmp_path: Path, executor: str
) -> None:
    flag = tmp_path / "kill"
    flag.touch()
    job = functools.partial(killed_at_2, flag=str(flag))
    storage = _storage(tmp_path / "data")
    items = range(8)
    with cf.ProcessPoolExecutor(max_workers=2) as pool, pytest.raises(WriteParallelError) as caught:
        write_parallel(
            storage,
            items,
            job,
            executor=pool if executor == "pool" else None,
            max_workers=2,
            progress=False,
        )
    error = caught.value
    failed = [index for index, _, _ in error.failures]
    assert 2 in failed
    assert all(isinstance(e, cf.process.BrokenProcessPool) for _, _, e in error.failures)
    report = error.report
    assert sorted(report.written + report.failed + report.not_run) == list(items)
    if executor == "own":  # its workers are joined: what is reported not committed is not
        for shard in report.failed + report.not_run:
            assert not (tmp_path / "data" / f"{shard:07d}.shard.json").exists()
    shown = ", ".join(map(str, failed))
    assert f"The executor broke while items {shown} were in flight" in str(error)
    assert "run the same call again" in str(error)
    if executor == "pool":
        assert "with a new executor if it was yours" in str(error)
    flag.unlink()
    again = write_parallel(storage, items, job, max_workers=2, progress=False)
    assert set(again.written) <= set(report.failed + report.not_run)
    if executor == "own":
        assert sorted(again.written) == sorted(report.failed + report.not_run)
    write_parallel(_storage(tmp_path / "serial"), items, job, executor=SerialExecutor())
    assert _files(tmp_path / "data") == _files(tmp_path / "serial")


def test_ctrl_c_with_a_users_executor_cancels_the_rest_says_how_far_and_leaves_it_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flag = tmp_path / "interrupt"
    flag.touch()
    job = functools.partial(interrupted_at_2, flag=str(flag))
    storage = _storage(tmp_path / "data")
    with cf.ThreadPoolExecutor(max_workers=1) as pool:
        with pytest.raises(KeyboardInterrupt) as caught:
            write_parallel(storage, range(6), job, executor=pool, progress=False, max_in_flight=1)
        assert caught.traceback[-1].name == "write_parallel"  # not from concurrent.futures
        err = capsys.readouterr().err
        assert err.strip() == (
            "write_parallel interrupted: 2 shards committed, 4 not; run the same call again "
            "to finish (committed shards are skipped)"
        )
        assert pool.submit(int, "7").result() == 7  # the user's executor still works
    assert not (tmp_path / "data" / "0000003.in_band.bin").exists()  # cancelled, not run
    flag.unlink()
    again = write_parallel(storage, range(6), job, progress=False)
    assert (again.skipped, again.written) == ([0, 1], [2, 3, 4, 5])


def test_a_gap_left_by_an_interrupted_run_says_that_the_same_call_fills_it(tmp_path: Path) -> None:
    storage = _storage(tmp_path)
    write_parallel(storage, [(0, 5), (5, 9), (9, 12)], numbers, progress=False)
    for path in tmp_path.glob("0000001.*"):
        path.unlink()
    with (
        pytest.warns(StaleManifestWarning, match="deleted"),  # (so the open lists the shards)
        pytest.raises(FileNotFoundError, match="running the same call again fills the gap"),
        storage.sync_reader(),
    ):
        pass
    done = subprocess.run(
        [sys.executable, "-m", "guideloom_pipes", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "running the same call again fills the gap" in done.stdout


def test_a_dask_rerun_after_a_fix_runs_the_failed_item_again(
    tmp_path: Path, dask_client: Any
) -> None:
    flag = tmp_path / "fail"
    flag.touch()
    job = functools.partial(fails_at_1, flag=str(flag))
    storage = _storage(tmp_path / "data")
    executor = dask_client.get_executor()
    with pytest.raises(WriteParallelError) as first:  # kept: Dask would keep its result
        write_parallel(storage, range(3), job, executor=executor, progress=False)
    assert first.value.report.failed == [1]
    flag.unlink()
    again = write_parallel(storage, range(3), job, executor=executor, progress=False)
    assert (again.written, again.skipped) == ([1], [0, 2])
