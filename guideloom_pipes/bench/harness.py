"""The measuring harness: run sizes, clocks, contenders' rounds and ``measure``.

``measure`` warms each contender up, runs them in alternating rounds on wall and CPU clocks
(child processes included) and sums each up as a ``Row``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

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
    #: the scale-shards scenario's shard counts, and the largest opened without a manifest
    scale_shard_counts: str = "1000,10000,100000,1000000"
    scale_listing_max: int = 100_000
    shuffle_block: int = 8192
    rounds: int = 5
    round_seconds: float = 1.0
    warmup_seconds: float = 0.5
    train_steps: int = 300
    resume_rounds: int = 5
    #: the remote-range scenario's dataset (its cold first batch): 1 GiB
    remote_bytes: int = 2**30
    #: documents of the megatron-open scenario's corpus
    megatron_documents: int = 10_000_000
    #: text documents (50-400 words) the convert-dask scenario tokenizes
    convert_documents: int = 40_000

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            tokens=2_000_000,
            meta_tokens=300_000,
            documents=1500,
            slow_tokens=1_000_000,
            remote_bytes=2**26,
            megatron_documents=20_000,
            scale_shard_counts="1000,3000",
            convert_documents=2_000,
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


def process_table() -> tuple[dict[int, list[int]], dict[int, int]]:
    """Every live process's children, and its CPU clock ticks (utime, stime, cutime,
    cstime), from ``/proc`` (Linux; nothing elsewhere)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children, ticks
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
    return children, ticks


def descendants(pid: int, children: dict[int, list[int]]) -> list[int]:
    """The descendants of ``pid`` in ``children`` (from :func:`process_table`)."""
    found, stack = [], list(children.get(pid, ()))
    while stack:
        here = stack.pop()
        found.append(here)
        stack.extend(children.get(here, ()))
    return found


def _descendant_cpu() -> float:
    """CPU seconds of this process's live descendants (Linux ``/proc``; 0 elsewhere)."""
    children, ticks = process_table()
    return sum(ticks.get(pid, 0) for pid in descendants(os.getpid(), children)) / _TICKS


def _reaped_children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _Clock:
    """Accumulates wall time, this process's CPU time and its children's CPU time."""

    def __init__(self) -> None:
        self.wall = self.cpu = self.children = 0.0
        self._marks: tuple[float, float, float] | None = None

    def start(self) -> None:
        # (the wall clock last: reading /proc for the children's CPU takes a millisecond or
        # more, which is not the round's)
        children = _descendant_cpu() + _reaped_children_cpu()
        cpu = time.process_time()
        self._marks = (time.perf_counter(), cpu, children)

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
