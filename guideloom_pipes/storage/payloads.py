"""Payloads behind an offset index (``.out_of_band.bin`` and ``.out_of_band.index``), as
documents and stream-with-metadata records keep them: written (:class:`PayloadLog`),
counted from the index sizes, and read one at a time or a batch of runs together
(:class:`OffsetIndex`: one gather and check of the offsets, one copy of the bytes,
sliced on demand by :class:`RunPayloads`).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any, cast

import numpy as np

from guideloom_pipes.storage.base import ReaderBase
from guideloom_pipes.storage.commit import _CountingFile
from guideloom_pipes.storage.errors import CorruptShardError
from guideloom_pipes.storage.names import IN_BAND, INDEX, OUT_OF_BAND
from guideloom_pipes.storage.shard_listing import FileSizes

INDEX_DTYPE = np.dtype("<i8")
#: Runs that :meth:`OffsetIndex.run_views` reads one by one rather than all at once.
_FEW_RUNS = 16


def check_payload(payload: Any, what: str) -> memoryview:
    """``payload`` as a byte view if it is ``bytes``/``bytearray``/``memoryview``."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"{what} must return bytes or memoryview, got {type(payload).__name__}; encode the "
            f"document to bytes in pack"
        )
    return memoryview(payload).cast("B")


class PayloadLog:
    """Appends byte payloads to an ``.out_of_band.bin`` file and keeps their offsets."""

    def __init__(self, data: _CountingFile) -> None:
        self.data = data
        self.offsets: list[int] = [0]

    def append(self, payload: memoryview) -> None:
        self.data.write(payload)
        self.offsets.append(self.data.size)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def write_index(self, index: _CountingFile) -> None:
        index.write(np.asarray(self.offsets, dtype=INDEX_DTYPE))


class OffsetIndex:
    """Reads byte ranges of documents through shard index files (opened lazily)."""

    def __init__(self, reader: ReaderBase, counts: np.ndarray, bin_sizes: np.ndarray) -> None:
        self._index = reader._files[INDEX]
        self._data = reader._files[OUT_OF_BAND]
        self._reader = reader
        self._bin_sizes = bin_sizes
        self._counts = counts
        self._checked: set[int] = set()

    def _offsets(self, shard: int, local: int, count: int) -> np.ndarray:
        mapped = self._index.array(shard, INDEX_DTYPE)
        if mapped is not None:
            offsets = mapped[local : local + count + 1]
        else:
            raw = self._index.read(shard, local * 8, (count + 1) * 8)
            offsets = np.frombuffer(raw, dtype=INDEX_DTYPE)
        if shard not in self._checked:
            self._check(shard)
        return offsets

    def _check(self, shard: int) -> None:
        # GuideLoom files carry no record: check the index against the data file once.
        mapped = self._index.array(shard, INDEX_DTYPE)
        if mapped is not None:
            first, last = int(mapped[0]), int(mapped[-1])
        else:
            count = int(self._counts[shard])
            first = int(np.frombuffer(self._index.read(shard, 0, 8), dtype=INDEX_DTYPE)[0])
            last = int(np.frombuffer(self._index.read(shard, count * 8, 8), dtype=INDEX_DTYPE)[0])
        if first != 0 or last != self._bin_sizes[shard]:
            path = self._reader._shard_path(shard, INDEX)
            raise CorruptShardError(
                f"{path} does not match its data file: offsets run from {first} to {last}, but "
                f"the data file holds {self._bin_sizes[shard]} bytes (truncated or mixed "
                f"files). Rewrite shard {shard}"
            )
        self._checked.add(shard)

    def span(self, shard: int, local: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of document ``local`` of ``shard``."""
        offsets = self._offsets(shard, local, 1)
        return int(offsets[0]), int(offsets[1])

    def payload(self, shard: int, local: int) -> bytearray:
        """The bytes of document ``local`` of ``shard`` (a fresh copy the caller owns)."""
        if not 0 <= local < self._counts[shard]:
            raise CorruptShardError(
                f"{self._reader._shard_path(shard, IN_BAND)} has a record pointing at payload "
                f"{local}, but {self._reader._shard_path(shard, INDEX)} has "
                f"{int(self._counts[shard])} entries (0..{int(self._counts[shard]) - 1}): one "
                f"of the files is corrupt. Rewrite shard {shard}"
            )
        start, end = self.span(shard, local)
        size = self._bin_sizes[shard]
        if not 0 <= start <= end <= size:
            problem = (
                "decreasing offsets"
                if 0 <= start <= size and 0 <= end <= size
                else f"offsets outside the {size}-byte data file"
            )
            raise CorruptShardError(
                f"{self._reader._shard_path(shard, INDEX)} has {problem} at document {local} "
                f"([{start}, {end})); rewrite shard {shard}"
            )
        mapped = self._data.array(shard, np.dtype("u1"))
        if mapped is not None:
            return bytearray(mapped[start:end])
        data = self._data.read(shard, start, end - start)
        if self._data.owned_reads and type(data) is bytearray:
            return data  # our backends' reads are fresh copies already
        return bytearray(data)  # a custom backend may hand out a view of its own memory

    def payload_views(self, shard: int, locals_: np.ndarray) -> list[memoryview]:
        """The bytes of documents ``locals_`` of ``shard``, as memoryviews of fresh copies
        (valid after the reader closes).

        When the files are mapped: one gather of their offsets, and one copy per run of
        payloads whose bytes follow each other in the file (the payloads of one stream
        window, typically), which their memoryviews share. Otherwise one :meth:`payload`
        call each.
        """
        index = self._index.array(shard, INDEX_DTYPE)
        data = self._data.array(shard, np.dtype("u1"))
        if index is None or data is None or len(locals_) == 0:
            return [memoryview(self.payload(shard, local)) for local in locals_.tolist()]
        if shard not in self._checked:
            self._check(shard)
        count = int(self._counts[shard])
        if int(locals_.min()) < 0 or int(locals_.max()) >= count:
            bad = int(locals_[(locals_ < 0) | (locals_ >= count)][0])
            return [memoryview(self.payload(shard, bad))]  # raises, naming the entry
        starts, ends = index[locals_], index[locals_ + 1]
        if (ends < starts).any() or int(starts.min()) < 0 or int(ends.max()) > data.size:
            bad = int(locals_[(ends < starts) | (starts < 0) | (ends > data.size)][0])
            return [memoryview(self.payload(shard, bad))]  # raises, naming the entry
        cuts = (np.flatnonzero(starts[1:] != ends[:-1]) + 1).tolist()
        first, last = starts.tolist(), ends.tolist()
        view = memoryview(data.data)  # slicing a memoryview costs a third of slicing the array
        out: list[memoryview] = []
        for begin, end in zip([0, *cuts], [*cuts, len(first)]):
            base = first[begin]
            block = memoryview(bytearray(view[base : last[end - 1]]))
            out += [block[a - base : b - base] for a, b in zip(first[begin:end], last[begin:end])]
        return out

    def _mapped(self, shard: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Shard ``shard``'s offsets and bytes as mapped arrays (checked once), or None when
        the backend does not map files."""
        index = self._index.array(shard, INDEX_DTYPE)
        data = self._data.array(shard, np.dtype("u1"))
        if index is None or data is None:
            return None
        if shard not in self._checked:
            self._check(shard)
        return index, data

    def run_views(
        self, shards: np.ndarray, firsts: np.ndarray, counts: np.ndarray
    ) -> list[memoryview]:
        """The payloads of runs: run ``r`` is payloads ``firsts[r] .. firsts[r] + counts[r]
        - 1`` of shard ``shards[r]`` (``counts[r] >= 1``), whose bytes follow each other in
        the data file (what one stream window touches). All of them, run after run, as
        memoryviews into one fresh copy of the runs' bytes (valid after the reader closes).

        When the files are mapped the work is done for all runs at once: one gather of
        their offsets per shard, one check of them, the bytes copied with one ``join``
        (a piece per run), one slice per payload. Otherwise :meth:`payload_views` per run.
        """
        runs = self.run_payloads(shards, firsts, counts)
        return runs.views(0, len(runs))

    def run_payloads(
        self, shards: np.ndarray, firsts: np.ndarray, counts: np.ndarray
    ) -> RunPayloads:
        """:meth:`run_views` without the slices: the runs' bytes read, checked and copied,
        each payload's ``memoryview`` made only when :meth:`RunPayloads.views` asks for it
        (a memoryview is an object the garbage collector tracks; bytes and offsets are
        not, so a large read held for a while costs the collector nothing until sliced).
        """
        shards = np.asarray(shards, dtype=np.int64)
        firsts = np.asarray(firsts, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        if len(shards) == 0:
            return RunPayloads(views=[])
        one = bool(shards[0] == shards[-1]) and bool((shards == shards[0]).all())
        distinct: list[int] = [int(shards[0])] if one else np.unique(shards).tolist()
        files = [self._mapped(shard) for shard in distinct]
        if any(f is None for f in files):
            out: list[memoryview] = []
            for shard, first, count in zip(shards.tolist(), firsts.tolist(), counts.tolist()):
                out += self.payload_views(shard, np.arange(first, first + count, dtype=np.int64))
            return RunPayloads(views=out)
        mapped = cast("list[tuple[np.ndarray, np.ndarray]]", files)
        if len(shards) <= _FEW_RUNS:
            return RunPayloads(views=self._few_run_views(shards, firsts, counts, distinct, mapped))
        available = self._counts[shards]
        outside = (firsts < 0) | (firsts + counts > available)
        if outside.any():
            bad = int(np.flatnonzero(outside)[0])
            local = int(firsts[bad]) if firsts[bad] < 0 else int(firsts[bad] + counts[bad] - 1)
            self.payload(int(shards[bad]), local)  # raises, naming the entry
        # run r's offsets (index[firsts[r] : firsts[r] + counts[r] + 1]), runs back to back
        widths = counts + 1
        ends = np.cumsum(widths)
        begins = ends - widths
        places = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(begins - firsts, widths)
        if one:
            offsets = mapped[0][0][places]
            sizes = np.full(len(shards), mapped[0][1].size, dtype=np.int64)
        else:
            offsets = np.empty(len(places), dtype=INDEX_DTYPE)
            sizes = np.empty(len(shards), dtype=np.int64)
            for shard, (index, data) in zip(distinct, mapped):
                rows = shards == shard
                where = np.repeat(rows, widths)
                offsets[where] = index[places[where]]
                sizes[rows] = data.size
        low, high = offsets[begins], offsets[ends - 1]
        decreasing = offsets[1:] < offsets[:-1]
        decreasing[ends[:-1] - 1] = False  # from one run to the next: no order
        if decreasing.any() or int(low.min()) < 0 or bool((high > sizes).any()):
            self._raise_for_runs(shards, firsts, counts)
        views = [memoryview(data.data) for _, data in mapped]
        which = [0] * len(shards) if one else np.searchsorted(distinct, shards).tolist()
        block = bytearray().join(
            [views[w][a:b] for w, a, b in zip(which, low.tolist(), high.tolist())]
        )
        # each run's bytes start in ``block`` where the earlier runs' bytes end
        lengths = high - low
        relative = offsets + np.repeat(np.cumsum(lengths) - lengths - low, widths)
        not_last = np.ones(len(relative), dtype=bool)
        not_last[ends - 1] = False
        not_first = np.ones(len(relative), dtype=bool)
        not_first[begins] = False
        return RunPayloads(
            block=block, starts=relative[not_last].tolist(), ends=relative[not_first].tolist()
        )

    def _few_run_views(
        self,
        shards: np.ndarray,
        firsts: np.ndarray,
        counts: np.ndarray,
        distinct: list[int],
        mapped: list[tuple[np.ndarray, np.ndarray]],
    ) -> list[memoryview]:
        """:meth:`run_views` of a few runs, one run at a time: a handful of numpy calls per
        run cost less than the dozens of the vectorised path."""
        files = dict(zip(distinct, mapped))
        out: list[memoryview] = []
        for shard, first, count in zip(shards.tolist(), firsts.tolist(), counts.tolist()):
            index, data = files[shard]
            if first < 0 or first + count > self._counts[shard]:
                self.payload(shard, first if first < 0 else first + count - 1)  # raises
            offsets = index[first : first + count + 1].tolist()
            base, end = offsets[0], offsets[-1]
            if base < 0 or end > data.size or sorted(offsets) != offsets:
                self._raise_for_runs(np.array([shard]), np.array([first]), np.array([count]))
            block = memoryview(bytearray(memoryview(data.data)[base:end]))
            out += [block[a - base : b - base] for a, b in pairwise(offsets)]
        return out

    def _raise_for_runs(self, shards: np.ndarray, firsts: np.ndarray, counts: np.ndarray) -> None:
        """Raise the error of the first payload of the runs whose offsets are bad."""
        for shard, first, count in zip(shards.tolist(), firsts.tolist(), counts.tolist()):
            for local in range(first, first + count):
                self.payload(shard, local)  # raises for a bad entry
        raise AssertionError("bad offsets that payload() accepts")  # pragma: no cover


class RunPayloads:
    """The payloads of one :meth:`OffsetIndex.run_payloads` read, sliced on demand.

    Either the views themselves (small reads, files that are not mapped), or one copy of
    the runs' bytes with each payload's start and end in it: payload ``j`` is
    ``block[starts[j]:ends[j]]``, a ``memoryview`` made by :meth:`views`.
    """

    __slots__ = ("_block", "_ends", "_starts", "_views")

    def __init__(
        self,
        *,
        views: list[memoryview] | None = None,
        block: bytearray | None = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
    ) -> None:
        self._views = views
        self._block = memoryview(block) if block is not None else None
        self._starts = starts if starts is not None else []
        self._ends = ends if ends is not None else []

    def __len__(self) -> int:
        return len(self._views) if self._views is not None else len(self._starts)

    def views(self, begin: int, end: int) -> list[memoryview]:
        """Payloads ``begin .. end - 1`` as memoryviews of the copy."""
        if self._views is not None:
            return self._views[begin:end]
        block = self._block
        assert block is not None
        return [block[a:b] for a, b in zip(self._starts[begin:end], self._ends[begin:end])]


def index_counts(reader: ReaderBase, sizes: FileSizes) -> np.ndarray:
    """Entries per shard from index-file sizes (``size // 8 - 1``), checking the sizes."""
    index = sizes.column(INDEX)
    bad = np.flatnonzero((index < 8) | (index % 8 != 0))
    if len(bad):
        shard = int(bad[0])
        raise CorruptShardError(
            f"{reader._shard_path(shard, INDEX)} is {int(index[shard])} bytes; an index holds "
            f"n + 1 int64 offsets (a multiple of 8, at least 8). Rewrite shard {shard}"
        )
    return index // 8 - 1
