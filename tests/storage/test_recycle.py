"""The recycled output buffers of the readers (``storage/recycle.py``): a buffer is lent
again only once nothing refers to it, whatever refers to it."""

from __future__ import annotations

import gc
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage
from guideloom_pipes.storage import recycle
from guideloom_pipes.storage.recycle import BufferPool, Lease

U4 = np.dtype(np.uint32)


@pytest.fixture(autouse=True, params=[True, False], ids=["counted", "leases"])
def _both_ways(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every test runs with buffers lent by counting references (CPython with a GIL) and
    with a lease per buffer (the way elsewhere, and for a reader that keeps a note on it)."""
    if request.param and not recycle._COUNTS:
        pytest.skip("this interpreter's references are not counted under a GIL")
    monkeypatch.setattr(recycle, "_COUNTS", request.param)
    return bool(request.param)


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def test_a_buffer_comes_back_only_when_its_last_view_is_gone() -> None:
    pool = BufferPool()
    first = pool.take((4, 8), U4)
    address = _address(first)
    row, column, flat = first[1], first[:, 2], first.reshape(-1)[3:]
    del first
    held = pool.take((4, 8), U4)  # views of the first are alive: another buffer
    assert _address(held) != address
    del row, column
    assert _address(pool.take((4, 8), U4)) != address  # flat still holds it
    del flat
    again = pool.take((4, 8), U4)
    assert _address(again) == address
    assert again.shape == (4, 8) and again.dtype == U4 and again.flags.c_contiguous


def test_a_tensor_over_the_buffer_keeps_it() -> None:
    torch = pytest.importorskip("torch")
    pool = BufferPool()
    array = pool.take((2, 3), np.dtype(np.int32))
    array[:] = 7
    address = _address(array)
    tensor = torch.from_numpy(array)
    del array
    other = pool.take((2, 3), np.dtype(np.int32))
    other[:] = 1
    assert _address(other) != address and tensor.tolist() == [[7, 7, 7], [7, 7, 7]]
    del tensor
    assert _address(pool.take((2, 3), np.dtype(np.int32))) == address


def test_each_shape_and_dtype_has_its_own_shelf_and_keeps_at_most_its_share() -> None:
    size = 4 * 8 * 4  # a (4, 8) uint32 buffer
    pool = BufferPool(limit=3 * size * 2, shelves=2)  # three of them per shelf
    lent = [pool.take((4, 8), U4) for _ in range(5)]
    addresses = {_address(a) for a in lent}
    del lent
    assert pool.kept_bytes == 3 * size
    reused = [pool.take((4, 8), U4) for _ in range(3)]
    assert {_address(a) for a in reused} <= addresses
    assert pool.take((4, 8), np.dtype(np.int64)).dtype == np.int64  # not a uint32 buffer
    del reused
    assert pool.kept_bytes == 3 * size + 4 * 8 * 8


def test_a_new_shape_past_the_most_shelves_frees_the_oldest_shelf() -> None:
    pool = BufferPool(shelves=2)
    for length in (4, 8):
        del_me = pool.take((length,), U4)
        del del_me
    assert pool.kept_bytes == (4 + 8) * 4
    third = pool.take((16,), U4)  # a third shape: the (4,) shelf goes
    assert pool.kept_bytes == 8 * 4
    del third
    assert pool.kept_bytes == (8 + 16) * 4
    lent = pool.take((4,), U4)  # back again: a new shelf, the (8,) one goes
    del lent
    assert pool.kept_bytes == (16 + 4) * 4


def test_after_clear_buffers_lent_before_are_freed_not_lent_again() -> None:
    pool = BufferPool()
    before = pool.take((4, 4), U4)
    address = _address(before)
    pool.clear()
    del before
    assert pool.kept_bytes == 0  # the closed shelf did not take it back
    fresh = pool.take((4, 4), U4)
    assert fresh.shape == (4, 4)
    del fresh
    assert pool.kept_bytes == 4 * 4 * 4  # the pool's new shelf does
    assert address > 0


def test_a_buffer_dropped_in_another_thread_comes_back() -> None:
    pool = BufferPool()
    lent = [pool.take((8,), U4)]
    address = _address(lent[0])
    worker = threading.Thread(target=lent.clear)
    worker.start()
    worker.join()
    assert _address(pool.take((8,), U4)) == address


def test_a_batch_in_a_reference_cycle_comes_back_after_a_collection() -> None:
    pool = BufferPool()

    class Holder:
        pass

    holder = Holder()
    holder.array = pool.take((3,), U4)  # type: ignore[attr-defined]
    holder.me = holder  # type: ignore[attr-defined]
    address = _address(holder.array)  # type: ignore[attr-defined]
    del holder
    gc.collect()
    assert _address(pool.take((3,), U4)) == address


def test_a_lease_carries_what_a_reader_remembers() -> None:
    pool = BufferPool()
    array = pool.take((2,), U4, leased=True)
    lease = array.base
    assert type(lease) is Lease and lease.note is None
    lease.note = "starts"
    view = array[1:]
    assert view.base is array and array.base is lease


def test_windows_read_again_reuse_the_memory_of_dropped_batches_only(tmp_path: Path) -> None:
    storage = StreamStorage(tmp_path, StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(1000)})
        writer.append(1, {"tokens": np.arange(1000, 2000)})
    with StreamDataset(storage, 10).sync_reader() as reader:
        ids = np.array([3, 150, 99, 100], dtype=np.int64)  # both shards, the boundary
        held = [reader.read_arrays(ids).columns["tokens"] for _ in range(3)]  # type: ignore[index]
        assert len({_address(a) for a in held}) == 3
        assert all(a[:, 0].tolist() == [30, 1500, 990, 1000] for a in held)
        address = _address(held[-1])
        held[-1][:] = -1
        del held[-1]
        again = reader.read_arrays(ids).columns["tokens"]  # type: ignore[index]
        assert _address(again) == address
        assert again[:, 0].tolist() == [30, 1500, 990, 1000]  # rewritten, not the old rows
        assert all(a[:, 0].tolist() == [30, 1500, 990, 1000] for a in held)


def test_a_lent_array_changed_in_place_does_not_change_the_next_one() -> None:
    pool = BufferPool()
    lent = pool.take((4, 8), U4)
    address = _address(lent)
    with warnings.catch_warnings():
        # (numpy 2.5 deprecates setting a shape in place; code written for older numpy does)
        warnings.simplefilter("ignore", DeprecationWarning)
        lent.shape = (8, 4)
    lent.flags.writeable = False
    del lent
    again = pool.take((4, 8), U4)
    assert _address(again) == address
    assert again.shape == (4, 8) and again.flags.writeable
    again[:] = 1


def test_the_plain_lease_lends_views_of_kept_buffers_where_references_count(
    _both_ways: bool,
) -> None:
    pool = BufferPool()
    lent = pool.take((4,), U4)
    if _both_ways:
        assert type(lent.base) is np.ndarray and lent.base.flags.owndata
    else:
        assert type(lent.base) is Lease
    assert type(pool.take((4,), U4, leased=False).base) is type(lent.base)
    assert type(pool.take((4,), U4, leased=True).base) is Lease  # a lease of its own


def test_threads_taking_and_dropping_at_once_never_share_a_buffer() -> None:
    pool = BufferPool(limit=8 * 4 * 64 * 8, shelves=8)  # 8 kept: fewer than are wanted
    errors: list[str] = []
    start = threading.Barrier(4)

    def work(me: int) -> None:
        start.wait()
        held = []
        for step in range(400):
            array = pool.take((64,), U4)
            array[:] = me
            held.append(array)
            if len(held) > 3:
                old = held.pop(0)
                if not (old == me).all():
                    errors.append(f"thread {me} step {step}: its buffer was lent again")
            del array

    threads = [threading.Thread(target=work, args=(me,)) for me in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_a_loop_after_a_burst_reuses_the_same_few_buffers() -> None:
    """After a worker's chunk held many batches at once, a loop holding one batch at a time
    takes turns with two buffers (still in the CPU's caches), not all the burst made."""
    pool = BufferPool()
    burst = [pool.take((8, 16), U4) for _ in range(20)]
    assert len({_address(array) for array in burst}) == 20
    del burst
    held = pool.take((8, 16), U4)
    seen = set()
    for _ in range(40):
        batch = pool.take((8, 16), U4)  # the previous batch is still held meanwhile
        seen.add(_address(batch))
        held = batch
    assert len(seen) == 2, f"the loop used {len(seen)} buffers"
    del held, batch


def test_a_second_burst_reuses_the_first_bursts_buffers() -> None:
    pool = BufferPool()
    first = [pool.take((8, 16), U4) for _ in range(12)]
    addresses = {_address(array) for array in first}
    del first
    again = [pool.take((8, 16), U4) for _ in range(12)]
    assert {_address(array) for array in again} == addresses


def test_a_lease_calls_its_way_back_once_when_its_last_view_is_gone() -> None:
    """The one lease type of the package (pools, the pinned ring, the result ring): the
    lender's ``back`` is called with the lease, once, when nothing refers to it any more."""
    backs: list[tuple[object, np.ndarray]] = []
    buffer = np.arange(4, dtype=U4)
    array = np.asarray(
        Lease(
            buffer,
            buffer.__array_interface__,
            lambda lease: backs.append((lease.place, lease.buffer)),
            7,
        )
    )
    view = array[1:]
    assert view.base is array and type(array.base) is Lease
    assert np.shares_memory(view, buffer)
    del array
    assert backs == []
    del view
    assert len(backs) == 1 and backs[0][0] == 7 and backs[0][1] is buffer
