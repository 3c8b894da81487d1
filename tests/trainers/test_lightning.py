"""PyTorch Lightning trains on ``guideloom_pipes.DataLoader``: ``Trainer.fit`` checkpoints
it mid-epoch (Lightning saves a loader's ``state_dict()``) and ``fit(ckpt_path=...)``
continues with exactly the batches of the uninterrupted run, on one process and under
``strategy="ddp"`` on 2 CPU processes (gloo), where Lightning rebuilds our loader with its
``DistributedSampler``. Each run is the script ``lightning_script.py`` in a subprocess
(``ddp`` starts its ranks by running the command line again)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from script_helpers import run_script

pytest.importorskip("torch")
pytest.importorskip("lightning", reason="needs lightning (pip install guideloom_pipes[test])")

SCRIPT = Path(__file__).with_name("lightning_script.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _fit(out: Path, tag: str, *args: str) -> None:
    run_script([sys.executable, str(SCRIPT), str(out), tag, *args], out)


def _steps(out: Path, tag: str, rank: int) -> list[list[object]]:
    lines = (out / f"{tag}-rank{rank}.txt").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _stopped_and_resumed(out: Path, stop: int, *args: str) -> None:
    _fit(out, "part", "--stop", str(stop), *args)
    (checkpoint,) = (out / "ckpt").iterdir()
    _fit(out, "part", "--resume", str(checkpoint), *args)
    (out / "ckpt" / checkpoint.name).unlink()


@pytest.mark.parametrize(("workers", "stops"), [(0, [5]), (2, [3, 8, 11])])
def test_fit_resumed_mid_epoch_trains_on_the_uninterrupted_runs_batches(
    tmp_path: Path, workers: int, stops: list[int]
) -> None:
    options = ("--workers", str(workers))
    _fit(tmp_path, "whole", *options)
    whole = _steps(tmp_path, "whole", 0)
    assert len(whole) == 16  # (24 samples, batches of 3, 2 epochs)
    for epoch in (0, 1):
        seen = sorted(i for e, batch in whole if e == epoch for i in batch)
        assert seen == list(range(24))
    for stop in stops:  # (8: the end of the first epoch)
        (tmp_path / "part-rank0.txt").unlink(missing_ok=True)
        _stopped_and_resumed(tmp_path, stop, *options)
        assert _steps(tmp_path, "part", 0) == whole, stop


@pytest.mark.parametrize("stop", [3, 6])
def test_ddp_on_two_processes_gives_each_rank_its_half_and_resumes_both_exactly(
    tmp_path: Path, stop: int
) -> None:
    options = ("--workers", "2", "--devices", "2")
    _fit(tmp_path, "whole", *options)
    ranks = [_steps(tmp_path, "whole", rank) for rank in (0, 1)]
    for rank in (0, 1):  # Lightning rebuilt our loader with its DistributedSampler
        loaders = (tmp_path / f"whole-rank{rank}-loader.txt").read_text().split()
        assert loaders[:2] == [
            "guideloom_pipes.loader.torch_loader.DataLoader",
            "torch.utils.data.distributed.DistributedSampler",
        ]
    for epoch in (0, 1):
        halves = [[i for e, batch in steps if e == epoch for i in batch] for steps in ranks]
        assert len(halves[0]) == len(halves[1]) == 12
        assert sorted(halves[0] + halves[1]) == list(range(24))
    _stopped_and_resumed(tmp_path, stop, *options)
    assert [_steps(tmp_path, "part", rank) for rank in (0, 1)] == ranks
