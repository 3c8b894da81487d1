""":class:`MetaWindows`: a batch of stream-with-metadata windows prepared at once by
:meth:`~guideloom_pipes.storage.stream_meta.StreamWithMetaReader.prepare_windows`
(arrays and one copy of the payloads' bytes) and decoded a range of rows at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from guideloom_pipes.storage.errors import StorageError
from guideloom_pipes.storage.payloads import RunPayloads

if TYPE_CHECKING:
    from guideloom_pipes.storage.stream_meta import StreamWithMetaReader


class MetaWindows:
    """A read of stream-with-metadata windows, prepared for the whole read at once
    (:meth:`StreamWithMetaReader.prepare_windows`) and decoded a range of rows at a time.

    It holds arrays and one copy of the payloads' bytes; :meth:`decode` makes the samples
    of rows ``begin .. end - 1``: their payloads' memoryviews and one ``unpack`` per row.
    """

    __slots__ = (
        "_document_index",
        "_ends",
        "_low",
        "_payload_shards",
        "_payloads",
        "_position",
        "_reader",
        "_runs",
        "_starts",
        "_stream",
        "_windows",
    )

    def __init__(
        self,
        reader: StreamWithMetaReader,
        windows: np.ndarray,
        starts: np.ndarray,
        simple: np.ndarray,
    ) -> None:
        self._reader = reader
        self._windows = windows
        self._starts = starts
        # row -> its place among the rows decoded together (-1: decoded alone, by decode())
        position = np.full(len(simple), -1, dtype=np.int64)
        position[simple] = np.arange(int(np.count_nonzero(simple)), dtype=np.int64)
        self._position = position
        self._stream: np.ndarray | None = None
        self._document_index: np.ndarray | None = None
        self._payloads: RunPayloads | None = None
        self._payload_shards: np.ndarray | None = None
        self._low: np.ndarray | None = None
        self._runs: np.ndarray | None = None
        self._ends: list[int] = []

    def fill(
        self,
        *,
        stream: np.ndarray,
        document_index: np.ndarray,
        payloads: RunPayloads,
        payload_shards: np.ndarray,
        low: np.ndarray,
        runs: np.ndarray,
    ) -> None:
        """The shared work for the rows decoded together, in their order."""
        self._stream = stream
        self._document_index = document_index
        self._payloads = payloads
        self._payload_shards = payload_shards
        self._low = low
        self._runs = runs
        self._ends = [0, *np.cumsum(runs).tolist()]  # row k's payloads: ends[k] .. ends[k + 1]

    def __len__(self) -> int:
        return len(self._position)

    def decode(self, begin: int, end: int) -> list[Any]:
        """The samples of rows ``begin .. end - 1``, in order."""
        reader = self._reader
        positions = self._position[begin:end]
        if len(positions) == 0:
            return []
        out: list[Any] = []
        together = positions >= 0
        if not together.all():
            length = self._windows.shape[1]
            windows, starts = self._windows, self._starts
            for row, position in zip(range(begin, end), positions.tolist()):
                if position < 0:  # (an empty window's pieces: those of (0, 0))
                    pieces = reader.window_pieces(int(starts[row]) if length else 0, length)
                    out.append(reader.decode(windows[row], *pieces))
                else:
                    out += self._together(position, position + 1)
            return out
        return self._together(int(positions[0]), int(positions[-1]) + 1)

    def _together(self, first: int, stop: int) -> list[Any]:
        """``unpack`` of rows ``first .. stop - 1`` of those decoded together."""
        stream, document_index = self._stream, self._document_index
        payloads, shards = self._payloads, self._payload_shards
        assert stream is not None and document_index is not None
        assert payloads is not None and shards is not None
        ends = self._ends
        offset = ends[first]
        fetched = payloads.views(offset, ends[stop])
        unpack = self._reader.storage.format.unpack
        out: list[Any] = []
        begin = end = offset
        try:
            for k in range(first, stop):
                end = ends[k + 1]
                out.append(
                    unpack(
                        stream[k],
                        shards[begin:end],
                        document_index[k],
                        fetched[begin - offset : end - offset],
                    )
                )
                begin = end
        except StorageError:
            raise
        except Exception as error:
            assert self._low is not None and self._runs is not None
            row = len(out) + first
            locals_ = np.arange(int(self._low[row]), int(self._low[row] + self._runs[row]))
            raise self._reader._decode_failed(error, shards[begin:end], locals_) from error
        return out
