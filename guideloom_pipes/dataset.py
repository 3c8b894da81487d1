"""GuideLoom's module path for the datasets (``guideloom.dataset``); see :mod:`.datasets`."""

from guideloom_pipes.datasets import DocumentDataset, StreamDataset

__all__ = ["DocumentDataset", "StreamDataset"]
