"""The scenarios: ``Bench`` builds each one's data and contenders, and measures them.

The scale and resume figures come from a subprocess (see ``scale``); the train loop times
``next()`` around a simulated training step.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from guideloom_pipes.bench.contenders import (
    BLEND,
    COPY_LIMIT,
    CPU,
    FIXED_IN_ORDER,
    OURS_0,
    OURS_0_ARRAYS,
    OURS_0_PAD,
    OURS_2,
    OURS_2_ARRAYS,
    OURS_2_PAD,
    OURS_2P,
    OURS_2P_PAD,
    OURS_INLINE_ARRAYS,
    PACKED,
    PLAIN,
    SCHEDULED,
    SINGLE,
    SLOW_PREAD,
    CopyLimit,
    HandLoop,
    MemmapDocuments,
    MemmapMetaWindows,
    MemmapWindows,
    ParallelCeiling,
    SlowIO,
    _ours_contender,
    _ours_dataset_contender,
    _slow_name,
    _slow_prefetch,
    _torch_contender,
    dataset_row,
)
from guideloom_pipes.bench.data import (
    SEED,
    TOKENS_DTYPE,
    _count_pad_collate,
    _count_padded,
    _count_tokens,
    build_documents,
    build_eos_tokens,
    build_meta,
    build_sparse,
    build_tokens,
    collate_meta,
    collate_pad,
    collate_tokens,
)
from guideloom_pipes.bench.gather import NUMPY_GATHER, NumpyGather
from guideloom_pipes.bench.harness import Contender, Row, Sizes, _close_iterator, measure
from guideloom_pipes.datasets import StreamDataset
from guideloom_pipes.formats import StreamNumpyFormat
from guideloom_pipes.storage import DocumentStorage, StreamStorage

SCENARIOS = (
    "tokens-2048",
    "tokens-128",
    "meta",
    "documents",
    "slow-storage",
    "shuffle",
    "scale",
    "resume",
    "scale-shards",
    "first-batch",
    "train-loop",
    "mixture",
    "packed",
    "packed-fit",
    "parallel-write",
    "remote-cache",
    "remote-range",
    "remote-s3",
    "shard-order",
    "pinned-ring",
    "dataloader-tokens",
    "dataloader-documents",
    "dataloader-iterable",
    "dataloader-memory",
    "megatron-windows",
    "megatron-open",
    "convert-dask",
    "parquet-documents",
)
#: What the train-loop scenario's rows read (its ``data`` field).
TOKENS, DOCUMENTS = "tokens", "documents"
#: The train-loop scenario's documents rows, and their batch.
TRAIN_DOCUMENTS_OURS = {
    "thread": "ours workers=2 threads prefetch=2",
    "process": "ours workers=2 processes prefetch=2",
}
TRAIN_DOCUMENTS_TORCH = {
    0: "torch DataLoader workers=0",
    2: "torch DataLoader workers=2 prefetch_factor=2",
}
DOCUMENTS_BATCH = 32
#: The end-of-document token of the packed scenario's stream.
PACKED_EOS = 0


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
    _documents: DocumentStorage | None = None

    def tokens(self) -> StreamStorage:
        if self._tokens is None:
            started = time.perf_counter()
            self._tokens = build_tokens(self.root / "tokens", self.sizes.tokens, self.sizes.shards)
            self.timings["build tokens"] = time.perf_counter() - started
        return self._tokens

    def documents(self) -> DocumentStorage:
        if self._documents is None:
            started = time.perf_counter()
            self._documents, _ = build_documents(
                self.root / "documents", self.sizes.documents, self.sizes.shards
            )
            self.timings["build documents"] = time.perf_counter() - started
        return self._documents

    def stream_scenario(self, name: str, length: int, batch: int) -> None:
        storage = self.tokens()
        count = _count_tokens(length)
        hand = HandLoop(storage, length, batch, SEED)
        stream = {"sequence_length": length, "local_batch_size": batch}
        limit = CopyLimit(storage, length, batch, SEED)
        gather = NumpyGather(storage, length, batch, SEED)
        contenders = [
            Contender("hand loop", lambda: iter(hand), count),
            Contender(COPY_LIMIT, lambda: iter(limit), count),
            Contender(NUMPY_GATHER, lambda: iter(gather), count),
            _ours_contender(
                OURS_0_ARRAYS, storage, None, count, num_workers=0, prefetch=4, **stream
            ),
            _ours_contender(
                OURS_2_ARRAYS, storage, None, count, num_workers=2, prefetch=4, **stream
            ),
            _ours_contender(
                OURS_INLINE_ARRAYS, storage, None, count, num_workers=0, prefetch=0, **stream
            ),
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
        from guideloom_pipes.pipes.collate import pad_collate

        storage = self.documents()
        batch = DOCUMENTS_BATCH
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
            _ours_contender(
                OURS_0_PAD, storage, pad_collate, _count_pad_collate, num_workers=0, **common
            ),
            _ours_contender(
                OURS_2_PAD,
                storage,
                pad_collate,
                _count_pad_collate,
                num_workers=2,
                parallel_method="thread",
                **common,
            ),
            _ours_contender(
                OURS_2P_PAD,
                storage,
                pad_collate,
                _count_pad_collate,
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
            # what two cores give torch's workers=0 loop in the same rounds: the processes
            # rows' room on this machine at this minute
            ParallelCeiling(
                MemmapDocuments(storage), collate_pad, _count_padded, batch
            ).contender(),
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

    def shard_order_scenario(self) -> None:
        """``order="shards"`` (whole shards per rank, a buffer of 256 windows) against the
        global order, on the local token stream and with 1 ms added to every read. Reported,
        no target: the shard order trades the global shuffle for a read per shard."""
        storage = self.tokens()
        slow = StreamStorage(storage.dir, StreamNumpyFormat(TOKENS_DTYPE), SlowIO(0.001))
        count = _count_tokens(2048)
        common = {"sequence_length": 2048, "local_batch_size": 8, "prefetch": 4}
        shards = {"order": "shards", "shuffle_buffer": 256}
        contenders = [
            _ours_contender("global order workers=0", storage, collate_tokens, count, **common),
            _ours_contender(
                "shards order workers=0", storage, collate_tokens, count, **common, **shards
            ),
            _ours_contender(
                "shards order workers=2 threads",
                storage,
                collate_tokens,
                count,
                num_workers=2,
                **common,
                **shards,
            ),
            _ours_contender(
                "global order workers=8 threads, 1 ms per read",
                slow,
                collate_tokens,
                count,
                num_workers=8,
                **common,
            ),
            _ours_contender(
                "shards order workers=2 threads, 1 ms per read",
                slow,
                collate_tokens,
                count,
                num_workers=2,
                **common,
                **shards,
            ),
        ]
        self.rows += measure("shard-order", contenders, self.sizes, self.log)

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

    def mixture_scenario(self) -> None:
        """A blend of three token streams (L=2048, batch 8, shuffled) against the single
        stream of the same total size."""
        from guideloom_pipes.mixture import MixtureDataset
        from guideloom_pipes.mixture_weights import WeightSchedule

        started = time.perf_counter()
        names = ("web", "code", "books")
        parts = [
            build_tokens(self.root / f"mix-{name}", self.sizes.tokens // 3, self.sizes.shards)
            for name in names
        ]
        self.timings["build mixture"] = time.perf_counter() - started
        length, batch = 2048, 8
        count = _count_tokens(length)
        single = StreamDataset(self.tokens(), length)
        blend = MixtureDataset(
            {name: StreamDataset(part, length) for name, part in zip(names, parts)},
            {"web": 0.5, "code": 0.3, "books": 0.2},
            seed=SEED,
        )
        contenders: list[Contender] = []

        def add(pairs: tuple[tuple[str, Any], ...], **options: Any) -> None:
            for workers in (0, 2):
                for kind, dataset in pairs:
                    contenders.append(
                        _ours_dataset_contender(
                            dataset_row(kind, workers),
                            dataset,
                            collate_tokens,
                            count,
                            local_batch_size=batch,
                            num_workers=workers,
                            parallel_method="thread",
                            prefetch=4,
                            **options,
                        )
                    )

        add(((SINGLE, single), (BLEND, blend)))
        # issue 30: a weight schedule costs no throughput. Both blends in order (a schedule
        # needs shuffle=False), the schedule a linear ramp over the first half of the
        # positions (the rounds read there: a piece every few hundred positions)
        windows = {name: StreamDataset(part, length) for name, part in zip(names, parts)}
        total = sum(len(window) for window in windows.values())
        fixed = MixtureDataset(
            windows, {"web": 0.5, "code": 0.3, "books": 0.2}, seed=SEED, num_samples=total
        )
        ramp = WeightSchedule(
            [
                (0, {"web": 0.8, "code": 0.1, "books": 0.1}),
                (total // 2, {"web": 0.2, "code": 0.5, "books": 0.3}),
            ],
            interpolation="linear",
        )
        scheduled = MixtureDataset(windows, ramp, seed=SEED, num_samples=total)
        add(((FIXED_IN_ORDER, fixed), (SCHEDULED, scheduled)), shuffle=False)
        self.rows += measure("mixture", contenders, self.sizes, self.log)

    def packed_scenario(self) -> None:
        """Packed windows with document boundaries (a stream whose documents average 1,000
        tokens; L=2048, batch 8, shuffled, ``collate_packed``) against plain windows of the
        same stream (``collate_tokens``)."""
        from guideloom_pipes.packing import PackedDataset
        from guideloom_pipes.pipes.packed import collate_packed

        started = time.perf_counter()
        storage = build_eos_tokens(
            self.root / "packed", self.sizes.tokens, self.sizes.shards, PACKED_EOS, 1000
        )
        self.timings["build packed"] = time.perf_counter() - started
        length, batch = 2048, 8
        count = _count_tokens(length)
        kinds = (
            (PLAIN, StreamDataset(storage, length), collate_tokens),
            (PACKED, PackedDataset(storage, length, eos_token=PACKED_EOS), collate_packed),
        )
        contenders = [
            _ours_dataset_contender(
                dataset_row(kind, workers),
                dataset,
                collate,
                count,
                local_batch_size=batch,
                num_workers=workers,
                parallel_method="thread",
                prefetch=4,
            )
            for workers in (0, 2)
            for kind, dataset, collate in kinds
        ]
        self.rows += measure("packed", contenders, self.sizes, self.log)

    def packed_fit_scenario(self) -> None:
        """Best-fit packing against cut-and-concatenate on documents of log-normal lengths:
        padding and documents split, and the speed through the loader (``bench/fitting.py``)."""
        from guideloom_pipes.bench.fitting import packed_fit_rows

        self.rows += packed_fit_rows(self.root, self.sizes, self.log, self.extra)

    def parallel_write_scenario(self) -> None:
        """``write_parallel`` of a CPU-bound conversion: 2 worker processes against 1, on a
        process pool and on a Dask LocalCluster (see ``bench/writing.py``)."""
        from guideloom_pipes.bench.writing import parallel_write_rows

        self.rows += parallel_write_rows(self.root / "parallel-write", self.sizes, self.log)

    def remote_cache_scenario(self) -> None:
        """The token stream through the shard cache over HTTP (nginx), second epoch,
        against its local directory (see ``bench/remote.py``)."""
        from guideloom_pipes.bench.remote import remote_cache_rows

        self.rows += remote_cache_rows(self.tokens(), self.root, self.sizes, self.log, self.extra)

    def remote_range_scenario(self) -> None:
        """Range reads over HTTP with 20 ms added per request, 1 thread worker against 32;
        a cold first batch. See ``bench/remote.py``."""
        from guideloom_pipes.bench.remote import remote_range_rows

        self.rows += remote_range_rows(
            self.root, self.sizes, self.log, self.extra, self.sizes.remote_bytes
        )

    def pinned_ring_scenario(self) -> None:
        """Batches to a CUDA device through our ring of pinned buffers, against a bare
        pinned ``copy_`` of the same bytes (skipped without CUDA). See ``bench/pinned.py``."""
        from guideloom_pipes.bench.pinned import pinned_ring_rows

        self.rows += pinned_ring_rows(self.tokens, self.sizes, self.log, self.extra)

    def remote_s3_scenario(self) -> None:
        """Range reads from S3 (moto's server), 1 thread worker against 8, with the CPU per
        request. See ``bench/remote.py``."""
        from guideloom_pipes.bench.remote import remote_s3_rows

        self.rows += remote_s3_rows(
            self.root, self.sizes, self.log, self.extra, min(self.sizes.remote_bytes, 2**25)
        )

    def dataloader_scenario(self, name: str) -> None:
        """``guideloom_pipes.DataLoader`` against torch's, the same dataset and arguments
        (``bench/dataloader.py``)."""
        from guideloom_pipes.bench import dataloader

        if name == dataloader.TOKENS_SCENARIO:
            self.rows += dataloader.tokens_rows(self.tokens(), self.sizes, self.log)
        elif name == dataloader.DOCUMENTS_SCENARIO:
            self.rows += dataloader.documents_rows(self.documents(), self.sizes, self.log)
        elif name == dataloader.ITERABLE_SCENARIO:
            self.rows += dataloader.iterable_rows(self.documents(), self.sizes, self.log)
        else:
            directories = {"tokens": self.tokens().dir, "documents": self.documents().dir}
            self.extra[name] = dataloader.memory_figures(
                directories,  # type: ignore[arg-type]
                self.sizes,
                self.log,
            )

    def convert_scenario(self) -> None:
        """``convert`` of Parquet text on a Dask LocalCluster, 2 workers against 1; needs
        Dask, pyarrow and tokenizers (``bench/corpora_rows.py``)."""
        from guideloom_pipes.bench import corpora_rows

        reason = corpora_rows.missing_modules("dask.distributed", "pyarrow", "tokenizers")
        if reason is not None:
            self.log(f"  {corpora_rows.CONVERT_SCENARIO} skipped: {reason}")
            self.extra[corpora_rows.CONVERT_SCENARIO] = {"skipped": reason}
            return
        self.rows += corpora_rows.convert_rows(self.root, self.sizes, self.log)

    def parquet_scenario(self) -> None:
        """Shuffled documents of a Parquet table against our DocumentStorage; needs pyarrow
        (``bench/corpora_rows.py``)."""
        from guideloom_pipes.bench import corpora_rows

        reason = corpora_rows.missing_modules("pyarrow")
        if reason is not None:
            self.log(f"  {corpora_rows.PARQUET_SCENARIO} skipped: {reason}")
            self.extra[corpora_rows.PARQUET_SCENARIO] = {"skipped": reason}
            return
        self.rows += corpora_rows.parquet_rows(self.root, self.sizes, self.log)

    def megatron_scenario(self, name: str) -> None:
        """A Megatron corpus read in place (``bench/corpora.py``); needs megatron-core."""
        from guideloom_pipes.bench import corpora

        reason = corpora.skipped(self.log)
        if reason is not None:
            self.extra[name] = {"skipped": reason}
        elif name == corpora.WINDOWS_SCENARIO:
            self.rows += corpora.windows_rows(self.tokens(), self.root, self.sizes, self.log)
        else:
            self.extra[name] = corpora.open_figures(self.root, self.sizes, self.log)

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

    def scale_shards_scenario(self) -> None:
        from guideloom_pipes.bench.scale_shards import scale_shards_rows

        counts = tuple(int(c) for c in self.sizes.scale_shard_counts.split(","))
        self.extra["scale-shards"] = scale_shards_rows(
            self.root, counts, self.sizes.scale_listing_max, self.log
        )

    def first_batch_scenario(self) -> None:
        """Build + first batch in fresh processes, ours (new and resumed) against torch's
        ``DataLoader`` (``bench/first_batch.py``)."""
        from guideloom_pipes.bench import first_batch

        figures = first_batch.first_batch_figures(self.tokens(), self.sizes.resume_rounds, self.log)
        self.extra[first_batch.SCENARIO] = figures

    def train_loop_scenario(self) -> None:
        from guideloom_pipes.loader import StatefulDataLoader

        storage = self.tokens()
        length, batch, steps = 2048, 8, self.sizes.train_steps
        results = []
        configurations: list[tuple[str, str, Callable[[], Any]]] = [
            (
                TOKENS,
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
                TOKENS,
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
        # Documents: unpickling and the user's padding collate hold the GIL (~3-5 ms a
        # batch). In a tight loop threads cannot beat torch's workers=0 (the documents
        # scenario); in a training loop they read while the step waits.
        documents = self.documents()
        for method in ("thread", "process"):
            configurations.append(
                (
                    DOCUMENTS,
                    TRAIN_DOCUMENTS_OURS[method],
                    lambda method=method: StatefulDataLoader.from_storage(  # type: ignore[misc]
                        documents,
                        collate_pad,
                        local_batch_size=DOCUMENTS_BATCH,
                        num_workers=2,
                        parallel_method=method,
                        prefetch=2,
                        shuffle=True,
                        shuffle_seed=SEED,
                        device=CPU,
                    ),
                )
            )
        for workers in (0, 2):
            configurations.append(
                (
                    DOCUMENTS,
                    TRAIN_DOCUMENTS_TORCH[workers],
                    lambda workers=workers: torch.utils.data.DataLoader(  # type: ignore[misc]
                        MemmapDocuments(documents),
                        batch_size=DOCUMENTS_BATCH,
                        shuffle=True,
                        num_workers=workers,
                        prefetch_factor=2 if workers else None,
                        collate_fn=collate_pad,
                    ),
                )
            )
        for data, name, make in configurations:
            loader = make()
            with contextlib.ExitStack() as stack:
                if hasattr(loader, "__enter__"):
                    stack.enter_context(loader)
                figures = _train_loop(loader, steps)
            results.append({"data": data, "contender": name, **figures})
            self.log(
                f"  train-loop    {data:<9} {name:<44} waits {figures['wait_fraction']:.1%}, "
                f"{figures['next_cpu_ms_per_batch']:.3f} ms CPU in next() per batch, steps "
                f"{figures['slowdown']:.2f}x as long as alone"
            )
        self.extra["train-loop"] = {
            "step_s": STEP_S,
            "step_calls": STEP_CALLS,
            "steps": steps,
            "sequence_length": length,
            "batch": batch,
            "documents_batch": DOCUMENTS_BATCH,
            "rows": results,
        }


#: The simulated training step: 10 ms in 50 calls that let the GIL go, as a GPU step's
#: kernel launches and its wait do. Each call wants the GIL back when it returns, so a
#: reader thread holding it (unpickling, a user's collate in Python) delays the step: a
#: step of one long sleep would hide that cost.
STEP_S = 0.01
STEP_CALLS = 50


def _step(seconds: float = STEP_S, calls: int = STEP_CALLS) -> None:
    pause = seconds / calls
    for _ in range(calls):
        time.sleep(pause)


def _steps_alone(steps: int) -> float:
    """Seconds a step takes with no loader running (the sleeps overshoot a little)."""
    started = time.perf_counter()
    for _ in range(steps):
        _step()
    return (time.perf_counter() - started) / steps


def _train_loop(loader: Any, steps: int) -> dict[str, float]:
    """Run ``steps`` simulated training steps; how long and how much CPU ``next()`` took,
    and how much longer the loop's steps took than the same steps alone (timed just
    before)."""
    alone = _steps_alone(max(10, steps // 3))
    iterator = iter(loader)
    try:
        for _ in range(3):  # start-up: worker start and the first batches are not a steady state
            next(iterator)
            _step()
        waited = next_cpu = 0.0
        started = time.perf_counter()
        cpu_started = time.process_time()
        done = 0
        while done < steps:
            wall_mark, cpu_mark = time.perf_counter(), time.thread_time()
            try:
                batch = next(iterator)
            except StopIteration:
                _close_iterator(iterator)
                iterator = iter(loader)
                continue
            next_cpu += time.thread_time() - cpu_mark
            waited += time.perf_counter() - wall_mark
            done += 1
            _step()
            del batch  # (freed after the step, as the loop's next batch would free it)
        total = time.perf_counter() - started
        process_cpu = time.process_time() - cpu_started
    finally:
        _close_iterator(iterator)
    return {
        "wait_fraction": waited / total,
        "wait_ms_per_batch": waited / steps * 1e3,
        "next_cpu_ms_per_batch": next_cpu / steps * 1e3,
        "process_cpu_ms_per_batch": process_cpu / steps * 1e3,
        "step_alone_ms": alone * 1e3,
        "ms_per_step": total / steps * 1e3,
        "slowdown": total / steps / alone,
        "wall_s": total,
    }
