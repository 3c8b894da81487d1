"""Corpora written by the real tools of other projects (megatron-core's
``IndexedDatasetBuilder``, ...), and what those tools read back themselves: the test data of
the read-only storages. A test that needs a tool skips without it (the ``corpora`` extra)."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def megatron() -> Any:
    """megatron-core's ``indexed_dataset`` module (the test skips without megatron-core)."""
    pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its optional fused kernels are missing on CPU)
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def random_documents(
    seed: int, count: int, dtype: Any, *, sequences: int = 1, longest: int = 40, empty: bool = False
) -> list[list[np.ndarray]]:
    """``count`` documents of ``sequences`` sequences each (of 1 to ``longest`` tokens; some
    empty with ``empty``), token ids spanning ``dtype``'s range."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    low, high = max(int(info.min), -(2**31)), min(int(info.max), 2**31 - 1)
    documents = []
    for _ in range(count):
        document = []
        for _ in range(sequences):
            size = int(rng.integers(0 if empty else 1, longest + 1))
            document.append(rng.integers(low, high, size, endpoint=True).astype(dtype))
        documents.append(document)
    return documents


def write_megatron(prefix: Path, documents: list[list[np.ndarray]], dtype: Any) -> Path:
    """``PREFIX.bin`` / ``PREFIX.idx`` written by megatron-core's ``IndexedDatasetBuilder``:
    each document's sequences, then the document's end. The prefix."""
    module = megatron()  # (skips first without torch: megatron-core needs it)
    import torch

    builder = module.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.dtype(dtype).type)
    for document in documents:
        for sequence in document:
            builder.add_item(torch.from_numpy(np.ascontiguousarray(sequence).astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def megatron_read_back(prefix: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """What megatron-core's own ``IndexedDataset`` reads of ``prefix``: its sequences, and
    its documents (the sequences of each, concatenated)."""
    module = megatron()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset = module.IndexedDataset(str(prefix))
    sequences = [np.array(dataset[i]) for i in range(len(dataset))]
    bounds = dataset.document_indices.tolist()
    documents = [
        np.concatenate(sequences[a:b]) if b > a else np.empty(0, dataset.index.dtype)
        for a, b in itertools.pairwise(bounds)
    ]
    return sequences, documents


def parquet() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)`` (the test skips without pyarrow)."""
    return pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")


def write_parquet(
    path: Path,
    documents: list[np.ndarray],
    dtype: Any,
    *,
    row_group_size: int = 4,
    column: str = "input_ids",
    large: bool = False,
    **more: list[Any],
) -> Path:
    """A Parquet file written by pyarrow itself: ``column`` a list of ``dtype`` integers per
    document (``large_list`` with ``large``), row groups of ``row_group_size`` rows, and
    ``more`` columns as given. The path."""
    pa, pq = parquet()
    value = pa.from_numpy_dtype(np.dtype(dtype))
    kind = pa.large_list(value) if large else pa.list_(value)
    columns = {column: pa.array([np.asarray(d).tolist() for d in documents], type=kind)}
    columns.update({name: pa.array(values) for name, values in more.items()})
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def parquet_read_back(path: Path, column: str = "input_ids") -> list[Any]:
    """What pyarrow reads of ``column`` of ``path``: a list per row (or a string)."""
    _, pq = parquet()
    return pq.read_table(path, columns=[column]).column(0).to_pylist()
