"""Writer modes: ``update`` (the default, GuideLoom's: replace only the shards written),
``overwrite`` (the dataset becomes exactly the shards written) and ``create`` (refuse a
directory that holds shard files).

An overwrite marks the shards it did not write as deleted, highest id first, before the first
commit point of its new shards, and removes their files after: a full disk or a kill at any
step leaves every shard old or new, no gap, and never new shards beside old shards above them.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shard_kinds
from shard_kinds import KINDS, append, expected, read, storage, write
from test_commit_faults import shard_contents

from guideloom_pipes import write_parallel
from guideloom_pipes.storage import StaleWriteWarning, StorageError, commit
from guideloom_pipes.storage.names import CREATE_LOCK

# (these tests change shard files behind the manifest's back: its StaleManifestWarning is
# the expected fallback, asserted where it matters, and would flood the report)
pytestmark = pytest.mark.filterwarnings(
    "ignore::guideloom_pipes.storage.errors.StaleManifestWarning"
)

TESTS = Path(__file__).resolve().parents[1]
#: This file's folder: its subprocesses import this module (and its neighbours) by name.
HERE = Path(__file__).resolve().parent
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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), str(HERE)]))
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


# a writer of another kind or dtype ---------------------------------------------------------

#: writers whose shards do not belong in a dataset of ``<i4`` stream shards, and what the
#: refusal names for each
FOREIGN = {
    "<u2": ("stream", [("tokens", "<u2")], "[('tokens', '<u2')]"),
    ">i4": ("stream", [("tokens", ">i4")], "[('tokens', '>i4')]"),
    "renamed field": ("stream", [("text", "<i4")], "[('text', '<i4')]"),
    "document": ("document", None, "document shards"),
    "stream_meta": ("stream_meta", None, "stream_meta shards of dtype '<i4'"),
}


def foreign_writer(case: str, path: Path, mode: str = "update") -> tuple[Any, Any]:
    """A writer of ``FOREIGN[case]`` and the record it appends."""
    kind, dtype, _ = FOREIGN[case]
    if kind == "stream":
        record = {np.dtype(dtype).names[0]: np.arange(4, dtype=np.dtype(dtype)[0])}
        return storage(kind, path, np.dtype(dtype)).sync_writer(mode=mode), record
    return storage(kind, path).sync_writer(mode=mode), {"n": 1} if kind == "document" else [1]


@pytest.mark.parametrize("case", FOREIGN)
def test_update_refuses_the_first_append_of_another_kind_or_dtype(
    tmp_path: Path, case: str
) -> None:
    write("stream", tmp_path, FOUR)
    before = shard_kinds.names(tmp_path)
    writer, record = foreign_writer(case, tmp_path)
    with writer, pytest.raises(StorageError) as error:
        writer.append(1, record)
    message = str(error.value)
    assert FOREIGN[case][2] in message  # the writer's
    assert "stream shards of dtype [('tokens', '<i4')]" in message  # the dataset's
    assert "shard 0000000" in message and "mode='overwrite'" in message
    assert shard_kinds.names(tmp_path) == before  # nothing was written
    assert read("stream", tmp_path) == expected("stream", FOUR)


@pytest.mark.parametrize(
    ("kind", "other"), [(kind, other) for kind in KINDS for other in KINDS if other != kind]
)
def test_update_refuses_a_writer_of_another_storage_kind(
    tmp_path: Path, kind: str, other: str
) -> None:
    write(kind, tmp_path, FOUR)
    with storage(other, tmp_path).sync_writer() as writer, pytest.raises(StorageError) as error:
        append(other, writer, 0, [5])
    assert f"whose committed shards are {kind} shards" in str(error.value)
    assert read(kind, tmp_path) == expected(kind, FOUR)


def test_update_refuses_another_kind_in_a_dataset_without_records(tmp_path: Path) -> None:
    write("document", tmp_path, FOUR)
    for record in tmp_path.glob("*.shard.json"):
        record.unlink()  # as GuideLoom writes it: the kind shows in the file names
    with storage("stream", tmp_path).sync_writer() as writer, pytest.raises(StorageError) as error:
        append("stream", writer, 0, [5])
    assert "whose committed shards are document shards (shard 0000000" in str(error.value)


@pytest.mark.parametrize("mode", ["overwrite", "create"])
@pytest.mark.parametrize("case", ["<u2", "document"])
def test_overwrite_and_create_accept_another_kind_or_dtype(
    tmp_path: Path, mode: str, case: str
) -> None:
    target = tmp_path / "data"
    if mode == "overwrite":
        write("stream", target, FOUR)
    writer, record = foreign_writer(case, target, mode)
    with writer:
        writer.append(0, record)
    kind, dtype, _ = FOREIGN[case]
    reopened = storage(kind, target, None if dtype is None else np.dtype(dtype))
    with reopened.sync_reader() as reader:
        assert reader.num_shards == 1 and reader.total_length in (1, 4)


@pytest.mark.listing  # states what an open that lists the directory does
def test_a_reader_of_a_dataset_that_mixes_dtypes_says_so_whichever_dtype_it_asks_for(
    tmp_path: Path,
) -> None:
    write("stream", tmp_path / "data", FOUR)
    u2 = np.dtype([("tokens", "<u2")])
    with storage("stream", tmp_path / "other", u2).sync_writer() as writer:
        writer.append(2, {"tokens": np.arange(3, dtype="<u2")})
    for name in ("0000002.in_band.bin", "0000002.shard.json"):  # copied in by hand
        (tmp_path / "data" / name).write_bytes((tmp_path / "other" / name).read_bytes())
    for asked, odd, usual in ((None, "0000002", "0000000"), (u2, "0000000", "0000002")):
        with pytest.raises(ValueError) as error:
            storage("stream", tmp_path / "data", asked).sync_reader().open()
        message = str(error.value)
        assert f"shard {odd} of" in message and f"the dtype of shard(s) {usual}" in message
        assert "the dataset mixes dtypes" in message and "Open it with" not in message


def foreign_tokens(item: int) -> Iterator[dict[str, np.ndarray]]:
    yield {"tokens": np.arange(item, dtype="<u2")}


def test_write_parallel_update_refuses_another_dtype_before_any_work(tmp_path: Path) -> None:
    write("stream", tmp_path, FOUR)
    before = shard_kinds.names(tmp_path)
    other = storage("stream", tmp_path, np.dtype([("tokens", "<u2")]))
    with cf.ThreadPoolExecutor(2) as pool, pytest.raises(StorageError, match="'<u2'"):
        write_parallel(other, [3, 4], foreign_tokens, executor=pool, mode="update", progress=False)
    assert shard_kinds.names(tmp_path) == before
    with cf.ThreadPoolExecutor(2) as pool:  # overwrite (write_parallel's default) replaces it
        write_parallel(other, [3, 4], foreign_tokens, executor=pool, progress=False)
    with other.sync_reader() as reader:
        assert (reader.num_shards, reader.total_length) == (2, 7)


# create runs at the same time --------------------------------------------------------------


def test_a_second_create_writer_is_refused_while_the_first_is_open(tmp_path: Path) -> None:
    first = storage("stream", tmp_path).sync_writer(mode="create")
    with first:
        append("stream", first, 0, [1, 2])
        second = storage("stream", tmp_path).sync_writer(mode="create")
        with pytest.raises(FileExistsError) as error:
            second.open()
        message = str(error.value)
        assert "another mode='create' writer" in message and CREATE_LOCK in message
        append("stream", first, 1, [3])
    assert read("stream", tmp_path) == [1, 2, 3]  # the first one completed
    assert CREATE_LOCK not in shard_kinds.names(tmp_path)
    with pytest.raises(FileExistsError, match="already holds shard files"):
        storage("stream", tmp_path).sync_writer(mode="create").open()


def test_a_create_writer_dropped_without_close_releases_the_directory(tmp_path: Path) -> None:
    writer = storage("stream", tmp_path).sync_writer(mode="create")
    append("stream", writer, 0, [1])
    with pytest.warns(ResourceWarning, match="dropped without close"):
        del writer
        gc.collect()
    write_mode("stream", tmp_path, {0: [2]}, "create")
    assert read("stream", tmp_path) == [2]


CREATOR = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from shard_kinds import append, storage
writer = storage("stream", Path({path!r})).sync_writer(mode="create")
writer.open()
append("stream", writer, 0, [7, 8])
print("open", flush=True)
sys.stdin.readline()
append("stream", writer, 1, [9])
writer.close()
print("done", flush=True)
"""


def start_creator(path: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CREATOR.format(tests=str(TESTS), path=str(path))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "open\n"  # it holds its create writer open
    return child


def test_a_create_run_in_another_process_is_refused_up_front_and_the_first_completes(
    tmp_path: Path,
) -> None:
    child = start_creator(tmp_path)
    try:
        with pytest.raises(FileExistsError, match="another mode='create' writer"):
            write_mode("stream", tmp_path, {0: [1], 1: [2]}, "create")
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
    assert (child.returncode, out) == (0, "done\n")
    assert read("stream", tmp_path) == [7, 8, 9]


def test_a_killed_create_writer_does_not_block_the_next_create(tmp_path: Path) -> None:
    child = start_creator(tmp_path)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    assert CREATE_LOCK in shard_kinds.names(tmp_path)  # left behind, no longer locked
    write_mode("stream", tmp_path, {0: [1], 1: [2]}, "create")  # its leftovers cleaned
    assert read("stream", tmp_path) == [1, 2]
    assert not shard_kinds.leftovers(tmp_path) and CREATE_LOCK not in shard_kinds.names(tmp_path)


#: the first write_parallel create run holds its first item here until the second has tried
HOLD = threading.Event()
STARTED = threading.Event()


def held_tokens(item: int) -> Iterator[dict[str, np.ndarray]]:
    if item == 0:
        STARTED.set()
        assert HOLD.wait(60)
    yield {"tokens": np.full(3, item, dtype="<i4")}


def test_two_write_parallel_create_runs_the_second_is_refused_the_first_completes(
    tmp_path: Path,
) -> None:
    HOLD.clear()
    STARTED.clear()
    store = storage("stream", tmp_path)
    with cf.ThreadPoolExecutor(2) as pool:
        first = threading.Thread(
            target=lambda: results.append(
                write_parallel(
                    store, range(4), held_tokens, executor=pool, mode="create", progress=False
                )
            )
        )
        results: list[Any] = []
        first.start()
        assert STARTED.wait(60)  # the first run's workers are writing
        try:
            with pytest.raises(FileExistsError, match="another mode='create' writer"):
                write_parallel(store, range(2), held_tokens, mode="create", progress=False)
        finally:
            HOLD.set()
            first.join(60)
    assert results[0].written == [0, 1, 2, 3]
    assert read("stream", tmp_path) == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
