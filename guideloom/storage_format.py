"""GuideLoom's module path ``guideloom.storage_format``: the formats, from
:mod:`guideloom_pipes.formats`."""

from guideloom_pipes.formats import DocumentPickleFormat, StreamNumpyFormat

__all__ = ["DocumentPickleFormat", "StreamNumpyFormat"]
