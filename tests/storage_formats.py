"""Small storage formats and helpers shared by the storage/dataset tests (numpy only)."""

from __future__ import annotations

from collections.abc import Generator, Hashable, Sequence
from typing import Any

import numpy as np


class ChunkMetaFormat:
    """A stream-with-metadata format shaped like the one that wrote the GuideLoom fixtures.

    A record is ``{"doc": int, "tokens": [...], "chunk_ids": [...]}``: one stream element per
    token, keyed by its chunk id, whose payload is ``b"doc:<doc>/chunk:<chunk>"`` (written
    once, at the first element of each run). ``unpack`` returns plain lists.
    """

    stream_dtype = np.dtype("<i4")

    def size(self, data: dict[str, Any]) -> int:
        return len(data["tokens"])

    def pack(self, data: dict[str, Any]) -> Generator[tuple[Hashable, bytes | None], None, Any]:
        previous = None
        for chunk in data["chunk_ids"]:
            first = chunk != previous
            yield chunk, (f"doc:{data['doc']}/chunk:{chunk}".encode() if first else None)
            previous = chunk
        return np.asarray(data["tokens"], dtype=self.stream_dtype)

    def unpack(
        self,
        stream_data: np.ndarray,
        document_shard: np.ndarray,
        document_index: np.ndarray,
        document_data: Sequence[memoryview],
    ) -> dict[str, list[Any]]:
        return {
            "stream": [int(x) for x in stream_data],
            "document_shard": [int(x) for x in document_shard],
            "document_index": [int(x) for x in document_index],
            "document_data": [bytes(x).decode() for x in document_data],
        }


class ScriptedMetaFormat:
    """A stream-with-metadata format whose ``pack`` yields exactly the pairs it is given.

    A record is ``(pairs, stream, size)``; ``size`` defaults to ``len(pairs)``. Used to feed
    the writer protocol violations.
    """

    stream_dtype = np.dtype("<i4")

    def size(self, data: tuple[Any, ...]) -> int:
        pairs = data[0]
        return data[2] if len(data) > 2 else len(pairs)

    def pack(self, data: tuple[Any, ...]) -> Generator[tuple[Any, Any], None, Any]:
        pairs, stream = data[0], data[1]
        yield from pairs
        return stream

    def unpack(
        self,
        stream_data: np.ndarray,
        document_shard: np.ndarray,
        document_index: np.ndarray,
        document_data: Sequence[memoryview],
    ) -> dict[str, Any]:
        return {
            "stream": stream_data.tolist(),
            "document_shard": [int(x) for x in document_shard],
            "document_index": document_index,
            "document_data": [bytes(x) for x in document_data],
        }


class RecordingStreamFormat:
    """A plain stream format that returns what ``unpack`` was called with (the int64
    ``shard_lengths`` and ``shards`` vectors as lists)."""

    def __init__(self, dtype: Any = "<i8") -> None:
        self.stream_dtype = np.dtype(dtype)

    def pack(self, data: Any) -> np.ndarray:
        return np.asarray(data, dtype=self.stream_dtype)

    def unpack(
        self, stream: np.ndarray, shard_lengths: np.ndarray, shards: np.ndarray
    ) -> tuple[np.ndarray, list[int], list[int]]:
        assert shard_lengths.dtype == np.int64 and shards.dtype == np.int64
        return stream, shard_lengths.tolist(), shards.tolist()


def windows_of(reference: np.ndarray, start: int, length: int) -> np.ndarray:
    """``length`` elements of ``reference`` from ``start``, wrapping around as often as needed."""
    if length == 0:
        return reference[:0]
    reps = (start + length) // len(reference) + 1
    return np.tile(reference, reps)[start : start + length]


def pieces_of(shard_lengths: Sequence[int], start: int, length: int) -> tuple[list[int], list[int]]:
    """The ``(shard_lengths, shards)`` of a span, as ``unpack`` should see them (no empties)."""
    bounds = np.concatenate([[0], np.cumsum(shard_lengths)])
    total = int(bounds[-1])
    pieces: list[int] = []
    shards: list[int] = []
    position, left = start, length
    while left:
        shard = int(np.searchsorted(bounds, position, side="right")) - 1
        take = min(left, int(bounds[shard + 1]) - position)
        pieces.append(take)
        shards.append(shard)
        left -= take
        position = (position + take) % total
    return pieces, shards
