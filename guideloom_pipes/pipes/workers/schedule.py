"""The scheduling policy of :class:`~guideloom_pipes.pipes.ReadSamples`: who reads the next
batch (the calling thread or the workers), how many batches one job holds, how many jobs are
in flight and how many thread workers run at once, from what it has learned of the batches
and of the caller (:class:`ReadFigures`).

Pure policy: no thread, no reader, no pool, no clock. The read stage measures and tells it
(``batches_read``, ``caller_back``, ``lone_job_running``), and asks it (``reads_inline``,
``chunk_size``, ``inline_chunk``, ``side_by_side``, ``workers_at_once``,
``enough_in_flight``). numpy-free and torch-free.
"""

from __future__ import annotations

__all__ = [
    "CHUNK_SECONDS",
    "COLUMN_CHUNK",
    "GAP_FLOOR",
    "GAP_OUTLIER",
    "GAP_SHARE",
    "INLINE_SAMPLE",
    "WAITING",
    "ReadFigures",
    "ReadSchedule",
]

#: A worker's time per job of quick batches to aim for (``chunk_seconds``' default). A
#: handoff between threads costs tens of microseconds of CPU (a trip through a process pipe
#: more): batches quicker than this go several to a job, so it is paid per chunk, not per
#: batch; slower ones go one per job, so that ``N`` workers keep ``N`` of them in flight.
CHUNK_SECONDS = 0.002
#: A job that spends less than this share of its time on the CPU (running alone) waits on
#: I/O: such jobs run side by side on thread workers even when quick, and the calling thread
#: leaves them to the workers. Above it they compute, and threads running them side by side
#: only take the GIL from each other. Measured here: 0.10-0.19 for reads that wait, 0.8-1.0
#: for memory-mapped tokens and documents; the value sits between, nearer the waiting side.
WAITING = 0.35
#: The calling thread reads the batches itself while it comes back for the next one within
#: this share of a batch's read time: it is waiting for the data, and a worker thread reading
#: ahead under the same GIL only adds a handoff (and colder memory) to every batch (8 windows
#: of 2048 tokens: 16 us of CPU read by the calling thread, 24 us through a worker thread). A
#: caller away longer (a training step) gains from the workers reading during its own work.
GAP_SHARE = 0.5
#: ... and always while it comes back within this many seconds, however quick the batches:
#: a handoff to a worker thread costs more CPU than such a gap holds, and the workers'
#: chunks (up to 128 batches in flight) made a caller whose loop took 10 us between 18 us
#: batches wait for them.
GAP_FLOOR = 50e-6
#: One late call counts as at most this many times the gap that keeps the calling thread
#: reading (:meth:`ReadSchedule.gap_bound`): a caller that the machine paused once, or that
#: was away once (another loader's turn, an evaluation), keeps reading; one that is late at
#: two or three timed calls in a row is handed the workers' batches (the moving average of
#: the gap weighs a new call by a quarter).
GAP_OUTLIER = 2.0
#: One in this many batches read one at a time by the calling thread is timed (its time and
#: CPU share, the caller's time before it) and decides whether the calling thread goes on:
#: the clocks cost as much as the rest of the bookkeeping of a quick batch, and a change of
#: the batches or of the caller is still seen within a few dozen batches.
INLINE_SAMPLE = 16
#: Batches of columns that one read packs together (``read_arrays_many``: packed windows)
#: are read by the calling thread this many at a time at most: the chunk's arrays, written
#: together and held until delivered, stay in the caches.
COLUMN_CHUNK = 8
#: The weight of a new figure in the moving averages (batch time, CPU share, gap): a few
#: figures in a row move them, one odd figure does not.
_NEW = 0.25
_OLD = 1 - _NEW


class ReadFigures:
    """What a read stage has learned of its batches and of its caller: a batch's read time
    and the share of it spent on the CPU, and the caller's time between batches (moving
    averages; see :class:`ReadSchedule`). A loader hands one such object to the read stage
    of each of its epochs, so that a new epoch starts from what the last one learned instead
    of learning again (its first job timed alone, the first chunks read ahead on workers)."""

    __slots__ = ("batch_seconds", "cpu_share", "gap")

    def __init__(self, batch_seconds: float = 0.0, cpu_share: float = -1.0, gap: float = -1.0):
        self.batch_seconds = batch_seconds  # 0: unknown
        self.cpu_share = cpu_share  # -1: unknown
        self.gap = gap  # -1: unknown

    def known(self) -> bool:
        """Whether a job has been timed (its time and CPU share)."""
        return self.batch_seconds > 0 and self.cpu_share >= 0

    def __repr__(self) -> str:
        return (
            f"ReadFigures(batch_seconds={self.batch_seconds:.3g}, "
            f"cpu_share={self.cpu_share:.2f}, gap={self.gap:.3g})"
        )


class ReadSchedule:
    """The read stage's scheduling policy, from what it has learned (moving averages of a
    batch's read time, of the share of it a job running alone spends on the CPU, and of the
    caller's time between calls).

    - **Chunks**: a job holds about ``chunk_seconds`` of a worker's time, at most
      ``max_chunk`` batches (:meth:`chunk_size`): slow batches go one per job, quick ones are
      grouped so a handoff is paid per chunk.
    - **Side by side**: process workers always run jobs side by side; thread workers only
      once the jobs are known to wait on I/O (:data:`WAITING`), else one at a time (threads
      that compute share the GIL). The first job after :meth:`start` runs alone to find out
      (``probing``), unless an earlier epoch's figures are known.
    - **In flight**: jobs of one batch until ``max_in_flight`` batches are pending; chunks
      until ``max(m, ceil(max_in_flight / size))`` jobs are, ``m = workers + 1`` (one being
      delivered, one being read by each worker) where jobs run side by side, else 2.
    - **Inline**: while the batches compute and the caller comes back for the next one
      within :data:`GAP_SHARE` of a batch's read time (or :data:`GAP_FLOOR`), the calling
      thread reads them itself (:meth:`reads_inline`), one at a time where a read gives
      batches of columns, else a chunk with one read (:meth:`inline_chunk`). Batches that
      start to wait, or a caller that slows, go back to the workers.

    Args:
        threads: Thread workers (else process workers).
        workers: How many.
        chunk_seconds: A worker's time per job to aim for; 0: one batch per job.
        max_chunk: The most batches in one job.
        max_in_flight: Batches submitted ahead of the caller.
        figures: Where the figures are also kept, to start from at the next :meth:`start`
            once they are known (a loader's, shared by its epochs); None: each start learns
            again.
    """

    __slots__ = (
        "_batch_seconds",
        "_cpu_share",
        "_figures",
        "_gap",
        "_may_inline",
        "_probing",
        "chunk_seconds",
        "max_chunk",
        "max_in_flight",
        "threads",
        "workers",
    )

    def __init__(
        self,
        *,
        threads: bool,
        workers: int,
        chunk_seconds: float = CHUNK_SECONDS,
        max_chunk: int = 64,
        max_in_flight: int = 1,
        figures: ReadFigures | None = None,
    ) -> None:
        self.threads = threads
        self.workers = workers
        self.chunk_seconds = chunk_seconds
        self.max_chunk = max_chunk
        self.max_in_flight = max_in_flight
        self._figures = figures
        self._batch_seconds = 0.0  # 0: unknown
        self._cpu_share = -1.0  # -1: unknown
        self._gap = -1.0  # -1: unknown
        self._probing = False
        self._may_inline = False

    # -- an epoch -----------------------------------------------------------------------

    def start(self, caller_may_read: bool) -> bool:
        """A new epoch (the stage's reset): start from the shared figures where they are
        known, else time the first job alone (thread workers, ``chunk_seconds > 0``).
        ``caller_may_read``: whether the calling thread may read batches at all (no timeout,
        nothing that tells it from a worker). Returns whether it may (see
        :meth:`reads_inline`)."""
        capable = self.threads and self.chunk_seconds > 0
        figures = self._figures
        learned = capable and figures is not None and figures.known()
        if learned:
            assert figures is not None
            self.adopt(figures)
        self._probing = capable and not learned
        self._may_inline = capable and caller_may_read
        return self._may_inline

    def adopt(self, figures: ReadFigures) -> None:
        """Go on from ``figures`` (what an earlier epoch learned) instead of what was learned."""
        self._batch_seconds, self._cpu_share = figures.batch_seconds, figures.cpu_share
        self._gap = figures.gap

    def learned(self) -> ReadFigures:
        """A copy of what has been learned so far."""
        return ReadFigures(self._batch_seconds, self._cpu_share, self._gap)

    @property
    def figures(self) -> ReadFigures | None:
        """The shared figures given (kept current), or None."""
        return self._figures

    # -- what the stage tells -----------------------------------------------------------

    def batches_read(self, seconds: float, cpu_share: float | None = None) -> None:
        """A job (a worker's, or the calling thread's) read batches taking ``seconds`` each;
        ``cpu_share``: the share of its time spent on the CPU, where it ran alone (None:
        not known)."""
        average = self._batch_seconds
        self._batch_seconds = seconds if average == 0 else _OLD * average + _NEW * seconds
        if cpu_share is not None:
            share = self._cpu_share
            self._cpu_share = cpu_share if share < 0 else _OLD * share + _NEW * cpu_share
        figures = self._figures
        if figures is not None:
            figures.batch_seconds, figures.cpu_share = self._batch_seconds, self._cpu_share

    def caller_back(self, seconds: float) -> None:
        """The caller came back for the next batch ``seconds`` after the last one was given
        (one late call counts as at most :data:`GAP_OUTLIER` times :meth:`gap_bound`)."""
        if self._batch_seconds > 0:
            seconds = min(seconds, GAP_OUTLIER * self.gap_bound())
        gap = self._gap
        self._gap = seconds if gap < 0 else _OLD * gap + _NEW * seconds
        if self._figures is not None:
            self._figures.gap = self._gap

    def lone_job_running(self, cpu_share: float | None) -> None:
        """The first job, running alone, is still running after ``chunk_seconds`` of its own
        having spent ``cpu_share`` of them on the CPU (None: not started, or it cannot be
        told). A job that slow is worth a job of its own anyway; one that waited rather than
        computed tells that the jobs wait on I/O: they run side by side from now on."""
        if cpu_share is None or cpu_share < WAITING:
            self._cpu_share = 0.0 if cpu_share is None else cpu_share

    def probe_over(self) -> None:
        """The first job no longer runs alone (the stage waited for it, or stopped)."""
        self._probing = False

    # -- what the stage asks ------------------------------------------------------------

    @property
    def probing(self) -> bool:
        """Whether the first job runs alone, to be timed, before more are submitted."""
        return self._probing

    def reads_inline(self) -> bool:
        """Whether the calling thread reads the next batch itself rather than the workers:
        it may (:meth:`start`), the batches compute (they do not wait on I/O), and the caller
        comes back for the next one within :meth:`gap_bound`, so it is waiting for them.
        Thread workers run computing jobs one at a time (:meth:`side_by_side`), so reading
        ahead in a thread only adds a handoff under the same GIL; a caller with work of its
        own between batches (a training step) keeps the workers reading ahead."""
        return (
            self._may_inline
            and not self._probing
            and self._batch_seconds > 0
            and self._cpu_share >= WAITING
            and 0 <= self._gap < max(GAP_SHARE * self._batch_seconds, GAP_FLOOR)
        )

    def gap_bound(self) -> float:
        """The caller's time between batches under which the calling thread reads them."""
        return max(GAP_SHARE * self._batch_seconds, GAP_FLOOR)

    def side_by_side(self) -> bool:
        """Whether jobs should run on several workers at once: processes always (each has a
        core); threads when the jobs mostly *wait* (a job running alone spends under
        :data:`WAITING` of its time on the CPU), since quick jobs that compute would only
        take the GIL from each other."""
        return not self.threads or 0 <= self._cpu_share < WAITING

    def workers_at_once(self) -> int:
        """How many thread workers may run jobs at once (see :meth:`side_by_side`): two
        threads decoding 0.3 ms batches side by side took 0.85 ms a batch, one after the
        other 0.3 ms."""
        return self.workers if self.side_by_side() else 1

    def chunk_size(self) -> int:
        """Batches per job: about ``chunk_seconds`` of a worker's time, at most
        ``max_chunk``; 1 while a batch's time is not known."""
        per_batch = self._batch_seconds
        if per_batch <= 0 or self.chunk_seconds <= 0:
            return 1
        return max(1, min(self.max_chunk, int(self.chunk_seconds / per_batch)))

    def inline_chunk(self, columns: bool | None, packs_chunks: bool) -> int:
        """How many batches the calling thread reads with one read: a chunk, as a worker
        would, where a read gives lists (``columns`` False); 1 where it gives batches of
        columns (each read into memory the allocator just freed) or may (None: not known
        before the first read), unless the reader packs several together
        (``packs_chunks``: up to :data:`COLUMN_CHUNK`)."""
        if columns is False:
            return self.chunk_size()
        if packs_chunks and columns:
            return min(self.chunk_size(), COLUMN_CHUNK)
        return 1

    def enough_in_flight(self, batches: int, jobs: int, size: int) -> bool:
        """Whether ``batches`` pending in ``jobs`` are enough in flight, where the next job
        would hold ``size`` batches (see the class's *In flight*; while ``probing``, one
        job)."""
        if self._probing:
            return jobs > 0
        if size == 1:
            return batches >= self.max_in_flight
        least = self.workers + 1 if self.side_by_side() else 2
        return jobs >= max(least, -(-self.max_in_flight // size))

    def __repr__(self) -> str:
        return (
            f"ReadSchedule({'threads' if self.threads else 'processes'}={self.workers}, "
            f"{self.learned()!r}, probing={self._probing}, may_inline={self._may_inline})"
        )
