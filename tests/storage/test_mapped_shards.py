"""A reader keeps at most ``max_mapped`` shards of a file kind mapped (past the kernel's
``vm.max_map_count``, 65,530 by default, ``mmap`` fails: an epoch over 100,000 small shards
used to stop with ``OSError: mmap failed: Cannot allocate memory``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from shard_kinds import KINDS, SUFFIXES, expected, read, storage, write

from guideloom_pipes.storage import shard_files
from guideloom_pipes.storage.backend_base import map_limit, max_mapped_per_kind

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="counts mappings in /proc/self/maps"
)

LIMIT = 4
SHARDS = {shard: range(shard * 1000, shard * 1000 + 50) for shard in range(30)}


def _mapped(path: Path, suffix: str) -> int:
    """The shard files of ``suffix`` under ``path`` this process has mapped."""
    with open("/proc/self/maps") as maps:
        return sum(f"{path}/" in line and line.rstrip().endswith(suffix) for line in maps)


@pytest.fixture
def few_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_files, "max_mapped_per_kind", lambda: LIMIT)


@pytest.mark.parametrize("kind", KINDS)
def test_reads_across_more_shards_than_may_stay_mapped_are_exact(kind, tmp_path, few_maps):
    """Everything at once (each shard let go as later ones are mapped, within one read), then
    random reads that map shards again after they were let go: the same values, and never
    more than the limit of each file kind mapped."""
    write(kind, tmp_path, SHARDS)
    want = expected(kind, SHARDS)
    assert read(kind, tmp_path) == want
    rng = np.random.default_rng(0)
    with storage(kind, tmp_path).sync_reader() as reader:
        for _ in range(40):
            if kind == "document":
                ids = rng.integers(0, len(want), 6)
                got = list(reader.read_many(ids))
                assert got == [want[i] for i in ids.tolist()]
            else:
                start = int(rng.integers(0, len(want) - 60))
                data = reader.read(start, 60)
                got = [int(v) for v in data["tokens"]] if kind == "stream" else list(data)
                assert got == want[start : start + 60]
            for suffix in SUFFIXES[kind]:
                assert _mapped(tmp_path, suffix) <= LIMIT


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "2-threads"])
def test_a_shuffled_epoch_lets_shards_go_and_delivers_the_same_batches(
    workers, tmp_path, monkeypatch
):
    """A shuffled loader over 30 shards, 4 of them mapped at a time (read inline and on
    threads): the same batches as with every shard mapped, and, read inline, at most 4
    mapped after each batch (on threads a read in flight may still hold one let go)."""
    pytest.importorskip("torch")
    from guideloom_pipes import StatefulDataLoader, StreamDataset

    write("stream", tmp_path, SHARDS)

    def epoch(bounded: bool) -> list[list[int]]:
        loader = StatefulDataLoader(
            StreamDataset(storage("stream", tmp_path), 16),
            local_batch_size=8,
            shuffle=True,
            shuffle_seed=3,
            collate_fn=None,
            num_workers=workers,
            prefetch=2 if workers else 0,  # (0: read in this thread when asked, no sooner)
        )
        batches = []
        with loader:
            for batch in loader:
                batches.append(batch["tokens"].tolist())
                # (inline: nothing else holds a mapping between two batches)
                assert not bounded or workers or _mapped(tmp_path, ".in_band.bin") <= LIMIT
        return batches

    everything = epoch(bounded=False)
    assert _mapped(tmp_path, ".in_band.bin") == 0  # (closed: all let go)
    monkeypatch.setattr(shard_files, "max_mapped_per_kind", lambda: LIMIT)
    assert epoch(bounded=True) == everything


def test_the_limit_is_a_share_of_the_kernels():
    assert map_limit() >= 64
    assert max_mapped_per_kind() == max(8, map_limit() // 8)
