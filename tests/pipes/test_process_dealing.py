"""Worker processes dealt jobs round robin and seeded as torch seeds its workers
(``ProcessPool(deal="round_robin", torch_seeding=True)``): what ``guideloom_pipes.DataLoader``
builds torch's draws in ``__getitem__`` from (process workers never have the calling thread
read for them, so every batch is read by the worker it was dealt)."""

from __future__ import annotations

import multiprocessing
import random
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import torch
from random_helpers import Draws, WhoReads
from torch.utils.data._utils.worker import _generate_state

from guideloom_pipes.pipes.seeding import seed_globals_as_torch
from guideloom_pipes.pipes.workers.processes import ProcessPool

pytestmark = pytest.mark.timeout(180)

CONTEXT = multiprocessing.get_context("forkserver")


def _one_batch_each(pool: ProcessPool, count: int) -> list[Any]:
    """Submit ``count`` one-sample jobs, each read back before the next is sent (so every
    worker is idle when a job is dealt): the samples."""
    samples = []
    for index in range(count):
        job = pool.submit([np.array([index], dtype=np.int64)])
        outcomes, _, _ = pool.result(job, 60.0)
        samples.append(outcomes[0][0])
    return samples


@pytest.mark.parametrize("deal", ["least_busy", "round_robin"])
def test_round_robin_deals_job_k_to_worker_k_mod_n_whatever_their_load(deal: str) -> None:
    pool = ProcessPool(WhoReads(8), None, 3, CONTEXT, base_seed=0, deal=deal)  # type: ignore[arg-type]
    try:
        first = [sample[1][0] for sample in _one_batch_each(pool, 7)]
        pool.begin(WhoReads(8), None)  # a new epoch deals from worker 0 again
        second = [sample[1][0] for sample in _one_batch_each(pool, 4)]
    finally:
        pool.close()
    if deal == "round_robin":
        assert first == [0, 1, 2, 0, 1, 2, 0]
        assert second == [0, 1, 2, 0]
    else:  # every worker idle at each submit: the least busy is the first
        assert first == [0] * 7
        assert second == [0] * 4


def test_a_deal_that_is_not_known_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"deal must be one of .*'round-robin'"):
        ProcessPool(WhoReads(2), None, 1, CONTEXT, deal="round-robin")  # type: ignore[arg-type]


@pytest.mark.parametrize(("base_seed", "worker_id"), [(0, 0), (12345, 1), (2**62 + 17, 3)])
def test_torch_seeding_seeds_random_torch_and_numpy_as_torchs_workers(
    base_seed: int, worker_id: int
) -> None:
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_generate_state(base_seed, worker_id))
    expected = (random.random(), float(torch.rand(())), float(np.random.rand()))
    random.seed(1)
    torch.manual_seed(1)
    np.random.seed(1)
    seed_globals_as_torch(base_seed, worker_id)
    assert (random.random(), float(torch.rand(())), float(np.random.rand())) == expected


def _torch_worker_draws(base_seed: int, workers: int, count: int) -> list[Any]:
    """What torch's workers, seeded from ``base_seed``, draw for samples ``0..count-1``
    dealt round robin: the draws of worker ``k % workers``'s stream."""
    streams: list[list[Any]] = []
    for worker in range(workers):
        random.seed(base_seed + worker)
        torch.manual_seed(base_seed + worker)
        np.random.seed(_generate_state(base_seed, worker))
        streams.append([Draws(count)[index] for index in range(worker, count, workers)])
    return [streams[index % workers][index // workers] for index in range(count)]


def test_round_robin_with_torch_seeding_gives_each_sample_its_torch_worker_draws() -> None:
    pool = ProcessPool(
        Draws(7), None, 2, CONTEXT, base_seed=99, deal="round_robin", torch_seeding=True
    )
    try:
        got = _one_batch_each(pool, 7)
    finally:
        pool.close()
    assert got == _torch_worker_draws(99, 2, 7)


def test_without_torch_seeding_the_workers_draw_from_other_streams() -> None:
    pool = ProcessPool(Draws(4), None, 2, CONTEXT, base_seed=99, deal="round_robin")
    try:
        got = _one_batch_each(pool, 4)
    finally:
        pool.close()
    expected = _torch_worker_draws(99, 2, 4)
    assert [sample[0] for sample in got] == [sample[0] for sample in expected]
    assert [sample[2] for sample in got] != [sample[2] for sample in expected]  # numpy's
