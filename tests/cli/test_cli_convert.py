"""``guideloom-pipes convert SRC DST``: a Parquet text table tokenized into our stream (and
documents), every token the tokenizer's own encode, EOS per document, on a local pool and on a
local Dask cluster; a rerun skips what is committed; bad usage is one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_cli import cli
from tokenizer_helpers import expected, texts, train_tokenizer

from guideloom_pipes import DocumentDataset, open_storage


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path, list[list[int]]]:
    """A Parquet text table (row groups of 3 rows), a tokenizer, and the ids it gives."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    documents = texts(4, 10)
    pq.write_table(pa.table({"text": documents}), tmp_path / "web.parquet", row_group_size=3)
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json")
    return tmp_path / "web.parquet", tmp_path / "tokenizer.json", expected(tokenizer, documents)


def test_convert_writes_the_tokenized_text_and_a_rerun_skips_it(
    tmp_path: Path, setup: tuple[Path, Path, list[list[int]]]
) -> None:
    table, tokenizer, want = setup
    out = tmp_path / "out"
    args = ("convert", table, out, "--tokenizer", tokenizer, "--eos-id", "</s>")
    done = cli(*args, "--workers", 2, "--shard-documents", 4, "--no-progress")
    assert done.returncode == 0, done.stderr
    assert f"{table} -> {out}: 3 shards written, 0 skipped" in done.stdout
    with open_storage(out).sync_reader() as reader:
        tokens = reader.read(0, reader.total_length)["tokens"]
    assert tokens.dtype == np.uint16 and tokens.tolist() == [t for ids in want for t in ids]
    again = json.loads(cli(*args, "--shard-documents", 4, "--json", "--no-progress").stdout)
    assert (again["written"], again["skipped"]) == ([], [0, 1, 2])


def test_convert_on_a_local_dask_cluster_writes_documents(
    tmp_path: Path, setup: tuple[Path, Path, list[list[int]]]
) -> None:
    pytest.importorskip("dask.distributed")
    table, tokenizer, want = setup
    out = tmp_path / "docs"
    done = cli(
        "convert", table, out, "--tokenizer", tokenizer, "--eos-id", 1, "--documents",
        "--dtype", "int32", "--dask", "--workers", 2, "--shard-documents", 5, "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with DocumentDataset(open_storage(out)).sync_reader() as reader:
        assert [d["tokens"].tolist() for d in reader] == want
        assert reader[0]["tokens"].dtype == np.int32


def test_bad_usage_is_one_line_naming_the_fix(
    tmp_path: Path, setup: tuple[Path, Path, list[list[int]]]
) -> None:
    table, tokenizer, _ = setup
    missing = cli("convert", table, tmp_path / "o", "--tokenizer", tmp_path / "none.json")
    assert missing.returncode == 2
    assert f"tokenizer file {tmp_path / 'none.json'} does not exist" in missing.stderr
    untokenized = cli("convert", table, tmp_path / "o")
    assert untokenized.returncode == 2 and "holds text" in untokenized.stderr
    assert "--tokenizer" in untokenized.stderr
    narrow = cli(
        "convert", table, tmp_path / "o", "--tokenizer", tokenizer, "--dtype", "uint8",
        "--no-progress",
    )  # fmt: skip
    assert narrow.returncode == 1, narrow.stderr
    assert narrow.stderr.startswith("guideloom-pipes: error: WriteParallelError: ")
    assert "does not fit dtype=uint8" in narrow.stderr
    assert len(narrow.stderr.strip().splitlines()) == 1


def test_shard_tokens_splits_a_stream_without_documents(tmp_path: Path) -> None:
    np.save(tmp_path / "tokens.npy", np.arange(10, dtype=np.uint16))
    out = tmp_path / "out"
    done = cli("convert", tmp_path / "tokens.npy", out, "--shard-tokens", 4, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["written"] == [0, 1, 2]
    with open_storage(out).sync_reader() as reader:
        assert reader.read(0, reader.total_length)["tokens"].tolist() == list(range(10))
