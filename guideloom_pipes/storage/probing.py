"""Discovery where the backend cannot list (HTTP): probing ids 0, 1, 2, 4, ... for the
first suffix's files and bisecting the end, as GuideLoom does, then the records and
sizes of the shards found.
"""

from __future__ import annotations

from pathlib import PurePath

from guideloom_pipes.storage.io import ResolvedBackend
from guideloom_pipes.storage.names import RECORD, _display, shard_name
from guideloom_pipes.storage.records import ShardRecord
from guideloom_pipes.storage.shard_listing import (
    ShardListing,
    _backend_info,
    _concurrently,
    backend_size,
    read_whole,
)


def _probe(backend: ResolvedBackend, directory: PurePath, ours: tuple[str, ...]) -> ShardListing:
    primary = ours[0]

    def exists(shard: int) -> bool:
        return backend_size(backend, directory / (shard_name(shard) + primary)) is not None

    high = 0  # the first id without a data file
    if exists(0):
        low, high = 0, 1  # exists(low); probe 1, 2, 4, ... for the first id that does not
        while exists(high):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            if exists(middle):
                low = middle
            else:
                high = middle

    def record_of(shard: int) -> ShardRecord | None:
        path = directory / (shard_name(shard) + RECORD)
        if backend_size(backend, path) is None:
            return None
        return ShardRecord.from_json(read_whole(backend, path), _display(path))

    records: dict[int, ShardRecord] = {}
    names: dict[tuple[int, str], str] = {}

    def add(shard: int, record: ShardRecord | None) -> None:
        if record is None:
            return
        records[shard] = record
        if record.versioned:
            for suffix in record.files:
                names[(shard, "." + suffix)] = record.file_name("." + suffix)

    for shard, record in enumerate(_concurrently(backend, record_of, range(high))):
        add(shard, record)
    sizes: dict[tuple[int, str], int] = {}
    tags: dict[tuple[int, str], str] = {}
    if getattr(backend.backend, "open_concurrency", 1) > 1:  # else check_listing asks
        files = [(shard, suffix) for shard in range(high) for suffix in ours]

        def info_of(file: tuple[int, str]) -> tuple[int, str | None] | None:
            shard, suffix = file
            name = names.get(file) or shard_name(shard) + suffix
            return _backend_info(backend, directory / name)

        for file, info in zip(files, _concurrently(backend, info_of, files)):
            if info is not None:
                sizes[file] = info[0]
                if info[1]:
                    tags[file] = info[1]
    # A committed shard whose data file is missing (deleted, or refused as 404) ends the
    # probe early: its record is still there, so the shard counts, and the check of the
    # listing fails naming its missing file instead of the dataset ending before it. (Asked
    # last: the first requests of an open stay those of GuideLoom's probe.)
    tail = record_of(high)
    if tail is None and high == 0:
        raise FileNotFoundError(
            f"no shard 0000000{primary} in {_display(directory)}; write the dataset first, or "
            f"check the path and the storage class"
        )
    if tail is not None:
        add(high, tail)
        high += 1
    return ShardListing(directory, high, sizes, records, listed=False, names=names, tags=tags)
