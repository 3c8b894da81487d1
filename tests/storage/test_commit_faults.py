"""Fault injection into the commit protocol: a full disk (``ENOSPC``) and ``SIGKILL`` at every
write, ``fsync``, rename, link and unlink step of a writer session that replaces one shard and
adds a fresh one, for the three storage kinds.

After each fault every shard reads back, through our reader, as exactly its old content or
exactly its new content (a fresh shard: absent or new), and once leftovers are recovered the
canonical files alone (no records, as GuideLoom reads them) hold one such version too.

The faults come from ``guideloom_pipes.storage.commit._fault``, the hook the protocol calls
before each step; no timing is involved.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shard_kinds
from shard_kinds import KINDS, append, storage, write

from guideloom_pipes.storage import StaleWriteWarning, commit

# (these tests change shard files behind the manifest's back: its StaleManifestWarning is
# the expected fallback, asserted where it matters, and would flood the report)
pytestmark = [
    pytest.mark.fault,
    pytest.mark.filterwarnings("ignore::guideloom_pipes.storage.errors.StaleManifestWarning"),
]

TESTS = Path(__file__).resolve().parents[1]
#: This file's folder: its subprocesses import this module (and its neighbours) by name.
HERE = Path(__file__).resolve().parent
ROOT = TESTS.parent
OLD = {0: [1, 2, 3], 1: [4, 5]}
#: shard 0 is replaced, shard 2 is fresh, shard 1 is not touched
NEW = {0: [10, 11, 12, 13, 14, 15], 2: [20, 21]}
STEPS = ("write", "fsync", "rename", "link", "unlink")


@pytest.fixture(autouse=True)
def _no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """No real ``fsync``: a kill or an injected error does not need them to be durable, and
    the fault hook still sees every ``fsync`` step (this keeps the suite fast)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def session(kind: str, path: Path) -> None:
    """The writer session under test (its open included: it recovers the directory)."""
    with storage(kind, path).sync_writer() as writer:
        for shard, values in NEW.items():
            append(kind, writer, shard, values)


def fault_points(kind: str, tmp_path: Path) -> list[tuple[str, str]]:
    """Every (step, path) the session calls the hook with, in order."""
    path = tmp_path / "count"
    write(kind, path, OLD)
    calls: list[tuple[str, str]] = []
    real = commit._fault
    commit._fault = lambda step, target: calls.append((step, os.path.basename(target)))
    try:
        session(kind, path)
    finally:
        commit._fault = real
    assert shard_contents(kind, path) == {0: NEW[0], 1: OLD[1], 2: NEW[2]}
    return calls


def shard_contents(kind: str, path: Path) -> dict[int, list[Any]]:
    """Each shard's values as our reader reads them (``expected(kind, {0: values})``
    shape), keyed by shard id."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StaleWriteWarning)  # a killed writer's leftovers
        with storage(kind, path).sync_reader() as reader:
            out: dict[int, list[Any]] = {}
            start = 0
            for shard in range(reader.num_shards):
                count = reader.length(shard)
                if kind == "document":
                    got = list(reader.read_many(np.arange(start, start + count)))
                    out[shard] = [d["n"] for d in got]
                else:
                    data = reader.read(start, count)
                    if kind == "stream":
                        out[shard] = [int(v) for v in data["tokens"]]
                    else:
                        assert all(payload == f"p{v}" for v, payload in data)
                        out[shard] = [v for v, _ in data]
                start += count
            return out


def check_old_or_new(kind: str, path: Path) -> dict[int, list[Any]]:
    """Assert each shard is exactly old or exactly new; the contents."""
    got = shard_contents(kind, path)
    assert got.get(0) in (OLD[0], NEW[0]), got
    assert got.get(1) == OLD[1], got
    assert got.get(2) in (None, NEW[2]), got
    assert set(got) <= {0, 1, 2}
    return got


def check_guideloom_view(kind: str, path: Path, tmp_path: Path) -> dict[int, list[Any]]:
    """Recover ``path``, then read only its canonical files (records removed, as GuideLoom
    reads it): each shard old or new. The contents."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StaleWriteWarning)
        storage(kind, path).recover()
    names = shard_kinds.names(path)
    assert not [n for n in names if ".v" in n or n.endswith((".tmp", ".pending"))], names
    bare = tmp_path / "guideloom-view"
    shutil.copytree(path, bare)
    for record in bare.glob("*.shard.json"):
        record.unlink()
    return check_old_or_new(kind, bare)


@pytest.mark.parametrize("kind", KINDS)
def test_every_step_kind_of_the_commit_calls_the_fault_hook(kind: str, tmp_path: Path) -> None:
    steps = {step for step, _ in fault_points(kind, tmp_path)}
    assert steps == set(STEPS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_disk_at_any_step_leaves_every_shard_old_or_new_and_no_debris(
    kind: str, tmp_path: Path
) -> None:
    points = fault_points(kind, tmp_path)
    outcomes = set()
    for index in range(len(points)):
        path = tmp_path / f"enospc-{index}"
        write(kind, path, OLD)
        calls = [0]

        def fault(step: str, target: str, index: int = index, calls: list[int] = calls) -> None:
            calls[0] += 1
            if calls[0] == index + 1:
                raise OSError(errno.ENOSPC, "injected: no space left on device", target)

        commit._fault = fault
        try:
            with pytest.raises(OSError, match="no space left"):
                session(kind, path)
        finally:
            commit._fault = commit_fault
        got = check_old_or_new(kind, path)
        outcomes.add((tuple(got[0]), 2 in got))
        assert shard_kinds.leftovers(path) == [], points[index]
        assert not [n for n in shard_kinds.names(path) if ".v" in n], points[index]
        assert check_guideloom_view(kind, path, tmp_path / f"view-{index}") == got
    # the faults fell before and after the commit points
    assert (tuple(OLD[0]), False) in outcomes and (tuple(NEW[0]), True) in outcomes


commit_fault = commit._fault

KILL_AT_EVERY_STEP = """
    import os, signal, sys
    from pathlib import Path
    from shard_kinds import write
    from test_commit_faults import OLD, session
    from guideloom_pipes.storage import commit

    os.fsync = lambda fd: None  # not needed against a kill; the hook still sees each step
    kind, root, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    for index in range(count):
        path = root / str(index)
        write(kind, path, OLD)
        pid = os.fork()
        if pid == 0:
            calls = [0]

            def fault(step, target):
                calls[0] += 1
                if calls[0] == index + 1:
                    os.kill(os.getpid(), signal.SIGKILL)

            commit._fault = fault
            try:
                session(kind, path)
            finally:
                os._exit(0)  # not reached when the kill came
        _, status = os.waitpid(pid, 0)
        print(index, os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_sigkill_at_any_step_leaves_every_shard_old_or_new_and_recoverable(
    kind: str, tmp_path: Path
) -> None:
    points = fault_points(kind, tmp_path)
    root = tmp_path / "killed"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), str(HERE)]))
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(KILL_AT_EVERY_STEP),
            kind,
            str(root),
            str(len(points)),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=110,
    )
    assert child.returncode == 0, child.stderr
    killed = [line.split() for line in child.stdout.splitlines()]
    assert killed == [[str(i), "True"] for i in range(len(points))]
    outcomes = set()
    for index in range(len(points)):
        path = root / str(index)
        got = check_old_or_new(kind, path)
        outcomes.add((tuple(got[0]), 2 in got))
        assert check_guideloom_view(kind, path, tmp_path / f"view-{index}") == got, points[index]
        assert shard_contents(kind, path) == got  # recovery changed no shard's version
        write(kind, path, {0: [7], 1: [8], 2: [9]})  # and the next writer just works
        assert shard_contents(kind, path) == {0: [7], 1: [8], 2: [9]}
    assert (tuple(OLD[0]), False) in outcomes and (tuple(NEW[0]), True) in outcomes


KILL_RECOVERY_AT_EVERY_STEP = """
    import os, shutil, signal, sys
    from pathlib import Path
    from shard_kinds import storage, write
    from test_commit_faults import OLD, session
    from guideloom_pipes.storage import commit

    os.fsync = lambda fd: None
    kind, root = sys.argv[1], Path(sys.argv[2])

    def killed_at(index, run):
        pid = os.fork()
        if pid == 0:
            calls = [0]

            def fault(step, target):
                calls[0] += 1
                if index is None and step == "link" or calls[0] == index:
                    os.kill(os.getpid(), signal.SIGKILL)

            commit._fault = fault
            try:
                run()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        return os.WIFSIGNALED(status)

    # a writer killed after its commit points, at its first link: records name .v files
    template = root / "template"
    write(kind, template, OLD)
    assert killed_at(None, lambda: session(kind, template))
    shutil.copytree(template, root / "count")
    calls = []
    commit._fault = lambda step, target: calls.append(step)
    storage(kind, root / "count").recover()
    commit._fault = lambda step, target: None
    print(len(calls))
    for index in range(1, len(calls) + 1):
        path = root / str(index)
        shutil.copytree(template, path)
        print(index, killed_at(index, lambda: storage(kind, path).recover()))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_sigkill_at_any_step_of_recovery_leaves_the_new_version_and_recovers_again(
    kind: str, tmp_path: Path
) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), str(HERE)]))
    script = textwrap.dedent(KILL_RECOVERY_AT_EVERY_STEP)
    child = subprocess.run(
        [sys.executable, "-c", script, kind, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=110,
    )
    assert child.returncode == 0, child.stderr
    lines = child.stdout.split("\n")
    count = int(lines[0])
    assert count > 5  # links, renames, record writes, unlinks
    assert lines[1 : count + 1] == [f"{i} True" for i in range(1, count + 1)]
    new = {0: NEW[0], 1: OLD[1], 2: NEW[2]}
    assert check_old_or_new(kind, tmp_path / "template") == new
    for index in range(1, count + 1):
        path = tmp_path / str(index)
        assert check_old_or_new(kind, path) == new
        assert check_guideloom_view(kind, path, tmp_path / f"view-{index}") == new


@pytest.mark.parametrize("kind", KINDS)
def test_readers_opened_at_every_step_of_a_commit_see_old_or_new(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "data"
    write(kind, path, OLD)
    seen: list[dict[int, list[Any]]] = []

    def fault(step: str, target: str) -> None:  # the writer pauses here: open a reader
        seen.append(check_old_or_new(kind, path))

    commit._fault = fault
    try:
        session(kind, path)
    finally:
        commit._fault = commit_fault
    assert seen[0] == OLD and seen[-1] == {0: NEW[0], 1: OLD[1], 2: NEW[2]}
