"""GuideLoom's module path for the formats (``guideloom.storage_format``); see :mod:`.formats`."""

from guideloom_pipes.formats import DocumentPickleFormat, StreamNumpyFormat

__all__ = ["DocumentPickleFormat", "StreamNumpyFormat"]
