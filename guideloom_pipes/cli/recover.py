"""``guideloom-pipes recover DIR``: finish or remove what writers that stopped left behind
(commits past their commit point rolled forward, interrupted removals finished, temporary
files and stale locks deleted), only for shards whose write lock no live writer holds; never
touches committed data. ``--dry-run`` says what it would do."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from guideloom_pipes.cli.dataset import UsageError, is_shard_file
from guideloom_pipes.opening import local_path
from guideloom_pipes.storage.locks import is_locked
from guideloom_pipes.storage.names import RECORD, TMP, shard_name
from guideloom_pipes.storage.recovery import recover_directory, recovery_plan


def plan(directory: Path) -> dict[str, list[int]]:
    """What :func:`recover_directory` would do, without doing it (``"held"``: shards a live
    writer holds, left alone)."""
    suspects = recovery_plan(os.fspath(directory))
    result: dict[str, list[int]] = {"rolled_forward": [], "removed": [], "cleaned": [], "held": []}
    for shard, what in sorted(suspects.items()):
        lock = os.fspath(directory / (shard_name(shard) + RECORD + TMP))
        result["held" if is_locked(lock) else what].append(shard)
    return result


#: what each outcome says: (done, dry run)
_SAYS = {
    "rolled_forward": (
        "commit rolled forward to the canonical file names",
        "would roll its commit forward to the canonical file names",
    ),
    "removed": ("interrupted removal finished", "would finish its interrupted removal"),
    "cleaned": (
        "temporary files and stale lock removed",
        "would remove its temporary files and stale lock",
    ),
    "held": ("a live writer holds it: left alone", "a live writer holds it: would be left alone"),
}


def run(args: argparse.Namespace) -> int:
    """Recover (or, with ``--dry-run``, plan); exit status 0 (2 for a URL, or a directory
    with no shard files at all)."""
    try:
        directory = local_path(args.path)
    except ValueError:  # a URL: recover changes files, of a local directory only
        raise UsageError(
            f"recover cleans up a local directory, {args.path} is a URL (read through fsspec "
            f"only, never written); pass the dataset directory"
        ) from None
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise UsageError(f"{directory} {what}; pass the dataset directory")
    with os.scandir(directory) as entries:
        if not any(is_shard_file(entry.name) for entry in entries):
            raise UsageError(
                f"{directory} is not a dataset: it holds no shard files, committed or left by "
                f"a writer (0000000.in_band.bin, 0000000.shard.json, ...); check the path"
            )
    planned = plan(directory)
    if args.dry_run:
        result = planned
    else:
        result = {**recover_directory(os.fspath(directory)), "held": planned["held"]}
    if args.json:
        print(json.dumps({"path": str(directory), "dry_run": args.dry_run, **result}))
        return 0
    lines = [
        f"shard {shard:07d}: {_SAYS[what][args.dry_run]}"
        for what, shards in result.items()
        for shard in shards
    ]
    print("\n".join(lines) if lines else f"nothing to recover in {directory}")
    return 0
