"""The CLI on a corpus another tool wrote (a Megatron prefix, or its .bin / .idx; Parquet
tables): ``info`` describes its files, tokens and documents, ``verify`` runs every open check
and reads every token, ``head`` prints its documents (or windows with ``-L``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from corpus_writers import megatron, megatron_read_back, write_megatron, write_parquet
from test_cli import cli

DOCUMENTS = [[np.array([5, 6, 7], np.uint16)], [np.array([300, 40000], np.uint16)]]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    megatron()  # (skips without megatron-core)
    return write_megatron(tmp_path / "corpus", DOCUMENTS, "uint16")


@pytest.fixture
def table(tmp_path: Path) -> Path:
    """Two Parquet files (row groups of one row) in a directory, with a text column."""
    folder = tmp_path / "table"
    folder.mkdir()
    for name, documents in (("a", DOCUMENTS[:1]), ("b", DOCUMENTS[1:])):
        texts = [f"document {name}"]
        write_parquet(folder / f"{name}.parquet", [d[0] for d in documents], "uint16", text=texts)
    return folder


@pytest.mark.parametrize("given", ["", ".bin", ".idx"])
def test_info_describes_a_megatron_corpus_by_its_files(corpus: Path, given: str) -> None:
    done = cli("info", f"{corpus}{given}", "-L", 2)
    assert done.returncode == 0, done.stderr
    assert "(MegatronIndexedStorage), written by Megatron-LM" in done.stdout
    assert "dtype:     uint16" in done.stdout
    assert "elements:  5" in done.stdout and "documents: 2" in done.stdout
    assert "samples:   2 (sequence length 2)" in done.stdout
    facts = json.loads(cli("info", corpus, "--json", "--dtype", "int32").stdout)
    assert (facts["dtype"], facts["read_as"], facts["elements"]) == ("uint16", "int32", 5)
    assert facts["files"] == [{"file": f"{corpus}.bin", "tokens": 5, "documents": 2, "bytes": 10}]


def test_verify_reads_every_token_and_refuses_one_past_the_dtype_asked_for(corpus: Path) -> None:
    done = cli("verify", corpus)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no checksums to verify: 1 files, 5 tokens" in done.stdout
    assert cli("verify", corpus, "--strict").returncode == 1
    narrow = cli("verify", corpus, "--dtype", "int16")
    assert narrow.returncode == 1
    assert f"token 40000 at element 4 of {corpus}.bin does not fit dtype=int16" in narrow.stdout
    Path(f"{corpus}.bin").write_bytes(Path(f"{corpus}.bin").read_bytes()[:-2])
    damaged = json.loads(cli("verify", corpus, "--json").stdout)
    assert not damaged["sound"] and "is 8 bytes, but its index" in damaged["problem"]


def test_head_prints_documents_or_windows(corpus: Path) -> None:
    documents = megatron_read_back(corpus)[1]
    lines = cli("head", corpus, "--json").stdout.splitlines()
    assert [json.loads(line)["tokens"] for line in lines] == [d.tolist() for d in documents]
    windows = cli("head", f"{corpus}.idx", "-L", 2, "-n", 9).stdout.splitlines()
    assert windows == ["0\ttokens=[5,6]", "1\ttokens=[7,300]"]
    refused = cli("head", corpus, "--kind", "document")
    assert refused.returncode == 2 and "drop --kind" in refused.stderr


def test_info_describes_parquet_tables_by_their_files(table: Path) -> None:
    done = cli("info", table, "-L", 2)
    assert done.returncode == 0, done.stderr
    assert "(ParquetStorage), written by Parquet" in done.stdout
    assert "column:    input_ids" in done.stdout and "dtype:     uint16" in done.stdout
    assert "elements:  5" in done.stdout and "documents: 2" in done.stdout
    assert "samples:   2 (sequence length 2)" in done.stdout
    facts = json.loads(cli("info", table / "b.parquet", "--json", "--dtype", "int32").stdout)
    assert (facts["dtype"], facts["read_as"], facts["elements"]) == ("uint16", "int32", 2)
    assert facts["files"][0]["file"] == str(table / "b.parquet")
    assert (facts["files"][0]["tokens"], facts["files"][0]["documents"]) == (2, 1)
    text = json.loads(cli("info", table, "--json", "--column", "text").stdout)
    assert (text["kind"], text["elements"], text["documents"]) == ("document", None, 2)


def test_verify_and_head_read_parquet_tables(table: Path) -> None:
    done = cli("verify", table)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no checksums to verify: 2 files, 5 tokens" in done.stdout
    narrow = cli("verify", table, "--dtype", "int16")
    assert narrow.returncode == 1
    assert f"token 40000 at element 1 of {table / 'b.parquet'} does not fit" in narrow.stdout
    lines = cli("head", table, "--json").stdout.splitlines()
    assert [json.loads(line)["tokens"] for line in lines] == [[5, 6, 7], [300, 40000]]
    windows = cli("head", table, "-L", 2, "-n", 9).stdout.splitlines()
    assert windows == ["0\ttokens=[5,6]", "1\ttokens=[7,300]"]
    texts = cli("head", table, "--column", "text").stdout.splitlines()
    assert texts == ["0\ttext=document a", "1\ttext=document b"]
    refused = cli("head", table, "--column", "text", "-L", 2)
    assert refused.returncode != 0 and "a tokenizer" in refused.stderr
