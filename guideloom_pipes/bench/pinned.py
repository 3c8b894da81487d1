"""The ``pinned-ring`` scenario: batches to a CUDA device, through our ring of pinned buffers
(windows read straight into pinned memory, no pinning copy), against a bare pinned ``copy_``
of the same bytes, our pinning copy (``PinMemory``) and torch's ``pin_memory=True``.

Every contender's batch is waited for on the clock (``torch.cuda.synchronize()`` when it is
counted), as a training step that uses it would: the figure is host-to-device throughput,
not how fast copies are queued. Without a CUDA device the scenario is skipped and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from guideloom_pipes.bench.contenders import MemmapWindows
from guideloom_pipes.bench.data import SEED, collate_tokens
from guideloom_pipes.bench.harness import Contender, Row, Sizes, measure
from guideloom_pipes.pipes.device import apply_to_tensors
from guideloom_pipes.storage import StreamStorage

#: Row names.
BARE_COPY = "bare pinned copy_ (same bytes, nothing read)"
RING_0 = "ours ring workers=0 prefetch=4, collate_fn=None"
RING_2 = "ours ring workers=2 threads prefetch=4, collate_fn=None"
RING_INLINE = "ours ring workers=0 prefetch=0 (inline), collate_fn=None"
PIN_COPY_0 = "ours PinMemory copy workers=0 prefetch=4, default_collate"
TORCH_PIN_2 = "torch DataLoader workers=2 pin_memory=True"
#: The scenario's windows: 64 x 2048 int32 tokens, 512 KiB a batch.
LENGTH, BATCH = 2048, 64
SKIPPED = (
    "needs a CUDA device (torch.cuda.is_available() is False here): run "
    "`python -m guideloom_pipes.bench --only pinned-ring` on a machine with a GPU"
)


def _device() -> torch.device:
    """The current CUDA device."""
    return torch.device("cuda", torch.cuda.current_device())


def _synced_count(length: int) -> Callable[[Any], tuple[int, int]]:
    """Count a batch's samples and tokens once its copy to the device has completed."""

    def count(batch: Any) -> tuple[int, int]:
        torch.cuda.synchronize()
        rows = int(batch["tokens"].shape[0]) if isinstance(batch, dict) else int(batch.shape[0])
        return rows, rows * length

    return count


class BareCopy:
    """The bound: one pinned host batch of the same bytes copied to the device per batch
    (``copy_``, ``non_blocking``), nothing read, nothing allocated."""

    def __init__(self, batches: int, device: torch.device) -> None:
        self.batches = batches
        pinned = device.type == "cuda"
        self.host = torch.zeros((BATCH, LENGTH), dtype=torch.int32, pin_memory=pinned)
        self.target = torch.empty((BATCH, LENGTH), dtype=torch.int32, device=device)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.batches):
            yield self.target.copy_(self.host, non_blocking=True)


def _pin_copy_collate() -> Callable[[Any], Any]:
    """``default_collate`` under another name: the loader then pins by a copy (PinMemory),
    as it does for any collate of ours but ``default_collate``."""
    from guideloom_pipes.batch import batch_arrays
    from guideloom_pipes.pipes.collate import default_collate

    @batch_arrays
    def collate(samples: Any) -> Any:
        return default_collate(samples)

    return collate


def pinned_ring_rows(
    tokens: Callable[[], StreamStorage],
    sizes: Sizes,
    log: Callable[[str], None],
    extra: dict[str, Any],
) -> list[Row]:
    """The scenario's rows over the bench's token stream (``tokens()`` builds it once),
    or none, with ``extra["pinned-ring"]["skipped"]``, without a CUDA device."""
    if not torch.cuda.is_available():
        extra["pinned-ring"] = {"skipped": SKIPPED}
        log(f"  pinned-ring   skipped: {SKIPPED}")
        return []
    storage = tokens()
    from guideloom_pipes.loader import StatefulDataLoader
    from guideloom_pipes.loader.orders import batches_ahead

    device = _device()
    count = _synced_count(LENGTH)
    rings: dict[str, Any] = {}  # what each loader's ring held at the end

    def finish(name: str, loader: Any) -> None:
        ring = loader._ring
        rings[name] = (
            None
            if ring is None
            else {"size": ring.size, "allocated": ring.allocated, **ring.counts}
        )
        loader.close()

    def ours(name: str, collate: Any, **options: Any) -> Contender:
        loader = StatefulDataLoader.from_storage(
            storage,
            collate,
            sequence_length=LENGTH,
            local_batch_size=BATCH,
            shuffle=True,
            shuffle_seed=SEED,
            device=device,
            pin_memory=True,
            **options,
        )
        return Contender(
            name,
            lambda: iter(loader),
            count,
            setup=loader.open,
            teardown=lambda: finish(name, loader),
            ahead=batches_ahead(loader),
        )

    torch_loader = torch.utils.data.DataLoader(
        MemmapWindows(storage, LENGTH),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        collate_fn=collate_tokens,
        drop_last=True,
        pin_memory=True,
        generator=torch.Generator().manual_seed(SEED),
    )

    def torch_batches() -> Iterator[Any]:
        for batch in torch_loader:
            yield apply_to_tensors(batch, lambda t: t.to(device, non_blocking=True))

    with storage.sync_reader() as reader:
        batches = max(reader.total_length // (LENGTH * BATCH), 1)
    bare = BareCopy(batches, device)
    contenders = [
        Contender(BARE_COPY, lambda: iter(bare), count),
        ours(RING_0, None, num_workers=0, prefetch=4),
        ours(RING_2, None, num_workers=2, prefetch=4),
        ours(RING_INLINE, None, num_workers=0, prefetch=0),
        ours(PIN_COPY_0, _pin_copy_collate(), num_workers=0, prefetch=4),
        Contender(TORCH_PIN_2, torch_batches, count, ahead=4),
    ]
    rows = measure("pinned-ring", contenders, sizes, log)
    extra["pinned-ring"] = {
        "batch_bytes": BATCH * LENGTH * np.dtype(np.int32).itemsize,
        "device": torch.cuda.get_device_name(device),
        "rings": rings,
    }
    log(f"  pinned-ring   rings: {rings}")
    return rows
