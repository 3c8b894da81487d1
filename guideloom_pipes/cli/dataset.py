"""How the CLI opens a dataset: the kind and dtype from the commit records (or ``--kind`` /
``--dtype`` for GuideLoom-written data), a storage whose format decodes every field without
the user's own format class, and a listing of each shard's state that never refuses."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from guideloom_pipes.formats import DocumentPickleFormat, StreamNumpyFormat
from guideloom_pipes.opening import (
    DOCUMENT_PICKLE,
    KIND_SUFFIXES,
    STORAGE_CLASSES,
    Detected,
    detect,
    is_pickled,
)
from guideloom_pipes.storage.errors import StorageError
from guideloom_pipes.storage.locks import is_locked
from guideloom_pipes.storage.manifest import MANIFEST_DIR
from guideloom_pipes.storage.names import (
    CREATE_LOCK,
    IN_BAND,
    INDEX,
    RECORD,
    SHARD_NAME,
    TMP,
    shard_name,
)
from guideloom_pipes.storage.records import ShardRecord
from guideloom_pipes.storage.remote_paths import RemotePath, file_url_path, is_url
from guideloom_pipes.storage.stream_meta import record_dtype

KINDS = tuple(KIND_SUFFIXES)


class UsageError(Exception):
    """Bad usage, or a path that is missing or not a dataset: exit status 2."""


def is_shard_file(name: str) -> bool:
    """Whether ``name`` is the name of a shard file (a data file, a commit record, a
    versioned file of a commit, or a writer's temporary)."""
    return SHARD_NAME.match(name) is not None


def ignored_entries(directory: Path, suffixes: Sequence[str]) -> list[str]:
    """The entries of a local dataset directory that readers and ``verify`` pass over
    (sorted; a directory with a trailing ``/``): names that are not shard files (``notes.txt``,
    ``.DS_Store``), shard names that are not regular files, and shard files of another kind
    than ``suffixes``. Packing sidecars, the manifest's folder and a create run's lock file
    (ours) are not listed."""
    from guideloom_pipes.packing import SIDECAR_PREFIX  # only here: verify of a directory

    ignored = []
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith("." + SIDECAR_PREFIX) or name in (CREATE_LOCK, MANIFEST_DIR):
                continue
            match = SHARD_NAME.match(name)
            try:
                regular = entry.is_file(follow_symlinks=True)
                folder = not regular and entry.is_dir()
            except OSError:  # gone since listed
                continue
            if match is not None and regular:
                suffix = match.group("suffix")
                if suffix == RECORD or suffix in suffixes:
                    continue
            ignored.append(name + ("/" if folder else ""))
    return sorted(ignored)


def parse_dtype(text: str) -> np.dtype[Any]:
    """``--dtype``: ``int32`` or ``<u2`` (one field, ``tokens``), ``tokens:<i4,mask:u1``
    (named fields), or a JSON field list ``[["tokens", "<i4"]]``."""
    text = text.strip()
    try:
        if text.startswith("["):
            import json

            from guideloom_pipes.storage.records import dtype_from_json

            return dtype_from_json(json.loads(text))
        if ":" in text:
            fields = []
            for part in text.split(","):
                name, _, kind = part.partition(":")
                if not re.fullmatch(r"\w+", name.strip()):
                    raise ValueError(f"bad field name {name!r}")
                fields.append((name.strip(), np.dtype(kind.strip())))
            return np.dtype(fields)
        return np.dtype(text)
    except (TypeError, ValueError) as error:
        raise UsageError(
            f"--dtype {text!r} is not a dtype ({error}); pass e.g. --dtype int32 or "
            f"--dtype tokens:int32,loss_mask:uint8"
        ) from None


def _structured(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return dtype if dtype.names else np.dtype([("tokens", dtype)])


class RawStreamFormat:
    """Decodes stream windows of any dtype into ``{field: array}`` (``tokens`` for a plain
    dtype); the CLI's stand-in for a user's stream format. It cannot write."""

    def __init__(self, stream_dtype: np.dtype[Any]) -> None:
        self.stream_dtype = stream_dtype

    def pack(self, data: Any) -> Any:
        raise TypeError("the CLI's stand-in format only reads")

    def unpack(self, stream: np.ndarray, shard_lengths: Any, shards: Any) -> dict[str, Any]:
        if stream.dtype.names:
            return {name: np.array(stream[name]) for name in stream.dtype.names}
        return {"tokens": np.array(stream)}


class RawMetaFormat(RawStreamFormat):
    """Decodes stream-with-metadata windows into their fields, the payload each element
    points to, and the payloads' bytes; the CLI's stand-in for a user's format."""

    def size(self, data: Any) -> int:
        raise TypeError("the CLI's stand-in format only reads")

    def unpack(  # type: ignore[override]
        self,
        stream_data: np.ndarray,
        document_shard: np.ndarray,
        document_index: np.ndarray,
        document_data: Sequence[memoryview],
    ) -> dict[str, Any]:
        out = super().unpack(stream_data, None, None)
        out["payload"] = np.array(document_index)
        out["payloads"] = [bytes(payload) for payload in document_data]
        return out


class RawDocumentFormat:
    """Documents as their stored bytes (a format that is not pickle)."""

    def pack(self, data: Any) -> bytes:
        raise TypeError("the CLI's stand-in format only reads")

    def unpack(self, encoded_data: Any, shard: int) -> bytes:
        return bytes(encoded_data)


@dataclass
class Opened:
    """A dataset as the CLI sees it."""

    found: Detected
    kind: str
    #: the stream dtype (None: documents, or unknown)
    dtype: np.dtype[Any] | None
    #: where the dtype came from: "records", "--dtype" or "" (unknown)
    dtype_from: str
    storage: Any
    format_name: str


def open_dataset(path: str, dtype: str | None, kind: str | None) -> Opened:
    """The dataset at ``path`` with the CLI's formats (``--dtype``/``--kind`` applied).
    The options are checked before anything is read (a URL's server is not asked, nor
    retried, for a command that cannot run)."""
    given = parse_dtype(dtype) if dtype is not None else None
    try:
        found = detect(path)
    except (FileNotFoundError, NotADirectoryError) as error:
        raise UsageError(str(error)) from None
    except ValueError as error:
        if is_url(path):  # an unknown protocol, or files of no one kind: --kind cannot help
            raise UsageError(str(error)) from None
        if kind is None:
            raise UsageError(f"{error} with --kind") from None
        found = Detected(Path(path), kind, False)
    if kind is not None and kind != found.kind:
        if found.recorded:
            raise UsageError(
                f"{path} holds {found.kind} data (its commit records say so), not {kind}; "
                f"drop --kind or pass --kind {found.kind}"
            )
        found = Detected(found.directory, kind, False, None, None, found.suffixes)
    stream_dtype = found.dtype
    source = "records" if stream_dtype is not None else ""
    if given is not None and found.kind != "document":
        if stream_dtype is None or found.format not in (None, _STREAM_NUMPY_NAME):
            stream_dtype = given
        else:  # a StreamNumpyFormat dataset: field names default as --dtype int32 does
            stream_dtype = _structured(given)
        source = "--dtype"
    if found.kind == "document":
        if found.format == DOCUMENT_PICKLE or (
            found.format is None and is_pickled(found.directory)
        ):
            fmt: Any = DocumentPickleFormat()
            name = "DocumentPickleFormat"
        else:
            fmt = RawDocumentFormat()
            name = found.format or "raw bytes (not pickled)"
        return Opened(
            found, found.kind, None, "", STORAGE_CLASSES["document"](_location(found), fmt), name
        )
    known = stream_dtype is not None
    element = stream_dtype if stream_dtype is not None else np.dtype("u1")
    if found.kind == "stream_meta":
        fmt = RawMetaFormat(element)
    elif element.names and found.format in (None, _STREAM_NUMPY_NAME):
        fmt = StreamNumpyFormat(element)
    else:
        fmt = RawStreamFormat(element)
    name = found.format or ("unknown" if not known else type(fmt).__name__)
    storage = STORAGE_CLASSES[found.kind](_location(found), fmt)
    return Opened(found, found.kind, stream_dtype, source, storage, name.rpartition(".")[2])


_STREAM_NUMPY_NAME = "guideloom_pipes.formats.StreamNumpyFormat"


def _location(found: Detected) -> Any:
    """Where the storage of ``found`` is: its directory, or its URL (a ``RemotePath``'s
    ``str``: read through fsspec)."""
    return str(found.directory) if isinstance(found.directory, RemotePath) else found.directory


@dataclass
class ShardState:
    """One shard as the directory shows it (never refuses: for ``info``)."""

    shard: int
    #: committed, unrecorded (GuideLoom's), uncommitted, pending, deleted, missing,
    #: committing (a commit past its commit point, not yet at the canonical names)
    state: str
    count: int | None = None
    payloads: int | None = None
    bytes: int = 0
    files: dict[str, int] = field(default_factory=dict)
    fingerprint: str | None = None
    #: the kind and stream dtype its commit record names (None: no readable record)
    kind: str | None = None
    dtype: np.dtype[Any] | None = None


@dataclass
class Survey:
    """Every shard of a directory and the leftovers of writers."""

    shards: list[ShardState]
    #: shard -> names of temporaries or unreferenced versioned files, and whether a live
    #: writer holds that shard's lock
    leftovers: dict[int, tuple[list[str], bool]]


def refuse_url(path: str) -> None:
    """A :class:`UsageError` for a URL given to ``info`` (before anything is read: a URL's
    server is not asked, nor retried)."""
    if is_url(path) and file_url_path(path) is None:
        raise UsageError(
            f"info surveys the files of a local directory, {path} is a URL: run "
            f"verify or head on it (they read a URL), or info on a local copy"
        )


def survey(opened: Opened) -> Survey:
    """Each shard's state, counts and sizes from the file names, sizes and records (of a
    local directory: a URL is a :class:`UsageError` naming the commands that read one)."""
    directory = opened.found.directory
    if isinstance(directory, RemotePath):
        refuse_url(str(directory))
    suffixes = KIND_SUFFIXES[opened.kind]
    sizes: dict[str, int] = {}
    records: dict[int, ShardRecord | None] = {}
    present: set[int] = set()
    leftovers: dict[int, list[str]] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            match = SHARD_NAME.match(entry.name)
            if match is None or not entry.is_file():
                continue
            shard = int(match.group("shard"))
            if match.group("temporary") or match.group("generation") is not None:
                leftovers.setdefault(shard, []).append(entry.name)
                continue
            if match.group("suffix") == RECORD:
                try:
                    records[shard] = ShardRecord.from_json(
                        Path(entry.path).read_bytes(), entry.path
                    )
                except (OSError, StorageError):
                    records[shard] = None
                present.add(shard)
                continue
            sizes[entry.name] = entry.stat().st_size
            present.add(shard)
    have_records = bool(records)
    states = []
    element = opened.dtype
    if element is not None and opened.kind == "stream_meta":
        element = record_dtype(element)
    for shard in range(max(present, default=-1) + 1):
        if shard not in present:
            states.append(ShardState(shard, "missing"))
            continue
        record = records.get(shard)
        files = {}
        for suffix in suffixes:
            name = record.file_name(suffix) if record is not None else shard_name(shard) + suffix
            if name in sizes:
                files[name] = sizes[name]
        state = ShardState(shard, "unrecorded", files=files, bytes=sum(files.values()))
        if shard in records and record is None:
            state.state = "corrupt record"
        elif record is not None:
            state.state = record.state
            if record.state == "committed" and record.versioned:
                state.state = "committing"
            state.count, state.payloads = record.count, record.payloads
            state.fingerprint = record.fingerprint
            state.kind, state.dtype = record.kind, record.dtype
        elif have_records:
            state.state = "uncommitted"
        if record is None:
            in_band = files.get(shard_name(shard) + IN_BAND)
            index = files.get(shard_name(shard) + INDEX)
            if opened.kind == "document" and index is not None:
                state.count = max(index // 8 - 1, 0)
            elif in_band is not None and element is not None:
                state.count = in_band // element.itemsize
            if opened.kind == "stream_meta" and index is not None:
                state.payloads = max(index // 8 - 1, 0)
        if state.state != "deleted":
            states.append(state)
    while states and states[-1].state in ("deleted", "missing"):
        states.pop()
    held = {
        shard: (
            sorted(names),
            is_locked(os.fspath(directory / (shard_name(shard) + RECORD + TMP))),
        )
        for shard, names in leftovers.items()
    }
    return Survey(states, held)
