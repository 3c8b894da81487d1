"""``guideloom-pipes head DIR``: the first samples of a dataset, decoded, one line each
(``index<TAB>field=value``) or one JSON object a line with ``--json``."""

from __future__ import annotations

import argparse
import base64
import json
from typing import Any

import numpy as np

from guideloom_pipes.cli.dataset import UsageError, open_dataset
from guideloom_pipes.datasets import DocumentDataset, StreamDataset

#: elements per sample of a stream when ``--sequence-length`` is not given
DEFAULT_SEQUENCE_LENGTH = 16


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


def _fields(sample: Any) -> dict[str, Any]:
    if isinstance(sample, dict):
        return {str(key): value for key, value in sample.items()}
    return {"value": sample}


def run(args: argparse.Namespace) -> int:
    """Print the first ``-n`` samples; exit status 0."""
    if args.n < 0:
        raise UsageError(f"-n must be >= 0, got {args.n}")
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
    with dataset.sync_reader() as samples:
        count = min(args.n, len(samples))
        for index, sample in enumerate(samples[0:count] if count else []):
            fields = _fields(sample)
            if args.json:
                print(json.dumps({"index": index, **{k: _plain(v) for k, v in fields.items()}}))
            else:
                shown = "\t".join(
                    f"{key}={json.dumps(_plain(value), separators=(',', ':'))}"
                    for key, value in fields.items()
                )
                print(f"{index}\t{shown}")
    return 0
