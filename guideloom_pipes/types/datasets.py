"""Datasets (sample ``i`` -> decoded sample) and the loader's checkpoint dict."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Sequence
from typing import Any, Generic, TypedDict

from guideloom_pipes.types.buffers import (
    OutT,
)
from guideloom_pipes.types.context import (
    AsyncContextManager,
    SyncContextManager,
)
from guideloom_pipes.types.storages import (
    DocumentStorageAbstract,
    StreamStorageAbstract,
)


class DatasetSyncReaderAbstract(Sequence, SyncContextManager, abc.ABC, Generic[OutT]):
    """Indexed samples, open for reading: a ``Sequence`` (``len``, ``[i]``, slices, ``iter``,
    ``reversed``, ``in``) and a context manager."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many samples."""

    @abc.abstractmethod
    def __getitem__(self, index: int | slice) -> OutT | Sequence[OutT]:  # type: ignore[override]
        """Sample ``index``, or a list of samples for a slice."""


class DatasetAsyncReaderAbstract(AsyncContextManager, abc.ABC, Generic[OutT]):
    """Indexed samples for ``async`` code: ``len``, and ``await reader[i]`` /
    ``await reader[a:b]``; an ``async`` context manager."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many samples."""

    @abc.abstractmethod
    def __getitem__(self, index: int | slice) -> Awaitable[OutT] | Awaitable[Sequence[OutT]]:
        """An awaitable of sample ``index``, or of a list of samples for a slice."""


class DatasetAbstract(Generic[OutT], metaclass=abc.ABCMeta):
    """Numbered samples over a storage: factories of sync and ``async`` readers."""

    @abc.abstractmethod
    def __init__(
        self, storage: DocumentStorageAbstract[Any, OutT] | StreamStorageAbstract[Any, OutT]
    ) -> None:
        """Samples of ``storage``."""

    @abc.abstractmethod
    def sync_reader(self) -> DatasetSyncReaderAbstract[OutT]:
        """A reader (context manager)."""

    @abc.abstractmethod
    def async_reader(self) -> DatasetAsyncReaderAbstract[OutT]:
        """An ``async`` reader (``async with``)."""


#: Our older name of :class:`DatasetAbstract`.
Dataset = DatasetAbstract


class StatefulDataLoaderStateDict(TypedDict):
    """The checkpoint of a ``StatefulDataLoader`` (``state_dict()`` / ``load_state_dict``)."""

    epoch: int
    observation_offset: int
    shuffle: bool
    shuffle_seed: int | None
    drop_last: bool
