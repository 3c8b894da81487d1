"""guideloom_pipes: GuideLoom-compatible shard storage and a resumable PyTorch data loader.

The storage, format, dataset and shuffle layers need only numpy; the loader and the
``pipes`` stages import torch and torchdata lazily, on first use of those names
(``get_worker_info`` loads on first use too, and never imports torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from guideloom_pipes import io, types
from guideloom_pipes.batch import Batch
from guideloom_pipes.datasets import DocumentDataset, StreamDataset
from guideloom_pipes.formats import DocumentPickleFormat, StreamNumpyFormat
from guideloom_pipes.mixture import MixtureDataset
from guideloom_pipes.mixture_weights import WeightSchedule
from guideloom_pipes.opening import open_storage
from guideloom_pipes.packing import PackedDataset
from guideloom_pipes.parallel import WriteParallelError, WriteReport, convert, write_parallel
from guideloom_pipes.storage import DocumentStorage, StreamStorage, StreamWithMetaStorage
from guideloom_pipes.storage.corpora import (
    MegatronIndexedStorage,
    NumpyTokensStorage,
    ParquetStorage,
)
from guideloom_pipes.tokenizing import TokenizedDataset

__version__ = "0.1.0"
#: The GuideLoom release whose API, files, order and checkpoints this package reproduces.
GUIDELOOM_VERSION = "1.1.0"

if TYPE_CHECKING:
    from guideloom_pipes import pipes
    from guideloom_pipes.loader import DataLoader, StatefulDataLoader
    from guideloom_pipes.pipes.collate import pad_collate
    from guideloom_pipes.pipes.errors import DataLoaderTimeoutError
    from guideloom_pipes.pipes.packed import collate_packed
    from guideloom_pipes.pipes.worker_info import get_worker_info

_LAZY = {
    "StatefulDataLoader": ("guideloom_pipes.loader", "StatefulDataLoader"),
    "DataLoader": ("guideloom_pipes.loader", "DataLoader"),
    "DataLoaderTimeoutError": ("guideloom_pipes.pipes", "DataLoaderTimeoutError"),
    "pipes": ("guideloom_pipes.pipes", None),
    "collate_packed": ("guideloom_pipes.pipes.packed", "collate_packed"),
    "pad_collate": ("guideloom_pipes.pipes.collate", "pad_collate"),
    # (torch-free, but it loads the ``pipes`` package: on first use too)
    "get_worker_info": ("guideloom_pipes.pipes.worker_info", "get_worker_info"),
}


def __getattr__(name: str) -> Any:
    # Torch-backed names load on first use so preprocessing scripts never import torch.
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'guideloom_pipes' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DataLoader",
    "DataLoaderTimeoutError",
    "Batch",
    "DocumentDataset",
    "DocumentPickleFormat",
    "DocumentStorage",
    "GUIDELOOM_VERSION",
    "MegatronIndexedStorage",
    "NumpyTokensStorage",
    "MixtureDataset",
    "PackedDataset",
    "ParquetStorage",
    "StatefulDataLoader",
    "StreamDataset",
    "StreamNumpyFormat",
    "StreamStorage",
    "StreamWithMetaStorage",
    "TokenizedDataset",
    "WeightSchedule",
    "WriteParallelError",
    "WriteReport",
    "__version__",
    "collate_packed",
    "convert",
    "get_worker_info",
    "io",
    "open_storage",
    "pad_collate",
    "pipes",
    "types",
    "write_parallel",
]
