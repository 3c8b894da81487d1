"""Discovery: which shards a dataset directory holds (listing it, or probing ids where the
backend cannot list), with their file sizes and commit records; warns of stale temporaries."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from guideloom_pipes.storage.commit import _is_locked
from guideloom_pipes.storage.errors import StaleWriteWarning
from guideloom_pipes.storage.io import ResolvedBackend, resolve_backend
from guideloom_pipes.storage.names import (
    _NAME,
    IN_BAND,
    INDEX,
    OUT_OF_BAND,
    RECORD,
    TMP,
    _display,
    shard_name,
)
from guideloom_pipes.storage.records import ShardRecord

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


@dataclass
class ShardListing:
    """What discovery found in a dataset directory."""

    directory: PurePath
    num_shards: int
    #: size of each (shard, suffix) file, when the backend could tell without opening it
    sizes: dict[tuple[int, str], int] = field(default_factory=dict)
    records: dict[int, ShardRecord] = field(default_factory=dict)
    listed: bool = True


def _scan_local(directory: PurePath) -> dict[str, int]:
    try:
        with os.scandir(os.fspath(directory)) as entries:
            return {e.name: e.stat().st_size for e in entries if e.is_file()}
    except FileNotFoundError:
        raise FileNotFoundError(
            f"dataset directory {_display(directory)} does not exist; check the path, or "
            f"write the dataset first"
        ) from None
    except NotADirectoryError:
        raise NotADirectoryError(
            f"{_display(directory)} is not a directory; pass the dataset directory"
        ) from None


def _read_whole(backend: ResolvedBackend, path: PurePath) -> bytes:
    reader = backend.reader(path)
    reader.open()
    try:
        return bytes(reader.read(0, reader.filesize()))
    finally:
        reader.close()


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


def _backend_size(backend: ResolvedBackend, path: PurePath) -> int | None:
    reader = backend.reader(path)
    try:
        reader.open()
    except (FileNotFoundError, IsADirectoryError):
        return None
    try:
        return int(reader.filesize())
    finally:
        reader.close()


def discover(backend: Any, directory: PurePath, suffixes: Sequence[str] | str) -> ShardListing:
    """Find the shards of ``directory``, a dataset whose shards consist of ``suffixes`` files.

    Lists the directory when the backend can (local backends, or one with ``list_dir``):
    a gap in the ids is an error naming the missing shard, an empty or missing directory is
    an error, data files of another storage class in a directory without commit records are
    an error, stale temporary files are named in a :class:`StaleWriteWarning`. Otherwise
    probes ids 0, 1, 2, 4, ... for the first suffix's files and bisects the end, as
    GuideLoom does (a gap is then undetectable). ``backend``: a read backend in either
    convention, or a :class:`~guideloom_pipes.storage.io.ResolvedBackend`.
    """
    backend = resolve_backend(backend)
    if isinstance(suffixes, str):
        suffixes = (suffixes,)
    ours = tuple(suffixes)
    if backend.local:
        sizes_by_name: dict[str, int] | None = _scan_local(directory)
    elif backend.list_dir is not None:
        try:
            names = list(backend.list_dir(directory))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"dataset directory {_display(directory)} does not exist; check the path"
            ) from None
        sizes_by_name = dict.fromkeys(names, -1)
    else:
        sizes_by_name = None

    if sizes_by_name is None:
        return _probe(backend, directory, ours[0])

    ids: set[int] = set()
    sizes: dict[tuple[int, str], int] = {}
    record_names: dict[int, str] = {}
    temporaries: dict[int, list[str]] = {}
    foreign: set[str] = set()
    for name, size in sizes_by_name.items():
        match = _NAME.match(name)
        if match is None:
            continue
        shard, suffix, tmp = int(match.group(1)), match.group(2), match.group(3)
        if tmp:
            temporaries.setdefault(shard, []).append(name)
            continue
        if suffix == RECORD:
            record_names[shard] = name
            continue
        if suffix not in ours:
            foreign.add(suffix)
            continue
        sizes[(shard, suffix)] = size
        ids.add(shard)
    if temporaries and backend.local:
        _warn_stale(directory, temporaries)
    ids |= set(record_names)
    where = _display(directory)
    if foreign and not record_names:
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
        found = ", ".join(str(i) for i in ordered[:20]) + (", ..." if len(ids) > 20 else "")
        raise FileNotFoundError(
            f"shard {shard_name(first_missing)} is missing from {where} (found {found}); "
            f"{count - len(ids)} missing in all. Rewrite the missing shard(s), or renumber the "
            f"shards so that ids run 0..N-1"
        )
    if backend.local:
        base = os.fspath(directory)
        records = {}
        for shard, name in record_names.items():
            path = os.path.join(base, name)
            records[shard] = ShardRecord.from_json(_read_local(path), path)
    else:
        records = {
            shard: ShardRecord.from_json(
                _read_whole(backend, directory / name), _display(directory / name)
            )
            for shard, name in record_names.items()
        }
    sizes = {key: value for key, value in sizes.items() if value >= 0}
    return ShardListing(directory, count, sizes, records, listed=True)


def _warn_stale(directory: PurePath, temporaries: dict[int, list[str]]) -> None:
    for shard, names in sorted(temporaries.items()):
        lock = os.fspath(directory / (shard_name(shard) + RECORD + TMP))
        if _is_locked(lock):
            continue  # a live writer is writing this shard right now
        warnings.warn(
            f"stale temporary file(s) {', '.join(sorted(names))} in {_display(directory)}: a "
            f"writer of shard {shard_name(shard)} stopped before committing. Readers ignore "
            f"them and the next writer of that shard replaces them; delete them to silence this",
            StaleWriteWarning,
            stacklevel=4,
        )


def _probe(backend: ResolvedBackend, directory: PurePath, primary: str) -> ShardListing:
    def exists(shard: int) -> bool:
        return _backend_size(backend, directory / (shard_name(shard) + primary)) is not None

    if not exists(0):
        raise FileNotFoundError(
            f"no shard 0000000{primary} in {_display(directory)}; write the dataset first, or "
            f"check the path and the storage class"
        )
    low, high = 0, 1  # exists(low); probe 1, 2, 4, ... for the first id that does not
    while exists(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if exists(middle):
            low = middle
        else:
            high = middle
    records: dict[int, ShardRecord] = {}
    for shard in range(high):
        path = directory / (shard_name(shard) + RECORD)
        if _backend_size(backend, path) is not None:
            records[shard] = ShardRecord.from_json(_read_whole(backend, path), _display(path))
    return ShardListing(directory, high, {}, records, listed=False)
