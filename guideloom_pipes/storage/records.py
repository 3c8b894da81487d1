"""The commit record (the ``.shard.json`` sidecar of each shard): its schema, each file's size
and CRC-32, and the JSON form of the stream dtype it records."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from guideloom_pipes.storage.errors import CorruptShardError, StorageError
from guideloom_pipes.storage.names import shard_name, versioned_name

#: The newest record format this package reads. Version 2 records name versioned files (a
#: commit whose files are not yet at their canonical names) or mark a removed shard; they are
#: written only then, so that an older reader refuses them rather than misread them.
RECORD_VERSION = 2
#: bytes read at a time to checksum a file
_CHUNK = 16 << 20


def dtype_to_json(dtype: np.dtype[Any]) -> Any:
    """A JSON-able description of ``dtype`` (numpy's ``descr`` form)."""
    return json.loads(json.dumps(np.lib.format.dtype_to_descr(dtype)))


def dtype_from_json(descr: Any) -> np.dtype[Any]:
    """The dtype described by :func:`dtype_to_json`'s output."""
    key = repr(descr)
    found = _DTYPES.get(key)
    if found is None:
        if len(_DTYPES) > 256:
            _DTYPES.clear()
        found = _DTYPES[key] = _dtype_from_json(descr)
    return found


_DTYPES: dict[str, np.dtype[Any]] = {}  # the records of one dataset share their dtype


def _dtype_from_json(descr: Any) -> np.dtype[Any]:
    return np.lib.format.descr_to_dtype(_descr_from_json(descr))


def _descr_from_json(descr: Any) -> Any:
    # JSON turned numpy's tuples into lists: a field is [name, type] or [name, type, shape],
    # a name may be [title, name], and a type is a string or a nested list of fields.
    if not isinstance(descr, list):
        return descr
    fields = []
    for name, sub, *rest in descr:
        fields.append(
            (
                tuple(name) if isinstance(name, list) else name,
                _descr_from_json(sub),
                *(tuple(r) if isinstance(r, list) else r for r in rest),
            )
        )
    return fields


@dataclass
class FileRecord:
    """Size and CRC-32 of one committed file."""

    size: int
    crc32: int


@dataclass
class ShardRecord:
    """The commit record of one shard (the ``.shard.json`` sidecar)."""

    kind: str
    shard: int
    count: int
    files: dict[str, FileRecord]
    dtype: np.dtype[Any] | None = None
    payloads: int | None = None
    #: ``"committed"``; ``"deleted"`` (a shard being removed: read as absent); ``"pending"``
    #: (left by the commit protocol of earlier versions: an interrupted commit)
    state: str = "committed"
    #: the number of commits of this shard id (names its versioned files)
    generation: int = 0
    #: whether the files are still at their versioned names (``0000003.v2.in_band.bin``)
    versioned: bool = False

    def file_name(self, suffix: str) -> str:
        """The name of the shard's ``suffix`` file that this record describes."""
        if self.versioned:
            return versioned_name(self.shard, self.generation, suffix)
        return shard_name(self.shard) + suffix

    def to_json(self) -> bytes:
        newer = self.versioned or self.state == "deleted"
        data: dict[str, Any] = {
            "guideloom_pipes_record": RECORD_VERSION if newer else 1,
            "generation": self.generation,
            "state": self.state,
            "kind": self.kind,
            "shard": self.shard,
            "count": self.count,
            "dtype": None if self.dtype is None else dtype_to_json(self.dtype),
            "files": {s: {"size": f.size, "crc32": f.crc32} for s, f in self.files.items()},
        }
        if self.payloads is not None:
            data["payloads"] = self.payloads
        if self.versioned:
            data["versioned"] = True
        return json.dumps(data, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> ShardRecord:
        try:
            data = json.loads(raw)
            version = int(data["guideloom_pipes_record"])
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptShardError(
                f"commit record {where} is unreadable ({type(error).__name__}: {error}); "
                f"rewrite the shard"
            ) from error
        if version > RECORD_VERSION:
            raise StorageError(
                f"commit record {where} has format version {version}, newer than this "
                f"guideloom_pipes understands ({RECORD_VERSION}); upgrade guideloom_pipes"
            )
        try:
            return cls(
                kind=data["kind"],
                shard=int(data["shard"]),
                count=int(data["count"]),
                files={
                    s: FileRecord(int(f["size"]), int(f["crc32"])) for s, f in data["files"].items()
                },
                dtype=None if data.get("dtype") is None else dtype_from_json(data["dtype"]),
                payloads=data.get("payloads"),
                state=data["state"],
                generation=int(data.get("generation", 0)),
                versioned=bool(data.get("versioned", False)),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptShardError(
                f"commit record {where} is unreadable ({type(error).__name__}: {error}); "
                f"rewrite the shard"
            ) from error
