"""pad_collate: documents of token arrays of different lengths -> padded tensors, an attention
mask and the lengths; through the loader too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch

import guideloom_pipes
from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StatefulDataLoader,
    pad_collate,
)


def test_pad_collate_is_a_lazy_name_of_the_package() -> None:
    from guideloom_pipes.pipes.collate import pad_collate as defined

    assert guideloom_pipes.pad_collate is defined
    assert guideloom_pipes.pipes.pad_collate is defined
    assert "pad_collate" in guideloom_pipes.__all__


def test_bare_token_arrays_are_padded_with_a_mask_and_lengths() -> None:
    batch = pad_collate([np.array([1, 2, 3]), [4], np.array([], dtype=np.int64)], pad_value=-1)
    assert batch["tokens"].tolist() == [[1, 2, 3], [4, -1, -1], [-1, -1, -1]]
    assert batch["attention_mask"].tolist() == [
        [True, True, True],
        [True, False, False],
        [False, False, False],
    ]
    assert batch["attention_mask"].dtype == torch.bool
    assert batch["lengths"].tolist() == [3, 1, 0]


def test_the_tokens_keep_their_dtype() -> None:
    batch = pad_collate([np.array([1, 2], dtype=np.int32), np.array([3], dtype=np.int32)])
    assert batch["tokens"].dtype == torch.int32


def test_dict_samples_pad_every_sequence_field_each_with_its_pad_value() -> None:
    samples = [
        {"tokens": np.array([5, 6]), "labels": np.array([6, 7]), "id": 0, "text": "ab"},
        {"tokens": np.array([8]), "labels": np.array([9]), "id": 1, "text": "c"},
    ]
    batch = pad_collate(samples, pad_value={"tokens": 0, "labels": -100})
    assert batch["tokens"].tolist() == [[5, 6], [8, 0]]
    assert batch["labels"].tolist() == [[6, 7], [9, -100]]
    assert batch["id"].tolist() == [0, 1]
    assert batch["text"] == ["ab", "c"]


def test_left_padding_truncation_and_a_multiple_of() -> None:
    batch = pad_collate([[1, 2, 3, 4, 5], [6]], max_length=3, padding_side="left")
    assert batch["tokens"].tolist() == [[1, 2, 3], [0, 0, 6]]
    assert batch["lengths"].tolist() == [3, 1]
    rounded = pad_collate([[1, 2, 3]], pad_to_multiple_of=8)
    assert rounded["tokens"].shape == (1, 8)
    assert rounded["attention_mask"].sum().item() == 3


@pytest.mark.parametrize(
    "documents",
    [
        [[1, 2, 3], [4]],
        [[True, False], [True]],
        [[1, True], [2]],
        [[1, 2.5], [3]],
        [[2**63], [1]],
        [[-(2**63)], [2**62]],
        [[1, np.int32(2)], [3]],
        [[np.int16(1), 2], [3]],
        [[], [1, 2]],
        [(1, 2), [3]],
        [[1, np.uint64(2**63)], [2]],
        [[1, np.float64(2.0)], [2]],
        [[1, 2**40, -5], [0]],
        [list(range(100_000)), [7]],
    ],
    ids=lambda documents: repr(documents)[:60],
)
def test_lists_are_padded_as_numpy_converts_them(documents: list[Any]) -> None:
    """Lists of Python ints take a quicker conversion; every list still pads to the dtype
    and values ``np.asarray`` gives it (bools, floats, ints past int64, numpy scalars,
    empty lists)."""
    as_arrays = [np.asarray(document) for document in documents]
    batch = pad_collate(documents, pad_value=False)  # False fits every dtype here
    expected = pad_collate(as_arrays, pad_value=False)
    assert batch["tokens"].dtype == expected["tokens"].dtype
    assert batch["tokens"].tolist() == expected["tokens"].tolist()
    assert batch["lengths"].tolist() == [len(document) for document in documents]


def test_a_list_of_ints_holding_a_numpy_uint64_stays_integers() -> None:
    """The one list ``np.asarray`` makes float64 although every element is an integer
    that fits int64: the quick conversion keeps it int64, the exact values."""
    batch = pad_collate([[1, np.uint64(5)], [2**53 + 1]])
    assert batch["tokens"].dtype == torch.int64
    assert batch["tokens"].tolist() == [[1, 5], [2**53 + 1, 0]]


def test_an_empty_rank_batch_stays_empty() -> None:
    assert pad_collate([]) == []


def test_samples_without_token_arrays_or_of_unequal_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="needs token arrays"):
        pad_collate([{"text": "a"}])
    with pytest.raises(ValueError, match="need one length"):
        pad_collate([{"tokens": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="has fields"):
        pad_collate([{"tokens": [1]}, {"ids": [1]}])
    with pytest.raises(ValueError, match="does not fit"):
        pad_collate([np.array([1], dtype=np.int32)], pad_value=0.5)


def test_a_loader_over_documents_of_token_arrays_batches_them_with_pad_collate(
    tmp_path: Path,
) -> None:
    storage = DocumentStorage(tmp_path, DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for i in range(6):
            writer.append(i // 3, np.arange(i + 1, dtype=np.int64))
    loader = StatefulDataLoader(DocumentDataset(storage), pad_collate, local_batch_size=3)
    batches = list(loader)
    assert [b["tokens"].shape for b in batches] == [(3, 3), (3, 6)]
    assert batches[1]["lengths"].tolist() == [4, 5, 6]
    assert batches[1]["attention_mask"].sum().item() == 15
