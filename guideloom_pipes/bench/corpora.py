"""The corpora scenarios: a Megatron-LM indexed dataset read in place.

- ``megatron-windows``: the token windows of ``tokens-2048`` read from our own shards
  (baseline) and from the same tokens as a Megatron corpus (the shards' files linked as
  ``.bin`` files, each with an ``.idx`` of documents averaging 1,000 tokens), through
  ``StatefulDataLoader`` with 0 and 2 thread workers.
- ``megatron-open``: a corpus of ``sizes.megatron_documents`` documents, each reader in a
  fresh process of its own (``--child-megatron-open``), alternating: from building the
  dataset objects (imports done) to the first batch of 8 windows of 2048 tokens, ours
  (``MegatronIndexedStorage`` through ``from_storage``, shuffled) against megatron-core's
  own ``GPTDataset`` (its index building included: a fresh cache each time); then samples/s
  of both once running. Needs megatron-core (the ``corpora-test`` extra); says so otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from guideloom_pipes.bench.contenders import CPU, _ours_contender
from guideloom_pipes.bench.data import SEED, _count_tokens
from guideloom_pipes.bench.harness import Row, Sizes, measure
from guideloom_pipes.storage import StreamStorage

WINDOWS_SCENARIO = "megatron-windows"
OPEN_SCENARIO = "megatron-open"
OWN = "our shards"
MEGATRON = "Megatron corpus"
LENGTH, BATCH = 2048, 8
#: Batches timed once running, in the open children.
_RUNNING_BATCHES = 200


def windows_row(kind: str, workers: int) -> str:
    return f"{kind}, ours workers={workers} threads prefetch=4"


def _megatron_available() -> str | None:
    """None where megatron-core imports, else why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.datasets.indexed_dataset  # noqa: F401
    except ImportError as error:
        return f"megatron-core is not installed ({error}): pip install -e '.[corpora-test]'"
    return None


def write_megatron_index(prefix: Path, lengths: np.ndarray, dtype: Any) -> None:
    """``PREFIX.idx`` for the tokens already in ``PREFIX.bin``: one sequence and one
    document per entry of ``lengths``, written by megatron-core's own index writer."""
    from megatron.core.datasets.indexed_dataset import _IndexWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _IndexWriter(f"{prefix}.idx", np.dtype(dtype).type) as writer:
            writer.write(lengths.astype(np.int32), None, np.arange(len(lengths) + 1))


def _documents_of(total: int, rng: np.random.Generator, mean: int) -> np.ndarray:
    """Document lengths (1 .. 2 * mean - 1) adding up to ``total`` tokens."""
    lengths = rng.integers(1, 2 * mean, 2 * (total // mean) + 16)  # (more than enough)
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, total))
    lengths = lengths[: count + 1].copy()
    lengths[-1] = total - (int(ends[count - 1]) if count else 0)
    return lengths[lengths > 0]


def windows_rows(tokens: StreamStorage, root: Path, sizes: Sizes, log: Any) -> list[Row]:
    """``megatron-windows``: the same tokens in our shards and as a Megatron corpus."""
    from guideloom_pipes.storage.corpora import MegatronIndexedStorage

    folder = root / "megatron-windows"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    prefixes = []
    shards = sorted(Path(tokens.dir).glob("*.in_band.bin"))
    for shard in shards:
        prefix = folder / shard.name.split(".")[0]
        _same_bytes(shard, Path(f"{prefix}.bin"))
        tokens_in = shard.stat().st_size // 4
        write_megatron_index(prefix, _documents_of(tokens_in, rng, 1000), np.int32)
        prefixes.append(prefix)
    corpus = MegatronIndexedStorage(prefixes)
    count = _count_tokens(LENGTH)
    contenders = []
    for workers in (0, 2):
        for kind, storage in ((OWN, tokens), (MEGATRON, corpus)):
            contenders.append(
                _ours_contender(
                    windows_row(kind, workers),
                    storage,
                    None,
                    count,
                    sequence_length=LENGTH,
                    local_batch_size=BATCH,
                    num_workers=workers,
                    prefetch=4,
                )
            )
    return measure(WINDOWS_SCENARIO, contenders, sizes, log)


def _same_bytes(source: Path, target: Path) -> None:
    """``target`` holding ``source``'s bytes: a hard link (the very pages of the page cache,
    so that the rows compare the readers, not two copies' memory: a copy made by
    ``shutil.copyfile`` read 0.87x as fast, mapped, as the file it copied), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def build_open_corpus(folder: Path, documents: int) -> Path:
    """A Megatron corpus of ``documents`` documents (1-59 tokens, ``uint16``): its prefix."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED + 5)
    lengths = rng.integers(1, 60, documents)
    prefix = folder / "corpus_text_document"
    chunk = 1 << 24
    with open(f"{prefix}.bin", "wb") as out:
        total = int(lengths.sum())
        for start in range(0, total, chunk):
            out.write(rng.integers(1, 50_000, min(chunk, total - start), dtype=np.uint16).tobytes())
    write_megatron_index(prefix, lengths, np.uint16)
    return prefix


def _gpt_dataset(prefix: Path, cache: Path) -> Any:
    """megatron-core's ``GPTDataset`` over the whole corpus (one epoch, its order), its
    indexes built into ``cache``."""
    import logging

    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
        from megatron.core.datasets.utils import Split

    class _Ids(MegatronLegacyTokenizer):
        """No text: the token ids are the corpus's (GPTDataset asks only these)."""

        def tokenize(self, text: str) -> Any:
            raise NotImplementedError

        def detokenize(self, ids: Any) -> str:
            raise NotImplementedError

        vocab = property(lambda self: {})
        inv_vocab = property(lambda self: {})
        vocab_size = property(lambda self: 50_001)
        eod = property(lambda self: 0)
        pad = property(lambda self: 50_000)

    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=LENGTH,
        split="1,0,0",
        tokenizer=_Ids("ids"),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(cache),
    )
    indexed = IndexedDataset(str(prefix))
    documents = np.arange(len(indexed.document_indices) - 1, dtype=np.int32)
    return GPTDataset(indexed, str(prefix), documents, None, Split.train, config)


def open_child(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: open the corpus as ``spec["who"]`` does and take the first
    batch of 8 windows (seconds), then ``_RUNNING_BATCHES`` more (samples/s)."""
    import torch  # noqa: F401  (imports are not the open's)

    import guideloom_pipes  # noqa: F401
    from guideloom_pipes.loader import StatefulDataLoader
    from guideloom_pipes.storage.corpora import MegatronIndexedStorage

    prefix = Path(spec["prefix"])
    if spec["who"] == "megatron":
        cache = Path(tempfile.mkdtemp(prefix="megatron-cache-"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.datasets.gpt_dataset  # noqa: F401
        started = time.perf_counter()
        dataset = _gpt_dataset(prefix, cache)
        samples = [dataset[i] for i in range(BATCH)]
        first = time.perf_counter() - started
        assert samples[0]["tokens"].shape == (LENGTH,)
        running = min(_RUNNING_BATCHES, len(dataset) // BATCH - 1)
        started = time.perf_counter()
        for i in range(BATCH, BATCH * (running + 1)):
            dataset[i]
        rate = BATCH * running / (time.perf_counter() - started)
        shutil.rmtree(cache, ignore_errors=True)
        return {"open_first_batch_s": first, "samples_per_s": rate, "samples": len(dataset)}
    started = time.perf_counter()
    loader = StatefulDataLoader.from_storage(
        MegatronIndexedStorage(prefix),
        None,
        sequence_length=LENGTH,
        local_batch_size=BATCH,
        shuffle=True,
        shuffle_seed=SEED,
        device=CPU,
    )
    iterator = iter(loader)
    batch: Any = next(iterator)
    first = time.perf_counter() - started
    assert tuple(batch["tokens"].shape) == (BATCH, LENGTH)
    running = min(_RUNNING_BATCHES, len(loader) - 1)
    started = time.perf_counter()
    for _ in range(running):
        next(iterator)
    rate = BATCH * running / (time.perf_counter() - started)
    loader.close()
    return {"open_first_batch_s": first, "samples_per_s": rate, "samples": len(loader) * BATCH}


def open_figures(root: Path, sizes: Sizes, log: Callable[[str], None]) -> dict[str, Any]:
    """``megatron-open``: medians of ``sizes.resume_rounds`` alternating rounds."""
    started = time.perf_counter()
    prefix = build_open_corpus(root / "megatron-open", sizes.megatron_documents)
    built = time.perf_counter() - started
    rounds: dict[str, list[dict[str, Any]]] = {"ours": [], "megatron": []}
    for _ in range(max(1, sizes.resume_rounds)):
        for who in rounds:
            spec = json.dumps({"prefix": str(prefix), "who": who})
            command = [sys.executable, "-m", "guideloom_pipes.bench", "--child-megatron-open", spec]
            done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
            if done.returncode != 0:
                raise RuntimeError(
                    f"the megatron-open child ({who}) failed ({done.returncode}):\n"
                    f"{done.stderr[-4000:]}"
                )
            rounds[who].append(json.loads(done.stdout.strip().splitlines()[-1]))
    figures: dict[str, Any] = {"documents": sizes.megatron_documents, "build_s": built}
    for who, found in rounds.items():
        figures[who] = {
            "open_first_batch_s": statistics.median(r["open_first_batch_s"] for r in found),
            "samples_per_s": statistics.median(r["samples_per_s"] for r in found),
            "samples": found[0]["samples"],
            "rounds": found,
        }
    ours, theirs = figures["ours"], figures["megatron"]
    log(
        f"  {OPEN_SCENARIO}  {sizes.megatron_documents:,} documents: open + first batch ours "
        f"{ours['open_first_batch_s']:.3f} s, GPTDataset {theirs['open_first_batch_s']:.3f} s; "
        f"running ours {ours['samples_per_s']:,.0f}, GPTDataset "
        f"{theirs['samples_per_s']:,.0f} samples/s"
    )
    return figures


def skipped(log: Callable[[str], None]) -> str | None:
    """Why the corpora scenarios cannot run here (logged), or None."""
    reason = _megatron_available()
    if reason is not None:
        log(f"  megatron   skipped: {reason}")
    return reason
