"""Files written by guideloom_pipes read back unchanged by the real GuideLoom 1.1.

Run with a Python that has ``guideloom==1.1.0`` and numpy installed (``tox -e compat``)::

    python3.13 tests/compat/guideloom_roundtrip.py [--keep DIR]

1. *Write* (this process): this checkout's ``guideloom_pipes`` writes a stream dataset
   (structured dtype), a document dataset (pickle) and a stream-with-metadata dataset (the
   small :class:`ChunkLabelFormat` below), each in several writer sessions, a dozen shards
   each (so two-digit ids), with shards rewritten by later sessions. What each dataset should
   hold goes to ``written.json``.
2. *Read* (a second interpreter, ``python -I``: no PYTHONPATH, neither the script's folder
   nor the working directory on ``sys.path``, so the installed GuideLoom wins over our
   ``guideloom`` alias): GuideLoom's own storages, datasets and every read backend read the
   files back and compare them with ``written.json``.

Not collected by pytest (its name does not match ``test_*.py``). Exit status 0 means GuideLoom
read everything exactly as written.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SEED = 20240611

STREAM_DTYPE = np.dtype([("tokens", "<i4"), ("loss_mask", "u1")])
META_DTYPE = np.dtype([("tokens", "<i4"), ("position", "<u2")])
STREAM_SHARDS = 12
DOCUMENT_SHARDS = 11
META_SHARDS = 11


class ChunkLabelFormat:
    """Stream-with-metadata format: tokens with a position, one text label per chunk.

    ``pack({"tokens": int array, "chunks": [(length, label), ...]})`` yields the chunk number
    as the key for each element and the label's utf-8 bytes at the first element of each
    chunk; ``unpack`` returns the raw pieces so the reader can compare all of them.
    """

    stream_dtype = META_DTYPE

    def size(self, data: dict[str, Any]) -> int:
        return len(data["tokens"])

    def pack(self, data: dict[str, Any]) -> Generator[tuple[int, bytes | None], None, np.ndarray]:
        for chunk, (length, label) in enumerate(data["chunks"]):
            yield chunk, label.encode()
            for _ in range(length - 1):
                yield chunk, None
        stream = np.empty(len(data["tokens"]), dtype=META_DTYPE)
        stream["tokens"] = data["tokens"]
        stream["position"] = np.arange(len(stream)) % 65536
        return stream

    def unpack(
        self,
        stream_data: np.ndarray,
        document_shard: np.ndarray,
        document_index: np.ndarray,
        document_data: Sequence[Any],
    ) -> dict[str, Any]:
        return {
            "stream": stream_data,
            "document_shard": document_shard,
            "document_index": document_index,
            "document_data": [bytes(d).decode() for d in document_data],
        }


# --- phase 1: write with guideloom_pipes ---------------------------------------------------


def _sessions(shards: int) -> list[list[int]]:
    """Writer sessions: two halves written independently, then two shards rewritten."""
    half = shards // 2
    return [[*range(half), shards - 1], list(range(half, shards)), [1, shards - 2]]


def write_all(root: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    import guideloom_pipes as gp

    print(f"write: guideloom_pipes {gp.__version__} from {Path(gp.__file__).parent}", flush=True)
    rng = np.random.default_rng(SEED)
    written = {
        "stream": _write_stream(gp, root / "stream", rng),
        "document": _write_documents(gp, root / "document", rng),
        "stream_meta": _write_meta(gp, root / "stream_meta", rng),
    }
    # each dataset has its manifest (our readers open it from there; GuideLoom must not care)
    from guideloom_pipes.storage.manifest_open import ManifestListing

    for kind, storage in (
        ("stream", gp.StreamStorage(root / "stream", gp.StreamNumpyFormat(STREAM_DTYPE))),
        ("document", gp.DocumentStorage(root / "document", gp.DocumentPickleFormat())),
    ):
        assert (root / kind / ".guideloom-manifest").is_dir(), kind
        with storage.sync_reader() as reader:
            assert isinstance(reader.listing, ManifestListing), (kind, reader.listing)
    print("write: every dataset has its manifest, and our readers open from it", flush=True)
    return written


def _interleaved(rng: np.random.Generator, shards: list[int]) -> Iterator[tuple[int, int]]:
    """(shard, record number): 1-3 records per shard, the shards' appends interleaved."""
    appends = [shard for shard in shards for _ in range(int(rng.integers(1, 4)))]
    counts: dict[int, int] = {}
    for shard in rng.permutation(appends).tolist():
        counts[shard] = counts.get(shard, -1) + 1
        yield shard, counts[shard]


def _write_stream(gp: Any, directory: Path, rng: np.random.Generator) -> dict[str, Any]:
    storage = gp.StreamStorage(directory, gp.StreamNumpyFormat(STREAM_DTYPE))
    shards: dict[int, dict[str, list[int]]] = {}
    for session in _sessions(STREAM_SHARDS):
        with storage.sync_writer() as writer:
            fresh: dict[int, dict[str, list[int]]] = {}
            for shard, _ in _interleaved(rng, session):
                n = int(rng.integers(1, 40))
                tokens = rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int64).astype("<i4")
                mask = rng.integers(0, 2, n).astype("u1")
                writer.append(shard, {"tokens": tokens, "loss_mask": mask})
                got = fresh.setdefault(shard, {"tokens": [], "loss_mask": []})
                got["tokens"] += tokens.tolist()
                got["loss_mask"] += mask.tolist()
        shards.update(fresh)  # a session replaces each shard it touched
    return {
        "dtype": [list(field) for field in STREAM_DTYPE.descr],
        "shards": [shards[k] for k in range(STREAM_SHARDS)],
    }


def _document(rng: np.random.Generator, shard: int, number: int) -> Any:
    kind = int(rng.integers(0, 5))
    if kind == 0:
        return f"plain string {shard}/{number} ünïcødé"
    if kind == 1:
        return {}
    if kind == 2:
        return "x" * int(rng.integers(50_000, 120_000))  # larger than any read buffer
    return {
        "id": [shard, number],
        "text": " ".join(["doc"] * int(rng.integers(0, 6))),
        "tokens": rng.integers(0, 50_000, int(rng.integers(0, 20))).tolist(),
        "score": float(rng.random()),
        "flags": {"ok": bool(rng.integers(0, 2)), "none": None},
    }


def _write_documents(gp: Any, directory: Path, rng: np.random.Generator) -> dict[str, Any]:
    storage = gp.DocumentStorage(directory, gp.DocumentPickleFormat())
    shards: dict[int, list[Any]] = {}
    for session in _sessions(DOCUMENT_SHARDS):
        with storage.sync_writer() as writer:
            fresh: dict[int, list[Any]] = {}
            for shard, record in _interleaved(rng, session):
                doc = _document(rng, shard, record)
                writer.append(shard, doc)
                fresh.setdefault(shard, []).append(doc)
        shards.update(fresh)
    return {"shards": [shards[k] for k in range(DOCUMENT_SHARDS)]}


def _write_meta(gp: Any, directory: Path, rng: np.random.Generator) -> dict[str, Any]:
    storage = gp.StreamWithMetaStorage(directory, ChunkLabelFormat())
    shards: dict[int, dict[str, list[Any]]] = {}
    for number, session in enumerate(_sessions(META_SHARDS)):
        with storage.sync_writer() as writer:
            fresh: dict[int, dict[str, list[Any]]] = {}
            for shard, record in _interleaved(rng, session):
                lengths = rng.integers(1, 8, int(rng.integers(1, 5))).tolist()
                chunks = [
                    (length, f"session {number} shard {shard} record {record} chunk {c} ✓")
                    for c, length in enumerate(lengths)
                ]
                tokens = rng.integers(0, 2**31 - 1, sum(lengths)).astype("<i4")
                writer.append(shard, {"tokens": tokens, "chunks": chunks})
                got = fresh.setdefault(
                    shard, {"tokens": [], "position": [], "payload": [], "labels": []}
                )
                got["tokens"] += tokens.tolist()
                got["position"] += list(range(len(tokens)))
                for length, label in chunks:  # each chunk run is a new shard-local payload
                    got["payload"] += [len(got["labels"])] * length
                    got["labels"].append(label)
        shards.update(fresh)
    return {
        "dtype": [list(field) for field in META_DTYPE.descr],
        "shards": [shards[k] for k in range(META_SHARDS)],
    }


# --- phase 2: read with GuideLoom 1.1 ------------------------------------------------------


class Mismatch(Exception):
    """GuideLoom read something other than what was written."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise Mismatch(what)


def _same_array(got: Any, want: np.ndarray, what: str) -> None:
    got = np.asarray(got)
    _check(got.dtype == want.dtype, f"{what}: dtype {got.dtype}, wrote {want.dtype}")
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)[:3].tolist() if got.shape == want.shape else []
        raise Mismatch(
            f"{what}: got {got.shape} {got[:8].tolist()}..., wrote {want.shape} "
            f"{want[:8].tolist()}..., first differences at {bad}"
        )


def _wrapped(total: int, start: int, length: int) -> np.ndarray:
    return (start + np.arange(length)) % total


def read_all(root: Path) -> None:
    import guideloom as gl

    where = Path(gl.__file__).resolve()
    print(f"read: guideloom {gl.__version__} from {where.parent}", flush=True)
    alias = REPO / "guideloom"
    _check(where.parent != alias, f"the guideloom alias in {alias} was imported, not GuideLoom")
    _check(importlib.util.find_spec("guideloom_pipes") is None, "guideloom_pipes is importable")
    _check(gl.__version__ == "1.1.0", f"expected GuideLoom 1.1.0, got {gl.__version__}")
    written = json.loads((root / "written.json").read_text())
    backends: list[tuple[str, Callable[[], Any]]] = [
        ("default", lambda: None),
        ("SeekIO", gl.io.SeekIO),
        ("PosixPreadIO", gl.io.PosixPreadIO),
        ("MmapIO", gl.io.MmapIO),
    ]
    for name, backend in backends:
        _read_stream(gl, root / "stream", written["stream"], backend())
        _read_documents(gl, root / "document", written["document"], backend())
        _read_meta(gl, root / "stream_meta", written["stream_meta"], backend())
        print(f"read: {name:12s} stream, document, stream_meta: all equal to what was written")


def _read_stream(gl: Any, directory: Path, written: dict[str, Any], backend: Any) -> None:
    dtype = np.dtype([tuple(field) for field in written["dtype"]])
    shards = written["shards"]
    want = {f: np.concatenate([np.asarray(s[f], dtype[f]) for s in shards]) for f in dtype.names}
    total = len(want["tokens"])
    storage = gl.StreamStorage(directory, gl.StreamNumpyFormat(dtype), backend)
    with storage.sync_reader() as reader:
        _check(reader.num_shards == len(shards), f"stream: {reader.num_shards} shards")
        _check(reader.total_length == total, f"stream: total_length {reader.total_length}")
        for k, shard in enumerate(shards):
            got = reader.length(k)
            _check(got == len(shard["tokens"]), f"stream: shard {k} has {got} elements")
        spans = [(0, total), (total - 5, 12), (3, 2 * total + 5), (total // 2, 1), (0, 0)]
        for start, length in spans:
            got = reader.read(start, length)
            _check(sorted(got) == sorted(dtype.names), f"stream: fields {sorted(got)}")
            where = _wrapped(total, start, length)
            for field in dtype.names:
                _same_array(got[field], want[field][where], f"stream read({start}, {length})")
    for length in (1, 7, 64):
        with gl.StreamDataset(storage, length).sync_reader() as samples:
            _check(len(samples) == total // length, f"stream L={length}: len {len(samples)}")
            for i in range(len(samples)):
                for field in dtype.names:
                    window = want[field][i * length : (i + 1) * length]
                    _same_array(samples[i][field], window, f"stream L={length} sample {i}")

    async def async_read() -> Any:
        async with storage.async_reader() as reader:
            return await reader.read(total - 3, 6)

    got = asyncio.run(async_read())
    _same_array(got["tokens"], want["tokens"][_wrapped(total, total - 3, 6)], "stream async")


def _read_documents(gl: Any, directory: Path, written: dict[str, Any], backend: Any) -> None:
    shards = written["shards"]
    want = [doc for shard in shards for doc in shard]
    storage = gl.DocumentStorage(directory, gl.DocumentPickleFormat(), backend)
    with storage.sync_reader() as reader:
        _check(reader.num_shards == len(shards), f"document: {reader.num_shards} shards")
        _check(reader.total_length == len(want), f"document: total {reader.total_length}")
        for k, shard in enumerate(shards):
            _check(reader.length(k) == len(shard), f"document: shard {k} {reader.length(k)}")
        for i, doc in enumerate(want):
            _check(reader.read(i) == doc, f"document {i}: {str(reader.read(i))[:80]!r}")
        order = np.random.default_rng(SEED).permutation(len(want)).astype(np.int64)
        got = list(reader.read_many(order))
        _check(got == [want[i] for i in order], "document: read_many differs")
    with gl.DocumentDataset(storage).sync_reader() as samples:
        _check(len(samples) == len(want), f"document dataset: len {len(samples)}")
        _check(list(samples[2:9]) == want[2:9], "document dataset: slice differs")

    async def async_read() -> Any:
        async with storage.async_reader() as reader:
            return await reader.read(len(want) - 1)

    _check(asyncio.run(async_read()) == want[-1], "document: async read differs")


def _read_meta(gl: Any, directory: Path, written: dict[str, Any], backend: Any) -> None:
    dtype = np.dtype([tuple(field) for field in written["dtype"]])
    shards = written["shards"]
    tokens = np.concatenate([np.asarray(s["tokens"], "<i4") for s in shards])
    positions = np.concatenate([np.asarray(s["position"], "<u2") for s in shards])
    element_shard = np.concatenate([np.full(len(s["tokens"]), k) for k, s in enumerate(shards)])
    element_payload = np.concatenate([np.asarray(s["payload"], np.int64) for s in shards])
    total = len(tokens)
    storage = gl.StreamWithMetaStorage(directory, ChunkLabelFormat(), backend)

    def expect(start: int, length: int) -> dict[str, Any]:
        where = _wrapped(total, start, length)
        keys = list(zip(element_shard[where].tolist(), element_payload[where].tolist()))
        distinct = list(dict.fromkeys(keys))
        return {
            "tokens": tokens[where],
            "position": positions[where],
            "document_shard": [s for s, _ in distinct],
            "document_index": np.asarray([distinct.index(k) for k in keys], np.int32),
            "document_data": [shards[s]["labels"][p] for s, p in distinct],
        }

    def compare(got: dict[str, Any], start: int, length: int, what: str) -> None:
        want = expect(start, length)
        stream = np.asarray(got["stream"])
        _check(stream.dtype == dtype, f"{what}: stream dtype {stream.dtype}")
        _same_array(stream["tokens"], want["tokens"], f"{what} tokens")
        _same_array(stream["position"], want["position"], f"{what} position")
        _check(
            np.asarray(got["document_shard"]).tolist() == want["document_shard"],
            f"{what}: document_shard {np.asarray(got['document_shard']).tolist()}, "
            f"expected {want['document_shard']}",
        )
        _same_array(got["document_index"], want["document_index"], f"{what} document_index")
        _check(
            got["document_data"] == want["document_data"],
            f"{what}: document_data {got['document_data']}, expected {want['document_data']}",
        )

    with storage.sync_reader() as reader:
        _check(reader.num_shards == len(shards), f"stream_meta: {reader.num_shards} shards")
        _check(reader.total_length == total, f"stream_meta: total {reader.total_length}")
        for k, shard in enumerate(shards):
            n = reader.length(k)
            _check(n == len(shard["tokens"]), f"stream_meta: shard {k} has {n} elements")
        for length in (1, 5, 16):
            for i in range(total // length):
                got = reader.read(i * length, length)
                compare(got, i * length, length, f"stream_meta read({i * length}, {length})")
        compare(reader.read(total - 3, 10), total - 3, 10, "stream_meta wrapping read")
    with gl.StreamDataset(storage, 9).sync_reader() as samples:
        _check(len(samples) == total // 9, f"stream_meta dataset: len {len(samples)}")
        for i in range(len(samples)):
            compare(samples[i], 9 * i, 9, f"stream_meta dataset L=9 sample {i}")


# --- driver --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="write into this empty folder and keep it")
    parser.add_argument("--read", type=Path, help=argparse.SUPPRESS)  # phase 2 (internal)
    args = parser.parse_args(argv)
    if args.read is not None:
        try:
            read_all(args.read)
        except Mismatch as error:
            print(f"MISMATCH: {error}", file=sys.stderr)
            return 1
        return 0

    with tempfile.TemporaryDirectory(prefix="guideloom-compat-") as scratch:
        root = args.keep if args.keep is not None else Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        written = write_all(root)
        (root / "written.json").write_text(json.dumps(written))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        command = [sys.executable, "-I", str(Path(__file__).resolve()), "--read", str(root)]
        result = subprocess.run(command, env=env, cwd=root, check=False)
        if result.returncode != 0:
            print(f"compat: GuideLoom did not read our files as written (files in {root})")
            if args.keep is None:
                print("compat: rerun with --keep DIR to keep them")
            return 1
    print("compat: GuideLoom 1.1 read every file written by guideloom_pipes exactly as written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
