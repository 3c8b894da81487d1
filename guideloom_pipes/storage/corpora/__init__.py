"""Read-only storages of token corpora written by other tools (Megatron-LM's indexed
datasets, ...), read in place as a token stream and its documents."""

from guideloom_pipes.storage.corpora.base import TokenCorpus, TokenFormat
from guideloom_pipes.storage.corpora.megatron import (
    MegatronIndex,
    MegatronIndexedStorage,
    read_megatron_index,
)
from guideloom_pipes.storage.corpora.numpy_tokens import NumpyTokensStorage
from guideloom_pipes.storage.corpora.parquet import ParquetStorage

__all__ = [
    "MegatronIndex",
    "MegatronIndexedStorage",
    "NumpyTokensStorage",
    "ParquetStorage",
    "TokenCorpus",
    "TokenFormat",
    "read_megatron_index",
]
