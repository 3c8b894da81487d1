"""A shard becomes visible only when its writer closes successfully; never half-written.

Covers the commit protocol of ``guideloom_pipes.storage.commit``: temporaries until close,
abort on an exception, a writer killed with SIGKILL mid-write or mid-commit, failures inside
``close``, the ``fsync`` calls, and the writer's refusals.
"""

from __future__ import annotations

import errno
import gc
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import shard_kinds
from hypothesis import given, settings
from hypothesis import strategies as st
from shard_kinds import KINDS, SUFFIXES, append, expected, leftovers, read, storage, write

from guideloom_pipes.storage import StaleWriteWarning, UncommittedShardError

# (these tests change shard files behind the manifest's back: its StaleManifestWarning is
# the expected fallback, asserted where it matters, and would flood the report)
pytestmark = pytest.mark.filterwarnings(
    "ignore::guideloom_pipes.storage.errors.StaleManifestWarning"
)

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
OLD = {0: [1, 2, 3]}
NEW = {0: [10, 11, 12, 13, 14], 1: [20, 21]}


def run_child(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh Python with the package and the test helpers importable."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


# Visible only after a successful close ------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_new_shard_is_invisible_until_its_writer_closes(tmp_path: Path, kind: str) -> None:
    with storage(kind, tmp_path).sync_writer() as writer:
        append(kind, writer, 0, NEW[0])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a live writer's temporaries are not stale
            with pytest.raises(FileNotFoundError, match="no shards in"):
                read(kind, tmp_path)
    assert read(kind, tmp_path) == expected(kind, {0: NEW[0]})


@pytest.mark.parametrize("kind", KINDS)
def test_a_rewrite_is_invisible_until_its_writer_closes(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, OLD)
    with storage(kind, tmp_path).sync_writer() as writer:
        for shard, values in NEW.items():
            append(kind, writer, shard, values)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert read(kind, tmp_path) == expected(kind, OLD)
    assert read(kind, tmp_path) == expected(kind, NEW)


@pytest.mark.parametrize("kind", KINDS)
def test_an_exception_in_the_with_block_keeps_the_previous_shard_and_adds_none(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, OLD)
    with pytest.raises(KeyboardInterrupt), storage(kind, tmp_path).sync_writer() as writer:
        for shard, values in NEW.items():
            append(kind, writer, shard, values)
        raise KeyboardInterrupt
    assert read(kind, tmp_path) == expected(kind, OLD)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", KINDS)
def test_an_exception_in_the_with_block_of_a_first_write_leaves_no_files(
    tmp_path: Path, kind: str
) -> None:
    with pytest.raises(RuntimeError, match="boom"), storage(kind, tmp_path).sync_writer() as w:
        append(kind, w, 0, NEW[0])
        raise RuntimeError("boom")
    assert shard_kinds.names(tmp_path) == []


@pytest.mark.parametrize("kind", KINDS)
def test_abort_drops_the_session_and_keeps_the_previous_shard(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, OLD)
    writer = storage(kind, tmp_path).sync_writer()
    writer.open()
    append(kind, writer, 0, NEW[0])
    writer.abort()
    assert read(kind, tmp_path) == expected(kind, OLD)
    assert leftovers(tmp_path) == []


def test_a_writer_dropped_without_close_leaves_nothing_behind(tmp_path: Path) -> None:
    write("stream", tmp_path, OLD)
    writer = storage("stream", tmp_path).sync_writer()
    append("stream", writer, 0, NEW[0])
    with pytest.warns(ResourceWarning, match="dropped without close"):
        del writer
        gc.collect()
    assert read("stream", tmp_path) == expected("stream", OLD)
    assert leftovers(tmp_path) == []


class Abandon(Exception):
    """Raised inside a writer's ``with`` block to abandon the session."""


SESSIONS = st.lists(
    st.tuples(
        st.dictionaries(
            st.integers(0, 3), st.lists(st.integers(0, 999), max_size=4), min_size=1, max_size=3
        ),
        st.booleans(),
    ),
    min_size=1,
    max_size=4,
)


@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
@settings(deadline=None, max_examples=40)
@given(kind=st.sampled_from(KINDS), sessions=SESSIONS)
def test_readers_see_the_last_committed_content_of_every_shard(
    kind: str, sessions: list[tuple[dict[int, list[int]], bool]]
) -> None:
    committed: dict[int, list[int]] = {}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory)
        for shards, completes in sessions:
            try:
                with storage(kind, path).sync_writer() as writer:
                    for shard, values in shards.items():
                        append(kind, writer, shard, values)
                    if not completes:
                        raise Abandon
            except Abandon:
                continue
            # (no document appended: a document shard was not touched, so not replaced)
            committed.update({k: v for k, v in shards.items() if v or kind != "document"})
        assert leftovers(path) == []
        if committed and sorted(committed) == list(range(len(committed))):
            assert read(kind, path) == expected(kind, committed)
        else:
            with pytest.raises(FileNotFoundError):
                read(kind, path)


# SIGKILL mid-write ----------------------------------------------------------------------------

KILLED_MID_WRITE = """
    import os, signal, sys
    from pathlib import Path
    from shard_kinds import append, storage, write

    kind, path = sys.argv[1], Path(sys.argv[2])
    write(kind, path, {0: [1, 2, 3]})
    writer = storage(kind, path).sync_writer()
    writer.open()
    # Megabytes: past the write buffers, so bytes reach the .tmp files.
    n = {"stream": 1_000_000, "document": 60_000, "stream_meta": 150_000}[kind]
    append(kind, writer, 0, range(n))
    append(kind, writer, 1, range(n // 4))
    print("writing", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""

KILLED_MID_COMMIT = """
    import os, signal, sys
    from pathlib import Path
    from shard_kinds import SUFFIXES, append, storage, write
    from guideloom_pipes.storage import commit

    kind, path = sys.argv[1], Path(sys.argv[2])
    write(kind, path, {0: [1, 2, 3]})
    # Die as the last data file gets its canonical name: past the commit point (the record
    # names the versioned files), and (for the multi-file kinds) some canonical files are
    # already new, others still old.
    last = SUFFIXES[kind][-1]

    def fault(step, target):
        if step == "link" and target.endswith(last + ".tmp"):
            print("committing", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    commit._fault = fault
    with storage(kind, path).sync_writer() as writer:
        append(kind, writer, 0, range(100, 200))
"""


def killed_writer(factory: pytest.TempPathFactory, script: str, kind: str, said: str) -> Path:
    """A directory left by a child that ran ``script`` and killed itself (once per kind)."""
    path = factory.mktemp(f"killed-{kind}")
    child = run_child(script, kind, str(path))
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert child.stdout == said
    return path


@pytest.fixture(scope="module", params=KINDS)
def killed_mid_write(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    kind = request.param
    return kind, killed_writer(tmp_path_factory, KILLED_MID_WRITE, kind, "writing\n")


@pytest.fixture(scope="module", params=KINDS)
def killed_mid_commit(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    kind = request.param
    return kind, killed_writer(tmp_path_factory, KILLED_MID_COMMIT, kind, "committing\n")


def copy_of(template: Path, tmp_path: Path) -> Path:
    path = tmp_path / "data"
    shutil.copytree(template, path)
    return path


# SIGKILL mid-write ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_writer_killed_mid_write_leaves_the_old_shard_and_no_new_one(
    tmp_path: Path, killed_mid_write: tuple[str, Path]
) -> None:
    kind, path = killed_mid_write[0], copy_of(killed_mid_write[1], tmp_path)
    bulk = ".out_of_band.bin" if kind == "document" else ".in_band.bin"
    assert (path / f"0000000{bulk}.tmp").stat().st_size > 0  # bytes reached the disk
    with pytest.warns(StaleWriteWarning):
        assert read(kind, path) == expected(kind, OLD)
    assert [n for n in shard_kinds.names(path) if n.startswith("0000001")] == sorted(
        f"0000001{s}.tmp" for s in (*SUFFIXES[kind], ".shard.json")
    )


@pytest.mark.timeout(60)
def test_readers_name_the_temporaries_a_killed_writer_left(
    tmp_path: Path, killed_mid_write: tuple[str, Path]
) -> None:
    kind, path = killed_mid_write[0], copy_of(killed_mid_write[1], tmp_path)
    left = leftovers(path)
    assert {"0000000.shard.json.tmp", "0000001.shard.json.tmp"} <= set(left)
    assert {f"000000{k}{s}.tmp" for k in (0, 1) for s in SUFFIXES[kind]} <= set(left)
    with pytest.warns(StaleWriteWarning) as caught:
        read(kind, path)
    message = " ".join(str(w.message) for w in caught)
    for name in left:
        assert name in message
    assert "shard 0000000" in message and "shard 0000001" in message


@pytest.mark.timeout(60)
def test_the_next_writer_replaces_stale_temporaries_and_commits(
    tmp_path: Path, killed_mid_write: tuple[str, Path]
) -> None:
    kind, path = killed_mid_write[0], copy_of(killed_mid_write[1], tmp_path)
    write(kind, path, NEW)
    assert leftovers(path) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read(kind, path) == expected(kind, NEW)


# A crash during the commit -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_writer_killed_after_the_commit_point_leaves_the_new_version_readable(
    tmp_path: Path, killed_mid_commit: tuple[str, Path]
) -> None:
    kind, path = killed_mid_commit[0], copy_of(killed_mid_commit[1], tmp_path)
    assert any(".v2." in name for name in shard_kinds.names(path))  # not yet rolled forward
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StaleWriteWarning)  # the dead writer's lock file
        assert read(kind, path) == expected(kind, {0: list(range(100, 200))})


@pytest.mark.timeout(60)
def test_the_next_writer_rolls_a_killed_commit_forward_to_the_canonical_names(
    tmp_path: Path, killed_mid_commit: tuple[str, Path]
) -> None:
    kind, path = killed_mid_commit[0], copy_of(killed_mid_commit[1], tmp_path)
    with storage(kind, path).sync_writer():
        pass
    canonical = sorted(f"0000000{s}" for s in (*SUFFIXES[kind], ".shard.json"))
    assert shard_kinds.names(path) == canonical
    assert read(kind, path) == expected(kind, {0: list(range(100, 200))})
    write(kind, path, NEW)
    assert read(kind, path) == expected(kind, NEW)
    assert leftovers(path) == []


def fail_replace_of(monkeypatch: pytest.MonkeyPatch, suffix: str, times: int = 0) -> None:
    """Make the renames of a ``<suffix>.tmp`` file fail as a broken disk would: its rename
    to the versioned name (before the commit point), or with ``times``, the first ``times``
    renames to the canonical name (after it) instead."""
    real = os.replace
    left = [times]

    def replace(src: Any, dst: Any) -> None:
        source, versioned = os.fspath(src), ".v" in os.path.basename(os.fspath(dst))
        chosen = versioned if not times else not versioned
        if source.endswith(suffix + ".tmp") and chosen and (left[0] > 0 or not times):
            left[0] -= 1
            raise OSError(errno.EIO, "injected I/O error", source)
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("kind", ["document", "stream_meta"])
def test_a_failure_between_the_renames_of_a_committed_shard_keeps_its_new_version_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    write(kind, tmp_path, OLD)
    # the first canonical file of shard 0 is already new when the last one's rename fails
    fail_replace_of(monkeypatch, SUFFIXES[kind][-1], times=2)
    committed = r"after shard\(s\) 0000000 were committed"
    with (
        pytest.raises(OSError, match=committed) as error,
        storage(kind, tmp_path).sync_writer() as w,
    ):
        append(kind, w, 0, range(100, 200))
    assert "injected" in str(error.value)
    assert "versioned names" in str(error.value)  # the retry failed too: GuideLoom warned
    monkeypatch.undo()
    assert read(kind, tmp_path) == expected(kind, {0: list(range(100, 200))})
    assert leftovers(tmp_path) == []
    with storage(kind, tmp_path).sync_writer():  # the next writer rolls it forward
        pass
    assert not [n for n in shard_kinds.names(tmp_path) if ".v" in n]
    assert read(kind, tmp_path) == expected(kind, {0: list(range(100, 200))})


@pytest.mark.parametrize("kind", KINDS)
def test_a_failure_before_any_data_file_is_renamed_keeps_the_previous_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    write(kind, tmp_path, OLD)
    fail_replace_of(monkeypatch, SUFFIXES[kind][0])
    with pytest.raises(OSError, match="injected"), storage(kind, tmp_path).sync_writer() as w:
        append(kind, w, 0, range(100, 200))
        append(kind, w, 1, [5])
    monkeypatch.undo()
    assert read(kind, tmp_path) == expected(kind, OLD)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_disk_while_flushing_keeps_every_shard_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    write(kind, tmp_path, {0: [1, 2, 3], 1: [4, 5]})
    calls = []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 3:  # partway through the second shard's files
            raise OSError(errno.ENOSPC, "injected: no space left on device")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="no space"), storage(kind, tmp_path).sync_writer() as w:
        for shard, values in NEW.items():
            append(kind, w, shard, values)
    monkeypatch.undo()
    assert read(kind, tmp_path) == expected(kind, {0: [1, 2, 3], 1: [4, 5]})
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_pending_commit_record_is_reported_as_uncommitted(tmp_path: Path, kind: str) -> None:
    write(kind, tmp_path, {0: [1, 2], 1: [3], 2: [4]})
    record = tmp_path / "0000001.shard.json"
    record.write_text(record.read_text().replace('"committed"', '"pending"'))
    with pytest.raises(UncommittedShardError) as error:
        read(kind, tmp_path)
    assert "shard 0000001" in str(error.value)
    assert "'pending'" in str(error.value)


def test_a_shard_being_committed_right_now_is_reported_as_such(tmp_path: Path) -> None:
    write("stream", tmp_path, OLD)
    record = tmp_path / "0000000.shard.json"
    record.write_text(record.read_text().replace('"committed"', '"pending"'))
    writer = storage("stream", tmp_path).sync_writer()
    with writer:  # holds the write lock of shard 0, as a writer between its renames does
        append("stream", writer, 0, [7])
        with pytest.raises(UncommittedShardError, match="being committed by a live writer"):
            read("stream", tmp_path)
    assert read("stream", tmp_path) == [7]


# fsync ---------------------------------------------------------------------------------------


@pytest.mark.listing  # states what an open that lists the directory does
def test_commit_fsyncs_every_data_file_the_record_and_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to tell which file an fsync is for")
    real = os.fsync
    synced: list[str] = []

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        synced.append(path + ("/" if is_dir else ""))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write("stream_meta", tmp_path, NEW)
    base = os.fspath(tmp_path)
    for shard in ("0000000", "0000001"):
        for suffix in SUFFIXES["stream_meta"]:
            assert f"{base}/{shard}{suffix}.tmp" in synced
        # the committed record naming the versioned files, then the one naming canonical ones
        assert synced.count(f"{base}/{shard}.shard.json.pending") == 2
    # versioned names, commit points, canonical names, settled records
    assert synced.count(base + "/") == 4
    assert synced[-1] == base + "/"
    first_dir = synced.index(base + "/")
    assert all(p.endswith(".tmp") for p in synced[:first_dir])  # the data, before any rename


def test_closing_a_writer_that_wrote_nothing_touches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", calls.append)
    with storage("stream", tmp_path).sync_writer():
        pass
    assert calls == []
    assert shard_kinds.names(tmp_path) == []


# Refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shard", [-1, -10_000_000])
def test_append_refuses_a_negative_shard_id_and_names_it(
    tmp_path: Path, kind: str, shard: int
) -> None:
    writer = storage(kind, tmp_path).sync_writer()
    with writer, pytest.raises(ValueError, match=f"shard id must be >= 0, got {shard}$"):
        append(kind, writer, shard, [1])
    assert shard_kinds.names(tmp_path) == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("shard", "shown"), [(1.0, "1.0 (float)"), ("3", "'3' (str)"), (True, "True (bool)")]
)
def test_append_refuses_a_shard_id_that_is_not_an_int_and_names_it(
    tmp_path: Path, kind: str, shard: Any, shown: str
) -> None:
    with storage(kind, tmp_path).sync_writer() as writer, pytest.raises(TypeError) as error:
        append(kind, writer, shard, [1])
    assert str(error.value) == f"shard id must be an int, got {shown}"
    assert shard_kinds.names(tmp_path) == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("end", ["close", "abort"])
def test_append_after_the_writer_closed_is_a_runtime_error_naming_the_directory(
    tmp_path: Path, kind: str, end: str
) -> None:
    writer = storage(kind, tmp_path).sync_writer()
    with writer:
        append(kind, writer, 0, [1])
    if end == "abort":
        writer = storage(kind, tmp_path).sync_writer()
        writer.abort()
    with pytest.raises(RuntimeError, match="is closed") as error:
        append(kind, writer, 0, [2])
    assert os.fspath(tmp_path) in str(error.value)
    assert read(kind, tmp_path) == expected(kind, {0: [1]})


def test_closing_twice_is_harmless(tmp_path: Path) -> None:
    writer = storage("stream", tmp_path).sync_writer()
    with writer:
        append("stream", writer, 0, [1])
    writer.close()
    writer.abort()
    assert read("stream", tmp_path) == [1]
