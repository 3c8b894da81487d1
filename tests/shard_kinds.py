"""The three storage kinds behind one small interface, for the commit/lock/discovery tests.

Every kind stores a shard as a list of small ints, so tests can write "old" and "new"
content to the same shard id and say exactly what a reader must see:

* ``stream``: a ``StreamStorage`` of ``[("tokens", "<i4")]``; each int is one element.
* ``document``: a ``DocumentStorage`` of pickled ``{"n": int}``; each int is one document.
* ``stream_meta``: a ``StreamWithMetaStorage`` of ``<i4`` tokens; each int is one element
  whose payload is ``b"p<int>"``.

``read(path)`` returns everything a reader sees, in order, as plain Python values; the
expected value for shards ``{0: [...], 1: [...]}`` is ``expected(shards)``.

Also usable from a child process (``python -c``) with this directory on ``sys.path``.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from guideloom_pipes import (
    DocumentPickleFormat,
    DocumentStorage,
    StreamNumpyFormat,
    StreamStorage,
    StreamWithMetaStorage,
)

TOKENS = np.dtype([("tokens", "<i4")])
KINDS = ("stream", "document", "stream_meta")
#: The data files of a shard of each kind (GuideLoom's names).
SUFFIXES = {
    "stream": (".in_band.bin",),
    "document": (".out_of_band.index", ".out_of_band.bin"),
    "stream_meta": (".in_band.bin", ".out_of_band.index", ".out_of_band.bin"),
}
#: A file GuideLoom 1.1 itself would write (or read).
GUIDELOOM_NAME = re.compile(r"^\d{7,}\.(in_band\.bin|out_of_band\.bin|out_of_band\.index)$")


class PayloadPerElement:
    """A stream-with-metadata format: element ``n`` carries token ``n`` and payload ``p<n>``."""

    def __init__(self, stream_dtype: Any = "<i4") -> None:
        self.stream_dtype = np.dtype(stream_dtype)

    def size(self, data: Sequence[int]) -> int:
        return len(data)

    def pack(self, data: Sequence[int]) -> Generator[tuple[int, bytes], None, np.ndarray]:
        for key, value in enumerate(data):
            yield key, f"p{value}".encode()
        return np.asarray(data, dtype=self.stream_dtype)

    def unpack(
        self,
        stream_data: np.ndarray,
        document_shard: np.ndarray,
        document_index: np.ndarray,
        document_data: Sequence[memoryview],
    ) -> list[tuple[int, str]]:
        return [
            (int(token), bytes(document_data[int(j)]).decode())
            for token, j in zip(stream_data, document_index)
        ]


def storage(kind: str, path: Path, dtype: Any = None) -> Any:
    """The storage of ``kind`` at ``path`` (``dtype`` overrides the stream dtype)."""
    if kind == "stream":
        return StreamStorage(path, StreamNumpyFormat(TOKENS if dtype is None else dtype))
    if kind == "document":
        return DocumentStorage(path, DocumentPickleFormat())
    if kind == "stream_meta":
        return StreamWithMetaStorage(path, PayloadPerElement("<i4" if dtype is None else dtype))
    raise ValueError(kind)


def append(kind: str, writer: Any, shard: int, values: Sequence[int]) -> None:
    """Append ``values`` to ``shard`` the way each kind stores them."""
    if kind == "stream":
        if isinstance(values, range):
            tokens = np.arange(values.start, values.stop, values.step, dtype="<i4")
        else:
            tokens = np.asarray(values, dtype="<i4")
        writer.append(shard, {"tokens": tokens})
    elif kind == "document":
        for value in values:
            writer.append(shard, {"n": int(value)})
    else:
        writer.append(shard, list(values))


def write(kind: str, path: Path, shards: Mapping[int, Sequence[int]]) -> None:
    """Write ``shards`` in one writer session (committed on close)."""
    with storage(kind, path).sync_writer() as writer:
        for shard, values in shards.items():
            append(kind, writer, shard, values)


def expected(kind: str, shards: Mapping[int, Sequence[int]]) -> list[Any]:
    """What :func:`read` returns for a dataset holding exactly ``shards``."""
    values = [int(v) for shard in sorted(shards) for v in shards[shard]]
    if kind == "stream":
        return values
    if kind == "document":
        return [{"n": v} for v in values]
    return [(v, f"p{v}") for v in values]


def read(kind: str, path: Path, read_interface: Any = None) -> list[Any]:
    """Everything a reader of ``path`` sees, in order."""
    store = storage(kind, path)
    store.read_interface = read_interface
    with store.sync_reader() as reader:
        total = reader.total_length
        if kind == "document":
            return list(reader.read_many(np.arange(total)))
        if total == 0:
            return []
        data = reader.read(0, total)
        if kind == "stream":
            return [int(v) for v in data["tokens"]]
        return list(data)


def leftovers(path: Path) -> list[str]:
    """Names in ``path`` that are temporaries of a writer (``.tmp`` / ``.pending``)."""
    return sorted(p.name for p in path.iterdir() if p.name.endswith((".tmp", ".pending")))


def names(path: Path) -> list[str]:
    """Every name in ``path``, sorted (the manifest's folder aside: its files are named by
    the manifest tests)."""
    return sorted(p.name for p in path.iterdir() if p.name != ".guideloom-manifest")
