"""Text to token ids with a Hugging Face ``tokenizers`` tokenizer (``tokenizer.json``):
:func:`load_tokenizer` (imported lazily, loaded once per process and file), :func:`encode_texts`
(a batch of documents, EOS appended), :func:`check_fits` (a token id that a dtype cannot hold
is refused, naming it and its document), and :class:`TokenizedDataset`, a dataset of text
documents read as token arrays, tokenized in the loader's workers. numpy only (and
``tokenizers`` when used): it never imports torch.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from guideloom_pipes.batch import Batch
from guideloom_pipes.checks import check_int
from guideloom_pipes.datasets import DocumentDataset, has_documents
from guideloom_pipes.reader_base import (
    DatasetReaderBase,
    _as_ids,
    _AsyncDatasetReader,
    batch_read_fn,
    open_reader,
    reader_fingerprint,
)
from guideloom_pipes.storage import DocumentStorage

__all__ = [
    "TOKEN_DTYPE",
    "TokenizedDataset",
    "TokenizedReader",
    "check_fits",
    "encode_texts",
    "load_tokenizer",
    "resolve_eos",
    "tokenizer_identity",
]

#: The dtype of the token arrays a :class:`TokenizedDataset` gives.
TOKEN_DTYPE = np.dtype(np.int32)

#: Tokenizers loaded in this process, by (absolute path, size, modification time).
_LOADED: dict[tuple[str, int, int], Any] = {}
_LOADED_LOCK = threading.Lock()


def _tokenizers_module() -> Any:
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError(
            f"tokenizing text needs Hugging Face tokenizers, which is not installed ({error}): "
            f"pip install tokenizers (or pip install 'guideloom-pipes[tokenizers]')"
        ) from None
    return tokenizers


def _identity(path: str | os.PathLike[str]) -> tuple[str, int, int]:
    where = os.path.abspath(os.fspath(path))
    try:
        info = os.stat(where)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"tokenizer file {where} does not exist: give the tokenizer.json a Hugging Face "
            f"tokenizer was saved to (tokenizer.save(path), or the one beside a model's files)"
        ) from None
    if os.path.isdir(where):
        raise IsADirectoryError(
            f"tokenizer file {where} is a directory: give its tokenizer.json "
            f"({os.path.join(where, 'tokenizer.json')})"
        )
    return where, info.st_size, info.st_mtime_ns


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The ``tokenizers.Tokenizer`` saved at ``path`` (``tokenizer.json``), loaded once per
    process (a worker loads it on its first document, then reuses it; an edited file is
    loaded again).

    Raises:
        ImportError: ``tokenizers`` is not installed (``pip install tokenizers``).
        FileNotFoundError: no such file.
        ValueError: the file is not a tokenizer ``tokenizers`` can load.
    """
    key = _identity(path)
    with _LOADED_LOCK:
        found = _LOADED.get(key)
    if found is not None:
        return found
    tokenizers = _tokenizers_module()
    try:
        loaded = tokenizers.Tokenizer.from_file(key[0])
    except Exception as error:  # (tokenizers raises its own Exception for a bad file)
        raise ValueError(
            f"{key[0]} is not a tokenizer file that tokenizers can load ({error}); give the "
            f"tokenizer.json of a Hugging Face tokenizer (Tokenizer.save)"
        ) from None
    with _LOADED_LOCK:
        return _LOADED.setdefault(key, loaded)


def tokenizer_identity(path: str | os.PathLike[str]) -> str:
    """A digest of the tokenizer file's bytes: what a checkpoint or a converted shard is
    made with (another tokenizer, another digest)."""
    where = _identity(path)[0]
    digest = hashlib.blake2b(digest_size=16)
    with open(where, "rb") as file:
        digest.update(file.read())
    return digest.hexdigest()


def resolve_eos(eos_id: int | str | None, tokenizer_file: Any = None) -> int | None:
    """``eos_id`` as a token id: an int as is (>= 0); a str is a token of the tokenizer
    (``"</s>"``, ``"<|endoftext|>"``), its id looked up."""
    if not isinstance(eos_id, str):
        return check_int(
            "eos_id", eos_id, minimum=0, allow_none=True, kind="a token id (an int) or a token"
        )
    if tokenizer_file is None:
        raise TypeError(
            f"eos_id={eos_id!r} is a token, whose id only a tokenizer knows: give the "
            f"tokenizer, or its id as an int"
        )
    found = load_tokenizer(tokenizer_file).token_to_id(eos_id)
    if found is None:
        raise ValueError(
            f"eos_id={eos_id!r} is not a token of the tokenizer {tokenizer_file}: give one of "
            f"its special tokens (e.g. '</s>', '<|endoftext|>') or the id as an int"
        )
    return int(found)


def encode_texts(tokenizer: Any, texts: Sequence[str], eos_id: int | None) -> list[np.ndarray]:
    """Each text's token ids (int64, what ``tokenizer.encode(text).ids`` gives), with
    ``eos_id`` appended when given."""
    encoded = tokenizer.encode_batch(list(texts))
    tail = [] if eos_id is None else [eos_id]
    return [np.array(item.ids + tail, dtype=np.int64) for item in encoded]


def check_fits(tokens: np.ndarray, dtype: np.dtype[Any], where: str) -> None:
    """Refuse ``tokens`` holding an id that ``dtype`` cannot hold, naming the id and
    ``where`` (its document)."""
    if not tokens.size or np.can_cast(tokens.dtype, dtype, "safe"):
        return
    info = np.iinfo(dtype)
    bad = tokens[(tokens < info.min) | (tokens > info.max)]
    if len(bad):
        raise ValueError(
            f"token id {int(bad[0])} of {where} does not fit dtype={dtype} "
            f"({info.min}..{info.max}): give a wider dtype= (e.g. 'int32')"
        )


def _text_of(sample: Any, index: int) -> str:
    if isinstance(sample, str):
        return sample
    if isinstance(sample, dict) and isinstance(sample.get("text"), str):
        return sample["text"]
    shown = repr(sample)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise TypeError(
        f"sample {index} is {shown}: TokenizedDataset reads text documents, each a str or a "
        f"dict with a 'text' str (e.g. DocumentDataset(ParquetStorage(path, 'text')))"
    )


class TokenizedDataset:
    """Text documents read as token ids: sample ``i`` is ``{"tokens": array}``, the int32 ids
    the tokenizer gives for document ``i``'s text, then ``eos_id`` (when given), cut to
    ``max_length`` (a cut document loses its EOS).

    Tokenizing happens on read, in the loader's workers (threads or processes; each
    process loads the tokenizer once); the same document always gives the same tokens, so a
    loader over it resumes exactly, and its checkpoint fingerprint carries the tokenizer
    file's digest. Batches of documents of different lengths: ``pad_collate``.

    Args:
        dataset: the text documents: a ``DocumentDataset`` (or a storage that serves
            documents, e.g. ``ParquetStorage(path, "text")``) or any map-style dataset whose
            samples are ``str`` or ``{"text": str}``.
        tokenizer_file: a Hugging Face ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``).
        eos_id: appended to each document: a token id, or a token of the tokenizer
            (``"</s>"``); None: nothing appended.
        max_length: most tokens per sample (>= 1); None: whole documents.
    """

    def __init__(
        self,
        dataset: Any,
        tokenizer_file: str | os.PathLike[str],
        eos_id: int | str | None = None,
        max_length: int | None = None,
    ) -> None:
        if isinstance(dataset, DocumentStorage) or has_documents(dataset):
            dataset = DocumentDataset(dataset)
        if not hasattr(dataset, "sync_reader") and not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
        ):
            raise TypeError(
                f"dataset must be a dataset of text documents (len and [i], or ours), got "
                f"{type(dataset).__name__}"
            )
        if not isinstance(tokenizer_file, (str, os.PathLike)):
            raise TypeError(
                f"tokenizer_file must be the path of a tokenizer.json, got {tokenizer_file!r}"
            )
        self.dataset = dataset
        self.tokenizer_file = os.path.abspath(os.fspath(tokenizer_file))
        load_tokenizer(self.tokenizer_file)  # (refused here, not in a worker, when bad)
        self.eos_id = resolve_eos(eos_id, self.tokenizer_file)
        self.max_length = check_int("max_length", max_length, minimum=1, allow_none=True)
        if self.eos_id is not None:
            check_fits(np.array([self.eos_id]), TOKEN_DTYPE, f"eos_id={self.eos_id}")

    def __len__(self) -> int:
        with self.sync_reader() as reader:
            return len(reader)

    def sync_reader(self) -> TokenizedReader:
        """A reader (context manager) with ``len``, ``[i]``, slices and ``read_batch``."""
        return TokenizedReader(self)

    def async_reader(self) -> _AsyncDatasetReader:
        """An ``async`` reader (``async with``) with ``read`` and ``read_batch``."""
        return _AsyncDatasetReader(TokenizedReader(self))

    def __getitem__(self, index: int | slice) -> Any:
        """Sample ``index`` (or a list for a slice), through a reader opened for this call;
        use :meth:`sync_reader` for many reads."""
        with self.sync_reader() as reader:
            return reader[index]

    def __repr__(self) -> str:
        return (
            f"TokenizedDataset({self.dataset!r}, {self.tokenizer_file!r}, eos_id={self.eos_id}, "
            f"max_length={self.max_length})"
        )


class TokenizedReader(DatasetReaderBase):
    """Reader of a :class:`TokenizedDataset`: its source's texts, a batch at a time, through
    the tokenizer."""

    def __init__(self, dataset: TokenizedDataset) -> None:
        super().__init__(None)
        self.dataset = dataset
        self._source: Any = None
        self._owns_source = False
        self._read: Any = None
        self._tokenizer: Any = None
        self._digest = ""

    def open(self) -> None:
        """Open the source and load the tokenizer (once per process)."""
        if self._source is not None:
            return
        self._tokenizer = load_tokenizer(self.dataset.tokenizer_file)
        self._digest = tokenizer_identity(self.dataset.tokenizer_file)
        self._source, self._owns_source = open_reader(self.dataset.dataset)
        self._read = batch_read_fn(self._source)
        self._length = len(self._source)

    def close(self) -> None:
        """Close the source (if this reader opened it); samples stay valid."""
        source, self._source = self._source, None
        if source is not None and self._owns_source:
            source.close()
        self._read = None
        self._length = -1

    @property
    def storage_reader(self) -> Any:
        """The source's reader."""
        return self._source

    def fingerprint(self) -> dict[str, Any] | None:
        """The source's fingerprint, with the tokenizer's digest, ``eos_id`` and
        ``max_length``."""
        self._check_open()
        return {
            "source": reader_fingerprint(self._source),
            "tokenizer": self._digest,
            "eos_id": self.dataset.eos_id,
            "max_length": self.dataset.max_length,
        }

    def read_batch(self, ids: Sequence[int] | np.ndarray) -> list[dict[str, np.ndarray]]:
        """The documents at ``ids`` as ``{"tokens": int32 array}``, in that order."""
        self._check_open()
        indexes = _as_ids(ids, self._length)
        if not len(indexes):
            return []
        samples = self._read(indexes)
        texts = [_text_of(sample, int(i)) for sample, i in zip(samples, indexes.tolist())]
        encoded = encode_texts(self._tokenizer, texts, self.dataset.eos_id)
        cut = self.dataset.max_length
        out = []
        for tokens, index in zip(encoded, indexes.tolist()):
            check_fits(tokens, TOKEN_DTYPE, f"document {index}")
            out.append({"tokens": tokens[:cut].astype(TOKEN_DTYPE)})
        return out

    def read_arrays(self, ids: Sequence[int] | np.ndarray) -> Batch | list[Any]:
        """The documents at ``ids`` as a :class:`~guideloom_pipes.batch.Batch` of rows."""
        return Batch(rows=self.read_batch(ids))
