"""Read backends (``guideloom_pipes.io.MmapIO`` etc.); see :mod:`guideloom_pipes.storage.io`."""

from guideloom_pipes.storage.io import MmapIO, PosixPreadIO, SeekIO

__all__ = ["MmapIO", "PosixPreadIO", "SeekIO"]
