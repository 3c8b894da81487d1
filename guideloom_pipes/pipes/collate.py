"""Batching and collation: a list of samples -> one batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import default_collate as _torch_default_collate
from torchdata.nodes import BaseNode

__all__ = ["Collate", "default_collate"]


def default_collate(samples: Sequence[Any]) -> Any:
    """torch's ``default_collate``, except that an empty rank batch stays ``[]``.

    With ``drop_last=False`` and several ranks a rank's last batch can be empty (SPEC §5);
    torch's function cannot stack nothing, so that batch is delivered as ``[]``.

    Args:
        samples: The samples of one local batch.
    """
    if len(samples) == 0:
        return []
    return _torch_default_collate(samples if isinstance(samples, list) else list(samples))


class Collate(BaseNode[Any]):
    """Applies ``collate_fn`` to each list of samples from ``source``, in the calling thread.

    ``collate_fn`` receives every batch, an empty one (``[]``) included: GuideLoom hands a
    rank's empty final batch to the collator too. To collate inside read workers instead,
    pass ``collate_fn`` to :class:`~guideloom_pipes.pipes.ReadSamples`.

    Args:
        source: Emits lists of samples (e.g. :class:`~guideloom_pipes.pipes.ReadSamples`).
        collate_fn: samples -> batch; ``None`` uses :func:`default_collate`.
    """

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[Any], collate_fn: Callable[[Any], Any] | None = None):
        super().__init__()
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        self.source = source
        self.collate_fn: Callable[[Any], Any] = collate_fn or default_collate

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.source.reset(initial_state[self.SOURCE_KEY])
        else:
            self.source.reset()

    def next(self) -> Any:
        return self.collate_fn(next(self.source))

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}
