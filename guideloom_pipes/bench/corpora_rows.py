"""Two corpora scenarios beside ``corpora.py``'s Megatron ones:

- ``convert-dask``: :func:`~guideloom_pipes.convert` of Parquet text tables (8 files of
  ``sizes.convert_documents`` documents in all, tokenized by a BPE ``tokenizer.json``
  trained on the spot, EOS appended) into our stream storage, on a Dask ``LocalCluster`` of
  2 worker processes against 1 (``threads_per_worker=1``, ``TOKENIZERS_PARALLELISM=false``:
  one core per worker, the tokenizer's own threads off). Documents and tokens per second,
  the median wall time of ``sizes.rounds`` rounds after a warm one (each worker has loaded
  the tokenizer). Without Dask or tokenizers it says so.
- ``parquet-documents``: shuffled documents of a Parquet table (a row per document, the
  ``documents`` scenario's documents as ``list<int32>`` rows in row groups of
  ``PARQUET_ROW_GROUP`` rows) through ``from_storage`` and ``pad_collate``, with 0 and 2
  thread workers and 2 process workers (the default row-group cache, 256 MiB: less than
  the table of a full run), and with 0 and 2 thread workers and a cache that holds it all
  (filled by one epoch before the rounds), against the same documents in our own
  ``DocumentStorage``. Without pyarrow it says so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from guideloom_pipes.bench.contenders import _ours_contender
from guideloom_pipes.bench.data import SEED, _count_pad_collate
from guideloom_pipes.bench.harness import Contender, Row, Sizes, measure

CONVERT_SCENARIO = "convert-dask"
PARQUET_SCENARIO = "parquet-documents"
CONVERT_1, CONVERT_2 = "Dask LocalCluster, 1 worker", "Dask LocalCluster, 2 workers"
#: the input files of the convert scenario (one work item each)
CONVERT_FILES = 8
#: rows per row group of the parquet-documents table
PARQUET_ROW_GROUP = 64
OWN_DOCUMENTS = "our DocumentStorage, ours workers=0 prefetch=4"
#: the row-group cache of the rows whose table fits it (the table's tokens: 100M int32 in a
#: full run, 400 MB decoded)
WHOLE_CACHE = 1 << 30


def parquet_row(workers: int, method: str = "threads", cache: str = "") -> str:
    shown = f" {method}" if workers else ""
    return f"Parquet table{cache}, ours workers={workers}{shown} prefetch=4"


def missing_modules(*modules: str) -> str | None:
    """None where every module imports, else which does not and how to install it."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            return f"{module} is not installed ({error}): pip install -e '.[test]'"
    return None


# convert on Dask ------------------------------------------------------------------------------


def _texts(count: int, seed: int) -> list[str]:
    """``count`` documents of 50-400 words drawn (Zipf-like) from 6,000 made-up words."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, int(rng.integers(2, 10)))) for _ in range(6000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    texts = []
    for _ in range(count):
        picked = rng.choice(len(words), int(rng.integers(50, 401)), p=weights)
        texts.append(" ".join(words[i] for i in picked.tolist()) + ".")
    return texts


def build_convert_input(folder: Path, documents: int) -> tuple[Path, Path]:
    """The Parquet text tables (``CONVERT_FILES`` files) and a trained ``tokenizer.json``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tables = folder / "text"
    tables.mkdir(parents=True, exist_ok=True)
    texts = _texts(documents, SEED + 7)
    per_file = -(-len(texts) // CONVERT_FILES)
    for k in range(CONVERT_FILES):
        part = texts[k * per_file : (k + 1) * per_file]
        pq.write_table(pa.table({"text": part}), tables / f"part-{k:02d}.parquet")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator(texts[:2000], trainer)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return tables, path


@contextlib.contextmanager
def _dask_cluster(workers: int) -> Iterator[Any]:
    """An executor of a Dask LocalCluster of ``workers`` single-threaded processes, started
    with ``TOKENIZERS_PARALLELISM=false`` (the workers inherit it)."""
    from dask.distributed import Client, LocalCluster

    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        cluster = LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            worker_dashboard_address=None,
        )
        try:
            with Client(cluster) as client:
                yield client.get_executor()
        finally:
            cluster.close()
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _convert_rounds(
    tables: Path, tokenizer: Path, out: Path, executor: Any, rounds: int
) -> tuple[list[float], int]:
    """The wall times of ``rounds`` converts after a warm one, and the tokens written."""
    from guideloom_pipes.opening import open_storage
    from guideloom_pipes.parallel import convert

    def once() -> Any:
        return convert(
            tables,
            out,
            tokenizer=tokenizer,
            eos_id="</s>",
            executor=executor,
            progress=False,
            resume=False,
        )

    once()  # warm: each worker loads the tokenizer once
    walls = []
    for _ in range(max(1, rounds)):
        started = time.perf_counter()
        once()
        walls.append(time.perf_counter() - started)
    with open_storage(out).sync_reader() as written:
        tokens = int(written.total_length)
    shutil.rmtree(out, ignore_errors=True)
    return walls, tokens


def convert_rows(root: Path, sizes: Sizes, log: Callable[[str], None]) -> list[Row]:
    """``convert-dask``: 1 and 2 Dask workers, documents and tokens per second."""
    from guideloom_pipes.storage.corpora import ParquetStorage

    tables, tokenizer = build_convert_input(root / CONVERT_SCENARIO, sizes.convert_documents)
    with ParquetStorage(tables, "text", progress=False).document_reader() as reader:
        documents = len(reader)
    results = []
    for workers, name in ((1, CONVERT_1), (2, CONVERT_2)):
        with _dask_cluster(workers) as executor:
            walls, tokens = _convert_rounds(
                tables, tokenizer, root / CONVERT_SCENARIO / "out", executor, sizes.rounds
            )
        results.append((name, statistics.median(walls), walls, tokens))
    rows = []
    base = results[0][1]
    for name, wall, walls, tokens in results:
        ratio = base / wall
        log(
            f"  {CONVERT_SCENARIO} {name:<28} {documents / wall:9.0f} documents/s, "
            f"{tokens / wall / 1e6:6.2f} M tokens/s ({ratio:.2f}x one worker)"
        )
        rows.append(
            Row(
                scenario=CONVERT_SCENARIO,
                contender=name,
                samples_per_s=documents / wall,
                tokens_per_s=tokens / wall,
                cpu_s_per_1m_samples=float("nan"),
                ratio_to_baseline=ratio,
                baseline=name == CONVERT_1,
                first_batch_s=0.0,
                rounds=[
                    {"wall_s": w, "documents": documents, "tokens": tokens, "files": CONVERT_FILES}
                    for w in walls
                ],
            )
        )
    return rows


# shuffled documents of a Parquet table --------------------------------------------------------


def build_parquet_documents(folder: Path, count: int) -> tuple[Path, Path]:
    """The ``documents`` scenario's kind of documents (100-4000 tokens), ``count`` of them,
    as a Parquet table (``input_ids``, ``list<int32>``) and as our ``DocumentStorage`` of
    ``{"tokens": array}``: the table's path and the storage's directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from guideloom_pipes.formats import DocumentPickleFormat
    from guideloom_pipes.storage import DocumentStorage

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED + 2)
    lengths = rng.integers(100, 4001, size=count)
    pool = rng.integers(1, 50_000, 4100, dtype=np.int32)
    documents = [pool[index % 97 : index % 97 + length] for index, length in enumerate(lengths)]
    offsets = np.zeros(count + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(documents)))
    table = folder / "documents.parquet"
    pq.write_table(pa.table({"input_ids": column}), table, row_group_size=PARQUET_ROW_GROUP)
    storage = DocumentStorage(folder / "ours", DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for index, document in enumerate(documents):
            writer.append(index * 4 // count, {"tokens": document})
    return table, folder / "ours"


def parquet_rows(root: Path, sizes: Sizes, log: Callable[[str], None]) -> list[Row]:
    """``parquet-documents``: shuffled documents, padded, of the table and of our storage."""
    from guideloom_pipes.formats import DocumentPickleFormat
    from guideloom_pipes.pipes.collate import pad_collate
    from guideloom_pipes.storage import DocumentStorage
    from guideloom_pipes.storage.corpora import ParquetStorage

    table, ours = build_parquet_documents(root / PARQUET_SCENARIO, sizes.documents)
    corpus = ParquetStorage(table, "input_ids", progress=False)
    whole = ParquetStorage(table, "input_ids", cache_bytes=WHOLE_CACHE, progress=False)
    own = DocumentStorage(ours, DocumentPickleFormat())
    common = {"local_batch_size": 32, "prefetch": 4}
    held = " (cache_bytes=1 GiB: all of it)"
    contenders = [
        _ours_contender(OWN_DOCUMENTS, own, pad_collate, _count_pad_collate, **common),
        _ours_contender(parquet_row(0), corpus, pad_collate, _count_pad_collate, **common),
        _ours_contender(
            parquet_row(2), corpus, pad_collate, _count_pad_collate, num_workers=2, **common
        ),
        _ours_contender(
            parquet_row(2, "processes"),
            corpus,
            pad_collate,
            _count_pad_collate,
            num_workers=2,
            parallel_method="process",
            **common,
        ),
        _warmed(
            _ours_contender(
                parquet_row(0, cache=held), whole, pad_collate, _count_pad_collate, **common
            )
        ),
        _warmed(
            _ours_contender(
                parquet_row(2, cache=held),
                whole,
                pad_collate,
                _count_pad_collate,
                num_workers=2,
                **common,
            )
        ),
    ]
    return measure(PARQUET_SCENARIO, contenders, sizes, log)


def _warmed(contender: Contender) -> Contender:
    """``contender`` whose setup reads one whole epoch first: its row-group cache holds the
    table when the rounds start (the rounds of a slow cold start are too short to fill it)."""
    opened = contender.setup

    def setup() -> None:
        opened()
        iterator = contender.make_iterator()
        for _ in iterator:
            pass

    contender.setup = setup
    return contender
