"""Discovery: which shards a dataset directory holds (listing it, or probing ids where the
backend cannot list), with their file sizes and commit records; warns of stale temporaries."""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import PurePath
from typing import Any

from guideloom_pipes.storage.errors import DatasetChangedError, StaleWriteWarning
from guideloom_pipes.storage.io import ResolvedBackend, resolve_backend
from guideloom_pipes.storage.locks import is_locked
from guideloom_pipes.storage.names import (
    IN_BAND,
    INDEX,
    OUT_OF_BAND,
    PENDING,
    RECORD,
    SHARD_NAME,
    TMP,
    _display,
    shard_name,
)
from guideloom_pipes.storage.probing import _probe
from guideloom_pipes.storage.records import ShardRecord
from guideloom_pipes.storage.shard_listing import ShardListing, _concurrently, _Entry, read_whole

#: The storage class whose shards are exactly these files.
_CLASS_OF_SUFFIXES = {
    frozenset({IN_BAND}): "StreamStorage",
    frozenset({INDEX, OUT_OF_BAND}): "DocumentStorage",
    frozenset({IN_BAND, INDEX, OUT_OF_BAND}): "StreamWithMetaStorage",
}
#: The data-file suffixes GuideLoom writes, and the storage classes that use each.
_DATA_SUFFIXES = {
    IN_BAND: "StreamStorage or StreamWithMetaStorage",
    OUT_OF_BAND: "DocumentStorage or StreamWithMetaStorage",
    INDEX: "DocumentStorage or StreamWithMetaStorage",
}


def _shard_of(name: str) -> int:
    match = SHARD_NAME.match(name)
    return int(match.group("shard")) if match else -1


def _check_strays(
    directory: PurePath, strays: list[os.DirEntry[str]], found: dict[str, _Entry]
) -> None:
    """Refuse an entry with a shard file's name that is not a file (a directory, say) where
    a shard file belongs: its shard has other files or a record, or later shards exist.
    Reading would fail with a bare errno (``mmap failed``). Others are ignored."""
    if not strays:
        return
    last = max(map(_shard_of, found), default=-1)
    for entry in strays:
        shard = _shard_of(entry.name)
        if shard <= last:
            what = "a directory" if entry.is_dir() else "not a regular file"
            error = IsADirectoryError if entry.is_dir() else OSError
            raise error(
                f"{_display(directory / entry.name)} is {what}, but shard {shard_name(shard)}'s "
                f"file of that name belongs there. Move it out of {_display(directory)} and "
                f"put the file back (or rewrite shard {shard})"
            )


def _scan_local(directory: PurePath) -> dict[str, _Entry]:
    try:
        with os.scandir(os.fspath(directory)) as entries:
            found = {}
            strays: list[os.DirEntry[str]] = []  # shard names that are not files
            for entry in entries:
                if SHARD_NAME.match(entry.name) is None:
                    continue  # not ours: no stat
                with contextlib.suppress(FileNotFoundError):  # gone since listed: a temporary
                    if entry.is_file():
                        info = entry.stat()
                        found[entry.name] = (info.st_size, info.st_dev, info.st_ino)
                    else:
                        strays.append(entry)
            _check_strays(directory, strays, found)
            return found
    except FileNotFoundError:
        raise FileNotFoundError(
            f"dataset directory {_display(directory)} does not exist; check the path, or "
            f"write the dataset first"
        ) from None
    except NotADirectoryError:
        raise NotADirectoryError(
            f"{_display(directory)} is not a directory; pass the dataset directory"
        ) from None


def _read_local(path: str) -> bytes:
    """A small local file's bytes (a commit record), with the fewest system calls."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


#: how many times an open lists a directory whose files a writer changes meanwhile
_ATTEMPTS = 8


class _Changed(Exception):
    """The directory changed while it was being listed (a writer committed): list again."""


def _relisted(directory: PurePath) -> dict[str, int]:
    """The inode (as the directory lists it: no ``stat``) of each file a commit changes
    (records, data files, versioned files), not of temporaries (a live writer's ``.tmp``
    files come and go all the time). A commit replaces files by rename, so a file it changed
    has another inode."""
    try:
        listing = os.scandir(os.fspath(directory))
    except (FileNotFoundError, NotADirectoryError):
        _scan_local(directory)  # raises the error that names the path and the fix
        raise
    with listing as entries:
        found = {}
        for entry in entries:
            if SHARD_NAME.match(entry.name) is None or entry.name.endswith((TMP, PENDING)):
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.is_file():  # as _scan_local lists them (d_type: no stat)
                    found[entry.name] = entry.inode()
        return found


def discover(backend: Any, directory: PurePath, suffixes: Sequence[str] | str) -> ShardListing:
    """Find the shards of ``directory``, a dataset whose shards consist of ``suffixes`` files.

    Lists the directory when the backend can (local backends, or one with ``list_dir``):
    a gap in the ids is an error naming the missing shard, an empty or missing directory is
    an error, data files of another storage class in a directory without commit records are
    an error, stale temporary files are named in a :class:`StaleWriteWarning`. Otherwise
    probes ids 0, 1, 2, 4, ... for the first suffix's files and bisects the end, as
    GuideLoom does (a gap is then undetectable). ``backend``: a read backend in either
    convention, or a :class:`~guideloom_pipes.storage.io.ResolvedBackend`.

    A local directory is listed (names and inodes), listed with sizes, its records read,
    and listed again: the listing is used only if nothing a commit changes differs between
    the first and the last (a snapshot of the committed
    version of every shard); else it tries again, a few times over about half a second,
    then raises :class:`DatasetChangedError`.
    """
    backend = resolve_backend(backend)
    if isinstance(suffixes, str):
        suffixes = (suffixes,)
    ours = tuple(suffixes)
    if backend.local:
        return _finish(backend, *_list_local(directory, ours))
    if backend.list_dir is not None:
        return _finish(backend, *_list_remote(backend, backend.list_dir, directory, ours))
    return _probe(backend, directory, ours)


def _list_local(
    directory: PurePath, ours: tuple[str, ...]
) -> tuple[ShardListing, dict[int, list[str]]]:
    """:func:`discover` of a local directory: its listing and stale temporaries, from a
    snapshot that no commit changed (listed again until one did not)."""
    base = os.fspath(directory)

    def read_local(name: str) -> ShardRecord:
        path = os.path.join(base, name)
        try:
            raw = _read_local(path)
        except FileNotFoundError:
            raise _Changed from None
        return ShardRecord.from_json(raw, path)

    for attempt in range(_ATTEMPTS):
        before = _relisted(directory)  # nothing changed from here ...
        entries = _scan_local(directory)
        try:
            found = _assemble(directory, entries, ours, read_local)
        except _Changed:
            found = None
        if found is not None and _relisted(directory) == before:  # ... to here
            return found
        time.sleep(0.002 * 2**attempt)  # back off: a commit takes milliseconds
    raise DatasetChangedError(
        f"the shards of {_display(directory)} changed every time they were listed "
        f"({_ATTEMPTS} times over about half a second): a writer is committing to this "
        f"dataset right now. Open it again once the writer has closed"
    )


def _list_remote(
    backend: ResolvedBackend,
    list_dir: Callable[[PurePath], Iterable[str]],
    directory: PurePath,
    ours: tuple[str, ...],
) -> tuple[ShardListing, dict[int, list[str]]]:
    """:func:`discover` through the backend's ``list_dir`` (with sizes and ETags where it
    gives them); the records read concurrently."""
    # a backend that lists sizes too (FsspecIO's object stores) spares a request per file
    list_sized = getattr(backend.backend, "list_dir_sizes", None)
    list_tagged = getattr(backend.backend, "list_dir_details", None)
    tagged: dict[str, str] = {}
    try:
        if callable(list_tagged):
            details = dict(list_tagged(directory))
            sized = {name: size for name, (size, _) in details.items()}
            tagged = {name: tag for name, (_, tag) in details.items() if tag}
        elif callable(list_sized):
            sized = dict(list_sized(directory))
        else:
            sized = dict.fromkeys(list_dir(directory), -1)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"dataset directory {_display(directory)} does not exist; check the path"
        ) from None

    def read_remote(name: str) -> ShardRecord:
        path = directory / name
        return ShardRecord.from_json(read_whole(backend, path), _display(path))

    entries = {name: (int(size), 0, 0) for name, size in sized.items()}
    record_names = [name for name in entries if _is_record(name)]
    fetched = dict(zip(record_names, _concurrently(backend, read_remote, record_names)))
    listing, temporaries = _assemble(
        directory, entries, ours, lambda name: fetched.get(name) or read_remote(name)
    )
    tags = {}
    for shard in range(listing.num_shards):
        for suffix in ours:
            tag = tagged.get(listing.file_name(shard, suffix))
            if tag:
                tags[(shard, suffix)] = tag
    listing.tags = tags
    return listing, temporaries


def _is_record(name: str) -> bool:
    """Whether ``name`` is a shard's commit record (not a temporary one)."""
    match = SHARD_NAME.match(name)
    return (
        match is not None
        and match.group("suffix") == RECORD
        and not match.group("temporary")
        and match.group("generation") is None
    )


def _assemble(
    directory: PurePath,
    entries: dict[str, _Entry],
    ours: tuple[str, ...],
    read_record: Callable[[str], ShardRecord],
) -> tuple[ShardListing, dict[int, list[str]]]:
    """The listing of ``entries`` (records read with ``read_record``), and the stale
    temporaries by shard (checked and warned about by :func:`_finish`)."""
    ids, record_names, temporaries, versioned, foreign = _sort_names(entries, ours)
    records = {shard: read_record(name) for shard, name in record_names.items()}
    for shard, found_record in list(records.items()):
        if found_record.state == "deleted":  # being removed: absent, whatever files remain
            del records[shard]
            ids.discard(shard)
    ids |= set(records)
    sizes, names, identities = _files_of(ids, records, entries, ours)
    for shard, found in versioned.items():
        owner = records.get(shard)
        named = {owner.file_name(s) for s in ours} if owner is not None else set()
        stale = [name for name in found if name not in named]
        if stale:  # a commit that stopped before its commit point
            temporaries.setdefault(shard, []).extend(stale)
    count = _count_shards(directory, ids, ours, foreign, bool(record_names))
    listing = ShardListing(directory, count, sizes, records, True, names, identities)
    return listing, temporaries


def _sort_names(
    entries: dict[str, _Entry], ours: tuple[str, ...]
) -> tuple[set[int], dict[int, str], dict[int, list[str]], dict[int, list[str]], set[str]]:
    """The shard names among ``entries``, sorted: the ids with a data file of ours, each
    shard's record name, its temporaries, its versioned files, and the data-file suffixes
    that are not ours."""
    ids: set[int] = set()
    record_names: dict[int, str] = {}
    temporaries: dict[int, list[str]] = {}
    versioned: dict[int, list[str]] = {}
    foreign: set[str] = set()
    for name in entries:
        match = SHARD_NAME.match(name)
        if match is None:
            continue
        shard, suffix = int(match.group("shard")), match.group("suffix")
        if match.group("temporary"):
            temporaries.setdefault(shard, []).append(name)
            continue
        if match.group("generation") is not None:
            versioned.setdefault(shard, []).append(name)
            continue
        if suffix == RECORD:
            record_names[shard] = name
            continue
        if suffix not in ours:
            foreign.add(suffix)
            continue
        ids.add(shard)
    return ids, record_names, temporaries, versioned, foreign


def _files_of(
    ids: set[int],
    records: dict[int, ShardRecord],
    entries: dict[str, _Entry],
    ours: tuple[str, ...],
) -> tuple[
    dict[tuple[int, str], int], dict[tuple[int, str], str], dict[tuple[int, str], tuple[int, int]]
]:
    """The size, the file name where it is not the canonical one (a versioned file its
    record names) and the identity of each (shard, suffix) file of the shards ``ids``."""
    sizes: dict[tuple[int, str], int] = {}
    names: dict[tuple[int, str], str] = {}
    identities: dict[tuple[int, str], tuple[int, int]] = {}
    for shard in ids:
        shard_record = records.get(shard)
        for suffix in ours:
            name = (
                shard_record.file_name(suffix)
                if shard_record is not None
                else shard_name(shard) + suffix
            )
            if name != shard_name(shard) + suffix:
                names[(shard, suffix)] = name
            entry = entries.get(name)
            if entry is None:
                continue
            size, device, inode = entry
            if size >= 0:
                sizes[(shard, suffix)] = size
            if inode:
                identities[(shard, suffix)] = (device, inode)
    return sizes, names, identities


def _count_shards(
    directory: PurePath, ids: set[int], ours: tuple[str, ...], foreign: set[str], recorded: bool
) -> int:
    """The number of shards, ``ids`` being all of them: refuses data files of another
    storage class in a dataset without records (``recorded``), no shards, and a gap."""
    where = _display(directory)
    if foreign and not recorded:
        # Without commit records the kind is known only from the file names: GuideLoom's
        # storages never mix these, and reading one as another returns garbage.
        kinds = " and ".join(sorted(f"*{s}" for s in foreign))
        owners = sorted({_DATA_SUFFIXES[s] for s in foreign})
        opener = _CLASS_OF_SUFFIXES.get(frozenset(ours), "this storage class's")
        raise ValueError(
            f"{where} holds {kinds} files, which a {opener} dataset does not have (its "
            f"shards are {' and '.join(ours)} files only): it looks like a "
            f"{' / '.join(owners)} dataset. Open it with the storage class it was written with"
        )
    if not ids:
        raise FileNotFoundError(
            f"no shards in {where} (no {' / '.join(f'*{s}' for s in ours)} files); write the "
            f"dataset first, or check the path and the storage class"
        )
    count = max(ids) + 1
    if len(ids) != count:
        ordered = sorted(ids)  # O(shards found), however large the ids
        first_missing = next(i for i, shard in enumerate(ordered) if shard != i)
        found_ids = ", ".join(str(i) for i in ordered[:20]) + (", ..." if len(ids) > 20 else "")
        raise FileNotFoundError(
            f"shard {shard_name(first_missing)} is missing from {where} (found {found_ids}); "
            f"{count - len(ids)} missing in all. Rewrite the missing shard(s): if a "
            f"write_parallel call or a writer was interrupted, running the same call again "
            f"fills the gap (write_parallel skips the shards already committed); or renumber "
            f"the shards so that ids run 0..N-1"
        )
    return count


def _finish(
    backend: ResolvedBackend, listing: ShardListing, temporaries: dict[int, list[str]]
) -> ShardListing:
    if temporaries and backend.local:
        _warn_stale(listing.directory, temporaries)
    return listing


def _warn_stale(directory: PurePath, temporaries: dict[int, list[str]]) -> None:
    for shard, names in sorted(temporaries.items()):
        lock = os.fspath(directory / (shard_name(shard) + RECORD + TMP))
        if is_locked(lock):
            continue  # a live writer is writing this shard right now
        warnings.warn(
            f"stale temporary file(s) {', '.join(sorted(names))} in {_display(directory)}: a "
            f"writer of shard {shard_name(shard)} stopped before committing. Readers ignore "
            f"them and the next writer of that shard replaces them; delete them to silence this",
            StaleWriteWarning,
            stacklevel=5,
        )
