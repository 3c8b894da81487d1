"""Corpora of other tools in the loader: ``from_storage`` over a Megatron corpus (written by
megatron-core), numpy token files (``numpy.save``, documents split at an end token) or
Parquet tables (written by pyarrow, row groups of a few rows) reads
their windows and their documents in both orders, and a run stopped at any step resumes on
another world size with exactly the batches of the uninterrupted run."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from corpus_writers import (
    megatron,
    megatron_read_back,
    parquet_read_back,
    random_documents,
    write_megatron,
    write_parquet,
)

pytest.importorskip("torch")

from guideloom_pipes import (
    MegatronIndexedStorage,
    NumpyTokensStorage,
    ParquetStorage,
    StatefulDataLoader,
)

GLOBAL_BATCH = 4


def tokens_of(samples: list[Any]) -> list[tuple[int, ...]]:
    """A collate that keeps each sample's tokens (comparable, picklable)."""
    return [tuple(sample["tokens"].tolist()) for sample in samples]


@pytest.fixture(scope="module", params=["megatron", "numpy", "parquet"])
def corpus(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A corpus of two files (two shards, for the shard order on two ranks), and its
    documents as its writer reads them back."""
    folder = tmp_path_factory.mktemp(request.param)
    written = [random_documents(seed, 19, "uint16", sequences=2) for seed in (21, 22)]
    if request.param == "megatron":
        megatron()  # (skips without megatron-core)
        prefixes = [
            write_megatron(folder / name, docs, "uint16") for name, docs in zip("ab", written)
        ]
        documents = [d for prefix in prefixes for d in megatron_read_back(prefix)[1]]
        return MegatronIndexedStorage(prefixes), documents
    if request.param == "parquet":
        paths = [
            write_parquet(folder / f"{name}.parquet", [np.concatenate(d) for d in docs], "uint16")
            for name, docs in zip("ab", written)
        ]
        rows = [np.array(row, np.uint16) for path in paths for row in parquet_read_back(path)]
        return ParquetStorage(paths, "input_ids"), rows
    # documents end with token 0 (none inside one: the writer's ids start at 1)
    documents = [
        np.append(np.concatenate(d) % 60000 + 1, 0).astype(np.uint16)
        for docs in written
        for d in docs
    ]
    files = [folder / "a.npy", folder / "b.npy"]
    np.save(files[0], np.concatenate(documents[:19]))
    np.save(files[1], np.concatenate(documents[19:]))
    return NumpyTokensStorage(files, eos_id=0), documents


def _loader(corpus: Any, world_size: int, rank: int, **options: Any) -> StatefulDataLoader:
    return StatefulDataLoader.from_storage(
        corpus[0],
        tokens_of,
        local_batch_size=GLOBAL_BATCH // world_size,
        rank=rank,
        world_size=world_size,
        shuffle=True,
        shuffle_seed=5,
        device="cpu",
        **options,
    )


def _global_steps(loaders: list[StatefulDataLoader], steps: int) -> list[list[tuple[int, ...]]]:
    """``steps`` global batches of the ranks' loaders: each rank's batch holds every
    ``world_size``-th position of the global one."""
    per_rank = [list(loader.steps(steps)) if steps else [] for loader in loaders]
    size = len(loaders)
    return [
        [per_rank[j % size][step][j // size] for j in range(GLOBAL_BATCH)] for step in range(steps)
    ]


READS = {
    "windows": {"sequence_length": 6},
    "documents": {},
    "windows, shard order": {"sequence_length": 6, "order": "shards", "shuffle_buffer": 8},
}


@pytest.mark.parametrize("read", list(READS))
def test_a_stop_at_any_step_resumes_on_another_world_size_with_the_same_batches(
    corpus: Any, read: str
) -> None:
    # (the shard order resumes on its own world size only: docs/shard-streaming.md)
    options = READS[read]
    again = 2 if options.get("order") == "shards" else 1
    steps = len(_loader(corpus, again, 0, **options))
    whole = _global_steps([_loader(corpus, again, rank, **options) for rank in range(again)], steps)
    assert len(whole) == steps > 4
    for stop in range(steps + 1):
        ranks = [_loader(corpus, 2, rank, **options) for rank in range(2)]
        before = _global_steps(ranks, stop)
        state = ranks[0].state_dict()
        assert ranks[1].state_dict()["observation_offset"] == state["observation_offset"]
        resumed = [_loader(corpus, again, rank, **options) for rank in range(again)]
        for loader in resumed:
            loader.load_state_dict(state)
        after = _global_steps(resumed, steps - stop)
        assert before + after == whole, stop


def test_windows_and_documents_through_the_loader_are_the_corpus(corpus: Any) -> None:
    documents = corpus[1]
    stream = np.concatenate(documents)
    windows = Counter(tuple(stream[i * 6 : (i + 1) * 6].tolist()) for i in range(len(stream) // 6))
    loader = _loader(corpus, 1, 0, sequence_length=6)
    got = Counter(w for batch in loader for w in batch)
    assert got <= windows and got.total() == windows.total() // 4 * 4  # (drop_last)
    loader = _loader(corpus, 1, 0, num_workers=2, parallel_method="process", prefetch=2)
    got = Counter(d for batch in loader for d in batch)
    expected = Counter(tuple(d.tolist()) for d in documents)
    assert got <= expected and got.total() == len(documents) // 4 * 4


def test_the_documents_of_a_parquet_text_column_through_the_loader_resume(tmp_path: Any) -> None:
    # (text documents: the rows' strings, a batch a list of them; windows need a tokenizer)
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    texts = [f"document {i}" for i in range(11)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=3)

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader.from_storage(
            ParquetStorage(tmp_path / "t.parquet", "text"),
            lambda samples: [sample["text"] for sample in samples],
            local_batch_size=2,
            shuffle=True,
            shuffle_seed=3,
            device="cpu",
        )

    whole = list(loader())
    assert len(whole) == 5 and set(t for batch in whole for t in batch) < set(texts)
    first = loader()
    before = list(first.steps(2))
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert before + list(resumed) == whole
    windows = StatefulDataLoader.from_storage(
        ParquetStorage(tmp_path / "t.parquet", "text"), sequence_length=4, device="cpu"
    )
    with pytest.raises(TypeError, match="a tokenizer"):
        next(iter(windows))
