"""Document storage: whole encoded documents, back to back, with an offset index per shard.

Shard ``k`` is ``{k:07d}.out_of_band.bin`` (the encoded documents) and
``{k:07d}.out_of_band.index`` (``n + 1`` little-endian int64 byte offsets, the first 0:
document ``j`` is bytes ``[idx[j], idx[j+1])``). Documents are numbered globally: shard 0's,
then shard 1's, ...
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import PurePath
from typing import Any, cast

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.storage.base import AsyncReaderBase, ReaderBase, StorageBase
from guideloom_pipes.storage.commit import _CountingFile
from guideloom_pipes.storage.errors import (
    CorruptShardError,
    ShardDecodeError,
    StorageError,
    decode_error,
)
from guideloom_pipes.storage.names import IN_BAND, INDEX, OUT_OF_BAND, shard_name
from guideloom_pipes.storage.shard_listing import ShardListing
from guideloom_pipes.storage.stream import as_indexes
from guideloom_pipes.storage.writer import ShardWriterBase
from guideloom_pipes.types import (
    DocumentStorageAbstract,
    DocumentStorageAsyncReaderAbstract,
    DocumentStorageSyncReaderAbstract,
    DocumentStorageSyncWriterAbstract,
    InDataT,
    OutDataT,
)

INDEX_DTYPE = np.dtype("<i8")
#: Runs that :meth:`OffsetIndex.run_views` reads one by one rather than all at once.
_FEW_RUNS = 16


def check_payload(payload: Any, what: str) -> memoryview:
    """``payload`` as a byte view if it is ``bytes``/``bytearray``/``memoryview``."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"{what} must return bytes or memoryview, got {type(payload).__name__}; encode the "
            f"document to bytes in pack"
        )
    return memoryview(payload).cast("B")


class PayloadLog:
    """Appends byte payloads to an ``.out_of_band.bin`` file and keeps their offsets."""

    def __init__(self, data: _CountingFile) -> None:
        self.data = data
        self.offsets: list[int] = [0]

    def append(self, payload: memoryview) -> None:
        self.data.write(payload)
        self.offsets.append(self.data.size)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def write_index(self, index: _CountingFile) -> None:
        index.write(np.asarray(self.offsets, dtype=INDEX_DTYPE))


class OffsetIndex:
    """Reads byte ranges of documents through shard index files (opened lazily)."""

    def __init__(self, reader: ReaderBase, counts: np.ndarray, bin_sizes: list[int]) -> None:
        self._index = reader._files[INDEX]
        self._data = reader._files[OUT_OF_BAND]
        self._reader = reader
        self._bin_sizes = bin_sizes
        self._counts = counts
        self._checked: set[int] = set()

    def _offsets(self, shard: int, local: int, count: int) -> np.ndarray:
        mapped = self._index.array(shard, INDEX_DTYPE)
        if mapped is not None:
            offsets = mapped[local : local + count + 1]
        else:
            raw = self._index.read(shard, local * 8, (count + 1) * 8)
            offsets = np.frombuffer(raw, dtype=INDEX_DTYPE)
        if shard not in self._checked:
            self._check(shard)
        return offsets

    def _check(self, shard: int) -> None:
        # GuideLoom files carry no record: check the index against the data file once.
        mapped = self._index.array(shard, INDEX_DTYPE)
        if mapped is not None:
            first, last = int(mapped[0]), int(mapped[-1])
        else:
            count = int(self._counts[shard])
            first = int(np.frombuffer(self._index.read(shard, 0, 8), dtype=INDEX_DTYPE)[0])
            last = int(np.frombuffer(self._index.read(shard, count * 8, 8), dtype=INDEX_DTYPE)[0])
        if first != 0 or last != self._bin_sizes[shard]:
            path = self._reader._shard_path(shard, INDEX)
            raise CorruptShardError(
                f"{path} does not match its data file: offsets run from {first} to {last}, but "
                f"the data file holds {self._bin_sizes[shard]} bytes (truncated or mixed "
                f"files). Rewrite shard {shard}"
            )
        self._checked.add(shard)

    def span(self, shard: int, local: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of document ``local`` of ``shard``."""
        offsets = self._offsets(shard, local, 1)
        return int(offsets[0]), int(offsets[1])

    def payload(self, shard: int, local: int) -> bytearray:
        """The bytes of document ``local`` of ``shard`` (a fresh copy the caller owns)."""
        if not 0 <= local < self._counts[shard]:
            raise CorruptShardError(
                f"{self._reader._shard_path(shard, IN_BAND)} has a record pointing at payload "
                f"{local}, but {self._reader._shard_path(shard, INDEX)} has "
                f"{int(self._counts[shard])} entries (0..{int(self._counts[shard]) - 1}): one "
                f"of the files is corrupt. Rewrite shard {shard}"
            )
        start, end = self.span(shard, local)
        size = self._bin_sizes[shard]
        if not 0 <= start <= end <= size:
            problem = (
                "decreasing offsets"
                if 0 <= start <= size and 0 <= end <= size
                else f"offsets outside the {size}-byte data file"
            )
            raise CorruptShardError(
                f"{self._reader._shard_path(shard, INDEX)} has {problem} at document {local} "
                f"([{start}, {end})); rewrite shard {shard}"
            )
        mapped = self._data.array(shard, np.dtype("u1"))
        if mapped is not None:
            return bytearray(mapped[start:end])
        data = self._data.read(shard, start, end - start)
        if self._data.owned_reads and type(data) is bytearray:
            return data  # our backends' reads are fresh copies already
        return bytearray(data)  # a custom backend may hand out a view of its own memory

    def payload_views(self, shard: int, locals_: np.ndarray) -> list[memoryview]:
        """The bytes of documents ``locals_`` of ``shard``, as memoryviews of fresh copies
        (valid after the reader closes).

        When the files are mapped: one gather of their offsets, and one copy per run of
        payloads whose bytes follow each other in the file (the payloads of one stream
        window, typically), which their memoryviews share. Otherwise one :meth:`payload`
        call each.
        """
        index = self._index.array(shard, INDEX_DTYPE)
        data = self._data.array(shard, np.dtype("u1"))
        if index is None or data is None or len(locals_) == 0:
            return [memoryview(self.payload(shard, local)) for local in locals_.tolist()]
        if shard not in self._checked:
            self._check(shard)
        count = int(self._counts[shard])
        if int(locals_.min()) < 0 or int(locals_.max()) >= count:
            bad = int(locals_[(locals_ < 0) | (locals_ >= count)][0])
            return [memoryview(self.payload(shard, bad))]  # raises, naming the entry
        starts, ends = index[locals_], index[locals_ + 1]
        if (ends < starts).any() or int(starts.min()) < 0 or int(ends.max()) > data.size:
            bad = int(locals_[(ends < starts) | (starts < 0) | (ends > data.size)][0])
            return [memoryview(self.payload(shard, bad))]  # raises, naming the entry
        cuts = (np.flatnonzero(starts[1:] != ends[:-1]) + 1).tolist()
        first, last = starts.tolist(), ends.tolist()
        view = memoryview(data.data)  # slicing a memoryview costs a third of slicing the array
        out: list[memoryview] = []
        for begin, end in zip([0, *cuts], [*cuts, len(first)]):
            base = first[begin]
            block = memoryview(bytearray(view[base : last[end - 1]]))
            out += [block[a - base : b - base] for a, b in zip(first[begin:end], last[begin:end])]
        return out

    def _mapped(self, shard: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Shard ``shard``'s offsets and bytes as mapped arrays (checked once), or None when
        the backend does not map files."""
        index = self._index.array(shard, INDEX_DTYPE)
        data = self._data.array(shard, np.dtype("u1"))
        if index is None or data is None:
            return None
        if shard not in self._checked:
            self._check(shard)
        return index, data

    def run_views(
        self, shards: np.ndarray, firsts: np.ndarray, counts: np.ndarray
    ) -> list[memoryview]:
        """The payloads of runs: run ``r`` is payloads ``firsts[r] .. firsts[r] + counts[r]
        - 1`` of shard ``shards[r]`` (``counts[r] >= 1``), whose bytes follow each other in
        the data file (what one stream window touches). All of them, run after run, as
        memoryviews into one fresh copy of the runs' bytes (valid after the reader closes).

        When the files are mapped the work is done for all runs at once: one gather of
        their offsets per shard, one check of them, the bytes copied with one ``join``
        (a piece per run), one slice per payload. Otherwise :meth:`payload_views` per run.
        """
        runs = self.run_payloads(shards, firsts, counts)
        return runs.views(0, len(runs))

    def run_payloads(
        self, shards: np.ndarray, firsts: np.ndarray, counts: np.ndarray
    ) -> RunPayloads:
        """:meth:`run_views` without the slices: the runs' bytes read, checked and copied,
        each payload's ``memoryview`` made only when :meth:`RunPayloads.views` asks for it
        (a memoryview is an object the garbage collector tracks; bytes and offsets are
        not, so a large read held for a while costs the collector nothing until sliced).
        """
        shards = np.asarray(shards, dtype=np.int64)
        firsts = np.asarray(firsts, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        if len(shards) == 0:
            return RunPayloads(views=[])
        one = bool(shards[0] == shards[-1]) and bool((shards == shards[0]).all())
        distinct: list[int] = [int(shards[0])] if one else np.unique(shards).tolist()
        files = [self._mapped(shard) for shard in distinct]
        if any(f is None for f in files):
            out: list[memoryview] = []
            for shard, first, count in zip(shards.tolist(), firsts.tolist(), counts.tolist()):
                out += self.payload_views(shard, np.arange(first, first + count, dtype=np.int64))
            return RunPayloads(views=out)
        mapped = cast("list[tuple[np.ndarray, np.ndarray]]", files)
        if len(shards) <= _FEW_RUNS:
            return RunPayloads(views=self._few_run_views(shards, firsts, counts, distinct, mapped))
        available = self._counts[shards]
        outside = (firsts < 0) | (firsts + counts > available)
        if outside.any():
            bad = int(np.flatnonzero(outside)[0])
            local = int(firsts[bad]) if firsts[bad] < 0 else int(firsts[bad] + counts[bad] - 1)
            self.payload(int(shards[bad]), local)  # raises, naming the entry
        # run r's offsets (index[firsts[r] : firsts[r] + counts[r] + 1]), runs back to back
        widths = counts + 1
        ends = np.cumsum(widths)
        begins = ends - widths
        places = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(begins - firsts, widths)
        if one:
            offsets = mapped[0][0][places]
            sizes = np.full(len(shards), mapped[0][1].size, dtype=np.int64)
        else:
            offsets = np.empty(len(places), dtype=INDEX_DTYPE)
            sizes = np.empty(len(shards), dtype=np.int64)
            for shard, (index, data) in zip(distinct, mapped):
                rows = shards == shard
                where = np.repeat(rows, widths)
                offsets[where] = index[places[where]]
                sizes[rows] = data.size
        low, high = offsets[begins], offsets[ends - 1]
        decreasing = offsets[1:] < offsets[:-1]
        decreasing[ends[:-1] - 1] = False  # from one run to the next: no order
        if decreasing.any() or int(low.min()) < 0 or bool((high > sizes).any()):
            self._raise_for_runs(shards, firsts, counts)
        views = [memoryview(data.data) for _, data in mapped]
        which = [0] * len(shards) if one else np.searchsorted(distinct, shards).tolist()
        block = bytearray().join(
            [views[w][a:b] for w, a, b in zip(which, low.tolist(), high.tolist())]
        )
        # each run's bytes start in ``block`` where the earlier runs' bytes end
        lengths = high - low
        relative = offsets + np.repeat(np.cumsum(lengths) - lengths - low, widths)
        not_last = np.ones(len(relative), dtype=bool)
        not_last[ends - 1] = False
        not_first = np.ones(len(relative), dtype=bool)
        not_first[begins] = False
        return RunPayloads(
            block=block, starts=relative[not_last].tolist(), ends=relative[not_first].tolist()
        )

    def _few_run_views(
        self,
        shards: np.ndarray,
        firsts: np.ndarray,
        counts: np.ndarray,
        distinct: list[int],
        mapped: list[tuple[np.ndarray, np.ndarray]],
    ) -> list[memoryview]:
        """:meth:`run_views` of a few runs, one run at a time: a handful of numpy calls per
        run cost less than the dozens of the vectorised path."""
        files = dict(zip(distinct, mapped))
        out: list[memoryview] = []
        for shard, first, count in zip(shards.tolist(), firsts.tolist(), counts.tolist()):
            index, data = files[shard]
            if first < 0 or first + count > self._counts[shard]:
                self.payload(shard, first if first < 0 else first + count - 1)  # raises
            offsets = index[first : first + count + 1].tolist()
            base, end = offsets[0], offsets[-1]
            if base < 0 or end > data.size or sorted(offsets) != offsets:
                self._raise_for_runs(np.array([shard]), np.array([first]), np.array([count]))
            block = memoryview(bytearray(memoryview(data.data)[base:end]))
            out += [block[a - base : b - base] for a, b in pairwise(offsets)]
        return out

    def _raise_for_runs(self, shards: np.ndarray, firsts: np.ndarray, counts: np.ndarray) -> None:
        """Raise the error of the first payload of the runs whose offsets are bad."""
        for shard, first, count in zip(shards.tolist(), firsts.tolist(), counts.tolist()):
            for local in range(first, first + count):
                self.payload(shard, local)  # raises for a bad entry
        raise AssertionError("bad offsets that payload() accepts")  # pragma: no cover


class RunPayloads:
    """The payloads of one :meth:`OffsetIndex.run_payloads` read, sliced on demand.

    Either the views themselves (small reads, files that are not mapped), or one copy of
    the runs' bytes with each payload's start and end in it: payload ``j`` is
    ``block[starts[j]:ends[j]]``, a ``memoryview`` made by :meth:`views`.
    """

    __slots__ = ("_block", "_ends", "_starts", "_views")

    def __init__(
        self,
        *,
        views: list[memoryview] | None = None,
        block: bytearray | None = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
    ) -> None:
        self._views = views
        self._block = memoryview(block) if block is not None else None
        self._starts = starts if starts is not None else []
        self._ends = ends if ends is not None else []

    def __len__(self) -> int:
        return len(self._views) if self._views is not None else len(self._starts)

    def views(self, begin: int, end: int) -> list[memoryview]:
        """Payloads ``begin .. end - 1`` as memoryviews of the copy."""
        if self._views is not None:
            return self._views[begin:end]
        block = self._block
        assert block is not None
        return [block[a:b] for a, b in zip(self._starts[begin:end], self._ends[begin:end])]


def index_counts(reader: ReaderBase, sizes: list[dict[str, int]]) -> np.ndarray:
    """Entries per shard from index-file sizes (``size // 8 - 1``), checking the sizes."""
    counts = np.empty(len(sizes), dtype=np.int64)
    for shard, shard_sizes in enumerate(sizes):
        size = shard_sizes[INDEX]
        if size < 8 or size % 8:
            raise CorruptShardError(
                f"{reader._shard_path(shard, INDEX)} is {size} bytes; an index holds n + 1 "
                f"int64 offsets (a multiple of 8, at least 8). Rewrite shard {shard}"
            )
        counts[shard] = size // 8 - 1
    return counts


class DocumentStorage(StorageBase, DocumentStorageAbstract[InDataT, OutDataT]):
    """Document storage: encoded documents plus an offset index per shard.

    Args:
        storage_dir: the dataset directory, or its URL (``"s3://bucket/data"``; see
            ``docs/remote.md``).
        storage_format: a document format (e.g. :class:`~guideloom_pipes.DocumentPickleFormat`).
        read_interface: the read backend (default memory-mapped).
        storage_options: for a URL, the fsspec file system's options.
        retry: for a URL, a :class:`~guideloom_pipes.storage.remote.RetryPolicy`.
        cache_dir: for a URL, the shard cache's local directory (None: range reads).
        cache_limit_bytes: most bytes the shard cache keeps (None: no bound).

    The format's ``unpack(encoded_data, shard)`` gets a fresh ``bytearray`` from ``read``,
    and a ``memoryview`` of a fresh ``bytearray`` from ``read_many`` (as GuideLoom does);
    either stays valid after the reader closes.
    """

    kind = "document"
    suffixes = (INDEX, OUT_OF_BAND)

    def __init__(
        self: DocumentStorage[Any, Any],
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
        missing = [n for n in ("pack", "unpack") if not callable(getattr(format, n, None))]
        if missing:
            raise TypeError(f"{format!r} is not a document format: it lacks {', '.join(missing)}")

    def sync_reader(self) -> DocumentReader:
        """A reader of the committed shards (context manager)."""
        return DocumentReader(self)

    def async_reader(self) -> AsyncDocumentReader:
        """An ``async`` reader of the committed shards (``async with``)."""
        return AsyncDocumentReader(DocumentReader(self))

    def sync_writer(self, mode: str = "update") -> DocumentWriter:
        """A writer; each touched shard is replaced atomically when it closes.

        ``mode``: ``"update"`` (the default, GuideLoom's: replace only the shards written;
        warns at close if shards of an earlier write remain above them), ``"overwrite"``
        (the dataset becomes exactly the shards written: the others are removed at commit)
        or ``"create"`` (refuse a directory that already holds shard files).
        """
        return DocumentWriter(self, mode)


class DocumentWriter(ShardWriterBase, DocumentStorageSyncWriterAbstract[Any]):
    """Appends encoded documents to shards; commits each touched shard on close."""

    kind = "document"
    suffixes = (INDEX, OUT_OF_BAND)

    def __init__(self, storage: DocumentStorage, mode: str = "update") -> None:
        super().__init__(storage.dir, mode, storage.read_interface)
        self.format = storage.format
        self._logs: dict[int, PayloadLog] = {}

    def append(self, shard: int, data: Any) -> None:
        """Encode the document ``data`` with the format and append it to shard ``shard``."""
        self._check_open()
        payload = check_payload(self.format.pack(data), f"{type(self.format).__name__}.pack")
        with self._lock:  # one append at a time: the file, its checksum, the offsets
            transaction = self._transaction(shard)
            log = self._logs.get(transaction.shard)
            if log is None:
                log = self._logs[transaction.shard] = PayloadLog(transaction.files[OUT_OF_BAND])
            log.append(payload)
            self._written(transaction.shard)

    def length(self, shard: int) -> int:
        """Documents appended to ``shard`` in this writer session (``KeyError`` if none)."""
        try:
            return len(self._logs[shard])
        except KeyError:
            raise KeyError(f"shard {shard} was not written by this writer") from None

    def start(self, shard: int) -> None:
        """Start shard ``shard`` with nothing in it: it is committed at close even if
        nothing is appended to it (an empty shard, where appends would otherwise be the
        only way to create one)."""
        self._check_open()
        with self._lock:
            transaction = self._transaction(shard)
            if transaction.shard not in self._logs:
                self._logs[transaction.shard] = PayloadLog(transaction.files[OUT_OF_BAND])
            self._written(transaction.shard)

    def _commit_args(self, shard: int) -> dict[str, Any]:
        log = self._logs[shard]
        log.write_index(self._transactions[shard].files[INDEX])
        return {"count": len(log), "dtype": None}


class DocumentReader(ReaderBase, DocumentStorageSyncReaderAbstract[Any]):
    """Reads documents by global index."""

    storage: DocumentStorage

    def _setup(self, listing: ShardListing, sizes: list[dict[str, int]]) -> None:
        self._counts = index_counts(self, sizes)
        self._starts = np.zeros(listing.num_shards + 1, dtype=np.int64)
        np.cumsum(self._counts, out=self._starts[1:])
        self._total = int(self._starts[-1])
        self._index = OffsetIndex(self, self._counts, [s[OUT_OF_BAND] for s in sizes])

    def _seal_args(self, shard: int) -> dict[str, Any]:
        self._index._check(shard)  # the index must run from 0 to the data file's size
        return {"count": int(self._counts[shard]), "dtype": None}

    @property
    def total_length(self) -> int:
        """Documents in the dataset."""
        self._check_open()
        return self._total

    def __len__(self) -> int:
        return self.total_length

    def length(self, shard: int) -> int:
        """Documents in shard ``shard``."""
        shard = self._check_shard(check_int("shard", shard))
        return int(self._counts[shard])

    def _out_of_range(self, global_index: int) -> IndexError:
        total = self._total
        valid = f"valid: 0..{total - 1}" if total else "it is empty"
        return IndexError(
            f"document index {global_index} out of range for a dataset of {total} documents "
            f"({valid})"
        )

    def _locate(self, global_index: int) -> tuple[int, int]:
        if not 0 <= global_index < self._total:
            raise self._out_of_range(global_index)
        shard = int(np.searchsorted(self._starts, global_index, side="right")) - 1
        return shard, global_index - int(self._starts[shard])

    def read(self, global_index: int) -> Any:
        """Document ``global_index``, decoded by the format.

        A document the format cannot decode raises :class:`ShardDecodeError` (a
        ``CorruptShardError``) naming the shard, the file and the document, with the
        format's own exception chained (and mixed in, see :func:`decode_error`).
        """
        self._check_open()
        global_index = check_int("global_index", global_index)
        shard, local = self._locate(global_index)
        payload = self._index.payload(shard, local)
        try:
            return self.storage.format.unpack(payload, shard)
        except StorageError:
            raise
        except Exception as error:
            raise self._decode_failed(error, shard, local, global_index) from error

    def _decode_failed(
        self, error: Exception, shard: int, local: int, global_index: int
    ) -> ShardDecodeError:
        path = self._shard_path(shard, OUT_OF_BAND)
        try:
            where = "bytes [{}, {}) of {}".format(*self._index.span(shard, local), path)
        except Exception:  # the index itself unreadable now: name the file alone
            where = path
        format_name = type(self.storage.format).__name__
        return decode_error(
            error,
            f"document {global_index} (document {local} of shard {shard_name(shard)}, {where}) "
            f"could not be decoded: {format_name}.unpack raised "
            f"{type(error).__name__}: {str(error).rstrip('.')}; the file is corrupt, or the "
            f"shard was written with another format. Run storage.verify() (it checks every "
            f"committed file against its checksum), then rewrite shard {shard}",
        )

    def read_many(self, global_indexes: Iterable[int] | np.ndarray) -> list[Any]:
        """Documents at ``global_indexes`` (an int64 vector, or any iterable of ints), in
        that order."""
        self._check_open()
        if not isinstance(global_indexes, (np.ndarray, Sequence)):
            global_indexes = list(global_indexes)  # any iterable of ints, e.g. a generator
        ids = as_indexes(global_indexes, self._total, "document indexes", self._out_of_range)
        shards = np.searchsorted(self._starts, ids, side="right") - 1
        locals_ = ids - self._starts[shards]
        # every document's bytes at once: one gather and check of the offsets, one copy
        # (read errors are not decode errors: they are raised here)
        payloads = self._index.run_views(shards, locals_, np.ones(len(ids), dtype=np.int64))
        unpack = self.storage.format.unpack
        out: list[Any] = []
        for s, data in zip(shards.tolist(), payloads):
            try:
                out.append(unpack(data, s))
            except StorageError:
                raise
            except Exception as error:
                k = int(locals_[len(out)])
                raise self._decode_failed(error, s, k, int(ids[len(out)])) from error
        return out


class AsyncDocumentReader(AsyncReaderBase, DocumentStorageAsyncReaderAbstract[Any]):
    """``async`` document reader: ``await reader.read(i)``, ``await reader.read_many(ids)``."""

    async def read(self, global_index: int) -> Any:
        """See :meth:`DocumentReader.read`."""
        return await asyncio.to_thread(self._sync.read, global_index)

    async def read_many(self, global_indexes: Iterable[int] | np.ndarray) -> list[Any]:
        """See :meth:`DocumentReader.read_many`."""
        return await asyncio.to_thread(self._sync.read_many, global_indexes)
