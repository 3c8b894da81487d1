"""Write locks: one writer per shard id at a time; different shard ids in parallel.

Children that hold a writer open are driven through pipes: they print a line when they
hold the lock and wait for a command on stdin (no sleeps).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from shard_kinds import KINDS, append, expected, leftovers, read, storage, write

from guideloom_pipes.storage import ShardLockedError, StaleWriteWarning

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

HOLDER = """
    import os, signal, sys
    from pathlib import Path
    from shard_kinds import append, storage

    kind, path, shard = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    writer = storage(kind, path).sync_writer()
    writer.open()
    append(kind, writer, shard, [100 + shard, 200 + shard])
    print("holding", flush=True)
    command = sys.stdin.readline().strip()
    if command == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    getattr(writer, command)()  # close or abort
    print(command + "d", flush=True)
"""


class Holder:
    """A child process holding a writer of ``shard`` open until told what to do."""

    def __init__(self, kind: str, path: Path, shard: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
        self.process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(HOLDER), kind, str(path), str(shard)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line != "holding\n":
            self.process.wait(timeout=30)
            raise AssertionError(f"holder did not start: {line!r} {self.process.stderr.read()!r}")  # type: ignore[union-attr]

    def tell(self, command: str) -> int:
        """Send ``close``/``abort``/``kill``; wait for the child to end; its return code."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        if command != "kill":
            assert self.process.stdout.readline() == command + "d\n"
        return self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    """Children started by a test; any still running at its end are killed."""
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.stop()


def hold(holders: list[Holder], kind: str, path: Path, shard: int) -> Holder:
    holder = Holder(kind, path, shard)
    holders.append(holder)
    return holder


# In one process --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_writer_of_the_same_shard_is_refused_naming_shard_and_lock(
    tmp_path: Path, kind: str
) -> None:
    first, second = storage(kind, tmp_path).sync_writer(), storage(kind, tmp_path).sync_writer()
    with first, second:
        append(kind, first, 3, [1])
        with pytest.raises(ShardLockedError) as error:
            append(kind, second, 3, [2])
    message = str(error.value)
    assert f"shard 0000003 of {tmp_path} is being written by another writer" in message
    assert os.fspath(tmp_path / "0000003.shard.json.tmp") in message
    assert isinstance(error.value, OSError)


def test_a_refused_writer_leaves_the_lock_holders_shard_intact(tmp_path: Path) -> None:
    first, second = (
        storage("stream", tmp_path).sync_writer(),
        storage("stream", tmp_path).sync_writer(),
    )
    with first:
        append("stream", first, 0, [1, 2])
        with second:
            with pytest.raises(ShardLockedError):
                append("stream", second, 0, [9, 9, 9])
            append("stream", second, 1, [3])  # the refused writer goes on with other shards
        append("stream", first, 0, [4])
    assert read("stream", tmp_path) == [1, 2, 4, 3]
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("end", ["close", "abort", "exception"])
def test_the_lock_is_released_when_the_writer_ends(tmp_path: Path, end: str) -> None:
    writer = storage("stream", tmp_path).sync_writer()
    writer.open()
    append("stream", writer, 0, [1])
    if end == "exception":
        with pytest.raises(ValueError, match="stop"), writer:
            raise ValueError("stop")
    else:
        getattr(writer, end)()
    write("stream", tmp_path, {0: [5]})
    assert read("stream", tmp_path) == [5]


# Across processes ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_writer_in_another_process_holding_the_shard_refuses_this_one(
    tmp_path: Path, holders: list[Holder]
) -> None:
    kind = "document"
    holder = hold(holders, kind, tmp_path, 0)
    writer = storage(kind, tmp_path).sync_writer()
    with writer, pytest.raises(ShardLockedError, match=r"shard 0000000 .* another writer"):
        append(kind, writer, 0, [1])
    assert holder.tell("close") == 0
    assert read(kind, tmp_path) == expected(kind, {0: [100, 200]})


@pytest.mark.timeout(60)
def test_writers_of_different_shards_in_different_processes_both_commit(
    tmp_path: Path, holders: list[Holder]
) -> None:
    one = hold(holders, "stream_meta", tmp_path, 1)
    two = hold(holders, "stream_meta", tmp_path, 2)
    write("stream_meta", tmp_path, {0: [7, 8]})  # while both children hold their shards
    assert one.tell("close") == 0
    assert two.tell("close") == 0
    assert read("stream_meta", tmp_path) == expected(
        "stream_meta", {0: [7, 8], 1: [101, 201], 2: [102, 202]}
    )
    assert leftovers(tmp_path) == []


@pytest.mark.timeout(60)
def test_the_lock_is_released_when_the_holding_process_aborts(
    tmp_path: Path, holders: list[Holder]
) -> None:
    holder = hold(holders, "document", tmp_path, 0)
    assert holder.tell("abort") == 0
    write("document", tmp_path, {0: [5]})
    assert read("document", tmp_path) == expected("document", {0: [5]})


@pytest.mark.timeout(60)
def test_the_lock_of_a_writer_killed_with_sigkill_is_stale_and_taken_over(
    tmp_path: Path, holders: list[Holder]
) -> None:
    kind = "stream_meta"
    write(kind, tmp_path, {0: [1]})
    holder = hold(holders, kind, tmp_path, 0)
    assert holder.tell("kill") == -signal.SIGKILL
    assert "0000000.shard.json.tmp" in leftovers(tmp_path)
    write(kind, tmp_path, {0: [5, 6]})
    assert read(kind, tmp_path) == expected(kind, {0: [5, 6]})
    assert leftovers(tmp_path) == []


@pytest.mark.listing  # states what an open that lists the directory does
@pytest.mark.timeout(60)
def test_readers_do_not_warn_about_the_temporaries_of_a_live_writer(
    tmp_path: Path, holders: list[Holder]
) -> None:
    write("stream", tmp_path, {0: [1]})
    holder = hold(holders, "stream", tmp_path, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read("stream", tmp_path) == [1]
    holder.tell("kill")
    with pytest.warns(StaleWriteWarning, match="0000000.in_band.bin.tmp"):
        assert read("stream", tmp_path) == [1]
