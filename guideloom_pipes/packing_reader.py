"""``PackedReader``, the reader of a :class:`~guideloom_pipes.packing.PackedDataset`: it
opens the source (a stream's reader, or the documents' reader and their prefix sums, loaded
from a sidecar or built and stored), locates a batch's windows (in the stream, or through the
sums) and packs them (:mod:`guideloom_pipes.packing_columns`) into an output slab of its own
per batch, recycled once the batch's last array is gone; ``read_arrays_many`` packs a chunk
of batches together. With ``packing="best_fit"`` (or ``"first_fit"``) it also loads (or
computes and stores) the window plan, and assembles each window from its pieces and padding
(:mod:`guideloom_pipes.packing_plan`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from guideloom_pipes.batch import Batch, token_array
from guideloom_pipes.datasets import StreamDataset
from guideloom_pipes.packing_columns import (
    _I64,
    FIELDS,
    IGNORE_INDEX,
    _pack_many,
    _remember_sequences,
    _samples,
)
from guideloom_pipes.packing_index import (
    _Damaged,
    _document_tokens,
    _fingerprint,
    _order_key,
    _read_sidecar,
    _write_sidecar,
)
from guideloom_pipes.packing_plan import (
    PackingPlan,
    check_pad_dtype,
    fitted_windows,
    load_plan,
    plan_meta,
)
from guideloom_pipes.reader_base import (
    BatchReads,
    DatasetReaderBase,
    WindowBuffers,
    _as_ids,
    batch_read_fn,
    open_reader,
    reader_fingerprint,
)
from guideloom_pipes.shuffle import FeistelPermutation
from guideloom_pipes.storage.recycle import BufferPool

if TYPE_CHECKING:
    from guideloom_pipes.packing import PackedDataset

#: Documents read at a time while the prefix sums are built.
_BUILD_BATCH = 1024
#: Positions permuted at a time while the seeded order's prefix sums are built.
_ORDER_CHUNK = 1 << 20
_INT64 = np.dtype(np.int64)
#: Released output slabs a reader keeps for reuse (``PackedReader._slabs``), in bytes.
_SLAB_BYTES = 32 << 20
#: Tokens packed together at most by ``read_arrays_many`` (eight batches of 8 x 2048: their
#: output blocks, 4 MB, stay in the caches while they are written).
_GROUP_TOKENS = 1 << 17


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
        self._plan: PackingPlan | None = None  # the windows of a fit (best_fit, first_fit)
        self._sidecars: list[Path] = []  # where the sums were looked for (documents)
        self._lock = threading.Lock()
        # the batches' (4, B, L) int64 output slabs, recycled once no array of a batch is
        # left (a fresh half-megabyte block per batch is memory the allocator has often
        # just given back to the kernel, faulted in again); one shape: another batch size
        # frees the released ones
        self._slabs = BufferPool(limit=_SLAB_BYTES, shelves=1)

    def fingerprint(self) -> dict[str, Any] | None:
        """The source's fingerprint (its keys; none where it cannot tell) and ``packing``:
        the settings that decide which tokens each window holds (a state taken with other
        ones would resume on other windows)."""
        self._check_open()
        return {**(reader_fingerprint(self._source) or {}), "packing": self.dataset.settings()}

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
        if dataset.packing == "concat":
            self._length = int(sums[-1]) // dataset.sequence_length
            return
        try:
            self._plan = self._load_plan(source, sums)
        except BaseException:
            self.close()
            raise
        self._length = self._plan.windows

    def _load_plan(self, source: Any, sums: _I64) -> PackingPlan:
        """The window plan of a fit, from its sidecar or computed (and the pad token checked
        against the first document's dtype)."""
        dataset = self.dataset
        assert dataset.pad_token is not None and dataset.lookahead is not None
        if len(sums) > 1:
            first = self._read(np.zeros(1, dtype=np.int64))[0]
            check_pad_dtype(
                dataset.pad_token, token_array(_document_tokens(first, dataset.field)).dtype
            )
        fingerprint = _fingerprint(source)
        paths = dataset.plan_paths() if fingerprint is not None else []
        meta = None
        if fingerprint is not None:
            variant = f"{dataset._variant()}-{dataset._plan_variant()}"
            meta = plan_meta(
                fingerprint,
                variant,
                dataset.packing,
                dataset.sequence_length,
                dataset.lookahead,
                sums,
            )
        self._sidecars += paths
        return load_plan(
            sums, dataset.packing, dataset.sequence_length, dataset.lookahead, paths, meta
        )

    def close(self) -> None:
        """Close the source reader (if opened here) and drop the prefix sums."""
        source, self._source = self._source, None
        if source is not None and self._owns_source:
            source.close()
        self._sums = None
        self._permutation = None
        self._plan = None
        self._slabs.clear()
        self._length = -1

    def _compute_length(self) -> int:
        raise NotImplementedError  # open() sets the length

    # -- prefix sums ------------------------------------------------------------------------

    def _load_sums(self, source: Any) -> _I64:
        dataset = self.dataset
        known = getattr(source, "document_lengths", None)
        lengths = known() if callable(known) else None
        if lengths is not None:
            # the corpus knows its documents' lengths (a Megatron index): no sidecar
            extra = 1 if dataset.eos_token is not None else 0
            known_sums: _I64 = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths + extra, out=known_sums[1:])
            return known_sums if dataset.seed is None else self._order_sums(known_sums)
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
            from guideloom_pipes.packing import PackedDataset  # (packing imports this module)

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
        elif self._plan is not None:
            assert self._sums is not None and dataset.pad_token is not None
            tokens, starts, padding = fitted_windows(
                self._plan,
                ids,
                self._sums,
                length,
                dataset.pad_token,
                dataset.eos_token,
                self._document_arrays,
            )
            packed = _pack_many(tokens, None, starts, outs)
            row = 0
            for (columns, _, _), rows in zip(packed, sizes):
                columns["labels"][padding[row : row + rows]] = IGNORE_INDEX
                row += rows
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

    def _document_arrays(self, order: _I64, expected: _I64) -> list[np.ndarray]:
        """The documents at positions ``order`` of the packing order, as token arrays
        (without the EOS); a ``RuntimeError`` naming the first whose tokens (and EOS) are not
        ``expected``, after the sidecars it contradicts are removed."""
        dataset = self.dataset
        doc_ids = order if self._permutation is None else self._permutation(order)
        extra = dataset.eos_token is not None
        arrays = []
        for k, document in enumerate(self._read(doc_ids)):
            array = token_array(_document_tokens(document, dataset.field))
            size = len(array) + extra
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
            arrays.append(array)
        return arrays

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
        expected = sums[order + 1] - sums[order]
        eos = dataset.eos_token
        pieces: list[Any] = []
        for array in self._document_arrays(order, expected):
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
