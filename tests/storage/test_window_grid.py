"""WindowGrid's gather of short windows, and its plans of whole blocks of shuffled ids."""

from __future__ import annotations

import numpy as np
import pytest

from guideloom_pipes.storage import window_grid
from guideloom_pipes.storage.window_grid import BlockPlan, WindowGrid

LENGTH = 16


def _grid(sizes: tuple[int, ...]) -> tuple[WindowGrid, np.ndarray]:
    """A grid over shards of ``sizes`` elements of the stream ``0, 1, 2, ...`` (uint32)."""
    stream = np.arange(sum(sizes), dtype=np.uint32)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    shards = [stream[starts[k] : starts[k + 1]] for k in range(len(sizes))]
    return WindowGrid(starts, LENGTH, lambda shard: shards[shard]), stream


def _block(numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``numbers`` as a shuffle stage hands a block out: a read-only int64 view of a uint64
    array (returned too: its owner, which stays writable)."""
    owner = numbers.astype(np.uint64)
    block = owner.view(np.int64)
    block.flags.writeable = False
    return block, owner


def _gathered(grid: WindowGrid, stream: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    out = np.empty((len(numbers), LENGTH), dtype=np.uint32)

    def across(row: np.ndarray, start: int, shard: int, length: int) -> None:
        row[...] = stream[start : start + length]

    assert grid.gather(numbers, out, across)
    return out


def _windows(stream: np.ndarray, numbers: np.ndarray) -> list[list[int]]:
    return [stream[n * LENGTH : (n + 1) * LENGTH].tolist() for n in numbers.tolist()]


@pytest.mark.parametrize(
    "sizes",
    [(3000,), (700, 1300, 999, 2000), (5, 3, 400, 9, 250, 1000), (333,) * 12],
    ids=["one-shard", "windows-crossing-shards", "shards-shorter-than-a-window", "12-shards"],
)
@pytest.mark.parametrize("phase", [0, 5], ids=["from-the-start", "resumed-mid-block"])
@pytest.mark.parametrize("listed", [True, False], ids=["bounds-listed", "bounds-as-arrays"])
@pytest.mark.parametrize("ranks", ["16-bit", "64-bit"])
def test_batches_sliced_from_one_block_are_gathered_by_its_plan(
    sizes, phase, listed, ranks, monkeypatch
):
    """A loader's batches are consecutive read-only slices of one block of shuffled ids:
    the block is planned once (each batch sorted by shard), and each batch, looked up in
    the plan, is exactly its windows, in its order (windows crossing into later shards, and
    shards shorter than a window, included); with the shard bounds kept as Python lists
    and, as past ``LISTED_SHARDS`` shards, as arrays; with few shards (keyed by compares)
    and more (by binary search)."""
    if not listed:
        monkeypatch.setattr(window_grid, "LISTED_SHARDS", 0)
    if ranks == "64-bit":  # (as a block of more (row, shard) pairs than 16 bits hold)
        monkeypatch.setattr(window_grid, "_NARROW_RANKS", 0)
    grid, stream = _grid(sizes)
    assert isinstance(grid._firsts, list) is listed
    count = 16
    numbers = np.random.default_rng(len(sizes)).permutation(grid.windows)
    block, _ = _block(numbers)
    first = block[phase : phase + count]
    plan = BlockPlan.of(first, grid)
    assert plan is not None
    rows = (len(block) - phase) // count
    for row in range(rows):
        batch = block[phase + row * count : phase + (row + 1) * count]
        assert plan.row_of(batch) == row
        assert _gathered(grid, stream, batch).tolist() == _windows(stream, batch)
    tail = block[phase + rows * count :]  # (shorter than a batch: the general gather)
    if len(tail):
        assert plan.row_of(tail) == -1
        assert _gathered(grid, stream, tail).tolist() == _windows(stream, tail)


def test_a_batch_changed_after_its_block_was_planned_is_gathered_as_it_is_now():
    """The plan is never trusted over the ids: a batch whose ids differ from its planned row
    (its block's owner written since) is not found in the plan, and gathered as it is."""
    grid, stream = _grid((700, 1300, 999, 2000))
    block, owner = _block(np.random.default_rng(0).permutation(grid.windows))
    count = 16
    assert _gathered(grid, stream, block[:count]).tolist() == _windows(stream, block[:count])
    plan = BlockPlan.of(block[:count], grid)
    assert plan is not None
    owner[count + 3] = owner[count + 3] + 1 if owner[count + 3] + 1 < grid.windows else 0
    second = block[count : 2 * count]
    assert plan.row_of(second) == -1
    assert _gathered(grid, stream, second).tolist() == _windows(stream, second)


def test_ids_that_are_not_a_read_only_block_of_windows_get_no_plan():
    """Only a read-only slice of a block of at least two batches, all of them windows of the
    stream, is planned; anything else takes the general gather (which names bad ids)."""
    grid, _ = _grid((700, 1300))
    numbers = np.random.default_rng(1).permutation(grid.windows)
    writable = numbers.copy()
    assert BlockPlan.of(writable[:16], grid) is None
    block, _ = _block(numbers)
    assert BlockPlan.of(block[:16], grid) is not None
    assert BlockPlan.of(block[: len(block) // 2 + 1], grid) is None  # (under two batches)
    outside, _ = _block(np.append(numbers, grid.windows))
    assert BlockPlan.of(outside[:16], grid) is None
    out = np.empty((2, LENGTH), dtype=np.uint32)
    assert not grid.gather(np.array([0, grid.windows]), out, lambda *args: None)
