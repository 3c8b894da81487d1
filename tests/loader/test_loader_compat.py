"""GuideLoom 1.1's own loader orders and resumes (``expected.json``), reproduced batch for batch."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
from loader_helpers import Ids, closed_at_the_end, ids_collate, stream_ids_collate

from guideloom_pipes import StatefulDataLoader, StreamNumpyFormat, StreamStorage
from guideloom_pipes.pipes import ReadSamples
from guideloom_pipes.pipes.workers.threads import ThreadPool

DATA = Path(__file__).parents[1] / "data" / "guideloom-1.1"
EXPECTED = json.loads((DATA / "expected.json").read_text())
ORDERS = EXPECTED["loader_orders"]
RUNS = ORDERS["runs"]
RESUMES = EXPECTED["resumes"]
N = ORDERS["num_samples"]
GUIDELOOM_KEYS = ("epoch", "observation_offset", "shuffle", "shuffle_seed", "drop_last")


@pytest.fixture(autouse=True)
def _loaders_closed_whatever_happens(monkeypatch):
    with closed_at_the_end(monkeypatch, (StatefulDataLoader, ReadSamples, ThreadPool)):
        yield


def _run_id(run: dict[str, Any]) -> str:
    c = run["config"]
    shuffle = f"seed{c['shuffle_seed']}" if c["shuffle"] else "ordered"
    drop = "drop" if c["drop_last"] else "pad"
    return f"ws{c['world_size']}-r{c['rank']}-b{c['local_batch_size']}-{shuffle}-{drop}"


def _loader(dataset: Any, config: dict[str, Any], collate=ids_collate, **kw: Any):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GuideLoom's prefetch/num_workers advice
        return StatefulDataLoader(dataset, collate, device="cpu", **config, **kw)


def _guideloom_state(loader: StatefulDataLoader) -> dict[str, Any]:
    state = loader.state_dict()
    return {key: state[key] for key in GUIDELOOM_KEYS}


def _three_epochs(loader: StatefulDataLoader) -> list[list[list[int]]]:
    with loader:
        return [list(loader) for _ in range(3)]


def _stream_storage() -> StreamStorage:
    dtype = np.dtype([tuple(field) for field in EXPECTED["stream"]["dtype"]])
    return StreamStorage(DATA / "stream", StreamNumpyFormat(dtype))


def test_the_fixture_covers_every_config():
    assert len(RUNS) == 108 and N == 22


@pytest.mark.parametrize("run", RUNS, ids=_run_id)
def test_loader_orders_inline(run):
    loader = _loader(Ids(N), run["config"])
    assert _three_epochs(loader) == run["epochs"]
    assert _guideloom_state(loader) == run["final_state"]


@pytest.mark.parametrize("run", RUNS, ids=_run_id)
def test_loader_orders_with_thread_workers_and_prefetch(run):
    loader = _loader(Ids(N), run["config"], num_workers=2, prefetch=2)
    assert _three_epochs(loader) == run["epochs"]
    assert _guideloom_state(loader) == run["final_state"]


@pytest.mark.parametrize("run", RUNS[::9], ids=_run_id)
def test_loader_orders_with_prefetch_and_no_workers(run):
    loader = _loader(Ids(N), run["config"], prefetch=1)
    assert _three_epochs(loader) == run["epochs"]


@pytest.mark.parametrize("run", RUNS, ids=_run_id)
def test_loader_orders_from_the_guideloom_written_stream_storage(run):
    config = dict(run["config"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = StatefulDataLoader.from_storage(
            _stream_storage(),
            stream_ids_collate,
            sequence_length=ORDERS["sequence_length"],
            device="cpu",
            **config,
        )
    assert _three_epochs(loader) == run["epochs"]


_PROCESS_RUNS = [
    (run, context)
    for run, context in zip(
        [
            next(r for r in RUNS if _run_id(r) == "ws3-r2-b4-seed42-pad"),
            next(r for r in RUNS if _run_id(r) == "ws2-r1-b3-seed7-drop"),
        ],
        ["spawn", "forkserver"],
    )
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("run", "context"), _PROCESS_RUNS, ids=[f"{_run_id(r)}-{c}" for r, c in _PROCESS_RUNS]
)
def test_loader_orders_with_process_workers(run, context):
    loader = _loader(
        Ids(N),
        run["config"],
        num_workers=2,
        parallel_method="process",
        multiprocessing_context=context,
        prefetch=1,
    )
    assert _three_epochs(loader) == run["epochs"]
    assert _guideloom_state(loader) == run["final_state"]


def _resume_id(case: dict[str, Any]) -> str:
    c = case["config"]
    return (
        f"ws{c['world_size']}-b{c['local_batch_size']}-at{case['state_dict']['observation_offset']}"
    )


@pytest.mark.parametrize("case", RESUMES, ids=_resume_id)
def test_resumes_save_the_same_state_as_guideloom(case):
    loader = _loader(Ids(N), case["config"])
    it = iter(loader)
    assert [next(it) for _ in case["batches_before_save"]] == case["batches_before_save"]
    assert _guideloom_state(loader) == case["state_dict"]
    it.close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("case", RESUMES, ids=_resume_id)
def test_resumes_continue_with_the_same_batches_on_any_world_and_batch_size(case, workers):
    for resumed in case["resumed"]:
        loader = _loader(Ids(N), resumed["config"], num_workers=workers, prefetch=workers)
        loader.load_state_dict(case["state_dict"])  # GuideLoom's five keys only
        epochs = [list(loader) for _ in resumed["epochs_after_resume"]]
        assert epochs == resumed["epochs_after_resume"]
        assert _guideloom_state(loader) == resumed["final_state"]
