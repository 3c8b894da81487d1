"""Read-only storages of token corpora written by other tools: the shared shape.

A corpus is a list of files of flat token arrays (each file one "shard" of the stream,
the stream their concatenation, as our own stream storage's shards) and, where the corpus
says so, where its documents start. :class:`TokenCorpus` is a
:class:`~guideloom_pipes.StreamStorage` over those files, so ``StreamDataset`` windows, the
loader's orders, the checkpoint fingerprint and the CLI read it unchanged; its
:meth:`~TokenCorpus.document_reader` serves document ``i`` as ``{"tokens": array}`` to a
``DocumentDataset`` (and a ``PackedDataset``, which takes the document lengths from the
corpus instead of building them).

A subclass says which files it reads and what it knows of them (:meth:`TokenCorpus._scan`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, TypeVar

import numpy as np

from guideloom_pipes.checks import check_int
from guideloom_pipes.formats import StreamNumpyFormat
from guideloom_pipes.storage.errors import StorageError
from guideloom_pipes.storage.io import resolve_backend
from guideloom_pipes.storage.names import IN_BAND
from guideloom_pipes.storage.shard_listing import ShardListing
from guideloom_pipes.storage.stream import StreamStorage
from guideloom_pipes.storage.stream_reader import StreamReader

__all__ = [
    "CorpusFiles",
    "DocumentReaderBase",
    "TokenCorpus",
    "TokenFormat",
    "token_dtype",
]

#: The integer dtypes tokens may be read as (``dtype=``).
_INTEGER_KINDS = "iu"


def token_dtype(dtype: Any, what: str) -> np.dtype[Any]:
    """``dtype`` as a little-endian integer dtype, or a ``TypeError``/``ValueError`` naming
    ``what`` (the parameter) and the fix."""
    try:
        found = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{what} must be a numpy integer dtype (e.g. 'int32', np.uint16), got {dtype!r}"
        ) from None
    if found.kind not in _INTEGER_KINDS or found.names is not None:
        raise ValueError(
            f"{what} must be an integer dtype (token ids), got {found}; e.g. 'int32' or 'uint16'"
        )
    return found.newbyteorder("<")


class TokenFormat(StreamNumpyFormat[Any, Any]):
    """The format of a corpus read as another token dtype than its files hold: the stream's
    one field ``tokens`` of the files' ``stored`` dtype, its samples' column cast to
    ``dtype`` (the reader refuses, before the cast, a token that does not fit ``dtype``)."""

    def __init__(self, stored: np.dtype[Any], dtype: np.dtype[Any]) -> None:
        super().__init__(np.dtype([("tokens", stored)]))
        self.dtype = dtype

    def unpack(self, stream: np.ndarray, shard_lengths: Any, shards: Any) -> Any:
        return {"tokens": stream["tokens"].astype(self.dtype)}

    def unpack_columns(self, windows: np.ndarray) -> dict[str, np.ndarray]:
        return {"tokens": windows["tokens"].astype(self.dtype)}

    def __repr__(self) -> str:
        return f"TokenFormat({self.stream_dtype['tokens']}, dtype={self.dtype})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TokenFormat)
            and other.stream_dtype == self.stream_dtype
            and other.dtype == self.dtype
        )

    def __hash__(self) -> int:
        return hash(("TokenFormat", self.stream_dtype, self.dtype))


def _format(stored: np.dtype[Any], dtype: np.dtype[Any]) -> StreamNumpyFormat[Any, Any]:
    if stored == dtype:
        return StreamNumpyFormat(np.dtype([("tokens", stored)]))
    return TokenFormat(stored, dtype)


@dataclass
class CorpusFiles:
    """What a corpus's :meth:`TokenCorpus._scan` found: its token files, their sizes, and
    where its documents start."""

    #: the token files, in stream order (relative to the corpus directory)
    names: list[str]
    #: their sizes in bytes
    sizes: list[int]
    #: the token offset in the stream of each document's start, and the stream's end
    #: (``documents + 1`` int64 values); None: the corpus has no document boundaries
    document_starts: np.ndarray | None = None
    #: other files each shard's version depends on (an index): their sizes, per shard
    extra_sizes: list[dict[str, int]] = field(default_factory=list)
    #: the read backend that serves the token files as raw tokens (a corpus whose files
    #: are decoded, such as Parquet tables), one per reader; None: the storage's own
    backend: Any = None
    #: each token file's ETag as the scan found it (files at a URL: reads are pinned to
    #: it); None: local files (pinned by their identity)
    tags: list[str] | None = None


class TokenCorpus(StreamStorage[Any, Any, Any]):
    """A read-only corpus of token files, as a stream storage of one field ``tokens``.

    Args:
        directory: the directory the token files are named relative to.
        stored: the dtype of the tokens in the files.
        dtype: the dtype samples have (None: ``stored``). A token that does not fit it is
            refused when read, naming the file and the value.
        read_interface: the read backend (default memory-mapped).
    """

    #: what the corpus is, for messages ("Megatron indexed dataset", ...)
    description = "token corpus"

    def __init__(
        self,
        directory: PurePath,
        stored: np.dtype[Any],
        dtype: Any = None,
        read_interface: Any = None,
    ) -> None:
        self.stored = stored
        self.dtype = stored if dtype is None else token_dtype(dtype, "dtype")
        super().__init__(directory, _format(stored, self.dtype), read_interface)

    # -- what a subclass provides ---------------------------------------------------------

    def _scan(self) -> CorpusFiles:
        """The corpus's files, checked (cost: what an open may cost)."""
        raise NotImplementedError

    # -- reading --------------------------------------------------------------------------

    def sync_reader(self) -> CorpusReader:
        """A reader of the token stream (context manager)."""
        return CorpusReader(self)

    def document_reader(self) -> CorpusDocumentReader:
        """A reader of the corpus's documents: document ``i`` as ``{"tokens": array}``."""
        return CorpusDocumentReader(self)

    # -- what a read-only storage refuses ---------------------------------------------------

    def _read_only(self, what: str) -> TypeError:
        return TypeError(
            f"{type(self).__name__} is read-only ({self.description} written by another tool): "
            f"it has no {what}. To write a dataset of our own from it, use "
            f"guideloom_pipes.write_parallel (or the CLI's convert)"
        )

    def sync_writer(self, mode: str = "update") -> Any:
        raise self._read_only("writer")

    def seal(self) -> list[int]:
        raise self._read_only("commit records to seal")

    def recover(self) -> dict[str, list[int]]:
        raise self._read_only("interrupted commits to recover")

    def verify(self) -> dict[str, int]:
        """Open the corpus (every check of its files an open makes) and read every token
        once: ``{"shards": files, "tokens": tokens}``; with ``dtype=`` narrower than the
        files', a token that does not fit it raises, naming the file and the value."""
        with self.sync_reader() as reader:
            return reader.verify()


class CorpusReader(StreamReader):
    """The token stream of a :class:`TokenCorpus` (its files, in order)."""

    storage: TokenCorpus

    def open(self) -> None:
        """Scan the corpus (its subclass's checks) and serve its files; idempotent."""
        if self._open:
            return
        found = self.storage._scan()
        if found.backend is not None:
            self._io = resolve_backend(found.backend)
        directory = self.storage.dir
        identities = {}
        for shard, name in enumerate([] if found.tags is not None else found.names):
            try:
                info = os.stat(os.fspath(directory / name))
            except OSError:
                continue  # (a backend that serves no local file)
            identities[(shard, IN_BAND)] = (info.st_dev, info.st_ino)
        listing = ShardListing(
            directory,
            len(found.names),
            sizes={(shard, IN_BAND): size for shard, size in enumerate(found.sizes)},
            names={(shard, IN_BAND): name for shard, name in enumerate(found.names)},
            identities=identities,
            tags={(shard, IN_BAND): tag for shard, tag in enumerate(found.tags or []) if tag},
        )
        extra = found.extra_sizes or [{} for _ in found.names]
        sizes = [{IN_BAND: size, **more} for size, more in zip(found.sizes, extra)]
        self.document_starts = found.document_starts
        self.file_names = found.names
        self._attach(listing, sizes)
        stored, wanted = self.storage.stored, self.storage.dtype
        #: the range of ``wanted`` where a cast from ``stored`` can overflow, else None
        self._fit_range: tuple[int, int] | None = None
        if not np.can_cast(stored, wanted, "safe"):
            limits = np.iinfo(wanted)
            self._fit_range = (int(limits.min), int(limits.max))

    def _shard_path(self, shard: int, suffix: str) -> str:
        return os.fspath(self.storage.dir / self.file_names[shard])

    def _check_fits(
        self, stream: np.ndarray, starts: Sequence[int] | np.ndarray, length: int
    ) -> None:
        """Refuse a token of ``stream`` (windows of ``length`` at ``starts``, one row each)
        outside ``dtype=``'s range, naming its file, its place and its value."""
        bounds = self._fit_range
        if bounds is None or stream.size == 0:
            return
        tokens = stream["tokens"] if stream.dtype.names else stream
        low, high = bounds
        bad = np.flatnonzero(((tokens < low) | (tokens > high)).reshape(-1))
        if not len(bad):
            return
        first = int(bad[0])
        row, column = divmod(first, length) if length else (0, first)
        position = (int(starts[row]) + column) % self._total
        shard = int(np.searchsorted(self._starts, position, side="right")) - 1
        value = tokens.reshape(-1)[first]
        raise StorageError(
            f"token {value} at element {position - int(self._starts[shard])} of "
            f"{self._shard_path(shard, IN_BAND)} does not fit dtype={self.storage.dtype} "
            f"(its range is {low}..{high}); read the corpus with a wider dtype= (e.g. "
            f"dtype='{self.storage.stored}', the files' own)"
        )

    def read_raw(
        self, global_index: int, global_length: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        found = super().read_raw(global_index, global_length)
        self._check_fits(found[0], [global_index], global_length)
        return found

    def _windows(
        self, starts: np.ndarray, length: int, buffers: Any = None, recycle: bool = False
    ) -> np.ndarray:
        windows = super()._windows(starts, length, buffers, recycle)
        self._check_fits(windows, starts, length)
        return windows

    def verify(self) -> dict[str, int]:
        """Read every token once (and check it fits ``dtype=``); counts read."""
        self._check_open()
        block = 1 << 22
        for start in range(0, self._total, block):
            self.read_raw(start, min(block, self._total - start))
        return {"shards": self.num_shards, "tokens": self._total}


_Reader = TypeVar("_Reader", bound="DocumentReaderBase")


class DocumentReaderBase:
    """What the corpora's document readers share: open while ``_starts`` (what the open
    found: document or row-group starts) is set, a context manager, ``len()`` the
    documents (:attr:`total_length`)."""

    storage: Any
    _starts: np.ndarray | None

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    @property
    def total_length(self) -> int:
        raise NotImplementedError

    @property
    def is_open(self) -> bool:
        return self._starts is not None

    def __enter__(self: _Reader) -> _Reader:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return self.total_length

    def _checked(self) -> np.ndarray:
        if self._starts is None:
            raise RuntimeError(
                f"the document reader of {self.storage!r} is not open; call open() or use it "
                "in a `with` block"
            )
        return self._starts


class CorpusDocumentReader(DocumentReaderBase):
    """The documents of a :class:`TokenCorpus`: document ``i`` is ``{"tokens": array}``,
    the tokens from its start to the next document's. The reader a ``DocumentDataset``
    reads through, as it reads a document storage's."""

    def __init__(self, storage: TokenCorpus) -> None:
        self.storage = storage
        self._stream = CorpusReader(storage)
        self._starts: np.ndarray | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def open(self) -> None:
        """Open the corpus; a corpus without document boundaries is refused."""
        if self._starts is not None:
            return
        self._stream.open()
        starts = self._stream.document_starts
        if starts is None:
            self._stream.close()
            raise ValueError(
                f"{self.storage!r} has no document boundaries: read it as windows "
                f"(StreamDataset(storage, sequence_length), or sequence_length= in "
                f"from_storage), or give the end-of-document token (eos_id=) where the "
                f"storage takes one"
            )
        self._starts = starts

    def close(self) -> None:
        self._stream.close()
        self._starts = None

    # -- what a document storage's reader offers ----------------------------------------------

    @property
    def total_length(self) -> int:
        """Documents in the corpus."""
        return len(self._checked()) - 1

    @property
    def num_shards(self) -> int:
        return self._stream.num_shards

    def length(self, shard: int) -> int:
        """Documents that start in file ``shard``."""
        starts = self._checked()
        files = self._stream.shard_starts
        shard = self._stream._check_shard(check_int("shard", shard))
        low, high = np.searchsorted(starts[:-1], files[shard : shard + 2], side="left")
        return int(high - low)

    def document_lengths(self) -> np.ndarray:
        """Each document's token count (int64), from the corpus's boundaries: nothing read."""
        return np.diff(self._checked())

    def fingerprint(self) -> dict[str, Any]:
        return self._stream.fingerprint()

    def read(self, global_index: int) -> dict[str, np.ndarray]:
        """Document ``global_index`` as ``{"tokens": array}`` (a fresh array)."""
        starts = self._checked()
        index = check_int("global_index", global_index)
        if not 0 <= index < len(starts) - 1:
            raise IndexError(
                f"document {index} out of range: the corpus has {len(starts) - 1} documents"
            )
        start, end = int(starts[index]), int(starts[index + 1])
        if end == start:
            return {"tokens": np.empty(0, dtype=self.storage.dtype)}
        return self._stream.read(start, end - start)

    def read_many(self, global_indexes: Iterable[int] | np.ndarray) -> list[dict[str, np.ndarray]]:
        """The documents at ``global_indexes``, in that order."""
        ids = np.asarray(
            list(global_indexes) if not isinstance(global_indexes, np.ndarray) else global_indexes
        )
        return [self.read(int(index)) for index in ids.tolist()]


def common_directory(files: Sequence[Path]) -> tuple[Path, list[str]]:
    """The deepest directory holding every file of ``files``, and their names relative to
    it."""
    absolute = [file.absolute() for file in files]
    root = Path(os.path.commonpath([os.fspath(file.parent) for file in absolute]))
    return root, [os.fspath(file.relative_to(root)) for file in absolute]
