"""The *numpy gather*: the bare floor of a batch of short windows (issue 31).

Our loader's epoch order (the epoch's Feistel permutation of the samples), precomputed with
where every window lies; then each batch is what numpy alone costs: the windows of each
shard gathered by ``np.take`` from a C-contiguous ``(windows, L)`` view of its ``np.memmap``
into a scratch array, then taken in the batch's order into one preallocated ``(B, L)``
buffer. Every batch is the same tensor, refilled, holding exactly the batch our loader
delivers with ``shuffle=True`` and the same seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from guideloom_pipes.bench.contenders import _shard_paths
from guideloom_pipes.shuffle import FeistelPermutation
from guideloom_pipes.storage import StreamStorage

__all__ = ["NUMPY_GATHER", "NumpyGather"]

#: Its row name.
NUMPY_GATHER = "numpy gather"


class NumpyGather:
    """Batches of ``batch`` windows of ``length`` tokens in our loader's shuffled order (epoch
    0, ``seed``), each gathered shard by shard with one ``np.take`` into a preallocated
    buffer, where every window lies worked out before the loop (see the module)."""

    def __init__(self, storage: StreamStorage, length: int, batch: int, seed: int) -> None:
        paths = _shard_paths(storage, ".in_band.bin")
        maps = [np.memmap(path, dtype=np.uint32, mode="r").view(np.ndarray) for path in paths]
        starts = np.concatenate([[0], np.cumsum([len(m) for m in maps])]).astype(np.int64)
        self.length, self.batch = length, batch
        self.samples = int(starts[-1]) // length
        self.steps = self.samples // batch
        # window numbers: the first starting in each shard, the end of those inside it
        firsts = -(-starts // length)
        ends = starts[1:] // length
        grids = []
        for shard, mapped in enumerate(maps):
            begin = int(firsts[shard]) * length - int(starts[shard])
            rows = max(int(ends[shard] - firsts[shard]), 0)
            grids.append(mapped[begin : begin + rows * length].reshape(rows, length))
        self.flat, self.starts = maps, starts
        ids = FeistelPermutation.for_epoch(self.samples, seed, 0)(
            np.arange(self.steps * batch, dtype=np.int64)
        ).reshape(self.steps, batch)
        shards = np.searchsorted(firsts[:-1], ids, side="right") - 1
        # each batch's windows sorted by shard (stably), and where each shard's run ends
        order = np.argsort(shards, axis=1, kind="stable")
        #: per batch: where each row of the sorted batch goes (taken by the inverse order)
        self.inverse = np.argsort(order, axis=1)
        shards = np.take_along_axis(shards, order, axis=1)
        ordered = np.take_along_axis(ids, order, axis=1)
        positions = ordered - firsts[shards]
        inside = ordered < ends[shards]
        self.plan: list[list[tuple[np.ndarray, np.ndarray, slice]]] = []
        #: per batch: (row of the sorted batch, window number) of windows crossing shards
        self.across: dict[int, list[tuple[int, int]]] = {}
        for step in range(self.steps):
            pieces = []
            here = shards[step]
            for shard in np.unique(here).tolist():
                cut = np.flatnonzero((here == shard) & inside[step])
                if len(cut):
                    span = slice(int(cut[0]), int(cut[-1]) + 1)
                    pieces.append((grids[shard], positions[step, span], span))
            self.plan.append(pieces)
            for row in np.flatnonzero(~inside[step]).tolist():
                self.across.setdefault(step, []).append((row, int(ordered[step, row])))

    def _window(self, number: int) -> np.ndarray:
        """Window ``number``, which crosses shards, concatenated from its pieces."""
        start, end = number * self.length, (number + 1) * self.length
        pieces = []
        for shard, mapped in enumerate(self.flat):
            low, high = max(start, int(self.starts[shard])), min(end, int(self.starts[shard + 1]))
            if low < high:
                pieces.append(
                    mapped[low - int(self.starts[shard]) : high - int(self.starts[shard])]
                )
        return np.concatenate(pieces)

    def __iter__(self) -> Iterator[torch.Tensor]:
        out = np.empty((self.batch, self.length), dtype=np.uint32)
        scratch = np.empty_like(out)
        tensor = torch.from_numpy(out.view(np.int32))
        across = self.across
        for step, pieces in enumerate(self.plan):
            for grid, rows, span in pieces:
                grid.take(rows, 0, scratch[span], "clip")
            if step in across:
                for row, number in across[step]:
                    scratch[row] = self._window(number)
            scratch.take(self.inverse[step], 0, out, "clip")
            yield tensor

    def batches(self) -> Iterator[Any]:
        """Copies of the batches (for a test comparing them with the loader's)."""
        for batch in self:
            yield batch.clone()
