"""``guideloom-pipes info DIR``: what a dataset holds (kind, format, dtype, shards, elements,
documents, bytes, each shard's commit state, samples for a sequence length), as text or JSON.
It describes what is there without refusing a damaged dataset (``verify`` judges it)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from guideloom_pipes.cli.dataset import open_dataset, refuse_url, survey
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
    out["leftovers"] = [
        {"shard": shard, "files": names, "live_writer": live}
        for shard, (names, live) in sorted(found.leftovers.items())
    ]
    return out


def run(args: argparse.Namespace) -> int:
    """Print the description; exit status 0."""
    facts = describe(args)
    if args.json:
        print(json.dumps(facts))
        return 0
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
    print("\n".join(lines))
    return 0
