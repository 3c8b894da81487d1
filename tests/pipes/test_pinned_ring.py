"""The ring of pinned buffers (issue 9): with ``pin_memory=True`` on a CUDA device windows are
read straight into host buffers that a loader reuses, each only once nothing refers to it and
its device copy's event has completed.

No GPU here: the ring's allocation and its completion signal are injected (plain numpy
buffers, events that complete only when the test or ``synchronize()`` says so), the device is
the CPU (the ring's ``ToDevice`` copies there too), so the whole logic runs as on a GPU
without pinning. The pipelines are driven by hand, or checked in ways no schedule changes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch
from loader_helpers import closed_at_the_end

from guideloom_pipes import (
    StatefulDataLoader,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
)
from guideloom_pipes.io import PosixPreadIO
from guideloom_pipes.loader.orders import pinned_ring
from guideloom_pipes.pipes import (
    Collate,
    PinnedRing,
    Prefetcher,
    ReadSamples,
    Shuffle,
    ToDevice,
    default_collate,
)
from guideloom_pipes.pipes.positions import RankPositions
from guideloom_pipes.pipes.workers.threads import ThreadPool

TOKENS = np.dtype([("tokens", "<i4")])
TWO_FIELDS = np.dtype([("tokens", "<i4"), ("mask", "u1")])
#: Shard sizes (elements): odd, so that windows cross shard boundaries.
SHARDS = (1000, 37, 1501, 703)
LENGTH = 16
BATCH = 8
#: (num_workers, parallel_method, prefetch): inline, the prefetch thread, worker threads.
MODES = [(0, "thread", 0), (0, "thread", 2), (2, "thread", 2)]


@pytest.fixture(autouse=True)
def _stages_closed_whatever_happens(monkeypatch: pytest.MonkeyPatch) -> Any:
    with closed_at_the_end(monkeypatch, (ReadSamples, Prefetcher, ThreadPool)):
        yield


def _stream(root: Path, dtype: np.dtype[Any] = TOKENS, backend: Any = None) -> StreamStorage:
    storage = StreamStorage(root, StreamNumpyFormat(dtype), backend)
    start = 0
    with storage.sync_writer() as writer:
        for shard, size in enumerate(SHARDS):
            values = np.arange(start, start + size)
            data = {"tokens": values}
            if dtype.names and "mask" in dtype.names:
                data["mask"] = values % 251
            writer.append(shard, data)
            start += size
    return storage


def describe(value: Any) -> Any:
    """A batch as plain values: tensors and arrays as ``(dtype, list)``, containers walked."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.device.type, value.tolist())
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.tolist())
    if isinstance(value, dict):
        return {key: describe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    return value


class Event:
    """A copy's completion signal that completes only when told (``done``) or waited for."""

    made: list[Event]

    def __init__(self) -> None:
        self.recorded = False
        self.done = False
        self.waited = False

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


class SpyRing(PinnedRing):
    """A ring on plain buffers whose events complete only when waited for (or told), that
    checks every buffer it hands out: the last event recorded for that buffer completed."""

    def __init__(self, nbytes: int, size: int) -> None:
        self.events: list[Event] = []
        self.last_event: dict[int, Event] = {}  # buffer -> event of its last copy
        self.handed: list[int] = []  # buffer of each take(), in order
        self.violations: list[str] = []
        super().__init__(
            nbytes,
            size,
            allocate=lambda n: np.full(n, 0xAB, dtype=np.uint8),
            event=self._new_event,
        )

    def _new_event(self) -> Event:
        event = Event()
        self.events.append(event)
        return event

    def take(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        array = super().take(shape, dtype)
        index = self.slot_of(array.ctypes.data)
        if index is not None:
            self.handed.append(index)
            event = self.last_event.get(index)
            if event is not None and not event.done:
                self.violations.append(f"buffer {index} handed out before its copy completed")
        return array

    def copied(self, addresses: Any) -> int:
        addresses = list(addresses)
        count = super().copied(addresses)
        if count:
            for index in {self.slot_of(a) for a in addresses} - {None}:
                assert index is not None
                self.last_event[index] = self.events[-1]
        return count


def _ring_loader(
    storage: StreamStorage, mode: tuple[int, str, int], ring: bool, **kwargs: Any
) -> StatefulDataLoader[Any, Any]:
    num_workers, method, prefetch = mode
    loader = StatefulDataLoader.from_storage(
        storage,
        sequence_length=LENGTH,
        local_batch_size=BATCH,
        shuffle=True,
        shuffle_seed=11,
        num_workers=num_workers,
        parallel_method=method,
        prefetch=prefetch,
        **kwargs,
    )
    if ring:
        # a CUDA device as far as the ring is concerned, with plain buffers and fake events
        loader._held.ring_device = lambda settings: True  # type: ignore[method-assign]
        loader._held.new_ring = SpyRing  # type: ignore[method-assign, assignment]
    return loader


# -- the ring alone --------------------------------------------------------------------------


def _ring(size: int = 2, nbytes: int = 64) -> tuple[PinnedRing, list[Event], list[np.ndarray]]:
    events: list[Event] = []
    buffers: list[np.ndarray] = []

    def allocate(n: int) -> np.ndarray:
        buffers.append(np.empty(n, dtype=np.uint8))
        return buffers[-1]

    def event() -> Event:
        events.append(Event())
        return events[-1]

    return PinnedRing(nbytes, size, allocate=allocate, event=event), events, buffers


def _copy(ring: PinnedRing, array: np.ndarray) -> None:
    """What ToDevice does for a batch: its copies issued, then the ring told."""
    assert ring.copied([array.ctypes.data]) == 1


def test_a_buffer_comes_back_only_after_its_copy_completed() -> None:
    ring, events, buffers = _ring(size=2)
    first = ring.take((4, 4), np.int32)
    assert first.shape == (4, 4) and first.dtype == np.int32 and first.flags.c_contiguous
    assert np.shares_memory(first, buffers[0])
    _copy(ring, first)
    del first  # released, its copy still running
    second = ring.take((4, 4), np.int32)
    assert np.shares_memory(second, buffers[1])  # a new buffer: the first one's copy runs
    _copy(ring, second)
    del second
    assert not events[0].waited and not events[1].waited
    events[1].done = True  # the second copy completed, the first did not
    third = ring.take((4, 4), np.int32)
    assert np.shares_memory(third, buffers[1]) and not events[0].waited
    _copy(ring, third)
    fourth = ring.take((4, 4), np.int32)  # at its size, nothing complete: wait the oldest
    assert np.shares_memory(fourth, buffers[0]) and events[0].waited
    assert ring.allocated == 2
    assert ring.counts == {"reused": 2, "waited": 1, "grown": 0}


def test_a_buffer_anything_refers_to_is_never_handed_out_again() -> None:
    ring, events, buffers = _ring(size=1)
    batch = ring.take((2, 8), np.int32)
    batch[:] = 7
    kept = torch.from_numpy(np.ascontiguousarray(batch[1:]))  # a view a user kept
    _copy(ring, batch)
    del batch
    events[0].done = True
    again = ring.take((2, 8), np.int32)
    assert not np.shares_memory(again, buffers[0])  # a second buffer, beyond the size
    assert ring.counts["grown"] == 1
    again[:] = 9
    assert bool((kept == 7).all())
    del kept  # now nothing refers to the first buffer
    third = ring.take((2, 8), np.int32)
    assert np.shares_memory(third, buffers[0])


def test_a_buffer_never_copied_comes_back_at_once() -> None:
    """A batch whose read or collate failed never reaches the device: no copy to wait for."""
    ring, events, buffers = _ring(size=1)
    failed = ring.take((2, 2), np.int64)
    del failed
    again = ring.take((2, 2), np.int64)
    assert np.shares_memory(again, buffers[0]) and not events
    assert ring.counts == {"reused": 1, "waited": 0, "grown": 0}


def test_one_event_covers_every_buffer_of_a_batch_and_only_those() -> None:
    ring, events, _ = _ring(size=3)
    a, b, c = (ring.take((2, 2), np.int32) for _ in range(3))
    assert ring.copied([a.ctypes.data, b[1:].ctypes.data, 12345]) == 2
    assert ring.copied([99]) == 0 and len(events) == 1 and events[0].recorded
    del a, b
    events[0].done = True
    reused = [ring.take((2, 2), np.int32) for _ in range(2)]
    assert {ring.slot_of(r.ctypes.data) for r in reused} == {0, 1}
    assert not np.shares_memory(reused[0], c) and not np.shares_memory(reused[1], c)


def test_a_request_larger_than_the_buffers_gets_ordinary_memory() -> None:
    ring, _, buffers = _ring(size=1, nbytes=16)
    big = ring.take((2, 4), np.int32)  # 32 bytes
    assert big.shape == (2, 4) and not buffers and ring.slot_of(big.ctypes.data) is None


def test_bad_ring_arguments_say_what_to_pass() -> None:
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        PinnedRing(64, 0)
    with pytest.raises(TypeError, match="nbytes must be an int, got '64'"):
        PinnedRing("64", 2)  # type: ignore[arg-type]
    ring = PinnedRing(64, 1, allocate=lambda n: np.empty(n // 2, np.uint8))
    with pytest.raises(ValueError, match=r"allocate\(64\) must return .* at least 64 bytes"):
        ring.take((4, 4), np.int32)


# -- reading into given buffers -------------------------------------------------------------


def _filled_buffer(given: list[np.ndarray], shape: tuple[int, int], dtype: Any) -> np.ndarray:
    """A buffer for a read, full of 0xff bytes (so a row left unwritten shows)."""
    buffer = np.empty(shape, dtype=dtype)
    buffer.view(np.uint8).fill(0xFF)
    given.append(buffer)
    return buffer


@pytest.mark.parametrize("backend", [None, PosixPreadIO()], ids=["mmap", "pread"])
def test_windows_read_into_a_buffer_are_the_windows_read_fresh(
    tmp_path: Path, backend: Any
) -> None:
    storage = _stream(tmp_path, TOKENS, backend)
    with StreamDataset(storage, LENGTH).sync_reader() as reader:
        assert reader.reads_into_buffers()
        n = len(reader)
        rng = np.random.default_rng(0)
        # few windows, many windows, one shard only, across shard ends
        for ids in (
            np.array([3, 62, 0]),
            rng.integers(0, n, 40),
            np.arange(5, 40),
            np.array([62, 64, 65] * 7),
        ):
            given: list[np.ndarray] = []
            batch = reader.read_arrays(ids, out=functools.partial(_filled_buffer, given))
            fresh = reader.read_arrays(ids)
            assert describe(batch.columns) == describe(fresh.columns)  # type: ignore[union-attr]
            assert np.shares_memory(batch.columns["tokens"], given[0])  # type: ignore[union-attr]


def test_a_wrong_buffer_says_what_it_must_be(tmp_path: Path) -> None:
    reader = StreamDataset(_stream(tmp_path), LENGTH).sync_reader()
    with (
        reader,
        pytest.raises(ValueError, match=r"shape \(2, 16\) and dtype uint32, got shape \(2, 8\)"),
    ):
        reader.read_arrays(np.array([1, 2]), out=lambda shape, dtype: np.empty((2, 8), dtype))


def test_only_one_field_formats_read_into_buffers(tmp_path: Path) -> None:
    """Two fields are copied apart after the read: their columns are not the buffer."""
    with StreamDataset(_stream(tmp_path, TWO_FIELDS), LENGTH).sync_reader() as reader:
        assert not reader.reads_into_buffers()


def test_process_workers_cannot_fill_buffers(tmp_path: Path) -> None:
    storage = _stream(tmp_path)
    source = RankPositions(10, 2)
    ring = PinnedRing(128, 2, allocate=lambda n: np.empty(n, np.uint8), event=Event)
    with pytest.raises(ValueError, match="not to method='process'"):
        ReadSamples(
            source,
            StreamDataset(storage, LENGTH),
            num_workers=2,
            method="process",
            buffers=ring.take,
        )


# -- a pipeline driven by hand ----------------------------------------------------------------


def test_a_pipeline_by_hand_reuses_two_buffers_and_delivers_the_same_batches(
    tmp_path: Path,
) -> None:
    """Inline reading: one batch read, one being copied; the ring's size is what is in
    flight (2), every buffer reused only after its copy, every batch as without the ring,
    and nothing delivered changes while the ring goes on reusing buffers."""
    storage = _stream(tmp_path)
    dataset = StreamDataset(storage, LENGTH)
    n = sum(SHARDS) // LENGTH

    def pipeline(ring: PinnedRing | None) -> Any:
        node: Any = Shuffle(RankPositions(n, BATCH, drop_last=False), 5)
        node = ReadSamples(
            node, dataset, arrays=True, buffers=ring.take if ring is not None else None
        )
        node = Collate(node, default_collate)
        return ToDevice(node, "cpu", ring=ring) if ring is not None else node

    plain = pipeline(None)
    plain.reset()
    expected = [describe(batch) for batch in plain]

    ring = SpyRing(BATCH * LENGTH * TOKENS.itemsize, 2)
    node = pipeline(ring)
    node.reset()
    delivered = []
    while True:
        try:
            delivered.append(next(node))
        except StopIteration:
            break
        assert ring.allocated <= 2
    assert [describe(batch) for batch in delivered] == expected  # held to the end
    assert ring.violations == [] and ring.allocated == 2
    assert ring.counts["grown"] == 0 and ring.counts["reused"] == len(expected) - 2
    assert len(ring.handed) == len(expected) and len(ring.events) == len(expected)
    assert all(
        not np.shares_memory(b["tokens"].numpy(), s.buffer) for b in delivered for s in ring._slots
    )


# -- the loader ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=["inline", "prefetch-thread", "threads"])
def test_the_loader_delivers_through_the_ring_what_it_delivers_without(
    tmp_path: Path, mode: tuple[int, str, int]
) -> None:
    storage = _stream(tmp_path)
    expected = [describe(batch) for batch in _ring_loader(storage, mode, False, drop_last=False)]
    for _ in range(2):  # an epoch, then another with the buffers the loader keeps
        loader = _ring_loader(storage, mode, True, drop_last=False)
        held = list(loader)  # every batch kept: later reads must not change any
        ring = loader._held.ring
        assert isinstance(ring, SpyRing)
        assert [describe(batch) for batch in held] == expected
        assert ring.violations == []
        assert len(ring.handed) == len(expected)  # every batch was read into the ring
        assert len(ring.events) == len(expected)  # and its copy recorded an event
        assert ring.counts["reused"] > 0
        loader.close()
        assert loader._held.ring is None


def test_the_inline_loader_keeps_a_ring_of_what_is_in_flight(tmp_path: Path) -> None:
    storage = _stream(tmp_path)
    loader = _ring_loader(storage, (0, "thread", 0), True)
    batches = sum(1 for _ in loader)
    ring = loader._held.ring
    assert isinstance(ring, SpyRing)
    assert ring.size == 2 and ring.allocated == 2  # one read, one copy that may run
    assert ring.counts == {"reused": batches - 2, "waited": batches - 2, "grown": 0}
    # the prefetch thread's ring plans for the batches it reads ahead as well
    loader = _ring_loader(storage, (0, "thread", 3), True)
    next(iter(loader))
    assert loader._held.ring is not None and loader._held.ring.size == 1 + 3 + 2
    loader.close()


@pytest.mark.parametrize("mode", MODES, ids=["inline", "prefetch-thread", "threads"])
def test_a_resumed_loader_reads_on_through_the_ring(
    tmp_path: Path, mode: tuple[int, str, int]
) -> None:
    storage = _stream(tmp_path)
    plain = _ring_loader(storage, mode, False)
    it = iter(plain)
    for _ in range(5):
        next(it)
    state = plain.state_dict()
    rest = [describe(batch) for batch in it]
    resumed = _ring_loader(storage, mode, True)
    resumed.load_state_dict(state)
    assert [describe(batch) for batch in resumed] == rest
    assert resumed.state_dict() == plain.state_dict()
    ring = resumed._held.ring
    assert isinstance(ring, SpyRing) and ring.violations == []


def test_where_the_ring_does_not_apply_the_pinning_copy_stays(tmp_path: Path) -> None:
    storage = _stream(tmp_path)

    def user_collate(samples: list[Any]) -> Any:
        return samples

    cases = {
        "a user collate_fn": _ring_loader(storage, (0, "thread", 0), True, collate_fn=user_collate),
        "process workers": _ring_loader(storage, (2, "process", 2), True),
        "two fields": _ring_loader(_stream(tmp_path / "two", TWO_FIELDS), (0, "thread", 0), True),
        "the shard order": _ring_loader(storage, (0, "thread", 0), True, order="shards"),
    }
    for what, loader in cases.items():
        with loader:
            assert pinned_ring(loader) is None, what
    # and without a CUDA device (pin_memory is then dropped, with its warning)
    with pytest.warns(UserWarning, match="pin_memory=True has no effect"):
        loader = _ring_loader(storage, (0, "thread", 0), False, pin_memory=True, device="cpu")
    with loader:
        assert not loader._held.ring_device(loader.settings) and pinned_ring(loader) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES, ids=["inline", "prefetch-thread", "threads"])
def test_on_a_gpu_windows_are_read_into_pinned_buffers(
    tmp_path: Path, mode: tuple[int, str, int]
) -> None:
    """The real thing (where a GPU is lent): pinned buffers, CUDA events, the same batches."""
    storage = _stream(tmp_path)
    expected = [describe(batch) for batch in _ring_loader(storage, mode, False)]
    loader = _ring_loader(storage, mode, False, device="cuda", pin_memory=True)
    held = list(loader)
    torch.cuda.synchronize()
    assert [describe({k: v.cpu() for k, v in batch.items()}) for batch in held] == expected
    assert all(batch["tokens"].device.type == "cuda" for batch in held)
    ring = loader._held.ring
    assert ring is not None and ring.allocated >= 1
    assert all(torch.from_numpy(slot.buffer).is_pinned() for slot in ring._slots)
    loader.close()


def test_closing_the_ring_waits_for_the_copies_out_of_its_buffers() -> None:
    """Its memory may go back to torch's pinned allocator: no copy may still read it."""
    ring, events, buffers = _ring(size=3)
    done, running, held = (ring.take((2, 2), np.int32) for _ in range(3))
    _copy(ring, done)
    _copy(ring, running)
    _copy(ring, held)
    events[0].done = True
    del done, running
    ring.close()
    assert [event.waited for event in events] == [False, True, True]
    assert ring.allocated == 0
    del held  # a buffer lent before close() never comes back to the ring
    fresh = ring.take((2, 2), np.int32)
    assert np.shares_memory(fresh, buffers[3]) and ring.allocated == 1


def test_closing_the_loader_closes_its_ring(tmp_path: Path) -> None:
    loader = _ring_loader(_stream(tmp_path), (0, "thread", 0), True)
    for _ in loader:
        pass
    ring = loader._held.ring
    assert isinstance(ring, SpyRing) and ring.allocated == 2
    loader.close()
    assert loader._held.ring is None and ring.allocated == 0
    assert all(event.done for event in ring.events)
