"""Stream with metadata: a stream whose elements each point to a metadata payload.

Shard ``k`` is ``{k:07d}.in_band.bin`` (packed records ``[("index", "<i4"), ("user",
stream_dtype)]``; ``index`` is the shard-local number of the element's payload) plus the
payloads stored as documents are (``.out_of_band.bin`` + ``.out_of_band.index``).
"""

from __future__ import annotations

import asyncio
from pathlib import PurePath
from typing import Any, Generic

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.storage.base import AsyncReaderBase, StorageBase
from guideloom_pipes.storage.errors import (
    CorruptShardError,
    ShardDecodeError,
    StorageError,
    decode_error,
)
from guideloom_pipes.storage.meta_windows import MetaWindows
from guideloom_pipes.storage.names import IN_BAND, INDEX, OUT_OF_BAND
from guideloom_pipes.storage.payloads import INDEX_DTYPE, OffsetIndex, PayloadLog, index_counts
from guideloom_pipes.storage.shard_listing import FileSizes, ShardListing
from guideloom_pipes.storage.stream_checks import check_packed, check_stream_format
from guideloom_pipes.storage.stream_reader import StreamReader
from guideloom_pipes.storage.writer import ShardWriterBase
from guideloom_pipes.types import (
    InDataT,
    OutDataT,
    StreamDType,
    StreamStorageAbstract,
    StreamStorageAsyncReaderAbstract,
    StreamStorageSyncWriterAbstract,
)

#: Most payloads one shard can hold (the ``index`` field is an int32).
MAX_PAYLOADS = 2**31


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def record_dtype(stream_dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The packed in-band record dtype for a user ``stream_dtype``."""
    return np.dtype([("index", "<i4"), ("user", np.dtype(stream_dtype))])


class StreamWithMetaStorage(
    StorageBase, StreamStorageAbstract[InDataT, OutDataT], Generic[InDataT, OutDataT, StreamDType]
):
    """A stream whose elements carry a pointer to a per-chunk metadata payload.

    Args:
        storage_dir: the dataset directory, or its URL (``"s3://bucket/data"``; see
            ``docs/remote.md``).
        storage_format: a stream-with-metadata format (see
            :class:`~guideloom_pipes.types.StreamWithMetaStorageFormat`).
        read_interface: the read backend (default memory-mapped).
        storage_options: for a URL, the fsspec file system's options.
        retry: for a URL, a :class:`~guideloom_pipes.storage.remote.RetryPolicy`.
        cache_dir: for a URL, the shard cache's local directory (None: range reads).
        cache_limit_bytes: most bytes the shard cache keeps (None: no bound).
    """

    kind = "stream_meta"
    suffixes = (IN_BAND, INDEX, OUT_OF_BAND)

    def __init__(
        self: StreamWithMetaStorage[Any, Any, Any],
        storage_dir: PurePath | str,
        storage_format: Any,
        read_interface: Any = None,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: Any = None,
        cache_dir: Any = None,
        cache_limit_bytes: int | None = None,
    ) -> None:
        super().__init__(
            storage_dir,
            storage_format,
            read_interface,
            storage_options=storage_options,
            retry=retry,
            cache_dir=cache_dir,
            cache_limit_bytes=cache_limit_bytes,
        )

    def _check_format(self, format: Any) -> None:
        check_stream_format(format, ("size", "pack", "unpack"))

    def sync_reader(self) -> StreamWithMetaReader:
        """A reader of the committed shards (context manager)."""
        return StreamWithMetaReader(self)

    def async_reader(self) -> AsyncStreamWithMetaReader:
        """An ``async`` reader of the committed shards (``async with``)."""
        return AsyncStreamWithMetaReader(StreamWithMetaReader(self))

    def sync_writer(self, mode: str = "update") -> StreamWithMetaWriter:
        """A writer; each touched shard is replaced atomically when it closes.

        ``mode``: ``"update"`` (the default, GuideLoom's: replace only the shards written;
        warns at close if shards of an earlier write remain above them), ``"overwrite"``
        (the dataset becomes exactly the shards written: the others are removed at commit)
        or ``"create"`` (refuse a directory that already holds shard files).
        """
        return StreamWithMetaWriter(self, mode)


def _pairs(name: str, generator: Any, size: int) -> tuple[np.ndarray, list[bytes], Any]:
    """The ``(key, payload)`` pairs ``generator`` (``format.pack``) yields, checked: each
    element's payload number, the payloads (one per run of a key), and what it returned
    (the stream)."""
    index = np.empty(size, dtype="<i4")
    payloads: list[bytes] = []
    seen: set[Any] = set()
    last: Any = None
    count = 0
    while True:
        try:
            pair = next(generator)
        except StopIteration as stop:
            stream = stop.value
            break
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(
                f"{name}.pack must yield (key, payload) pairs; element {count} is {_short(pair)}"
            )
        key, payload = pair
        if count >= size:
            raise ValueError(f"{name}.pack yielded more than size(data) = {size} pairs")
        if count == 0 or key != last:
            try:
                repeated = key in seen
            except TypeError:
                raise TypeError(
                    f"{name}.pack: keys must be hashable, got {_short(key)} "
                    f"({type(key).__name__}) at element {count}"
                ) from None
            if repeated:
                raise ValueError(
                    f"{name}.pack: key {key!r} repeats after another key at element "
                    f"{count}; a key may repeat only in one contiguous run"
                )
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise ValueError(
                    f"{name}.pack: the first pair of the run of key {key!r} (element "
                    f"{count}) must carry bytes or memoryview, got {type(payload).__name__}"
                )
            seen.add(key)
            payloads.append(bytes(payload))
            last = key
        index[count] = len(payloads) - 1
        count += 1
    if count != size:
        raise ValueError(f"{name}.pack yielded {count} pairs but size(data) is {size}")
    return index, payloads, stream


class StreamWithMetaWriter(ShardWriterBase, StreamStorageSyncWriterAbstract[Any]):
    """Appends records with their metadata payloads; commits each touched shard on close."""

    kind = "stream_meta"
    suffixes = (IN_BAND, INDEX, OUT_OF_BAND)

    def __init__(self, storage: StreamWithMetaStorage, mode: str = "update") -> None:
        super().__init__(storage.dir, mode, storage.read_interface)
        self.format = storage.format
        self.dtype = np.dtype(storage.format.stream_dtype)
        self.records = record_dtype(self.dtype)
        self._lengths: dict[int, int] = {}
        self._logs: dict[int, PayloadLog] = {}

    def append(self, shard: int, data: Any) -> None:
        """Pack ``data``: one ``(key, payload)`` per element, then the stream array.

        Everything is checked before anything is written, so a refused append leaves the
        shard as it was.
        """
        self._check_open()
        size, index, payloads, stream = self._pack(data)
        with self._lock:  # one append at a time: the files, their checksums, the offsets
            transaction = self._transaction(shard)
            shard = transaction.shard
            log = self._logs.get(shard)
            if log is None:
                log = self._logs[shard] = PayloadLog(transaction.files[OUT_OF_BAND])
            if len(log) + len(payloads) > MAX_PAYLOADS:
                raise ValueError(
                    f"shard {shard} would hold {len(log) + len(payloads)} payloads, more than "
                    f"{MAX_PAYLOADS} (the int32 index); spread the data over more shards"
                )
            records = np.empty(size, dtype=self.records)
            records["index"] = index + len(log)
            records["user"] = stream
            for payload in payloads:
                log.append(memoryview(payload))
            transaction.files[IN_BAND].write(records)
            self._lengths[shard] = self._lengths.get(shard, 0) + size
            self._written(shard)

    def _pack(self, data: Any) -> tuple[int, np.ndarray, list[bytes], np.ndarray]:
        """``data`` packed and checked, nothing written: its element count, each element's
        payload number (from 0), the payloads, the stream array."""
        name = type(self.format).__name__
        size = check_int(f"{name}.size(data)", self.format.size(data), minimum=0)
        generator = self.format.pack(data)
        if not hasattr(generator, "send"):
            raise TypeError(
                f"{name}.pack must be a generator yielding (key, payload) pairs and returning "
                f"the stream array, got {type(generator).__name__}"
            )
        index, payloads, stream = _pairs(name, generator, size)
        stream = check_packed(stream, self.dtype, f"{name}.pack")
        if len(stream) != size:
            raise ValueError(
                f"{name}.pack returned a stream of {len(stream)} elements but size(data) is {size}"
            )
        return size, index, payloads, stream

    def length(self, shard: int) -> int:
        """Elements appended to ``shard`` in this writer session (``KeyError`` if none)."""
        try:
            return self._lengths[shard]
        except KeyError:
            raise KeyError(f"shard {shard} was not written by this writer") from None

    def start(self, shard: int) -> None:
        """Start shard ``shard`` with nothing in it: it is committed at close even if
        nothing is appended to it (an empty shard, where appends would otherwise be the
        only way to create one)."""
        self._check_open()
        with self._lock:
            transaction = self._transaction(shard)
            shard = transaction.shard
            if shard not in self._logs:
                self._logs[shard] = PayloadLog(transaction.files[OUT_OF_BAND])
            self._lengths.setdefault(shard, 0)
            self._written(shard)

    def _commit_args(self, shard: int) -> dict[str, Any]:
        log = self._logs[shard]
        log.write_index(self._transactions[shard].files[INDEX])
        return {"count": self._lengths[shard], "dtype": self.dtype, "payloads": len(log)}


class StreamWithMetaReader(StreamReader):
    """Reads spans of the stream together with the payloads they touch."""

    storage: StreamWithMetaStorage  # type: ignore[assignment]

    def _element_dtype(self) -> np.dtype[Any]:
        return record_dtype(np.dtype(self.storage.format.stream_dtype))

    def _setup(self, listing: ShardListing, sizes: FileSizes) -> None:
        super()._setup(listing, sizes)
        counts = index_counts(self, sizes)
        self._payloads = OffsetIndex(self, counts, sizes.column(OUT_OF_BAND))

    def _seal_args(self, shard: int) -> dict[str, Any]:
        self._payloads._check(shard)
        payloads = int(self._payloads._counts[shard])
        mapped = self._mapped_array(shard)
        if mapped is not None and len(mapped):
            index = mapped.view(self.dtype)["index"]
            if int(index.min()) < 0 or int(index.max()) >= payloads:
                raise CorruptShardError(
                    f"{self._shard_path(shard, IN_BAND)} points at payloads outside "
                    f"0..{payloads - 1} of its index; rewrite shard {shard}"
                )
        return {**super()._seal_args(shard), "payloads": payloads}

    def decode(self, records: np.ndarray, shard_lengths: Any, shards: Any) -> Any:
        """``format.unpack`` of a span of records whose pieces came from ``shards``."""
        piece_shards = np.repeat(np.asarray(shards, dtype=np.int64), shard_lengths)
        index = records["index"]
        if len(index) and int(index.min()) < 0:  # would corrupt the shard bits of the keys
            position = int(np.argmax(index < 0))
            self._payloads.payload(int(piece_shards[position]), int(index[position]))  # raises
        keys = (piece_shards << 32) | index.astype(np.int64)
        if len(keys) and bool((keys[1:] >= keys[:-1]).all()):
            # the usual case: payload numbers never decrease along a span (no wrap-around
            # back into payloads already seen), so each run of equal keys is a new payload
            first_of_run = np.empty(len(keys), dtype=bool)
            first_of_run[0] = True
            np.not_equal(keys[1:], keys[:-1], out=first_of_run[1:])
            document_index = (np.cumsum(first_of_run) - 1).astype(np.int32)
            ordered = keys[first_of_run]
        else:
            unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
            order = np.argsort(first, kind="stable")
            rank = np.empty(len(order), dtype=np.int32)
            rank[order] = np.arange(len(order), dtype=np.int32)
            document_index = rank[inverse.reshape(-1)].astype(np.int32)
            ordered = unique[order]
        document_shard = (ordered >> 32).astype(np.int64)
        locals_ = ordered & 0xFFFFFFFF
        document_data = self._fetch(document_shard, locals_)
        stream_data = np.array(records["user"], copy=True)
        try:
            return self.storage.format.unpack(
                stream_data, document_shard, document_index, document_data
            )
        except StorageError:
            raise
        except Exception as error:
            raise self._decode_failed(error, document_shard, locals_) from error

    def _decode_failed(
        self, error: Exception, shards: np.ndarray, locals_: np.ndarray
    ) -> ShardDecodeError:
        """The error for a span whose ``unpack`` raised: the payloads it touched, by shard."""
        touched = []
        for shard in dict.fromkeys(shards.tolist()):  # in order of first use
            numbers = locals_[shards == shard]
            low, high = int(numbers.min()), int(numbers.max())
            span = f"payload {low}" if low == high else f"payloads {low}..{high}"
            touched.append(f"{span} of {self._shard_path(shard, OUT_OF_BAND)}")
        shard_list = ", ".join(str(s) for s in dict.fromkeys(shards.tolist()))
        format_name = type(self.storage.format).__name__
        return decode_error(
            error,
            f"a span touching {'; '.join(touched) or 'no payload'} could not be decoded: "
            f"{format_name}.unpack raised {type(error).__name__}: {str(error).rstrip('.')}; a "
            f"payload is corrupt, or the shard was written with another format. Run "
            f"storage.verify() (it checks every committed file against its checksum), then "
            f"rewrite shard {shard_list}",
        )

    def decode_windows(self, windows: np.ndarray, starts: np.ndarray) -> list[Any]:
        """:meth:`decode` of each row of ``windows`` (the records of equal-length spans at
        ``starts``, all inside the stream, as :meth:`read_windows` returns them), with the
        work done for the whole batch at once: :meth:`prepare_windows`, then all its rows."""
        prepared = self.prepare_windows(windows, starts)
        return prepared.decode(0, len(prepared))

    def prepare_windows(self, windows: np.ndarray, starts: np.ndarray) -> MetaWindows:
        """The shared work of decoding the rows of ``windows`` (see :meth:`decode_windows`),
        done for all rows at once; :meth:`MetaWindows.decode` then decodes any range of
        rows (the payloads' memoryviews, ``unpack`` per row).

        A row inside one shard whose payload number goes up by 0 or 1 from each element to
        the next (what our writers and GuideLoom's write: a shard's payloads are numbered
        in stream order) touches payloads ``first .. last`` of its shard, whose bytes
        follow each other: for all such rows together, ``document_index`` is one
        subtraction, the payloads one gather of offsets and one copy of bytes
        (:meth:`OffsetIndex.run_payloads`). Other rows (a shard boundary, payload numbers
        that jump or go back) go through :meth:`decode` when they are decoded. What this
        keeps is arrays and one byte copy, none of it tracked by the garbage collector: a
        loader can hold a chunk of batches prepared and make each batch's objects only
        when it is delivered.
        """
        rows, length = windows.shape
        starts = np.asarray(starts, dtype=np.int64)
        if rows == 0 or length == 0:
            return MetaWindows(self, windows, starts, np.zeros(rows, dtype=bool))
        first = np.searchsorted(self._starts, starts, side="right") - 1
        last = np.searchsorted(self._starts, starts + (length - 1), side="right") - 1
        index = np.ascontiguousarray(windows["index"])  # the ops below run on it contiguous
        steps = np.subtract(index[:, 1:], index[:, :-1])
        # steps of 0 or 1 (a negative step is a large unsigned number)
        simple = (first == last) & (steps.view(np.uint32) <= 1).all(axis=1)
        good = np.flatnonzero(simple)
        prepared = MetaWindows(self, windows, starts, simple)
        if len(good) == 0:
            return prepared
        every = len(good) == rows  # the usual case: no row picked out (no fancy copies)
        if not every:
            index, first = index[good], first[good]
        low = index[:, 0].astype(np.int64)
        runs = index[:, -1] - low + 1
        # one copy of the rows' own fields (picking rows out copies them already)
        user = windows["user"]
        prepared.fill(
            stream=np.array(user, copy=True) if every else user[good],
            document_index=np.subtract(index, index[:, :1]),  # int32: payload number - first
            payloads=self._payloads.run_payloads(first, low, runs),
            payload_shards=np.repeat(first, runs),
            low=low,
            runs=runs,
        )
        return prepared

    def _fetch(self, shards: np.ndarray, locals_: np.ndarray) -> list[memoryview]:
        """Payloads ``locals_[j]`` of shards ``shards[j]``, as memoryviews of fresh copies."""
        payloads = self._payloads.payload_views
        if len(shards) == 0:
            return []
        if shards[0] == shards[-1] and bool((shards == shards[0]).all()):
            return payloads(int(shards[0]), locals_)
        fetched: list[Any] = [None] * len(locals_)
        for shard in np.unique(shards).tolist():
            where = np.flatnonzero(shards == shard)
            for position, payload in zip(where.tolist(), payloads(shard, locals_[where])):
                fetched[position] = payload
        return fetched

    def read(self, global_index: int, global_length: int) -> Any:
        """``format.unpack(stream_data, document_shard, document_index, document_data)``.

        ``document_data`` lists the distinct payloads the span touches in order of first
        use (``memoryview`` objects over fresh ``bytearray`` copies, valid after the reader
        closes), ``document_shard[j]`` (int64) is payload ``j``'s shard, ``document_index[t]``
        (int32) the payload of element ``t``. Wraps past the end like a stream read.
        """
        records, shard_lengths, shards = self.read_raw(global_index, global_length)
        return self.decode(records, shard_lengths, shards)


class AsyncStreamWithMetaReader(AsyncReaderBase, StreamStorageAsyncReaderAbstract[Any]):
    """``async`` reader: ``await reader.read(global_index, global_length)``."""

    async def read(self, global_index: int, global_length: int) -> Any:
        """See :meth:`StreamWithMetaReader.read`."""
        return await asyncio.to_thread(self._sync.read, global_index, global_length)


__all__ = ["INDEX_DTYPE", "MetaWindows", "StreamWithMetaStorage", "record_dtype"]
