"""What is committed already, for :func:`~guideloom_pipes.parallel.write_parallel`: the
fingerprint of an item, whether its shard is committed from it unchanged (a run skips it), the
shards present, and what the workers of a broken pool committed."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import pickle
import stat
from collections.abc import Callable
from typing import Any

from guideloom_pipes.parallel.report import WriteReport
from guideloom_pipes.storage.base import StorageBase
from guideloom_pipes.storage.errors import StorageError
from guideloom_pipes.storage.names import RECORD, shard_ids, shard_name
from guideloom_pipes.storage.records import ShardRecord, format_name
from guideloom_pipes.storage.remote_paths import RemotePath
from guideloom_pipes.storage.upload import RemoteUpload

__all__ = ["item_fingerprint"]


def item_fingerprint(item: Any) -> bytes:
    """What identifies an item's input: for a path to a file, its absolute path, size and
    modification time (so an edited file is rewritten); for anything else, its pickle."""
    if isinstance(item, (str, os.PathLike)):
        path = os.fspath(item)
        try:
            info = os.stat(path)
        except (OSError, ValueError):
            info = None
        if info is not None and stat.S_ISREG(info.st_mode):
            return f"file\0{os.path.abspath(path)}\0{info.st_size}\0{info.st_mtime_ns}".encode()
    return b"pickle\0" + pickle.dumps(item, protocol=4)


def _fingerprint(
    item: Any,
    convert_bytes: bytes,
    storage: StorageBase,
    fingerprint: Callable[[Any], str | bytes] | None,
) -> str:
    own = fingerprint(item) if fingerprint is not None else item_fingerprint(item)
    if isinstance(own, str):
        own = own.encode()
    digest = hashlib.blake2b(digest_size=16)
    try:  # the format's class and settings (a StreamNumpyFormat's dtype)
        format_bytes = pickle.dumps(storage.format, protocol=4)
    except Exception:
        format_bytes = format_name(storage.format).encode()
    for part in (own, convert_bytes, format_bytes, storage.kind.encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return "blake2b:" + digest.hexdigest()


def _remote(storage: StorageBase) -> RemoteUpload | None:
    """What reads and removes the shards of a storage at a URL; None for a local one."""
    if not isinstance(storage.dir, RemotePath):
        return None
    return RemoteUpload(storage.read_interface, str(storage.dir), "update", storage.kind)


def _unchanged(
    storage: StorageBase,
    shard: int,
    fp: str,
    remote: RemoteUpload | None = None,
    remote_sizes: dict[str, int] | None = None,
) -> bool:
    """Whether shard ``shard`` is committed from the item of fingerprint ``fp`` with its
    files at their recorded sizes (at a URL: ``remote``, with its objects' sizes from one
    listing, ``remote_sizes``)."""
    if remote is not None:
        found = remote.record(shard)
        if found is None:
            return False
        record = found
        sizes = remote_sizes or {}

        def size_of(name: str) -> int | None:
            return sizes.get(name)
    else:
        directory = os.fspath(storage.dir)
        stem = os.path.join(directory, shard_name(shard))
        try:
            with open(stem + RECORD, "rb") as file:
                record = ShardRecord.from_json(file.read(), stem + RECORD)
        except (OSError, StorageError):
            return False

        def size_of(name: str) -> int | None:
            try:
                return os.stat(os.path.join(directory, name)).st_size
            except OSError:
                return None

    if record.state != "committed" or record.fingerprint != fp or record.kind != storage.kind:
        return False
    for suffix in storage.suffixes:
        expected = record.files.get(suffix.lstrip("."))
        if expected is None or expected.size != size_of(record.file_name(suffix)):
            return False
    return True


def _settle_broken(
    storage: StorageBase,
    remote: RemoteUpload | None,
    prints: list[str],
    failures: list[tuple[int, Any, BaseException]],
    report: WriteReport,
) -> None:
    """A broken pool fails every item it held, also those whose worker committed the shard
    before the pool broke, or as it stopped: count those as written. (A user's pool may
    still be stopping its workers: a rerun skips what they commit.)"""
    lost = [shard for shard, _, error in failures if isinstance(error, cf.BrokenExecutor)]
    if not lost:
        return
    sizes = remote.object_sizes() if remote is not None else None
    done = {shard for shard in lost if _unchanged(storage, shard, prints[shard], remote, sizes)}
    if done:
        failures[:] = [failure for failure in failures if failure[0] not in done]
        report.failed = [shard for shard in report.failed if shard not in done]
        report.written.extend(done)
    for shard in done:  # their bytes (how many records convert yielded is unknown here)
        record = _record_of(storage, shard, remote)
        if record is not None:
            report.bytes += sum(f.size for f in record.files.values())


def _record_of(storage: StorageBase, shard: int, remote: RemoteUpload | None) -> ShardRecord | None:
    if remote is not None:
        return remote.record(shard)
    stem = os.path.join(os.fspath(storage.dir), shard_name(shard))
    try:
        with open(stem + RECORD, "rb") as file:
            return ShardRecord.from_json(file.read(), stem + RECORD)
    except (OSError, StorageError):
        return None


def _shards_present(storage: StorageBase, remote: RemoteUpload | None) -> set[int]:
    if remote is not None:
        return remote.shards_present()
    try:
        return shard_ids(os.listdir(os.fspath(storage.dir)))
    except FileNotFoundError:
        return set()
