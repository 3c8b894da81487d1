"""Read backends: the local ones read identically, a custom backend serves any ``PurePath``,
async readers work, and descriptor-holding backends do not keep one descriptor per shard."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import numpy as np
import pytest
from storage_formats import ChunkMetaFormat

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
    StreamWithMetaStorage,
)
from guideloom_pipes.io import MmapIO, PosixPreadIO, SeekIO

REPO = Path(__file__).resolve().parents[2]
TOKENS = np.dtype([("tokens", "<i4"), ("loss_mask", "u1")])
LOCAL_BACKENDS = {
    "default": None,
    "MmapIO": MmapIO(),
    "PosixPreadIO": PosixPreadIO(),
    "PosixPreadIO-advice": PosixPreadIO(advice=True),
    "SeekIO": SeekIO(),
    "SeekIO-class": SeekIO,
}
SHARD_LENGTHS = [7, 0, 12, 5]
DOCUMENTS = [
    [{"id": i, "text": "x" * (i % 5)} for i in range(j, j + n)] for j, n in [(0, 3), (3, 1)]
]
META_RECORDS = [
    (0, {"doc": 0, "tokens": [0, 1, 2], "chunk_ids": [0, 0, 1]}),
    (0, {"doc": 1, "tokens": [3, 4], "chunk_ids": [0, 0]}),
    (1, {"doc": 2, "tokens": [5, 6, 7, 8], "chunk_ids": [3, 3, 3, 4]}),
]


def stream_reference() -> np.ndarray:
    total = sum(SHARD_LENGTHS)
    out = np.empty(total, dtype=TOKENS)
    out["tokens"] = np.arange(total) * 3
    out["loss_mask"] = np.arange(total) % 2
    return out


def write_stream(directory: Path) -> np.ndarray:
    reference = stream_reference()
    with StreamStorage(directory, StreamNumpyFormat(TOKENS)).sync_writer() as writer:
        start = 0
        for shard, n in enumerate(SHARD_LENGTHS):
            part = reference[start : start + n]
            writer.append(shard, {"tokens": part["tokens"], "loss_mask": part["loss_mask"]})
            start += n
    return reference


def write_documents(directory: Path) -> list[Any]:
    with DocumentStorage(directory, DocumentPickleFormat()).sync_writer() as writer:
        for shard, documents in enumerate(DOCUMENTS):
            for document in documents:
                writer.append(shard, document)
    return [d for documents in DOCUMENTS for d in documents]


def write_meta(directory: Path) -> None:
    with StreamWithMetaStorage(directory, ChunkMetaFormat()).sync_writer() as writer:
        for shard, data in META_RECORDS:
            writer.append(shard, data)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("backends")
    write_meta(root / "meta")
    return {
        "root": root,
        "stream": write_stream(root / "stream"),
        "document": write_documents(root / "document"),
    }


def read_everything(root: PurePath, backend: Any) -> dict[str, Any]:
    """Every read path of the three storages, as plain values."""
    out: dict[str, Any] = {}
    stream = StreamStorage(root / "stream", StreamNumpyFormat(TOKENS), backend)
    with stream.sync_reader() as reader:
        out["shards"] = [reader.length(k) for k in range(reader.num_shards)]
        out["spans"] = [
            reader.read(start, length)["tokens"].tolist()
            for start, length in [(0, 24), (5, 3), (6, 9), (20, 30), (23, 1)]
        ]
        out["windows"] = reader.read_windows(np.array([0, 4, 8, 12, 16]), 8).tolist()
    with StreamDataset(stream, 5).sync_reader() as reader:
        out["samples"] = [s["loss_mask"].tolist() for s in reader.read_batch(np.array([3, 0, 2]))]
    documents = DocumentStorage(root / "document", DocumentPickleFormat(), backend)
    with DocumentDataset(documents).sync_reader() as reader:
        out["documents"] = reader[:] + reader.read_batch(np.array([3, 1]))
    meta = StreamWithMetaStorage(root / "meta", ChunkMetaFormat(), backend)
    with StreamDataset(meta, 2).sync_reader() as reader:
        out["meta"] = [*reader[:], reader.storage_reader.read(8, 4)]
    return out


@pytest.fixture(scope="module")
def reference_reads(datasets: dict[str, Any]) -> dict[str, Any]:
    return read_everything(datasets["root"], None)


def test_reference_reads_are_right(
    datasets: dict[str, Any], reference_reads: dict[str, Any]
) -> None:
    tokens = datasets["stream"]["tokens"].tolist()
    assert reference_reads["shards"] == SHARD_LENGTHS
    assert reference_reads["spans"][1] == tokens[5:8]
    assert reference_reads["spans"][3] == (tokens * 3)[20:50]
    assert reference_reads["documents"][:4] == datasets["document"]
    assert reference_reads["meta"][-1] == {  # elements 8, 0, 1, 2: wraps into shard 0
        "stream": [8, 0, 1, 2],
        "document_shard": [1, 0, 0],
        "document_index": [0, 1, 1, 2],
        "document_data": ["doc:2/chunk:4", "doc:0/chunk:0", "doc:0/chunk:1"],
    }


@pytest.mark.parametrize("name", list(LOCAL_BACKENDS))
def test_local_backends_give_identical_reads(
    datasets: dict[str, Any], reference_reads: dict[str, Any], name: str
) -> None:
    assert read_everything(datasets["root"], LOCAL_BACKENDS[name]) == reference_reads


def test_backend_classes_are_importable_from_the_io_module() -> None:
    import guideloom_pipes

    assert guideloom_pipes.io.MmapIO is MmapIO
    assert {MmapIO, PosixPreadIO, SeekIO} <= {
        getattr(guideloom_pipes.io, n) for n in guideloom_pipes.io.__all__
    }


def test_a_read_interface_without_sync_reader_is_refused(tmp_path: Path) -> None:
    storage = StreamStorage(tmp_path, StreamNumpyFormat(TOKENS), read_interface="mmap")
    with pytest.raises(TypeError, match=r"read_interface must be a read backend.*'mmap'"):
        storage.sync_reader().open()


# a custom backend over any PurePath ---------------------------------------------------------


class MemoryReader:
    def __init__(self, files: dict[PurePosixPath, bytes], path: PurePath) -> None:
        assert isinstance(path, PurePosixPath) and not isinstance(path, Path)
        self.files, self.path = files, path
        self.data: memoryview | None = None

    def open(self) -> None:
        if self.path not in self.files:
            raise FileNotFoundError(str(self.path))
        self.data = memoryview(self.files[self.path])

    def close(self) -> None:
        self.data = None

    def filesize(self) -> int:
        assert self.data is not None, "filesize() before open()"
        return len(self.data)

    def read(self, offset: int, size: int) -> memoryview:
        assert self.data is not None, "read() before open()"
        return self.data[offset : offset + size]


class AsyncMemoryReader:
    def __init__(self, reader: MemoryReader) -> None:
        self.reader = reader

    async def open(self) -> None:
        self.reader.open()

    async def close(self) -> None:
        self.reader.close()

    async def filesize(self) -> int:
        return self.reader.filesize()

    async def read(self, offset: int, size: int) -> memoryview:
        return self.reader.read(offset, size)


class ProbingMemoryBackend:
    """Serves files from a dict keyed by ``PurePosixPath`` (an object store, say); no listing.

    A path-style backend (``sync_reader(path)`` returns the reader), which the storages
    accept beside GuideLoom's convention (see test_guideloom_api.py for that one)."""

    def sync_reader(self) -> Any:
        return self.open_reader

    def async_reader(self) -> Any:
        return self.open_async_reader

    def __init__(self, files: dict[PurePosixPath, bytes]) -> None:
        self.files = files
        self.opened: list[PurePath] = []

    def open_reader(self, path: PurePath) -> MemoryReader:
        self.opened.append(path)
        return MemoryReader(self.files, path)

    def open_async_reader(self, path: PurePath) -> AsyncMemoryReader:
        return AsyncMemoryReader(self.open_reader(path))


class ListingMemoryBackend(ProbingMemoryBackend):
    """The same, with the optional ``list_dir`` that lets discovery see gaps."""

    def list_dir(self, path: PurePath) -> Iterable[str]:
        names = [p.name for p in self.files if p.parent == path]
        if not names:
            raise FileNotFoundError(str(path))
        return names


BUCKET = PurePosixPath("/bucket/datasets")


def load_into_memory(root: Path) -> dict[PurePosixPath, bytes]:
    return {
        BUCKET / path.parent.name / path.name: path.read_bytes()
        for path in root.glob("*/*")
        if path.is_file()
    }


@pytest.mark.parametrize("backend_class", [ListingMemoryBackend, ProbingMemoryBackend])
def test_a_custom_backend_serving_pure_paths_reads_like_the_local_ones(
    datasets: dict[str, Any], reference_reads: dict[str, Any], backend_class: type
) -> None:
    backend = backend_class(load_into_memory(datasets["root"]))
    assert read_everything(BUCKET, backend) == reference_reads
    assert all(isinstance(p, PurePosixPath) for p in backend.opened)


def without_shard(files: dict[PurePosixPath, bytes], shard: int) -> dict[PurePosixPath, bytes]:
    return {p: data for p, data in files.items() if not p.name.startswith(f"{shard:07d}.")}


def test_a_custom_backend_with_list_dir_detects_a_gap(tmp_path: Path) -> None:
    root = tmp_path / "data"
    with StreamStorage(root / "stream", StreamNumpyFormat(TOKENS)).sync_writer() as writer:
        for shard in range(4):
            writer.append(shard, {"tokens": np.arange(3), "loss_mask": np.ones(3)})
    files = without_shard(load_into_memory(root), 2)
    storage = StreamStorage(
        BUCKET / "stream", StreamNumpyFormat(TOKENS), ListingMemoryBackend(files)
    )
    with pytest.raises(FileNotFoundError, match="shard 0000002 is missing"):
        storage.sync_reader().open()


def test_a_custom_backend_without_list_dir_probes_ids_so_a_gap_hides_every_later_shard(
    tmp_path: Path,
) -> None:
    """Without ``list_dir``, discovery probes ids 0, 1, 2, 4, ... as GuideLoom does: with
    shard 2 missing, shards 3.. are silently not part of the dataset. That is documented
    (give a backend ``list_dir`` to have gaps detected); this test pins it down."""
    root = tmp_path / "data"
    with StreamStorage(root / "stream", StreamNumpyFormat(TOKENS)).sync_writer() as writer:
        for shard in range(6):
            writer.append(shard, {"tokens": np.arange(3) + 10 * shard, "loss_mask": np.ones(3)})
    files = without_shard(load_into_memory(root), 2)
    storage = StreamStorage(
        BUCKET / "stream", StreamNumpyFormat(TOKENS), ProbingMemoryBackend(files)
    )
    with storage.sync_reader() as reader:
        assert reader.num_shards == 2
        assert reader.read(0, 6)["tokens"].tolist() == [0, 1, 2, 10, 11, 12]


def test_a_custom_backend_without_list_dir_finds_every_shard_when_there_is_no_gap(
    tmp_path: Path,
) -> None:
    root = tmp_path / "data"
    with StreamStorage(root / "stream", StreamNumpyFormat(TOKENS)).sync_writer() as writer:
        for shard in range(11):  # an end between probes (8 exists, 16 does not) is bisected
            writer.append(shard, {"tokens": [shard], "loss_mask": [1]})
    backend = ProbingMemoryBackend(load_into_memory(root))
    with StreamStorage(BUCKET / "stream", StreamNumpyFormat(TOKENS), backend).sync_reader() as r:
        assert r.num_shards == 11
        assert r.read(0, 11)["tokens"].tolist() == list(range(11))


def test_a_custom_backend_with_list_dir_reports_a_missing_directory() -> None:
    storage = StreamStorage(BUCKET / "nowhere", StreamNumpyFormat(TOKENS), ListingMemoryBackend({}))
    with pytest.raises(FileNotFoundError, match="/bucket/datasets/nowhere"):
        storage.sync_reader().open()


# async readers -----------------------------------------------------------------------------


def test_async_storage_readers_read_like_the_sync_ones(
    datasets: dict[str, Any], reference_reads: dict[str, Any]
) -> None:
    root = datasets["root"]

    async def main() -> dict[str, Any]:
        stream = StreamStorage(root / "stream", StreamNumpyFormat(TOKENS))
        async with stream.async_reader() as reader:
            spans = [(await reader.read(s, n))["tokens"].tolist() for s, n in [(0, 24), (5, 3)]]
            total = reader.total_length
        documents = DocumentStorage(root / "document", DocumentPickleFormat())
        async with documents.async_reader() as reader:
            first = await reader.read(0)
            many = await reader.read_many([3, 1])
        meta = StreamWithMetaStorage(root / "meta", ChunkMetaFormat())
        async with meta.async_reader() as reader:
            wrapped = await reader.read(8, 4)
        return {"spans": spans, "total": total, "docs": [first, *many], "meta": wrapped}

    got = asyncio.run(main())
    assert got["spans"] == reference_reads["spans"][:2]
    assert got["total"] == sum(SHARD_LENGTHS)
    assert got["docs"] == [datasets["document"][i] for i in (0, 3, 1)]
    assert got["meta"] == reference_reads["meta"][-1]


def test_async_dataset_readers_read_like_the_sync_ones(
    datasets: dict[str, Any], reference_reads: dict[str, Any]
) -> None:
    root = datasets["root"]

    async def main() -> tuple[Any, ...]:
        stream = StreamStorage(root / "stream", StreamNumpyFormat(TOKENS))
        async with StreamDataset(stream, 5).async_reader() as reader:
            count = len(reader)
            batch = await reader.read_batch(np.array([3, 0, 2]))
            one = await reader.read(3)
            many = await asyncio.gather(*(reader.read(i) for i in range(count)))
        documents = DocumentStorage(root / "document", DocumentPickleFormat())
        async with DocumentDataset(documents).async_reader() as reader:
            docs = await reader.read(slice(None))
        return count, batch, one, many, docs

    count, batch, one, many, docs = asyncio.run(main())
    assert count == sum(SHARD_LENGTHS) // 5
    assert [s["loss_mask"].tolist() for s in batch] == reference_reads["samples"]
    assert one["tokens"].tolist() == batch[0]["tokens"].tolist()
    assert [s["tokens"].tolist() for s in many] == [
        datasets["stream"]["tokens"][i * 5 : i * 5 + 5].tolist() for i in range(count)
    ]
    assert docs == datasets["document"]


def test_the_local_backends_async_readers_read_byte_ranges(datasets: dict[str, Any]) -> None:
    path = datasets["root"] / "stream" / "0000002.in_band.bin"
    expected = path.read_bytes()

    async def main(backend: Any) -> tuple[int, bytes]:
        reader = backend.async_reader()(path)  # GuideLoom's convention: a factory
        async with reader:
            return await reader.filesize(), bytes(await reader.read(5, 20))

    for backend in (MmapIO(), PosixPreadIO(), SeekIO()):
        assert asyncio.run(main(backend)) == (len(expected), expected[5:25])


# descriptors -------------------------------------------------------------------------------

FD_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys
    import numpy as np
    from pathlib import Path
    from guideloom_pipes import (DocumentDataset, DocumentPickleFormat, DocumentStorage,
        StreamDataset, StreamNumpyFormat, StreamStorage)
    from guideloom_pipes.io import MmapIO, PosixPreadIO, SeekIO

    root, limit = Path(sys.argv[1]), int(sys.argv[2])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    fds = lambda: len(os.listdir("/dev/fd"))
    result = {"baseline": fds()}
    dtype = np.dtype([("tokens", "<i4")])
    backends = [("mmap", MmapIO()), ("pread", PosixPreadIO(advice=True)), ("seek", SeekIO())]
    for name, backend in backends:
        storage = StreamStorage(root / "stream", StreamNumpyFormat(dtype), backend)
        with storage.sync_reader() as reader:
            shards = [reader.read(int(reader.shard_starts[k]), reader.length(k))["tokens"]
                      for k in range(reader.num_shards)]
            result[name + "_ok"] = all(
                s.tolist() == [k, k + 1, k + 2] for k, s in enumerate(shards))
            result[name + "_open_fds"] = fds()
        with StreamDataset(storage, 2).sync_reader() as reader:
            windows = reader.read_batch(np.arange(len(reader))[::-1])
            result[name + "_windows"] = len(windows)
        result[name + "_after_close"] = fds()
    # A document shard is two files, each kind with its own bound of open readers (64).
    resource.setrlimit(resource.RLIMIT_NOFILE, (2 * limit, hard))
    documents = DocumentStorage(root / "document", DocumentPickleFormat(), PosixPreadIO())
    with DocumentDataset(documents).sync_reader() as reader:
        result["docs_ok"] = reader[:] == list(range(len(reader)))
        result["docs_open_fds"] = fds()
    print(json.dumps(result))
    """
)


def test_fd_holding_backends_do_not_keep_a_descriptor_per_shard(tmp_path: Path) -> None:
    shards = 300
    (tmp_path / "stream").mkdir()
    (tmp_path / "document").mkdir()
    for k in range(shards):  # GuideLoom's layout, written directly: 300 shards in no time
        np.arange(k, k + 3, dtype="<i4").tofile(tmp_path / "stream" / f"{k:07d}.in_band.bin")
        payload = pickle.dumps(k)
        (tmp_path / "document" / f"{k:07d}.out_of_band.bin").write_bytes(payload)
        index = np.array([0, len(payload)], dtype="<i8")
        index.tofile(tmp_path / "document" / f"{k:07d}.out_of_band.index")
    limit = 128
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", FD_SCRIPT, str(tmp_path), str(limit)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["mmap_open_fds"] <= result["baseline"]  # mappings hold no descriptor
    for name in ("mmap", "pread", "seek"):
        assert result[name + "_ok"]
        assert result[name + "_windows"] == 3 * shards // 2
        assert result[name + "_open_fds"] < limit
        assert result[name + "_after_close"] <= result["baseline"]
    assert result["docs_ok"]
    assert result["docs_open_fds"] < 2 * limit


def test_the_local_backends_satisfy_the_read_protocols(datasets: dict[str, Any]) -> None:
    from guideloom_pipes.types import (
        AsyncByteReader,
        IOAsyncReaderAbstract,
        IOReaderAbstract,
        IOSyncReaderAbstract,
        ListingReadInterface,
        ReadInterface,
        SyncByteReader,
    )

    path = datasets["root"] / "stream" / "0000000.in_band.bin"
    for backend in (MmapIO(), PosixPreadIO(), SeekIO()):
        assert isinstance(backend, IOReaderAbstract)
        assert isinstance(backend, ReadInterface)
        assert isinstance(backend, ListingReadInterface)
        assert isinstance(backend.sync_reader()(path), IOSyncReaderAbstract)
        assert isinstance(backend.async_reader()(path), IOAsyncReaderAbstract)
        assert isinstance(backend.sync_reader()(path), SyncByteReader)
        assert isinstance(backend.async_reader()(path), AsyncByteReader)
    assert isinstance(ListingMemoryBackend({}), ListingReadInterface)
    assert not isinstance(ProbingMemoryBackend({}), ListingReadInterface)


def test_a_mapping_outlives_its_reader_while_an_array_uses_it(datasets: dict[str, Any]) -> None:
    path = datasets["root"] / "stream" / "0000002.in_band.bin"
    reader = MmapIO().sync_reader()(path)
    reader.open()
    array = np.frombuffer(reader.buffer(), dtype=TOKENS)
    reader.close()
    gc.collect()
    assert array.tobytes() == path.read_bytes()
    assert not array.flags.writeable  # the mapping is read-only


# readinto: byte-range reads straight into the caller's buffer --------------------------------


@pytest.mark.parametrize("backend", [PosixPreadIO(), SeekIO()], ids=repr)
def test_byte_range_readers_readinto_fill_the_buffer_and_stop_at_the_end_of_the_file(
    datasets: dict[str, Any], backend: Any
) -> None:
    path = datasets["root"] / "stream" / "0000002.in_band.bin"
    data = path.read_bytes()
    reader = backend.sync_reader()(path)
    reader.open()
    try:
        buffer = bytearray(10)
        assert reader.readinto(3, memoryview(buffer)) == 10
        assert buffer == data[3:13]
        tail = bytearray(b"\xff" * 10)
        assert reader.readinto(len(data) - 4, memoryview(tail)) == 4
        assert tail[:4] == data[-4:] and tail[4:] == b"\xff" * 6  # the rest is untouched
        assert reader.read(len(data) - 4, 10) == data[-4:]
    finally:
        reader.close()
    with pytest.raises(RuntimeError, match="not open"):
        reader.readinto(0, memoryview(bytearray(1)))


class IntoOnlyReader(MemoryReader):
    """A reader whose ``read`` of stream data must not be used: windows go through
    ``readinto`` (other files, such as commit records, are still read with ``read``)."""

    def read(self, offset: int, size: int) -> memoryview:
        assert not self.path.name.endswith(".in_band.bin"), "read() although readinto() exists"
        return super().read(offset, size)

    def readinto(self, offset: int, buffer: memoryview) -> int:
        assert self.data is not None
        piece = self.data[offset : offset + len(buffer)]
        buffer[: len(piece)] = piece
        return len(piece)


class IntoOnlyBackend(ListingMemoryBackend):
    def open_reader(self, path: PurePath) -> MemoryReader:
        return IntoOnlyReader(self.files, path)


def read_stream_windows(backend: Any, length: int = 5) -> list[np.ndarray]:
    """Every window of ``length`` through a storage reader (crossing shards), and the batch path."""
    storage = StreamStorage(BUCKET / "stream", StreamNumpyFormat(TOKENS), backend)
    with storage.sync_reader() as reader:
        total = reader.total_length
        windows = [reader.read_raw(start, length)[0] for start in range(total)]  # wraps too
        starts = np.arange(0, total - length + 1)
        windows += list(reader.read_windows(starts, length))
    return windows


def test_stream_reads_fill_the_output_through_readinto_when_the_reader_has_it(
    datasets: dict[str, Any],
) -> None:
    files = load_into_memory(datasets["root"])
    expected = read_stream_windows(ListingMemoryBackend(files))
    got = read_stream_windows(IntoOnlyBackend(files))
    assert len(got) == len(expected)
    for ours, reference in zip(got, expected):
        np.testing.assert_array_equal(ours, reference)


class StridedReader(MemoryReader):
    """``read`` returns a non-contiguous numpy view holding the right bytes."""

    def read(self, offset: int, size: int) -> Any:
        piece = np.frombuffer(super().read(offset, size), dtype=np.uint8)
        return np.repeat(piece, 2)[::2]


class StridedBackend(ListingMemoryBackend):
    def open_reader(self, path: PurePath) -> MemoryReader:
        return StridedReader(self.files, path)


def test_a_reader_returning_a_non_contiguous_array_reads_right(datasets: dict[str, Any]) -> None:
    files = load_into_memory(datasets["root"])
    expected = read_stream_windows(ListingMemoryBackend(files))
    for ours, reference in zip(read_stream_windows(StridedBackend(files)), expected):
        np.testing.assert_array_equal(ours, reference)


@pytest.mark.parametrize("extra", [1, -1], ids=["too-many-bytes", "too-few-bytes"])
def test_a_reader_returning_the_wrong_number_of_bytes_is_refused(
    datasets: dict[str, Any], extra: int
) -> None:
    from guideloom_pipes.storage.errors import CorruptShardError

    class Reader(MemoryReader):
        def read(self, offset: int, size: int) -> Any:
            data = bytes(super().read(offset, size))
            if not self.path.name.endswith(".in_band.bin"):
                return data
            return data + b"\0" if extra > 0 else data[:-1]

    class Backend(ListingMemoryBackend):
        def open_reader(self, path: PurePath) -> MemoryReader:
            return Reader(self.files, path)

    storage = StreamStorage(
        BUCKET / "stream", StreamNumpyFormat(TOKENS), Backend(load_into_memory(datasets["root"]))
    )
    with (
        storage.sync_reader() as reader,
        pytest.raises(CorruptShardError, match="bytes where 15 were expected"),
    ):
        reader.read_raw(0, 3)
