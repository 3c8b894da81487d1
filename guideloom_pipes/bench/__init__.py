"""Throughput benchmark: our loader against the hand-written limit and torch's ``DataLoader``.

Run ``python -m guideloom_pipes.bench`` (``--quick`` for tiny data in about a minute,
``--json PATH`` to keep the figures, ``--help`` for the sizes). It builds its own datasets in
a temporary directory, then for each scenario warms every contender up and measures them in
alternating rounds (A B C A B C ...), reporting the median round:

``tokens-2048`` / ``tokens-128``
    stream storage, shuffled, ``L=2048`` batch 8 / ``L=128`` batch 64; ours with 0 and 2
    thread workers against the *hand loop* (baseline: a precomputed permutation, each window
    copied out of per-shard ``np.memmap`` s, ``np.stack``, ``torch.from_numpy``) and
    ``torch.utils.data.DataLoader`` over a memmap-backed ``Dataset`` with 0 and 2 workers;
    and the *numpy gather* (issue 31): our loader's batches, where each window lies worked
    out before the loop, gathered by ``np.take`` a shard at a time into one preallocated
    ``(B, L)`` buffer (the floor of ``collate_fn=None``, whose rows are compared to it).
``meta``
    stream with metadata (a payload per chunk of about 100 tokens), ``L=2048`` batch 8.
``documents``
    pickled documents of 100-4000 token ids, batch 32, a padding collate; 2 workers as threads
    and as processes; and the *ceiling* of 2 processes each running torch's ``workers=0``
    loop and sending back only counts (what two cores give at that minute).
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
``scale-shards``
    datasets of 10^3 to 10^6 committed 1,000-token shards (sparse), opened in fresh processes
    without and with their manifest: open + first batch, resume + first batch, peak RSS above
    import, the open's file-system calls (``strace -c``), shuffled throughput at 10^6
    (``bench/scale_shards.py``; without a manifest only up to ``--scale-listing-max``).
``first-batch``
    each contender in a fresh process of its own, alternating: from building the storage and
    the loader (imports done) to the first batch of the tokens (shuffled, ``L=2048`` batch 8),
    ours with ``prefetch=4`` and without, the same resumed from a state saved mid-epoch by an
    earlier run, and torch's ``DataLoader(num_workers=0)``; median milliseconds (issue 31).
``train-loop``
    a training loop whose step is 50 calls that release the GIL over 10 ms (as a GPU step's
    kernel launches and wait do), ``prefetch=2``, over the tokens (``L=2048`` batch 8) and
    the documents (batch 32, the padding collate; ours with 2 threads and 2 processes,
    torch's ``DataLoader`` with 0 and 2 workers): the fraction of its time the training
    thread waits in ``next()``, its CPU time inside ``next()``, and how much longer its
    steps take than the same steps alone (a reader thread holding the GIL delays each call
    of the step that wants it back).
``mixture``
    a ``MixtureDataset`` of three token streams (weights 0.5/0.3/0.2, a third of the tokens
    each) against the single stream of the same size, ``L=2048`` batch 8, 0 and 2 threads;
    and, both read in order (``shuffle=False``), the blend with a ``WeightSchedule`` (a
    linear ramp over the first half of its positions) against the fixed-weight blend.
``packed``
    a ``PackedDataset`` of a stream whose documents average 1,000 tokens, with
    ``collate_packed``, against plain windows of the same stream, ``L=2048`` batch 8, 0 and 2
    threads.

Throughput rows give samples/s, tokens/s, CPU-seconds per million samples (this process's CPU
time across all its threads, plus that of its child processes: live ones read from ``/proc``,
reaped ones from ``RUSAGE_CHILDREN``) and the ratio to the scenario's baseline. Rates are
steady-state: starting the first iterator and its first batch are timed separately (``first
batch`` in the JSON), not inside a round; a new epoch's iterator starts inside the round, as it
does in training. The last table checks each target of issues 4 and 10 (PASS/MISS).
The benchmark needs only the runtime dependencies (numpy, torch, torchdata).
"""

from __future__ import annotations

from guideloom_pipes.bench.cli import main
from guideloom_pipes.bench.contenders import (
    CEILING_2P,
    CPU,
    OURS_0,
    OURS_2,
    OURS_2P,
    SLOW_PREAD,
    HandLoop,
    MemmapDocuments,
    MemmapMetaWindows,
    MemmapWindows,
    ParallelCeiling,
    SlowIO,
)
from guideloom_pipes.bench.data import (
    META_RECORD,
    SEED,
    TOKENS_DTYPE,
    ChunkMetaFormat,
    build_documents,
    build_meta,
    build_sparse,
    build_tokens,
    collate_meta,
    collate_pad,
    collate_tokens,
)
from guideloom_pipes.bench.harness import Contender, Round, Row, Sizes, measure
from guideloom_pipes.bench.reporting import Target, report, targets
from guideloom_pipes.bench.scale import scale_child
from guideloom_pipes.bench.scenarios import SCENARIOS, Bench

__all__ = [
    "Contender",
    "Round",
    "Row",
    "Sizes",
    "measure",
    "META_RECORD",
    "SEED",
    "TOKENS_DTYPE",
    "ChunkMetaFormat",
    "build_documents",
    "build_meta",
    "build_sparse",
    "build_tokens",
    "collate_meta",
    "collate_pad",
    "collate_tokens",
    "CPU",
    "CEILING_2P",
    "OURS_0",
    "OURS_2",
    "OURS_2P",
    "SLOW_PREAD",
    "HandLoop",
    "MemmapDocuments",
    "ParallelCeiling",
    "MemmapMetaWindows",
    "MemmapWindows",
    "SlowIO",
    "SCENARIOS",
    "Bench",
    "scale_child",
    "Target",
    "report",
    "targets",
    "main",
]
