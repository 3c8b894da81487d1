"""Throughput benchmark: our loader against the hand-written limit and torch's ``DataLoader``.

Run ``python -m guideloom_pipes.bench`` (``--quick`` for tiny data in about a minute,
``--json PATH`` to keep the figures, ``--help`` for the sizes). It builds its own datasets in
a temporary directory, then for each scenario warms every contender up and measures them in
alternating rounds (A B C A B C ...), reporting the median round:

``tokens-2048`` / ``tokens-128``
    stream storage, shuffled, ``L=2048`` batch 8 / ``L=128`` batch 64; ours with 0 and 2
    thread workers against the *hand loop* (baseline: a precomputed permutation, each window
    copied out of per-shard ``np.memmap`` s, ``np.stack``, ``torch.from_numpy``) and
    ``torch.utils.data.DataLoader`` over a memmap-backed ``Dataset`` with 0 and 2 workers.
``meta``
    stream with metadata (a payload per chunk of about 100 tokens), ``L=2048`` batch 8.
``documents``
    pickled documents of 100-4000 token ids, batch 32, a padding collate; 2 workers as threads
    and as processes.
``slow-storage``
    a read backend that sleeps 1 ms per read (a parallel file system: one blocking call per
    read, the bytes then copied from the page cache), ``L=2048`` batch 32, 1, 8 and 32
    thread workers; and 32 workers over a backend that sleeps and then calls ``pread``
    (two GIL handoffs per read).
``shuffle``
    shuffled sample ids per second from the Feistel permutation.
``scale`` / ``resume``
    in a subprocess: a sparse dataset of 2**40 tokens in 1,000 shards; seconds and peak memory
    to the first batch, and the first batch after ``load_state_dict`` at offset 0 and at the
    last batch of the epoch.
``train-loop``
    a training loop with a 10 ms step that releases the GIL, ``prefetch=2``: the fraction of
    its time the training thread waits in ``next()`` and its CPU time inside ``next()``.

Throughput rows give samples/s, tokens/s, CPU-seconds per million samples (this process's CPU
time across all its threads, plus that of its child processes: live ones read from ``/proc``,
reaped ones from ``RUSAGE_CHILDREN``) and the ratio to the scenario's baseline. Rates are
steady-state: starting the first iterator and its first batch are timed separately (``first
batch`` in the JSON), not inside a round; a new epoch's iterator starts inside the round, as it
does in training. The last table checks each target of issue 4 (PASS/MISS).
The benchmark needs only the runtime dependencies (numpy, torch, torchdata).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pickle
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch

from guideloom_pipes.formats import DocumentPickleFormat, StreamNumpyFormat
from guideloom_pipes.io import MmapIO, PosixPreadIO
from guideloom_pipes.storage import DocumentStorage, StreamStorage, StreamWithMetaStorage

TOKENS_DTYPE = np.dtype([("tokens", "<i4")])
META_RECORD = np.dtype([("index", "<i4"), ("tokens", "<i4")])
SEED = 1234
CPU = torch.device("cpu")

#: Row names the targets refer to.
OURS_0 = "ours workers=0 prefetch=4"
OURS_2 = "ours workers=2 threads prefetch=4"
OURS_2P = "ours workers=2 processes prefetch=4"
SLOW_PREAD = "ours workers=32 threads prefetch=32, sleep then pread"

SCENARIOS = (
    "tokens-2048",
    "tokens-128",
    "meta",
    "documents",
    "slow-storage",
    "shuffle",
    "scale",
    "resume",
    "train-loop",
)


# Sizes ----------------------------------------------------------------------------------------


@dataclass
class Sizes:
    """Data sizes and measurement effort of one benchmark run."""

    tokens: int = 100_000_000
    shards: int = 4
    meta_tokens: int = 10_000_000
    meta_chunk: int = 100
    documents: int = 50_000
    slow_tokens: int = 100_000_000
    scale_tokens: int = 2**40
    scale_shards: int = 1000
    shuffle_block: int = 8192
    rounds: int = 5
    round_seconds: float = 1.0
    warmup_seconds: float = 0.5
    train_steps: int = 300
    resume_rounds: int = 5

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            tokens=2_000_000,
            meta_tokens=300_000,
            documents=1500,
            slow_tokens=1_000_000,
            rounds=2,
            round_seconds=0.2,
            warmup_seconds=0.1,
            train_steps=30,
            resume_rounds=2,
        )


# Measuring ------------------------------------------------------------------------------------


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


_TICKS = _clock_ticks()


def _descendant_cpu() -> float:
    """CPU seconds of this process's live descendants (Linux ``/proc``; 0 elsewhere)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0.0
    me = os.getpid()
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                raw = handle.read()
        except OSError:
            continue
        fields = raw[raw.rindex(b")") + 2 :].split()
        pid = int(name)
        children.setdefault(int(fields[1]), []).append(pid)
        # utime, stime, cutime, cstime (fields 14-17 of proc(5))
        ticks[pid] = sum(int(value) for value in fields[11:15])
    total, stack = 0, list(children.get(me, ()))
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children.get(pid, ()))
    return total / _TICKS


def _reaped_children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _Clock:
    """Accumulates wall time, this process's CPU time and its children's CPU time."""

    def __init__(self) -> None:
        self.wall = self.cpu = self.children = 0.0
        self._marks: tuple[float, float, float] | None = None

    def start(self) -> None:
        self._marks = (
            time.perf_counter(),
            time.process_time(),
            _descendant_cpu() + _reaped_children_cpu(),
        )

    def stop(self) -> None:
        assert self._marks is not None
        wall, cpu, children = self._marks
        self.wall += time.perf_counter() - wall
        self.cpu += time.process_time() - cpu
        self.children += max(0.0, _descendant_cpu() + _reaped_children_cpu() - children)
        self._marks = None


@dataclass
class Round:
    """One measured round of one contender."""

    samples: int
    tokens: int
    wall_s: float
    cpu_s: float
    children_cpu_s: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_s_per_1m(self) -> float:
        return (self.cpu_s + self.children_cpu_s) / self.samples * 1e6 if self.samples else 0.0


def _close_iterator(iterator: Any) -> None:
    close = getattr(iterator, "close", None)
    if callable(close):
        close()
        return
    shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's multi-worker iterator
    if callable(shutdown):
        shutdown()


@dataclass
class Contender:
    """One way of producing batches in a scenario.

    Args:
        name: the row label.
        make_iterator: a fresh iterator of batches (a new epoch when the last one ended).
        count: ``(samples, tokens)`` in a batch.
        setup: called once before the first iterator (opens loaders).
        teardown: called once at the end (closes loaders).
        ahead: the most batches it can have read ahead of its consumer (prefetch buffers,
            jobs in flight). While other contenders run their rounds its workers fill
            these; each round first takes that many batches off the clock, so that work
            done between rounds is not counted as the round's.
    """

    name: str
    make_iterator: Callable[[], Iterator[Any]]
    count: Callable[[Any], tuple[int, int]]
    setup: Callable[[], None] = lambda: None
    teardown: Callable[[], None] = lambda: None
    ahead: int = 0
    iterator: Iterator[Any] | None = None
    batches_per_round: int = 1
    first_batch_s: float = 0.0
    rounds: list[Round] = field(default_factory=list)

    def restart(self) -> float:
        """Close the current iterator, start a new one and take its first batch; seconds."""
        self.stop()
        started = time.perf_counter()
        self.iterator = self.make_iterator()
        next(self.iterator)
        return time.perf_counter() - started

    def stop(self) -> None:
        if self.iterator is not None:
            _close_iterator(self.iterator)
            self.iterator = None

    def _next(self) -> Any:
        """The next batch; an exhausted iterator is replaced by a new epoch's."""
        assert self.iterator is not None
        try:
            return next(self.iterator)
        except StopIteration:
            _close_iterator(self.iterator)
            self.iterator = self.make_iterator()
            return next(self.iterator)

    def run(self, batches: int, timed_only: bool = False) -> Round:
        """Take ``batches`` batches on the clock (an exhausted iterator is restarted inside
        it), after ``ahead`` off it (unless ``timed_only``)."""
        for _ in range(0 if timed_only else self.ahead):
            self._next()
        clock = _Clock()
        samples = tokens = 0
        clock.start()
        for _ in range(batches):
            batch = self._next()
            count_samples, count_tokens = self.count(batch)
            samples += count_samples
            tokens += count_tokens
        clock.stop()
        return Round(samples, tokens, clock.wall, clock.cpu, clock.children)


@dataclass
class Row:
    """A contender's figures in a scenario (medians over the rounds)."""

    scenario: str
    contender: str
    samples_per_s: float
    tokens_per_s: float
    cpu_s_per_1m_samples: float
    ratio_to_baseline: float
    baseline: bool
    first_batch_s: float
    rounds: list[dict[str, float]]


def measure(scenario: str, contenders: Sequence[Contender], sizes: Sizes, log: Any) -> list[Row]:
    """Warm up every contender, run alternating rounds, and summarise (first is baseline)."""
    try:
        for contender in contenders:
            contender.setup()
            contender.first_batch_s = contender.restart()
            batches, wall, chunk = 0, 0.0, 1
            while wall < sizes.warmup_seconds:
                wall += contender.run(chunk, timed_only=True).wall_s
                batches += chunk
                chunk = min(2 * chunk, 4096)
            rate = batches / wall if wall > 0 else 1e6
            contender.batches_per_round = max(3, int(rate * sizes.round_seconds))
        for _ in range(sizes.rounds):
            for contender in contenders:
                contender.rounds.append(contender.run(contender.batches_per_round))
    finally:
        for contender in contenders:
            with contextlib.suppress(Exception):
                contender.stop()
            contender.teardown()
        gc.collect()
    base = statistics.median(r.samples_per_s for r in contenders[0].rounds)
    rows = []
    for index, contender in enumerate(contenders):
        rate = statistics.median(r.samples_per_s for r in contender.rounds)
        row = Row(
            scenario=scenario,
            contender=contender.name,
            samples_per_s=rate,
            tokens_per_s=statistics.median(r.tokens_per_s for r in contender.rounds),
            cpu_s_per_1m_samples=statistics.median(r.cpu_s_per_1m for r in contender.rounds),
            ratio_to_baseline=rate / base if base > 0 else 0.0,
            baseline=index == 0,
            first_batch_s=contender.first_batch_s,
            rounds=[
                {**asdict(r), "samples_per_s": r.samples_per_s, "cpu_s_per_1m": r.cpu_s_per_1m}
                for r in contender.rounds
            ],
        )
        rows.append(row)
        log(
            f"  {scenario:<13} {contender.name:<34} {rate:>12,.0f} samples/s  "
            f"x{row.ratio_to_baseline:.2f}"
        )
    return rows


# Data -----------------------------------------------------------------------------------------


def _tokens_stream(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.integers(0, 50_000, size=count, dtype=np.int32)


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


def build_tokens(directory: Path, total: int, shards: int) -> StreamStorage:
    """A stream storage of ``total`` random ``<i4`` tokens in ``shards`` shards."""
    storage = StreamStorage(directory, StreamNumpyFormat(TOKENS_DTYPE))
    rng = np.random.default_rng(SEED)
    with storage.sync_writer() as writer:
        for shard, length in enumerate(_split(total, shards)):
            for piece in _split(length, max(1, length // 10_000_000)):
                writer.append(shard, {"tokens": _tokens_stream(rng, piece)})
    return storage


class ChunkMetaFormat:
    """A stream-with-metadata format: tokens, and a small JSON payload per chunk.

    ``pack({"tokens": array, "source": str})`` gives every ``chunk`` consecutive tokens one
    payload; ``unpack`` returns ``{"tokens": array, "payload_index": int32 array, "payloads":
    [bytes, ...]}``.
    """

    stream_dtype = TOKENS_DTYPE

    def __init__(self, chunk: int = 100) -> None:
        self.chunk = chunk

    def size(self, data: dict[str, Any]) -> int:
        return len(data["tokens"])

    def pack(self, data: dict[str, Any]) -> Any:
        tokens = np.asarray(data["tokens"], dtype=np.int32)
        source = data.get("source", "doc")
        for start in range(0, len(tokens), self.chunk):
            payload = json.dumps({"source": source, "chunk": start // self.chunk}).encode()
            yield start, payload
            for _ in range(1, min(self.chunk, len(tokens) - start)):
                yield start, None
        stream = np.empty(len(tokens), dtype=TOKENS_DTYPE)
        stream["tokens"] = tokens
        return stream

    def unpack(
        self,
        stream_data: np.ndarray,
        document_shard: np.ndarray,
        document_index: np.ndarray,
        document_data: list[bytes],
    ) -> dict[str, Any]:
        return {
            "tokens": np.ascontiguousarray(stream_data["tokens"]),
            "payload_index": document_index,
            "payloads": document_data,
        }


def build_meta(directory: Path, total: int, shards: int, chunk: int) -> StreamWithMetaStorage:
    """A stream-with-metadata storage: ``total`` tokens, one payload per ``chunk`` tokens."""
    storage = StreamWithMetaStorage(directory, ChunkMetaFormat(chunk))
    rng = np.random.default_rng(SEED + 1)
    with storage.sync_writer() as writer:
        for shard, length in enumerate(_split(total, shards)):
            for index, piece in enumerate(_split(length, max(1, length // 100_000))):
                writer.append(
                    shard, {"tokens": _tokens_stream(rng, piece), "source": f"{shard}/{index}"}
                )
    return storage


def build_documents(directory: Path, count: int, shards: int) -> tuple[DocumentStorage, int]:
    """Pickled documents (lists of 100-4000 token ids); the storage and the token count."""
    storage = DocumentStorage(directory, DocumentPickleFormat())
    rng = np.random.default_rng(SEED + 2)
    lengths = rng.integers(100, 4001, size=count)
    pool = _tokens_stream(rng, 4100).tolist()
    with storage.sync_writer() as writer:
        for index, length in enumerate(lengths.tolist()):
            shift = index % 97
            writer.append(index * shards // count, pool[shift : shift + length])
    return storage, int(lengths.sum())


def build_sparse(directory: Path, total: int, shards: int) -> int:
    """Sparse ``<i4`` shards of ``total`` tokens (``os.truncate``, no commit records)."""
    directory.mkdir(parents=True, exist_ok=True)
    for shard, length in enumerate(_split(total, shards)):
        path = directory / f"{shard:07d}.in_band.bin"
        with open(path, "wb"):
            pass
        os.truncate(path, length * TOKENS_DTYPE.itemsize)
    return total


def _shard_paths(storage: Any, suffix: str) -> list[Path]:
    directory = Path(storage.dir)
    paths = sorted(directory.glob(f"*{suffix}"))
    return [p for p in paths if p.name[:7].isdigit() and p.name.endswith(suffix)]


# Collates -------------------------------------------------------------------------------------


def collate_tokens(samples: Sequence[dict[str, np.ndarray]]) -> torch.Tensor:
    """``torch.from_numpy(np.stack(tokens))``: the collate of the token scenarios."""
    return torch.from_numpy(np.stack([sample["tokens"] for sample in samples]))


def collate_meta(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stacked tokens plus the per-sample payload lists."""
    return {
        "tokens": torch.from_numpy(np.stack([sample["tokens"] for sample in samples])),
        "payload_index": [sample["payload_index"] for sample in samples],
        "payloads": [sample["payloads"] for sample in samples],
    }


def collate_pad(documents: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token-id lists to the longest: ``(batch, max_len)`` int64 and the lengths."""
    lengths = [len(document) for document in documents]
    out = np.zeros((len(documents), max(lengths)), dtype=np.int64)
    for row, document in enumerate(documents):
        out[row, : len(document)] = document
    return torch.from_numpy(out), torch.tensor(lengths)


def _count_tokens(length: int) -> Callable[[Any], tuple[int, int]]:
    def count(batch: Any) -> tuple[int, int]:
        rows = int(batch["tokens"].shape[0]) if isinstance(batch, dict) else int(batch.shape[0])
        return rows, rows * length

    return count


def _count_padded(batch: Any) -> tuple[int, int]:
    return int(batch[1].shape[0]), int(batch[1].sum())


# Baselines ------------------------------------------------------------------------------------


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
    collate: Callable[[Any], Any],
    count: Callable[[Any], tuple[int, int]],
    **options: Any,
) -> Contender:
    from guideloom_pipes.loader import StatefulDataLoader

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
        ahead=loader._batches_ahead(),
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

    def sync_reader(self, path: PurePath) -> _SlowReader:
        """A reader of ``path``."""
        return _SlowReader(self._inner.sync_reader(path), self.delay, not self.pread)

    def async_reader(self, path: PurePath) -> Any:
        """An ``async`` reader of ``path`` (without the delay)."""
        return self._inner.async_reader(path)

    def list_dir(self, path: PurePath) -> list[str]:
        """Names in directory ``path``."""
        return os.listdir(os.fspath(path))

    def __repr__(self) -> str:
        return f"SlowIO(delay={self.delay}, pread={self.pread})"


def _slow_prefetch(workers: int) -> int:
    return max(2, workers)


def _slow_name(workers: int) -> str:
    return f"ours workers={workers} threads prefetch={_slow_prefetch(workers)}"


# Scenarios ------------------------------------------------------------------------------------


@dataclass
class Bench:
    """One benchmark run: data in ``root``, figures in ``rows`` and ``extra``."""

    root: Path
    sizes: Sizes
    log: Callable[[str], None]
    rows: list[Row] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    _tokens: StreamStorage | None = None

    def tokens(self) -> StreamStorage:
        if self._tokens is None:
            started = time.perf_counter()
            self._tokens = build_tokens(self.root / "tokens", self.sizes.tokens, self.sizes.shards)
            self.timings["build tokens"] = time.perf_counter() - started
        return self._tokens

    def stream_scenario(self, name: str, length: int, batch: int) -> None:
        storage = self.tokens()
        count = _count_tokens(length)
        hand = HandLoop(storage, length, batch, SEED)
        stream = {"sequence_length": length, "local_batch_size": batch}
        contenders = [
            Contender("hand loop", lambda: iter(hand), count),
            _ours_contender(
                OURS_0, storage, collate_tokens, count, num_workers=0, prefetch=4, **stream
            ),
            _ours_contender(
                OURS_2, storage, collate_tokens, count, num_workers=2, prefetch=4, **stream
            ),
            _ours_contender(
                "ours workers=0 prefetch=0 (inline)",
                storage,
                collate_tokens,
                count,
                num_workers=0,
                prefetch=0,
                **stream,
            ),
            _torch_contender(
                "torch DataLoader workers=0",
                MemmapWindows(storage, length),
                collate_tokens,
                batch,
                0,
                count,
            ),
            _torch_contender(
                "torch DataLoader workers=2",
                MemmapWindows(storage, length),
                collate_tokens,
                batch,
                2,
                count,
            ),
        ]
        self.rows += measure(name, contenders, self.sizes, self.log)

    def meta_scenario(self) -> None:
        started = time.perf_counter()
        storage = build_meta(
            self.root / "meta", self.sizes.meta_tokens, self.sizes.shards, self.sizes.meta_chunk
        )
        self.timings["build meta"] = time.perf_counter() - started
        length, batch = 2048, 8
        count = _count_tokens(length)
        contenders = [
            _torch_contender(
                "torch DataLoader workers=0",
                MemmapMetaWindows(storage, length),
                collate_meta,
                batch,
                0,
                count,
            ),
            _ours_contender(
                OURS_0,
                storage,
                collate_meta,
                count,
                sequence_length=length,
                local_batch_size=batch,
                num_workers=0,
                prefetch=4,
            ),
            _ours_contender(
                OURS_2,
                storage,
                collate_meta,
                count,
                sequence_length=length,
                local_batch_size=batch,
                num_workers=2,
                parallel_method="thread",
                prefetch=4,
            ),
            _torch_contender(
                "torch DataLoader workers=2",
                MemmapMetaWindows(storage, length),
                collate_meta,
                batch,
                2,
                count,
            ),
        ]
        self.rows += measure("meta", contenders, self.sizes, self.log)

    def documents_scenario(self) -> None:
        started = time.perf_counter()
        storage, _ = build_documents(
            self.root / "documents", self.sizes.documents, self.sizes.shards
        )
        self.timings["build documents"] = time.perf_counter() - started
        batch = 32
        common = {"local_batch_size": batch, "prefetch": 4}
        contenders = [
            _torch_contender(
                "torch DataLoader workers=0",
                MemmapDocuments(storage),
                collate_pad,
                batch,
                0,
                _count_padded,
            ),
            _ours_contender(OURS_0, storage, collate_pad, _count_padded, num_workers=0, **common),
            _ours_contender(
                OURS_2,
                storage,
                collate_pad,
                _count_padded,
                num_workers=2,
                parallel_method="thread",
                **common,
            ),
            _ours_contender(
                OURS_2P,
                storage,
                collate_pad,
                _count_padded,
                num_workers=2,
                parallel_method="process",
                **common,
            ),
            _torch_contender(
                "torch DataLoader workers=2",
                MemmapDocuments(storage),
                collate_pad,
                batch,
                2,
                _count_padded,
            ),
        ]
        self.rows += measure("documents", contenders, self.sizes, self.log)

    def slow_scenario(self) -> None:
        started = time.perf_counter()
        directory = self.root / "slow"
        if self.sizes.slow_tokens == self.sizes.tokens:
            directory = self.tokens().dir  # type: ignore[assignment]
        else:
            build_tokens(directory, self.sizes.slow_tokens, self.sizes.shards)
        self.timings["build slow"] = time.perf_counter() - started
        storage = StreamStorage(directory, StreamNumpyFormat(TOKENS_DTYPE), SlowIO(0.001))
        preads = StreamStorage(directory, StreamNumpyFormat(TOKENS_DTYPE), SlowIO(0.001, True))
        count = _count_tokens(2048)

        def ours(name: str, store: StreamStorage, workers: int) -> Contender:
            return _ours_contender(
                name,
                store,
                collate_tokens,
                count,
                sequence_length=2048,
                local_batch_size=32,
                num_workers=workers,
                parallel_method="thread",
                prefetch=_slow_prefetch(workers),
            )

        contenders = [ours(_slow_name(workers), storage, workers) for workers in (1, 8, 32)]
        contenders.append(ours(SLOW_PREAD, preads, 32))
        self.rows += measure("slow-storage", contenders, self.sizes, self.log)

    def shuffle_scenario(self) -> None:
        from guideloom_pipes.shuffle import FeistelPermutation

        block = self.sizes.shuffle_block
        stream_samples = self.sizes.tokens // 2048

        def blocks(n: int, size: int) -> Callable[[], Iterator[Any]]:
            permutation = FeistelPermutation.for_epoch(n, SEED, 0)

            def generate() -> Iterator[Any]:
                for start in range(0, min(n, 1 << 40), size):
                    positions = np.arange(start, min(n, start + size), dtype=np.int64)
                    yield permutation(positions)

            return generate

        def per_index(n: int) -> Callable[[], Iterator[Any]]:
            permutation = FeistelPermutation.for_epoch(n, SEED, 0)

            def generate() -> Iterator[Any]:
                for start in range(0, n, 256):
                    yield [permutation(p) for p in range(start, min(n, start + 256))]

            return generate

        def count(ids: Any) -> tuple[int, int]:
            return len(ids), 0

        contenders = [
            Contender(f"per-index calls, n={stream_samples:,}", per_index(stream_samples), count),
            Contender(
                f"blocks of {block}, n={stream_samples:,}", blocks(stream_samples, block), count
            ),
            Contender(f"blocks of {block}, n=2**29", blocks(2**29, block), count),
            Contender(f"blocks of {block}, n=2**40", blocks(2**40, block), count),
        ]
        self.rows += measure("shuffle", contenders, self.sizes, self.log)

    def scale_scenario(self) -> None:
        started = time.perf_counter()
        directory = self.root / "sparse"
        build_sparse(directory, self.sizes.scale_tokens, self.sizes.scale_shards)
        self.timings["build sparse"] = time.perf_counter() - started
        command = [
            sys.executable,
            "-m",
            "guideloom_pipes.bench",
            "--child-scale",
            str(directory),
            "--resume-rounds",
            str(self.sizes.resume_rounds),
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(
                f"the scale subprocess failed ({result.returncode}):\n{result.stderr[-4000:]}"
            )
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        figures["tokens"] = self.sizes.scale_tokens
        figures["shards"] = self.sizes.scale_shards
        self.extra["scale"] = {k: v for k, v in figures.items() if not k.startswith("resume")}
        self.extra["resume"] = {k: v for k, v in figures.items() if k.startswith("resume")}
        scale, resume = self.extra["scale"], self.extra["resume"]
        self.log(
            f"  scale         first batch {scale['first_batch_s']:.3f} s, peak "
            f"{scale['peak_rss_above_import_mb']:.1f} MB above import"
        )
        self.log(
            f"  resume        offset 0 {resume['resume_offset0_s']:.4f} s, near end "
            f"{resume['resume_near_end_s']:.4f} s"
        )

    def train_loop_scenario(self) -> None:
        from guideloom_pipes.loader import StatefulDataLoader

        storage = self.tokens()
        length, batch, steps = 2048, 8, self.sizes.train_steps
        results = []
        configurations: list[tuple[str, Callable[[], Any]]] = [
            (
                f"ours workers={workers} prefetch=2",
                lambda workers=workers: StatefulDataLoader.from_storage(  # type: ignore[misc]
                    storage,
                    collate_tokens,
                    sequence_length=length,
                    local_batch_size=batch,
                    num_workers=workers,
                    parallel_method="thread",
                    prefetch=2,
                    shuffle=True,
                    shuffle_seed=SEED,
                    device=CPU,
                ),
            )
            for workers in (0, 2)
        ]
        configurations.append(
            (
                "torch DataLoader workers=2 prefetch_factor=2",
                lambda: torch.utils.data.DataLoader(
                    MemmapWindows(storage, length),
                    batch_size=batch,
                    shuffle=True,
                    num_workers=2,
                    prefetch_factor=2,
                    collate_fn=collate_tokens,
                    drop_last=True,
                ),
            )
        )
        for name, make in configurations:
            loader = make()
            with contextlib.ExitStack() as stack:
                if hasattr(loader, "__enter__"):
                    stack.enter_context(loader)
                figures = _train_loop(loader, steps)
            results.append({"contender": name, **figures})
            self.log(
                f"  train-loop    {name:<34} waits {figures['wait_fraction']:.1%}, "
                f"{figures['next_cpu_ms_per_batch']:.3f} ms CPU in next() per batch"
            )
        self.extra["train-loop"] = {
            "step_s": 0.01,
            "steps": steps,
            "sequence_length": length,
            "batch": batch,
            "rows": results,
        }


def _train_loop(loader: Any, steps: int, step_s: float = 0.01) -> dict[str, float]:
    """Run ``steps`` simulated training steps; how long and how much CPU ``next()`` took."""
    iterator = iter(loader)
    try:
        for _ in range(3):  # start-up: worker start and the first batches are not a steady state
            next(iterator)
            time.sleep(step_s)
        waited = next_cpu = 0.0
        started = time.perf_counter()
        cpu_started = time.process_time()
        done = 0
        while done < steps:
            wall_mark, cpu_mark = time.perf_counter(), time.thread_time()
            try:
                next(iterator)
            except StopIteration:
                _close_iterator(iterator)
                iterator = iter(loader)
                continue
            next_cpu += time.thread_time() - cpu_mark
            waited += time.perf_counter() - wall_mark
            done += 1
            time.sleep(step_s)  # the training step: GIL released, as a GPU step's wait is
        total = time.perf_counter() - started
        process_cpu = time.process_time() - cpu_started
    finally:
        _close_iterator(iterator)
    return {
        "wait_fraction": waited / total,
        "wait_ms_per_batch": waited / steps * 1e3,
        "next_cpu_ms_per_batch": next_cpu / steps * 1e3,
        "process_cpu_ms_per_batch": process_cpu / steps * 1e3,
        "wall_s": total,
    }


# The scale / resume child ---------------------------------------------------------------------


def _proc_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _max_rss_kb() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def scale_child(directory: Path, resume_rounds: int) -> dict[str, Any]:
    """In a fresh process: open the sparse dataset, first batch, peak RSS, resume timings."""
    import torchdata.nodes  # noqa: F401  - part of "after importing torch and our package"

    import guideloom_pipes
    from guideloom_pipes.loader import StatefulDataLoader

    assert guideloom_pipes.__version__
    gc.collect()
    base_rss = _proc_status_kb("VmRSS")
    reset = base_rss is not None and _reset_peak_rss()
    base_max = _max_rss_kb()
    length, batch = 2048, 8
    started = time.perf_counter()
    storage = StreamStorage(directory, StreamNumpyFormat(TOKENS_DTYPE))
    loader = StatefulDataLoader.from_storage(
        storage,
        collate_tokens,
        sequence_length=length,
        local_batch_size=batch,
        num_workers=0,
        prefetch=4,
        shuffle=True,
        shuffle_seed=SEED,
        device=CPU,
    )
    loader.__enter__()
    opened = time.perf_counter()
    iterator = iter(loader)
    first = next(iterator)
    first_batch_s = time.perf_counter() - started
    assert tuple(first.shape) == (batch, length)
    _close_iterator(iterator)
    if reset and base_rss is not None:
        hwm = _proc_status_kb("VmHWM") or 0
        peak_kb, method = hwm - base_rss, "VmHWM after clear_refs"
    else:
        peak_kb, method = _max_rss_kb() - base_max, "ru_maxrss delta"
    samples = len(loader) * batch
    near_end = (samples // batch - 1) * batch
    timings: dict[int, list[float]] = {0: [], near_end: []}
    for round_index in range(resume_rounds):
        offsets = [0, near_end] if round_index % 2 == 0 else [near_end, 0]
        for offset in offsets:
            state = {
                "epoch": 0,
                "observation_offset": offset,
                "shuffle": True,
                "shuffle_seed": SEED,
                "drop_last": True,
            }
            mark = time.perf_counter()
            loader.load_state_dict(state)
            iterator = iter(loader)
            next(iterator)
            timings[offset].append(time.perf_counter() - mark)
            _close_iterator(iterator)
    loader.__exit__(None, None, None)
    zero, end = statistics.median(timings[0]), statistics.median(timings[near_end])
    return {
        "first_batch_s": first_batch_s,
        "open_s": opened - started,
        "peak_rss_above_import_mb": peak_kb / 1024,
        "post_import_rss_mb": (base_rss or 0) / 1024,
        "rss_method": method,
        "samples": samples,
        "resume_offset0_s": zero,
        "resume_near_end_s": end,
        "resume_near_end_offset": near_end,
        "resume_ratio": end / zero if zero > 0 else 0.0,
        "resume_rounds": {str(k): v for k, v in timings.items()},
    }


# Targets and the report -----------------------------------------------------------------------


@dataclass
class Target:
    """One target of issue 4 and how this run did."""

    name: str
    measured: float
    threshold: float
    higher_is_better: bool
    unit: str = "x"

    @property
    def passed(self) -> bool:
        if self.higher_is_better:
            return self.measured >= self.threshold
        return self.measured < self.threshold


def _rate(rows: list[Row], scenario: str, contender: str) -> float:
    for row in rows:
        if row.scenario == scenario and row.contender == contender:
            return row.samples_per_s
    return float("nan")


def targets(rows: list[Row], extra: dict[str, Any]) -> list[Target]:
    """The targets of issue 4 that this run measured."""
    out: list[Target] = []
    scenarios = {row.scenario for row in rows}
    for scenario in ("tokens-2048", "tokens-128"):
        if scenario not in scenarios:
            continue
        hand = _rate(rows, scenario, "hand loop")
        zero = _rate(rows, scenario, OURS_0)
        two = _rate(rows, scenario, OURS_2)
        out.append(Target(f"{scenario}: {OURS_0} / hand loop", zero / hand, 0.5, True))
        out.append(Target(f"{scenario}: {OURS_2} / {OURS_0}", two / zero, 0.95, True))
    if "documents" in scenarios:
        threads = _rate(rows, "documents", OURS_2)
        processes = _rate(rows, "documents", OURS_2P)
        out.append(Target("documents: processes / threads", processes / threads, 1.3, True))
    if "slow-storage" in scenarios:
        one = _rate(rows, "slow-storage", _slow_name(1))
        for workers, floor in ((8, 6.0), (32, 20.0)):
            many = _rate(rows, "slow-storage", _slow_name(workers))
            out.append(
                Target(f"slow-storage: {workers} workers / 1 worker", many / one, floor, True)
            )
    for row in rows:
        if row.scenario == "shuffle" and row.contender.startswith("blocks"):
            out.append(
                Target(f"shuffle: {row.contender}", row.samples_per_s / 1e6, 3.0, True, "M ids/s")
            )
    if "scale" in extra:
        scale = extra["scale"]
        out.append(Target("scale: first batch", scale["first_batch_s"], 1.0, False, "s"))
        out.append(
            Target(
                "scale: peak RSS above post-import",
                scale["peak_rss_above_import_mb"],
                50.0,
                False,
                "MB",
            )
        )
    if "resume" in extra:
        resume = extra["resume"]
        out.append(Target("resume: near end / offset 0", resume["resume_ratio"], 2.0, False))
    for row in extra.get("train-loop", {}).get("rows", []):
        if row["contender"].startswith("ours"):
            out.append(
                Target(
                    f"train-loop: {row['contender']} waits",
                    row["wait_fraction"] * 100,
                    5.0,
                    False,
                    "% of time",
                )
            )
    return out


def _table(headers: Sequence[str], body: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths))
            )
            + " |"
        )

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(headers), rule, *(line(r) for r in body)])


def report(rows: list[Row], extra: dict[str, Any], goals: list[Target]) -> str:
    """The tables printed at the end of a run (markdown)."""
    parts = []
    body = [
        [
            row.scenario,
            row.contender + (" (baseline)" if row.baseline else ""),
            f"{row.samples_per_s:,.0f}",
            f"{row.tokens_per_s:,.0f}" if row.tokens_per_s else "-",
            f"{row.cpu_s_per_1m_samples:,.1f}",
            f"{row.ratio_to_baseline:.2f}",
            f"{row.first_batch_s:.3f}",
        ]
        for row in rows
    ]
    parts.append(
        _table(
            [
                "scenario",
                "contender",
                "samples/s",
                "tokens/s",
                "CPU-s / 1M samples",
                "vs baseline",
                "first batch s",
            ],
            body,
            {2, 3, 4, 5, 6},
        )
    )
    latency: list[list[str]] = []
    if "scale" in extra:
        scale = extra["scale"]
        latency.append(["scale", "open + first batch", f"{scale['first_batch_s']:.3f} s"])
        latency.append(["scale", "of which open", f"{scale['open_s']:.3f} s"])
        latency.append(
            ["scale", "peak RSS above post-import", f"{scale['peak_rss_above_import_mb']:.1f} MB"]
        )
    if "resume" in extra:
        resume = extra["resume"]
        latency.append(["resume", "first batch at offset 0", f"{resume['resume_offset0_s']:.4f} s"])
        latency.append(
            ["resume", "first batch near the end", f"{resume['resume_near_end_s']:.4f} s"]
        )
    for row in extra.get("train-loop", {}).get("rows", []):
        latency.append(
            [
                "train-loop",
                row["contender"],
                f"waits {row['wait_fraction']:.1%}; next(): {row['next_cpu_ms_per_batch']:.3f} ms "
                f"CPU/batch; process {row['process_cpu_ms_per_batch']:.2f} ms CPU/batch",
            ]
        )
    if latency:
        parts.append(_table(["scenario", "measure", "value"], latency, set()))
    goal_rows = [
        [
            goal.name,
            f"{goal.measured:.3g} {goal.unit}".strip(),
            f"{'>=' if goal.higher_is_better else '<'} {goal.threshold:g} {goal.unit}".strip(),
            "PASS" if goal.passed else "MISS",
        ]
        for goal in goals
    ]
    if goal_rows:
        parts.append(_table(["target", "measured", "target", "result"], goal_rows, {1}))
    return "\n\n".join(parts)


def _machine() -> dict[str, Any]:
    import torchdata

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torchdata": getattr(torchdata, "__version__", "?"),
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


# Command line ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    defaults = Sizes()
    parser = argparse.ArgumentParser(
        prog="python -m guideloom_pipes.bench",
        description="Throughput of guideloom_pipes against a hand loop and torch's DataLoader.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny data, about a minute")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument(
        "--only",
        help=f"comma-separated scenarios to run (default all: {', '.join(SCENARIOS)})",
    )
    parser.add_argument("--tmpdir", type=Path, help="where to build the data (default: system)")
    sizes = parser.add_argument_group("sizes (defaults: the full run; --quick shrinks them)")
    for name, value in asdict(defaults).items():
        sizes.add_argument(
            "--" + name.replace("_", "-"), type=type(value), default=None, help=f"(full: {value})"
        )
    parser.add_argument("--child-scale", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0, even when targets are missed)."""
    args = _parser().parse_args(argv)
    if args.child_scale is not None:
        rounds = args.resume_rounds if args.resume_rounds is not None else 3
        print(json.dumps(scale_child(args.child_scale, rounds)))
        return 0
    sizes = Sizes.quick() if args.quick else Sizes()
    for name in asdict(sizes):
        value = getattr(args, name)
        if value is not None:
            setattr(sizes, name, value)
    only = SCENARIOS if not args.only else tuple(s.strip() for s in args.only.split(","))
    unknown = sorted(set(only) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    machine = _machine()
    root = Path(tempfile.mkdtemp(prefix="guideloom-bench-", dir=args.tmpdir))
    bench = Bench(root, sizes, log)
    log(f"guideloom_pipes benchmark in {root} ({'quick' if args.quick else 'full'})")
    try:
        steps: list[tuple[str, Callable[[], None]]] = [
            ("tokens-2048", lambda: bench.stream_scenario("tokens-2048", 2048, 8)),
            ("tokens-128", lambda: bench.stream_scenario("tokens-128", 128, 64)),
            ("meta", bench.meta_scenario),
            ("documents", bench.documents_scenario),
            ("slow-storage", bench.slow_scenario),
            ("shuffle", bench.shuffle_scenario),
            ("scale", bench.scale_scenario),
            ("train-loop", bench.train_loop_scenario),
        ]
        for name, step in steps:
            if name in only or (name == "scale" and "resume" in only):
                mark = time.perf_counter()
                step()
                bench.timings[name] = time.perf_counter() - mark
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    goals = targets(bench.rows, bench.extra)
    print(report(bench.rows, bench.extra, goals))
    total = time.perf_counter() - started
    print(
        f"\n{len(bench.rows)} rows in {total:.0f} s; load average {machine['loadavg_start']}"
        f" -> {machine['loadavg_end']} on {machine['cpus']} CPUs"
    )
    if args.json is not None:
        payload = {
            "mode": "quick" if args.quick else "full",
            "sizes": asdict(sizes),
            "machine": machine,
            "seconds": total,
            "timings": bench.timings,
            "scenarios": _by_scenario(bench.rows, bench.extra),
            "targets": [{**asdict(goal), "passed": goal.passed} for goal in goals],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


def _by_scenario(rows: list[Row], extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        entry = out.setdefault(row.scenario, {"rows": []})
        if row.baseline:
            entry["baseline"] = row.contender
        entry["rows"].append(asdict(row))
    for name, figures in extra.items():
        out[name] = figures
    return out


if __name__ == "__main__":
    sys.exit(main())
