"""GuideLoom's module path ``guideloom.dataset``: the datasets of :mod:`guideloom_pipes`."""

from guideloom_pipes.datasets import DocumentDataset, StreamDataset

__all__ = ["DocumentDataset", "StreamDataset"]
