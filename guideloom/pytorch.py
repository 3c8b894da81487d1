"""GuideLoom's module path ``guideloom.pytorch``: the loader of :mod:`guideloom_pipes.loader`.

Importing it imports torch.
"""

from guideloom_pipes.loader import StatefulDataLoader

__all__ = ["StatefulDataLoader"]
