"""Hugging Face Accelerate with ``guideloom_pipes.DataLoader``, under 2 CPU processes
(``torchrun``, gloo): ``save_state`` mid-epoch and ``load_state`` in new processes go on
with exactly the batches of the uninterrupted run, each sample once per epoch across the
processes, both ways of using it (``accelerate_script.py``):

- ours, sharded by a ``DistributedSampler`` and registered for checkpointing: it reads
  with our stages and resumes from its own ``state_dict()``;
- given to ``accelerator.prepare``, which rebuilds it as Accelerate's own loader (torch's
  reader underneath) and resumes it with ``skip_first_batches``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from script_helpers import run_script

pytest.importorskip("torch")
pytest.importorskip("accelerate", reason="needs accelerate (pip install guideloom_pipes[test])")

SCRIPT = Path(__file__).with_name("accelerate_script.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _torchrun(out: Path, tag: str, *args: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run_script([*command, "--nproc-per-node=2", str(SCRIPT), str(out), tag, *args], out)


def _steps(out: Path, tag: str) -> list[list[list[object]]]:
    files = [out / f"{tag}-rank{rank}.txt" for rank in (0, 1)]
    return [[json.loads(line) for line in file.read_text().splitlines()] for file in files]


@pytest.mark.parametrize(
    ("mode", "reader"),
    [
        ("ours", "guideloom_pipes.loader.torch_loader.DataLoader"),
        ("prepared", "torch.utils.data.dataloader.DataLoader"),
    ],
)
def test_save_state_mid_epoch_and_load_state_in_new_processes_go_on_exactly(
    tmp_path: Path, mode: str, reader: str
) -> None:
    _torchrun(tmp_path, "whole", "--mode", mode)
    whole = _steps(tmp_path, "whole")
    for rank in (0, 1):
        assert (tmp_path / f"whole-rank{rank}-loader.txt").read_text().split() == [reader]
    for epoch in (0, 1):
        halves = [[i for e, batch in steps if e == epoch for i in batch] for steps in whole]
        assert len(halves[0]) == len(halves[1]) == 12
        assert sorted(halves[0] + halves[1]) == list(range(24))
    for stop in (3, 6):  # (4 steps an epoch: the first epoch's middle, the second's)
        for rank in (0, 1):
            (tmp_path / f"part-rank{rank}.txt").unlink(missing_ok=True)
        _torchrun(tmp_path, "part", "--mode", mode, "--stop", str(stop))
        _torchrun(tmp_path, "part", "--mode", mode, "--resume")
        shutil.rmtree(tmp_path / "state")
        assert _steps(tmp_path, "part") == whole, stop
