"""The prefix-sum sidecars of a :class:`~guideloom_pipes.packing.PackedDataset` of documents:
the file format (a JSON header with version, the dataset's fingerprint, the count and the CRC-32
of the sums, then the int64 sums, 64-aligned), its atomic write and its checked read, the
fingerprint of a document storage that keys a sidecar, and the seeded document order's key.
The window plans of best-fit packing (:mod:`guideloom_pipes.packing_plan`) are written and
their headers read with the same helpers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

#: Prefix of the sidecar files (not a shard name: listing and verify ignore them).
SIDECAR_PREFIX = "guideloom-packing"
#: 2: the header holds the CRC-32 of the sums (a sidecar of version 1 is rebuilt once)
_SIDECAR_VERSION = 2
_I64 = npt.NDArray[np.int64]


def _order_key(seed: int) -> int:
    """The Feistel key of the seeded document order."""
    sequence = np.random.SeedSequence(seed, spawn_key=(0x7061636B,))  # "pack"
    return int(sequence.generate_state(1, dtype=np.uint64)[0])


def _document_tokens(document: Any, field: str) -> Any:
    if isinstance(document, Mapping):
        try:
            return document[field]
        except KeyError:
            raise KeyError(
                f"a document has no {field!r} field (it has {sorted(map(str, document))}); "
                f"pass field= the name of its tokens"
            ) from None
    return document


def _fingerprint(document_reader: Any) -> str | None:
    """A digest of a document storage's shards (commit records, else file sizes), or None
    when ``document_reader`` is not one of ours."""
    storage_reader = getattr(document_reader, "storage_reader", None)
    listing = getattr(storage_reader, "listing", None)
    if listing is None:
        return None
    shards = []
    for shard in range(listing.num_shards):
        record = listing.records.get(shard)
        if record is not None:
            files = {name: [f.size, f.crc32] for name, f in sorted(record.files.items())}
            shards.append({"generation": record.generation, "count": record.count, **files})
        else:
            sizes = {
                suffix: listing.sizes.get((shard, suffix))
                for suffix in document_reader.storage_reader.storage.suffixes
            }
            shards.append(
                {
                    "sizes": sizes,
                    "files": [
                        listing.identities.get((shard, s))
                        for s in document_reader.storage_reader.storage.suffixes
                    ],
                }
            )
    text = json.dumps({"documents": len(document_reader), "shards": shards}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class _Damaged(Exception):
    """A sidecar of the right version and fingerprint whose contents are not what was
    written (or contradict its documents): rebuilt, with a warning."""


#: ``(st_dev, st_ino, st_size, st_mtime_ns)`` of sidecars this process has checked whole
#: (checksum and shape): a later open of the same unchanged file maps it without reading it
_CHECKED: set[tuple[int, int, int, int]] = set()


def _read_header(path: Path) -> tuple[dict[str, Any], bytes, os.stat_result] | None:
    """The JSON header of the sidecar at ``path``, its bytes (the data follows them) and the
    file's status; None if there is no such file. Raises :class:`_Damaged` when the header
    does not parse as a JSON object."""
    try:
        with open(path, "rb") as file:
            header = file.readline(4096)
            info = os.fstat(file.fileno())
    except OSError:
        return None
    try:
        meta = json.loads(header)
        if not isinstance(meta, dict):
            raise ValueError("the header is not a JSON object")
    except ValueError as error:
        raise _Damaged(f"its header does not parse ({error})") from None
    return meta, header, info


def _read_sidecar(path: Path, fingerprint: str, documents: int) -> _I64 | None:
    """The prefix sums in ``path`` if it exists and was built from ``fingerprint`` (None:
    no such file, or one of another version or of another state of the dataset, rebuilt
    quietly). Raises :class:`_Damaged` when its fingerprint matches but its contents do not
    hold: a header that does not parse, a size or count other than ``documents + 1``
    values, a CRC-32 other than the one written, a first value other than 0 or a decrease
    (checked once per process for an unchanged file)."""
    found = _read_header(path)
    if found is None:
        return None
    meta, header, info = found
    if meta.get("version") != _SIDECAR_VERSION or meta.get("fingerprint") != fingerprint:
        return None  # another version of the dataset: refused, rebuilt by the caller
    try:
        count, crc = int(meta["count"]), int(meta["crc32"])
    except (KeyError, TypeError, ValueError) as error:
        raise _Damaged(f"its header lacks a valid {error}") from None
    if count != documents + 1:
        raise _Damaged(f"it holds {count} sums for {documents} documents")
    size = info.st_size - len(header)
    if size != 8 * count:
        raise _Damaged(f"it has {size} bytes of sums, not {8 * count}")
    try:
        array = np.memmap(path, dtype="<i8", mode="r", offset=len(header), shape=(count,))
    except (OSError, ValueError):
        return None
    sums = array.view(np.ndarray)
    identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    if identity not in _CHECKED:
        if zlib.crc32(sums.data) != crc:
            raise _Damaged("its sums fail their checksum (the file changed after it was written)")
        if sums[0] != 0:
            raise _Damaged(f"its first sum is {int(sums[0])}, not 0")
        if count > 1 and bool((sums[1:] < sums[:-1]).any()):
            where = int(np.argmax(sums[1:] < sums[:-1]))
            raise _Damaged(f"its sums decrease at document {where}")
        _CHECKED.add(identity)
    return sums


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new temporary file next to ``path``, created as shard files are (mode 0o644 less
    the umask): its descriptor and name."""
    for _ in range(100):
        name = os.path.join(path.parent, f"{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), name
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")


def _write_sidecar(path: Path, fingerprint: str, sums: _I64) -> bool:
    """Write ``sums`` to ``path`` atomically (temporary file, fsync, rename), with the CRC-32
    of their bytes in the header; False if the directory cannot be written."""
    data = np.ascontiguousarray(sums, dtype="<i8").tobytes()
    meta = {
        "version": _SIDECAR_VERSION,
        "fingerprint": fingerprint,
        "count": len(sums),
        "crc32": zlib.crc32(data),
    }
    return _write_atomic(path, meta, [data])


def _write_atomic(path: Path, meta: dict[str, Any], chunks: Sequence[Any]) -> bool:
    """Write a sidecar to ``path`` atomically (temporary file, fsync, rename): ``meta`` as
    its one-line JSON header, padded so that the data starts 64-aligned, then the bytes of
    ``chunks`` (buffers) one after the other; False if the directory cannot be written."""
    text = json.dumps(meta).encode()
    header = text + b" " * (-(len(text) + 1) % 64) + b"\n"  # the data starts 64-aligned
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = _create_temporary(path)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(header)
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        return False
    return True
