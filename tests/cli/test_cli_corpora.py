"""The CLI on a corpus another tool wrote (a Megatron prefix, or its .bin / .idx): ``info``
describes its files, tokens and documents, ``verify`` runs every open check and reads every
token, ``head`` prints its documents (or windows with ``-L``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from corpus_writers import megatron, megatron_read_back, write_megatron
from test_cli import cli

megatron()  # (the module skips without megatron-core)

DOCUMENTS = [[np.array([5, 6, 7], np.uint16)], [np.array([300, 40000], np.uint16)]]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_megatron(tmp_path / "corpus", DOCUMENTS, "uint16")


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
