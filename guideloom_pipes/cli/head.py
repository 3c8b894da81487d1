"""``guideloom-pipes head DIR``: the first samples of a dataset, decoded, one line each
(``index<TAB>field=value``, each value cut at 200 characters unless ``--full``) or one JSON
object a line with ``--json`` (whole)."""

from __future__ import annotations

import argparse
import base64
import json
import sys
from typing import Any

import numpy as np

from guideloom_pipes.cli.corpus import corpus_of
from guideloom_pipes.cli.dataset import UsageError, open_dataset
from guideloom_pipes.datasets import DocumentDataset, StreamDataset

#: elements per sample of a stream when ``--sequence-length`` is not given
DEFAULT_SEQUENCE_LENGTH = 16
#: characters of a field's value shown without ``--full`` (the rest is counted, not shown)
FIELD_CHARACTERS = 200
#: characters a text field shows escaped, so that a sample stays one line
_ESCAPES = str.maketrans({"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"})


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data (arrays as lists, bytes as text where they decode)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(raw).decode()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _shown(value: Any, full: bool) -> str:
    """A field's value as ``head`` prints it: text as its characters (a tab, a line break
    and a backslash escaped, so the sample stays one line), anything else as compact JSON;
    cut at :data:`FIELD_CHARACTERS` characters unless ``full``, with the count of those
    cut."""
    plain = _plain(value)
    if isinstance(plain, str):
        text = plain.translate(_ESCAPES)
    else:
        text = json.dumps(plain, separators=(",", ":"), ensure_ascii=False)
    if full or len(text) <= FIELD_CHARACTERS:
        return text
    cut = len(text) - FIELD_CHARACTERS
    return f"{text[:FIELD_CHARACTERS]}...[{cut:,} more characters; --full shows all]"


def _fields(sample: Any) -> dict[str, Any]:
    if isinstance(sample, dict):
        return {str(key): value for key, value in sample.items()}
    return {"value": sample}


def run(args: argparse.Namespace) -> int:
    """Print the first ``-n`` samples; exit status 0 (2 for a stream shorter than one
    sample)."""
    if args.n < 0:
        raise UsageError(f"-n must be >= 0, got {args.n}")
    found = corpus_of(args)
    if found is not None:  # a corpus's documents, or its windows with -L (or no documents)
        if args.sequence_length or not getattr(found, "has_documents", True):
            length = args.sequence_length or DEFAULT_SEQUENCE_LENGTH
            return _print(args, "stream", StreamDataset(found, length))
        return _print(args, "document", DocumentDataset(found))  # type: ignore[arg-type]
    opened = open_dataset(args.path, args.dtype, args.kind)
    if opened.kind == "document":
        dataset: Any = DocumentDataset(opened.storage)
    else:
        if opened.dtype is None:
            raise UsageError(
                f"{args.path} has no commit records (written by GuideLoom), so its dtype is "
                f"unknown: pass --dtype (e.g. --dtype int32 or --dtype tokens:int32,mask:uint8)"
            )
        length = args.sequence_length or DEFAULT_SEQUENCE_LENGTH
        dataset = StreamDataset(opened.storage, length)
    return _print(args, opened.kind, dataset)


def _print(args: argparse.Namespace, kind: str, dataset: Any) -> int:
    with dataset.sync_reader() as samples:
        if len(samples) == 0:
            _nothing_to_show(args, kind, samples)
        count = min(args.n, len(samples))
        for index, sample in enumerate(samples[0:count] if count else []):
            fields = _fields(sample)
            if args.json:
                print(json.dumps({"index": index, **{k: _plain(v) for k, v in fields.items()}}))
            else:
                shown = "\t".join(
                    f"{key}={_shown(value, args.full)}" for key, value in fields.items()
                )
                print(f"{index}\t{shown}")
    return 0


def _nothing_to_show(args: argparse.Namespace, kind: str, samples: Any) -> None:
    """A dataset with no sample: a :class:`UsageError` naming both sizes when the stream
    is shorter than one sample (a shorter ``-L`` shows it), else a note on stderr."""
    if kind != "document":
        elements = samples.storage_reader.total_length
        length = samples.sequence_length
        if elements > 0:
            raise UsageError(
                f"--sequence-length {length} is longer than {args.path}, which holds "
                f"{elements} elements: no sample to show; pass -L {elements} or less"
            )
        print(f"{args.path} holds 0 elements: no sample to show", file=sys.stderr)
    else:
        print(f"{args.path} holds 0 documents: no sample to show", file=sys.stderr)
