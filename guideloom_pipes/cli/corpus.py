"""``info``, ``verify`` and ``head`` of a corpus another tool wrote (a Megatron prefix or its
``.bin`` / ``.idx``, ``.npy`` files, Parquet tables), read in place: :func:`corpus_of` says
whether the path is one, and the commands describe it by its files, tokens and documents
(``--dtype``: the dtype tokens are read as)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from guideloom_pipes.cli.dataset import UsageError, parse_dtype
from guideloom_pipes.opening import foreign_corpus
from guideloom_pipes.storage.corpora import (
    MegatronIndexedStorage,
    NumpyTokensStorage,
    ParquetStorage,
    TokenCorpus,
)
from guideloom_pipes.storage.errors import StorageError

#: who wrote each corpus class's files
_WRITTEN_BY: dict[type, str] = {
    MegatronIndexedStorage: "Megatron-LM (an indexed dataset: .bin + .idx)",
    NumpyTokensStorage: "numpy (flat token files)",
    ParquetStorage: "Parquet (a column of token ids, a row per document)",
}


def corpus_of(args: argparse.Namespace) -> TokenCorpus | None:
    """The corpus at ``args.path`` (``--dtype`` the dtype its tokens are read as,
    ``--column`` the column of a Parquet table), or None where the path is not one."""
    column = getattr(args, "column", None)
    try:
        corpus = foreign_corpus(args.path, column=column)
        if corpus is None:
            if column is not None:
                raise UsageError(
                    f"--column {column}: {args.path} is not a Parquet table (a .parquet file "
                    f"or a directory of them); drop --column"
                )
            return None
        if getattr(args, "dtype", None) is not None:
            dtype = parse_dtype(args.dtype)
            if dtype.names is not None:
                raise UsageError(
                    f"--dtype {args.dtype}: a token corpus has one field, its tokens; pass an "
                    f"integer dtype (e.g. --dtype int32)"
                )
            corpus = foreign_corpus(args.path, dtype=dtype, column=column)
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    text = getattr(corpus, "text", False)
    if corpus is not None and getattr(args, "kind", None) not in (
        None,
        "document" if text else "stream",
    ):
        what = "documents of text" if text else "a token corpus (kind stream, with its documents)"
        raise UsageError(f"{args.path} is {what}, not {args.kind}: drop --kind")
    return corpus


def describe(corpus: TokenCorpus, sequence_length: int | None) -> dict[str, Any]:
    """What ``info`` prints of a corpus, as a JSON-able dict (``documents`` None: the corpus
    has no document boundaries; ``elements`` None: text, no tokens)."""
    if getattr(corpus, "text", False):
        return _describe_text(corpus)
    with corpus.sync_reader() as stream:
        starts = stream.document_starts
        shard_starts = stream.shard_starts
        files = []
        for shard, name in enumerate(stream.file_names):
            documents = None
            if starts is not None:
                low, high = np.searchsorted(starts[:-1], shard_starts[shard : shard + 2])
                documents = int(high - low)
            files.append(
                {
                    "file": os.fspath(corpus.dir / name),
                    "tokens": stream.length(shard),
                    "documents": documents,
                    "bytes": os.path.getsize(corpus.dir / name),
                }
            )
        tokens = stream.total_length
    out: dict[str, Any] = {
        "path": [os.fspath(path) for path in _paths(corpus)],
        "kind": "stream",
        "storage": type(corpus).__name__,
        "written_by": _WRITTEN_BY.get(type(corpus), corpus.description),
        "dtype": str(corpus.stored),
        "read_as": str(corpus.dtype),
        **({"column": corpus.column} if isinstance(corpus, ParquetStorage) else {}),
        "shards": len(files),
        "elements": tokens,
        "documents": None if starts is None else len(starts) - 1,
        "bytes": sum(file["bytes"] for file in files),
        "files": files,
    }
    if sequence_length is not None:
        out["sequence_length"] = sequence_length
        out["samples"] = tokens // sequence_length
    return out


def _describe_text(corpus: Any) -> dict[str, Any]:
    """``describe`` of a Parquet string column: its files and rows (documents)."""
    with corpus.document_reader() as documents:
        files = [
            {
                "file": os.fspath(path),
                "tokens": None,
                "documents": documents.length(shard),
                "bytes": os.path.getsize(path),
            }
            for shard, path in enumerate(corpus.files)
        ]
        count = len(documents)
    return {
        "path": [os.fspath(path) for path in corpus.files],
        "kind": "document",
        "storage": type(corpus).__name__,
        "written_by": "Parquet (a column of text, a row per document)",
        "column": corpus.column,
        "dtype": "string",
        "read_as": "string",
        "shards": len(files),
        "elements": None,
        "documents": count,
        "bytes": sum(file["bytes"] for file in files),
        "files": files,
    }


def _paths(corpus: TokenCorpus) -> list[Any]:
    return list(getattr(corpus, "prefixes", None) or getattr(corpus, "files", [corpus.dir]))


def info_lines(facts: dict[str, Any]) -> list[str]:
    text = facts["elements"] is None
    kind = "stream" + ("" if facts["documents"] is None else " with documents")
    if text:
        kind = "documents of text (windows need a tokenizer)"
    lines = [
        f"path:      {', '.join(facts['path'])}",
        f"kind:      {kind} ({facts['storage']}), written by {facts['written_by']}; read-only",
        *([f"column:    {facts['column']}"] if "column" in facts else []),
        f"dtype:     {facts['dtype']}"
        + ("" if facts["read_as"] == facts["dtype"] else f" (read as {facts['read_as']})"),
        f"shards:    {facts['shards']}",
        f"elements:  {'none (text)' if text else facts['elements']}",
        "documents: "
        + (
            "none (no end-of-document token)"
            if facts["documents"] is None
            else str(facts["documents"])
        ),
        f"bytes:     {facts['bytes']}",
    ]
    if "samples" in facts:
        lines.append(f"samples:   {facts['samples']} (sequence length {facts['sequence_length']})")
    lines.append("")
    lines.append(f"{'shard':<8} {'elements':>14} {'documents':>12} {'bytes':>14}  file")
    for shard, file in enumerate(facts["files"]):
        documents = "-" if file["documents"] is None else file["documents"]
        tokens = "-" if file["tokens"] is None else file["tokens"]
        lines.append(
            f"{shard:07d}  {tokens:>14} {documents:>12} {file['bytes']:>14}  {file['file']}"
        )
    return lines


def verify(corpus: TokenCorpus) -> dict[str, Any]:
    """Every check of the corpus's files an open makes, then every token read once (and
    checked against ``--dtype``): ``sound``, the problem, the counts."""
    started = time.perf_counter()
    try:
        counts = corpus.verify()
    except (StorageError, ValueError, OSError) as error:
        return {"sound": False, "problem": str(error), "seconds": time.perf_counter() - started}
    if getattr(corpus, "text", False):
        return {
            "sound": True,
            "problem": None,
            "shards": counts["shards"],
            "tokens": None,
            "documents": counts["documents"],
            "bytes": sum(os.path.getsize(path) for path in _paths(corpus)),
            "seconds": time.perf_counter() - started,
        }
    with corpus.sync_reader() as reader:
        size = sum(int(n) for n in reader.shard_starts[1:] - reader.shard_starts[:-1])
        size *= np.dtype(corpus.stored).itemsize
    return {
        "sound": True,
        "problem": None,
        "shards": counts["shards"],
        "tokens": counts["tokens"],
        "bytes": size,
        "seconds": time.perf_counter() - started,
    }
