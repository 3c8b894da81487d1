"""Shared shape of the storages and their readers: construction, open/close, verification."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.storage.commit import _fsync_directory
from guideloom_pipes.storage.errors import DatasetChangedError
from guideloom_pipes.storage.io import ResolvedBackend, resolve_backend
from guideloom_pipes.storage.listing import discover
from guideloom_pipes.storage.manifest_open import ManifestListing, open_listing
from guideloom_pipes.storage.manifest_remote import index_remote, open_remote_listing
from guideloom_pipes.storage.manifest_write import NotTabulated, build_manifest
from guideloom_pipes.storage.names import shard_name
from guideloom_pipes.storage.records import format_name
from guideloom_pipes.storage.recovery import recover_directory, seal_shard
from guideloom_pipes.storage.remote import resolve_location
from guideloom_pipes.storage.remote_failures import RetryPolicy
from guideloom_pipes.storage.remote_paths import is_url
from guideloom_pipes.storage.shard_files import ShardFiles
from guideloom_pipes.storage.shard_listing import FileSizes, ShardListing
from guideloom_pipes.storage.verify import check_listing, verify_checksums
from guideloom_pipes.types import Storage

#: how many times ``storage.verify()`` opens the dataset again when a writer recommitted a
#: shard it was checking
_VERIFY_ATTEMPTS = 4


class StorageBase(Storage):
    """A dataset directory, the format its records use, and the backend that reads it.

    Args:
        storage_dir: the dataset directory; any ``pathlib.PurePath`` (a custom backend may
            serve paths that are not local files; writers need a local directory). A ``str``
            is taken as a local ``Path``, unless it is a URL (contains ``://``): ``file://``
            is a local path, any other is read in byte ranges through fsspec
            (``docs/remote.md``). A ``Path`` is always local.
        storage_format: the storage format.
        read_interface: the read backend (default :class:`~guideloom_pipes.io.MmapIO`), in
            GuideLoom's convention (:class:`~guideloom_pipes.types.IOReaderAbstract`). Not
            with a remote URL (``ValueError``).
        storage_options: for a URL, the fsspec file system's options (credentials,
            ``endpoint_url``, ...), as in ``fsspec.open``; unused for a local location.
        retry: for a URL, how transient failures are retried
            (:class:`~guideloom_pipes.storage.remote.RetryPolicy`; default
            ``RetryPolicy()``); unused for a local location.
        cache_dir: for a URL, a local directory for the shard cache: each shard file a
            reader touches is downloaded whole once (checked against its record), then read
            memory-mapped; shared by every process of the node. None (the default): range
            mode, nothing written locally. Unused for a local location.
        cache_limit_bytes: most bytes the shard cache keeps (least recently used files
            deleted first); None: no bound. Needs ``cache_dir``.

    The directory and format are also ``storage.dir`` and ``storage.format``.
    """

    kind = ""
    #: files per shard, the first marking the shard's presence
    suffixes: tuple[str, ...] = ()

    def __init__(
        self,
        storage_dir: PurePath | str,
        storage_format: Any,
        read_interface: Any = None,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        if is_url(storage_dir) or cache_dir is not None or cache_limit_bytes is not None:
            storage_dir, read_interface = resolve_location(
                storage_dir, read_interface, storage_options, retry, cache_dir, cache_limit_bytes
            )
        if isinstance(storage_dir, str):
            from pathlib import Path

            storage_dir = Path(storage_dir)
        if not isinstance(storage_dir, PurePath):
            raise TypeError(
                f"storage_dir must be a pathlib path (e.g. Path('data/tokens')), got "
                f"{storage_dir!r}"
            )
        self.dir = storage_dir
        self.format = storage_format
        self.read_interface = read_interface
        #: the fsspec options of a URL location (unused for a local one)
        self.storage_options = storage_options
        #: the shard cache's directory and bound (a URL location only; None: range mode)
        self.cache_dir = cache_dir
        self.cache_limit_bytes = cache_limit_bytes
        self._check_format(storage_format)

    @property
    def storage_dir(self) -> PurePath:
        """The dataset directory (also ``dir``)."""
        return self.dir

    @property
    def storage_format(self) -> Any:
        """The storage format (also ``format``)."""
        return self.format

    def _check_format(self, format: Any) -> None:
        """Raise ``TypeError`` if ``format`` does not fit this storage."""

    @property
    def backend(self) -> Any:
        """The read backend object (``read_interface``, or the default ``MmapIO()``)."""
        return self._resolve_io().backend

    def _resolve_io(self) -> ResolvedBackend:
        """The read backend behind the one calling convention the readers use."""
        return resolve_backend(self.read_interface)

    def _local_io(self, why: str) -> ResolvedBackend:
        """The read backend, which must be a local one: ``why`` says what needs it."""
        io = self._resolve_io()
        if not io.local:
            raise TypeError(
                f"{why}, so it needs a local directory; {self.read_interface!r} is not a "
                f"local backend"
            )
        return io

    def verify(self) -> dict[str, int]:
        """Check every committed shard's checksums; raise on a mismatch. Counts checked.

        A shard that a writer recommits while it is being checked is checked again in its
        new version (the dataset is listed again, up to a few times; then the
        :class:`~guideloom_pipes.storage.DatasetChangedError` says a writer is committing).
        """
        for attempt in range(_VERIFY_ATTEMPTS):
            try:
                with self.sync_reader() as reader:
                    return reader.verify()
            except DatasetChangedError:
                if attempt == _VERIFY_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def seal(self) -> list[int]:
        """Record shards that have no commit record yet, after checking their files.

        A dataset written by GuideLoom has no records, and once this package commits a
        shard into it, readers treat every shard without a record as uncommitted. Sealing
        checks each such shard as a reader would (files present, sizes consistent, document
        index matching its data), checksums it, and writes its record under the shard's
        write lock. Only seal shards whose writers have finished. Returns the shard ids
        sealed (``[]`` if every shard already had a record).
        """
        io = self._local_io("seal() writes records next to the shard files")
        listing = discover(io, self.dir, self.suffixes)
        bare = [shard for shard in range(listing.num_shards) if shard not in listing.records]
        if not bare:
            return []
        unrecorded = ShardListing(
            listing.directory, listing.num_shards, listing.sizes, {}, listing.listed
        )
        reader = self.sync_reader()
        sizes = check_listing(unrecorded, io, self.kind, self.suffixes, None)
        reader._attach(unrecorded, sizes)
        sealed = []
        try:
            for shard in bare:
                if seal_shard(
                    os.fspath(self.dir),
                    shard,
                    self.kind,
                    self.suffixes,
                    sizes[shard],
                    **reader._seal_args(shard),
                    format=format_name(self.format),
                ):
                    sealed.append(shard)
        finally:
            reader.close()
        _fsync_directory(os.fspath(self.dir))
        return sealed

    def index(self, *, own_marker: str | None = None) -> int:
        """Write the dataset's manifest (``.guideloom-manifest/``) from a listing of its
        directory, checked as an open checks it; the number of shards.

        For a dataset written without one (by GuideLoom, by an earlier version, by hand), or
        whose manifest a change by another tool made stale (a
        :class:`~guideloom_pipes.storage.StaleManifestWarning` says so): its opens then read
        the manifest instead of listing the directory and every commit record. Refused while
        a writer is writing (:class:`~guideloom_pipes.storage.ShardLockedError`).
        ``own_marker``: the marker of a writer that indexes what it wrote (write_parallel).

        A dataset at an object store's URL (``s3://``, ...) is indexed there: its table
        records each shard file's ETag too (see ``docs/remote.md``). An HTTP(S) URL cannot
        be indexed (``ValueError``): index the directory the server serves.
        """
        if not self._resolve_io().local:
            reader = self.sync_reader()
            suffixes = tuple(self.suffixes)
            return index_remote(
                self._resolve_io(),
                self.dir,
                self.kind,
                suffixes,
                reader._record_dtype(),
                reader._dtype_hint,
            )
        io = self._local_io("index() writes the manifest into the dataset directory")
        listing = discover(io, self.dir, self.suffixes)
        reader = self.sync_reader()
        check_listing(
            listing, io, self.kind, self.suffixes, reader._record_dtype(), reader._dtype_hint
        )
        records = {shard: listing.records[shard] for shard in listing.records}
        try:
            build_manifest(
                os.fspath(self.dir),
                self.kind,
                self.suffixes,
                records,
                listing.num_shards,
                own_marker=own_marker,
            )
        except NotTabulated as error:
            raise ValueError(
                f"cannot index {os.fspath(self.dir)}: {error}; run storage.recover() "
                f"(guideloom-pipes recover) first"
            ) from None
        return listing.num_shards

    def recover(self) -> dict[str, list[int]]:
        """Finish what writers that stopped (killed, out of space) left in the directory.

        A commit that passed its commit point is rolled forward (its files get their
        canonical names, which GuideLoom reads); a removal is finished; versioned files no
        record names, stale temporaries and stale locks are deleted. Shards a live writer
        holds are left alone. Every writer's ``open`` does the same. Returns the shard ids
        ``{"rolled_forward": [...], "removed": [...], "cleaned": [...]}``.
        """
        self._local_io("recover() changes files of the dataset directory")
        return recover_directory(os.fspath(self.dir))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({os.fspath(self.dir)!r}, {self.format!r})"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ReaderBase:
    """Discovery, checks and lifecycle shared by the storage readers."""

    def __init__(self, storage: StorageBase) -> None:
        self.storage = storage
        self._io = storage._resolve_io()
        self._open = False
        self.listing: ShardListing | None = None
        self._files: dict[str, ShardFiles] = {}
        self._sizes = FileSizes({})

    @property
    def is_open(self) -> bool:
        """Whether ``open()`` has been called and ``close()`` not yet."""
        return self._open

    def open(self) -> None:
        """Discover and check the shards; idempotent. A dataset with a manifest that passes
        its checks opens from it (a local one: a few files read; one at a URL: one request
        for its whole table), whatever the number of shards; others are listed (cost
        O(number of shards))."""
        if self._open:
            return
        storage = self.storage
        found = self._manifest_listing()
        want = self._record_dtype()
        if found is not None and (found.dtype is None or want is None or found.dtype == want):
            self._attach(found, found.file_sizes())
            return
        listing = discover(self._io, storage.dir, storage.suffixes)
        sizes = check_listing(
            listing,
            self._io,
            storage.kind,
            storage.suffixes,
            self._record_dtype(),
            self._dtype_hint,
        )
        self._attach(listing, sizes)

    def _manifest_listing(self) -> ManifestListing | None:
        """The listing from the dataset's manifest, where it has one that passes the open's
        checks (see ``manifest_open`` and ``manifest_remote``)."""
        storage = self.storage
        suffixes = tuple(storage.suffixes)
        if self._io.local:
            return open_listing(storage.dir, storage.kind, suffixes)
        return open_remote_listing(self._io, storage.dir, storage.kind, suffixes)

    def _attach(
        self, listing: ShardListing, sizes: FileSizes | Sequence[Mapping[str, int]]
    ) -> None:
        """Serve the shards of a checked ``listing`` whose files have ``sizes``."""
        storage = self.storage
        if not isinstance(sizes, FileSizes):
            sizes = FileSizes.from_dicts(sizes, storage.suffixes)
        self.listing = listing
        self._files = {
            suffix: ShardFiles(self._io, storage.dir, suffix, listing.num_shards, listing=listing)
            for suffix in storage.suffixes
        }
        self._setup(listing, sizes)
        self._sizes = sizes
        self._open = True

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this version of the dataset, compactly: the number of shards, a
        digest of every shard file's size, and a digest of the commit records' checksums
        (``None`` for a dataset without records). Two opens of an unchanged dataset give
        the same; appending, removing or rewriting a shard changes it. A loader's
        checkpoint carries it, so that a state is not resumed on another dataset."""
        self._check_open()
        assert self.listing is not None
        return self.listing.fingerprint(self._sizes)

    def _record_dtype(self) -> np.dtype[Any] | None:
        return None

    def _dtype_hint(self, dtype: np.dtype[Any]) -> str:
        return f"a format whose stream_dtype is np.dtype({dtype.descr!r})"

    def _setup(self, listing: ShardListing, sizes: FileSizes) -> None:
        raise NotImplementedError

    def _seal_args(self, shard: int) -> dict[str, Any]:
        """``count``/``dtype``/``payloads`` of shard ``shard``'s record, after the checks a
        first read would make (see :meth:`StorageBase.seal`)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release every mapping and descriptor. Samples already returned stay valid."""
        for files in self._files.values():
            files.close()
        self._files = {}
        self._open = False

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
        shard = check_int("shard", shard)
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
        return verify_checksums(self.listing, self._io, self.storage.suffixes)

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

    @property
    def num_shards(self) -> int:
        """How many shards the dataset has."""
        return int(self._sync.num_shards)

    @property
    def total_length(self) -> int:
        """Elements (stream) or documents in the whole dataset."""
        return int(self._sync.total_length)

    def length(self, shard: int) -> int:
        """Elements (stream) or documents in shard ``shard``."""
        return int(self._sync.length(shard))

    def __getattr__(self, name: str) -> Any:
        # Other cheap attributes (shard_starts, ...) come straight from the sync reader.
        return getattr(self._sync, name)
