"""The readers of one remote shard file that :class:`~guideloom_pipes.storage.remote.FsspecIO`
hands out: byte ranges pinned to the ETag the dataset's open listed, each answer's
length and (where its record has block checksums) content checked
(:class:`_RemoteReader`), or the file read whole into the shard cache, then
memory-mapped (:class:`_CachedReader`).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

from guideloom_pipes.storage.cache import CachedFile
from guideloom_pipes.storage.checksums import BlockChecksums
from guideloom_pipes.storage.errors import (
    CorruptShardError,
    DatasetChangedError,
    StorageError,
    size_changed,
)
from guideloom_pipes.storage.io import _MmapReader
from guideloom_pipes.storage.names import RECORD, SHARD_NAME, shard_name
from guideloom_pipes.storage.records import ExpectedFile, ShardRecord
from guideloom_pipes.storage.remote_failures import (
    RangeIgnoredError,
    _changed,
    _describe,
    _shard_label,
    _ShortRead,
    logger,
)
from guideloom_pipes.types import IOSyncReaderAbstract

if TYPE_CHECKING:
    from guideloom_pipes.storage.remote import FsspecIO


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _shard_id(name: str) -> int:
    """The shard id of the file ``name`` (-1 where it is not a shard file)."""
    match = SHARD_NAME.match(name)
    return int(match["shard"]) if match else -1


def _strong(etag: str | None) -> bool:
    """Whether ``etag`` is a strong ETag: ``If-Match`` compares strongly, so a weak one
    (``W/"..."``, a server that compresses on the fly) would never match."""
    return etag is not None and not etag.startswith("W/")


def _check_length(url: str, start: int, end: int, size: int, got: int) -> None:
    """Refuse an answer of ``got`` bytes to a read of bytes ``start..end`` of an object of
    ``size`` bytes: the whole object where a part was asked for is a server that ignores
    ``Range`` (:class:`RangeIgnoredError`, not retried); any other length a
    :class:`_ShortRead` (retried)."""
    want = end - start
    if got == want:
        return
    if got == size:
        raise RangeIgnoredError(
            f"reading bytes {start}..{end} of {url} ({_shard_label(url)}): the server "
            f"answered with the whole object ({size} bytes) instead of those {want} bytes, so "
            f"it ignored the HTTP Range header. A dataset is read in byte ranges: serve it "
            f"from a server that honours Range requests (nginx, S3, a CDN with range "
            f"requests on), not through a proxy that drops the header"
        )
    raise _ShortRead(f"asked for bytes {start}..{end} ({want} bytes), got {got} bytes")


class _RemoteReader(IOSyncReaderAbstract):
    """Byte ranges of one object: its size on ``open`` (one request, none where the open
    of its dataset found it), a request per read; pinned to the ETag the open found."""

    def __init__(self, backend: FsspecIO, url: str, expected: ExpectedFile | None = None) -> None:
        self.backend = backend
        self.url = url
        self.expected = expected
        #: the object's ETag (None until open, or where the server gives none)
        self.etag: str | None = None
        self._pin: str | None = None
        self._size = -1

    def open(self) -> None:
        if self._size >= 0:
            return
        expected = self.expected
        hint = expected.changed_hint if expected is not None else ""
        if expected is not None and expected.size is not None and expected.etag is not None:
            self._size, self.etag = expected.size, expected.etag  # found by the open
            if _strong(expected.etag) and self._checks_each_read():
                self._pin = expected.etag  # every read is conditional
                return
            # no conditional reads (a weak ETag, another protocol): checked once, now
            now = self._info()[1]
            if now != expected.etag:
                self._size = -1
                raise _changed(self.url, expected.etag, now, hint)
            return
        size, self.etag = self._info()
        if expected is not None and expected.etag is not None and self.etag != expected.etag:
            raise _changed(self.url, expected.etag, self.etag, hint)
        if expected is not None and expected.size is not None and size != expected.size:
            # (an open from a manifest learns the size only now, at the shard's first read)
            where, _, name = self.url.rpartition("/")
            raise size_changed(name, where, size, expected.size, _shard_id(name))
        self._size = size
        if expected is not None and _strong(self.etag) and self._checks_each_read():
            self._pin = self.etag

    def _checks_each_read(self) -> bool:
        """Whether this protocol's reads can be made conditional on an ETag (If-Match)."""
        fs = self.backend.fs
        return hasattr(fs, "_call_s3") or any(p in ("http", "https") for p in _protocols(fs))

    def _info(self) -> tuple[int, str | None]:
        info = dict(self.backend.request("finding the size of", self.url, "info", self.url))
        if info.get("type") == "directory":
            raise IsADirectoryError(f"{self.url} is a directory, not a shard file")
        size = info.get("size")
        if size is None:
            raise OSError(
                f"{self.url}: the server did not say the object's size (no Content-Length), "
                f"so its shards cannot be checked against their commit records; serve the "
                f"files with their sizes (a static file server does)"
            )
        tag = info.get("ETag") or info.get("etag")
        return int(size), str(tag) if tag else None

    def close(self) -> None:
        self._size = -1

    def filesize(self) -> int:
        if self._size < 0:
            raise RuntimeError(f"reader of {self.url} is not open; call open() first")
        return self._size

    def read(self, offset: int, size: int) -> memoryview:
        """Bytes ``offset..offset + size`` (fewer past the end of the object), checked
        against the commit record: the range is widened to the whole blocks around it and
        each block's CRC-32 compared with the record's (records without block checksums:
        a read of the whole file is compared with the file's CRC-32)."""
        size_now = self.filesize()
        end = min(offset + size, size_now)
        want = max(0, end - offset)
        if want == 0:
            return memoryview(b"")
        expected = self.expected
        blocks = expected.blocks if expected is not None else None
        if blocks is not None and blocks.fits(size_now):
            start, stop = blocks.span(offset, end, size_now)
        else:
            start, stop, blocks = offset, end, None

        def fetch() -> bytes:
            try:
                data = self.backend.ranged(self.url, start, stop, self._pin)
            except DatasetChangedError as error:
                hint = self.expected.changed_hint if self.expected is not None else ""
                if not hint:
                    raise
                raise DatasetChangedError(f"{error}{hint}") from error
            _check_length(self.url, start, stop, size_now, len(data))
            return data

        def ranged() -> memoryview:
            data = fetch()
            wrong = self._mismatch(data, start, blocks)
            if wrong is not None:  # a byte spoiled on the way is not there the next time
                logger.info("%s; reading it again", self._mismatch_text(wrong))
                data = fetch()
                wrong = self._mismatch(data, start, blocks)
                if wrong is not None:
                    raise self._refusal(offset, end, wrong)
            view = memoryview(data)
            return view if stop - start == want else view[offset - start : end - start]

        return self.backend.call(f"reading bytes {offset}..{end} of", self.url, ranged)

    def _mismatch(
        self, data: bytes, start: int, blocks: BlockChecksums | None
    ) -> tuple[int, int, int, int] | None:
        """``(first byte, end, CRC-32 read, CRC-32 committed)`` of the first block of
        ``data`` (read from ``start``) that differs from the record (without block
        checksums: of a read of the whole file that differs); None if none does."""
        if blocks is not None:
            found = blocks.mismatch(data, start)
            if found is None:
                return None
            block, crc = found
            first = block * blocks.block_size
            return first, min(first + blocks.block_size, start + len(data)), crc, blocks.crc(block)
        committed = self.expected.crc32 if self.expected is not None else None
        if committed is not None and start == 0 and len(data) == self._size:
            crc = zlib.crc32(data)
            if crc != committed:
                return 0, len(data), crc, committed
        return None

    def _mismatch_text(self, wrong: tuple[int, int, int, int]) -> str:
        first, last, crc, committed = wrong
        return (
            f"bytes {first}..{last} of {self.url} ({_shard_label(self.url)}) do not match its "
            f"commit record (crc32 {crc:#010x}, committed {committed:#010x})"
        )

    def _refusal(self, offset: int, end: int, wrong: tuple[int, int, int, int]) -> StorageError:
        """The error for bytes that differ from the record twice: a
        :class:`DatasetChangedError` where the shard's record changed since the open (the
        shard was committed again: this reader's view is old), else a
        :class:`CorruptShardError`."""
        asked = f", read for bytes {offset}..{end}" if (offset, end) != wrong[:2] else ""
        if self._recommitted():
            return DatasetChangedError(
                f"{self._mismatch_text(wrong)}{asked}, twice: the shard was committed again "
                f"after this reader opened the dataset (its commit record now describes other "
                f"content) and the object was replaced keeping its ETag (the same size and "
                f"modification time, as `rsync -a` can leave it). Open the dataset again (a "
                f"new reader) to read the new version"
            )
        return CorruptShardError(
            f"{self._mismatch_text(wrong)}{asked}, twice: the object is not the one that was "
            f"committed. It was changed in place without a new commit (a data file replaced by "
            f"one of the same size, e.g. by `rsync -a`, which keeps the modification time, so "
            f"the server's ETag did not change either), or it is corrupt in storage or on the "
            f"way. Restore the object or rewrite the shard; `guideloom-pipes verify URL` checks "
            f"every shard"
        )

    def _recommitted(self) -> bool:
        """Whether the shard's commit record, read again now (one try), describes this file
        otherwise than the record the open read; False where it cannot be told."""
        match = SHARD_NAME.match(self.url.rpartition("/")[2])
        if match is None or self.expected is None:
            return False
        url = f"{self.url.rpartition('/')[0]}/{shard_name(int(match['shard']))}{RECORD}"
        try:
            record = ShardRecord.from_json(bytes(self.backend.once("cat_file", url)), url)
        except Exception:  # gone, refused, unreadable: nothing to compare (the data is refused)
            return False
        entry = record.files.get(match["suffix"].lstrip("."))
        expected = self.expected
        return entry is None or (entry.crc32, entry.blocks) != (expected.crc32, expected.blocks)

    def readinto(self, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` with the bytes at ``offset`` (one ranged request); the bytes
        read, fewer than ``len(buffer)`` only past the end of the object."""
        data = self.read(offset, len(buffer))
        got = len(data)
        buffer[:got] = data
        return got


class _CachedReader(IOSyncReaderAbstract):
    """A shard file through the shard cache: downloaded whole on ``open`` where no process
    of the node has it yet (pinned ranged reads, the size and CRC-32 of its record
    checked), then reads of the memory-mapped local copy (checked by the cache when it is
    mapped)."""

    def __init__(self, backend: FsspecIO, url: str, expected: ExpectedFile) -> None:
        self.backend = backend
        self.url = url
        self.expected = expected
        self._local: _MmapReader | None = None

    def open(self) -> None:
        if self._local is not None:
            return
        cache = self.backend.cache
        assert cache is not None
        remote = _RemoteReader(self.backend, self.url, self.expected)
        remote.open()
        file = CachedFile(self.url, remote.filesize(), self.expected.crc32, remote.etag)

        def download(offset: int, size: int) -> memoryview:
            try:
                return remote.read(offset, size)
            except Exception as error:
                # botocore checks a GetObject's bytes against the checksum S3 keeps
                if not any(c.__name__ == "FlexibleChecksumError" for c in type(error).__mro__):
                    raise
                raise CorruptShardError(
                    f"{self.url} ({_shard_label(self.url)}): bytes {offset}..{offset + size} "
                    f"as received fail the checksum the store keeps for the object "
                    f"({_describe(error)}): something on the way (a proxy, the network) "
                    f"altered them, or the stored object is damaged. Nothing was cached; "
                    f"read again, and if it recurs check the path to the store or rewrite "
                    f"the shard"
                ) from error

        self._local = cache.open(file, download)

    def _reader(self) -> _MmapReader:
        if self._local is None:
            raise RuntimeError(f"reader of {self.url} is not open; call open() first")
        return self._local

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        self._local = None

    def filesize(self) -> int:
        return self._reader().filesize()

    def buffer(self) -> memoryview:
        """The whole local copy as a read-only memoryview."""
        return self._reader().buffer()

    def read(self, offset: int, size: int) -> bytearray:
        return self._reader().read(offset, size)
