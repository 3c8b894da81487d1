"""Packed documents with boundaries: ``PackedDataset``, fixed windows over a concatenation of
documents that say where each document starts (Megatron's reset of positions and attention).

Sample ``i`` is the window ``[i*L, (i+1)*L)`` of the concatenated documents, with
``tokens``, ``position_ids`` (restarting at 0 at the window start and at each document
start), ``document_ids`` (the documents of the window numbered from 0) and ``labels`` (the
next token; ``-100`` across a document boundary and at the last position), all int64.

* A **stream** (``StreamStorage`` whose documents end with ``eos_token``): the boundaries are
  found inside each window (a document starts after each EOS); nothing of the dataset's size
  is ever held.
* **Documents** (a map-style dataset of token arrays, lists, or dicts with ``field``; an
  ``eos_token`` is appended to each when given): the windows are located through prefix
  sums of the document lengths (one int64 per document, in storage order or, with ``seed``,
  in the seeded document order), built on first use and kept as a *sidecar* file next to a
  ``DocumentStorage`` (or under ``cache_dir``), keyed to the storage's commit records and
  file sizes: a sidecar of a dataset that changed is refused and rebuilt. Listing,
  ``verify`` and the readers ignore these files (their names are not shard names).

With ``packing="best_fit"`` (or ``"first_fit"``), documents are not cut to fill windows:
whole documents are fitted into windows (a plan computed once from the prefix sums and kept
as a sidecar beside them, see :mod:`guideloom_pipes.packing_plan`), the rest of each window
filled with ``pad_token``, a sequence of its own labelled ``-100``.

A reader computes a batch of windows at once (:func:`pack_columns`: a few numpy passes over
the whole ``(B, L)`` batch) into one output block per read, reused once the read's last
array is gone; ``read_arrays`` gives the batch as a :class:`~guideloom_pipes.batch.Batch`
(the loader's path to ``collate_packed`` and ``collate_fn=None``),
``read_batch`` as a list of samples (rows of the same arrays).

This module holds the dataset; the packed columns are computed in
:mod:`guideloom_pipes.packing_columns`, the sidecars are read and written in
:mod:`guideloom_pipes.packing_index`, and the reader is
:mod:`guideloom_pipes.packing_reader`'s ``PackedReader`` (their public names are importable
from here too).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from guideloom_pipes.checks import check_int
from guideloom_pipes.datasets import DocumentDataset, StreamDataset, has_documents
from guideloom_pipes.packing_columns import (
    FIELDS,
    IGNORE_INDEX,
    PackedSample,
    pack_columns,
    pack_windows,
)
from guideloom_pipes.packing_columns import known_sequences as known_sequences
from guideloom_pipes.packing_index import SIDECAR_PREFIX
from guideloom_pipes.packing_plan import check_packing
from guideloom_pipes.packing_reader import PackedReader
from guideloom_pipes.reader_base import _AsyncDatasetReader
from guideloom_pipes.storage import DocumentStorage, StreamStorage, StreamWithMetaStorage

__all__ = [
    "FIELDS",
    "IGNORE_INDEX",
    "PackedDataset",
    "PackedSample",
    "pack_columns",
    "pack_windows",
]


def _check_token(value: Any, name: str) -> int | None:
    return check_int(name, value, allow_none=True, kind="an int token id")


class PackedDataset:
    """Fixed windows over concatenated documents, with document boundaries.

    ``len`` is the total number of tokens // ``sequence_length`` (a trailing partial
    window is dropped); with ``packing="best_fit"`` (or ``"first_fit"``), the number of
    windows of its plan (every token once, nothing dropped). Each sample is a dict of
    four ``(sequence_length,)`` int64 arrays: ``tokens``, ``position_ids``,
    ``document_ids`` and ``labels`` (see the module docstring);
    :func:`guideloom_pipes.collate_packed` batches them into the inputs of
    flash-attention's varlen kernels. Works in ``StatefulDataLoader`` and as a component of
    a ``MixtureDataset``.

    Args:
        source: A ``StreamStorage`` whose documents each end with ``eos_token``; or a
            map-style dataset of documents (``DocumentDataset``, a ``DocumentStorage``, or
            any ``len`` + ``[i]`` dataset) whose documents are 1-D token arrays or lists, or
            dicts with a ``field`` entry. A ``StreamDataset`` is refused: pass its storage.
        sequence_length: ``L``, tokens per window (>= 1).
        eos_token: The end-of-document token: required for a stream; for documents,
            appended after each one when given.
        seed: For documents, an int >= 0 that fixes a document order (a Feistel
            permutation of the documents); ``None`` keeps storage order. Refused for a
            stream (its order is the storage's).
        field: The stream's field, or the documents' dict key, holding the tokens.
        cache_dir: Where to keep the prefix-sum sidecar when the dataset's directory is
            read-only or remote (by default: next to the dataset, else in memory only).
        packing: ``"concat"`` (the default): the documents concatenated and cut into
            windows. ``"best_fit"``: whole documents fitted into windows without cutting
            them (best-fit decreasing over ``lookahead`` documents at a time; a document
            longer than a window is split at multiples of it), the rest of each window
            padded; ``"first_fit"``: the same with first fit. A fit needs documents (not a
            stream); see :mod:`guideloom_pipes.packing_plan`.
        pad_token: The token that fills a fitted window's free space (required for a fit,
            refused for ``"concat"``): its own sequence, labelled ``-100``.
        lookahead: Documents sorted and fitted together (>= 1; a fit only; default 1024).
    """

    def __init__(
        self,
        source: Any,
        sequence_length: int,
        *,
        eos_token: int | None = None,
        seed: int | None = None,
        field: str = "tokens",
        cache_dir: str | os.PathLike[str] | None = None,
        packing: str = "concat",
        pad_token: int | None = None,
        lookahead: int | None = None,
    ) -> None:
        self.sequence_length = check_int("sequence_length", sequence_length, minimum=1)
        self.eos_token = _check_token(eos_token, "eos_token")
        self.packing, self.pad_token, self.lookahead = check_packing(packing, pad_token, lookahead)
        self.field = field
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        if isinstance(source, (StreamDataset,)):
            raise TypeError(
                "PackedDataset reads a stream's storage, not a StreamDataset: pass "
                "dataset.storage, e.g. PackedDataset(dataset.storage, sequence_length, "
                "eos_token=...)"
            )
        if isinstance(source, StreamWithMetaStorage):
            raise TypeError(
                "PackedDataset packs a StreamStorage (documents separated by eos_token) or a "
                "dataset of documents; a StreamWithMetaStorage is neither"
            )
        if isinstance(source, DocumentStorage) or has_documents(source):
            # (a corpus with its own document boundaries, e.g. MegatronIndexedStorage, is
            # packed by its documents: their lengths come from it, nothing is scanned)
            source = DocumentDataset(source)
        self.source = source
        self.stream = isinstance(source, StreamStorage)
        if self.stream and self.packing != "concat":
            raise ValueError(
                f"packing={self.packing!r} places whole documents, so it needs their lengths "
                f"up front: pass a dataset of documents (a DocumentStorage, DocumentDataset "
                f"or a list of token arrays); a stream packs with packing='concat'"
            )
        if self.stream:
            if self.eos_token is None:
                raise ValueError(
                    "a stream's documents are found by their end token: pass eos_token=<the "
                    "id that ends each document>"
                )
            if seed is not None:
                raise ValueError(
                    f"seed={seed!r} orders documents, but a stream is packed in storage "
                    f"order; drop seed (the loader's shuffle reorders windows)"
                )
            names = source.format.stream_dtype.names or ()
            if field not in names:
                raise ValueError(
                    f"the stream has no field {field!r} (its fields: {list(names)}); pass "
                    f"field= the name of its tokens"
                )
            self.seed = None
        else:
            if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")) and not (
                hasattr(source, "sync_reader")
            ):
                raise TypeError(
                    f"source must be a StreamStorage or a map-style dataset of documents "
                    f"(len and [i]), got {type(source).__name__}"
                )
            try:
                self.seed = check_int("seed", seed, minimum=0, allow_none=True)
            except (TypeError, ValueError):
                # A ValueError for any bad seed, as before.
                raise ValueError(f"seed must be an int >= 0 or None, got {seed!r}") from None

    def __len__(self) -> int:
        with self.sync_reader() as reader:
            return len(reader)

    def sync_reader(self) -> PackedReader:
        """A reader (context manager) with ``len``, ``[i]``, slices and ``read_batch(ids)``."""
        return PackedReader(self)

    def async_reader(self) -> _AsyncDatasetReader:
        """An ``async`` reader (``async with``) with ``read`` and ``read_batch``."""
        return _AsyncDatasetReader(PackedReader(self))

    def __getitem__(self, index: int | slice) -> Any:
        """Sample ``index`` (or a list for a slice), through a reader opened for this call;
        use :meth:`sync_reader` for many reads."""
        with self.sync_reader() as reader:
            return reader[index]

    def settings(self) -> dict[str, Any]:
        """What decides which tokens each window holds, besides the source's data (a packed
        dataset's checkpoint fingerprint carries it, as ``packing``)."""
        return {
            "packing": self.packing,
            "sequence_length": self.sequence_length,
            "eos_token": self.eos_token,
            "seed": self.seed,
            "field": self.field,
            "pad_token": self.pad_token,
            "lookahead": self.lookahead,
        }

    def __repr__(self) -> str:
        fit = (
            ""
            if self.packing == "concat"
            else f", packing={self.packing!r}, pad_token={self.pad_token}, "
            f"lookahead={self.lookahead}"
        )
        return (
            f"PackedDataset({self.source!r}, sequence_length={self.sequence_length}, "
            f"eos_token={self.eos_token}, seed={self.seed}, field={self.field!r}{fit})"
        )

    # -- sidecars ---------------------------------------------------------------------------

    def _variant(self) -> str:
        eos = "eos" if self.eos_token is not None else "plain"
        order = "storage" if self.seed is None else f"seed{self.seed}"
        field = hashlib.sha256(self.field.encode()).hexdigest()[:8]
        return f"{field}-{eos}-{order}"

    def sidecar_paths(self) -> list[Path]:
        """Where this dataset's prefix sums are looked for, first to last (documents of a
        local ``DocumentStorage``: next to the dataset, then under ``cache_dir``)."""
        return self._paths(self._variant())

    def plan_paths(self) -> list[Path]:
        """Where the window plan of ``packing="best_fit"`` or ``"first_fit"`` is looked
        for, first to last (beside the prefix sums; empty for ``"concat"``)."""
        if self.packing == "concat":
            return []
        return self._paths(f"{self._variant()}-{self._plan_variant()}")

    def _plan_variant(self) -> str:
        return f"{self.packing}-L{self.sequence_length}-k{self.lookahead}"

    def _paths(self, variant: str) -> list[Path]:
        paths = []
        storage = getattr(self.source, "storage", None)
        if isinstance(storage, DocumentStorage) and storage._resolve_io().local:
            paths.append(Path(storage.dir) / f".{SIDECAR_PREFIX}-{variant}.bin")
        if self.cache_dir is not None and isinstance(storage, DocumentStorage):
            where = hashlib.sha256(os.fsencode(os.path.abspath(os.fspath(storage.dir))))
            name = f"{SIDECAR_PREFIX}-{where.hexdigest()[:16]}-{variant}.bin"
            paths.append(self.cache_dir / name)
        return paths
