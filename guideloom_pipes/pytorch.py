"""GuideLoom's module path for the loader (``guideloom.pytorch``); imports torch."""

from guideloom_pipes.loader import StatefulDataLoader

__all__ = ["StatefulDataLoader"]
