"""Read backends: byte-range readers of one file (GuideLoom's abstract bases and our structural
protocols)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from pathlib import PurePath
from typing import Any, Generic, Protocol, runtime_checkable

from guideloom_pipes.types.buffers import (
    Buffer,
    PathT,
    StorageBufferTypes,
)


class IOSyncReaderAbstract(metaclass=abc.ABCMeta):
    """Reads byte ranges of one file (made by a backend's ``sync_reader()`` factory).

    ``open`` raises ``FileNotFoundError`` for a missing file.
    """

    @abc.abstractmethod
    def filesize(self) -> int:
        """The file's size in bytes (after ``open``)."""

    @abc.abstractmethod
    def read(self, offset: int, size: int) -> StorageBufferTypes:
        """``size`` bytes from ``offset``."""

    @abc.abstractmethod
    def open(self) -> None:
        """Open the file."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the file."""


class IOAsyncReaderAbstract(metaclass=abc.ABCMeta):
    """The ``async`` counterpart of :class:`IOSyncReaderAbstract`, plus ``close_sync()``."""

    @abc.abstractmethod
    async def filesize(self) -> int:
        """The file's size in bytes (after ``open``)."""

    @abc.abstractmethod
    async def read(self, offset: int, size: int) -> StorageBufferTypes:
        """``size`` bytes from ``offset``."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Open the file."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the file."""

    @abc.abstractmethod
    def close_sync(self) -> None:
        """Close the file without an event loop (e.g. from a finalizer)."""


class IOReaderAbstract(Generic[PathT], metaclass=abc.ABCMeta):
    """A read backend (a storage's ``read_interface``).

    ``sync_reader()`` and ``async_reader()`` return *factories*: call one with a path to get
    a reader of that file (``backend.sync_reader()(path)``). The path is whatever
    ``pathlib.PurePath`` the storage was given, so a backend may serve an object store.

    Our extension: a backend may also define ``list_dir(path) -> Iterable[str]`` (the file
    names in a directory). With it, shard discovery lists the directory and detects a gap
    in the shard ids; without it, discovery probes ids one by one, as GuideLoom does.
    """

    @staticmethod
    @abc.abstractmethod
    def is_supported() -> bool:
        """Whether this backend works on this platform."""

    @abc.abstractmethod
    def sync_reader(self) -> Callable[[PathT], IOSyncReaderAbstract]:
        """A factory of sync readers: ``factory(path)``."""

    @abc.abstractmethod
    def async_reader(self) -> Callable[[PathT], IOAsyncReaderAbstract]:
        """A factory of ``async`` readers: ``factory(path)``."""


@runtime_checkable
class SyncByteReader(Protocol):
    """Any object that reads byte ranges of one file (the shape of
    :class:`IOSyncReaderAbstract`, without subclassing it)."""

    def open(self) -> None: ...

    def close(self) -> None: ...

    def filesize(self) -> int: ...

    def read(self, offset: int, size: int) -> Buffer: ...


@runtime_checkable
class AsyncByteReader(Protocol):
    """The ``async`` counterpart of :class:`SyncByteReader`."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def filesize(self) -> int: ...

    async def read(self, offset: int, size: int) -> Buffer: ...


@runtime_checkable
class ReadInterface(Protocol):
    """A read backend (see :class:`IOReaderAbstract`): ``sync_reader()`` returns a factory
    that is called with the path (``async_reader()`` likewise, and is optional)."""

    def sync_reader(self) -> Any: ...

    def async_reader(self) -> Any: ...


@runtime_checkable
class ListingReadInterface(ReadInterface, Protocol):
    """A :class:`ReadInterface` that can list a directory (enables gap detection)."""

    def list_dir(self, path: PurePath) -> Iterable[str]: ...
