"""What a :class:`~guideloom_pipes.StatefulDataLoader` holds open from one iterator to the
next: the dataset's reader, the worker processes, the ring of pinned buffers and the
small-object memory reserve (:class:`LoaderResources`). The loader is its only owner:
``loader.close()`` releases it all, and so does the loader's garbage collection (the
finalizers hang on this object, which nothing else references).
"""

from __future__ import annotations

import weakref
from typing import Any

from guideloom_pipes.datasets import open_reader, reader_fingerprint
from guideloom_pipes.loader.settings import LoaderSettings
from guideloom_pipes.pipes import PinnedRing
from guideloom_pipes.pipes.read import start_context
from guideloom_pipes.pipes.workers.process_main import hold_small_object_reserve
from guideloom_pipes.pipes.workers.processes import ProcessPool
from guideloom_pipes.pipes.workers.threads import after_orphaned_jobs


class LoaderResources:
    """The reader, worker processes, pinned ring and memory reserve of one loader."""

    def __init__(self) -> None:
        #: The dataset's open reader (None while closed), and whether it is ours to close.
        self.reader: Any = None
        self.owns_reader = False
        self.is_open = False
        #: The dataset's fingerprint when it was last opened (None: not yet, or the dataset
        #: cannot tell).
        self.fingerprint: dict[str, Any] | None = None
        #: The worker processes, one pool per loader (started at the first iter() that
        #: needs them, kept across iterators).
        self.pool: ProcessPool | None = None
        self._pool_finalizer: weakref.finalize[Any, Any] | None = None
        self._reserve: weakref.finalize[Any, Any] | None = None
        #: The pinned buffers batches are read into (pin_memory on a CUDA device), made by
        #: the first iterator that uses them and kept until close().
        self.ring: PinnedRing | None = None

    def open(self, dataset: Any, settings: LoaderSettings) -> None:
        """Open the dataset's reader; a dataset of fewer samples than a global batch is a
        ``ValueError`` saying what to change."""
        reader, owns_reader = open_reader(dataset)
        n = len(reader) if hasattr(reader, "__len__") else len(dataset)
        if n < settings.local_batch_size * settings.world_size:
            try:
                message = too_few_samples(settings, reader, n)
            finally:
                if owns_reader:
                    reader.close()
            raise ValueError(message)
        self.reader, self.owns_reader = reader, owns_reader
        self.is_open = True
        self.fingerprint = reader_fingerprint(reader)
        if (
            not (settings.num_workers > 0 and settings.parallel_method == "process")
            and getattr(reader, "decodes_small_objects", lambda: True)()
        ):
            # samples are decoded in this process: keep small-object memory mapped for
            # them while the loader is open (see reserve_small_object_memory); not for
            # windows of arrays (4 MiB of blocks to make cost 5-15 ms of the first batch)
            self._reserve = weakref.finalize(self, hold_small_object_reserve())

    def close(self) -> None:
        """Stop the worker processes, free the ring and the reserve, close the reader."""
        self.stop_processes()
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()  # waits for copies still running out of its buffers
        reserve, self._reserve = self._reserve, None
        if reserve is not None:
            reserve()
        if self.is_open:
            reader, self.reader = self.reader, None
            self.is_open = False
            if self.owns_reader:
                self.owns_reader = False
                # Once worker threads still finishing a batch of a closed iterator are done.
                after_orphaned_jobs(reader.close)

    def processes(self, dataset: Any, settings: LoaderSettings, base_seed: int) -> ProcessPool:
        """The worker processes: started on first use, kept across iterators."""
        pool = self.pool
        if pool is not None and not pool.closed:
            return pool
        self.stop_processes()  # (a failed one)
        pool = ProcessPool(
            dataset,
            settings.collate_fn,
            settings.num_workers,
            start_context(settings.multiprocessing_context),
            base_seed=base_seed,
            worker_init_fn=settings.worker_init_fn,
            persistent=settings.persistent_workers,
        )
        self.pool = pool
        self._pool_finalizer = weakref.finalize(self, pool.close)
        return pool

    def stop_processes(self) -> None:
        """Stop the worker processes (the next ``processes()`` starts new ones)."""
        finalizer, self._pool_finalizer = self._pool_finalizer, None
        self.pool = None
        if finalizer is not None:
            finalizer()

    def ring_device(self, settings: LoaderSettings) -> bool:
        """Whether batches go to a CUDA device from pinned memory (what the ring is for)."""
        return settings.pin_memory and settings.device.type == "cuda"

    def new_ring(self, nbytes: int, size: int) -> PinnedRing:
        """A ring of ``size`` pinned buffers of ``nbytes`` with CUDA events."""
        return PinnedRing(nbytes, size)


def too_few_samples(settings: LoaderSettings, reader: Any, n: int) -> str:
    """Why a dataset of ``n`` samples cannot fill a global batch, and the fix."""
    g = settings.local_batch_size * settings.world_size
    batch = (
        f"one global batch of local_batch_size * world_size = {settings.local_batch_size} * "
        f"{settings.world_size} = {g} (also required with drop_last=False)"
    )
    length = getattr(reader, "sequence_length", None)
    total = getattr(getattr(reader, "storage_reader", None), "total_length", None)
    if not isinstance(length, int) or not isinstance(total, int):
        return (
            f"the dataset has {n} samples, fewer than {batch}: use a smaller batch or "
            "world size, or more data"
        )
    if n == 0:  # a stream dataset: sample i is elements [i * L, (i + 1) * L)
        return (
            f"the stream holds {total} elements, fewer than sequence_length={length}, so "
            f"it makes no sample at all ({total} // {length} = 0): pass a sequence_length "
            f"of at most {total}, or write more data"
        )
    return (
        f"the stream's {total} elements make {n} samples of sequence_length={length} "
        f"({total} // {length}), fewer than {batch}: use a sequence_length of at most "
        f"{total // g}, a smaller batch or world size, or more data"
    )
