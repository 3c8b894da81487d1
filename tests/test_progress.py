"""The tools' progress display: plain lines without tqdm (at the end, and every few seconds),
a tqdm bar when tqdm is installed, nothing when disabled."""

from __future__ import annotations

import io

import pytest

from guideloom_pipes.progress import Progress, human_bytes


def test_without_tqdm_a_last_line_gives_the_totals() -> None:
    out = io.StringIO()
    with Progress("writing", 3, stream=out, use_tqdm=False) as progress:
        progress.update(1, records=5, bytes=2048)
        progress.update(2, records=1, bytes=1024)
    (line,) = out.getvalue().splitlines()
    assert line.startswith("writing done: 3 items of 3 items (100%), records 6, bytes 3.0 KiB in ")


def test_without_tqdm_a_line_comes_every_interval() -> None:
    out = io.StringIO()
    progress = Progress("verifying", 10, "B", stream=out, use_tqdm=False, interval=0.0)
    progress.update(4)
    assert out.getvalue().startswith("verifying: 4 B of 10 B (40%) in ")
    progress.close()
    assert "verifying done: 4 B of 10 B (40%)" in out.getvalue()


def test_disabled_progress_writes_nothing_but_counts() -> None:
    out = io.StringIO()
    with Progress("writing", 2, stream=out, enabled=False) as progress:
        progress.update(2, records=3)
    assert out.getvalue() == ""
    assert (progress.done, progress.extra) == (2, {"records": 3})


def test_with_tqdm_a_bar_shows_the_counters() -> None:
    pytest.importorskip("tqdm")
    out = io.StringIO()
    with Progress("writing", 2, stream=out) as progress:
        progress.update(1, records=7, bytes=10)
        progress.update(1, records=1, bytes=10)
    shown = out.getvalue()
    assert "writing" in shown and "2/2" in shown and "records 8" in shown


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (5, 2048, 3 << 30)] == ["5 B", "2.0 KiB", "3.0 GiB"]
