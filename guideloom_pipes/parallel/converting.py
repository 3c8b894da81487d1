"""``convert``: any corpus :func:`~guideloom_pipes.open_storage` reads (a dataset of ours, a
Megatron indexed dataset, numpy token files, Parquet tables of token ids or of text) written
as a dataset of ours by :func:`~guideloom_pipes.write_parallel`: a token stream (or, with
``documents=True``, documents of ``{"tokens": array}``), text tokenized on the way, EOS
appended per document, every token checked against the dtype. A work item is a range of the
source's documents (or of its stream's tokens) within one of its files; item ``k`` is shard
``k``, so a rerun skips what is committed and the output is the same on any executor.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from guideloom_pipes.datasets import DocumentDataset, has_documents
from guideloom_pipes.formats import DocumentPickleFormat, StreamNumpyFormat
from guideloom_pipes.opening import foreign_corpus, open_storage
from guideloom_pipes.parallel.report import WriteReport
from guideloom_pipes.parallel.write import write_parallel
from guideloom_pipes.reader_base import reader_fingerprint
from guideloom_pipes.storage import DocumentStorage, StreamStorage
from guideloom_pipes.storage.corpora import NumpyTokensStorage
from guideloom_pipes.storage.corpora.base import token_dtype
from guideloom_pipes.tokenizing import (
    check_fits,
    encode_texts,
    load_tokenizer,
    resolve_eos,
    tokenizer_identity,
)

__all__ = ["ConvertItem", "DEFAULT_SHARD_DOCUMENTS", "DEFAULT_SHARD_TOKENS", "convert"]

#: Most documents of the source per output shard by default (a larger file is split).
DEFAULT_SHARD_DOCUMENTS = 1 << 17
#: Most tokens per output shard by default, for a stream without documents.
DEFAULT_SHARD_TOKENS = 1 << 26
#: Documents read (and tokenized) at a time in a worker.
_READ_DOCUMENTS = 256
#: Tokens read at a time from a stream without documents.
_READ_TOKENS = 1 << 22
#: The largest vocabulary whose ids ``uint16`` holds (the default dtype of text).
_UINT16_VOCAB = 1 << 16


@dataclass(frozen=True)
class ConvertItem:
    """One shard's work: ``source``'s documents ``[start, stop)`` (``documents``), or its
    stream's tokens ``[start, stop)``."""

    source: Any
    start: int
    stop: int
    documents: bool


@dataclass(frozen=True)
class _Settings:
    tokenizer: str | None
    eos_id: int | None
    dtype: np.dtype[Any]
    text: bool
    #: a stream is written: a batch of documents is one record (their tokens back to back)
    stream: bool = False


def convert(
    src: Any,
    dst: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    dtype: Any = None,
    eos_id: int | str | None = None,
    documents: bool = False,
    column: str | None = None,
    shard_documents: int = DEFAULT_SHARD_DOCUMENTS,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    executor: cf.Executor | None = None,
    max_workers: int | None = None,
    progress: bool = True,
    resume: bool = True,
) -> WriteReport:
    """Write the corpus at ``src`` as a dataset of ours at ``dst``, in parallel; returns
    the write's :class:`~guideloom_pipes.WriteReport`.

    ``src`` is anything :func:`~guideloom_pipes.open_storage` opens: a dataset of ours (a
    stream of token ids, or documents of ``{"tokens": ...}`` / ``{"text": str}``), a
    Megatron prefix, ``.npy`` files, Parquet tables (a column of token ids or of text).
    ``dst`` becomes a :class:`~guideloom_pipes.StreamStorage` of
    ``StreamNumpyFormat(np.dtype([("tokens", dtype)]))``, the documents back to back, or with
    ``documents=True`` a :class:`~guideloom_pipes.DocumentStorage` (``DocumentPickleFormat``)
    of ``{"tokens": array}`` per document (what ``DocumentDataset``, ``pad_collate`` and
    ``PackedDataset`` read).

    Each input file is one shard, a file of more than ``shard_documents`` documents (or,
    for a stream without documents, ``shard_tokens`` tokens) several: shard ``k`` is work
    item ``k`` of :func:`~guideloom_pipes.write_parallel`, run on ``executor``. A rerun
    skips the shards committed from the same input with the same settings (``resume``).

    Args:
        src: the source corpus (a path).
        dst: the output directory.
        tokenizer: a Hugging Face ``tokenizer.json``: required for text, refused for tokens.
            Each worker loads it once.
        dtype: the output token dtype. None: the source's; for text, ``uint16`` when the
            tokenizer's vocabulary fits it, else ``int32``. A token id that does not fit is
            refused, naming the value and its document.
        eos_id: appended to each document: a token id, or a token of the tokenizer
            (``"</s>"``). For flat numpy token files, whose documents already end with it,
            it is where they are split (nothing is appended).
        documents: write documents (a ``DocumentStorage``) instead of a stream.
        column: the column of a Parquet table (default: ``input_ids`` or ``tokens``, else
            ``text``).
        shard_documents: most source documents per output shard (>= 1).
        shard_tokens: most tokens per output shard of a source without documents (>= 1).
        executor: where to run, as for :func:`~guideloom_pipes.write_parallel` (a Dask
            cluster: ``client.get_executor()``).
        max_workers: as for :func:`~guideloom_pipes.write_parallel`.
        progress: as for :func:`~guideloom_pipes.write_parallel`.
        resume: as for :func:`~guideloom_pipes.write_parallel`.

    Raises:
        TypeError: text without ``tokenizer``, a tokenizer for tokens, another kind of source.
        ValueError: an id or ``eos_id`` past ``dtype``; documents of a stream without them.
        ImportError: text, and ``tokenizers`` is not installed.
        WriteParallelError: some items failed (their shards are not committed; rerun).
    """
    _check_arguments(src, dst, shard_documents, shard_tokens)
    source = _open_source(src, column, eos_id)
    text, tokenizer_file = _tokenizing(src, source, tokenizer)
    out_dtype = _output_dtype(source, dtype, text, tokenizer_file)
    eos = _eos(eos_id, tokenizer_file, source, out_dtype)
    items = _items(source, documents, shard_documents, shard_tokens, src, eos)
    storage = _destination(dst, documents, out_dtype)
    settings = _Settings(tokenizer_file, eos, out_dtype, text, stream=not documents)
    identity = _source_identity(source, tokenizer_file)
    return write_parallel(
        storage,
        items,
        functools.partial(convert_item, settings),
        executor=executor,
        max_workers=max_workers,
        progress=progress,
        resume=resume,
        fingerprint=functools.partial(_item_print, identity),
    )


def _check_arguments(src: Any, dst: Any, shard_documents: int, shard_tokens: int) -> None:
    """Refuse shard sizes below 1 and a destination that is the source."""
    if shard_documents < 1 or shard_tokens < 1:
        raise ValueError(
            f"shard_documents and shard_tokens must be >= 1, got {shard_documents} and "
            f"{shard_tokens}"
        )
    if isinstance(src, (str, os.PathLike)) and os.path.realpath(src) == os.path.realpath(dst):
        raise ValueError(
            f"dst {os.fspath(dst)!r} is the source itself: convert writes a new dataset, give "
            f"another directory"
        )


def _tokenizing(src: Any, source: Any, tokenizer: Any) -> tuple[bool, str | None]:
    """Whether ``source`` holds text, and the tokenizer file's absolute path (checked to
    load: refused before any work), a tokenizer being required for text and refused for
    tokens."""
    text = bool(getattr(source, "text", False)) or _holds_text(source)
    tokenizer_file = None if tokenizer is None else os.path.abspath(os.fspath(tokenizer))
    if text and tokenizer_file is None:
        raise TypeError(
            f"{src} holds text, which is written as token ids: give tokenizer= a Hugging Face "
            f"tokenizer.json (the CLI's --tokenizer)"
        )
    if not text and tokenizer_file is not None:
        raise TypeError(
            f"{src} holds token ids already, so no tokenizer is run on it: drop tokenizer="
        )
    if tokenizer_file is not None:
        load_tokenizer(tokenizer_file)
    return text, tokenizer_file


def _eos(eos_id: Any, tokenizer_file: str | None, source: Any, dtype: np.dtype[Any]) -> Any:
    """The id appended to each document (None: none), checked to fit ``dtype``."""
    eos = resolve_eos(eos_id, tokenizer_file)
    if isinstance(source, NumpyTokensStorage):
        eos = None  # (its documents end with it already)
    if eos is not None:
        check_fits(np.array([eos]), dtype, f"eos_id={eos}")
    return eos


def _destination(dst: Any, documents: bool, dtype: np.dtype[Any]) -> Any:
    """The storage written: documents of ``{"tokens": array}``, or a stream of ``tokens``."""
    if documents:
        return DocumentStorage(os.fspath(dst), DocumentPickleFormat())
    return StreamStorage(os.fspath(dst), StreamNumpyFormat(np.dtype([("tokens", dtype)])))


def _open_source(src: Any, column: str | None, eos_id: int | str | None) -> Any:
    """The source's storage: a corpus of another tool (flat numpy files split at an int
    ``eos_id``), else a dataset of ours."""
    corpus = foreign_corpus(src, column=column)
    if isinstance(corpus, NumpyTokensStorage) and isinstance(eos_id, int):
        corpus = foreign_corpus(src, eos_id=eos_id)
    if corpus is not None:
        return corpus
    if column is not None:
        raise TypeError(
            f"column={column!r} names a column of a Parquet table; {src} is not one: drop column="
        )
    return open_storage(src)


def _holds_text(source: Any) -> bool:
    """Whether a document storage of ours holds text: its first document is a str or
    ``{"text": str}``."""
    if not isinstance(source, DocumentStorage):
        return False
    with DocumentDataset(source).sync_reader() as reader:
        if not len(reader):
            return False
        first = reader[0]
    return isinstance(first, str) or (isinstance(first, dict) and "text" in first)


def _output_dtype(source: Any, dtype: Any, text: bool, tokenizer_file: str | None) -> np.dtype[Any]:
    if dtype is not None:
        return token_dtype(dtype, "dtype")
    if text:
        assert tokenizer_file is not None
        vocabulary = load_tokenizer(tokenizer_file).get_vocab_size(with_added_tokens=True)
        return np.dtype("<u2" if vocabulary <= _UINT16_VOCAB else "<i4")
    if isinstance(source, StreamStorage):
        return token_dtype(_token_field(source)[1], "dtype")
    return np.dtype("<i4")  # (documents of ours: their arrays say; int32 by default)


def _token_field(source: StreamStorage[Any, Any, Any]) -> tuple[str, np.dtype[Any]]:
    """The field of a stream that holds its tokens: ``tokens``, or its one field."""
    stream = np.dtype(source.format.stream_dtype)
    names: tuple[str, ...] = stream.names or ()
    name = "tokens" if "tokens" in names else (names[0] if len(names) == 1 else None)
    if name is None or stream[name].kind not in "iu":
        raise TypeError(
            f"{source.dir} is a stream of {stream}: convert reads a stream of token ids (an "
            f"integer field 'tokens', or one integer field)"
        )
    return name, stream[name]


def _items(
    source: Any,
    documents: bool,
    shard_documents: int,
    shard_tokens: int,
    src: Any,
    eos_id: int | None,
) -> list[ConvertItem]:
    """The work items: each file's documents (or tokens) in ranges of at most
    ``shard_documents`` (``shard_tokens``)."""
    if isinstance(source, DocumentStorage) or has_documents(source):
        with DocumentDataset(source).sync_reader() as reader:
            counts = [
                reader.storage_reader.length(s) for s in range(reader.storage_reader.num_shards)
            ]
        return _ranges(source, counts, shard_documents, True)
    if documents:
        raise ValueError(
            f"{src} has no document boundaries, so documents=True cannot find its documents: "
            f"give eos_id= the token that ends each (flat token files), or write a stream"
        )
    if eos_id is not None:
        raise ValueError(
            f"eos_id={eos_id} is appended to each document, but {src} is a stream without "
            f"document boundaries (its documents, if any, end with their EOS already): drop "
            f"eos_id="
        )
    with source.sync_reader() as reader:
        counts = [reader.length(s) for s in range(reader.num_shards)]
    return _ranges(source, counts, shard_tokens, False)


def _ranges(source: Any, counts: list[int], most: int, documents: bool) -> list[ConvertItem]:
    items, start = [], 0
    for count in counts:
        pieces = max(1, -(-count // most))
        bounds = [start + count * piece // pieces for piece in range(pieces + 1)]
        items += [ConvertItem(source, a, b, documents) for a, b in itertools.pairwise(bounds)]
        start += count
    return items


def _source_identity(source: Any, tokenizer_file: str | None) -> bytes:
    """What a shard is made from besides its range: the source's version (its reader's
    fingerprint, its files' sizes and modification times) and the tokenizer's bytes."""
    parts: list[Any] = [type(source).__name__, repr(source)]
    documents = isinstance(source, DocumentStorage) or has_documents(source)
    with (DocumentDataset(source) if documents else source).sync_reader() as reader:
        parts.append(reader_fingerprint(reader))
    for path in _files_of(source):
        try:
            info = os.stat(path)
        except OSError:
            continue
        parts.append([os.fspath(path), info.st_size, info.st_mtime_ns])
    if tokenizer_file is not None:
        parts.append(tokenizer_identity(tokenizer_file))
    return json.dumps(parts, default=str).encode()


def _files_of(source: Any) -> list[Any]:
    prefixes = getattr(source, "prefixes", None)
    if prefixes:
        return [f"{p}{suffix}" for p in prefixes for suffix in (".bin", ".idx")]
    return list(getattr(source, "files", None) or [])


def _item_print(identity: bytes, item: ConvertItem) -> bytes:
    digest = hashlib.blake2b(identity, digest_size=16)
    digest.update(f"{item.start}\0{item.stop}\0{item.documents}".encode())
    return digest.digest()


def convert_item(settings: _Settings, item: ConvertItem) -> Iterator[dict[str, np.ndarray]]:
    """In a worker: the records of one item, ``{"tokens": array}`` each (a document, or a
    piece of a stream), in ``settings``' dtype."""
    if item.documents:
        yield from _documents(settings, item)
        return
    source = item.source
    name = _token_field(source)[0] if isinstance(source, StreamStorage) else "tokens"
    with source.sync_reader() as reader:
        for start in range(item.start, item.stop, _READ_TOKENS):
            length = min(_READ_TOKENS, item.stop - start)
            tokens = np.asarray(_stream_tokens(reader.read(start, length), name))
            check_fits(tokens, settings.dtype, f"the stream at tokens {start}..{start + length}")
            yield {"tokens": tokens.astype(settings.dtype)}


def _stream_tokens(found: Any, name: str) -> Any:
    if isinstance(found, dict):
        return found[name]
    if isinstance(found, np.ndarray) and found.dtype.names:
        return found[name]
    return found


def _documents(settings: _Settings, item: ConvertItem) -> Iterator[dict[str, np.ndarray]]:
    tokenizer = None if settings.tokenizer is None else load_tokenizer(settings.tokenizer)
    tail = [] if settings.eos_id is None else [settings.eos_id]
    with DocumentDataset(item.source).sync_reader() as reader:
        for first in range(item.start, item.stop, _READ_DOCUMENTS):
            ids = np.arange(first, min(first + _READ_DOCUMENTS, item.stop), dtype=np.int64)
            samples = reader.read_batch(ids)
            if settings.text:
                texts = [
                    _text(sample, int(index), item.source) for sample, index in zip(samples, ids)
                ]
                arrays = encode_texts(tokenizer, texts, settings.eos_id)
            else:
                arrays = [
                    _tokens(sample, int(i), item.source, tail) for sample, i in zip(samples, ids)
                ]
            if settings.stream and arrays:  # (one record, one check: no per-document cost)
                tokens = np.concatenate(arrays)
                if _fits(tokens, settings.dtype):
                    yield {"tokens": tokens.astype(settings.dtype)}
                    continue
            for tokens, index in zip(arrays, ids.tolist()):
                check_fits(tokens, settings.dtype, f"document {index} of {item.source!r}")
                if not settings.stream:
                    yield {"tokens": tokens.astype(settings.dtype)}


def _fits(tokens: np.ndarray, dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` holds every id of ``tokens``."""
    if not tokens.size or np.can_cast(tokens.dtype, dtype, "safe"):
        return True
    info = np.iinfo(dtype)
    return bool(tokens.min() >= info.min and tokens.max() <= info.max)


def _text(sample: Any, index: int, source: Any) -> str:
    if isinstance(sample, dict):
        sample = sample.get("text")
    if not isinstance(sample, str):
        raise TypeError(
            f"document {index} of {source!r} is not text (a str, or a dict with a 'text' str), "
            f"though the first one is: every document of a source is text, or every one tokens"
        )
    return sample


def _tokens(sample: Any, index: int, source: Any, tail: list[int]) -> np.ndarray:
    found = sample.get("tokens") if isinstance(sample, dict) else sample
    tokens = np.asarray(found) if found is not None else None
    if tokens is None or tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise TypeError(
            f"document {index} of {source!r} is not a document of token ids (a 1-D integer "
            f"array, or a dict with one under 'tokens'): convert writes token ids"
        )
    if tail:
        tokens = np.concatenate([tokens.astype(np.int64, copy=False), np.array(tail, np.int64)])
    return tokens
