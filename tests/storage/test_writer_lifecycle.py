"""A writer never closed (no ``with``, no ``close()``): when it is garbage-collected, or left
at interpreter exit, a ``ResourceWarning`` names its uncommitted shards and directory, and its
temporaries and locks are removed as ``abort()`` would."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from shard_kinds import KINDS, append, expected, leftovers, read, storage, write

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
OLD = {0: [1, 2, 3]}


@pytest.mark.parametrize("kind", KINDS)
def test_a_writer_collected_unclosed_warns_naming_its_shards_and_aborts_them(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, OLD)
    writer = storage(kind, tmp_path).sync_writer()
    append(kind, writer, 0, [7, 8])
    append(kind, writer, 3, [9])
    assert leftovers(tmp_path)
    with pytest.warns(ResourceWarning) as caught:
        del writer
        gc.collect()
    message = str(caught[0].message)
    assert "0000000, 0000003 uncommitted" in message
    assert os.fspath(tmp_path) in message
    assert "`with` block" in message and "close()" in message
    assert leftovers(tmp_path) == []
    assert read(kind, tmp_path) == expected(kind, OLD)


@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_writer_closed_or_aborted_does_not_warn_when_collected(tmp_path: Path, end: str) -> None:
    writer = storage("stream", tmp_path).sync_writer()
    append("stream", writer, 0, [1])
    getattr(writer, end)()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del writer
        gc.collect()


def test_a_writer_that_wrote_nothing_does_not_warn(tmp_path: Path) -> None:
    writer = storage("stream", tmp_path).sync_writer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del writer
        gc.collect()


LEFT_OPEN_AT_EXIT = """
    import sys
    from pathlib import Path
    from shard_kinds import append, storage, write

    path = Path(sys.argv[1])
    write("stream_meta", path, {0: [1, 2, 3]})
    WRITER = storage("stream_meta", path).sync_writer()  # a global: alive until exit
    append("stream_meta", WRITER, 0, [5, 6])
    append("stream_meta", WRITER, 1, [7])
    print("exiting", flush=True)
"""


def test_a_writer_left_unclosed_at_interpreter_exit_warns_and_removes_its_temporaries(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    child = subprocess.run(
        [
            sys.executable,
            "-W",
            "always::ResourceWarning",
            "-c",
            textwrap.dedent(LEFT_OPEN_AT_EXIT),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout == "exiting\n"
    assert "ResourceWarning" in child.stderr
    assert "0000000, 0000001 uncommitted" in child.stderr
    assert os.fspath(tmp_path) in child.stderr
    assert leftovers(tmp_path) == []
    assert read("stream_meta", tmp_path) == expected("stream_meta", OLD)
