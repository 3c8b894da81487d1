"""The commit record (the ``.shard.json`` sidecar of each shard): its schema, each file's size
and CRC-32, and the JSON form of the stream dtype it records."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from guideloom_pipes.storage.checksums import BlockChecksums
from guideloom_pipes.storage.errors import CorruptShardError, StorageError
from guideloom_pipes.storage.names import shard_name, versioned_name

#: The newest record format this package reads. Version 2 records name versioned files (a
#: commit whose files are not yet at their canonical names) or mark a removed shard; they are
#: written only then, so that an older reader refuses them rather than misread them. The
#: block checksums of each file (``block_size``, ``block_crc32``: what range reads of a
#: remote object are checked against) are optional fields that raise no version: a reader
#: that predates them reads such records correctly, only without checking ranges.
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


def format_name(format: Any) -> str:
    """How a commit record names the class of ``format``: ``module.QualName``."""
    cls = type(format)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class ExpectedFile:
    """One shard file as its dataset's open found it: size, the CRC-32 its commit record
    gives and the object's ETag (remote stores), each None where unknown; the record's
    block checksums (None in records written before they were kept); what to add to the
    error of a file found changed (an open from a manifest says how to index again)."""

    size: int | None
    crc32: int | None
    etag: str | None
    blocks: BlockChecksums | None = None
    changed_hint: str = ""


@dataclass
class FileRecord:
    """Size and CRC-32 of one committed file, and the CRC-32 of each of its blocks (None
    in records written before they were kept, and in sealed shards of earlier versions)."""

    size: int
    crc32: int
    blocks: BlockChecksums | None = None

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"size": self.size, "crc32": self.crc32}
        if self.blocks is not None:
            entry["block_size"] = self.blocks.block_size
            entry["block_crc32"] = base64.b64encode(self.blocks.crcs).decode("ascii")
        return entry


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
    #: the class of the format the shard was written with (``module.QualName``), so that
    #: ``open_storage`` can rebuild it; None in records of earlier versions and sealed shards
    format: str | None = None
    #: what the shard was made from (``write_parallel``'s item fingerprint), so that a rerun
    #: skips a shard whose input did not change; None for shards written otherwise
    fingerprint: str | None = None

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
            "files": {s: f.to_json() for s, f in self.files.items()},
        }
        if self.payloads is not None:
            data["payloads"] = self.payloads
        if self.versioned:
            data["versioned"] = True
        if self.format is not None:
            data["format"] = self.format
        if self.fingerprint is not None:
            data["fingerprint"] = self.fingerprint
        return json.dumps(data, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> ShardRecord:
        """The record in ``raw`` (the bytes of the file ``where``), its schema checked.

        Unparseable JSON, or a field missing or of the wrong type or range, raises
        :class:`CorruptShardError` naming the file and the field.
        """
        try:
            data = json.loads(raw)
        except ValueError as error:  # JSON syntax, or bytes that are not UTF-8
            raise CorruptShardError(
                f"commit record {where} is unreadable ({type(error).__name__}: {error}); "
                f"rewrite the shard (storage.verify() checks the others)"
            ) from error
        check = _Checker(where)
        if not isinstance(data, dict):
            check.fail("the record", "a JSON object", data)
        version = check.integer(data, "guideloom_pipes_record", minimum=1)
        if version > RECORD_VERSION:
            raise StorageError(
                f"commit record {where} has format version {version}, newer than this "
                f"guideloom_pipes understands ({RECORD_VERSION}); upgrade guideloom_pipes"
            )
        files = check.field(data, "files", dict, "an object of file records")
        file_records = {}
        for suffix, entry in files.items():
            if not isinstance(entry, dict):
                check.fail(f"files.{suffix}", "an object with size and crc32", entry)
            size = check.integer(entry, "size", within=f"files.{suffix}")
            file_records[suffix] = FileRecord(
                size,
                check.integer(entry, "crc32", within=f"files.{suffix}", maximum=0xFFFFFFFF),
                check.blocks(entry, suffix, size),
            )
        descr = data.get("dtype")
        dtype = None
        if descr is not None:
            try:
                dtype = dtype_from_json(descr)
            except (ValueError, TypeError, KeyError, IndexError) as error:
                check.fail("dtype", f"a numpy dtype description ({error})", descr)
        payloads = data.get("payloads")
        state = check.field(data, "state", str, "a string")
        if state not in _STATES:
            check.fail("state", f"one of {', '.join(map(repr, _STATES))}", state)
        versioned = data.get("versioned", False)
        if not isinstance(versioned, bool):
            check.fail("versioned", "true or false", versioned)
        # optional (absent from records of earlier versions): the format class, the input
        optional = {}
        for name in ("format", "fingerprint"):
            if name in data:
                optional[name] = check.field(data, name, str, "a string")
        return cls(
            kind=check.field(data, "kind", str, "a string"),
            shard=check.integer(data, "shard"),
            count=check.integer(data, "count"),
            files=file_records,
            dtype=dtype,
            payloads=None if payloads is None else check.integer(data, "payloads"),
            state=state,
            generation=check.integer(data, "generation") if "generation" in data else 0,
            versioned=versioned,
            **optional,
        )


_STATES = ("committed", "deleted", "pending")


class _Checker:
    """Checks fields of the commit record in file ``where``; a clear error for a bad one."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, name: str, wanted: str, value: Any) -> NoReturn:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        if value is not _MISSING:
            shown += f" ({type(value).__name__})"
        raise CorruptShardError(
            f"commit record {self.where} is corrupt: field {name!r} must be {wanted}, got "
            f"{shown}. Rewrite the shard with a guideloom_pipes writer (storage.verify() "
            f"checks the other shards)"
        )

    def field(
        self, data: dict[str, Any], name: str, kind: type, wanted: str, within: str = ""
    ) -> Any:
        label = f"{within}.{name}" if within else name
        if name not in data:
            self.fail(label, wanted, _MISSING)
        value = data[name]
        if not isinstance(value, kind):
            self.fail(label, wanted, value)
        return value

    def blocks(self, entry: dict[str, Any], suffix: str, size: int) -> BlockChecksums | None:
        """The block checksums of file record ``entry`` of ``size`` bytes; None where the
        record has none (records of earlier versions)."""
        if "block_size" not in entry and "block_crc32" not in entry:
            return None
        block = self.integer(entry, "block_size", within=f"files.{suffix}", minimum=1)
        text = self.field(entry, "block_crc32", str, "base64 text", f"files.{suffix}")
        try:
            crcs = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            self.fail(f"files.{suffix}.block_crc32", "base64 text", text)
        blocks = BlockChecksums(block, crcs)
        if len(crcs) % 4 or not blocks.fits(size):
            self.fail(
                f"files.{suffix}.block_crc32",
                f"{-(-size // block)} CRC-32s of 4 bytes (a {size}-byte file in blocks of "
                f"{block}), {len(crcs)} bytes",
                text,
            )
        return blocks

    def integer(
        self,
        data: dict[str, Any],
        name: str,
        within: str = "",
        minimum: int = 0,
        maximum: int = 2**63 - 1,
    ) -> int:
        """``data[name]``: a JSON integer (not a float, not a bool) in range."""
        label = f"{within}.{name}" if within else name
        wanted = f"an integer from {minimum} to {maximum}"
        if name not in data:
            self.fail(label, wanted, _MISSING)
        value = data[name]
        if type(value) is not int or not minimum <= value <= maximum:
            self.fail(label, wanted, value)
        return value


class _Missing:
    def __repr__(self) -> str:
        return "nothing (the field is missing)"


_MISSING = _Missing()
