"""Megatron-LM's indexed datasets, read in place: ``MegatronIndexedStorage``.

A Megatron indexed dataset (what Megatron-LM's ``preprocess_data.py``, NeMo, GPT-NeoX and
DataTrove's tokenizer write) is a pair of files per prefix: ``PREFIX.bin``, the tokens of
every sequence back to back, and ``PREFIX.idx``, the ``MMIDIDX`` index (version 1), all
little-endian::

    9 bytes   b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
              7 float32, 8 uint16)
    u64       S, the number of sequences
    u64       D, the number of document indices
    i32[S]    each sequence's length in tokens
    i64[S]    each sequence's byte offset in the .bin
    i64[D]    document indices: document k is sequences [doc[k], doc[k + 1])
    (i8[S]    each sequence's mode: multimodal indexes only)

The stream is the ``.bin`` files in the order given; a document is the tokens of its
sequences. Nothing is scanned or built: the index is mapped and checked (sizes, offsets,
document indices) in a few vectorised passes.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from guideloom_pipes.storage.corpora.base import CorpusFiles, TokenCorpus
from guideloom_pipes.storage.corpora.location import corpus_paths, locate
from guideloom_pipes.storage.errors import CorruptShardError, StorageError

__all__ = ["MegatronIndex", "MegatronIndexedStorage", "read_megatron_index"]

MAGIC = b"MMIDIDX\x00\x00"
#: The header: magic, version, dtype code, sequence count, document-index count.
_HEADER = struct.Struct("<9sQBQQ")
#: The token dtype of each dtype code Megatron writes (integers only: codes 6 and 7 are
#: floats, refused).
DTYPE_CODES: dict[int, np.dtype[Any]] = {
    1: np.dtype("u1"),
    2: np.dtype("i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    8: np.dtype("<u2"),
}
_FLOAT_CODES = {6: "float64", 7: "float32"}
_FIX = "rewrite the index with Megatron's IndexedDatasetBuilder (or preprocess_data.py)"


@dataclass(frozen=True)
class MegatronIndex:
    """A checked ``MMIDIDX`` index, its arrays mapped from the file (read-only)."""

    #: the index file (a ``RemotePath`` at a URL)
    path: PurePath
    dtype: np.dtype[Any]
    #: each sequence's length in tokens (int32)
    sequence_lengths: np.ndarray
    #: each sequence's byte offset in the .bin (int64)
    sequence_pointers: np.ndarray
    #: document k is sequences ``[document_indices[k], document_indices[k + 1])`` (int64)
    document_indices: np.ndarray

    @property
    def tokens(self) -> int:
        """Tokens in the ``.bin``."""
        if not len(self.sequence_lengths):
            return 0
        return int(self.sequence_pointers[-1]) // self.dtype.itemsize + int(
            self.sequence_lengths[-1]
        )

    def document_starts(self) -> np.ndarray:
        """The token offset of each document's start in the ``.bin``, and its end
        (``documents + 1`` int64 values)."""
        sequence_starts = np.zeros(len(self.sequence_lengths) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=sequence_starts[1:])
        return sequence_starts[self.document_indices]


def _refuse(path: PurePath, problem: str) -> CorruptShardError:
    return CorruptShardError(
        f"{path} {problem}: it is not a Megatron index this release reads; {_FIX}"
    )


def read_megatron_index(path: str | os.PathLike[str]) -> MegatronIndex:
    """Map and check the ``MMIDIDX`` index at ``path``.

    Raises:
        CorruptShardError: not an index, another version, a size its header does not
            explain (truncated), offsets that are not the sequences back to back, or
            document indices out of order (each naming the file and what is wrong).
        ValueError: a float dtype code (6, 7) or a multimodal index (sequence modes).
    """
    path = Path(os.fspath(path))
    if path.stat().st_size < _HEADER.size:
        return parse_megatron_index(path.read_bytes(), path)
    return parse_megatron_index(np.memmap(path, dtype=np.uint8, mode="r"), path)


def _dtype_code(head: bytes, path: PurePath) -> tuple[int, np.dtype[Any], int, int]:
    """``(version, dtype, sequences, documents)`` of an index's header, checked."""
    if len(head) < _HEADER.size or not head.startswith(MAGIC):
        raise _refuse(path, f"does not start with {MAGIC!r} (the MMIDIDX magic)")
    _, version, code, sequences, documents = _HEADER.unpack(head[: _HEADER.size])
    if code in _FLOAT_CODES:
        raise ValueError(
            f"{path} holds {_FLOAT_CODES[code]} values (dtype code {code}): token corpora are "
            f"integers; a float index is not a token corpus and is not read"
        )
    dtype = DTYPE_CODES.get(code)
    if dtype is None:
        raise _refuse(path, f"names dtype code {code} (known: {sorted(DTYPE_CODES)})")
    return version, dtype, sequences, documents


def parse_megatron_index(data: Any, path: PurePath) -> MegatronIndex:
    """Check the bytes ``data`` of the ``MMIDIDX`` index at ``path`` (a buffer: bytes, a
    memory map) and map its arrays on them; raises as :func:`read_megatron_index`."""
    size = len(data)
    version, dtype, sequences, documents = _dtype_code(bytes(data[: _HEADER.size]), path)
    if version != 1:
        raise _refuse(path, f"is index version {version} (this release reads version 1)")
    expected = _HEADER.size + 12 * sequences + 8 * documents
    if size == expected + sequences and sequences:
        raise ValueError(
            f"{path} is a multimodal index (each sequence has a mode byte): only text "
            "token indexes are read"
        )
    if size != expected:
        raise _refuse(
            path,
            f"is {size} bytes, but its header's {sequences} sequences and {documents} "
            f"document indices take {expected} (truncated, or written by another tool)",
        )
    offset = _HEADER.size
    lengths = np.frombuffer(data, np.dtype("<i4"), sequences, offset)
    pointers = np.frombuffer(data, np.dtype("<i8"), sequences, offset + 4 * sequences)
    indices = np.frombuffer(data, np.dtype("<i8"), documents, offset + 12 * sequences)
    index = MegatronIndex(path, dtype, lengths, pointers, indices)
    _check_arrays(index, sequences)
    return index


def _check_arrays(index: MegatronIndex, sequences: int) -> None:
    path, lengths, pointers, indices = (
        index.path,
        index.sequence_lengths,
        index.sequence_pointers,
        index.document_indices,
    )
    if sequences and int(lengths.min()) < 0:
        raise _refuse(path, f"has a negative sequence length ({int(lengths.min())})")
    if sequences:
        ends = np.cumsum(lengths, dtype=np.int64) * index.dtype.itemsize
        if int(pointers[0]) != 0 or not np.array_equal(pointers[1:], ends[:-1]):
            raise _refuse(path, "has sequence offsets that are not its sequences back to back")
    if not len(indices) or int(indices[0]) != 0 or int(indices[-1]) != sequences:
        raise _refuse(
            path,
            f"has document indices that do not run from 0 to its {sequences} sequences",
        )
    if len(indices) > 1 and bool((np.diff(indices) < 0).any()):
        raise _refuse(path, "has document indices out of order")


def _prefix(path: PurePath) -> PurePath:
    """A prefix from a prefix or from either of its files."""
    if path.suffix in (".bin", ".idx"):
        return path.with_suffix("")
    return path


class MegatronIndexedStorage(TokenCorpus):
    """One or more Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``), read in
    place, as one token stream: ``StreamDataset`` windows, ``DocumentDataset`` documents
    (as the index defines them: the tokens of a document's sequences), ``PackedDataset``
    (boundaries from the index), a ``MixtureDataset`` component, ``from_storage``.

    Args:
        path_prefix: a prefix (``data/corpus_text_document``), its ``.bin`` or ``.idx``
            file, or a list of them (the stream is their tokens in that order); or their
            URLs (``s3://``, ``http(s)://``, any fsspec protocol: the ``.bin`` read in byte
            ranges pinned to the ETag the open found, the ``.idx`` read whole each open).
        dtype: the token dtype samples have (None: the index's). A token that does not
            fit it is refused when read, naming the file and the value.
        read_interface: the read backend of local files (default memory-mapped).
        storage_options: for URLs, the fsspec file system's options (credentials,
            ``endpoint_url``, ...).
        retry: for URLs, a :class:`~guideloom_pipes.storage.remote.RetryPolicy`.
        cache_dir: for URLs, a local directory where the ``.idx`` files are kept (the
            shard cache: downloaded once, then memory-mapped); the ``.bin`` is never
            downloaded whole. None: each open reads each ``.idx`` again.
    """

    description = "a Megatron indexed dataset"

    def __init__(
        self,
        path_prefix: Any,
        dtype: Any = None,
        read_interface: Any = None,
        *,
        storage_options: dict[str, Any] | None = None,
        retry: Any = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        prefixes = [_prefix(path) for path in corpus_paths(path_prefix, "path_prefix")]
        self.prefixes = prefixes
        bins = [prefix.with_name(prefix.name + ".bin") for prefix in prefixes]
        #: where the files are, and how they are read
        self.location = locate(
            bins,
            storage_options=storage_options,
            retry=retry,
            cache_dir=cache_dir,
            read_interface=read_interface,
        )
        self._bin_names = self.location.names
        stored = self._stored_dtype()
        backend = self.location.backend if self.location.remote else read_interface
        super().__init__(self.location.directory, stored, dtype, backend)

    def _index_name(self, bin_name: str) -> str:
        return bin_name[: -len(".bin")] + ".idx"

    def _stored_dtype(self) -> np.dtype[Any]:
        found: dict[np.dtype[Any], PurePath] = {}
        for name in self._bin_names:
            index = self.location.path(self._index_name(name))
            try:
                head, _ = self.location.head(self._index_name(name), _HEADER.size)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"{index} does not exist: give the prefix of a Megatron indexed dataset "
                    f"(the path of its .bin and .idx without the suffix)"
                ) from None
            found.setdefault(_dtype_code(head, index)[1], index)
        if len(found) > 1:
            listed = ", ".join(f"{dtype} ({path})" for dtype, path in found.items())
            raise StorageError(
                f"the prefixes hold tokens of different dtypes: {listed}; open each as its "
                f"own MegatronIndexedStorage and blend them with a MixtureDataset, giving "
                f"both the same dtype="
            )
        return next(iter(found))

    def _read_index(self, name: str) -> tuple[MegatronIndex, int]:
        """The checked index ``name`` and its size in bytes."""
        location = self.location
        if not location.remote:
            index = read_megatron_index(location.path(name))
            return index, os.stat(index.path).st_size
        size, tag = location.info(name)
        return parse_megatron_index(location.whole(name, size, tag), location.path(name)), size

    def _scan(self) -> CorpusFiles:
        sizes, extra, tags, starts = [], [], [], [np.zeros(1, dtype=np.int64)]
        offset = 0
        for name in self._bin_names:
            index, index_size = self._read_index(self._index_name(name))
            data = self.location.path(name)
            try:
                size, tag = self.location.info(name)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"{data} does not exist, but its index {index.path} does: a Megatron "
                    f"indexed dataset is the pair PREFIX.bin and PREFIX.idx"
                ) from None
            need = index.tokens * index.dtype.itemsize
            if size != need:
                raise CorruptShardError(
                    f"{data} is {size} bytes, but its index {index.path} describes "
                    f"{index.tokens} tokens of {index.dtype} ({need} bytes): the .bin is "
                    f"truncated or belongs to another index; {_FIX}"
                )
            sizes.append(size)
            tags.append(tag)
            extra.append({".idx": index_size})
            starts.append(index.document_starts()[1:] + offset)
            offset += index.tokens
        return CorpusFiles(
            list(self._bin_names),
            sizes,
            np.concatenate(starts),
            extra,
            tags=tags if self.location.remote else None,
        )

    def __repr__(self) -> str:
        listed = [os.fspath(prefix) for prefix in self.prefixes]
        shown = listed[0] if len(listed) == 1 else listed
        dtype = "" if self.dtype == self.stored else f", dtype={str(self.dtype)!r}"
        return f"MegatronIndexedStorage({shown!r}{dtype})"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)
