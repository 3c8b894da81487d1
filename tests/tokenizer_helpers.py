"""A small tokenizer trained here with Hugging Face ``tokenizers`` (BPE on a few sentences),
and texts to tokenize: the test data of ``convert`` and ``TokenizedDataset``. Tests that use
it skip without ``tokenizers``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # (tests fork worker processes)


def _words(count: int) -> list[str]:
    rng = np.random.default_rng(7)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    return ["".join(rng.choice(letters, int(rng.integers(2, 8)))) for _ in range(count)]


#: 300 made-up words: a BPE vocabulary of several hundred ids (past uint8)
WORDS = _words(300)
#: the tokenizer's special tokens: ids 0 and 1
UNK, EOS = "<unk>", "</s>"


def texts(seed: int, count: int, longest: int = 14) -> list[str]:
    """``count`` sentences of the words above (one empty)."""
    rng = np.random.default_rng(seed)
    out = [" ".join(rng.choice(WORDS, int(rng.integers(1, longest)))) for _ in range(count)]
    out[min(2, count - 1)] = ""
    return out


def train_tokenizer(path: Path, vocab_size: int = 400) -> Any:
    """A BPE tokenizer trained on sentences of the words above, saved to ``path``."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[UNK, EOS])
    tokenizer.train_from_iterator(texts(99, 600), trainer)
    tokenizer.save(str(path))
    return tokenizer


def expected(tokenizer: Any, documents: list[str], eos: int | None = 1) -> list[list[int]]:
    """What the tokenizer's own encode gives each document, EOS appended."""
    return [tokenizer.encode(text).ids + ([] if eos is None else [eos]) for text in documents]
