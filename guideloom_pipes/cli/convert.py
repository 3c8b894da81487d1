"""``guideloom-pipes convert SRC DST``: any corpus the package reads (a dataset of ours, a
Megatron prefix, ``.npy`` files, Parquet tables of token ids or of text) written as a dataset of
ours by :func:`~guideloom_pipes.convert`, on a local process pool (``--workers``) or a Dask
cluster (``--dask``, an address, or alone for a local one); rerun to resume."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import Any

from guideloom_pipes.cli.dataset import UsageError
from guideloom_pipes.parallel.converting import convert


def _eos(text: str | None) -> int | str | None:
    """``--eos-id``: a token id, else a token of the tokenizer (``</s>``)."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return text


@contextlib.contextmanager
def _executor(args: argparse.Namespace) -> Iterator[Any]:
    """None (convert's own process pool), or a Dask cluster's executor (``--dask``)."""
    if args.dask is None:
        yield None
        return
    try:
        from dask import distributed
    except ImportError as error:
        raise UsageError(
            f"--dask needs Dask's distributed scheduler ({error}): pip install "
            f"'dask[distributed]' (or 'guideloom-pipes[dask]')"
        ) from None
    if args.dask:
        with distributed.Client(args.dask) as client:
            yield client.get_executor()
        return
    with (
        distributed.LocalCluster(
            n_workers=args.workers or 2, threads_per_worker=1, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client.get_executor()


def run(args: argparse.Namespace) -> int:
    """Convert; exit status 0 (what was written and skipped on stdout)."""
    if args.dask is not None and args.dask and args.workers:
        raise UsageError("--workers is for a local pool or cluster; a Dask address has its own")
    with _executor(args) as executor:
        try:
            report = convert(
                args.src,
                args.dst,
                tokenizer=args.tokenizer,
                dtype=args.dtype,
                eos_id=_eos(args.eos_id),
                documents=args.documents,
                column=args.column,
                shard_documents=args.shard_documents,
                shard_tokens=args.shard_tokens,
                executor=executor,
                max_workers=None if executor is not None else args.workers,
                progress=not args.no_progress,
                resume=not args.no_resume,
            )
        except (TypeError, ValueError, FileNotFoundError, ImportError) as error:
            raise UsageError(str(error)) from error
    if args.json:
        print(
            json.dumps(
                {
                    "src": args.src,
                    "dst": args.dst,
                    "written": report.written,
                    "skipped": report.skipped,
                    "removed": report.removed,
                    "records": report.records,
                    "bytes": report.bytes,
                    "seconds": report.seconds,
                }
            )
        )
    else:
        print(f"{args.src} -> {args.dst}: {report}")
    return 0
