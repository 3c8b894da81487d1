"""write_parallel's driver interrupted for real: Ctrl-C (SIGINT to its process group, as a
terminal sends it), SIGTERM and SIGKILL, with its own pool, a user's process pool, a Dask
LocalCluster and against S3 (moto). After each, every worker process ends within seconds, no
staging directory is left, and running the same call again completes the dataset with every
shard exact. The driver is tests/write_parallel_driver.py in a subprocess; the test knows
what runs through a fifo the items write to, never by sleeping."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import write_parallel_driver as driver
from remote_servers import S3Server

HERE = Path(__file__).parent
#: generous bounds for a busy 2-core machine: a driver reaching the blocked item, workers
#: ending once their driver has
START_TIMEOUT = 120.0
EXIT_TIMEOUT = 30.0
BUCKET = "faults"


#: every driver started, so that a failed test leaves none of their processes behind
_STARTED: list[Run] = []


class Run:
    """One driver process, in a process group of its own (with its workers)."""

    def __init__(self, config: dict[str, Any], control: Path, tmpdir: Path) -> None:
        path = control / "config.json"
        path.write_text(json.dumps(config))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "TMPDIR": str(tmpdir),
        }
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "write_parallel_driver.py"), str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own process group, as a shell job has
        )
        _STARTED.append(self)

    def finish(self) -> tuple[int, str, str]:
        out, err = self.process.communicate(timeout=START_TIMEOUT)
        return self.process.returncode, out, err


@pytest.fixture(autouse=True)
def _no_process_left() -> Iterator[None]:
    """Whatever a test asserts, its drivers and their workers end with it."""
    yield
    while _STARTED:
        run = _STARTED.pop()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(run.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.process.communicate(timeout=EXIT_TIMEOUT)


@pytest.fixture
def control(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """The control directory (its ``started`` fifo open for reading) and that fifo's fd."""
    directory = tmp_path / "control"
    directory.mkdir()
    os.mkfifo(directory / "started")
    os.mkfifo(directory / "hold")
    (directory / "block").touch()
    fd = os.open(directory / "started", os.O_RDONLY | os.O_NONBLOCK)
    keep = os.open(directory / "started", os.O_WRONLY)  # never at end of file between items
    try:
        yield directory, fd
    finally:
        os.close(keep)
        os.close(fd)


def _wait_started(fd: int, item: int, run: Run) -> int:
    """Read the fifo until ``item`` reports it started; the pid of its process."""
    deadline = time.monotonic() + START_TIMEOUT
    buffered = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            buffered += os.read(fd, 4096)
            for line in buffered.decode().splitlines():
                started, pid = map(int, line.split())
                if started == item:
                    return pid
        if run.process.poll() is not None:
            _, out, err = run.finish()
            pytest.fail(f"the driver ended before item {item} started: {out}{err}")
    pytest.fail(f"item {item} did not start within {START_TIMEOUT} s")


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(processes: list[psutil.Process]) -> list[psutil.Process]:
    deadline = time.monotonic() + EXIT_TIMEOUT
    while (alive := _alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.1)  # a bounded poll of process states, not a synchronisation
    return alive


def _interrupt(run: Run, fd: int, how: str) -> tuple[int, str]:
    """Stop the driver while item BLOCKED runs; its return code and stderr once all its
    workers are gone (the test fails if any outlives it by EXIT_TIMEOUT)."""
    worker = _wait_started(fd, driver.BLOCKED, run)
    family = psutil.Process(run.process.pid).children(recursive=True)
    assert worker in {p.pid for p in family}
    if how == "ctrl-c":
        os.killpg(run.process.pid, signal.SIGINT)
    else:
        run.process.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    code, _, err = run.finish()
    alive = _wait_gone(family)
    assert not alive, f"{len(alive)} worker(s) outlived the driver: {alive}\n{err}"
    return code, err


def _config(executor: str, dataset: str, control: Path, **extra: Any) -> dict[str, Any]:
    return {"executor": executor, "dataset": dataset, "control": str(control), **extra}


def _driver_tracebacks(err: str) -> list[str]:
    """The tracebacks the driver printed (those through its script), each up to its
    exception's line: worker processes may print their own into the same stderr."""
    found = []
    for block in err.split("Traceback (most recent call last):")[1:]:
        lines = block.splitlines()[1:]
        upto = next((k for k, line in enumerate(lines) if not line.startswith(" ")), len(lines))
        text = "\n".join(lines[: upto + 1])
        if "write_parallel_driver.py" in text:
            found.append(text)
    return found


def _check_stopped(how: str, code: int, err: str, executor: str = "own") -> None:
    if how == "ctrl-c":
        assert code == -signal.SIGINT, err
        assert "shards committed," in err and "run the same call again to finish" in err, err
        if executor == "pool":
            # a user's pool is the user's: Ctrl-C reaches its workers too (one process
            # group), and Python prints the KeyboardInterrupt of each that was waiting for
            # work, as it would without write_parallel; ours is the driver's traceback
            tracebacks = _driver_tracebacks(err)
            assert tracebacks, err
            assert not any("concurrent/futures" in t for t in tracebacks), err
        else:  # our own pool's workers ignore SIGINT: nothing from concurrent.futures at all
            assert "concurrent/futures" not in err.split("write_parallel interrupted")[-1], err
    else:
        assert code == (-signal.SIGTERM if how == "sigterm" else -signal.SIGKILL), err


def _rerun(executor: str, dataset: str, control: Path, tmpdir: Path, **extra: Any) -> None:
    (control / "block").unlink()
    code, out, err = Run(_config(executor, dataset, control, **extra), control, tmpdir).finish()
    assert code == 0, err
    report = json.loads(out.splitlines()[-1])
    assert sorted(report["written"] + report["skipped"]) == list(range(driver.ITEMS))
    assert driver.BLOCKED in report["written"]
    assert not list(tmpdir.glob("guideloom_pipes-upload-*"))


def _check_local(dataset: Path) -> None:
    names = sorted(p.name for p in dataset.iterdir() if p.is_file())
    assert names == sorted(
        f"{k:07d}{suffix}"
        for k in range(driver.ITEMS)
        for suffix in (".in_band.bin", ".shard.json")
    )  # no temporaries, locks or versioned leftovers
    for k in range(driver.ITEMS):
        data = np.frombuffer((dataset / f"{k:07d}.in_band.bin").read_bytes(), dtype="<i4")
        np.testing.assert_array_equal(data, driver.expected(k))
    _check_reads(driver.storage({"dataset": str(dataset)}))


def _check_reads(storage: Any) -> None:
    with storage.sync_reader() as reader:
        assert reader.num_shards == driver.ITEMS
        whole = reader.read(0, reader.total_length)["tokens"]
    np.testing.assert_array_equal(
        whole, np.concatenate([driver.expected(k) for k in range(driver.ITEMS)])
    )


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
@pytest.mark.parametrize("executor", ["own", "pool", "dask"])
def test_a_stopped_driver_leaves_no_worker_and_a_rerun_completes_the_dataset(
    tmp_path: Path, control: tuple[Path, int], executor: str, how: str
) -> None:
    if executor == "dask":
        pytest.importorskip("distributed")
    directory, fd = control
    dataset = tmp_path / "data"
    run = Run(_config(executor, str(dataset), directory), directory, tmp_path)
    code, err = _interrupt(run, fd, how)
    _check_stopped(how, code, err, executor)
    if executor != "dask":  # Dask's workers exit at once (os._exit): the rerun sweeps
        assert not list(tmp_path.glob("guideloom_pipes-upload-*"))
    _rerun("own", str(dataset), directory, tmp_path)
    _check_local(dataset)


@pytest.mark.remote
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_a_stopped_driver_writing_to_s3_leaves_no_worker_nor_staging_and_a_rerun_completes(
    tmp_path: Path, control: tuple[Path, int], s3: S3Server, how: str
) -> None:
    directory, fd = control
    url = f"s3://{BUCKET}/{how}"
    options = s3.options()
    run = Run(_config("own", url, directory, options=options), directory, tmp_path)
    code, err = _interrupt(run, fd, how)
    _check_stopped(how, code, err)
    left = list(tmp_path.glob("guideloom_pipes-upload-*"))
    assert not left, (
        err,
        [sorted(p.name for p in d.iterdir()) for d in left],
    )  # each worker removed its own
    _rerun("own", url, directory, tmp_path, options=options)
    names = sorted(name.rsplit("/", 1)[-1] for name in s3.filesystem().ls(f"{BUCKET}/{how}"))
    assert names == sorted(
        f"{k:07d}{suffix}"
        for k in range(driver.ITEMS)
        for suffix in (".in_band.bin", ".shard.json")
    )
    _check_reads(driver.storage({"dataset": url, "options": options}))


_KILLED_WRITER = """
import os, signal, sys
import numpy as np
import write_parallel_driver as driver
writer = driver.storage({"dataset": sys.argv[1], "options": eval(sys.argv[2])}).sync_writer()
writer.append(0, {"tokens": driver.expected(0)})
print(writer.directory, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.remote
def test_the_staging_directory_of_a_killed_writer_is_swept_and_a_live_ones_kept(
    tmp_path: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guideloom_pipes.storage.upload import sweep_staging

    url, options = f"s3://{BUCKET}/swept", s3.options()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, url, repr(options)],
        capture_output=True,
        text=True,
        env=env,
        timeout=START_TIMEOUT,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    dead = Path(done.stdout.strip())
    assert dead.parent == tmp_path and (dead / "0000000.in_band.bin.tmp").exists()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert sweep_staging() == [str(dead)] and not dead.exists()
    live = driver.storage({"dataset": url, "options": options}).sync_writer()
    live.append(0, {"tokens": driver.expected(0)})
    assert Path(live.directory).parent == tmp_path
    assert sweep_staging() == [] and Path(live.directory).is_dir()  # its writer is alive
    live.close()
    assert not list(tmp_path.glob("guideloom_pipes-upload-*"))


def test_a_pool_worker_whose_driver_died_before_it_started_ends_at_once() -> None:
    """The worker's initializer is told the driver's pid; a parent that is not the driver
    any more (here: never was) means it died before the worker could watch it."""
    code = (
        "import time\n"
        "from guideloom_pipes.parallel.worker import _start_worker\n"
        "_start_worker(1)\n"
        "for _ in range(600):\n"
        "    time.sleep(0.1)\n"
        "raise SystemExit('still running')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=START_TIMEOUT
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
