"""Shared shape of the storages and their readers: construction, open/close, verification."""

from __future__ import annotations

import asyncio
import os
from pathlib import PurePath
from typing import Any

import numpy as np

from guideloom_pipes.storage.io import resolve_backend
from guideloom_pipes.storage.shards import (
    ShardFiles,
    ShardListing,
    check_listing,
    discover,
    shard_name,
    verify_checksums,
)
from guideloom_pipes.types import Storage


class StorageBase(Storage):
    """A dataset directory, the format its records use, and the backend that reads it.

    Args:
        dir: the dataset directory; any ``pathlib.PurePath`` (a custom backend may serve
            paths that are not local files; writers need a local directory).
        format: the storage format.
        read_interface: the read backend (default :class:`~guideloom_pipes.io.MmapIO`).
    """

    kind = ""
    #: files per shard, the first marking the shard's presence
    suffixes: tuple[str, ...] = ()

    def __init__(self, dir: PurePath | str, format: Any, read_interface: Any = None) -> None:
        if isinstance(dir, str):
            from pathlib import Path

            dir = Path(dir)
        if not isinstance(dir, PurePath):
            raise TypeError(f"dir must be a pathlib path (e.g. Path('data/tokens')), got {dir!r}")
        self.dir = dir
        self.format = format
        self.read_interface = read_interface
        self._check_format(format)

    def _check_format(self, format: Any) -> None:
        """Raise ``TypeError`` if ``format`` does not fit this storage."""

    @property
    def backend(self) -> Any:
        """The resolved read backend."""
        return resolve_backend(self.read_interface)

    def verify(self) -> dict[str, int]:
        """Check every committed shard's checksums; raise on a mismatch. Counts checked."""
        with self.sync_reader() as reader:
            return reader.verify()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({os.fspath(self.dir)!r}, {self.format!r})"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ReaderBase:
    """Discovery, checks and lifecycle shared by the storage readers."""

    def __init__(self, storage: StorageBase) -> None:
        self.storage = storage
        self.backend = storage.backend
        self._open = False
        self.listing: ShardListing | None = None
        self._files: dict[str, ShardFiles] = {}

    @property
    def is_open(self) -> bool:
        """Whether ``open()`` has been called and ``close()`` not yet."""
        return self._open

    def open(self) -> None:
        """Discover and check the shards (cost O(number of shards)); idempotent."""
        if self._open:
            return
        storage = self.storage
        listing = discover(self.backend, storage.dir, storage.suffixes)
        sizes = check_listing(
            listing,
            self.backend,
            storage.kind,
            storage.suffixes,
            self._record_dtype(),
            self._dtype_hint,
        )
        self.listing = listing
        self._files = {
            suffix: ShardFiles(self.backend, storage.dir, suffix, listing.num_shards)
            for suffix in storage.suffixes
        }
        self._setup(listing, sizes)
        self._open = True

    def _record_dtype(self) -> np.dtype[Any] | None:
        return None

    def _dtype_hint(self, dtype: np.dtype[Any]) -> str:
        return f"a format whose stream_dtype is np.dtype({dtype.descr!r})"

    def _setup(self, listing: ShardListing, sizes: list[dict[str, int]]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release every mapping and descriptor. Samples already returned stay valid."""
        for files in self._files.values():
            files.close()
        self._files = {}
        self._open = False

    def __enter__(self) -> Any:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(
                f"{type(self).__name__} of {os.fspath(self.storage.dir)} is not open; call "
                f"open() or use it in a `with` block"
            )

    @property
    def num_shards(self) -> int:
        """How many shards the dataset has."""
        self._check_open()
        assert self.listing is not None
        return self.listing.num_shards

    def _check_shard(self, shard: int) -> int:
        self._check_open()
        if isinstance(shard, bool) or not isinstance(shard, (int, np.integer)):
            raise TypeError(f"shard must be an int, got {shard!r} ({type(shard).__name__})")
        shard = int(shard)
        if not 0 <= shard < self.num_shards:
            raise IndexError(
                f"shard {shard} out of range: {os.fspath(self.storage.dir)} has shards "
                f"0..{self.num_shards - 1}"
            )
        return shard

    def verify(self) -> dict[str, int]:
        """Recompute the checksums of every committed shard; raise on a mismatch."""
        self._check_open()
        assert self.listing is not None
        return verify_checksums(self.listing, self.backend, self.storage.suffixes)

    def _shard_path(self, shard: int, suffix: str) -> str:
        return os.fspath(self.storage.dir / (shard_name(shard) + suffix))


class AsyncReaderBase:
    """An ``async`` facade over a sync reader: blocking calls run in a worker thread."""

    def __init__(self, sync_reader: Any) -> None:
        self._sync = sync_reader

    async def open(self) -> None:
        """Open the underlying reader."""
        await asyncio.to_thread(self._sync.open)

    async def close(self) -> None:
        """Close the underlying reader."""
        self._sync.close()

    async def __aenter__(self) -> Any:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __getattr__(self, name: str) -> Any:
        # Cheap attributes (num_shards, total_length, ...) come straight from the sync reader.
        return getattr(self._sync, name)
