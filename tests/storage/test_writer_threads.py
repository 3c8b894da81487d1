"""A writer shared by threads: append, close and abort are serialised, so each append lands
whole (before the commit, or refused after it) and every committed record matches its files."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from shard_kinds import KINDS, append, read, storage

THREADS = 8
APPENDS = 60


def blocks_of(values: list[int]) -> list[list[int]]:
    """``values`` cut where the block number (``value // 1000``) changes."""
    blocks: list[list[int]] = []
    for value in values:
        if blocks and blocks[-1][0] // 1000 == value // 1000:
            blocks[-1].append(value)
        else:
            blocks.append([value])
    return blocks


def plain(kind: str, got: list) -> list[int]:
    if kind == "document":
        return [d["n"] for d in got]
    if kind == "stream_meta":
        assert all(payload == f"p{v}" for v, payload in got)
        return [v for v, _ in got]
    return got


def run_threads(target, count: int = THREADS) -> None:  # type: ignore[no-untyped-def]
    start = threading.Barrier(count)
    errors: list[BaseException] = []

    def body(number: int) -> None:
        start.wait()
        try:
            target(number)
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    threads = [threading.Thread(target=body, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("kind", KINDS)
def test_threads_appending_to_one_shard_each_commit_every_append_whole(
    tmp_path: Path, kind: str
) -> None:
    with storage(kind, tmp_path).sync_writer() as writer:

        def work(number: int) -> None:
            for block in range(APPENDS):
                base = (number * APPENDS + block) * 1000
                append(kind, writer, number, [base, base + 1, base + 2])

        run_threads(work)
    values = plain(kind, read(kind, tmp_path))
    expected = [
        (n * APPENDS + b) * 1000 + i
        for n in range(THREADS)
        for b in range(APPENDS)
        for i in (0, 1, 2)
    ]
    assert values == expected
    assert storage(kind, tmp_path).verify()["shards"] == THREADS


@pytest.mark.parametrize("kind", KINDS)
def test_threads_appending_to_the_same_shard_interleave_whole_appends(
    tmp_path: Path, kind: str
) -> None:
    with storage(kind, tmp_path).sync_writer() as writer:

        def work(number: int) -> None:
            for block in range(APPENDS):
                base = (number * APPENDS + block) * 1000
                append(kind, writer, 0, [base, base + 1, base + 2])

        run_threads(work)
        assert writer.length(0) == THREADS * APPENDS * 3
    values = plain(kind, read(kind, tmp_path))
    every = [
        (n * APPENDS + b) * 1000 + i
        for n in range(THREADS)
        for b in range(APPENDS)
        for i in range(3)
    ]
    assert sorted(values) == every
    if kind != "document":  # (a document is one append each)
        blocks = blocks_of(values)
        assert len(blocks) == THREADS * APPENDS
        assert all(block == [block[0], block[0] + 1, block[0] + 2] for block in blocks)
    assert storage(kind, tmp_path).verify()["shards"] == 1


@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_close_or_abort_racing_appends_takes_each_append_whole_or_refuses_it(
    tmp_path: Path, end: str
) -> None:
    writer = storage("stream", tmp_path).sync_writer()
    writer.open()
    accepted = [0] * (THREADS - 1)
    appended = threading.Semaphore(0)

    def work(number: int) -> None:
        if number == THREADS - 1:  # the closer: once every appender got some appends in
            for _ in range(5 * (THREADS - 1)):
                appended.acquire()
            getattr(writer, end)()
            return
        block = 0
        while True:
            base = (number * 10_000 + block) * 1000
            try:
                append("stream", writer, 0, [base, base + 1, base + 2])
            except RuntimeError as error:
                assert "is closed" in str(error)
                return
            accepted[number] += 1
            block += 1
            if block <= 5:
                appended.release()

    run_threads(work)
    if end == "abort":
        assert not list(tmp_path.iterdir())
        return
    blocks = blocks_of(read("stream", tmp_path))
    assert len(blocks) == sum(accepted)
    assert all(block == [block[0], block[0] + 1, block[0] + 2] for block in blocks)
