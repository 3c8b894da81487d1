"""``guideloom-pipes info DIR``: what a dataset holds (kind, format, dtype, shards, elements,
documents, bytes, each shard's commit state, samples for a sequence length), as text or JSON.
It describes what is there without refusing a damaged dataset (``verify`` judges it)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from guideloom_pipes.cli import corpus
from guideloom_pipes.cli.dataset import ShardState, open_dataset, refuse_url, survey
from guideloom_pipes.progress import human_bytes
from guideloom_pipes.storage.records import dtype_to_json

_STORAGE = {"stream": "StreamStorage", "stream_meta": "StreamWithMetaStorage"}


def describe(args: argparse.Namespace) -> dict[str, Any]:
    """The facts ``info`` prints, as a JSON-able dict."""
    refuse_url(args.path)
    opened = open_dataset(args.path, args.dtype, args.kind)
    found = survey(opened)
    shards = found.shards
    counts = [s.count for s in shards]
    total = sum(c for c in counts if c is not None) if all(c is not None for c in counts) else None
    out: dict[str, Any] = {
        "path": str(opened.found.directory),
        "kind": opened.kind,
        "storage": _STORAGE.get(opened.kind, "DocumentStorage"),
        "written_by": "guideloom_pipes"
        if opened.found.recorded
        else "GuideLoom (no commit records)",
        "format": opened.format_name,
        "dtype": None if opened.dtype is None else dtype_to_json(opened.dtype),
        "dtype_from": opened.dtype_from or None,
        "shards": len(shards),
        "bytes": sum(s.bytes for s in shards),
    }
    if opened.kind == "document":
        out["documents"] = total
    else:
        out["elements"] = total
        if opened.kind == "stream_meta":
            payloads = [s.payloads for s in shards]
            out["payloads"] = (
                sum(p for p in payloads if p is not None) if None not in payloads else None
            )
        if args.sequence_length is not None:
            out["sequence_length"] = args.sequence_length
            out["samples"] = None if total is None else total // args.sequence_length
    if opened.kind == "document" and args.sequence_length is not None:
        out["samples"] = total  # a document is a sample
    out["states"] = {}
    for shard in shards:
        out["states"][shard.state] = out["states"].get(shard.state, 0) + 1
    out["shard_list"] = [
        {
            "shard": s.shard,
            "state": s.state,
            "count": s.count,
            **({"payloads": s.payloads} if opened.kind == "stream_meta" else {}),
            "bytes": s.bytes,
            **({"fingerprint": s.fingerprint} if s.fingerprint else {}),
        }
        for s in shards
    ]
    out["mixed"] = _mixed(shards)
    out["leftovers"] = [
        {"shard": shard, "files": names, "live_writer": live}
        for shard, (names, live) in sorted(found.leftovers.items())
    ]
    return out


def _mixed(shards: list[ShardState]) -> list[dict[str, Any]]:
    """The groups of committed shards by the kind and dtype their records name, when there
    is more than one (a dataset no format opens whole); else ``[]``."""
    groups: dict[str, dict[str, Any]] = {}
    for shard in shards:
        if shard.kind is None or shard.state not in ("committed", "committing"):
            continue
        dtype = None if shard.dtype is None else dtype_to_json(shard.dtype)
        key = json.dumps([shard.kind, dtype])
        group = groups.setdefault(key, {"kind": shard.kind, "dtype": dtype, "shards": []})
        group["shards"].append(shard.shard)
    return list(groups.values()) if len(groups) > 1 else []


def _ranges(ids: list[int]) -> str:
    """``0000000-0000002, 0000005`` for ``[0, 1, 2, 5]``."""
    parts: list[str] = []
    start = previous = ids[0]
    for shard in [*ids[1:], None]:
        if shard is not None and shard == previous + 1:
            previous = shard
            continue
        parts.append(f"{start:07d}" if start == previous else f"{start:07d}-{previous:07d}")
        if shard is not None:
            start = previous = shard
    return ", ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Print the description; exit status 0, or 1 for a dataset whose shards mix kinds or
    dtypes."""
    found = corpus.corpus_of(args)
    if found is not None:
        facts = corpus.describe(found, args.sequence_length)
        print(json.dumps(facts) if args.json else "\n".join(corpus.info_lines(facts)))
        return 0
    facts = describe(args)
    status = 1 if facts["mixed"] else 0
    if args.json:
        print(json.dumps(facts))
        return status
    unit = "documents" if facts["kind"] == "document" else "elements"
    lines = [
        f"path:      {facts['path']}",
        f"kind:      {facts['kind']} ({facts['storage']}), written by {facts['written_by']}",
        f"format:    {facts['format']}",
    ]
    if facts["kind"] != "document":
        if facts["dtype"] is None:
            lines.append("dtype:     dtype unknown: pass --dtype (e.g. --dtype int32)")
        else:
            lines.append(f"dtype:     {json.dumps(facts['dtype'])} (from {facts['dtype_from']})")
    lines.append(f"shards:    {facts['shards']}")
    count = facts.get("documents", facts.get("elements"))
    lines.append(f"{unit + ':':<10} {'unknown (pass --dtype)' if count is None else count}")
    if "payloads" in facts:
        lines.append(f"payloads:  {facts['payloads']}")
    lines.append(f"bytes:     {facts['bytes']} ({human_bytes(facts['bytes'])})")
    if "samples" in facts:
        shown = "unknown (pass --dtype)" if facts["samples"] is None else facts["samples"]
        length = facts.get("sequence_length")
        lines.append(f"samples:   {shown}" + (f" (sequence length {length})" if length else ""))
    states = ", ".join(f"{n} {state}" for state, n in facts["states"].items())
    lines.append(f"state:     {states or 'no shards'}")
    lines.append("")
    lines.append(f"{'shard':<8} {'state':<12} {unit:>12} {'bytes':>14}")
    for shard in facts["shard_list"]:
        count = "?" if shard["count"] is None else shard["count"]
        lines.append(f"{shard['shard']:07d}  {shard['state']:<12} {count:>12} {shard['bytes']:>14}")
    for left in facts["leftovers"]:
        who = "a live writer is writing it" if left["live_writer"] else "stale: run recover"
        lines.append(f"leftovers of shard {left['shard']:07d}: {', '.join(left['files'])} ({who})")
    if facts["mixed"]:
        lines.append(
            "mixed:     the shards' commit records name different kinds or dtypes, so no "
            "format opens the whole dataset; rewrite the odd ones with the dataset's dtype, "
            "or the whole dataset with mode='overwrite':"
        )
        for group in facts["mixed"]:
            dtype = "" if group["dtype"] is None else f" {json.dumps(group['dtype'])}"
            lines.append(f"  shards {_ranges(group['shards'])}: {group['kind']}{dtype}")
    print("\n".join(lines))
    return status
