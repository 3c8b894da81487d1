"""ReadSchedule, the read stage's scheduling policy, driven through its public methods alone:
it is told times (no clock, no thread, no reader) and asked what to do."""

from __future__ import annotations

import pytest

from guideloom_pipes.pipes.workers.schedule import (
    CHUNK_SECONDS,
    COLUMN_CHUNK,
    GAP_FLOOR,
    GAP_SHARE,
    INLINE_SAMPLE,
    WAITING,
    ReadFigures,
    ReadSchedule,
)

QUICK = 0.45e-3  # a batch's read time: chunks of 2 ms hold 4


def _threads(workers: int = 2, **kw: object) -> ReadSchedule:
    return ReadSchedule(threads=True, workers=workers, max_in_flight=2 * workers, **kw)  # type: ignore[arg-type]


def _reading_inline(figures: ReadFigures | None = None) -> ReadSchedule:
    """A schedule whose first job (run alone) read quick batches that compute, whose
    caller came back at once: the calling thread reads."""
    schedule = _threads(figures=figures)
    schedule.start(True)
    schedule.probe_over()
    schedule.batches_read(QUICK, 1.0)
    schedule.caller_back(0.0)
    return schedule


def test_the_constants_are_the_documented_ones() -> None:
    assert CHUNK_SECONDS == 0.002 and 0 < WAITING < 1 and 0 < GAP_SHARE < 1
    assert GAP_FLOOR > 0 and INLINE_SAMPLE > 1 and COLUMN_CHUNK > 1


def test_nothing_learned_one_batch_a_job_and_the_workers_read() -> None:
    schedule = _threads()
    assert schedule.chunk_size() == 1
    assert not schedule.reads_inline()
    assert not schedule.side_by_side() and schedule.workers_at_once() == 1
    assert not schedule.probing
    learned = schedule.learned()
    assert (learned.batch_seconds, learned.cpu_share, learned.gap) == (0.0, -1.0, -1.0)
    assert not learned.known()


def test_process_workers_always_run_side_by_side_and_never_probe() -> None:
    schedule = ReadSchedule(threads=False, workers=3, max_in_flight=6)
    assert not schedule.start(True)  # the calling thread never reads for processes
    assert not schedule.probing
    assert schedule.side_by_side() and schedule.workers_at_once() == 3
    schedule.batches_read(QUICK, 1.0)
    schedule.caller_back(0.0)
    assert not schedule.reads_inline()
    # chunks: one per worker being read plus the one being delivered
    assert not schedule.enough_in_flight(12, 3, 4)
    assert schedule.enough_in_flight(16, 4, 4)


def test_the_first_job_after_start_runs_alone_until_it_is_timed() -> None:
    schedule = _threads(workers=4)
    assert schedule.start(True)
    assert schedule.probing
    assert not schedule.enough_in_flight(0, 0, 1)  # the first job is submitted ...
    assert schedule.enough_in_flight(1, 1, 1)  # ... and alone
    assert schedule.enough_in_flight(8, 1, 8)
    schedule.probe_over()
    assert not schedule.probing
    assert not schedule.enough_in_flight(1, 1, 1)


def test_without_chunks_nothing_probes_and_the_calling_thread_never_reads() -> None:
    schedule = _threads(chunk_seconds=0.0)
    assert not schedule.start(True)
    assert not schedule.probing
    schedule.batches_read(QUICK, 1.0)
    schedule.caller_back(0.0)
    assert not schedule.reads_inline()
    assert schedule.chunk_size() == 1


def test_figures_are_moving_averages_the_first_taken_as_it_is() -> None:
    schedule = _threads()
    schedule.batches_read(1e-3)
    assert schedule.learned().batch_seconds == 1e-3
    assert schedule.learned().cpu_share == -1.0  # not run alone: not known
    schedule.batches_read(2e-3, 0.5)
    learned = schedule.learned()
    assert learned.batch_seconds == pytest.approx(0.75e-3 + 0.5e-3)
    assert learned.cpu_share == 0.5
    schedule.batches_read(2e-3, 1.0)
    assert schedule.learned().cpu_share == pytest.approx(0.625)
    schedule.caller_back(1e-4)
    schedule.caller_back(0.0)
    assert schedule.learned().gap == pytest.approx(0.75e-4)


def test_a_chunk_holds_about_chunk_seconds_of_batches_at_most_max_chunk() -> None:
    schedule = _threads(max_chunk=16)
    schedule.batches_read(QUICK)
    assert schedule.chunk_size() == 4  # 2 ms / 0.45 ms
    slow = _threads()
    slow.batches_read(0.01)
    assert slow.chunk_size() == 1
    tiny = _threads(max_chunk=16)
    tiny.batches_read(1e-6)
    assert tiny.chunk_size() == 16


@pytest.mark.parametrize("share", [0.05, None])
def test_jobs_that_wait_run_side_by_side_on_every_thread(share: float | None) -> None:
    schedule = _threads(workers=4)
    schedule.start(True)
    # the first job, still running after chunk_seconds, has spent little of it computing
    # (None: not started, or it cannot be told)
    schedule.probe_over()
    schedule.lone_job_running(share)
    assert schedule.side_by_side() and schedule.workers_at_once() == 4
    schedule.batches_read(QUICK)
    # chunks of 4: one per worker plus the one being delivered
    assert not schedule.enough_in_flight(16, 4, 4)
    assert schedule.enough_in_flight(20, 5, 4)


def test_a_lone_job_that_computes_keeps_the_threads_one_at_a_time() -> None:
    schedule = _threads(workers=4)
    schedule.start(True)
    schedule.probe_over()
    schedule.lone_job_running(0.9)  # computing: not told yet
    assert not schedule.side_by_side()
    schedule.batches_read(QUICK, 0.9)
    assert not schedule.side_by_side() and schedule.workers_at_once() == 1
    # quick chunks that compute: two in flight (one delivered, one read), or as many as
    # max_in_flight batches ahead asks
    assert not schedule.enough_in_flight(4, 1, 4)
    assert schedule.enough_in_flight(8, 2, 4)
    assert not schedule.enough_in_flight(8, 2, 2)  # 8 in flight: 4 jobs of 2
    assert schedule.enough_in_flight(8, 4, 2)
    # jobs of one batch: max_in_flight batches
    assert not schedule.enough_in_flight(7, 7, 1)
    assert schedule.enough_in_flight(8, 3, 1)


def test_the_calling_thread_reads_quick_batches_that_compute_for_a_waiting_caller() -> None:
    schedule = _reading_inline()
    assert schedule.reads_inline()
    assert not schedule.side_by_side()
    # while the caller comes back within half a batch's read time
    bound = schedule.gap_bound()
    assert bound == pytest.approx(GAP_SHARE * QUICK)
    for _ in range(20):
        schedule.caller_back(0.9 * bound)
    assert schedule.reads_inline()


def test_reading_inline_needs_the_first_job_timed_and_the_calling_thread_allowed() -> None:
    schedule = _threads()
    schedule.start(True)
    schedule.batches_read(QUICK, 1.0)
    schedule.caller_back(0.0)
    assert not schedule.reads_inline()  # the first job is still alone (probing)
    schedule.probe_over()
    assert schedule.reads_inline()
    barred = _threads()
    assert not barred.start(False)  # a timeout, a worker_init_fn
    barred.probe_over()
    barred.batches_read(QUICK, 1.0)
    barred.caller_back(0.0)
    assert not barred.reads_inline()


def test_the_gap_is_needed_before_the_calling_thread_reads() -> None:
    schedule = _threads()
    schedule.start(True)
    schedule.probe_over()
    schedule.batches_read(QUICK, 1.0)
    assert not schedule.reads_inline()  # the caller's gap is not known yet
    schedule.caller_back(0.0)
    assert schedule.reads_inline()


def test_batches_that_wait_go_back_to_the_workers() -> None:
    schedule = _reading_inline()
    schedule.batches_read(QUICK, 0.0)  # reads that take no CPU time: a few tell
    schedule.batches_read(QUICK, 0.0)
    assert schedule.reads_inline()
    schedule.batches_read(QUICK, 0.0)
    schedule.batches_read(QUICK, 0.0)
    assert not schedule.reads_inline()
    assert schedule.side_by_side()


def test_one_late_call_keeps_the_calling_thread_reading_three_in_a_row_do_not() -> None:
    for late in (1e-3, 10.0):
        schedule = _reading_inline()
        schedule.caller_back(late)  # one call the machine paused, however long
        assert schedule.reads_inline()
        schedule.caller_back(late)
        assert schedule.reads_inline()
        schedule.caller_back(late)  # the third in a row
        assert not schedule.reads_inline()
        # and back: a caller that waits again
        for _ in range(10):
            schedule.caller_back(0.0)
        assert schedule.reads_inline()


def test_a_caller_back_within_the_gap_floor_keeps_reading_quicker_batches() -> None:
    schedule = _reading_inline()
    schedule.adopt(ReadFigures(10e-6, 1.0, 0.0))
    assert schedule.gap_bound() == GAP_FLOOR
    for _ in range(50):
        schedule.caller_back(8e-6)  # more than half of the batch's 10 us
        assert schedule.reads_inline()
    assert schedule.learned().gap > GAP_SHARE * 10e-6


def test_inline_chunks_follow_what_a_read_gives() -> None:
    schedule = _threads(max_chunk=64)
    schedule.batches_read(0.1e-3)  # chunks of 20
    assert schedule.chunk_size() == 20
    assert schedule.inline_chunk(False, False) == 20  # lists: a chunk, as a worker reads it
    assert schedule.inline_chunk(True, False) == 1  # batches of columns: one at a time
    assert schedule.inline_chunk(None, True) == 1  # not known before the first read
    assert schedule.inline_chunk(True, True) == COLUMN_CHUNK  # packed together: a few
    slow = _threads()
    slow.batches_read(1.0)
    assert slow.inline_chunk(True, True) == 1 and slow.inline_chunk(False, False) == 1


def test_shared_figures_are_kept_current_and_start_the_next_epoch() -> None:
    figures = ReadFigures()
    first = _reading_inline(figures)
    assert figures.known()
    assert figures.batch_seconds == pytest.approx(QUICK) and figures.gap == 0
    assert first.figures is figures
    # the next epoch's schedule: no job timed alone, the calling thread reads at once
    second = _threads(figures=figures)
    assert second.start(True)
    assert not second.probing and second.reads_inline()
    assert second.chunk_size() == 4


def test_figures_not_known_yet_start_a_probe() -> None:
    figures = ReadFigures(QUICK)  # a time, no CPU share: not known
    schedule = _threads(figures=figures)
    schedule.start(True)
    assert schedule.probing
    assert schedule.learned().batch_seconds == 0.0  # own figures, not the shared ones
    waiting = ReadFigures(QUICK, 0.05, 0.0)  # known: batches that wait
    second = _threads(figures=waiting)
    second.start(True)
    assert not second.probing and not second.reads_inline() and second.side_by_side()


def test_a_stage_without_shared_figures_keeps_its_own_across_starts_and_probes_again() -> None:
    schedule = _reading_inline()
    schedule.start(True)
    assert schedule.probing and not schedule.reads_inline()
    assert schedule.learned().batch_seconds == pytest.approx(QUICK)
    assert schedule.chunk_size() == 4


def test_learned_is_a_copy_and_adopt_goes_on_from_figures() -> None:
    schedule = _threads()
    copy = schedule.learned()
    copy.batch_seconds = 1.0
    assert schedule.learned().batch_seconds == 0.0
    schedule.adopt(copy)
    assert schedule.learned().batch_seconds == 1.0
    assert "ReadSchedule(threads=2" in repr(schedule) and "ReadFigures(" in repr(schedule)
