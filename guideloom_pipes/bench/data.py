"""The benchmark's data: building its storages, and the collates that batch their samples.

Token, metadata, document and sparse storages, built in the run's temporary directory; the
metadata format; collates and counters of a batch's samples and tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from guideloom_pipes.formats import DocumentPickleFormat, StreamNumpyFormat
from guideloom_pipes.storage import DocumentStorage, StreamStorage, StreamWithMetaStorage

TOKENS_DTYPE = np.dtype([("tokens", "<i4")])
META_RECORD = np.dtype([("index", "<i4"), ("tokens", "<i4")])
SEED = 1234


# Data -----------------------------------------------------------------------------------------


def _tokens_stream(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.integers(0, 50_000, size=count, dtype=np.int32)


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


def build_tokens(directory: Path, total: int, shards: int) -> StreamStorage:
    """A stream storage of ``total`` random ``<i4`` tokens in ``shards`` shards."""
    storage = StreamStorage(directory, StreamNumpyFormat(TOKENS_DTYPE))
    rng = np.random.default_rng(SEED)
    with storage.sync_writer() as writer:
        for shard, length in enumerate(_split(total, shards)):
            for piece in _split(length, max(1, length // 10_000_000)):
                writer.append(shard, {"tokens": _tokens_stream(rng, piece)})
    return storage


class ChunkMetaFormat:
    """A stream-with-metadata format: tokens, and a small JSON payload per chunk.

    ``pack({"tokens": array, "source": str})`` gives every ``chunk`` consecutive tokens one
    payload; ``unpack`` returns ``{"tokens": array, "payload_index": int32 array, "payloads":
    [bytes, ...]}``.
    """

    stream_dtype = TOKENS_DTYPE

    def __init__(self, chunk: int = 100) -> None:
        self.chunk = chunk

    def size(self, data: dict[str, Any]) -> int:
        return len(data["tokens"])

    def pack(self, data: dict[str, Any]) -> Any:
        tokens = np.asarray(data["tokens"], dtype=np.int32)
        source = data.get("source", "doc")
        for start in range(0, len(tokens), self.chunk):
            payload = json.dumps({"source": source, "chunk": start // self.chunk}).encode()
            yield start, payload
            for _ in range(1, min(self.chunk, len(tokens) - start)):
                yield start, None
        stream = np.empty(len(tokens), dtype=TOKENS_DTYPE)
        stream["tokens"] = tokens
        return stream

    def unpack(
        self,
        stream_data: np.ndarray,
        document_shard: np.ndarray,
        document_index: np.ndarray,
        document_data: list[bytes],
    ) -> dict[str, Any]:
        return {
            "tokens": np.ascontiguousarray(stream_data["tokens"]),
            "payload_index": document_index,
            "payloads": document_data,
        }


def build_meta(directory: Path, total: int, shards: int, chunk: int) -> StreamWithMetaStorage:
    """A stream-with-metadata storage: ``total`` tokens, one payload per ``chunk`` tokens."""
    storage = StreamWithMetaStorage(directory, ChunkMetaFormat(chunk))
    rng = np.random.default_rng(SEED + 1)
    with storage.sync_writer() as writer:
        for shard, length in enumerate(_split(total, shards)):
            for index, piece in enumerate(_split(length, max(1, length // 100_000))):
                writer.append(
                    shard, {"tokens": _tokens_stream(rng, piece), "source": f"{shard}/{index}"}
                )
    return storage


def build_documents(directory: Path, count: int, shards: int) -> tuple[DocumentStorage, int]:
    """Pickled documents (lists of 100-4000 token ids); the storage and the token count."""
    storage = DocumentStorage(directory, DocumentPickleFormat())
    rng = np.random.default_rng(SEED + 2)
    lengths = rng.integers(100, 4001, size=count)
    pool = _tokens_stream(rng, 4100).tolist()
    with storage.sync_writer() as writer:
        for index, length in enumerate(lengths.tolist()):
            shift = index % 97
            writer.append(index * shards // count, pool[shift : shift + length])
    return storage, int(lengths.sum())


def build_eos_tokens(
    directory: Path, total: int, shards: int, eos: int, mean_length: int
) -> StreamStorage:
    """A stream of ``total`` random ``<i4`` tokens in ``1..49999`` whose documents end with
    ``eos`` (each token is an end with probability ``1 / mean_length``)."""
    storage = StreamStorage(directory, StreamNumpyFormat(TOKENS_DTYPE))
    rng = np.random.default_rng(SEED + 3)
    with storage.sync_writer() as writer:
        for shard, length in enumerate(_split(total, shards)):
            for piece in _split(length, max(1, length // 10_000_000)):
                tokens = rng.integers(1, 50_000, size=piece, dtype=np.int32)
                tokens[rng.random(piece) < 1 / mean_length] = eos
                writer.append(shard, {"tokens": tokens})
    return storage


def build_sparse(directory: Path, total: int, shards: int) -> int:
    """Sparse ``<i4`` shards of ``total`` tokens (``os.truncate``, no commit records)."""
    directory.mkdir(parents=True, exist_ok=True)
    for shard, length in enumerate(_split(total, shards)):
        path = directory / f"{shard:07d}.in_band.bin"
        with open(path, "wb"):
            pass
        os.truncate(path, length * TOKENS_DTYPE.itemsize)
    return total


# Collates -------------------------------------------------------------------------------------


def collate_tokens(samples: Sequence[dict[str, np.ndarray]]) -> torch.Tensor:
    """``torch.from_numpy(np.stack(tokens))``: the collate of the token scenarios."""
    return torch.from_numpy(np.stack([sample["tokens"] for sample in samples]))


def collate_meta(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stacked tokens plus the per-sample payload lists."""
    return {
        "tokens": torch.from_numpy(np.stack([sample["tokens"] for sample in samples])),
        "payload_index": [sample["payload_index"] for sample in samples],
        "payloads": [sample["payloads"] for sample in samples],
    }


def collate_pad(documents: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token-id lists to the longest: ``(batch, max_len)`` int64 and the lengths."""
    lengths = [len(document) for document in documents]
    out = np.zeros((len(documents), max(lengths)), dtype=np.int64)
    for row, document in enumerate(documents):
        out[row, : len(document)] = document
    return torch.from_numpy(out), torch.tensor(lengths)


def _count_tokens(length: int) -> Callable[[Any], tuple[int, int]]:
    def count(batch: Any) -> tuple[int, int]:
        rows = int(batch["tokens"].shape[0]) if isinstance(batch, dict) else int(batch.shape[0])
        return rows, rows * length

    return count


def _count_pad_collate(batch: Any) -> tuple[int, int]:
    lengths = batch["lengths"]
    return int(lengths.shape[0]), int(lengths.sum())


def _count_padded(batch: Any) -> tuple[int, int]:
    return int(batch[1].shape[0]), int(batch[1].sum())
