"""The resumable loader: :class:`StatefulDataLoader` and its parts.

- :mod:`.settings`: the constructor's keywords, checked once into a frozen ``LoaderSettings``;
- :mod:`.orders`: the orders an epoch is read in, each building its own pipeline;
- :mod:`.checkpoint`: ``state_dict()`` / ``load_state_dict()`` and what a state is checked
  against;
- :mod:`.iterator`, :mod:`.samplers`: an epoch being delivered; ``loader.sampler``;
- :mod:`.stateful`: the class itself;
- :mod:`.torch_loader`, :mod:`.sampler_order`: :class:`DataLoader`, torch's ``DataLoader``
  (its signature, defaults and order) on the same iterator, with its own checkpoints.
"""

from guideloom_pipes.loader.samplers import EpochBatchSampler, EpochSampler
from guideloom_pipes.loader.stateful import StatefulDataLoader
from guideloom_pipes.loader.torch_loader import DataLoader
from guideloom_pipes.pipes.errors import DataLoaderTimeoutError

__all__ = [
    "DataLoader",
    "DataLoaderTimeoutError",
    "EpochBatchSampler",
    "EpochSampler",
    "StatefulDataLoader",
]
