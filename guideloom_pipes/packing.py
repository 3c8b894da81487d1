"""Packed documents with boundaries: ``PackedDataset``, fixed windows over a concatenation of
documents that say where each document starts (Megatron's reset of positions and attention).

Sample ``i`` is the window ``[i*L, (i+1)*L)`` of the concatenated documents, with
``tokens``, ``position_ids`` (restarting at 0 at the window start and at each document
start), ``document_ids`` (the documents of the window numbered from 0) and ``labels`` (the
next token; ``-100`` across a document boundary and at the last position), all int64.

* A **stream** (``StreamStorage`` whose documents end with ``eos_token``): the boundaries are
  found inside each window (a document starts after each EOS); nothing of the dataset's size
  is ever held.
* **Documents** (a map-style dataset of token arrays, lists, or dicts with ``field``; an
  ``eos_token`` is appended to each when given): the windows are located through prefix
  sums of the document lengths (one int64 per document, in storage order or, with ``seed``,
  in the seeded document order), built on first use and kept as a *sidecar* file next to a
  ``DocumentStorage`` (or under ``cache_dir``), keyed to the storage's commit records and
  file sizes: a sidecar of a dataset that changed is refused and rebuilt. Listing,
  ``verify`` and the readers ignore these files (their names are not shard names).

A reader computes a batch of windows at once (:func:`pack_columns`: a few numpy passes over
the whole ``(B, L)`` batch) into one output block per read, reused once the read's last
array is gone; ``read_arrays`` gives the batch as a :class:`~guideloom_pipes.batch.Batch`
(the loader's path to ``collate_packed`` and ``collate_fn=None``),
``read_batch`` as a list of samples (rows of the same arrays).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import warnings
import weakref
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from guideloom_pipes.batch import Batch, token_array
from guideloom_pipes.checks import check_int
from guideloom_pipes.datasets import DocumentDataset, StreamDataset
from guideloom_pipes.reader_base import (
    BatchReads,
    DatasetReaderBase,
    WindowBuffers,
    _as_ids,
    _AsyncDatasetReader,
    batch_read_fn,
    open_reader,
    reader_fingerprint,
)
from guideloom_pipes.shuffle import FeistelPermutation
from guideloom_pipes.storage import DocumentStorage, StreamStorage, StreamWithMetaStorage
from guideloom_pipes.storage.recycle import BufferPool, Lease

__all__ = [
    "FIELDS",
    "IGNORE_INDEX",
    "PackedDataset",
    "PackedSample",
    "pack_columns",
    "pack_windows",
]

#: The label of positions that predict nothing (torch's ``cross_entropy`` ignore_index).
IGNORE_INDEX = -100
#: Prefix of the sidecar files (not a shard name: listing and verify ignore them).
SIDECAR_PREFIX = "guideloom-packing"
#: 2: the header holds the CRC-32 of the sums (a sidecar of version 1 is rebuilt once)
_SIDECAR_VERSION = 2
#: Documents read at a time while the prefix sums are built.
_BUILD_BATCH = 1024
#: Positions permuted at a time while the seeded order's prefix sums are built.
_ORDER_CHUNK = 1 << 20
_I64 = npt.NDArray[np.int64]
_INT64 = np.dtype(np.int64)


#: The four fields of a packed sample.
FIELDS = ("tokens", "position_ids", "document_ids", "labels")


@functools.lru_cache(maxsize=8)
def _arange(count: int) -> _I64:
    steps = np.arange(count, dtype=np.int64)
    steps.flags.writeable = False
    return steps


@functools.lru_cache(maxsize=32)
def _eos_scalar(dtype: np.dtype[Any], eos_token: int) -> Any:
    """``eos_token`` as a scalar to compare windows of ``dtype`` with in their own dtype
    (fewer bytes than int64), or as an int64 where that dtype cannot hold it (then never
    found)."""
    if dtype.kind not in "iu":
        return eos_token
    info = np.iinfo(dtype)
    if not info.min <= eos_token <= info.max:
        return np.int64(eos_token)
    return dtype.type(eos_token)


def _narrow(length: int) -> type[np.signedinteger[Any]]:
    """The narrowest signed dtype that holds ``0..length`` (the window-local values: a
    position, a column, a document's number in its window)."""
    if length <= _INT16_MAX:
        return np.int16
    return np.int32 if length <= _INT32_MAX else np.int64


_INT16_MAX = int(np.iinfo(np.int16).max)
_INT32_MAX = int(np.iinfo(np.int32).max)
#: (length, dtype) -> ``0..length-1`` repeated, read-only (see ``_ramp``).
_RAMPS: dict[tuple[int, Any], np.ndarray] = {}
#: Ramps of up to this many values are kept (a batch of 512 windows of 8,192 tokens);
#: a larger read builds its own.
_RAMP_KEPT = 1 << 22


def _ramp(rows: int, length: int, dtype: type[np.signedinteger[Any]]) -> np.ndarray:
    """``0, 1, ..., length - 1`` repeated ``rows`` times in ``dtype`` (read-only): a slice
    of one array per window length, grown to twice the rows when a batch needs more (up to
    ``_RAMP_KEPT`` values)."""
    total = rows * length
    ramps = _RAMPS.get((length, dtype))
    if ramps is None or len(ramps) < total:
        have = 0 if ramps is None else len(ramps) // max(length, 1)
        ramps = np.tile(np.arange(length, dtype=dtype), max(rows, 2 * have))
        if len(ramps) > _RAMP_KEPT:  # a very large read: not kept
            return ramps[:total]
        ramps.flags.writeable = False
        if len(_RAMPS) >= 16:  # many window lengths: keep the latest ones
            _RAMPS.clear()
        _RAMPS[(length, dtype)] = ramps
    return ramps[:total]


#: Released output slabs a reader keeps for reuse (``PackedReader._slabs``), in bytes.
_SLAB_BYTES = 32 << 20
#: Tokens packed together at most by ``read_arrays_many`` (eight batches of 8 x 2048: their
#: output blocks, 4 MB, stay in the caches while they are written).
_GROUP_TOKENS = 1 << 17


def _remember_sequences(position_ids: _I64, bounds: _I64, sizes: _I64) -> None:
    """Record its batch's sequence bounds and sizes on the lease of ``position_ids`` (a
    column of a slab), for :func:`known_sequences` (``collate_packed`` then needs no pass
    over the positions): ``(column, bounds, sizes)`` as the lease's note, ``column`` a weak
    reference to ``position_ids``. Every array of the batch (columns, the rows of its
    samples, tensors made from them) holds the lease through its base, so it dies with the
    last of them and hands the slab back to the reader's pool (see
    :class:`~guideloom_pipes.storage.recycle.Lease`)."""
    lease: Lease = position_ids.base.base  # type: ignore[union-attr,assignment]
    lease.note = (weakref.ref(position_ids), bounds, sizes)


def known_sequences(position_ids: np.ndarray) -> tuple[_I64, _I64] | None:
    """``(bounds, sizes)`` of the sequences of ``position_ids`` when it is, unchanged in
    shape, the ``position_ids`` column of one :class:`PackedReader` read (as its read found
    them: the flat start of every sequence then ``B * L``, and each one's length), else
    None (then they are found from the positions)."""
    whole = position_ids.base
    if type(whole) is not np.ndarray:
        return None
    lease = whole.base
    if type(lease) is not Lease or type(note := lease.note) is not tuple:
        return None
    column, bounds, sizes = note
    if column() is not position_ids:
        return None
    return bounds, sizes


def pack_columns(
    windows: np.ndarray,
    *,
    eos_token: int | None = None,
    starts: _I64 | None = None,
    out: _I64 | None = None,
) -> tuple[dict[str, _I64], _I64]:
    """The four int64 ``(B, L)`` fields of ``(B, L)`` token windows, computed for the whole
    batch at once, and the flat starts of its sequences.

    Args:
        windows: ``(B, L)`` integer tokens (any integer dtype, any strides).
        eos_token: A document starts after each of these tokens (a stream).
        starts: Or: the flat indexes (into the ``B * L`` tokens) where a document starts
            inside a window, sorted (documents).
        out: Where to write the four fields: a ``(4, B, L)`` int64 array (by default a new
            one).

    Returns:
        ``(columns, segments)``: field -> ``(B, L)`` int64 array, and the sorted flat index
        of every sequence start (each window start and each document start inside a
        window). See :func:`_pack` for how.
    """
    columns, bounds, _ = _pack(windows, eos_token, starts, out)
    return columns, bounds[:-1]


def _pack(
    windows: np.ndarray, eos_token: int | None, starts: _I64 | None, out: _I64 | None
) -> tuple[dict[str, _I64], _I64, _I64]:
    """:func:`pack_columns`, returning the bounds of the sequences (their flat starts, then
    ``B * L``) and their sizes instead of the starts."""
    if out is None:
        out = np.empty((len(FIELDS), *windows.shape), dtype=np.int64)
    return _pack_many(windows, eos_token, starts, [out])[0]


def _pack_many(
    windows: np.ndarray, eos_token: int | None, starts: _I64 | None, outs: Sequence[_I64]
) -> list[tuple[dict[str, _I64], _I64, _I64]]:
    """The packed columns of consecutive groups of rows of ``windows``, one group per
    ``(4, B_i, L)`` int64 array of ``outs`` (their ``B_i`` add up to the rows): for each,
    ``(columns, bounds, sizes)`` as :func:`_pack` gives them for those rows alone.

    A few passes over all the rows at once and no loop per window or per document: a mask
    of the sequence starts (the EOS found in the source's own dtype, or ``starts``) and its
    nonzero indexes; per sequence, its first column and its number in its window, both
    repeated over its tokens with one ``repeat`` in the narrowest dtype that holds them
    (int16 for windows up to 32,767 tokens: a quarter of int64's bytes); ``position_ids`` as
    a cached ramp ``0..L-1`` per window minus the first column. Then per group, into its
    array: the tokens widened; the two planes widened into ``position_ids`` and
    ``document_ids`` with one copy (they are adjacent); ``labels`` as the widened tokens
    shifted by one (a plain copy), with ``-100`` scattered before each start and last.
    The work per sequence is done once for all the groups (a reader packs a chunk of
    batches together, each into its own array).
    """
    rows, length = windows.shape
    total = rows * length
    flat = windows.reshape(-1)  # a copy only for windows with odd strides
    if total == 0:
        return [
            (dict(zip(FIELDS, out)), np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64))
            for out in outs
        ]
    # is_start[k]: a sequence starts at flat index k (k == total: the end of the last one)
    is_start = np.empty(total + 1, dtype=bool)
    if starts is None:
        eos = _eos_scalar(windows.dtype, eos_token or 0)
        np.equal(flat[:-1], eos, out=is_start[1:total])
    else:
        is_start[1:total] = False
        is_start[starts] = True
    is_start[::length] = True  # every window start (index 0 among them), and index total
    bounds = is_start.nonzero()[0]
    segments = bounds[:-1]
    sizes = bounds[1:] - segments
    narrow = _narrow(length)
    # per sequence: its first column, and its number in its window (its rank minus the rank
    # of its window's first sequence, found by a search of its own window in the sorted ones)
    window, column = np.divmod(segments, length)
    numbers = _arange(total)[: len(segments)] - window.searchsorted(window)
    values = np.array((column, numbers), dtype=narrow)
    spread = np.repeat(values, sizes, axis=1)  # (2, total): each value over its sequence
    np.subtract(_ramp(rows, length, narrow), spread[0], out=spread[0])
    if len(outs) == 1:
        return [_fill(outs[0], flat, spread, bounds, sizes)]
    # each group's share of the bounds: every window start is one, so a group's rows
    # begin and end at bounds
    edges = np.cumsum([0] + [out.shape[1] * length for out in outs])
    at = bounds.searchsorted(edges).tolist()
    results = []
    for index, out in enumerate(outs):
        a, b = int(edges[index]), int(edges[index + 1])
        low, high = at[index], at[index + 1]
        results.append(
            _fill(out, flat[a:b], spread[:, a:b], bounds[low : high + 1] - a, sizes[low:high])
        )
    return results


def _fill(
    out: _I64, flat: np.ndarray, spread: np.ndarray, bounds: _I64, sizes: _I64
) -> tuple[dict[str, _I64], _I64, _I64]:
    """Write one group's four planes into ``out`` (see :func:`_pack_many`)."""
    planes = out.reshape(len(FIELDS), len(flat))
    tokens, labels = planes[0], planes[3]
    np.copyto(tokens, flat, casting="unsafe")
    np.copyto(planes[1:3], spread)  # position_ids and document_ids, widened
    if len(flat):
        labels[:-1] = tokens[1:]
        labels[bounds[1:] - 1] = IGNORE_INDEX  # the last token of each document, window, batch
    return dict(zip(FIELDS, out)), bounds, sizes


def pack_windows(
    windows: np.ndarray, *, eos_token: int | None = None, starts: _I64 | None = None
) -> list[PackedSample]:
    """The samples of ``(B, L)`` token windows (see :func:`pack_columns` for the
    arguments): one :class:`PackedSample` per window, rows of the ``(B, L)`` arrays."""
    columns, segments = pack_columns(windows, eos_token=eos_token, starts=starts)
    return _samples(columns, segments)


class PackedSample(dict[str, Any]):
    """A window of a :class:`PackedDataset`: a plain ``dict`` of its four ``(L,)`` arrays.

    It also remembers the ``(B, L)`` arrays of the read it is row ``row`` of (``batch``) and
    their sequence starts (``segments``), so that :func:`~guideloom_pipes.collate_packed`
    batches consecutive rows of one read without copying them. It pickles as a plain
    ``dict``.
    """

    __slots__ = ("batch", "row", "segments")

    batch: dict[str, _I64]
    row: int
    segments: _I64

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


def _samples(columns: dict[str, _I64], segments: _I64) -> list[PackedSample]:
    out = []
    for row in range(len(columns["tokens"])):
        sample = PackedSample({name: column[row] for name, column in columns.items()})
        sample.batch = columns
        sample.row = row
        sample.segments = segments
        out.append(sample)
    return out


def _check_token(value: Any, name: str) -> int | None:
    return check_int(name, value, allow_none=True, kind="an int token id")


def _order_key(seed: int) -> int:
    """The Feistel key of the seeded document order."""
    sequence = np.random.SeedSequence(seed, spawn_key=(0x7061636B,))  # "pack"
    return int(sequence.generate_state(1, dtype=np.uint64)[0])


def _document_tokens(document: Any, field: str) -> Any:
    if isinstance(document, Mapping):
        try:
            return document[field]
        except KeyError:
            raise KeyError(
                f"a document has no {field!r} field (it has {sorted(map(str, document))}); "
                f"pass field= the name of its tokens"
            ) from None
    return document


class PackedDataset:
    """Fixed windows over concatenated documents, with document boundaries.

    ``len`` is the total number of tokens // ``sequence_length`` (a trailing partial
    window is dropped). Each sample is a dict of four ``(sequence_length,)`` int64 arrays:
    ``tokens``, ``position_ids``, ``document_ids`` and ``labels`` (see the module
    docstring); :func:`guideloom_pipes.collate_packed` batches them into the inputs of
    flash-attention's varlen kernels. Works in ``StatefulDataLoader`` and as a component of
    a ``MixtureDataset``.

    Args:
        source: A ``StreamStorage`` whose documents each end with ``eos_token``; or a
            map-style dataset of documents (``DocumentDataset``, a ``DocumentStorage``, or
            any ``len`` + ``[i]`` dataset) whose documents are 1-D token arrays or lists, or
            dicts with a ``field`` entry. A ``StreamDataset`` is refused: pass its storage.
        sequence_length: ``L``, tokens per window (>= 1).
        eos_token: The end-of-document token: required for a stream; for documents,
            appended after each one when given.
        seed: For documents, an int >= 0 that fixes a document order (a Feistel
            permutation of the documents); ``None`` keeps storage order. Refused for a
            stream (its order is the storage's).
        field: The stream's field, or the documents' dict key, holding the tokens.
        cache_dir: Where to keep the prefix-sum sidecar when the dataset's directory is
            read-only or remote (by default: next to the dataset, else in memory only).
    """

    def __init__(
        self,
        source: Any,
        sequence_length: int,
        *,
        eos_token: int | None = None,
        seed: int | None = None,
        field: str = "tokens",
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.sequence_length = check_int("sequence_length", sequence_length, minimum=1)
        self.eos_token = _check_token(eos_token, "eos_token")
        self.field = field
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        if isinstance(source, (StreamDataset,)):
            raise TypeError(
                "PackedDataset reads a stream's storage, not a StreamDataset: pass "
                "dataset.storage, e.g. PackedDataset(dataset.storage, sequence_length, "
                "eos_token=...)"
            )
        if isinstance(source, StreamWithMetaStorage):
            raise TypeError(
                "PackedDataset packs a StreamStorage (documents separated by eos_token) or a "
                "dataset of documents; a StreamWithMetaStorage is neither"
            )
        if isinstance(source, DocumentStorage):
            source = DocumentDataset(source)
        self.source = source
        self.stream = isinstance(source, StreamStorage)
        if self.stream:
            if self.eos_token is None:
                raise ValueError(
                    "a stream's documents are found by their end token: pass eos_token=<the "
                    "id that ends each document>"
                )
            if seed is not None:
                raise ValueError(
                    f"seed={seed!r} orders documents, but a stream is packed in storage "
                    f"order; drop seed (the loader's shuffle reorders windows)"
                )
            names = source.format.stream_dtype.names or ()
            if field not in names:
                raise ValueError(
                    f"the stream has no field {field!r} (its fields: {list(names)}); pass "
                    f"field= the name of its tokens"
                )
            self.seed = None
        else:
            if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")) and not (
                hasattr(source, "sync_reader")
            ):
                raise TypeError(
                    f"source must be a StreamStorage or a map-style dataset of documents "
                    f"(len and [i]), got {type(source).__name__}"
                )
            try:
                self.seed = check_int("seed", seed, minimum=0, allow_none=True)
            except (TypeError, ValueError):
                # A ValueError for any bad seed, as before.
                raise ValueError(f"seed must be an int >= 0 or None, got {seed!r}") from None

    def __len__(self) -> int:
        with self.sync_reader() as reader:
            return len(reader)

    def sync_reader(self) -> PackedReader:
        """A reader (context manager) with ``len``, ``[i]``, slices and ``read_batch(ids)``."""
        return PackedReader(self)

    def async_reader(self) -> _AsyncDatasetReader:
        """An ``async`` reader (``async with``) with ``read`` and ``read_batch``."""
        return _AsyncDatasetReader(PackedReader(self))

    def __getitem__(self, index: int | slice) -> Any:
        """Sample ``index`` (or a list for a slice), through a reader opened for this call;
        use :meth:`sync_reader` for many reads."""
        with self.sync_reader() as reader:
            return reader[index]

    def __repr__(self) -> str:
        return (
            f"PackedDataset({self.source!r}, sequence_length={self.sequence_length}, "
            f"eos_token={self.eos_token}, seed={self.seed}, field={self.field!r})"
        )

    # -- sidecars ---------------------------------------------------------------------------

    def _variant(self) -> str:
        eos = "eos" if self.eos_token is not None else "plain"
        order = "storage" if self.seed is None else f"seed{self.seed}"
        field = hashlib.sha256(self.field.encode()).hexdigest()[:8]
        return f"{field}-{eos}-{order}"

    def sidecar_paths(self) -> list[Path]:
        """Where this dataset's prefix sums are looked for, first to last (documents of a
        local ``DocumentStorage``: next to the dataset, then under ``cache_dir``)."""
        paths = []
        storage = getattr(self.source, "storage", None)
        if isinstance(storage, DocumentStorage) and storage._resolve_io().local:
            paths.append(Path(storage.dir) / f".{SIDECAR_PREFIX}-{self._variant()}.bin")
        if self.cache_dir is not None and isinstance(storage, DocumentStorage):
            where = hashlib.sha256(os.fsencode(os.path.abspath(os.fspath(storage.dir))))
            name = f"{SIDECAR_PREFIX}-{where.hexdigest()[:16]}-{self._variant()}.bin"
            paths.append(self.cache_dir / name)
        return paths


def _fingerprint(document_reader: Any) -> str | None:
    """A digest of a document storage's shards (commit records, else file sizes), or None
    when ``document_reader`` is not one of ours."""
    storage_reader = getattr(document_reader, "storage_reader", None)
    listing = getattr(storage_reader, "listing", None)
    if listing is None:
        return None
    shards = []
    for shard in range(listing.num_shards):
        record = listing.records.get(shard)
        if record is not None:
            files = {name: [f.size, f.crc32] for name, f in sorted(record.files.items())}
            shards.append({"generation": record.generation, "count": record.count, **files})
        else:
            sizes = {
                suffix: listing.sizes.get((shard, suffix))
                for suffix in document_reader.storage_reader.storage.suffixes
            }
            shards.append(
                {
                    "sizes": sizes,
                    "files": [
                        listing.identities.get((shard, s))
                        for s in document_reader.storage_reader.storage.suffixes
                    ],
                }
            )
    text = json.dumps({"documents": len(document_reader), "shards": shards}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class _Damaged(Exception):
    """A sidecar of the right version and fingerprint whose contents are not what was
    written (or contradict its documents): rebuilt, with a warning."""


#: ``(st_dev, st_ino, st_size, st_mtime_ns)`` of sidecars this process has checked whole
#: (checksum and shape): a later open of the same unchanged file maps it without reading it
_CHECKED: set[tuple[int, int, int, int]] = set()


def _read_sidecar(path: Path, fingerprint: str, documents: int) -> _I64 | None:
    """The prefix sums in ``path`` if it exists and was built from ``fingerprint`` (None:
    no such file, or one of another version or of another state of the dataset, rebuilt
    quietly). Raises :class:`_Damaged` when its fingerprint matches but its contents do not
    hold: a header that does not parse, a size or count other than ``documents + 1``
    values, a CRC-32 other than the one written, a first value other than 0 or a decrease
    (checked once per process for an unchanged file)."""
    try:
        with open(path, "rb") as file:
            header = file.readline(4096)
            info = os.fstat(file.fileno())
    except OSError:
        return None
    try:
        meta = json.loads(header)
        if not isinstance(meta, dict):
            raise ValueError("the header is not a JSON object")
    except ValueError as error:
        raise _Damaged(f"its header does not parse ({error})") from None
    if meta.get("version") != _SIDECAR_VERSION or meta.get("fingerprint") != fingerprint:
        return None  # another version of the dataset: refused, rebuilt by the caller
    try:
        count, crc = int(meta["count"]), int(meta["crc32"])
    except (KeyError, TypeError, ValueError) as error:
        raise _Damaged(f"its header lacks a valid {error}") from None
    if count != documents + 1:
        raise _Damaged(f"it holds {count} sums for {documents} documents")
    size = info.st_size - len(header)
    if size != 8 * count:
        raise _Damaged(f"it has {size} bytes of sums, not {8 * count}")
    try:
        array = np.memmap(path, dtype="<i8", mode="r", offset=len(header), shape=(count,))
    except (OSError, ValueError):
        return None
    sums = array.view(np.ndarray)
    identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    if identity not in _CHECKED:
        if zlib.crc32(sums.data) != crc:
            raise _Damaged("its sums fail their checksum (the file changed after it was written)")
        if sums[0] != 0:
            raise _Damaged(f"its first sum is {int(sums[0])}, not 0")
        if count > 1 and bool((sums[1:] < sums[:-1]).any()):
            where = int(np.argmax(sums[1:] < sums[:-1]))
            raise _Damaged(f"its sums decrease at document {where}")
        _CHECKED.add(identity)
    return sums


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new temporary file next to ``path``, created as shard files are (mode 0o644 less
    the umask): its descriptor and name."""
    for _ in range(100):
        name = os.path.join(path.parent, f"{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), name
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")


def _write_sidecar(path: Path, fingerprint: str, sums: _I64) -> bool:
    """Write ``sums`` to ``path`` atomically (temporary file, fsync, rename), with the CRC-32
    of their bytes in the header; False if the directory cannot be written."""
    data = np.ascontiguousarray(sums, dtype="<i8").tobytes()
    meta = json.dumps(
        {
            "version": _SIDECAR_VERSION,
            "fingerprint": fingerprint,
            "count": len(sums),
            "crc32": zlib.crc32(data),
        }
    ).encode()
    header = meta + b" " * (-(len(meta) + 1) % 64) + b"\n"  # the data starts 64-aligned
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = _create_temporary(path)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(header)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        return False
    return True


class PackedReader(DatasetReaderBase):
    """Reader of a :class:`PackedDataset`: a batch of windows per ``read_batch`` call."""

    def __init__(self, dataset: PackedDataset) -> None:
        super().__init__(None)
        self.dataset = dataset
        self._source: Any = None
        self._owns_source = False
        self._read: Any = None
        self._sums: _I64 | None = None  # prefix sums in the packing order (documents)
        self._permutation: FeistelPermutation | None = None
        self._sidecars: list[Path] = []  # where the sums were looked for (documents)
        self._lock = threading.Lock()
        # the batches' (4, B, L) int64 output slabs, recycled once no array of a batch is
        # left (a fresh half-megabyte block per batch is memory the allocator has often
        # just given back to the kernel, faulted in again); one shape: another batch size
        # frees the released ones
        self._slabs = BufferPool(limit=_SLAB_BYTES, shelves=1)

    def fingerprint(self) -> dict[str, Any] | None:
        """The source's fingerprint (``None`` if it cannot tell)."""
        self._check_open()
        return reader_fingerprint(self._source)

    def open(self) -> None:
        """Open the source; for documents, load (or build) the prefix sums."""
        if self._length >= 0:
            return
        dataset = self.dataset
        if dataset.stream:
            reader = StreamDataset(dataset.source, dataset.sequence_length).sync_reader()
            reader.open()
            self._source, self._owns_source = reader, True
            self._length = len(reader)
            return
        source, owns = open_reader(dataset.source)
        try:
            sums = self._load_sums(source)
        except BaseException:
            if owns:
                source.close()
            raise
        self._source, self._owns_source = source, owns
        self._read = batch_read_fn(source)
        self._sums = sums
        documents = len(sums) - 1
        if dataset.seed is not None and documents > 0:
            self._permutation = FeistelPermutation(documents, _order_key(dataset.seed))
        self._length = int(sums[-1]) // dataset.sequence_length

    def close(self) -> None:
        """Close the source reader (if opened here) and drop the prefix sums."""
        source, self._source = self._source, None
        if source is not None and self._owns_source:
            source.close()
        self._sums = None
        self._permutation = None
        self._slabs.clear()
        self._length = -1

    def _compute_length(self) -> int:
        raise NotImplementedError  # open() sets the length

    # -- prefix sums ------------------------------------------------------------------------

    def _load_sums(self, source: Any) -> _I64:
        dataset = self.dataset
        fingerprint = _fingerprint(source)
        paths = dataset.sidecar_paths() if fingerprint is not None else []
        self._sidecars = list(paths)
        for path in paths:
            found = self._sidecar(path, fingerprint, source, dataset.seed)  # type: ignore[arg-type]
            if found is not None:
                return found
        storage_sums = None
        if dataset.seed is not None and fingerprint is not None:
            # the storage-order sums of the same dataset give the lengths without a read
            plain = PackedDataset(
                dataset.source,
                dataset.sequence_length,
                eos_token=dataset.eos_token,
                field=dataset.field,
                cache_dir=dataset.cache_dir,
            )
            self._sidecars += plain.sidecar_paths()
            for path in plain.sidecar_paths():
                storage_sums = self._sidecar(path, fingerprint, source, None)
                if storage_sums is not None:
                    break
        if storage_sums is None:
            storage_sums = self._build_storage_sums(source)
            if fingerprint is not None and dataset.seed is not None:
                self._store(plain.sidecar_paths(), fingerprint, storage_sums, quiet=True)
        sums = storage_sums if dataset.seed is None else self._order_sums(storage_sums)
        if fingerprint is not None:
            self._store(paths, fingerprint, sums)
        return sums

    def _sidecar(self, path: Path, fingerprint: str, source: Any, seed: int | None) -> _I64 | None:
        """The sums of the sidecar at ``path`` (in the order of ``seed``), or None where
        there is none to use; one that is damaged or contradicts a sample of its documents
        (the first, the middle and the last in its order) is left to be rebuilt, with a
        warning naming it."""
        try:
            sums = _read_sidecar(path, fingerprint, len(source))
            if sums is not None:
                self._check_sample(sums, source, seed)
        except _Damaged as damage:
            warnings.warn(
                f"the PackedDataset sidecar {path} does not hold its dataset's prefix sums: "
                f"{damage}. It is rebuilt from the documents",
                UserWarning,
                stacklevel=5,
            )
            return None
        return sums

    def _check_sample(self, sums: _I64, source: Any, seed: int | None) -> None:
        """Raise :class:`_Damaged` unless the first, middle and last documents in the order
        of ``seed`` have the lengths ``sums`` give them."""
        count = len(sums) - 1
        if count <= 0:
            return
        positions = np.unique(np.array([0, count // 2, count - 1], dtype=np.int64))
        ids = positions if seed is None else FeistelPermutation(count, _order_key(seed))(positions)
        extra = 1 if self.dataset.eos_token is not None else 0
        for position, doc_id, document in zip(positions, ids, batch_read_fn(source)(ids)):
            size = len(_document_tokens(document, self.dataset.field)) + extra
            counted = int(sums[position + 1] - sums[position])
            if size != counted:
                raise _Damaged(
                    f"document {int(doc_id)} has {size} tokens, but the sums count {counted}"
                )

    def _store(self, paths: list[Path], fingerprint: str, sums: _I64, quiet: bool = False) -> None:
        for path in paths:
            if _write_sidecar(path, fingerprint, sums):
                return
        if not quiet:
            warnings.warn(
                f"PackedDataset could not write its prefix sums next to the dataset"
                f"{' or under cache_dir' if self.dataset.cache_dir else ''}: they are kept in "
                f"memory only and rebuilt by every process. Pass cache_dir= a writable "
                f"directory to keep them",
                UserWarning,
                stacklevel=4,
            )

    def _build_storage_sums(self, source: Any) -> _I64:
        dataset = self.dataset
        count = len(source)
        extra = 1 if dataset.eos_token is not None else 0
        sums = np.zeros(count + 1, dtype=np.int64)
        read = batch_read_fn(source)
        for start in range(0, count, _BUILD_BATCH):
            ids = np.arange(start, min(count, start + _BUILD_BATCH), dtype=np.int64)
            lengths = [len(_document_tokens(d, dataset.field)) + extra for d in read(ids)]
            sums[start + 1 : start + 1 + len(ids)] = lengths
        np.cumsum(sums, out=sums)
        return sums

    def _order_sums(self, storage_sums: _I64) -> _I64:
        count = len(storage_sums) - 1
        sums = np.zeros(count + 1, dtype=np.int64)
        if count == 0:
            return sums
        permutation = FeistelPermutation(count, _order_key(self.dataset.seed or 0))
        lengths = np.diff(storage_sums)
        total = 0
        for start in range(0, count, _ORDER_CHUNK):
            positions = np.arange(start, min(count, start + _ORDER_CHUNK), dtype=np.int64)
            chunk = np.cumsum(lengths[permutation(positions)]) + total
            sums[start + 1 : start + 1 + len(positions)] = chunk
            total = int(chunk[-1])
        return sums

    def _discard_sidecars(self) -> list[str]:
        """Remove the sidecars the sums came from (a document contradicts them): the next
        open builds them again from the documents, instead of failing on every open. The
        paths removed."""
        removed = []
        for path in self._sidecars:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(str(path))
        return removed

    # -- reading ----------------------------------------------------------------------------

    def read_batch(self, ids: Sequence[int] | np.ndarray) -> list[Any]:
        """The windows at ``ids``, each a dict of four int64 arrays, in that order.

        Args:
            ids: An integer array or sequence of window numbers in ``[0, len)``; one out of
                range raises ``IndexError`` naming it.
        """
        return _samples(*self._columns(ids))

    def read_arrays(self, ids: Sequence[int] | np.ndarray) -> Batch:
        """The windows at ``ids`` as a :class:`~guideloom_pipes.batch.Batch` of four
        ``(len(ids), sequence_length)`` int64 columns (the loader's path to
        :func:`~guideloom_pipes.collate_packed` and ``collate_fn=None``); row ``i`` holds
        the same arrays as ``read_batch(ids)[i]``."""
        return Batch.of_columns(self._columns(ids)[0])

    def read_arrays_many(self, batches: Sequence[Sequence[int] | np.ndarray]) -> list[Batch]:
        """``[read_arrays(ids) for ids in batches]``, the batches packed together: one read
        of their windows and the work per sequence done once for a group of them (up to
        ``_GROUP_TOKENS`` tokens), each batch still in an output block of its own (the
        loader's path for a chunk of batches).

        Raises:
            IndexError: An id is out of range (nothing is read).
        """
        self._check_open()
        length = self.dataset.sequence_length
        sizes = [len(ids) for ids in batches]
        everything = _as_ids(np.concatenate(batches) if batches else [], self._length)
        out: list[Batch] = []
        per_group = max(1, _GROUP_TOKENS // max(length, 1))
        first = begin = 0
        while first < len(sizes):
            last, rows = first + 1, sizes[first]
            while last < len(sizes) and rows + sizes[last] <= per_group:
                rows += sizes[last]
                last += 1
            group = self._packed(everything[begin : begin + rows], sizes[first:last])
            out.extend(Batch.of_columns(columns) for columns, _ in group)
            first, begin = last, begin + rows
        return out

    def batch_reads(self, arrays: bool, out: WindowBuffers | None = None) -> BatchReads:
        """:meth:`DatasetReaderBase.batch_reads`, and for arrays read into memory of their
        own (no ``out``) :meth:`read_arrays_many` for a chunk of batches."""
        reads = super().batch_reads(arrays, out)
        if arrays and out is None:
            reads.read_many = self.read_arrays_many
        return reads

    def _columns(self, ids: Sequence[int] | np.ndarray) -> tuple[dict[str, _I64], _I64]:
        self._check_open()
        ids = _as_ids(ids, self._length)
        return self._packed(ids, [len(ids)])[0]

    def _packed(self, ids: _I64, sizes: Sequence[int]) -> list[tuple[dict[str, _I64], _I64]]:
        """The windows at ``ids`` (checked), packed into one slab per group of ``sizes``
        rows: each group's columns and sequence starts."""
        dataset = self.dataset
        length = dataset.sequence_length
        outs = [self._slab(rows, length) for rows in sizes]
        if dataset.stream:
            windows = self._source.storage_reader._windows(ids * length, length)
            packed = _pack_many(windows[dataset.field], dataset.eos_token, None, outs)
        else:
            tokens, starts = self._document_windows(ids)
            packed = _pack_many(tokens, None, starts, outs)
        results = []
        for columns, bounds, sequence_sizes in packed:
            _remember_sequences(columns["position_ids"], bounds, sequence_sizes)
            results.append((columns, bounds[:-1]))
        return results

    def _slab(self, rows: int, length: int) -> _I64:
        """A ``(4, rows, length)`` int64 slab that nothing else uses, owned by a lease (whose
        note :func:`_remember_sequences` sets)."""
        return self._slabs.take((len(FIELDS), rows, length), _INT64, leased=True)

    def _document_windows(self, ids: _I64) -> tuple[_I64, _I64]:
        dataset = self.dataset
        length = dataset.sequence_length
        sums = self._sums
        assert sums is not None
        rows = len(ids)
        if rows == 0:
            return np.zeros((0, length), dtype=np.int64), np.zeros(0, dtype=np.int64)
        begin = ids * length
        first = np.searchsorted(sums, begin, side="right") - 1
        last = np.searchsorted(sums, begin + (length - 1), side="right") - 1
        counts = last - first + 1
        group_start = np.zeros(rows, dtype=np.int64)
        np.cumsum(counts[:-1], out=group_start[1:])
        total = int(counts.sum())
        owner = np.repeat(np.arange(rows, dtype=np.int64), counts)
        rank = np.arange(total, dtype=np.int64) - group_start[owner]
        order = first[owner] + rank  # positions in the packing order
        doc_ids = order if self._permutation is None else self._permutation(order)
        expected = sums[order + 1] - sums[order]
        documents = self._read(doc_ids)
        eos = dataset.eos_token
        pieces: list[Any] = []
        for k, document in enumerate(documents):
            array = token_array(_document_tokens(document, dataset.field))
            size = len(array) + (eos is not None)
            if size != expected[k]:
                removed = self._discard_sidecars()
                raise RuntimeError(
                    f"document {int(doc_ids[k])} has {size} tokens, but the prefix sums "
                    f"count {int(expected[k])}: the dataset changed after they were built"
                    + (
                        f", or their sidecar contradicts the documents (removed: "
                        f"{', '.join(removed)}; the next open rebuilds it)"
                        if removed
                        else ""
                    )
                    + ". Open the PackedDataset again (a sidecar of a changed DocumentStorage "
                    "is rebuilt; an in-memory dataset must not change while it is read)"
                )
            pieces.append(array)
            if eos is not None:
                pieces.append(np.array([eos]))
        flat = np.concatenate(pieces).astype(np.int64, copy=False)
        offsets = np.zeros(total, dtype=np.int64)
        np.cumsum(expected[:-1], out=offsets[1:])
        head = offsets[group_start] + (begin - sums[first])
        tokens = flat[head[:, None] + np.arange(length, dtype=np.int64)]
        inner = rank > 0
        starts = owner[inner] * length + (sums[order[inner]] - begin[owner[inner]])
        return tokens.astype(np.int64, copy=False), starts
