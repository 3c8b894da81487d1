""":class:`StreamReader`, the reader of a stream storage: spans of the stream across
shards (wrapping past the end), and batches of equal-length windows copied row by
row, gathered a shard at a time, or copied by numpy, as the constants below decide.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.storage.base import ReaderBase
from guideloom_pipes.storage.errors import CorruptShardError
from guideloom_pipes.storage.names import IN_BAND, shard_name
from guideloom_pipes.storage.recycle import BufferPool
from guideloom_pipes.storage.shard_listing import FileSizes, ShardListing
from guideloom_pipes.storage.stream_checks import _checked_out, as_indexes, check_read_size
from guideloom_pipes.storage.window_grid import WindowGrid, searchable
from guideloom_pipes.types import StreamStorageSyncReaderAbstract

if TYPE_CHECKING:
    from guideloom_pipes.storage.stream import StreamStorage

#: Batches of at least this many windows, each shorter than ``_ROW_BYTES``, are gathered a
#: shard at a time (one numpy call each); others are copied a window at a time by
#: ``memoryview`` slices (:meth:`StreamReader._copy_rows`). Measured, in microseconds per
#: window of 4-byte tokens, gathered / row by row: 64 windows of 128 tokens 0.70 / 0.35,
#: of 2048 1.35 / 0.91; 16 of 2048 2.9 / 1.0; 512 of 2048 0.94 / 0.96; 512 of 128
#: 0.19 / 0.36; 256 of 32 0.20 / 0.28; 4096 of 16 0.11 / 0.39. (A loader's windows, at
#: multiples of their length, take :class:`WindowGrid`'s gather instead from ``_FEW_ROWS``
#: short ones on: 64 of 128 in about half the time of their row copies.)
_GATHER_ROWS = 128
#: ... and fewer windows than this always.
_FEW_ROWS = 16
#: Windows of at least this many bytes are copied row by row however many there are (a
#: row's copy runs at memory speed; a gather is no faster and costs its index arrays)...
_ROW_BYTES = 4096
#: ... up to this many bytes in all: a row copy holds the GIL (numpy's large copies let other
#: threads run, also while a cold page of the mapping is read from disk). Beyond it, 128 or
#: more windows are gathered a shard at a time, fewer copied by numpy one window at a time.
_ROWS_AT_MOST = 1 << 20
#: The unsigned integer dtype of each element size: windows are gathered through it.
_GATHER_DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


class StreamReader(ReaderBase, StreamStorageSyncReaderAbstract[Any]):
    """Reads spans of the concatenated stream; see :meth:`read`."""

    storage: StreamStorage

    def _record_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.storage.format.stream_dtype)

    def _dtype_hint(self, dtype: np.dtype[Any]) -> str:
        fields = dtype.descr if dtype.names else dtype.str
        return (
            f"StreamNumpyFormat(np.dtype({fields!r}))"
            if dtype.names
            else f"stream_dtype {fields!r}"
        )

    def _element_dtype(self) -> np.dtype[Any]:
        """The dtype of one element of the in-band file."""
        return np.dtype(self.storage.format.stream_dtype)

    def _setup(self, listing: ShardListing, sizes: FileSizes) -> None:
        self.dtype = self._element_dtype()
        itemsize = self.dtype.itemsize
        lengths = _whole_elements(sizes.column(IN_BAND), self.dtype, self.storage.dir)
        self._lengths = lengths
        self._starts = np.zeros(listing.num_shards + 1, dtype=np.int64)
        np.cumsum(lengths, out=self._starts[1:])
        self._total = int(self._starts[-1])
        # shard bounds as the row copies' bisect searches them
        self._bounds: Any = searchable(self._starts, listing.num_shards)
        self._in_band = self._files[IN_BAND]
        # windows gathered through an unsigned integer view of the element's size, if any
        self._gather = _GATHER_DTYPES.get(itemsize)
        # copies go through an opaque dtype of the element's size, where numpy's structured
        # copy walks field by field (1.7x slower for one field, more for several): that
        # unsigned integer where there is one (numpy copies it faster than a void), else a
        # void of that size
        self._raw = self._gather if self._gather is not None else np.dtype((np.void, itemsize))
        # per shard used: its mapped _raw array, False for a byte-range backend (dicts of the
        # shards touched, not lists of every shard: 8 MB a list for a million shards)
        self._mapped: dict[int, np.ndarray | bool] = {}
        # per shard mapped: the bytes of its mapped array (the row copies of a few windows: a
        # memoryview slice assignment costs a third of numpy's per row)
        self._bytes: dict[int, memoryview] = {}
        self._views: dict[int, dict[int, np.ndarray]] = {}  # length -> shard -> view
        # per window length: the windows at its multiples as rows of each shard's mapping
        self._grids: dict[int, WindowGrid] = {}
        # the arrays of the windows read, reused once no batch refers to them (see recycle)
        self._pool = BufferPool()
        # a shard let go for others to be mapped (past the kernel's share of mappings for
        # this kind: see ShardFiles) is dropped from every cache above
        self._in_band.on_release(self._forget_shard)

    def _forget_shard(self, shard: int) -> None:
        """Drop what this reader keeps of shard ``shard``'s mapping (ShardFiles.on_release)."""
        self._mapped.pop(shard, None)
        self._bytes.pop(shard, None)
        for grid in list(self._grids.values()):
            grid.forget(shard)
        for views in list(self._views.values()):
            views.pop(shard, None)

    def _seal_args(self, shard: int) -> dict[str, Any]:
        return {"count": int(self._lengths[shard]), "dtype": self._record_dtype()}

    @property
    def total_length(self) -> int:
        """Elements in the whole stream."""
        self._check_open()
        return self._total

    def length(self, shard: int) -> int:
        """Elements in shard ``shard``."""
        shard = self._check_shard(check_int("shard", shard))
        return int(self._lengths[shard])

    @property
    def shard_starts(self) -> np.ndarray:
        """Global index of each shard's first element (``num_shards + 1`` values)."""
        self._check_open()
        return self._starts

    def _mapped_array(self, shard: int) -> np.ndarray | None:
        """Shard ``shard``'s elements as a mapped ``_raw`` array, or None for a byte-range
        backend."""
        mapped = self._mapped.get(shard)
        if mapped is None:
            array = self._in_band.array(shard, self._raw)
            mapped = self._mapped[shard] = array if array is not None else False
            if array is not None:
                self._bytes[shard] = array.data.cast("B")
        return mapped if isinstance(mapped, np.ndarray) else None

    def close(self) -> None:
        """Release every mapping and descriptor. Samples already returned stay valid."""
        self._mapped = {}
        self._bytes = {}
        self._views = {}
        self._grids = {}
        pool = getattr(self, "_pool", None)  # (None: never opened)
        if pool is not None:
            pool.clear()
        super().close()

    def _copy(self, shard: int, local: int, count: int, out: np.ndarray) -> None:
        mapped = self._mapped_array(shard)
        if mapped is not None:
            out[:] = mapped[local : local + count]
            return
        # a byte-range backend reads straight into ``out`` (contiguous: a row or a slice)
        itemsize = self.dtype.itemsize
        got = self._in_band.readinto(shard, local * itemsize, out.data.cast("B"))
        if got != count * itemsize:
            raise self._short_read(shard, got, count * itemsize)

    def read_raw(
        self, global_index: int, global_length: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The span as a fresh array, with ``shard_lengths`` and ``shards`` of its pieces
        (int64 vectors)."""
        self._check_open()
        global_index = check_int("global_index", global_index)
        global_length = check_int("global_length", global_length)
        if global_length < 0:
            raise IndexError(f"global_length must be >= 0, got {global_length}")
        check_read_size(global_length, self.dtype.itemsize, f"global_length {global_length}")
        if not 0 <= global_index < self._total:
            raise IndexError(
                f"global_index {global_index} out of range for a stream of {self._total} elements"
            )
        out = np.empty(global_length, dtype=self._raw)
        shard_lengths: list[int] = []
        shards: list[int] = []
        position, filled, starts = global_index, 0, self._starts
        while filled < global_length:
            shard = int(np.searchsorted(starts, position, side="right")) - 1
            local = position - int(starts[shard])
            take = min(global_length - filled, int(starts[shard + 1]) - position)
            self._copy(shard, local, take, out[filled : filled + take])
            shard_lengths.append(take)
            shards.append(shard)
            filled += take
            position += take
            if position == self._total:
                position = 0  # wrap around to shard 0
        return (
            out.view(self.dtype),
            np.array(shard_lengths, dtype=np.int64),
            np.array(shards, dtype=np.int64),
        )

    def read(self, global_index: int, global_length: int) -> Any:
        """``format.unpack(stream, shard_lengths, shards)`` of ``global_length`` elements
        from ``global_index``: ``stream`` is a fresh array, ``shard_lengths[i]`` (int64)
        elements of it came from shard ``shards[i]`` (int64).

        The span may cross shards and wraps to shard 0 past the end (as often as needed).
        ``global_index`` outside ``[0, total_length)`` or a negative length: ``IndexError``.
        """
        stream, shard_lengths, shards = self.read_raw(global_index, global_length)
        return self.storage.format.unpack(stream, shard_lengths, shards)

    def read_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Equal-length spans as one fresh ``(len(starts), length)`` array (the batch path).

        Every span must lie inside the stream (no wrap-around); spans may cross shards.
        """
        self._check_open()
        length = check_int("length", length)
        if length < 0:
            raise IndexError(f"window length must be >= 0, got {length}")
        total = self._total

        def outside(bad: int) -> IndexError:
            valid = (
                f"windows of {length} start at 0..{total - length}"
                if length <= total
                else f"a window of {length} is longer than the stream"
            )
            return IndexError(
                f"window [{bad}, {bad + length}) is outside the stream of {total} elements "
                f"({valid})"
            )

        starts = as_indexes(starts, max(total - length + 1, 0), "window starts", outside)
        check_read_size(
            len(starts) * length, self.dtype.itemsize, f"{len(starts)} windows of {length}"
        )
        return self._windows(starts, length)

    def _windows(
        self,
        starts: np.ndarray,
        length: int,
        buffers: Callable[[tuple[int, int], np.dtype[Any]], np.ndarray] | None = None,
        recycle: bool = False,
    ) -> np.ndarray:
        """:meth:`read_windows` of int64 ``starts`` already checked to lie inside the stream.

        ``buffers(shape, dtype)``, if given, returns the array the windows are copied into
        (a C-contiguous ``(len(starts), length)`` array of the element's opaque ``dtype``,
        e.g. a pinned host buffer); the result is then a view of it. By default a fresh
        array; with ``recycle``, one of the reader's :class:`BufferPool` (for batches of one
        shape read again and again: a loader's batches of columns)."""
        shape = (len(starts), length)
        if buffers is None:
            out = self._pool.take(shape, self._raw) if recycle else np.empty(shape, self._raw)
        else:
            out = _checked_out(buffers(shape, self._raw), shape, self._raw)
        if len(starts) == 0:
            return out.view(self.dtype)
        if self._by_rows(len(starts), length) and self._copy_rows(out, starts.tolist(), length):
            return out.view(self.dtype)
        first = np.searchsorted(self._starts, starts, side="right") - 1
        last = np.searchsorted(self._starts, starts + (length - 1), side="right") - 1
        local = starts - self._starts[first]
        if self._mapped_array(int(first[0])) is None:
            _read_rows(self, out, starts, first, last, local, length)
            return out.view(self.dtype)
        if first[0] == last[-1] and bool((first == last).all()) and bool((first == first[0]).all()):
            # all in one shard (one shard, or a small batch): one gather, one copy per token
            view = self._window_view(int(first[0]), length)
            if view is not None:
                rows_out = out.view(self._gather) if self._gather is not None else out
                # (fancy indexing: np.take would first copy the strided view, the whole shard)
                rows_out[...] = view[local]
                return out.view(self.dtype)
        if len(starts) >= _GATHER_ROWS:
            self._gather_rows(out, starts, first, last, local, length)
            return out.view(self.dtype)
        maps = self._mapped
        for row, (shard, end_shard, offset) in enumerate(
            zip(first.tolist(), last.tolist(), local.tolist())
        ):
            if shard != end_shard:
                self._copy_across(out[row], int(starts[row]), shard, length)
                continue
            mapped: np.ndarray | bool | None
            try:
                mapped = maps[shard]
            except KeyError:
                mapped = self._mapped_array(shard)
            if isinstance(mapped, np.ndarray):
                out[row] = mapped[offset : offset + length]
            else:
                self._copy(shard, offset, length, out[row])
        return out.view(self.dtype)

    def _few_windows(
        self, numbers: np.ndarray, length: int, dtype: np.dtype[Any] | None = None
    ) -> np.ndarray | None:
        """Windows ``[n * length, (n + 1) * length)`` for the ``numbers`` (a non-empty 1-D
        integer array) as a recycled ``(len(numbers), length)`` array, where their shards
        are mapped: a few, or long ones, copied row by row; many short ones gathered a shard
        at a time (:class:`WindowGrid`). Else None (then :meth:`_windows` reads them), also
        where a number is not a window of the stream (the caller's general read names it).
        The array is of ``dtype`` (one as wide as the element: a column's own), by default
        the opaque ``_raw``."""
        count = len(numbers)
        raw = self._raw if dtype is None else dtype
        if _on_grid(count, length * self.dtype.itemsize, self._gather):
            assert self._gather is not None
            windows = self._grids.get(length)
            if windows is None:
                grid = WindowGrid(self._starts, length, self._mapped_array, self._gather)
                windows = self._grids[length] = grid
            take = self._pool.take
            numbers = numbers.astype(np.int64, copy=False)
            return windows.gather(numbers, lambda shape: take(shape, raw), self._copy_across)
        if count >= _FEW_ROWS and not self._by_rows(count, length):
            return None
        listed = numbers.tolist()
        if min(listed) < 0 or max(listed) >= self._total // length:
            return None
        out = self._pool.take((count, length), raw)
        return out if self._copy_rows(out, listed, length, length) else None

    def _by_rows(self, count: int, length: int) -> bool:
        """Whether ``count`` windows of ``length`` are copied row by row (see
        ``_GATHER_ROWS``) rather than gathered a shard at a time: always a handful of them."""
        if count < _FEW_ROWS:
            return True
        width = length * self.dtype.itemsize
        return count * width <= _ROWS_AT_MOST and (count < _GATHER_ROWS or width >= _ROW_BYTES)

    def _copy_rows(self, out: np.ndarray, starts: list[int], length: int, scale: int = 1) -> bool:
        """Windows of mapped shards starting at ``starts[r] * scale``, each copied into row
        ``r`` of ``out`` (C-contiguous) by a ``memoryview`` slice assignment, shards found
        with ``bisect`` on Python ints: for a handful of windows, numpy's calls cost more
        than the copies. False where a shard is not mapped (rows before it may be written)."""
        bounds, views, find = self._bounds, self._bytes, bisect.bisect_right
        size = self.dtype.itemsize
        width = length * size
        rows = out.data.cast("B")
        begin = 0
        for start in starts:
            start *= scale
            shard = find(bounds, start) - 1
            try:
                view = views[shard]
            except KeyError:  # (a subscript: faster than get() where it is found)
                mapped = self._mapped_array(shard)
                if mapped is None:
                    return False
                view = mapped.data.cast("B")  # (no lookup: another thread may let it go)
            if start + length <= bounds[shard + 1]:
                offset = (start - bounds[shard]) * size
                rows[begin : begin + width] = view[offset : offset + width]
            else:
                self._copy_across(out[begin // width].view(self._raw), start, shard, length)
            begin += width
        return True

    def _window_view(self, shard: int, length: int) -> np.ndarray | None:
        """Every window of ``length`` elements inside shard ``shard`` as rows of a read-only
        strided view of its mapping (in an unsigned integer dtype of the element's size where
        there is one, whose copies numpy does fastest), or None for a byte-range backend or a
        shard shorter than ``length``. Fancy-indexing its rows copies windows straight into
        a fresh ``(B, length)`` array. Kept per (shard, length) until the reader closes."""
        views = self._views.get(length)
        if views is None:
            views = self._views[length] = {}
        view = views.get(shard)
        if view is None:
            mapped = self._mapped_array(shard)
            if mapped is None or len(mapped) < length:
                return None
            flat = mapped.view(self._gather) if self._gather is not None else mapped
            view = views[shard] = np.lib.stride_tricks.sliding_window_view(flat, length)
        return view

    def _gather_rows(
        self,
        out: np.ndarray,
        starts: np.ndarray,
        first: np.ndarray,
        last: np.ndarray,
        local: np.ndarray,
        length: int,
    ) -> None:
        """Windows of mapped shards into the rows of ``out``: one gather per shard, so a
        batch of many short windows costs a few numpy calls, not one per window."""
        inside = first == last
        rows_out = out.view(self._gather) if self._gather is not None else out
        for shard in np.unique(first[inside]).tolist():
            rows = np.flatnonzero(inside & (first == shard))
            view = self._window_view(shard, length)
            if view is None:
                for row in rows.tolist():
                    self._copy(shard, int(local[row]), length, out[row])
            else:
                rows_out[rows] = view[local[rows]]
        for row in np.flatnonzero(~inside).tolist():
            self._copy_across(out[row], int(starts[row]), int(first[row]), length)

    def _short_read(self, shard: int, got: int, expected: int) -> CorruptShardError:
        return CorruptShardError(
            f"{self._shard_path(shard, IN_BAND)} returned {got} bytes where {expected} were "
            f"expected: the file shrank while open"
        )

    def _copy_across(self, out: np.ndarray, start: int, shard: int, length: int) -> None:
        """The window of ``length`` elements at ``start``, which begins in ``shard`` and ends
        in a later one, into ``out``."""
        shard_starts = self._starts
        filled, position = 0, start
        while filled < length:
            take = min(length - filled, int(shard_starts[shard + 1]) - position)
            self._copy(
                shard, position - int(shard_starts[shard]), take, out[filled : filled + take]
            )
            filled += take
            position += take
            shard += 1

    def window_pieces(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``shard_lengths`` and ``shards`` (int64 vectors) of a span inside the stream, as
        ``unpack`` gets them."""
        if length <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        starts = self._starts
        first = int(np.searchsorted(starts, start, side="right")) - 1
        end = start + length
        if end <= starts[first + 1]:  # the usual case: one shard
            return np.array([length], dtype=np.int64), np.array([first], dtype=np.int64)
        last = int(np.searchsorted(starts, end - 1, side="right")) - 1
        bounds = starts[first : last + 2].copy()
        bounds[0], bounds[-1] = start, end
        lengths = np.diff(bounds)
        shards = np.arange(first, last + 1, dtype=np.int64)
        keep = lengths > 0  # empty shards inside the span hold none of it
        return lengths[keep], shards[keep]


def _whole_elements(in_band: np.ndarray, dtype: np.dtype[Any], directory: Any) -> np.ndarray:
    """Elements of ``dtype`` per shard of ``in_band`` bytes (CorruptShardError if ragged)."""
    itemsize = dtype.itemsize
    ragged = np.flatnonzero(in_band % itemsize)
    if len(ragged):
        shard, size = int(ragged[0]), int(in_band[ragged[0]])
        raise CorruptShardError(
            f"{shard_name(shard)}{IN_BAND} in {directory} is {size} bytes, not a multiple of "
            f"the {itemsize}-byte element of {dtype}: it is truncated or was written with "
            f"another dtype. Rewrite shard {shard}"
        )
    return in_band // itemsize


def _read_rows(
    reader: StreamReader,
    out: np.ndarray,
    starts: np.ndarray,
    first: np.ndarray,
    last: np.ndarray,
    local: np.ndarray,
    length: int,
) -> None:
    """Windows of a byte-range backend: each read straight into its row of ``out``.

    With many threads reading from slow storage, this loop's time under the GIL bounds
    how many reads run at once, so it keeps to one call per window.
    """
    size = length * reader.dtype.itemsize
    rows = out.data.cast("B")  # out is C-contiguous: row r is rows[r*size:(r+1)*size]
    readinto = reader._in_band.readinto
    begin = 0
    for row, (shard, end_shard, offset) in enumerate(
        zip(first.tolist(), last.tolist(), (local * reader.dtype.itemsize).tolist())
    ):
        if shard != end_shard:
            reader._copy_across(out[row], int(starts[row]), shard, length)
        else:
            got = readinto(shard, offset, rows[begin : begin + size])
            if got != size:
                raise reader._short_read(shard, got, size)
        begin += size


def _on_grid(count: int, width: int, gather: np.dtype[Any] | None) -> bool:
    """Whether ``count`` windows of ``width`` bytes at multiples of their length are gathered
    a shard at a time (:class:`WindowGrid`, through the unsigned ``gather`` dtype) rather
    than copied row by row: many short ones."""
    return count >= _FEW_ROWS and width < _ROW_BYTES and gather is not None
