"""``write_parallel``: a dataset written by many workers (a local process pool, or any
``concurrent.futures.Executor``, Dask's included), item ``k`` of the input becoming shard ``k``
through the atomic commit; resumable by a fingerprint of each item kept in the shard's commit
record. numpy only: it never imports torch.

The package: :mod:`~guideloom_pipes.parallel.write` (:func:`write_parallel`, its steps),
:mod:`~guideloom_pipes.parallel.worker` (a worker's item, and how workers end with their
driver), :mod:`~guideloom_pipes.parallel.committed` (what a run skips, and what a broken pool
committed), :mod:`~guideloom_pipes.parallel.report` (:class:`WriteReport`,
:class:`WriteParallelError`) and :mod:`~guideloom_pipes.parallel.converting` (:func:`convert`:
any corpus we read, text tokenized on the way, written as a dataset of ours)."""

from __future__ import annotations

from guideloom_pipes.parallel.committed import item_fingerprint
from guideloom_pipes.parallel.converting import convert
from guideloom_pipes.parallel.report import WriteParallelError, WriteReport
from guideloom_pipes.parallel.write import write_parallel

__all__ = ["WriteParallelError", "WriteReport", "convert", "item_fingerprint", "write_parallel"]
