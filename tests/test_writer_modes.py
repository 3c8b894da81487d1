"""Writer modes: ``update`` (the default, GuideLoom's: replace only the shards written),
``overwrite`` (the dataset becomes exactly the shards written) and ``create`` (refuse a
directory that holds shard files).

An overwrite marks the shards it did not write as deleted, highest id first, before the first
commit point of its new shards, and removes their files after: a full disk or a kill at any
step leaves every shard old or new, no gap, and never new shards beside old shards above them.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import shard_kinds
from shard_kinds import KINDS, append, expected, read, storage, write
from test_commit_faults import shard_contents

from guideloom_pipes.storage import StaleWriteWarning, commit

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
EIGHT = {k: [k * 10, k * 10 + 1] for k in range(8)}
FOUR = {k: [100 + k] * (k + 1) for k in range(4)}


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """No real ``fsync``: a kill or an injected error does not need them to be durable, and
    the fault hook still sees every ``fsync`` step (this keeps the suite fast)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def write_mode(kind: str, path: Path, shards: dict[int, list[int]], mode: str) -> None:
    with storage(kind, path).sync_writer(mode=mode) as writer:
        for shard, values in shards.items():
            append(kind, writer, shard, values)


# update ------------------------------------------------------------------------------------


def test_the_default_mode_is_update(tmp_path: Path) -> None:
    writer = storage("stream", tmp_path).sync_writer()
    assert writer.mode == "update"
    writer.abort()


@pytest.mark.parametrize("kind", KINDS)
def test_update_replaces_the_shards_written_and_warns_of_older_shards_left_above(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, EIGHT)
    with pytest.warns(UserWarning, match="shards up to 0000003") as caught:
        write_mode(kind, tmp_path, FOUR, "update")
    message = str(caught[0].message)
    assert "4 shard(s) it did not write" in message and "0000004, 0000005" in message
    assert "mode='overwrite'" in message and os.fspath(tmp_path) in message
    assert read(kind, tmp_path) == expected(kind, {**EIGHT, **FOUR})


def test_update_does_not_warn_of_shards_another_writer_committed_meanwhile(
    tmp_path: Path,
) -> None:
    first = storage("stream", tmp_path).sync_writer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with first:
            append("stream", first, 0, [1])
            write("stream", tmp_path, {1: [2], 2: [3]})  # a second writer of the dataset
    assert read("stream", tmp_path) == [1, 2, 3]


def test_update_does_not_warn_when_no_older_shard_is_above(tmp_path: Path) -> None:
    write("stream", tmp_path, EIGHT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_mode("stream", tmp_path, {7: [5]}, "update")


# overwrite ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_overwrite_removes_every_shard_it_did_not_write(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, EIGHT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_mode(kind, tmp_path, FOUR, "overwrite")
    assert read(kind, tmp_path) == expected(kind, FOUR)
    suffixes = (*shard_kinds.SUFFIXES[kind], ".shard.json")
    assert shard_kinds.names(tmp_path) == sorted(
        f"000000{k}{s}" for k in range(4) for s in suffixes
    )


def test_overwrite_removes_the_shards_of_a_dataset_guideloom_wrote(tmp_path: Path) -> None:
    write("document", tmp_path, EIGHT)
    for record in tmp_path.glob("*.shard.json"):
        record.unlink()
    write_mode("document", tmp_path, {0: [5]}, "overwrite")
    assert read("document", tmp_path) == expected("document", {0: [5]})
    assert len(shard_kinds.names(tmp_path)) == 3


def test_overwrite_refuses_while_another_writer_holds_a_shard_it_would_remove(
    tmp_path: Path,
) -> None:
    write("stream", tmp_path, EIGHT)
    holder = storage("stream", tmp_path).sync_writer()
    with holder:
        append("stream", holder, 7, [77])
        with pytest.raises(BlockingIOError, match="shard 0000007"):
            write_mode("stream", tmp_path, FOUR, "overwrite")
        assert read("stream", tmp_path) == expected("stream", EIGHT)  # nothing changed
    assert read("stream", tmp_path) == expected("stream", {**EIGHT, 7: [77]})


def check_overwrite_outcome(kind: str, path: Path) -> None:
    """Each shard old or new; no gap; no new shard beside an old one above it."""
    got = shard_contents(kind, path)
    assert sorted(got) == list(range(len(got)))
    new = [k for k in got if k < 4 and got[k] == FOUR[k]]
    for shard, values in got.items():
        assert values in (EIGHT[shard], FOUR.get(shard)), got
    if new:
        assert len(got) <= 4, got  # the others were marked deleted before any commit point


def overwrite_points(kind: str, tmp_path: Path) -> int:
    path = tmp_path / "count"
    write(kind, path, EIGHT)
    calls = [0]
    commit._fault = lambda step, target: calls.__setitem__(0, calls[0] + 1)
    try:
        write_mode(kind, path, FOUR, "overwrite")
    finally:
        commit._fault = FAULT
    return calls[0]


FAULT = commit._fault


@pytest.mark.fault
@pytest.mark.parametrize("kind", KINDS)
def test_a_full_disk_at_any_step_of_an_overwrite_leaves_a_consistent_dataset(
    tmp_path: Path, kind: str
) -> None:
    for index in range(overwrite_points(kind, tmp_path)):
        path = tmp_path / f"enospc-{index}"
        write(kind, path, EIGHT)
        calls = [0]

        def fault(step: str, target: str, index: int = index, calls: list[int] = calls) -> None:
            calls[0] += 1
            if calls[0] == index + 1:
                raise OSError(errno.ENOSPC, "injected: no space left on device", target)

        commit._fault = fault
        try:
            with pytest.raises(OSError, match="no space left"):
                write_mode(kind, path, FOUR, "overwrite")
        finally:
            commit._fault = FAULT
        check_overwrite_outcome(kind, path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StaleWriteWarning)
            storage(kind, path).recover()
        check_overwrite_outcome(kind, path)


@pytest.mark.fault
@pytest.mark.parametrize("kind", KINDS)
def test_readers_opened_at_every_step_of_an_overwrite_see_a_consistent_dataset(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, EIGHT)
    opened = [0]

    def fault(step: str, target: str) -> None:
        check_overwrite_outcome(kind, tmp_path)
        opened[0] += 1

    commit._fault = fault
    try:
        write_mode(kind, tmp_path, FOUR, "overwrite")
    finally:
        commit._fault = FAULT
    assert opened[0] > 20
    assert shard_contents(kind, tmp_path) == FOUR


KILL_OVERWRITE_AT_EVERY_STEP = """
    import os, signal, sys
    from pathlib import Path
    from shard_kinds import write
    from test_writer_modes import EIGHT, FOUR, write_mode
    from guideloom_pipes.storage import commit

    os.fsync = lambda fd: None  # not needed against a kill; the hook still sees each step
    kind, root, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    for index in range(count):
        path = root / str(index)
        write(kind, path, EIGHT)
        pid = os.fork()
        if pid == 0:
            calls = [0]

            def fault(step, target):
                calls[0] += 1
                if calls[0] == index + 1:
                    os.kill(os.getpid(), signal.SIGKILL)

            commit._fault = fault
            try:
                write_mode(kind, path, FOUR, "overwrite")
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(index, os.WIFSIGNALED(status))
"""


@pytest.mark.fault
@pytest.mark.timeout(120)
def test_sigkill_at_any_step_of_an_overwrite_leaves_a_consistent_dataset(tmp_path: Path) -> None:
    kind = "stream_meta"
    count = overwrite_points(kind, tmp_path)
    root = tmp_path / "killed"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    script = textwrap.dedent(KILL_OVERWRITE_AT_EVERY_STEP)
    child = subprocess.run(
        [sys.executable, "-c", script, kind, str(root), str(count)],
        capture_output=True,
        text=True,
        env=env,
        timeout=110,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == [x for i in range(count) for x in (str(i), "True")]
    for index in range(count):
        path = root / str(index)
        check_overwrite_outcome(kind, path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StaleWriteWarning)
            storage(kind, path).recover()
        check_overwrite_outcome(kind, path)
        assert not shard_kinds.leftovers(path)


# create ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_create_refuses_a_directory_that_holds_shard_files(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, {0: [1]})
    with pytest.raises(FileExistsError) as error:
        write_mode(kind, tmp_path, {0: [2]}, "create")
    message = str(error.value)
    assert os.fspath(tmp_path) in message and "0000000.shard.json" in message
    assert "mode='create'" in message and "mode='overwrite'" in message
    assert read(kind, tmp_path) == expected(kind, {0: [1]})


def test_create_writes_into_a_new_or_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("not a shard")
    for path in (tmp_path / "new", tmp_path / "empty"):
        write_mode("stream", path, {0: [1], 1: [2]}, "create")
        assert read("stream", path) == [1, 2]


@pytest.mark.parametrize("mode", ["append", "", None, "Update"])
def test_a_bad_mode_is_a_value_error_naming_the_choices(tmp_path: Path, mode: Any) -> None:
    with pytest.raises(ValueError, match=r"mode must be one of 'update', 'overwrite', 'create'"):
        storage("document", tmp_path).sync_writer(mode=mode)
