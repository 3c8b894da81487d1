"""Flat numpy token files, read in place: ``NumpyTokensStorage``.

What OLMo / Dolma and many home-made pipelines ship: token ids back to back in ``.npy``
files (``numpy.save``; the header gives dtype and shape, the data follows it) or in raw
files (``ndarray.tofile``; the dtype is given), documents separated by an end-of-document
token. The stream is the files in the order given. With ``eos_id`` the documents are the
spans that end with it (the last one may end with the stream instead); their ends are
found by one scan, kept in a sidecar file (beside the first file, else under ``cache_dir``)
that later opens read instead.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from guideloom_pipes.progress import Progress, show_progress
from guideloom_pipes.storage.corpora.base import CorpusFiles, TokenCorpus, token_dtype
from guideloom_pipes.storage.corpora.location import CorpusLocation, corpus_paths, locate
from guideloom_pipes.storage.corpora.sidecar import keep_values, read_values
from guideloom_pipes.storage.errors import CorruptShardError
from guideloom_pipes.storage.io import resolve_backend
from guideloom_pipes.storage.records import ExpectedFile

__all__ = ["NumpyTokensStorage", "npy_header", "npy_layout"]

#: Tokens scanned at a time for the end-of-document token.
_SCAN_BLOCK = 1 << 24
#: Bytes of an ``.npy`` file read for its header (a longer header is read again whole).
_NPY_HEAD = 4096
#: The sidecar's first bytes (then: its key's digest, 16 bytes; then int64 ends).
_SIDECAR_MAGIC = b"GLPEOS1\x00"


def npy_layout(path: Path) -> tuple[np.dtype[Any], int, int]:
    """``(dtype, tokens, data offset)`` of the ``.npy`` file at ``path``, from its header.

    Raises:
        CorruptShardError: not an ``.npy`` file, or data shorter than the header says.
        ValueError: not a 1-D C-ordered array of integers in little-endian order (the
            message says how to rewrite it).
    """
    with open(path, "rb") as handle:
        head = handle.read(_NPY_HEAD)
        size = os.fstat(handle.fileno()).st_size
    return npy_header(head, path, size, lambda count: _first_bytes(path, count))


def _first_bytes(path: Path, count: int) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(count)


def npy_header(
    head: bytes, path: PurePath, size: int, more: Callable[[int], bytes]
) -> tuple[np.dtype[Any], int, int]:
    """:func:`npy_layout` of the ``.npy`` file at ``path`` of ``size`` bytes, from its first
    bytes ``head`` (``more(count)``: its first ``count`` bytes, for a longer header)."""
    if head[:6] == np.lib.format.MAGIC_PREFIX and len(head) >= 12:
        wide = head[6] >= 2  # (versions 2 and 3: a 4-byte header length)
        length = int.from_bytes(head[8:12] if wide else head[8:10], "little")
        need = (12 if wide else 10) + length
        if need > len(head):
            head = more(need)
    handle = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(handle)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
    except ValueError as error:
        raise CorruptShardError(
            f"{path} is not a .npy file numpy can read ({error}); give raw token files "
            f"with dtype=, or write the tokens with numpy.save"
        ) from None
    offset = handle.tell()
    if len(shape) != 1:
        raise ValueError(
            f"{path} holds an array of shape {shape}: token files are 1-D (the tokens back "
            f"to back); save array.reshape(-1), or read it with numpy and write it again"
        )
    if dtype.kind not in "iu":
        raise ValueError(
            f"{path} holds {dtype} values: token files hold integer ids; cast them "
            f"(array.astype('int32')) and save again"
        )
    if dtype.byteorder == ">" or (fortran and len(shape) > 1):
        raise ValueError(
            f"{path} is stored big-endian ({dtype.str}): save it little-endian "
            f"(array.astype('{dtype.newbyteorder('<').str}'))"
        )
    dtype = dtype.newbyteorder("<")
    need = offset + shape[0] * dtype.itemsize
    if size != need:
        raise CorruptShardError(
            f"{path} is {size} bytes, but its header describes {shape[0]} tokens of {dtype} "
            f"after {offset} header bytes ({need} bytes): it is truncated or was changed; "
            f"save it again with numpy.save"
        )
    return dtype, shape[0], offset


class _SkipHeaders:
    """A read backend over another that serves each file from its data offset on (a
    ``.npy`` file's tokens, its header skipped): sizes, reads and mapped buffers."""

    def __init__(self, inner: Any, offsets: dict[str, int]) -> None:
        self.inner = resolve_backend(inner)
        self.offsets = offsets
        self.holds_fd = self.inner.holds_fd

    def sync_reader(self) -> Any:
        return self._reader

    def _reader(self, path: PurePath) -> _Skipped:
        return _Skipped(self.inner.reader(path), self.offsets.get(os.fspath(path), 0))

    def shard_reader(self, path: PurePath, expected: ExpectedFile) -> _Skipped:
        """The reader of a file at a URL pinned to what the open found (its ETag), as the
        inner backend's ``shard_reader`` makes it (``expected``: of the tokens)."""
        skip = self.offsets.get(os.fspath(path), 0)
        pinned = getattr(self.inner.backend, "shard_reader", None)
        if not callable(pinned):
            return self._reader(path)
        size = None if expected.size is None else expected.size + skip
        whole = ExpectedFile(size, expected.crc32, expected.etag, None)
        return _Skipped(pinned(path, whole), skip)

    def __repr__(self) -> str:
        return f"_SkipHeaders({self.inner.backend!r})"


class _Skipped:
    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def open(self) -> None:
        self.inner.open()

    def close(self) -> None:
        self.inner.close()

    def filesize(self) -> int:
        return int(self.inner.filesize()) - self.skip

    def read(self, offset: int, size: int) -> Any:
        return self.inner.read(offset + self.skip, size)

    def readinto(self, offset: int, buffer: memoryview) -> int:
        readinto = getattr(self.inner, "readinto", None)
        if callable(readinto):
            return int(readinto(offset + self.skip, buffer))
        data = memoryview(self.inner.read(offset + self.skip, len(buffer))).cast("B")
        buffer[: len(data)] = data
        return len(data)

    def __getattr__(self, name: str) -> Any:
        if name == "buffer":
            buffer = self.inner.buffer  # (AttributeError: no mapped buffers)
            return lambda: buffer()[self.skip :]
        raise AttributeError(name)


def _layout(location: CorpusLocation, name: str) -> tuple[np.dtype[Any], int, int]:
    """:func:`npy_layout` of the ``.npy`` file ``name`` of ``location`` (local or at a URL)."""
    if not location.remote:
        return npy_layout(Path(location.path(name)))
    head, size = location.head(name, _NPY_HEAD)
    return npy_header(head, location.path(name), size, lambda count: location.head(name, count)[0])


class NumpyTokensStorage(TokenCorpus):
    """Flat token files (``.npy``, or raw with ``dtype=``) read in place as one token
    stream: ``StreamDataset`` windows, and with ``eos_id`` its documents (``DocumentDataset``,
    ``PackedDataset``, ``from_storage`` without ``sequence_length``).

    Args:
        files: a file or a list of them; the stream is their tokens in that order. ``.npy``
            files give their dtype in their header; other files are raw tokens of
            ``dtype``.
        dtype: for ``.npy`` files, the dtype samples have (None: the files'; a token that
            does not fit it is refused when read, naming the file and the value); for raw
            files, the dtype they hold (required).
        eos_id: the end-of-document token: documents are the spans ending with it (found
            once, kept in a sidecar). None: the stream has no documents (windows only).
        cache_dir: where the sidecar goes when the first file's directory is read-only
            (by default: beside it, else in memory only); for files at a URL, the only
            place it goes (a reader never writes beside remote data).
        read_interface: the read backend of local files (default memory-mapped).
        progress: show the scan for ``eos_id`` (on stderr: a tqdm bar, else log lines):
            True, False, or None (the default) for files of 64 MiB and more.
        storage_options: for files at a URL (``s3://``, ``http(s)://``, any fsspec
            protocol: read in byte ranges pinned to the ETag the open found), the fsspec
            file system's options.
        retry: for files at a URL, a :class:`~guideloom_pipes.storage.remote.RetryPolicy`.
    """

    description = "flat numpy token files"

    def __init__(
        self,
        files: Any,
        dtype: Any = None,
        eos_id: int | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        read_interface: Any = None,
        progress: bool | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: Any = None,
    ) -> None:
        show_progress(progress, 0)  # (checked now)
        #: whether the scan for ``eos_id`` shows progress (None: for 64 MiB and more)
        self.progress = progress
        paths = corpus_paths(files, "files")
        self.files = paths
        self.eos_id = None if eos_id is None else int(eos_id)
        #: where the files are, how they are read, where the sidecar goes
        self.location = locate(
            paths,
            storage_options=storage_options,
            retry=retry,
            cache_dir=cache_dir,
            read_interface=read_interface,
        )
        raw = [path for path in paths if path.suffix != ".npy"]
        if raw and dtype is None:
            raise TypeError(
                f"{raw[0]} is not a .npy file, so its dtype is not written in it: pass "
                f"dtype= the dtype of its tokens (e.g. dtype='uint16')"
            )
        self._names = self.location.names
        layouts = {
            name: _layout(self.location, name)
            for path, name in zip(paths, self._names)
            if path.suffix == ".npy"
        }
        stored_types = {layout[0] for layout in layouts.values()}
        if raw:
            stored_types.add(token_dtype(dtype, "dtype"))
        if len(stored_types) > 1:
            listed = ", ".join(sorted(str(t) for t in stored_types))
            raise ValueError(
                f"the files hold tokens of different dtypes ({listed}); open each group as "
                f"its own NumpyTokensStorage and blend them with a MixtureDataset, giving "
                f"each the same dtype="
            )
        stored = next(iter(stored_types))
        directory = self.location.directory
        self._offsets = {os.fspath(directory / name): layout[2] for name, layout in layouts.items()}
        inner = self.location.backend if self.location.remote else read_interface
        backend = _SkipHeaders(inner, self._offsets) if self._offsets else inner
        # (raw files: dtype= is what they hold, and what is read)
        super().__init__(directory, stored, None if raw else dtype, backend)
        if self.eos_id is not None:
            info = np.iinfo(stored)
            if not info.min <= self.eos_id <= info.max:
                raise ValueError(
                    f"eos_id={self.eos_id} is outside the files' dtype {stored} "
                    f"({info.min}..{info.max}): no token can be it"
                )

    @property
    def has_documents(self) -> bool:
        """Whether the corpus has documents (``eos_id`` given)."""
        return self.eos_id is not None

    def _scan(self) -> CorpusFiles:
        sizes, versions = [], []
        for path, name in zip(self.files, self._names):
            size, version = self.location.info(name)
            size -= self._offsets.get(os.fspath(self.dir / name), 0)
            if path.suffix != ".npy" and size % self.stored.itemsize:
                raise CorruptShardError(
                    f"{path} is {size} bytes, not a whole number of {self.stored} tokens "
                    f"({self.stored.itemsize} bytes each): it is truncated, or holds another "
                    f"dtype than dtype={self.stored}"
                )
            sizes.append(size)
            versions.append(version)
        starts = None if self.eos_id is None else self._document_starts(sizes, versions)
        tags = versions if self.location.remote else None
        return CorpusFiles(list(self._names), sizes, starts, tags=tags)

    # -- documents: the ends of the eos tokens, scanned once ----------------------------------

    def _key(self, sizes: list[int], versions: list[str]) -> bytes:
        """What the sidecar must match: the files (names, sizes, modification times or
        ETags), dtype and eos."""
        digest = hashlib.blake2b(digest_size=16)
        for name, size, version in zip(self._names, sizes, versions):
            digest.update(f"{name}\0{size}\0{version}\0".encode())
        digest.update(f"{self.stored.str}\0{self.eos_id}".encode())
        return digest.digest()

    def _sidecars(self) -> list[Path]:
        first = self.files[0]
        shown = os.fspath(first if self.location.remote else Path(first).absolute())
        digest = hashlib.sha256(os.fsencode(shown)).hexdigest()[:16]
        return self.location.sidecars(first, f".guideloom_pipes-eos-{digest}.bin")

    def _document_starts(self, sizes: list[int], versions: list[str]) -> np.ndarray:
        key = self._key(sizes, versions)
        for place in self._sidecars():
            found = read_values(place, _SIDECAR_MAGIC, key)
            if found is not None:
                return found
        ends = self._scan_ends(sizes, versions)
        total = sum(sizes) // self.stored.itemsize
        if not len(ends) or int(ends[-1]) != total:
            ends = np.append(ends, np.int64(total)) if total else ends
        starts = np.concatenate([np.zeros(1, dtype=np.int64), ends])
        if not keep_values(self._sidecars(), _SIDECAR_MAGIC, key, starts):
            why = (
                "they are at a URL, and a reader never writes beside remote data"
                if self.location.remote
                else "its directory is read-only"
            )
            warnings.warn(
                f"NumpyTokensStorage could not keep the document ends of {self.files[0]} in a "
                f"sidecar ({why}): every open scans the files again. Pass cache_dir= a "
                f"writable local directory",
                UserWarning,
                stacklevel=4,
            )
        return starts

    def _scan_ends(self, sizes: list[int], versions: list[str]) -> np.ndarray:
        """The stream positions just after each ``eos_id`` token (int64)."""
        pieces, offset = [], 0
        total = sum(sizes)
        shown = Progress(
            f"finding the documents (eos_id={self.eos_id}) of {self.files[0].name}"
            + (f" and {len(self.files) - 1} more files" if len(self.files) > 1 else ""),
            total,
            "B",
            enabled=show_progress(self.progress, total),
        )
        with shown:
            for name, size, version in zip(self._names, sizes, versions):
                count = size // self.stored.itemsize
                for start, block in self._blocks(name, count, version):
                    ends = np.flatnonzero(block == self.eos_id).astype(np.int64)
                    pieces.append(ends + (offset + start + 1))
                    shown.update(int(block.nbytes))
                offset += count
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)

    def _blocks(self, name: str, count: int, version: str) -> Iterator[tuple[int, np.ndarray]]:
        """``(first token, tokens)`` of file ``name``'s ``count`` tokens, ``_SCAN_BLOCK`` at
        a time: slices of its memory map, or (at a URL) ranged reads pinned to
        ``version``."""
        if not count:
            return
        skip = self._offsets.get(os.fspath(self.dir / name), 0)
        itemsize = self.stored.itemsize
        if not self.location.remote:
            mapped = np.memmap(
                self.dir / name, dtype=self.stored, mode="r", offset=skip, shape=(count,)
            )
            for start in range(0, count, _SCAN_BLOCK):
                yield start, mapped[start : start + _SCAN_BLOCK]
            return
        reader = self.location.reader(name, skip + count * itemsize, version)
        try:
            for start in range(0, count, _SCAN_BLOCK):
                want = min(_SCAN_BLOCK, count - start) * itemsize
                data = reader.read(skip + start * itemsize, want)
                yield start, np.frombuffer(data, dtype=self.stored)
        finally:
            reader.close()

    def __repr__(self) -> str:
        listed = [os.fspath(path) for path in self.files]
        shown = listed[0] if len(listed) == 1 else listed
        extra = ""
        if self.dtype != self.stored or any(p.suffix != ".npy" for p in self.files):
            extra += f", dtype={str(self.dtype)!r}"
        if self.eos_id is not None:
            extra += f", eos_id={self.eos_id}"
        return f"NumpyTokensStorage({shown!r}{extra})"
