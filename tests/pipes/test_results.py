"""Process workers' result transport (``guideloom_pipes.pipes.workers.transport``): the
shared-memory ring and the pickling of results through it. The ring and numpy results need no
torch."""

from __future__ import annotations

import os
import pickle
import random
import sys
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from guideloom_pipes.pipes.workers import transport as _transport
from guideloom_pipes.pipes.workers.transport import (
    MIN_RING_BUFFER,
    ResultRing,
    dump_result,
    load_result,
)


def _rings(size: int) -> tuple[ResultRing, ResultRing]:
    """The parent's ring and a second mapping of it, standing in for the worker's."""
    parent = ResultRing.create(size)
    return parent, ResultRing(os.dup(parent.fd), size)


#: Where the first buffer placed in an empty ring lies (after its slot's in-use word).
FRONT = _transport._SLOT


def _held(worker: ResultRing) -> list[int]:
    """The positions of the buffers the worker placed that are not free yet, front first."""
    words = worker._words
    return [slot + FRONT for _, slot, _ in worker._placed if words[slot >> 3]]


@pytest.mark.parametrize("ring_size", [1 << 20, 5 << 20, 64 << 20])
def test_buffers_in_flight_never_overwrite_each_other(ring_size):
    parent, worker = _rings(ring_size)
    rng = random.Random(ring_size)
    in_flight: list[tuple[bytes, list[Any], np.ndarray]] = []
    through_ring = 0
    for step in range(600):
        array = np.full(rng.randint(1, 300_000), step % 251, dtype=np.uint8)
        data, places = dump_result(array, worker)
        through_ring += bool(places)
        in_flight.append((data, places, array))
        while in_flight and len(in_flight) > rng.randint(0, 10):  # the parent lags behind
            data, places, sent = in_flight.pop(0)
            assert np.array_equal(load_result(data, places, parent), sent)
    for data, places, sent in in_flight:
        assert np.array_equal(load_result(data, places, parent), sent)
    assert through_ring > 300
    worker.close()
    parent.close()


def test_the_ring_starts_at_the_front_when_everything_was_taken():
    parent, worker = _rings(8 << 20)
    for _ in range(5):
        data, places = dump_result(np.ones(1 << 20, dtype=np.uint8), worker)
        assert places == [(FRONT, 1 << 20)]
        load_result(data, places, parent)
    worker.close()
    parent.close()


def test_the_ring_stays_near_twice_the_bytes_in_flight():
    parent, worker = _rings(256 << 20)
    highest = 0
    pending: list[tuple[bytes, list[Any]]] = []
    for _ in range(400):
        pending.append(dump_result(np.ones(100_000, dtype=np.uint8), worker))
        highest = max(highest, pending[-1][1][0][0] + 100_000)
        if len(pending) > 4:
            load_result(*pending.pop(0), parent)
    assert highest < 2 * 6 * 100_000 + 64 * 6  # not all of the 256 MiB
    worker.close()
    parent.close()


def test_small_buffers_stay_in_the_pickle_and_big_ones_that_do_not_fit_too():
    parent, worker = _rings(1 << 20)
    small = np.arange(MIN_RING_BUFFER // 8 - 1, dtype=np.int64)
    huge = np.arange(1 << 18, dtype=np.int64)  # 2 MiB: larger than the ring
    data, places = dump_result({"small": small, "huge": huge}, worker)
    assert places == []
    out = load_result(data, places, parent)
    assert np.array_equal(out["small"], small) and np.array_equal(out["huge"], huge)
    worker.close()
    parent.close()


def _in_ring(array: np.ndarray, ring: ResultRing) -> bool:
    start = ring._data.__array_interface__["data"][0]
    address = array.__array_interface__["data"][0]
    return start <= address < start + ring.size


def test_arrays_come_back_writable_and_their_space_is_not_reused_while_they_live():
    parent, worker = _rings(4 << 20)
    sent = np.arange(100_000, dtype=np.float32).reshape(100, 1000)[:, ::2].copy()
    data, places = dump_result([sent, sent.T], worker)  # C and Fortran order
    out = load_result(data, places, parent)
    assert len(places) == 2
    assert all(np.array_equal(a, b) for a, b in zip(out, [sent, sent.T]))
    assert all(_in_ring(a, parent) for a in out)  # handed on where they lie
    out[0] += 1  # writable, and its space stays its own while it lives
    for _ in range(20):
        data, places = dump_result(np.zeros(200_000, dtype=np.uint8), worker)
        load_result(data, places, parent)
    assert np.array_equal(out[0], sent + 1) and np.array_equal(out[1], sent.T)
    worker.close()
    parent.close()


def test_a_results_space_is_free_once_its_last_view_is_gone_in_whatever_order():
    parent, worker = _rings(8 << 20)
    sent = [dump_result(np.full(100_000, n), worker) for n in range(5)]
    positions = [places[0][0] for _, places in sent]
    held = [load_result(data, places, parent) for data, places in sent]
    assert _held(worker) == positions
    tail = held[0][-10:]  # a view keeps its result's space
    del held[0]  # (held[i] is now result i + 1)
    assert _held(worker) == positions
    del held[1]  # result 2
    assert _held(worker) == positions[:2] + positions[3:]
    del tail  # result 0
    assert _held(worker) == [positions[1], *positions[3:]]
    # the next result goes in the first gap from the front that holds it: result 0's
    data, places = dump_result(np.full(100_000, 9), worker)
    assert places[0][0] == positions[0]
    load_result(data, places, parent)  # (dropped at once)
    assert [int(a[0]) for a in held] == [1, 3, 4]
    held.clear()
    assert _held(worker) == []
    assert dump_result(np.ones(100_000), worker)[1][0][0] == FRONT
    worker.close()
    parent.close()


def test_a_result_held_for_good_leaves_a_hole_not_a_wall():
    parent, worker = _rings(4 << 20)
    kept = load_result(*dump_result(np.full(100_000, 7), worker), parent)  # 800 KB, kept
    highest = 0
    for step in range(300):
        data, places = dump_result(np.full(100_000, step), worker)
        assert places, step  # every one through the ring: its space is reused
        highest = max(highest, places[0][0] + 800_000)
        pending = load_result(data, places, parent)
        assert int(pending[0]) == step
        del pending
    assert highest <= 2 * (800_000 + FRONT) + FRONT  # the kept one and one more
    assert (kept == 7).all()
    worker.close()
    parent.close()


def test_results_held_in_any_pattern_are_never_overwritten():
    parent, worker = _rings(4 << 20)
    rng = random.Random(7)
    held: list[tuple[int, np.ndarray]] = []
    placed = 0
    for step in range(800):
        data, places = dump_result(np.full(rng.randint(3000, 40_000), step), worker)
        placed += len(places)  # (one the ring has no room for goes in the pickle)
        held.append((step, load_result(data, places, parent)))
        while held and rng.random() < 0.55:  # dropped in a random order, some held long
            held.pop(rng.randrange(len(held)))
        for kept, array in held:
            assert (array == kept).all(), kept
    del array
    held.clear()
    assert placed > 600 and _held(worker) == []
    worker.close()
    parent.close()


def test_a_result_dropped_in_another_thread_frees_its_space():
    parent, worker = _rings(4 << 20)
    out = [load_result(*dump_result(np.ones(100_000), worker), parent)]
    assert len(_held(worker)) == 1
    thread = threading.Thread(target=out.clear)
    thread.start()
    thread.join()
    assert _held(worker) == []
    worker.close()
    parent.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_dropping_a_result_does_not_free_the_parents_space():
    parent, worker = _rings(4 << 20)
    out = load_result(*dump_result(np.full(100_000, 3), worker), parent)
    position = _held(worker)
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the batch, as a program's end would
        code = 1
        try:
            import gc

            del out
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _held(worker) == position  # still the parent's
    for step in range(10):
        load_result(*dump_result(np.full(100_000, step + 10), worker), parent)
    assert (out == 3).all()
    worker.close()
    parent.close()


def test_results_outlive_their_ring():
    parent, worker = _rings(4 << 20)
    out = load_result(*dump_result(np.arange(100_000), worker), parent)
    worker.close()
    parent.close()
    assert np.array_equal(out, np.arange(100_000))
    out += 1
    del out  # (frees nothing: the ring is closed)


def test_beyond_view_bytes_results_are_copies_whose_space_is_free_at_once(monkeypatch):
    monkeypatch.setattr(_transport, "VIEW_BYTES", 2_000_000)  # two of 800,000 bytes
    parent, worker = _rings(8 << 20)
    views = [load_result(*dump_result(np.full(100_000, n), worker), parent) for n in range(2)]
    copies = [load_result(*dump_result(np.full(100_000, n), worker), parent) for n in (2, 3)]
    assert all(_in_ring(a, parent) for a in views)
    assert not any(_in_ring(a, parent) for a in copies)
    assert len(_held(worker)) == 2  # results 2 and 3 are free, 0 and 1 held
    views.clear()
    assert _held(worker) == []
    assert [int(a[0]) for a in copies] == [2, 3]
    again = load_result(*dump_result(np.full(100_000, 4), worker), parent)
    assert _in_ring(again, parent)  # the views' bytes came back
    worker.close()
    parent.close()


def test_copies_reuse_the_memory_of_results_that_are_gone_and_only_those(monkeypatch) -> None:
    monkeypatch.setattr(_transport, "VIEW_BYTES", 0)  # every result copied out
    parent, worker = _rings(8 << 20)
    first = np.arange(300_000, dtype=np.int32)
    kept = load_result(*dump_result(first, worker), parent)
    assert not _in_ring(kept, parent)
    address = kept.__array_interface__["data"][0]
    view = kept[10:]
    del kept
    # the same size, and one a little larger (padded documents): the first is still held
    second = load_result(*dump_result(first + 1, worker), parent)
    other = second.__array_interface__["data"][0]
    assert other != address
    assert np.array_equal(view, first[10:])
    del view, second
    # 1,200,400 bytes: rounded up to the same 64 KiB multiple as 1,200,000
    third = load_result(*dump_result(np.arange(300_100, dtype=np.int32), worker), parent)
    assert third.__array_interface__["data"][0] in (address, other)
    assert np.array_equal(third, np.arange(300_100, dtype=np.int32))
    worker.close()
    parent.close()


def test_a_result_that_cannot_be_pickled_gives_its_ring_space_back():
    parent, worker = _rings(1 << 20)
    with pytest.raises(TypeError):
        dump_result([np.ones(600_000, dtype=np.uint8), threading.Lock()], worker)
    data, places = dump_result(np.ones(900_000, dtype=np.uint8), worker)
    assert places == [(FRONT, 900_000)]  # the failed result's buffer was forgotten
    load_result(data, places, parent)
    worker.close()
    parent.close()


class _Marker:
    """Something a result holds whose lifetime a test can watch (a weak reference)."""


def test_a_worker_pickles_its_results_with_one_pickler_that_keeps_none_of_them():
    import gc
    import weakref

    parent, worker = _rings(4 << 20)
    markers = []
    for step in range(3):
        marker = _Marker()
        markers.append(weakref.ref(marker))
        data, places = dump_result({"marker": marker, "data": np.full(100_000, step)}, worker)
        out = load_result(data, places, parent)
        assert isinstance(out["marker"], _Marker) and out["data"][0] == step
        if step == 0:
            pickler = worker._dumper._pickler  # type: ignore[union-attr]
        assert worker._dumper._pickler is pickler  # type: ignore[union-attr]
        del marker, out
    gc.collect()
    assert [ref() for ref in markers] == [None, None, None]  # the memo was cleared each time
    worker.close()
    parent.close()


def test_a_ring_travels_to_a_child_process_as_its_descriptor():
    import multiprocessing

    parent = ResultRing.create(1 << 20)
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_fill_ring, args=(parent.handle(), writer))
    child.start()
    writer.close()
    data, places = pickle.loads(reader.recv_bytes())
    child.join(60)
    assert child.exitcode == 0
    assert np.array_equal(load_result(data, places, parent), np.arange(50_000))
    reader.close()
    parent.close()


def _fill_ring(handle: Any, conn: Any) -> None:
    ring = ResultRing.attach(handle)
    conn.send_bytes(pickle.dumps(dump_result(np.arange(50_000), ring)))
    ring.close()


def test_pickling_results_imports_no_torch():
    code = (
        "import sys, numpy as np; from guideloom_pipes.pipes.workers.transport import dump_result; "
        "dump_result(np.ones(100_000), None); assert 'torch' not in sys.modules"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- tensors ----------------------------------------------------------------------------------


def test_tensors_travel_as_arrays_and_come_back_as_the_same_tensors():
    torch = pytest.importorskip("torch")
    parent, worker = _rings(16 << 20)
    base = torch.arange(300_000, dtype=torch.float32)
    sent = {
        "float": base.reshape(300, 1000),
        "bf16": base.to(torch.bfloat16),
        "view": base[1000:200_000],
        "transposed": base.reshape(300, 1000).t(),
        "grad": base[:50_000].clone().requires_grad_(True),
        "conj": (base[:10_000].to(torch.complex64) * 1j).conj(),
        "neg": (base[:10_000].to(torch.complex64) * 1j).conj().imag,
        "bool": base[:100_000] > 5,
        "zero_dim": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "small": torch.tensor([1, 2, 3]),
    }
    data, places = dump_result(sent, worker)
    assert len(places) >= 5
    out = load_result(data, places, parent)
    for key, tensor in sent.items():
        got = out[key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert got.requires_grad == tensor.requires_grad, key
        assert torch.equal(got.detach().resolve_conj().resolve_neg(), tensor.detach()), key
        assert not got.is_shared(), key
    worker.close()
    parent.close()


def test_tensors_go_through_the_ring_when_torch_comes_after_the_workers_first_result(
    monkeypatch,
):
    # a worker starts without torch; its first batch may import it (a collate that makes
    # tensors): the pickler made before must not send tensors the slow way from then on
    torch = pytest.importorskip("torch")
    parent, worker = _rings(4 << 20)
    with monkeypatch.context() as patch:
        patch.delitem(sys.modules, "torch")
        load_result(*dump_result(np.ones(100_000), worker), parent)
    sent = torch.arange(100_000, dtype=torch.int64)
    data, places = dump_result(sent, worker)
    assert [size for _, size in places] == [800_000]  # in the ring, not the pickle
    out = load_result(data, places, parent)
    assert torch.equal(out, sent) and not out.is_shared()
    worker.close()
    parent.close()


def test_tensors_too_big_for_the_ring_use_torchs_shared_memory():
    torch = pytest.importorskip("torch")
    parent, worker = _rings(1 << 20)
    sent = torch.arange(1 << 18, dtype=torch.int64)  # 2 MiB
    data, places = dump_result(sent, worker)
    assert places == []
    out = load_result(data, places, parent)
    assert torch.equal(out, sent) and out.is_shared()
    conj = (torch.arange(1 << 18).to(torch.complex64) * 1j).conj()  # a lazy conjugate
    out = load_result(*dump_result(conj, worker), parent)
    assert torch.equal(out, conj.resolve_conj()) and out[1].imag == -1
    worker.close()
    parent.close()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_tensors_that_are_not_plain_cpu_tensors_keep_torchs_pickling():
    torch = pytest.importorskip("torch")
    parent, worker = _rings(4 << 20)
    sent = [torch.nn.Parameter(torch.ones(5000)), torch.ones(3, 3).to_sparse()]
    out = load_result(*dump_result(sent, worker), parent)
    assert isinstance(out[0], torch.nn.Parameter) and torch.equal(out[0], sent[0])
    assert out[1].is_sparse and torch.equal(out[1].to_dense(), torch.ones(3, 3))
    worker.close()
    parent.close()


# -- the fork server's preloads ---------------------------------------------------------------


def test_the_fork_server_preloads_the_modules_of_the_dataset_and_collate_fn(monkeypatch):
    pytest.importorskip("torch")
    import multiprocessing

    import loader_helpers

    from guideloom_pipes.pipes.workers import processes as _pool

    server = SimpleNamespace(_forkserver_pid=None, _preload_modules=["__main__", "mine"])
    monkeypatch.setattr(multiprocessing.forkserver, "_forkserver", server)
    set_to: list[list[str]] = []
    context = SimpleNamespace(
        get_start_method=lambda: "forkserver", set_forkserver_preload=set_to.append
    )
    _pool._preload_forkserver(context, loader_helpers.Ids(3), loader_helpers.ids_collate)
    assert set_to == [
        ["__main__", "mine", "guideloom_pipes.pipes.workers.process_main", "loader_helpers"]
    ]
    server._forkserver_pid = 12345  # running: its preloads can no longer change
    _pool._preload_forkserver(context, loader_helpers.Ids(3), loader_helpers.ids_collate)
    assert len(set_to) == 1


def test_without_memfd_the_ring_is_an_unlinked_file(monkeypatch):
    monkeypatch.delattr(os, "memfd_create")
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    parent, worker = _rings(1 << 20)
    if os.path.isdir("/dev/shm"):
        assert not any(
            n.startswith("guideloom-results") for n in set(os.listdir("/dev/shm")) - before
        )
    data, places = dump_result(np.arange(100_000), worker)
    assert places and np.array_equal(load_result(data, places, parent), np.arange(100_000))
    worker.close()
    parent.close()
