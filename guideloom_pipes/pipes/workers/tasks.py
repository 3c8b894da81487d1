"""A read task: a chunk of batches of ids -> samples -> ``collate_fn`` per batch, each
batch failing alone (numpy only).

What a worker of :class:`guideloom_pipes.pipes.ReadSamples` runs, in a thread or a process; a
process worker imports it, so it stays free of torch.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.batch import (
    Batch,
    LazyRows,
    accepts_batch_arrays,
    batch_arrays,
    one_column_collate,
)
from guideloom_pipes.datasets import BatchReads, WindowBuffers, batch_reads
from guideloom_pipes.pipes.seeding import Seeding, seeded

Ids = npt.NDArray[np.int64]


class Failed:
    """A batch's outcome when reading or collating it raised ``error``.

    ``remote`` is the formatted traceback when the error happened in a worker process
    (its traceback object does not survive pickling).
    """

    __slots__ = ("error", "remote")

    def __init__(self, error: BaseException, remote: str | None = None) -> None:
        self.error: BaseException | None = error
        self.remote = remote

    def __reduce__(self) -> tuple[Any, ...]:
        error, remote = self.error, self.remote
        if error is None:
            raise RuntimeError("a failed batch whose error was raised is not sent on")
        if remote is None:
            remote = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return (Failed, (error, remote))

    def raised(self) -> BaseException:
        """The error to raise, with the worker's traceback as its cause where it came from
        a worker process; taken out of this outcome, which is spent then (each batch has
        its own). Once raised, the error's traceback holds the frames that read the batch,
        and with them (through their callers) the lists that held this outcome: an outcome
        that kept its error would close a cycle back to the read stage and its iterator,
        alive until the garbage collector ran."""
        error = self.error
        if error is None:
            raise RuntimeError("this failed batch's error was already raised")
        self.error = None
        if self.remote is not None:
            error.__cause__ = RemoteTraceback(self.remote)
        return error


class RemoteTraceback(Exception):
    """The cause attached to an error re-raised from a worker process: its traceback there."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


@batch_arrays
def keep_batch_arrays(samples: Any) -> Any:
    """The collate of a stage that hands batches on uncollated, as arrays where the reader
    gives them (a :class:`~guideloom_pipes.batch.Batch`), for a collate further on."""
    return samples


def column_read(
    reads: BatchReads, collate_fn: Callable[..., Any] | None
) -> tuple[Callable[[Ids], np.ndarray | None], Callable[[np.ndarray], Any]] | None:
    """``(read_column, collate_column)`` where a batch is read as its one column alone and
    collated by the form ``collate_fn`` declares for one column (a one-field stream and
    :func:`~guideloom_pipes.pipes.collate.default_collate`: the column's tensor, no
    :class:`~guideloom_pipes.batch.Batch` in between); ``read_column`` gives None for a
    batch it does not read (the general read takes it). None where that does not apply."""
    column = reads.column
    if column is None or collate_fn is None:
        return None
    name, dtype, read_column = column
    collate_column = one_column_collate(collate_fn, name, dtype)
    return None if collate_column is None else (read_column, collate_column)


class Deferred:
    """A batch of a chunk read whose samples are made, and collated, only when the batch
    is delivered (:meth:`ReadTask.run` with ``defer=True``): rows ``begin .. end - 1`` of
    the chunk's :class:`~guideloom_pipes.batch.LazyRows`, under the batch's seed if any."""

    __slots__ = ("begin", "end", "rows", "seed", "task")

    def __init__(
        self, task: ReadTask, rows: LazyRows, begin: int, end: int, seed: int | None
    ) -> None:
        self.task = task
        self.rows = rows
        self.begin = begin
        self.end = end
        self.seed = seed

    def finish(self) -> Any:
        """The batch's result (raises what its decode or collate raises)."""
        return self.task._collated_under(self.rows[self.begin : self.end], self.seed)


class ReadTask:
    """ids -> samples (-> ``collate_fn(samples)`` when one is given): one batch of work.

    :meth:`run` does a *chunk* of consecutive batches: one read of all their ids, then
    ``collate_fn`` per batch. An ``Exception`` fails its batch alone; a ``KeyboardInterrupt``
    (Ctrl-C, when the training thread runs the job) or ``SystemExit`` stops the whole job
    at once and propagates. A :class:`~guideloom_pipes.batch.Batch` from the read reaches
    ``collate_fn`` as it is when ``collate_fn`` takes arrays, else as its list of samples.

    With a seed per batch (``seeds`` of :meth:`run`, ``seed`` of a call) each batch is read
    and collated under its seed (see :func:`seeded`, ``seeding`` says how). A reader whose
    reads draw no random numbers (ours, see :class:`~guideloom_pipes.datasets.BatchReads`)
    still reads a chunk with one call and only the collates run under the seeds; any other
    reader (a user's ``__getitem__``) reads each batch under its seed.

    ``reads``: how the reader's batches are read (what the reader chose for ``collate_fn``;
    :meth:`of_reader` asks it). This is the one place where samples are collated.
    """

    __slots__ = (
        "_arrays",
        "_collate",
        "_collate_column",
        "_columns",
        "_draws_random",
        "_read",
        "_read_column",
        "_read_many",
        "seeding",
    )

    def __init__(
        self,
        reads: BatchReads,
        collate_fn: Callable[..., Any] | None,
        *,
        seeding: Seeding = "local",
    ):
        self._read = reads.read
        self._read_many = reads.read_many
        # a batch read as its one column and collated by the collate's form for it, where
        # that applies (read_column gives None for a batch it does not read: the read and
        # collate above take it); see column_read
        one = column_read(reads, collate_fn)
        self._read_column: Callable[[Ids], np.ndarray | None] | None = None
        self._collate_column: Callable[[np.ndarray], Any] | None = None
        if one is not None:
            self._read_column, self._collate_column = one
        self._collate = collate_fn
        self._arrays = accepts_batch_arrays(collate_fn)
        # whether the read gives batches of columns (None: not known before the first read)
        self._columns: bool | None = None if self._arrays else False
        self._draws_random = reads.draws_random
        self.seeding: Seeding = seeding

    @classmethod
    def of_reader(
        cls,
        reader: Any,
        collate_fn: Callable[..., Any] | None,
        *,
        out: WindowBuffers | None = None,
        seeding: Seeding = "local",
    ) -> ReadTask:
        """The task reading ``reader``'s batches as it reads them for ``collate_fn``: as
        arrays (a :class:`~guideloom_pipes.batch.Batch`) where ``collate_fn`` takes them,
        else as samples (:func:`~guideloom_pipes.datasets.batch_reads`). ``out``: where the
        arrays read their windows (a loader's pinned ring)."""
        reads = batch_reads(reader, accepts_batch_arrays(collate_fn), out)
        return cls(reads, collate_fn, seeding=seeding)

    def _input(self, samples: Any) -> Any:
        if type(samples) is Batch and not self._arrays:
            return samples.samples()
        if type(samples) is LazyRows:
            return samples[:]
        return samples

    def _collated(self, samples: list[Any]) -> Any:
        return samples if self._collate is None else self._collate(samples)

    def __call__(self, ids: Ids, seed: int | None = None) -> Any:
        if seed is not None:
            with seeded(seed, self.seeding):
                return self._plain(ids)
        return self._plain(ids)

    def _plain(self, ids: Ids) -> Any:
        read_column = self._read_column
        if read_column is not None:
            column = read_column(ids)
            if column is not None:
                return self._collate_column(column)  # type: ignore[misc]
        if not len(ids):
            samples: Any = []
        else:
            samples = self._read(ids)
            if self._columns is None:
                self._columns = type(samples) is Batch and samples.columns is not None
            samples = self._input(samples)
        return self._collated(samples)

    @property
    def columns(self) -> bool | None:
        """Whether a read gives batches of columns (None: not known before the first read)."""
        return self._columns

    @property
    def packs_chunks(self) -> bool:
        """Whether the reader can pack a chunk of batches of columns with one read (one of
        our readers' ``read_arrays_many``), known or not yet known to give columns."""
        return self._read_many is not None

    @property
    def reads_many(self) -> bool:
        """Whether a chunk of batches of columns is read with one call (see :meth:`run`)."""
        return bool(self._columns) and self._read_many is not None

    def _one(self, ids: Ids, seed: int | None = None) -> Any:
        try:
            return self(ids, seed)
        except Exception as error:
            return Failed(error)

    def run(
        self, job: list[Ids] | tuple[list[Ids], list[int] | None], defer: bool = False
    ) -> list[Any]:
        """Each batch's result, or a :class:`Failed` for a batch whose read or collate raised.

        ``job`` is the list of the batches' id arrays, or ``(batches, seeds)`` with a seed
        per batch (or ``None``). The ids of all batches are read with one call (unless each
        batch must be read under its seed); if that raises (or returns the wrong number of
        samples), each batch is read alone, so an error belongs to the batch that caused it
        and the batches around it are intact. Batches of columns (a collate that takes
        arrays, a reader that makes them) are read one by one instead: arrays the size of one
        batch come from the allocator's free memory, where a chunk's arrays are fresh pages
        that the kernel faults in (a chunk of 35 batches of 8 x 2048 tokens spent 0.4 ms in
        ``np.empty`` alone, more than 35 reads of one batch cost). Until the first read
        tells, batches are read one by one. A reader that packs batches of columns together
        (``read_many``: packed windows, each batch in a block of its own recycled memory)
        reads the chunk with one call (:meth:`_run_many`). Other reads stay one per chunk.

        A read that gives :class:`~guideloom_pipes.batch.LazyRows` (windows of a stream
        with metadata) makes each batch's samples from its slice, just before its collate;
        with ``defer=True`` not even then: the batch is a :class:`Deferred`, made and
        collated by its :meth:`Deferred.finish` when the caller delivers it (for the
        calling thread's own chunks: the batches held waiting then keep only the read's
        arrays and bytes, no objects that the garbage collector tracks).
        """
        batches, seeds = job if isinstance(job, tuple) else (job, None)
        if len(batches) > 1 and self.reads_many and (seeds is None or not self._draws_random):
            return self._run_many(batches, seeds)
        if (
            len(batches) == 1
            or self._columns is not False
            or (seeds is not None and self._draws_random)
        ):
            return self._each_alone(batches, seeds)
        sizes = [len(ids) for ids in batches]
        total = sum(sizes)
        try:
            samples = self._read(np.concatenate(batches)) if total else []
            if len(samples) != total:
                raise ValueError("a read returned the wrong number of samples")
        except Exception:
            samples = None
        if samples is None:
            # Read again batch by batch, after the handler: an error raised there now would
            # carry the chunk's as its context (shown twice, and the chunk's traceback holds
            # the frames that list the outcomes: a cycle back to the read stage).
            return self._each_alone(batches, seeds)
        collate = self._collate
        out: list[Any] = []
        start = 0
        lazy = samples if type(samples) is LazyRows and defer else None
        for index, size in enumerate(sizes):
            begin, start = start, start + size
            if lazy is not None:
                seed = None if seeds is None else seeds[index]
                out.append(Deferred(self, lazy, begin, start, seed))
                continue
            try:
                part = samples[begin:start]  # (rows of LazyRows are decoded here)
            except Exception as error:
                out.append(Failed(error))
                continue
            if type(part) is Batch:
                part = self._input(part)
            elif not isinstance(part, list):
                part = list(part)
            if collate is None:
                out.append(part)
                continue
            out.append(self._collate_one(part, None if seeds is None else seeds[index]))
        return out

    def _run_many(self, batches: list[Ids], seeds: list[int] | None) -> list[Any]:
        """:meth:`run` for batches of columns read together (``read_many``: one read of
        their windows, each batch its own arrays); only the collates run under the seeds.
        If the read raises, each batch is read alone (its error then belongs to it)."""
        reads: list[Any] | None = None
        if all(len(ids) for ids in batches):
            try:
                reads = self._read_many(batches)  # type: ignore[misc]
                if len(reads) != len(batches):
                    reads = None
            except Exception:
                reads = None
        if reads is None:
            return self._each_alone(batches, seeds)
        if seeds is None:
            return [self._collate_one(samples, None) for samples in reads]
        return [self._collate_one(samples, seed) for samples, seed in zip(reads, seeds)]

    def _each_alone(self, batches: list[Ids], seeds: list[int] | None) -> list[Any]:
        """Each batch read and collated by itself (under its seed): an error is its own."""
        if seeds is None:
            return [self._one(ids) for ids in batches]
        return [self._one(ids, seed) for ids, seed in zip(batches, seeds, strict=True)]

    def _collated_under(self, samples: Any, seed: int | None) -> Any:
        """:meth:`_collated` under ``seed`` (see :func:`seeded`), if one is given."""
        if seed is None:
            return self._collated(samples)
        with seeded(seed, self.seeding):
            return self._collated(samples)

    def _collate_one(self, samples: Any, seed: int | None) -> Any:
        """:meth:`_collated_under`, or a :class:`Failed` for the ``Exception`` it raises."""
        try:
            return self._collated_under(samples, seed)
        except Exception as error:
            return Failed(error)
