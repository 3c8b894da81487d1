"""The examples run as written: GuideLoom's distributed example (one rank and torchrun) and ours."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
#: a printed batch: ``rank=0: [[0, 1, 2, 3], [24, 25, 26, 27]]`` (a list of lists of ints)
_BATCH_ANYWHERE = re.compile(r"rank=(\d+): (\[\[[^\[\]]*\](?:, \[[^\[\]]*\])*\])")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("GUIDELOOM_PIPES_TORCH_FREE", None)
    return env


def _run(args: list[str], cwd: Path) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _batches(stdout: str) -> dict[int, list[list[list[int]]]]:
    by_rank: dict[int, list[list[list[int]]]] = {}
    # two ranks print to one pipe: a line's text and its newline are separate writes, so
    # one rank's line may end up glued to the other's; find every batch wherever it is
    for match in _BATCH_ANYWHERE.finditer(stdout):
        by_rank.setdefault(int(match[1]), []).append(ast.literal_eval(match[2]))
    return by_rank


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("example")
    _run([sys.executable, str(EXAMPLES / "write_shards.py")], workdir)
    return workdir


def _all_samples() -> list[list[int]]:
    return [list(range(4 * i, 4 * i + 4)) for i in range(16)]


def test_write_shards_writes_four_shards_of_sixteen_4_token_samples(shards):
    files = sorted(p.name for p in (shards / "data" / "sharded-tokens").glob("*.in_band.bin"))
    assert files == [f"{shard:07d}.in_band.bin" for shard in range(4)]
    tokens = np.concatenate(
        [np.fromfile(shards / "data" / "sharded-tokens" / name, dtype="<i4") for name in files]
    )
    assert tokens.tolist() == list(range(64))


@pytest.mark.timeout(240)
def test_train_distributed_runs_as_one_rank(shards):
    batches = _batches(_run([sys.executable, str(EXAMPLES / "train_distributed.py")], shards))
    assert list(batches) == [0]
    assert len(batches[0]) == 8
    assert sorted(s for batch in batches[0] for s in batch) == _all_samples()


def _torchrun() -> str | None:
    beside = Path(sys.executable).parent / "torchrun"  # the venv's, even if not on PATH
    return str(beside) if beside.exists() else shutil.which("torchrun")


@pytest.mark.timeout(240)
@pytest.mark.skipif(_torchrun() is None, reason="torchrun is not installed")
def test_train_distributed_under_torchrun_splits_the_samples_between_two_ranks(shards):
    stdout = _run(
        [
            _torchrun() or "torchrun",
            "--standalone",
            "--nproc-per-node=2",
            str(EXAMPLES / "train_distributed.py"),
        ],
        shards,
    )
    batches = _batches(stdout)
    assert sorted(batches) == [0, 1]
    for rank_batches in batches.values():
        assert len(rank_batches) == 4
        assert all(np.array(batch).shape == (2, 4) for batch in rank_batches)
    samples = [s for rank_batches in batches.values() for batch in rank_batches for s in batch]
    assert sorted(samples) == _all_samples()


@pytest.mark.timeout(240)
def test_custom_pipeline_example_resumes_at_the_identical_next_batch(tmp_path):
    stdout = _run([sys.executable, str(EXAMPLES / "custom_pipeline.py")], tmp_path)
    assert "resumed batch matches: True" in stdout


@pytest.mark.timeout(240)
def test_mix_and_pack_example_resumes_a_blend_of_packed_corpora_on_another_world_size(tmp_path):
    stdout = _run([sys.executable, str(EXAMPLES / "mix_and_pack.py")], tmp_path)
    assert "resumed steps match: True" in stdout
    assert "cu_seqlens of the first batch: [0," in stdout
    assert "windows of whole documents" in stdout and "best-fit cu_seqlens: [0," in stdout
    assert "weights history at position 12 [{'from': 0, 'interpolation': 'step'" in stdout
    assert "windows read twice after the restart: 0" in stdout


@pytest.mark.timeout(240)
def test_finetune_documents_example_pads_in_worker_processes_and_resumes(tmp_path):
    stdout = _run([sys.executable, str(EXAMPLES / "finetune_documents.py")], tmp_path)
    assert "batch fields: ['attention_mask', 'input_ids', 'labels', 'lengths']" in stdout
    shape = re.search(r"input_ids shape: \((\d+), (\d+)\)", stdout)
    assert shape is not None and int(shape[1]) == 4 and int(shape[2]) % 8 == 0
    assert len(re.findall(r"step \d: loss \d+\.\d+", stdout)) == 6
    assert "resumed batches match: True" in stdout


@pytest.mark.timeout(240)
def test_tokenize_corpus_writes_one_shard_per_file_with_eos_after_each_document(tmp_path):
    stdout = _run([sys.executable, str(EXAMPLES / "tokenize_corpus.py")], tmp_path)
    assert "first run: 8 shards written, 0 skipped" in stdout
    assert "second run: 0 shards written, 8 skipped" in stdout
    assert "shards:    8" in stdout and "samples:   50 (sequence length 64)" in stdout
    files = sorted((tmp_path / "corpus").glob("*.txt"))
    out = tmp_path / "data" / "corpus-tokens"
    for shard, path in enumerate(files):
        tokens = np.fromfile(out / f"{shard:07d}.in_band.bin", dtype="<i4")
        assert tokens[-1] == 256
        assert bytes(tokens[:-1].astype(np.uint8)) == path.read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_train_lightning_resumes_mid_epoch_with_the_batches_after_the_last_trained(shards):
    pytest.importorskip("lightning", reason="needs lightning (pip install guideloom_pipes[test])")
    out = _run([sys.executable, str(EXAMPLES / "train_lightning.py")], shards)
    steps = [
        (int(match[1]), ast.literal_eval(match[2]))
        for match in re.finditer(r"^step=(\d+): (\[\[.*\]\])$", out, re.MULTILINE)
    ]
    assert [step for step, _ in steps] == list(range(1, 17))  # stopped after 5, resumed at 6
    for epoch in (steps[:8], steps[8:]):  # each sample once an epoch: the resume went on
        assert sorted(sample for _, batch in epoch for sample in batch) == _all_samples()


def _corpora_tools() -> None:
    """Skip without the tools the corpora example writes with (the corpora-test extra)."""
    pytest.importorskip("pyarrow")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (megatron-core's optional fused kernels)
        pytest.importorskip("megatron.core.datasets.indexed_dataset")


@pytest.mark.timeout(240)
def test_train_on_corpora_blends_megatron_and_parquet_as_int32_and_resumes(tmp_path):
    _corpora_tools()
    stdout = _run([sys.executable, str(EXAMPLES / "train_on_corpora.py")], tmp_path)
    assert "corpora: MegatronIndexedStorage(" in stdout and "dtype='int32')" in stdout
    assert "ParquetStorage(" in stdout
    assert re.search(r"web 0\.70, code 0\.30", stdout)
    assert "tokens: torch.int32 (8, 32)" in stdout
    assert len(re.findall(r"step \d: loss \d+\.\d+", stdout)) == 8
    assert "resumed batches match: True" in stdout


def test_train_on_corpora_exits_naming_the_missing_extra(tmp_path):
    blocked = tmp_path / "blocked"
    (blocked / "pyarrow").mkdir(parents=True)
    (blocked / "pyarrow" / "__init__.py").write_text("raise ImportError('not installed here')\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocked), env["PYTHONPATH"]])
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_on_corpora.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 1
    assert "pyarrow (not installed here)" in done.stderr and "needs " in done.stderr
    assert "pip install" in done.stderr and "Traceback" not in done.stderr
