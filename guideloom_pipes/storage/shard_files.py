"""Reading shard files: :class:`ShardFiles` holds the byte readers of one file kind across the
shards (opened lazily, descriptor-holding ones kept in an LRU) and reads or fills buffers."""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

import numpy as np

from guideloom_pipes.storage.backend_base import (
    _identity,
    descriptor_limit,
    max_mapped_per_kind,
    max_open_per_kind,
)
from guideloom_pipes.storage.errors import DatasetChangedError
from guideloom_pipes.storage.io import resolve_backend
from guideloom_pipes.storage.names import shard_name
from guideloom_pipes.storage.shard_listing import ShardListing


def _fill_function(reader: Any) -> Callable[[int, memoryview], int]:
    """``fill(offset, buffer)`` for ``reader``: its own ``readinto`` where it has one (our
    byte-range backends: the system call fills ``buffer``), else ``read`` and a copy."""
    readinto = getattr(reader, "readinto", None)
    if callable(readinto):
        return readinto
    return functools.partial(_read_and_copy, reader)


def _read_and_copy(reader: Any, offset: int, buffer: memoryview) -> int:
    """``reader.read`` copied into ``buffer``; the bytes ``read`` returned.

    The copy is a memoryview assignment, a ``memcpy`` under the GIL: numpy's copy of more
    than a few hundred elements releases the GIL and takes it back, and with many reading
    threads each such handoff costs more than the copy.
    """
    data = reader.read(offset, len(buffer))
    try:
        view = memoryview(data).cast("B")
    except TypeError:  # not contiguous, or not a plain buffer format
        view = memoryview(memoryview(data).tobytes())
    got = len(view)
    if got <= len(buffer):
        buffer[:got] = view
    return got


class ShardFiles:
    """Byte readers of one file kind (``suffix``) across the shards, opened lazily.

    Readers of backends that hold a descriptor per open file (``holds_fd``, and any custom
    backend) are kept in an LRU of at most ``max_open``; memory-mapped ones hold none, and
    at most ``max_mapped`` shards stay mapped: past that, the shard mapped first is let go
    (its reader and arrays dropped, and :meth:`on_release` listeners told, so that the
    mapping is unmapped once no array of it is in use; a later read maps it again, its
    identity checked again). Thread-safe.

    Args:
        backend: the read backend.
        directory: the dataset directory.
        suffix: the file kind, e.g. ``".in_band.bin"``.
        num_shards: how many shards there are.
        max_open: most descriptor-holding readers kept open at once (default:
            :func:`~guideloom_pipes.storage.backend_base.max_open_per_kind`, 64 or less under a low
            ``ulimit -n``). Where opening one more fails for want of descriptors, idle
            readers are closed and the open tried again; if every open one is in use, an
            ``OSError`` says which limit to raise.
        max_mapped: most shards kept mapped at once (default:
            :func:`~guideloom_pipes.storage.backend_base.max_mapped_per_kind`, an eighth
            of the kernel's limit on a process's mappings, ``vm.max_map_count``).
    """

    def __init__(
        self,
        backend: Any,
        directory: PurePath,
        suffix: str,
        num_shards: int,
        max_open: int | None = None,
        *,
        listing: ShardListing | None = None,
        max_mapped: int | None = None,
    ) -> None:
        self.backend = resolve_backend(backend)
        self.directory = directory
        self.suffix = suffix
        self.num_shards = num_shards
        self._listing = listing
        self.bounded = self.backend.holds_fd
        #: whether ``read`` returns fresh buffers nobody else holds (our local backends)
        self.owned_reads = self.backend.local
        #: whether readers may offer ``buffer()`` (only tried where no descriptor is held)
        self._mappable = not self.bounded
        self.max_open = max(1, max_open_per_kind() if max_open is None else max_open)
        # with no more shards than max_open nothing is ever evicted: reads skip the LRU lock
        self._never_evicts = num_shards <= self.max_open
        # per shard opened, its reader; per shard read into, its reader's fill(offset, buffer)
        # (only where readers are never evicted). Dicts of the shards touched, not lists of
        # every shard: 8 bytes a shard per list, 8 MB for a million shards
        self._readers: dict[int, Any] = {}
        self._fills: dict[int, Callable[[int, memoryview], int]] = {}
        self._arrays: dict[tuple[int, str], np.ndarray] = {}
        self.max_mapped = max(1, max_mapped_per_kind() if max_mapped is None else max_mapped)
        # shards mapped, oldest first, each with the dtypes its arrays were made in (kept
        # only where there are more shards than may stay mapped), and who drops theirs on a
        # release
        self._bounds_maps = num_shards > self.max_mapped
        self._maps_order: dict[int, list[str]] = {}
        self._on_release: list[Callable[[int], None]] = []
        self._lru: OrderedDict[int, int] = OrderedDict()  # shard -> readers in use
        self._lock = threading.Lock()
        #: locks of the opens of shards (striped: shard % len), so that a slow open of one
        #: shard does not hold up the reads of others
        self._opening = [threading.Lock() for _ in range(max(1, min(num_shards, 64)))]
        self._closed = False

    def path(self, shard: int) -> PurePath:
        if self._listing is not None:
            return self.directory / self._listing.file_name(shard, self.suffix)
        return self.directory / (shard_name(shard) + self.suffix)

    def _open_reader(self, shard: int) -> Any:
        """Open the shard's reader; where the listing knows the file's identity (local
        backends), only on that very file.

        A writer may have replaced the shard since the dataset was listed: the file the
        listing saw is then looked for under the names it may have (a versioned file also
        gets its canonical name when its commit rolls forward), checked by device, inode
        and size before and after opening, and otherwise the reader fails with
        :class:`DatasetChangedError` rather than read another version. The same check runs
        when a reader closed by the LRU opens again.
        """
        identity = None
        if self._listing is not None:
            identity = self._listing.identities.get((shard, self.suffix))
        if identity is None:
            # a backend that pins what the open found (FsspecIO: the ETag, the record's
            # checksum for its cache) is given it
            pinned = getattr(self.backend.backend, "shard_reader", None)
            if callable(pinned) and self._listing is not None:
                reader = pinned(self.path(shard), self._listing.expected(shard, self.suffix))
            else:
                reader = self.backend.reader(self.path(shard))
            reader.open()
            return reader
        assert self._listing is not None
        size = self._listing.sizes.get((shard, self.suffix), -1)
        canonical = shard_name(shard) + self.suffix
        listed = self._listing.file_name(shard, self.suffix)
        for name in (listed,) if listed == canonical else (listed, canonical):
            reader = self._open_same(shard, self.directory / name, identity, size)
            if reader is not None:
                return reader
        path = os.fspath(self.directory / canonical)
        raise DatasetChangedError(
            f"shard {shard_name(shard)} of {os.fspath(self.directory)} was replaced by a "
            f"writer after this reader opened the dataset ({path} is now "
            f"another file, or gone){self._listing.changed_hint}: the dataset was rewritten "
            f"under an open reader, which reads only the version it opened. Open the dataset "
            f"again (a new reader) to read the new version"
        )

    def _open_same(self, shard: int, path: PurePath, identity: tuple[int, int], size: int) -> Any:
        """The open reader of ``path`` if it is the file ``identity`` of ``size`` bytes (and
        the same as far as the listing can tell: see ``ShardListing.same_file``)."""
        local = os.fspath(path)
        assert self._listing is not None
        try:
            info = os.stat(local)
            if _identity(info) != identity:
                return None
            if not self._listing.same_file(shard, self.suffix, info):
                return None
            reader = self.backend.reader(path)
            reader.open()
        except FileNotFoundError:
            return None
        # the file opened: a local reader's own (what its descriptor was), else the path's now
        opened = getattr(reader, "identity", None)
        try:
            if opened is None:
                opened = _identity(os.stat(local))
            same = opened == identity and reader.filesize() == size
        except FileNotFoundError:
            same = False
        if not same:  # replaced between the two looks: another file is open
            reader.close()
            return None
        return reader

    def array(self, shard: int, dtype: np.dtype[Any]) -> np.ndarray | None:
        """The whole file as a read-only numpy array, when the backend maps files; else None."""
        key = (shard, dtype.str if dtype.names is None else repr(dtype.descr))
        found = self._arrays.get(key)
        if found is not None:
            return found
        if not self._mappable:
            return None
        buffer = getattr(self._shared(shard), "buffer", None)  # mappable: never evicted
        if buffer is None:
            self._mappable = False  # a custom backend without buffers: use read()
            return None
        with self._lock:
            found = self._arrays.get(key)
            if found is None:
                view = buffer()
                usable = len(view) - len(view) % dtype.itemsize
                found = self._arrays[key] = np.frombuffer(view[:usable], dtype=dtype)
                if self._bounds_maps:
                    self._maps_order.setdefault(shard, []).append(key[1])
                    if len(self._maps_order) > self.max_mapped:
                        self._let_go(next(iter(self._maps_order)))
            return found

    def on_release(self, forget: Callable[[int], None]) -> None:
        """Call ``forget(shard)`` (under this object's lock: it should only drop references)
        when a shard is let go for others to be mapped, so that a reader drops what it
        keeps of the shard's arrays."""
        self._on_release.append(forget)

    def _let_go(self, shard: int) -> None:
        """Let go of shard ``shard``'s mapping (under ``_lock``): its reader is dropped, not
        closed (a read in another thread may be using it), and unmapped with its last view."""
        for dtype in self._maps_order.pop(shard):
            self._arrays.pop((shard, dtype), None)
        self._readers.pop(shard, None)
        self._fills.pop(shard, None)
        for forget in self._on_release:
            forget(shard)

    def read(self, shard: int, offset: int, size: int) -> Any:
        """``size`` bytes at ``offset`` of the shard's file."""
        if not self.bounded or self._never_evicts:
            return self._shared(shard).read(offset, size)
        reader = self._acquire(shard)
        try:
            return reader.read(offset, size)
        finally:
            self._release(shard)

    def readinto(self, shard: int, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` (a writable, contiguous byte memoryview) with the bytes at ``offset``
        of the shard's file; returns how many bytes the file had there (fewer than
        ``len(buffer)`` only past its end)."""
        if not self.bounded or self._never_evicts:
            fill = self._fills.get(shard)
            if fill is None:
                fill = self._fills[shard] = _fill_function(self._shared(shard))
            return int(fill(offset, buffer))
        reader = self._acquire(shard)
        try:
            return int(_fill_function(reader)(offset, buffer))
        finally:
            self._release(shard)

    def _shared(self, shard: int) -> Any:
        """The shard's reader, opened on first use, where readers are never evicted.

        Opens of different shards run in parallel (an open may be slow: the shard cache
        downloads the whole file), two of one shard never."""
        reader = self._readers.get(shard)
        if reader is None:
            with self._opening[shard % len(self._opening)]:
                if self._closed:
                    raise RuntimeError("reader is closed")
                reader = self._readers.get(shard)
                if reader is None:
                    reader = self._open_within_limit(shard)
                    with self._lock:
                        if self._closed:  # closed while this one opened
                            reader.close()
                            raise RuntimeError("reader is closed")
                        self._readers[shard] = reader
        return reader

    def _open_within_limit(self, shard: int) -> Any:
        """:meth:`_open_reader`; out of descriptors (``EMFILE``/``ENFILE``), close the idle
        readers of the LRU and try once more, then raise an error saying what to raise."""
        try:
            return self._open_reader(shard)
        except OSError as error:
            if error.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            failure = error
        if self.bounded and not self._never_evicts and self._close_idle():
            try:
                return self._open_reader(shard)
            except OSError as error:
                if error.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                failure = error
        held = len(self._readers) if self.bounded else 0
        mmap = ", or read with MmapIO(), which holds no descriptor per open file"
        raise OSError(
            failure.errno,
            f"too many open files opening {os.fspath(self.path(shard))}: this reader holds "
            f"{held} {self.suffix} files open, all in use, and the process may have "
            f"{descriptor_limit() or 'its maximum of'} descriptors open in all (ulimit -n). "
            f"Raise that limit (ulimit -n, or resource.setrlimit(resource.RLIMIT_NOFILE, "
            f"...)), or read with fewer threads{mmap if self.bounded else ''}",
        ) from failure

    def _close_idle(self) -> bool:
        """Close every reader of the LRU that no read is using; whether any was closed."""
        idle = [shard for shard, users in self._lru.items() if users == 0]
        for shard in idle:
            del self._lru[shard]
            self._readers.pop(shard).close()
        return bool(idle)

    def _acquire(self, shard: int) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("reader is closed")
            reader = self._readers.get(shard)
            if reader is None:
                self._evict()
                reader = self._readers[shard] = self._open_within_limit(shard)
                self._lru[shard] = 0
            self._lru[shard] += 1
            self._lru.move_to_end(shard)
            return reader

    def _release(self, shard: int) -> None:
        with self._lock:
            self._lru[shard] -= 1

    def _evict(self) -> None:
        if len(self._lru) < self.max_open:
            return
        for shard, users in list(self._lru.items()):
            if users == 0:
                del self._lru[shard]
                self._readers.pop(shard).close()
                if len(self._lru) < self.max_open:
                    return

    def close(self) -> None:
        """Close every open reader."""
        with self._lock:
            self._closed = True
            self._arrays.clear()
            self._fills.clear()
            self._maps_order.clear()
            readers, self._readers = self._readers, {}
            for reader in readers.values():
                reader.close()
            self._lru.clear()
