"""What a run of :func:`~guideloom_pipes.parallel.write_parallel` tells: its
:class:`WriteReport`, and :class:`WriteParallelError` when items failed."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Any

from guideloom_pipes.storage.names import shard_name

__all__ = ["WriteParallelError", "WriteReport"]


@dataclass
class WriteReport:
    """What :func:`write_parallel` did."""

    #: shard ids written (converted and committed) in this run
    written: list[int] = field(default_factory=list)
    #: shard ids skipped: committed by an earlier run from the same item
    skipped: list[int] = field(default_factory=list)
    #: shard ids whose item failed (left uncommitted: their earlier version, if any, stays)
    failed: list[int] = field(default_factory=list)
    #: shard ids at or above ``len(items)`` removed (``mode="overwrite"``)
    removed: list[int] = field(default_factory=list)
    #: shard ids never started because the run stopped early (the executor broke)
    not_run: list[int] = field(default_factory=list)
    #: records appended, over the shards written
    records: int = 0
    #: bytes of the files written
    bytes: int = 0
    #: wall-clock seconds
    seconds: float = 0.0

    def __str__(self) -> str:
        return (
            f"{len(self.written)} shards written, {len(self.skipped)} skipped (unchanged), "
            f"{len(self.failed)} failed"
            + (f", {len(self.removed)} removed (above the items)" if self.removed else "")
            + (f", {len(self.not_run)} not started" if self.not_run else "")
            + f"; {self.records} records, {self.bytes} bytes in {self.seconds:.2f} s"
        )


class WriteParallelError(RuntimeError):
    """Items failed in :func:`write_parallel`; every other item was written, but for those
    in ``report.not_run`` when a process pool broke (a worker died mid-item).

    Attributes:
        failures: ``(index, item, exception)`` of each failed item, by index.
        report: the :class:`WriteReport` of the run.
    """

    def __init__(self, failures: list[tuple[int, Any, BaseException]], report: WriteReport):
        self.failures = failures
        self.report = report
        lines = [
            f"item {index} ({_short(item)}): {type(error).__name__}: {error}"
            for index, item, error in failures
        ]
        broken = [index for index, _, error in failures if isinstance(error, cf.BrokenExecutor)]
        why = ""
        if broken:
            shown = ", ".join(map(str, broken[:10])) + (", ..." if len(broken) > 10 else "")
            why = (
                f" The executor broke while items {shown} were in flight: a worker process "
                f"ended abruptly while running one of them (killed by a signal, e.g. by the "
                f"out-of-memory killer, or os._exit in convert), and the pool failed every "
                f"item it held (a rerun skips any shard a worker committed as the pool "
                f"stopped)."
            )
        if report.not_run:
            why += (
                f" {len(report.not_run)} item(s) were not started (from shard "
                f"{shard_name(report.not_run[0])})."
            )
        others = "every item finished before was written" if why else "every other item was written"
        super().__init__(
            f"{len(failures)} of the items failed in write_parallel; their shards "
            f"({', '.join(shard_name(i) for i, _, _ in failures[:10])}"
            f"{', ...' if len(failures) > 10 else ''}) were not committed, {others} "
            f"({report}).{why} Fix them and run the same call again: the shards already "
            f"committed are skipped"
            + (
                " (with a new executor if it was yours: a broken pool takes no more work)"
                if broken
                else ""
            )
            + ".\n"
            + "\n".join(lines)
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failures, self.report))


def _short(value: Any, limit: int = 80) -> str:
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
