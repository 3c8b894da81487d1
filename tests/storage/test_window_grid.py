"""WindowGrid's gather of short windows, and its plans of whole blocks of shuffled ids."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
    return WindowGrid(starts, LENGTH, lambda shard: shards[shard], np.dtype(np.uint32)), stream


def _block(numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``numbers`` as a shuffle stage hands a block out: a read-only int64 view of a uint64
    array (returned too: its owner, which stays writable)."""
    owner = numbers.astype(np.uint64)
    block = owner.view(np.int64)
    block.flags.writeable = False
    return block, owner


def _gathered(grid: WindowGrid, stream: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    def across(row: np.ndarray, start: int, shard: int, length: int) -> None:
        row[...] = stream[start : start + length]

    out = grid.gather(numbers, lambda shape: np.empty(shape, dtype=np.uint32), across)
    assert out is not None
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
@pytest.mark.parametrize("per", [1, 16], ids=["a-batch-a-unit", "units-of-16-batches"])
def test_batches_sliced_from_one_block_are_gathered_by_its_plan(
    sizes, phase, listed, ranks, per, monkeypatch
):
    """A loader's batches are consecutive read-only slices of one block of shuffled ids:
    the block is planned once (its units of batches sorted by shard), and each batch, looked
    up in the plan, is exactly its windows, in its order (windows crossing into later
    shards, and shards shorter than a window, included); with the shard bounds kept as
    Python lists and, as past ``LISTED_SHARDS`` shards, as arrays; with few shards (keyed
    by compares) and more (by binary search); a batch a unit, and 16."""
    if per == 1:  # (as batches larger than a unit's bytes)
        monkeypatch.setattr(window_grid, "_UNIT_BYTES", 0)
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
    assert plan.per == per
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
    make = lambda shape: np.empty(shape, dtype=np.uint32)  # noqa: E731
    assert grid.gather(np.array([0, grid.windows]), make, lambda *args: None) is None


def _counted(stream: np.ndarray) -> tuple[list[tuple[int, ...]], Any, Any]:
    """A ``make`` that notes the shapes it made, and an ``across`` reading ``stream``."""
    shapes: list[tuple[int, ...]] = []

    def make(shape: tuple[int, ...]) -> np.ndarray:
        shapes.append(shape)
        return np.empty(shape, dtype=np.uint32)

    def across(row: np.ndarray, start: int, shard: int, length: int) -> None:
        row[...] = stream[start : start + length]

    return shapes, make, across


def test_a_unit_is_gathered_once_and_each_of_its_batches_handed_out_once():
    """The first batch of a unit asked for gathers the unit's 16 batches into one array;
    the others are its rows, made by nothing more. A batch asked for again is read again
    into memory of its own: nothing handed out is handed out twice."""
    grid, stream = _grid((700, 1300, 999, 2000))
    block, _ = _block(np.random.default_rng(2).permutation(grid.windows))
    count = 16
    shapes, make, across = _counted(stream)
    batches = [block[row * count : (row + 1) * count] for row in range(16)]
    got = [grid.gather(batch, make, across) for batch in batches]
    assert shapes[0] == (16, count, LENGTH)
    assert len(shapes) == 2  # (the unit's array and its scratch, for all 16 batches)
    for batch, out in zip(batches, got):
        assert out is not None
        assert out.tolist() == _windows(stream, batch)
        assert out.base is got[0].base  # (rows of the unit's array)
    again = grid.gather(batches[3], make, across)
    assert again is not None
    assert again.tolist() == _windows(stream, batches[3])
    assert not np.shares_memory(again, got[3])


def test_batches_asked_for_by_threads_at_once_are_each_their_own_windows():
    """Worker threads taking a block's batches in turn, as a loader's do, each get their
    batch's windows, and no two batches share memory."""
    grid, stream = _grid((333,) * 12)
    block, _ = _block(np.random.default_rng(3).permutation(grid.windows))
    count = 16
    _, make, across = _counted(stream)
    batches = [block[row * count : (row + 1) * count] for row in range(len(block) // count)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda batch: grid.gather(batch, make, across), batches))
    for batch, out in zip(batches, got):
        assert out is not None
        assert out.tolist() == _windows(stream, batch)
    for index, out in enumerate(got):
        assert not any(np.may_share_memory(out, other) for other in got[index + 1 :])


def test_a_shard_failing_its_first_touch_fails_only_the_batches_that_touch_it():
    """A unit touches the shards of all its batches; where one fails its first touch (a
    shard found truncated, say), only the batches reading from it raise, each in its own
    read, and the unit's other batches are their windows."""
    sizes = (700, 1300, 999, 2000)
    stream = np.arange(sum(sizes), dtype=np.uint32)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def mapped(shard: int) -> np.ndarray:
        if shard == 2:
            raise OSError("shard 0000002 is shorter than its record")
        return stream[starts[shard] : starts[shard + 1]]

    grid = WindowGrid(starts, LENGTH, mapped, np.dtype(np.uint32))
    block, _ = _block(np.random.default_rng(4).permutation(grid.windows))
    _, make, across = _counted(stream)
    count, failed, read = 4, 0, 0
    for row in range(len(block) // count):
        batch = block[row * count : (row + 1) * count]
        touches = any(starts[2] <= n * LENGTH < starts[3] for n in batch.tolist())
        if touches:
            with pytest.raises(OSError, match="0000002"):
                grid.gather(batch, make, across)
            failed += 1
            continue
        out = grid.gather(batch, make, across)
        assert out is not None
        assert out.tolist() == _windows(stream, batch)
        read += 1
    assert failed and read


def test_a_grid_keeps_the_batches_of_a_few_units_only():
    """Batches of units left behind (a loader that skipped them) are not kept past the last
    few units: their memory goes, and a batch of one asked for later is read anew."""
    grid, stream = _grid((30000,) * 4)
    block, _ = _block(np.random.default_rng(5).permutation(grid.windows))
    count = 16
    _, make, across = _counted(stream)
    units = window_grid._UNITS_KEPT + 2
    for unit in range(units):  # (the first batch of each unit only)
        grid.gather(block[unit * 16 * count : (unit * 16 + 1) * count], make, across)
    assert len(grid._units) == window_grid._UNITS_KEPT
    late = block[count : 2 * count]  # (unit 0's second batch)
    out = grid.gather(late, make, across)
    assert out is not None
    assert out.tolist() == _windows(stream, late)
