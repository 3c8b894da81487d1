"""``guideloom-pipes index DIR``: write a dataset's manifest (one file listing its committed
shards), so that it opens without listing its directory and reading every commit record:
for a dataset written by GuideLoom or before manifests, or one whose manifest a change by
another tool made stale. A dataset at an object store's URL (``s3://...``) is indexed there,
its files' ETags recorded; an HTTP(S) server's is indexed in the directory it serves."""

from __future__ import annotations

import argparse
import json
import time

from guideloom_pipes.cli.dataset import UsageError, open_dataset
from guideloom_pipes.storage.errors import ShardLockedError
from guideloom_pipes.storage.manifest import MAIN, MANIFEST_DIR


def run(args: argparse.Namespace) -> int:
    """Index the dataset; exit status 0 (2 for an HTTP(S) URL or a path that is not a
    dataset, 1 when a writer is writing it or its shards fail an open's checks)."""
    opened = open_dataset(args.path, args.dtype, args.kind)
    storage = opened.storage
    if str(storage.dir).partition("://")[0].lower() in ("http", "https"):
        raise UsageError(
            f"index writes the manifest next to the shards: {args.path} is an HTTP(S) URL, "
            f"which cannot be written; index the directory the server serves, whose "
            f"{MANIFEST_DIR}/ it then serves"
        )
    started = time.perf_counter()
    try:
        shards = storage.index()
    except ShardLockedError as error:
        print(f"error: {error}")
        return 1
    seconds = time.perf_counter() - started
    written = storage.dir / MANIFEST_DIR / MAIN
    if args.json:
        print(json.dumps({"path": str(storage.dir), "shards": shards, "manifest": str(written)}))
    else:
        print(f"indexed {shards} shards of {storage.dir} in {seconds:.2f} s: {written}")
    return 0
