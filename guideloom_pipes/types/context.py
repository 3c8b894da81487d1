"""The context-manager bases every reader and writer derives from (``open()``/``close()``)."""

from __future__ import annotations

import abc
import contextlib
from types import TracebackType
from typing import TypeVar

_SyncT = TypeVar("_SyncT", bound="SyncContextManager")
_AsyncT = TypeVar("_AsyncT", bound="AsyncContextManager")


class SyncContextManager(contextlib.AbstractContextManager, abc.ABC):
    """An object with ``open()``/``close()`` that ``with`` opens and closes."""

    def __enter__(self: _SyncT) -> _SyncT:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @abc.abstractmethod
    def open(self) -> None:
        """Acquire what the object needs (files, mappings); called by ``with``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what ``open`` acquired; called when the ``with`` block ends."""


class AsyncContextManager(contextlib.AbstractAsyncContextManager, abc.ABC):
    """The ``async`` counterpart of :class:`SyncContextManager` (``async with``)."""

    async def __aenter__(self: _AsyncT) -> _AsyncT:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    @abc.abstractmethod
    async def open(self) -> None:
        """Acquire what the object needs; awaited by ``async with``."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release what ``open`` acquired; awaited when the ``async with`` block ends."""
