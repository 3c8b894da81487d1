"""The tests' own check that no thread of ours outlives a test (``closed_at_the_end``): a
thread the test started and left running fails it; one left by an earlier test is reported
once, by name, and not held against this one."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch")

from loader_helpers import closed_at_the_end


def _thread(name: str, stop: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=stop.wait, name=name, daemon=True)
    thread.start()
    return thread


def test_a_thread_left_by_an_earlier_test_is_reported_not_held_against_this_one(monkeypatch):
    stop = threading.Event()
    try:
        _thread("guideloom-left-earlier", stop)
        with (
            pytest.warns(UserWarning, match="guideloom-left-earlier"),
            closed_at_the_end(monkeypatch, ()),
        ):
            pass
        with closed_at_the_end(monkeypatch, ()):  # (reported once)
            pass
    finally:
        stop.set()


@pytest.mark.slow
def test_a_thread_the_test_leaves_running_fails_it(monkeypatch):
    stop = threading.Event()
    try:
        with (
            pytest.raises(AssertionError, match="guideloom-left-running"),
            closed_at_the_end(monkeypatch, ()),
        ):
            _thread("guideloom-left-running", stop)
    finally:
        stop.set()
