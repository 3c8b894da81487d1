"""Worker randomness, worker info, worker_init_fn and the loader's worker processes: the base
seed (torch's global RNG or ``generator``), per-batch seeds in every mode, exact resumes of
datasets that draw random numbers, ``get_worker_info()`` in threads and processes, and one
pool of worker processes per loader."""

from __future__ import annotations

import gc
import multiprocessing
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import torch
from loader_helpers import Ids, ids_collate, threads_end
from random_helpers import (
    BatchDraws,
    BothAsk,
    Draws,
    InitCalls,
    WhoReads,
    draws_collate,
    failing_init,
    tag_worker,
)

from guideloom_pipes import StatefulDataLoader, get_worker_info
from guideloom_pipes.pipes import batch_rng

pytestmark = [
    pytest.mark.filterwarnings("ignore:prefetch \\* local_batch_size"),
    pytest.mark.timeout(180),
]

REPO = Path(__file__).resolve().parents[2]
PROCESSES = {"num_workers": 2, "parallel_method": "process"}
MODES = {
    "inline": {},
    "2-threads": {"num_workers": 2},
    "2-processes": PROCESSES,
}


def _loader(dataset: Any, collate_fn: Any = list, **kw: Any) -> StatefulDataLoader:
    kw.setdefault("local_batch_size", 3)
    return StatefulDataLoader(dataset, collate_fn, device="cpu", **kw)


def _epochs(loader: StatefulDataLoader, count: int) -> list[list[Any]]:
    with loader:
        return [list(loader) for _ in range(count)]


# -- the base seed ------------------------------------------------------------------------------


def test_torch_manual_seed_makes_an_unseeded_shuffle_reproducible():
    orders = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        loader = _loader(Ids(40), ids_collate, shuffle=True)
        orders.append((loader.shuffle_seed, loader.base_seed, list(loader)))
    assert orders[0] == orders[1]
    assert orders[0][2] != orders[2][2]  # another seed, another order
    assert orders[0][0] == orders[0][1]  # the unseeded shuffle uses the base seed


def test_a_generator_gives_the_base_seed_and_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    seeds = [_loader(Ids(9), generator=torch.Generator().manual_seed(7)).base_seed for _ in "ab"]
    assert seeds[0] == seeds[1]
    assert torch.equal(torch.get_rng_state(), before)


def test_an_explicit_shuffle_seed_keeps_its_order_whatever_the_base_seed():
    orders = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        orders.append(list(_loader(Ids(40), ids_collate, shuffle=True, shuffle_seed=5)))
    assert orders[0] == orders[1]


def test_state_dict_carries_the_base_seed_and_loading_restores_it():
    saved = _loader(Ids(12), generator=torch.Generator().manual_seed(3))
    state = saved.state_dict()
    assert state["base_seed"] == saved.base_seed
    loader = _loader(Ids(12), generator=torch.Generator().manual_seed(4))
    assert loader.base_seed != saved.base_seed
    loader.load_state_dict(state)
    assert loader.base_seed == saved.base_seed
    guideloom_keys = ("epoch", "observation_offset", "shuffle", "shuffle_seed", "drop_last")
    other = _loader(Ids(12), generator=torch.Generator().manual_seed(4))
    own = other.base_seed
    other.load_state_dict({key: state[key] for key in guideloom_keys})  # GuideLoom's state
    assert other.base_seed == own


def test_a_bad_base_seed_in_a_state_is_refused():
    loader = _loader(Ids(12))
    with pytest.raises(ValueError, match="base_seed"):
        loader.load_state_dict({**loader.state_dict(), "base_seed": -1})


# -- per-batch seeds ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["inline", "2-processes"])
def test_draws_in_getitem_never_repeat_across_workers_and_epochs(mode):
    torch.manual_seed(0)
    epochs = _epochs(_loader(Draws(24), **MODES[mode]), 2)
    draws = [sample[1:] for epoch in epochs for batch in epoch for sample in batch]
    assert len(draws) == 48
    for column in range(3):  # torch, numpy, random
        values = [d[column] for d in draws]
        assert len(set(values)) == len(values)


def test_draws_do_not_depend_on_the_mode_or_on_which_worker_reads_a_batch():
    results = []
    for kw in (MODES["inline"], PROCESSES, {**PROCESSES, "num_workers": 1}):
        torch.manual_seed(0)
        results.append(_epochs(_loader(Draws(24), draws_collate, **kw), 2))
    assert results[0] == results[1] == results[2]


def test_batch_rng_gives_the_same_draws_with_threads_processes_and_inline():
    results = []
    for kw in MODES.values():
        torch.manual_seed(0)
        results.append(_epochs(_loader(BatchDraws(24), **kw), 2))
    assert results[0] == results[1] == results[2]
    draws = [s[1] for epoch in results[0] for batch in epoch for s in batch]
    assert len(set(draws)) == len(draws)
    assert batch_rng() is None  # outside a batch's read


@pytest.mark.parametrize("mode", ["inline", "2-processes"])
def test_a_resumed_run_repeats_the_draws_of_the_uninterrupted_one(mode):
    kw = {**MODES[mode], "shuffle": True}
    torch.manual_seed(0)
    whole = _epochs(_loader(Draws(24), **kw), 2)
    torch.manual_seed(0)
    first = _loader(Draws(24), **kw)
    with first:
        head = list(first)
        it = iter(first)
        head2 = [next(it), next(it)]
        state = first.state_dict()
        it.close()
    torch.manual_seed(123)  # another process, another global RNG
    resumed = _loader(Draws(24), **kw)
    resumed.load_state_dict(state)
    with resumed:
        tail = list(resumed)
    assert head == whole[0]
    assert head2 + tail == whole[1]


def _loop_draws(loader, state=None):
    """What a training loop draws from the global generators after each batch it gets."""
    if state is not None:
        loader.load_state_dict(state)
    draws = []
    with loader:
        for _ in loader:
            draws.append((torch.rand(1).item(), float(np.random.rand()), random.random()))
    return draws


def test_reading_inline_leaves_the_training_loops_draws_a_function_of_the_batch():
    # the global generators continue from each batch's seed: the loop's own draws after a
    # batch are the same in another run, after a resume, whatever was seeded before
    torch.manual_seed(5)
    whole = _loop_draws(_loader(Draws(12)))
    torch.manual_seed(5)
    first = _loader(Draws(12))
    with first:
        it = iter(first)
        next(it)
        state = first.state_dict()
        it.close()
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    assert _loop_draws(_loader(Draws(12)), state) == whole[1:]
    assert len(set(whole)) == len(whole)  # and they differ from batch to batch


def _global_draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_seeded_sets_the_batch_generators_and_restores_the_outer_ones():
    from guideloom_pipes.pipes.seeding import seed_globals, seeded

    seed_globals(11)
    expected = _global_draws()
    assert batch_rng() is None
    with seeded(7, "local"):
        outer = batch_rng()
        assert outer is not None and outer.seed == 7
        with seeded(11, "globals"):  # nested: the inner batch's, and the globals seeded
            assert batch_rng().seed == 11  # type: ignore[union-attr]
            assert _global_draws() == expected
        assert batch_rng() is outer
        random.seed(3)
        before = random.getstate()
        with seeded(8, "local"):  # the global generators left alone
            assert random.getstate() == before
    assert batch_rng() is None


def test_seeded_restores_the_batch_generators_when_its_body_or_seeding_raises(monkeypatch):
    from guideloom_pipes.pipes import seeding

    with pytest.raises(KeyError), seeding.seeded(5, "globals"):
        raise KeyError("a collate's error")
    assert batch_rng() is None

    def refuse(seed: int) -> None:
        raise RuntimeError(f"cannot seed {seed}")

    monkeypatch.setattr(seeding, "seed_globals", refuse)
    with pytest.raises(RuntimeError, match="cannot seed 5"), seeding.seeded(5, "globals"):
        pytest.fail("the body ran although seeding failed")
    assert batch_rng() is None


# -- get_worker_info ----------------------------------------------------------------------------


def test_get_worker_info_in_worker_processes():
    loader = _loader(WhoReads(12), **PROCESSES)
    samples = [s for batch in _epochs(loader, 1)[0] for s in batch]
    fields = {s[1][:3] for s in samples}
    assert fields <= {(0, 2, loader.base_seed), (1, 2, loader.base_seed + 1)}
    assert all(s[1][3] for s in samples)  # info.dataset is the worker's own copy
    assert get_worker_info() is None


def test_get_worker_info_per_thread():
    dataset = WhoReads(30)
    # With a timeout the training thread never reads a batch itself: worker threads read all.
    loader = _loader(dataset, num_workers=2, timeout=60)
    samples = [s for batch in _epochs(loader, 1)[0] for s in batch]
    seed = loader.base_seed
    expected = {(0, 2, seed, True, "thread"), (1, 2, seed + 1, True, "thread")}
    assert {s[1] for s in samples} <= expected
    assert get_worker_info() is None


def test_torchs_get_worker_info_is_none_in_worker_threads():
    # (ours answers per thread; torch's is one value per process: the loader sets it only in
    # worker processes, as torch does, and never rewrites torch's function)
    loader = _loader(BothAsk(30), num_workers=2, timeout=60)
    samples = [s for batch in _epochs(loader, 1)[0] for s in batch]
    seed = loader.base_seed
    assert {s[1] for s in samples} == {None}
    assert {s[2] for s in samples} <= {(0, 2, seed), (1, 2, seed + 1)}
    assert None not in {s[2] for s in samples}


def test_torchs_get_worker_info_answers_in_worker_processes_as_ours_does():
    loader = _loader(BothAsk(12), **PROCESSES)
    samples = [s for batch in _epochs(loader, 1)[0] for s in batch]
    seed = loader.base_seed
    assert {s[1] for s in samples} <= {(0, 2, seed), (1, 2, seed + 1)}
    assert None not in {s[1] for s in samples}
    assert all(s[1] == s[2] for s in samples)
    assert torch.utils.data.get_worker_info() is None and get_worker_info() is None


def test_importing_the_package_leaves_torchs_get_worker_info_alone():
    code = """
import torch.utils.data as data
import torch.utils.data._utils.worker as worker
import torch.utils.data.dataloader as dataloader

function = data.get_worker_info
code = function.__code__
names = set(vars(worker))
import guideloom_pipes
import guideloom_pipes.pipes.read
from guideloom_pipes import StatefulDataLoader, get_worker_info
list(StatefulDataLoader(list(range(8)), list, local_batch_size=2, num_workers=2))
assert function.__code__ is code, "torch's get_worker_info was rewritten"
assert data.get_worker_info is worker.get_worker_info is dataloader.get_worker_info is function
assert set(vars(worker)) == names, set(vars(worker)) ^ names
assert get_worker_info() is None
print("ok")
"""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_batches_the_training_thread_reads_for_busy_thread_workers_see_no_worker_info():
    # All samples here: read either by a worker (its info) or by the training thread (None,
    # as in torch's main process); never another thread's info.
    loader = _loader(WhoReads(30), num_workers=2)
    seed = loader.base_seed
    allowed = {None, (0, 2, seed, True, "thread"), (1, 2, seed + 1, True, "thread")}
    assert {s[1] for batch in loader for s in batch} <= allowed


def test_num_workers_0_has_no_worker_info():
    samples = [s for batch in _epochs(_loader(WhoReads(6), prefetch=1), 1)[0] for s in batch]
    assert {s[1] for s in samples} == {None}


# -- worker_init_fn -----------------------------------------------------------------------------


def test_worker_init_fn_runs_once_in_each_worker_thread_after_its_info_is_set():
    init = InitCalls()
    loader = _loader(Ids(30), ids_collate, num_workers=2, worker_init_fn=init)
    list(loader)
    assert sorted(call[0] for call in init.calls) == [0, 1]
    assert len({call[1] for call in init.calls}) == 2  # one per thread
    assert all(call[2].id == call[0] and call[2].num_workers == 2 for call in init.calls)
    assert threading.get_ident() not in {call[1] for call in init.calls}


@pytest.mark.parametrize("mode", ["2-threads", "2-processes"])
def test_a_failing_worker_init_fn_raises_at_the_first_batch(mode):
    loader = _loader(Ids(30), ids_collate, worker_init_fn=failing_init, **MODES[mode])
    with loader, pytest.raises(ValueError, match="cannot start"):
        next(iter(loader))
    assert multiprocessing.active_children() == []
    assert threads_end() == []


def test_worker_init_fn_must_pickle_for_process_workers():
    with pytest.raises(TypeError, match=r"worker_init_fn .* cannot be pickled"):
        _loader(Ids(12), worker_init_fn=lambda worker_id: None, **PROCESSES)


# -- worker processes: one pool per loader ------------------------------------------------------


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_processes_start_once_per_loader(persistent):
    dataset = WhoReads(12)
    loader = _loader(dataset, worker_init_fn=tag_worker, persistent_workers=persistent, **PROCESSES)
    with loader:
        epochs = []
        for epoch in range(3):
            dataset.set_epoch(epoch)
            epochs.append([s for batch in loader for s in batch])
        assert len(multiprocessing.active_children()) == 2
    assert multiprocessing.active_children() == []
    pids = {s[2] for samples in epochs for s in samples}
    assert len(pids) <= 2  # the same two processes read every epoch
    for epoch, samples in enumerate(epochs):
        for sample in samples:
            worker_id = sample[1][0]
            if persistent:  # the workers keep their first copy, set up once
                assert (sample[3], sample[4]) == (0, (worker_id,))
            else:  # a fresh copy each epoch: the main process's set_epoch is seen
                assert (sample[3], sample[4]) == (epoch, (worker_id,))


@pytest.mark.parametrize("ending", ["close", "with", "gc"])
def test_no_worker_process_outlives_its_loader(ending):
    loader = _loader(Ids(30), ids_collate, **PROCESSES)
    if ending == "with":
        with loader:
            list(loader)
            assert len(multiprocessing.active_children()) == 2
    else:
        list(loader)
        it = iter(loader)
        next(it)  # an iterator left mid-epoch too
        assert len(multiprocessing.active_children()) == 2
        if ending == "close":
            loader.close()
        else:
            del it, loader
            gc.collect()
    assert multiprocessing.active_children() == []


def test_an_epoch_after_an_early_close_drops_the_answers_still_in_flight():
    loader = _loader(Ids(60), ids_collate, **PROCESSES, prefetch=4)
    expected = list(_loader(Ids(60), ids_collate))
    with loader:
        it = iter(loader)
        assert next(it) == expected[0]
        it.close()  # batches read ahead are still coming
        assert list(loader) == expected  # the epoch restarts, as GuideLoom's does


@pytest.mark.parametrize("mode", ["2-threads", "2-processes"])
def test_default_collate_in_workers_stacks_into_ordinary_memory(mode):
    # torch's collate stacks into shared memory when get_worker_info() is set; ours need not
    loader = _loader(np.arange(40).reshape(20, 2), None, timeout=60, **MODES[mode])
    batches = _epochs(loader, 1)[0]
    assert torch.equal(torch.cat(batches), torch.arange(36).reshape(18, 2))
    assert not any(batch.is_shared() for batch in batches)
