"""``guideloom-pipes verify DIR``: every check a reader makes when it opens the dataset, for every
shard (not only up to the first problem), then every file's CRC-32 against its commit record,
with progress on large datasets. Exit status 0 when sound, 1 when not; each problem on its own
line naming the shard and the fix."""

from __future__ import annotations

import argparse
import json
import re
import time
import warnings
from typing import Any

from guideloom_pipes.cli import corpus
from guideloom_pipes.cli.dataset import Opened, ignored_entries, open_dataset
from guideloom_pipes.progress import AUTO_BYTES, Progress, human_bytes
from guideloom_pipes.storage.errors import DatasetChangedError
from guideloom_pipes.storage.listing import discover
from guideloom_pipes.storage.names import IN_BAND, shard_name
from guideloom_pipes.storage.shard_listing import ShardListing
from guideloom_pipes.storage.stream_meta import record_dtype
from guideloom_pipes.storage.verify import check_files, check_listing, recorded_files

#: datasets at least this large show progress (``--progress auto``)
PROGRESS_FROM = AUTO_BYTES
#: ignored entries named in the note (``--json`` lists them all)
_SHOWN = 20
_SHARD = re.compile(r"\bshard (\d{7,})|\b(\d{7,})\.(?:v\d+\.)?(?:in_band|out_of_band|shard)")


def _shard_of(message: str) -> int | None:
    match = _SHARD.search(message)
    if match is None:
        return None
    return int(match.group(1) or match.group(2))


class _Findings:
    def __init__(self) -> None:
        self.problems: list[dict[str, Any]] = []
        self.notes: list[str] = []
        #: entries of the directory that are not shard files of the dataset
        self.ignored: list[str] = []
        #: whether some shards could not be verified (a writer kept recommitting them)
        self.unverified = False

    def problem(self, error: BaseException | str, shard: int | None = None) -> None:
        message = str(error)
        if shard is None:
            shard = _shard_of(message)
        self.problems.append({"shard": shard, "message": message})


#: how many times verify lists the dataset (the first time included) to check the shards a
#: writer recommitted while it read them
ATTEMPTS = 4


def check(opened: Opened, args: argparse.Namespace, findings: _Findings) -> dict[str, Any]:
    """Run every check on ``opened``; problems and notes go to ``findings``. Counts.

    Each file is read as readers read it: the very file the listing saw (by device and
    inode), so that a writer recommitting a shard meanwhile changes nothing. A shard whose
    listed file is gone (recommitted before verify opened it) is checked again in a new
    listing, a few times; one that changes every time is noted as not verified (a writer is
    committing), not reported as a problem."""
    storage = opened.storage
    io = storage._resolve_io()
    counts: dict[str, Any] = {"shards": 0, "files": 0, "bytes": 0, "seconds": 0.0}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            listing = _list(io, storage)
        except DatasetChangedError as error:  # sound or not, nothing could be checked
            findings.unverified = True
            findings.notes.append(f"{error}; nothing was verified, run verify again then")
            return counts
        except (OSError, ValueError) as error:
            # OSError: a missing shard, or a server that refuses a file (PermissionError)
            findings.problem(error)
            return counts
    for warning in seen:
        findings.notes.append(f"{warning.message}; or run guideloom-pipes recover {args.path}")
    counts["shards"] = listing.num_shards
    if io.local:
        findings.ignored = ignored_entries(storage.dir, storage.suffixes)
    if findings.ignored:
        more = len(findings.ignored) - _SHOWN
        shown = ", ".join(findings.ignored[:_SHOWN]) + (f", and {more} more" if more > 0 else "")
        findings.notes.append(
            f"ignored {len(findings.ignored)} entries that are not shard files of this "
            f"dataset (readers ignore them too): {shown}"
        )
    if opened.kind != "document" and opened.dtype is None:
        findings.notes.append(
            "dtype unknown (no commit records): element sizes not checked; pass --dtype"
        )
    if not listing.records:
        findings.notes.append("no commit records: no checksums (written by GuideLoom)")
    changed = _check_pass(opened, listing, None, args, findings, counts)
    for _ in range(ATTEMPTS - 1):
        if not changed:
            break
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # noted from the first listing
                listing = discover(io, storage.dir, storage.suffixes)
        except (FileNotFoundError, ValueError, DatasetChangedError):
            break  # the writer is still at it: noted below
        gone = sorted(s for s in changed if s >= listing.num_shards)
        if gone:
            findings.notes.append(
                f"shard(s) {_names(gone)} were removed by a writer while verify ran"
            )
        changed = _check_pass(opened, listing, sorted(changed - set(gone)), args, findings, counts)
    if changed:
        findings.unverified = True
        findings.notes.append(
            f"shard(s) {_names(sorted(changed))} were recommitted by a writer each time verify "
            f"read them ({ATTEMPTS} listings): a writer is committing to this dataset right "
            f"now, so they are not verified (the rest is); run verify again once it has closed"
        )
    return counts


def _list(io: Any, storage: Any) -> ShardListing:
    """The listing of ``storage``, tried up to ``ATTEMPTS`` times while a writer commits
    (each try lists a few times itself)."""
    for attempt in range(ATTEMPTS):
        try:
            return discover(io, storage.dir, storage.suffixes)
        except DatasetChangedError:
            if attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _names(shards: list[int]) -> str:
    return ", ".join(shard_name(s) for s in shards)


def _check_pass(
    opened: Opened,
    listing: ShardListing,
    shards: list[int] | None,
    args: argparse.Namespace,
    findings: _Findings,
    counts: dict[str, Any],
) -> set[int]:
    """The checks of ``shards`` (None: all) in ``listing``; their problems go to
    ``findings``, except those of shards a writer recommitted meanwhile: those are
    returned, to be checked again."""
    storage = opened.storage
    io = storage._resolve_io()
    found = _Findings()
    changed: set[int] = set()
    errors: list[Exception] = []
    sizes = check_listing(
        listing,
        io,
        storage.kind,
        storage.suffixes,
        opened.dtype,
        lambda d: f"--dtype '{json.dumps(d.descr)}' (the dtype it was written with)",
        problems=errors,
    )
    for error in errors:
        found.problem(error)
    wanted = set(range(listing.num_shards)) if shards is None else set(shards)
    found.problems = [p for p in found.problems if p["shard"] is None or p["shard"] in wanted]
    bad = {p["shard"] for p in found.problems}
    if opened.kind == "document" or opened.dtype is not None:
        _check_contents(opened, listing, sizes, bad, found, sorted(wanted), changed)
    recorded = [s for s in sorted(wanted) if s in listing.records and s not in bad]
    _checksums(opened, listing, recorded, args, found, counts, changed)
    findings.problems.extend(
        p
        for p in found.problems
        if p["shard"] not in changed and (p["shard"] is None or p["shard"] in wanted)
    )
    return changed


def _check_contents(
    opened: Opened,
    listing: ShardListing,
    sizes: list[dict[str, int]],
    bad: set[int | None],
    findings: _Findings,
    shards: list[int],
    changed: set[int],
) -> None:
    """What the reader checks as it sets up and first reads: element sizes, indexes (of
    ``shards``; those whose files a writer replaced meanwhile go to ``changed``)."""
    storage = opened.storage
    if opened.dtype is not None:
        element = opened.dtype if opened.kind == "stream" else record_dtype(opened.dtype)
        guess = (
            " (is --dtype the one it was written with?)" if opened.dtype_from == "--dtype" else ""
        )
        for shard, found in enumerate(sizes):
            size = found.get(IN_BAND)
            if shard not in bad and size is not None and size % element.itemsize:
                findings.problem(
                    f"shard {shard_name(shard)}: {shard_name(shard)}{IN_BAND} is {size} bytes, "
                    f"not a multiple of the {element.itemsize}-byte element of {element}: it is "
                    f"truncated or was written with another dtype{guess}. Rewrite shard {shard}",
                    shard,
                )
                bad.add(shard)
    if bad:
        return  # the reader cannot be set up over shards in error
    reader = storage.sync_reader()
    try:
        reader._attach(listing, sizes)
        index = getattr(reader, "_index", None) or getattr(reader, "_payloads", None)
        if index is not None:
            for shard in shards:
                try:
                    index._check(shard)
                except DatasetChangedError:
                    changed.add(shard)  # the reader's own check: not the version listed
                except (OSError, ValueError) as error:
                    findings.problem(error, shard)
    except (OSError, ValueError) as error:
        findings.problem(error)
    finally:
        reader.close()


def _checksums(
    opened: Opened,
    listing: ShardListing,
    recorded: list[int],
    args: argparse.Namespace,
    findings: _Findings,
    counts: dict[str, Any],
    changed: set[int],
) -> None:
    storage = opened.storage
    files = recorded_files(listing, storage.suffixes, recorded)
    total = sum(expected.size for _, _, expected in files)
    show = args.progress == "always" or (args.progress == "auto" and total >= PROGRESS_FROM)
    started = time.perf_counter()
    with Progress("verifying", total, "B", enabled=show and not args.json) as progress:
        io = storage._resolve_io()
        for check in check_files(listing, io, files, progress.update, errors="collect"):
            shard = check.shard
            if check.changed:
                changed.add(shard)
                continue
            if check.error is not None:
                findings.problem(
                    f"shard {shard_name(shard)}: {check.error}; rewrite shard {shard}", shard
                )
                continue
            counts["files"] += 1
            counts["bytes"] += check.size
            if not check.matches:
                findings.problem(
                    f"shard {shard_name(shard)}: {check.name} fails its checksum (crc32 "
                    f"{check.crc32:#010x} over {check.size} bytes, committed "
                    f"{check.expected.crc32:#010x} over {check.expected.size} bytes): it "
                    f"changed after it was committed. Restore it or rewrite shard {shard}",
                    shard,
                )
    counts["seconds"] += time.perf_counter() - started


def run(args: argparse.Namespace) -> int:
    """Check the dataset; 0 when sound, 1 when not (or, with ``--strict``, unverifiable)."""
    found = corpus.corpus_of(args)
    if found is not None:
        return _verify_corpus(found, args)
    opened = open_dataset(args.path, args.dtype, args.kind)
    findings = _Findings()
    counts = check(opened, args, findings)
    unverified = not opened.found.recorded or findings.unverified
    status = 1 if findings.problems or (args.strict and unverified) else 0
    seconds = counts["seconds"]
    rate = counts["bytes"] / seconds / 1e9 if seconds > 0 else None
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(opened.found.directory),
                    "kind": opened.kind,
                    "sound": not findings.problems,
                    "checksummed": not unverified,
                    "problems": findings.problems,
                    "notes": findings.notes,
                    "ignored": findings.ignored,
                    "shards": counts["shards"],
                    "files": counts["files"],
                    "bytes": counts["bytes"],
                    "seconds": seconds,
                    "gb_per_s": rate,
                    "exit_status": status,
                }
            )
        )
        return status
    for note in findings.notes:
        print(f"note: {note}")
    for problem in findings.problems:
        print(f"problem: {problem['message']}")
    speed = f" ({rate:.2f} GB/s)" if rate else ""
    summary = (
        f"{counts['shards']} shards, {counts['files']} files, {human_bytes(counts['bytes'])} "
        f"checksummed in {seconds:.2f} s{speed}"
    )
    if findings.problems:
        print(f"NOT SOUND: {len(findings.problems)} problem(s) in {args.path}; {summary}")
    elif unverified:
        strict = " (--strict: exit status 1)" if args.strict else ""
        what = (
            "not every shard could be verified (see the notes)"
            if findings.unverified
            else "no checksums to verify"
        )
        print(f"no problems found, but {what}{strict}: {summary}")
    else:
        print(f"sound: {summary}")
    return status


def _verify_corpus(found: Any, args: argparse.Namespace) -> int:
    """``verify`` of a corpus another tool wrote: its files' checks, then every token once
    (a corpus has no checksums: ``--strict`` makes that exit status 1)."""
    result = corpus.verify(found)
    status = 0 if result["sound"] and not args.strict else 1
    if args.json:
        print(
            json.dumps(
                {
                    "path": args.path,
                    "kind": "stream" if result.get("tokens", 0) is not None else "document",
                    "checksummed": False,
                    **result,
                    "exit_status": status,
                }
            )
        )
        return status
    if not result["sound"]:
        print(f"problem: {result['problem']}")
        print(f"NOT SOUND: 1 problem(s) in {args.path}")
        return status
    strict = " (--strict: exit status 1)" if args.strict else ""
    read = (
        f"{result['documents']} text documents"
        if result["tokens"] is None
        else f"{result['tokens']} tokens"
    )
    print(
        f"no problems found, but a {type(found).__name__} has no checksums to verify{strict}: "
        f"{result['shards']} files, {read} ({human_bytes(result['bytes'])}) "
        f"read in {result['seconds']:.2f} s"
    )
    return status
