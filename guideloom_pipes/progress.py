"""Progress display for the tools (``write_parallel``, ``guideloom-pipes verify``) and the
corpora's one-time scans: a tqdm bar when tqdm is installed (an optional dependency), else a
plain log line every few seconds and one at the end. Standard library only (it sits below
every layer that shows progress)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["AUTO_BYTES", "Progress", "human_bytes", "show_progress"]

#: Work of at least this many bytes shows progress where ``progress=None`` (auto) is given:
#: a scan of a corpus's files, ``guideloom-pipes verify --progress auto``.
AUTO_BYTES = 64 << 20


def human_bytes(size: float) -> str:
    """``size`` bytes as a short human string (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def show_progress(progress: bool | None, size: int) -> bool:
    """Whether to show the progress of work over ``size`` bytes: ``progress`` where it is
    True or False, and with None (auto) for work of :data:`AUTO_BYTES` and more."""
    if progress is None:
        return size >= AUTO_BYTES
    if not isinstance(progress, bool):
        raise TypeError(
            f"progress must be True (show it), False (never) or None (for work of "
            f"{human_bytes(AUTO_BYTES)} and more), got {progress!r}"
        )
    return progress


class Progress:
    """Counts work done and shows it: a tqdm bar, or plain lines.

    Args:
        description: what is being done (``"writing"``, ``"verifying"``).
        total: the amount of work (in ``unit``), None if unknown.
        unit: ``"items"`` or ``"B"`` (bytes: shown scaled).
        enabled: False shows nothing.
        stream: where to write (default ``sys.stderr``).
        use_tqdm: None uses tqdm when it can be imported; False never does.
        interval: seconds between plain lines.
    """

    def __init__(
        self,
        description: str,
        total: int | None,
        unit: str = "items",
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        use_tqdm: bool | None = None,
        interval: float = 5.0,
    ) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.done = 0
        self.extra: dict[str, int] = {}
        self._bar: Any = None
        self._last = time.monotonic()
        self._started = self._last
        if enabled and use_tqdm is not False:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                if use_tqdm:
                    raise
            else:
                self._bar = tqdm(
                    total=total,
                    desc=description,
                    unit=unit,
                    unit_scale=unit == "B",
                    unit_divisor=1024,
                    file=self.stream,
                )

    def update(self, amount: int = 1, **extra: int) -> None:
        """Add ``amount`` of work done; ``extra`` counters (``records=...``) are added to
        their running totals and shown beside it."""
        self.done += amount
        for key, value in extra.items():
            self.extra[key] = self.extra.get(key, 0) + value
        if not self.enabled:
            return
        if self._bar is not None:
            if extra or self.extra:
                self._bar.set_postfix_str(self._extras(), refresh=False)
            self._bar.update(amount)
            return
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._line()

    def _extras(self) -> str:
        return ", ".join(
            f"{key} {human_bytes(value) if key == 'bytes' else value}"
            for key, value in self.extra.items()
        )

    def _amount(self, value: int) -> str:
        return human_bytes(value) if self.unit == "B" else f"{value} {self.unit}"

    def _line(self, final: bool = False) -> None:
        shown = self._amount(self.done)
        if self.total is not None:
            shown += f" of {self._amount(self.total)}"
            if self.total:
                shown += f" ({100 * self.done / self.total:.0f}%)"
        elapsed = time.monotonic() - self._started
        extras = self._extras()
        tail = f", {extras}" if extras else ""
        rate = ""
        if final and self.unit == "B" and elapsed > 0:
            rate = f", {human_bytes(self.done / elapsed)}/s"
        done = " done" if final else ""
        print(
            f"{self.description}{done}: {shown}{tail} in {elapsed:.1f} s{rate}",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        """Finish the display (the bar closes; a last plain line says the totals)."""
        if not self.enabled:
            return
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.close()
            return
        self._line(final=True)
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
