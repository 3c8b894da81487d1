"""TokenizedDataset: text documents (a Parquet text column, a list of strings) read as the
tokenizer's ids with EOS appended, cut to max_length; through the loader with pad_collate, in
thread and process workers, a run resumed at every step equals the uninterrupted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizer_helpers import expected, texts, train_tokenizer

from guideloom_pipes import DocumentDataset, ParquetStorage, TokenizedDataset


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    train_tokenizer(tmp_path / "tokenizer.json")
    return tmp_path / "tokenizer.json"


@pytest.fixture
def table(tmp_path: Path) -> tuple[Path, list[str]]:
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    documents = texts(5, 19)
    pq.write_table(pa.table({"text": documents}), tmp_path / "web.parquet", row_group_size=4)
    return tmp_path / "web.parquet", documents


def test_samples_are_the_tokenizers_ids_then_eos_as_int32(
    tokenizer_file: Path, table: tuple[Path, list[str]]
) -> None:
    path, documents = table
    tokenizer = train_tokenizer(tokenizer_file)
    dataset = TokenizedDataset(DocumentDataset(ParquetStorage(path, "text")), tokenizer_file, 1)
    with dataset.sync_reader() as reader:
        assert len(reader) == len(documents)
        got = [sample["tokens"] for sample in reader]
    assert [t.tolist() for t in got] == expected(tokenizer, documents, eos=1)
    assert {t.dtype for t in got} == {np.dtype(np.int32)}
    assert got[2].tolist() == [1]  # (an empty text: its EOS alone)


def test_a_storage_a_list_of_strings_and_an_eos_token_work_too(tokenizer_file: Path) -> None:
    documents = texts(6, 5)
    tokenizer = train_tokenizer(tokenizer_file)
    dataset = TokenizedDataset(documents, tokenizer_file, eos_id="</s>")
    assert dataset.eos_id == 1 and len(dataset) == 5
    assert dataset[3]["tokens"].tolist() == expected(tokenizer, documents[3:4])[0]
    plain = TokenizedDataset([{"text": t} for t in documents], tokenizer_file)
    assert [s["tokens"].tolist() for s in plain[:]] == expected(tokenizer, documents, eos=None)


def test_max_length_cuts_the_tokens_and_eos_together(tokenizer_file: Path) -> None:
    documents = texts(7, 8)
    tokenizer = train_tokenizer(tokenizer_file)
    dataset = TokenizedDataset(documents, tokenizer_file, eos_id=1, max_length=4)
    want = [ids[:4] for ids in expected(tokenizer, documents)]
    assert [s["tokens"].tolist() for s in dataset[:]] == want
    assert max(len(ids) for ids in want) == 4


def test_bad_arguments_and_samples_are_refused_naming_the_fix(tokenizer_file: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .* does not exist"):
        TokenizedDataset(["a"], tokenizer_file.with_name("missing.json"))
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        TokenizedDataset(["a"], tokenizer_file, max_length=0)
    with pytest.raises(TypeError, match="sample 0 is 5: TokenizedDataset reads text documents"):
        TokenizedDataset([5], tokenizer_file)[0]


def _loader(dataset: Any, **options: Any) -> Any:
    pytest.importorskip("torch")
    from guideloom_pipes import StatefulDataLoader, pad_collate

    return StatefulDataLoader(
        dataset,
        pad_collate,
        local_batch_size=3,
        shuffle=True,
        shuffle_seed=11,
        device="cpu",
        **options,
    )


def _same(one: list[dict[str, Any]], other: list[dict[str, Any]]) -> bool:
    return len(one) == len(other) and all(
        a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
        for a, b in zip(one, other)
    )


@pytest.mark.parametrize(
    "options",
    [{}, {"num_workers": 2, "parallel_method": "process", "prefetch": 1}],
    ids=["inline", "processes"],
)
def test_a_loader_resumed_at_every_step_equals_the_uninterrupted_run(
    tokenizer_file: Path, table: tuple[Path, list[str]], options: dict[str, Any]
) -> None:
    path, documents = table
    tokenizer = train_tokenizer(tokenizer_file)
    dataset = TokenizedDataset(ParquetStorage(path, "text"), tokenizer_file, eos_id=1)
    whole = list(_loader(dataset, **options))
    assert len(whole) == len(documents) // 3
    want = {tuple(ids) for ids in expected(tokenizer, documents)}
    for batch in whole:  # (pad_collate: padded tokens, their mask and lengths)
        for row, length in zip(batch["tokens"].tolist(), batch["lengths"].tolist()):
            assert tuple(row[:length]) in want and not any(row[length:])
    # inline: a stop at every step; processes: the first, second, middle and last (each
    # stop there starts two loaders' worker processes, ~1 s apiece)
    steps = range(len(whole)) if not options else sorted({0, 1, len(whole) // 2, len(whole) - 1})
    for step in steps:
        first = _loader(dataset, **options)
        before = list(first.steps(step)) if step else []
        resumed = _loader(dataset, **options)
        resumed.load_state_dict(first.state_dict())
        assert _same(before + list(resumed), whole), f"resumed after step {step}"


def test_the_checkpoint_of_one_tokenizer_is_refused_by_another(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    documents = texts(8, 12)
    train_tokenizer(tokenizer_file)
    loader = _loader(TokenizedDataset(documents, tokenizer_file, eos_id=1))
    list(loader.steps(1))
    state = loader.state_dict()
    train_tokenizer(tmp_path / "other.json", vocab_size=300)
    other = _loader(TokenizedDataset(documents, tmp_path / "other.json", eos_id=1))
    with pytest.raises(ValueError, match="another version of the dataset: tokenizer"):
        other.load_state_dict(state)
