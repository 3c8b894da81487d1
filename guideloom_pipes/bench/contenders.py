"""The contenders: the baselines, torch's ``DataLoader``, our loader, and a slow backend.

The hand loop and memmap-backed torch ``Dataset`` s are the baselines; ``SlowIO`` is the
read backend of the slow-storage scenario. The row names the targets refer to live here.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

from guideloom_pipes.bench.data import META_RECORD, SEED
from guideloom_pipes.bench.harness import Contender
from guideloom_pipes.io import MmapIO, PosixPreadIO
from guideloom_pipes.storage import DocumentStorage, StreamStorage, StreamWithMetaStorage

CPU = torch.device("cpu")

#: Row names the targets refer to.
OURS_0 = "ours workers=0 prefetch=4"
OURS_2 = "ours workers=2 threads prefetch=4"
OURS_2P = "ours workers=2 processes prefetch=4"
#: Our loader with ``collate_fn=None`` (batches as arrays to ``default_collate``), issue 9.
OURS_0_ARRAYS = "ours workers=0 prefetch=4, collate_fn=None"
OURS_2_ARRAYS = "ours workers=2 threads prefetch=4, collate_fn=None"
OURS_INLINE_ARRAYS = "ours workers=0 prefetch=0 (inline), collate_fn=None"
OURS_2P_PAD = "ours workers=2 processes prefetch=4, pad_collate"
OURS_2_PAD = "ours workers=2 threads prefetch=4, pad_collate"
OURS_0_PAD = "ours workers=0 prefetch=4, pad_collate"
COPY_LIMIT = "copy limit"
#: The documents scenario's parallel ceiling (see ``ParallelCeiling``).
CEILING_2P = "ceiling: 2 processes each running torch's workers=0 loop, nothing sent back"
SLOW_PREAD = "ours workers=32 threads prefetch=32, sleep then pread"
#: The kinds of rows of the mixture and packed scenarios (see ``dataset_row``).
SINGLE = "single stream"
BLEND = "blend of 3 streams"
#: The mixture scenario's blends read in order (issue 30): fixed weights, and a schedule.
FIXED_IN_ORDER = "fixed-weight blend in order"
SCHEDULED = "scheduled blend in order"
PLAIN = "plain windows"
PACKED = "packed windows"


def dataset_row(kind: str, workers: int) -> str:
    """The row name of our loader over a dataset of ``kind`` with ``workers`` threads."""
    return f"{kind}, ours workers={workers} prefetch=4"


# Baselines ------------------------------------------------------------------------------------


def _shard_paths(storage: Any, suffix: str) -> list[Path]:
    directory = Path(storage.dir)
    paths = sorted(directory.glob(f"*{suffix}"))
    return [p for p in paths if p.name[:7].isdigit() and p.name.endswith(suffix)]


class _ShardMaps:
    """Per-shard ``np.memmap`` s of a stream, opened lazily (each process maps its own)."""

    def __init__(self, paths: Sequence[Path], dtype: np.dtype[Any]) -> None:
        self.paths = [str(p) for p in paths]
        self.dtype = dtype
        self.lengths = [os.path.getsize(p) // dtype.itemsize for p in self.paths]
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.total = int(self.starts[-1])
        self._maps: list[np.ndarray] | None = None

    def maps(self) -> list[np.ndarray]:
        if self._maps is None:
            # np.memmap per shard; slices are taken from plain ndarray views of the maps
            # (memmap's own __getitem__ adds per-slice overhead the limit should not pay).
            self._maps = [
                np.memmap(p, dtype=self.dtype, mode="r").view(np.ndarray) for p in self.paths
            ]
        return self._maps

    def pieces(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """``(shard, local_start, count)`` pieces of the span ``[start, start + length)``."""
        out = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while length > 0:
            local = start - int(self.starts[shard])
            take = min(length, self.lengths[shard] - local)
            out.append((shard, local, take))
            start += take
            length -= take
            shard += 1
        return out

    def window(self, start: int, length: int) -> np.ndarray:
        maps = self.maps()
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        local = start - int(self.starts[shard])
        if local + length <= self.lengths[shard]:
            return maps[shard][local : local + length]
        return np.concatenate([maps[s][a : a + n] for s, a, n in self.pieces(start, length)])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}


class HandLoop:
    """The limit: a precomputed permutation, windows copied out of memmaps, stack, tensor."""

    def __init__(self, storage: StreamStorage, length: int, batch: int, seed: int) -> None:
        self.maps = _ShardMaps(_shard_paths(storage, ".in_band.bin"), np.dtype("<i4"))
        self.length = length
        self.batch = batch
        self.samples = self.maps.total // length
        self.permutation = np.random.default_rng(seed).permutation(self.samples)

    def __iter__(self) -> Iterator[torch.Tensor]:
        length, batch, window = self.length, self.batch, self.maps.window
        permutation = self.permutation
        for step in range(self.samples // batch):
            ids = permutation[step * batch : (step + 1) * batch]
            windows = [window(int(i) * length, length) for i in ids]
            yield torch.from_numpy(np.stack(windows))


class CopyLimit:
    """The copy limit: the hand loop's windows copied into one preallocated ``(B, L)``
    buffer (a slice assignment per window, a shard boundary in two pieces), then
    ``torch.from_numpy``; nothing else. Where each window lies is computed before the
    loop, for the whole epoch. Every batch it yields is the same buffer, refilled: what a
    loader could reach if nothing but the copy cost anything."""

    def __init__(self, storage: StreamStorage, length: int, batch: int, seed: int) -> None:
        self.maps = _ShardMaps(_shard_paths(storage, ".in_band.bin"), np.dtype("<i4"))
        self.length = length
        self.batch = batch
        self.samples = self.maps.total // length
        permutation = np.random.default_rng(seed).permutation(self.samples)
        starts = permutation * length
        shard = np.searchsorted(self.maps.starts, starts, side="right") - 1
        local = starts - self.maps.starts[shard]
        self.places = list(zip(shard.tolist(), local.tolist(), permutation.tolist()))

    def __iter__(self) -> Iterator[torch.Tensor]:
        length, batch, maps = self.length, self.batch, self.maps.maps()
        lengths, places = self.maps.lengths, self.places
        buffer = np.empty((batch, length), dtype=np.int32)
        tensor = torch.from_numpy(buffer)
        for step in range(self.samples // batch):
            for row, (shard, local, index) in enumerate(places[step * batch : (step + 1) * batch]):
                if local + length <= lengths[shard]:
                    buffer[row] = maps[shard][local : local + length]
                else:
                    buffer[row] = self.maps.window(index * length, length)
            yield tensor


class MemmapWindows(torch.utils.data.Dataset):
    """A map-style torch ``Dataset`` of ``L``-token windows over per-shard memmaps."""

    def __init__(self, storage: StreamStorage, length: int) -> None:
        self.maps = _ShardMaps(_shard_paths(storage, ".in_band.bin"), np.dtype("<i4"))
        self.length = length

    def __len__(self) -> int:
        return self.maps.total // self.length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        window = self.maps.window(int(index) * self.length, self.length)
        return {"tokens": np.array(window)}


class MemmapMetaWindows(torch.utils.data.Dataset):
    """``MemmapWindows`` for a stream with metadata: tokens, payload index, payload bytes."""

    def __init__(self, storage: StreamWithMetaStorage, length: int) -> None:
        self.records = _ShardMaps(_shard_paths(storage, ".in_band.bin"), META_RECORD)
        self.index_paths = [str(p) for p in _shard_paths(storage, ".out_of_band.index")]
        self.data_paths = [str(p) for p in _shard_paths(storage, ".out_of_band.bin")]
        self.length = length
        self._payload_maps: tuple[list[np.ndarray], list[np.ndarray]] | None = None

    def __len__(self) -> int:
        return self.records.total // self.length

    def _payloads(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if self._payload_maps is None:
            self._payload_maps = (
                [np.memmap(p, dtype="<i8", mode="r").view(np.ndarray) for p in self.index_paths],
                [np.memmap(p, dtype="u1", mode="r").view(np.ndarray) for p in self.data_paths],
            )
        return self._payload_maps

    def __getitem__(self, index: int) -> dict[str, Any]:
        maps = self.records.maps()
        offsets, data = self._payloads()
        tokens: list[np.ndarray] = []
        payload_index: list[np.ndarray] = []
        payloads: list[bytes] = []
        for shard, local, count in self.records.pieces(int(index) * self.length, self.length):
            records = maps[shard][local : local + count]
            tokens.append(records["tokens"])
            keys = records["index"]
            change = np.flatnonzero(keys[1:] != keys[:-1]) + 1
            firsts = np.concatenate([[0], change])
            run = np.zeros(count, dtype=np.int32)
            run[change] = 1
            payload_index.append(np.cumsum(run, dtype=np.int32) + len(payloads))
            for key in keys[firsts].tolist():
                payloads.append(
                    data[shard][offsets[shard][key] : offsets[shard][key + 1]].tobytes()
                )
        return {
            "tokens": np.concatenate(tokens),
            "payload_index": np.concatenate(payload_index),
            "payloads": payloads,
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_payload_maps": None}


class MemmapDocuments(torch.utils.data.Dataset):
    """A map-style torch ``Dataset`` of pickled documents over per-shard memmaps."""

    def __init__(self, storage: DocumentStorage) -> None:
        self.index_paths = [str(p) for p in _shard_paths(storage, ".out_of_band.index")]
        self.data_paths = [str(p) for p in _shard_paths(storage, ".out_of_band.bin")]
        counts = [os.path.getsize(p) // 8 - 1 for p in self.index_paths]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._maps: tuple[list[np.ndarray], list[np.ndarray]] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> Any:
        if self._maps is None:
            self._maps = (
                [np.memmap(p, dtype="<i8", mode="r").view(np.ndarray) for p in self.index_paths],
                [np.memmap(p, dtype="u1", mode="r").view(np.ndarray) for p in self.data_paths],
            )
        offsets, data = self._maps
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        local = int(index) - int(self.starts[shard])
        start, end = int(offsets[shard][local]), int(offsets[shard][local + 1])
        return pickle.loads(data[shard][start:end].data)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}


#: Seconds a ``ParallelCeiling`` batch may take before its processes count as failed.
_CEILING_WAIT = 120.0


def _ceiling_worker(
    dataset: torch.utils.data.Dataset,
    collate: Callable[[Any], Any],
    count: Callable[[Any], tuple[int, int]],
    batch: int,
    seed: int,
    permits: Any,
    done: Any,
) -> None:
    """A ``ParallelCeiling`` process: one batch of random samples per permit; sends back
    only its ``count``."""
    generator = np.random.default_rng(seed)
    size = len(dataset)  # type: ignore[arg-type]
    while permits.get():
        samples = [dataset[int(index)] for index in generator.integers(0, size, batch)]
        done.put(count(collate(samples)))


class ParallelCeiling:
    """What ``workers`` cores give the baseline's own loop at this minute: that many
    processes, each reading and collating whole batches of random samples as torch's
    ``workers=0`` loop does, and sending back only each batch's ``(samples, tokens)``.
    No loader can hand batches over for less, so a parallel loader's rate against this
    row is its share of what the machine gives (on a machine of 2 vCPUs shared with
    others, that varies from minute to minute; it is measured in the same rounds).

    Each batch asked for releases one permit; ``ahead`` more are given at the start, so
    every process has one batch to work on while the last one is handed over."""

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        collate: Callable[[Any], Any],
        count: Callable[[Any], tuple[int, int]],
        batch: int,
        workers: int = 2,
    ) -> None:
        self.args = (dataset, collate, count, batch)
        self.workers = workers
        self.ahead = 2 * workers
        self._processes: list[Any] = []
        self._permits: Any = None
        self._done: Any = None

    def start(self) -> None:
        import multiprocessing

        # (not fork: the benchmark's loaders have threads by then)
        methods = multiprocessing.get_all_start_methods()
        context: Any = multiprocessing.get_context(
            "forkserver" if "forkserver" in methods else "spawn"
        )
        self._permits, self._done = context.SimpleQueue(), context.Queue()
        self._processes = [
            context.Process(
                target=_ceiling_worker,
                args=(*self.args, SEED + worker, self._permits, self._done),
                daemon=True,
            )
            for worker in range(self.workers)
        ]
        for process in self._processes:
            process.start()
        for _ in range(self.ahead):
            self._permits.put(True)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        permits, done = self._permits, self._done
        if permits is None:
            raise RuntimeError("ParallelCeiling.start() was not called")
        while True:
            permits.put(True)
            try:
                yield done.get(timeout=_CEILING_WAIT)
            except queue.Empty:
                dead = [p.exitcode for p in self._processes if not p.is_alive()]
                raise RuntimeError(
                    f"the parallel ceiling's processes sent no batch in {_CEILING_WAIT} s "
                    f"(exit codes of those that ended: {dead})"
                ) from None

    def stop(self) -> None:
        processes, self._processes = self._processes, []
        if not processes:
            return
        for _ in processes:
            self._permits.put(False)
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        self._permits.close()
        self._done.close()
        self._done.join_thread()

    def contender(self) -> Contender:
        """Its row (``CEILING_2P``): the batches are the ``(samples, tokens)`` counts."""
        return Contender(
            CEILING_2P,
            lambda: iter(self),
            lambda counted: counted,
            setup=self.start,
            teardown=self.stop,
            ahead=self.ahead,
        )


def _torch_contender(
    name: str,
    dataset: torch.utils.data.Dataset,
    collate: Callable[[Any], Any],
    batch: int,
    workers: int,
    count: Callable[[Any], tuple[int, int]],
) -> Contender:
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate,
        drop_last=True,
        generator=torch.Generator().manual_seed(SEED),
    )
    # torch keeps prefetch_factor (2) batches per worker in flight
    return Contender(name, lambda: iter(loader), count, ahead=2 * workers)


def _ours_contender(
    name: str,
    storage: Any,
    collate: Callable[[Any], Any] | None,
    count: Callable[[Any], tuple[int, int]],
    **options: Any,
) -> Contender:
    from guideloom_pipes.loader import StatefulDataLoader
    from guideloom_pipes.loader.orders import batches_ahead

    options.setdefault("shuffle", True)
    options.setdefault("shuffle_seed", SEED)
    options.setdefault("device", CPU)
    loader = StatefulDataLoader.from_storage(storage, collate, **options)
    return Contender(
        name,
        lambda: iter(loader),
        count,
        setup=loader.open,
        teardown=loader.close,
        ahead=batches_ahead(loader),
    )


def _ours_dataset_contender(
    name: str,
    dataset: Any,
    collate: Callable[[Any], Any],
    count: Callable[[Any], tuple[int, int]],
    **options: Any,
) -> Contender:
    """Our loader over a dataset (rather than a storage), shuffled with the bench's seed."""
    from guideloom_pipes.loader import StatefulDataLoader
    from guideloom_pipes.loader.orders import batches_ahead

    options.setdefault("shuffle", True)
    options.setdefault("shuffle_seed", SEED)
    options.setdefault("device", CPU)
    loader: StatefulDataLoader[Any, Any] = StatefulDataLoader(dataset, collate, **options)
    return Contender(
        name,
        lambda: iter(loader),
        count,
        setup=loader.open,
        teardown=loader.close,
        ahead=batches_ahead(loader),
    )


# Slow storage ---------------------------------------------------------------------------------


class _SlowReader:
    """A reader of slow storage: every read sleeps ``delay`` (the GIL released), then hands
    over the bytes.

    Over a mapping (default), the bytes are copied from the page-cached file under the GIL:
    like a blocking read from a parallel file system, a read is one call that gives up the
    GIL once, for its latency. Over a ``pread`` reader, the read after the sleep is a
    second system call that gives up the GIL again: two handoffs per read, more than a
    real read costs.
    """

    def __init__(self, inner: Any, delay: float, mapped: bool) -> None:
        self._inner = inner
        self._delay = delay
        self._mapped = mapped
        self._view: memoryview | None = None

    def open(self) -> None:
        self._inner.open()
        if self._mapped:
            self._view = self._inner.buffer()

    def close(self) -> None:
        self._view = None
        self._inner.close()

    def filesize(self) -> int:
        return int(self._inner.filesize())

    def read(self, offset: int, size: int) -> Any:
        time.sleep(self._delay)  # releases the GIL, as waiting on a network file system does
        if self._view is None:
            return self._inner.read(offset, size)
        return bytes(self._view[offset : offset + size])

    def readinto(self, offset: int, buffer: memoryview) -> int:
        time.sleep(self._delay)
        view = self._view
        if view is None:
            return int(self._inner.readinto(offset, buffer))
        piece = view[offset : offset + len(buffer)]
        buffer[: len(piece)] = piece
        return len(piece)


class SlowIO:
    """A read backend that adds ``delay`` seconds of latency to every read.

    Args:
        delay: seconds slept before each read (default 1 ms).
        pread: read with ``PosixPreadIO`` after the sleep (two GIL handoffs per read)
            instead of copying from a mapping (one, as a blocking read has).
    """

    def __init__(self, delay: float = 0.001, pread: bool = False) -> None:
        self.delay = delay
        self.pread = pread
        self._inner: Any = PosixPreadIO() if pread else MmapIO()

    def sync_reader(self) -> Any:
        """The factory of readers (:meth:`open_reader`)."""
        return self.open_reader

    def async_reader(self) -> Any:
        """The factory of ``async`` readers (:meth:`open_async_reader`)."""
        return self.open_async_reader

    def open_reader(self, path: PurePath) -> _SlowReader:
        """A reader of ``path``."""
        return _SlowReader(self._inner.sync_reader()(path), self.delay, not self.pread)

    def open_async_reader(self, path: PurePath) -> Any:
        """An ``async`` reader of ``path`` (without the delay)."""
        return self._inner.async_reader()(path)

    def list_dir(self, path: PurePath) -> list[str]:
        """Names in directory ``path``."""
        return os.listdir(os.fspath(path))

    def __repr__(self) -> str:
        return f"SlowIO(delay={self.delay}, pread={self.pread})"


def _slow_prefetch(workers: int) -> int:
    return max(2, workers)


def _slow_name(workers: int) -> str:
    return f"ours workers={workers} threads prefetch={_slow_prefetch(workers)}"
