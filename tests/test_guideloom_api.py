"""GuideLoom 1.1's public API, as user code sees it: the names and abstract bases of
``guideloom.types``, its read-backend convention (``sync_reader()`` returns a factory), the
argument types ``unpack`` gets, the dataset readers' ``Sequence`` and ``await reader[i]``
forms, and the parameter names keyword callers use. (numpy only.)"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import functools
import inspect
import os
import typing
from collections.abc import Callable, Generator, Hashable, Iterable
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import numpy as np
import pytest

import guideloom
from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
    StreamWithMetaStorage,
    types,
)
from guideloom_pipes.io import MmapIO, PosixPreadIO, SeekIO
from guideloom_pipes.storage.io import ResolvedBackend, resolve_backend

TOKENS = np.dtype([("tokens", "<i4")])
SHARDS = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]]
DOCUMENTS = [["a", {"b": 1}], [[2, 3]], ["d", "e"]]
BACKENDS = {"MmapIO": MmapIO, "PosixPreadIO": PosixPreadIO, "SeekIO": SeekIO}

#: ``guideloom.types.__all__`` of GuideLoom 1.1, in its order.
GUIDELOOM_TYPES = [
    "StorageFormat",
    "StreamWithMetaStorageFormat",
    "StreamStorageFormat",
    "DocumentStorageFormat",
    "UserBufferTypes",
    "StorageBufferTypes",
    "Vector",
    "SyncContextManager",
    "AsyncContextManager",
    "IOReaderAbstract",
    "IOSyncReaderAbstract",
    "IOAsyncReaderAbstract",
    "DatasetAbstract",
    "DatasetSyncReaderAbstract",
    "DatasetAsyncReaderAbstract",
    "StreamStorageAbstract",
    "StreamStorageSyncWriterAbstract",
    "StreamStorageSyncReaderAbstract",
    "StreamStorageAsyncReaderAbstract",
    "DocumentStorageAbstract",
    "DocumentStorageSyncWriterAbstract",
    "DocumentStorageSyncReaderAbstract",
    "DocumentStorageAsyncReaderAbstract",
    "StatefulDataLoaderStateDict",
]

#: The abstract methods of each of GuideLoom 1.1's abstract bases.
ABSTRACT_METHODS = {
    "SyncContextManager": {"open", "close"},
    "AsyncContextManager": {"open", "close"},
    "IOReaderAbstract": {"is_supported", "sync_reader", "async_reader"},
    "IOSyncReaderAbstract": {"open", "close", "filesize", "read"},
    "IOAsyncReaderAbstract": {"open", "close", "filesize", "read", "close_sync"},
    "DatasetAbstract": {"__init__", "sync_reader", "async_reader"},
    "DatasetSyncReaderAbstract": {"__getitem__", "__len__", "open", "close"},
    "DatasetAsyncReaderAbstract": {"__getitem__", "__len__", "open", "close"},
    "StreamStorageAbstract": {"sync_writer", "sync_reader", "async_reader"},
    "StreamStorageSyncWriterAbstract": {"append", "length", "open", "close"},
    "StreamStorageSyncReaderAbstract": {
        "read",
        "length",
        "num_shards",
        "total_length",
        "open",
        "close",
    },
    "StreamStorageAsyncReaderAbstract": {
        "read",
        "length",
        "num_shards",
        "total_length",
        "open",
        "close",
    },
    "DocumentStorageAbstract": {"sync_writer", "sync_reader", "async_reader"},
    "DocumentStorageSyncWriterAbstract": {"append", "length", "open", "close"},
    "DocumentStorageSyncReaderAbstract": {
        "read",
        "length",
        "num_shards",
        "total_length",
        "open",
        "close",
    },
    "DocumentStorageAsyncReaderAbstract": {
        "read",
        "length",
        "num_shards",
        "total_length",
        "open",
        "close",
    },
}

#: The direct bases of each class, by name, as GuideLoom 1.1 has them.
BASES = {
    "SyncContextManager": ["AbstractContextManager", "ABC"],
    "AsyncContextManager": ["AbstractAsyncContextManager", "ABC"],
    "IOReaderAbstract": ["Generic"],
    "IOSyncReaderAbstract": ["object"],
    "IOAsyncReaderAbstract": ["object"],
    "DatasetAbstract": ["Generic"],
    "DatasetSyncReaderAbstract": ["Sequence", "SyncContextManager", "ABC", "Generic"],
    "DatasetAsyncReaderAbstract": ["AsyncContextManager", "ABC", "Generic"],
    "StreamStorageAbstract": ["Generic"],
    "StreamStorageSyncWriterAbstract": ["SyncContextManager", "ABC", "Generic"],
    "StreamStorageSyncReaderAbstract": [
        "_StreamStorageSharedReaderAbstract",
        "SyncContextManager",
        "ABC",
        "Generic",
    ],
    "StreamStorageAsyncReaderAbstract": [
        "_StreamStorageSharedReaderAbstract",
        "AsyncContextManager",
        "ABC",
        "Generic",
    ],
    "DocumentStorageAbstract": ["Generic"],
    "DocumentStorageSyncWriterAbstract": ["SyncContextManager", "ABC", "Generic"],
    "DocumentStorageSyncReaderAbstract": [
        "_DocumentStorageSharedReaderAbstract",
        "SyncContextManager",
        "ABC",
        "Generic",
    ],
    "DocumentStorageAsyncReaderAbstract": [
        "_DocumentStorageSharedReaderAbstract",
        "AsyncContextManager",
        "ABC",
        "Generic",
    ],
    "StatefulDataLoaderStateDict": ["dict"],
}


def write_stream(directory: Path) -> StreamStorage:
    storage = StreamStorage(directory, StreamNumpyFormat(TOKENS))
    with storage.sync_writer() as writer:
        for shard, tokens in enumerate(SHARDS):
            writer.append(shard, {"tokens": np.array(tokens)})
    return storage


def write_documents(directory: Path) -> DocumentStorage:
    storage = DocumentStorage(directory, DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for shard, documents in enumerate(DOCUMENTS):
            for document in documents:
                writer.append(shard, document)
    return storage


class PairsMetaFormat:
    """Stream with metadata: a record is ``[(value, payload), ...]``, one run per pair."""

    stream_dtype = np.dtype("<i4")

    def size(self, data: list[tuple[int, bytes]]) -> int:
        return len(data)

    def pack(
        self, data: list[tuple[int, bytes]]
    ) -> Generator[tuple[Hashable, bytes | None], None, np.ndarray]:
        for key, (_, payload) in enumerate(data):
            yield key, payload
        return np.array([value for value, _ in data], dtype=self.stream_dtype)

    def unpack(self, *arguments: Any) -> tuple[Any, ...]:
        return arguments


class Recording:
    """A format wrapper that returns what ``unpack`` was called with."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        for name in ("stream_dtype", "size", "pack"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def unpack(self, *arguments: Any) -> tuple[Any, ...]:
        return arguments


# guideloom.types ---------------------------------------------------------------------------


def test_types_has_every_name_of_guideloom_types_in_its_all() -> None:
    assert set(GUIDELOOM_TYPES) <= set(types.__all__)
    assert all(hasattr(guideloom.types, name) for name in GUIDELOOM_TYPES)


def test_types_keeps_our_own_names() -> None:
    ours = ["Storage", "Dataset", "SyncByteReader", "AsyncByteReader", "ReadInterface"]
    ours += ["ListingReadInterface", "BatchStreamFormat", "Buffer"]
    assert all(name in types.__all__ for name in ours)


def test_dataset_is_our_older_name_of_dataset_abstract() -> None:
    assert types.Dataset is types.DatasetAbstract


@pytest.mark.parametrize("name", sorted(ABSTRACT_METHODS))
def test_abstract_bases_have_guideloom_abstract_methods(name: str) -> None:
    assert set(getattr(types, name).__abstractmethods__) == ABSTRACT_METHODS[name]


@pytest.mark.parametrize("name", sorted(BASES))
def test_classes_have_guideloom_direct_bases(name: str) -> None:
    assert [base.__name__ for base in getattr(types, name).__bases__] == BASES[name]


@pytest.mark.parametrize(
    "name", ["StreamStorageFormat", "StreamWithMetaStorageFormat", "DocumentStorageFormat"]
)
def test_format_protocols_are_runtime_checkable_protocols(name: str) -> None:
    protocol = getattr(types, name)
    assert protocol.__bases__ == (typing.Protocol,)
    assert not isinstance(object(), protocol)


def test_generic_bases_take_guideloom_type_parameters() -> None:
    assert len(types.StreamStorageFormat.__parameters__) == 3
    assert len(types.DocumentStorageFormat.__parameters__) == 2
    assert len(types.StreamStorageAbstract.__parameters__) == 2
    assert len(types.IOReaderAbstract.__parameters__) == 1
    assert types.StreamStorageSyncReaderAbstract[int] is not None


def test_vector_is_a_one_dimensional_ndarray_alias() -> None:
    alias = types.Vector[np.int64]
    assert typing.get_origin(alias) is np.ndarray
    assert typing.get_args(alias)[0] == tuple[int]


def test_buffer_aliases_are_guideloom_unions() -> None:
    assert set(typing.get_args(types.UserBufferTypes)) == {bytearray, bytes, memoryview}
    assert set(typing.get_args(types.StorageBufferTypes)) == {bytearray, memoryview}


def test_storage_format_is_the_union_of_the_three_format_protocols() -> None:
    members = {typing.get_origin(arg) for arg in typing.get_args(types.StorageFormat)}
    assert members == {
        types.StreamStorageFormat,
        types.StreamWithMetaStorageFormat,
        types.DocumentStorageFormat,
    }


def test_stateful_dataloader_state_dict_is_a_typed_dict_of_the_five_checkpoint_keys() -> None:
    state_dict = types.StatefulDataLoaderStateDict
    assert typing.is_typeddict(state_dict)
    assert state_dict.__required_keys__ == {
        "epoch",
        "observation_offset",
        "shuffle",
        "shuffle_seed",
        "drop_last",
    }
    assert state_dict(
        epoch=1, observation_offset=8, shuffle=True, shuffle_seed=None, drop_last=True
    ) == {
        "epoch": 1,
        "observation_offset": 8,
        "shuffle": True,
        "shuffle_seed": None,
        "drop_last": True,
    }


def test_a_format_subclassing_stream_storage_format_inherits_its_constructor() -> None:
    class Tokens(types.StreamStorageFormat):
        def pack(self, data: Any) -> np.ndarray:
            return np.asarray(data, dtype=self.stream_dtype)

        def unpack(self, stream: Any, shard_lengths: Any, shards: Any) -> Any:
            return stream

    format = Tokens(np.dtype("<i4"))
    assert format.stream_dtype == np.dtype("<i4")
    assert isinstance(format, types.StreamStorageFormat)


def test_a_format_subclassing_stream_with_meta_format_inherits_its_constructor() -> None:
    class Meta(types.StreamWithMetaStorageFormat):
        size = PairsMetaFormat.size
        pack = PairsMetaFormat.pack
        unpack = PairsMetaFormat.unpack

    assert Meta(np.dtype("<i2")).stream_dtype == np.dtype("<i2")


def test_format_protocols_cannot_be_instantiated() -> None:
    with pytest.raises(TypeError):
        types.StreamStorageFormat(np.dtype("<i4"))


def test_a_user_format_subclassing_the_protocol_writes_and_reads_a_storage(
    tmp_path: Path,
) -> None:
    class Tokens(types.StreamStorageFormat):
        def pack(self, data: Any) -> np.ndarray:
            return np.asarray(data, dtype=self.stream_dtype)

        def unpack(self, stream: Any, shard_lengths: Any, shards: Any) -> list[int]:
            return [int(x) for x in stream]

    storage = StreamStorage(tmp_path, Tokens(np.dtype("<i4")))
    with storage.sync_writer() as writer:
        writer.append(0, [1, 2, 3])
    with storage.sync_reader() as reader:
        assert reader.read(1, 2) == [2, 3]


def test_sync_context_manager_opens_on_enter_and_closes_on_exit() -> None:
    calls: list[str] = []

    class Resource(types.SyncContextManager):
        def open(self) -> None:
            calls.append("open")

        def close(self) -> None:
            calls.append("close")

    resource = Resource()
    with resource as entered:
        assert entered is resource
    assert calls == ["open", "close"]


def test_async_context_manager_opens_on_enter_and_closes_on_exit() -> None:
    calls: list[str] = []

    class Resource(types.AsyncContextManager):
        async def open(self) -> None:
            calls.append("open")

        async def close(self) -> None:
            calls.append("close")

    async def main() -> None:
        async with Resource():
            calls.append("inside")

    asyncio.run(main())
    assert calls == ["open", "inside", "close"]


class _ThreeDocuments(types.DocumentStorageSyncReaderAbstract):
    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    num_shards = property(lambda self: 1)
    total_length = property(lambda self: 3)

    def length(self, shard: int) -> int:
        return 3

    def read(self, global_index: int) -> str:
        return f"doc{global_index}"


def test_document_reader_abstract_read_many_defaults_to_one_read_each() -> None:
    assert _ThreeDocuments().read_many(np.array([2, 0], dtype=np.int64)) == ["doc2", "doc0"]


def storages(root: Path) -> dict[str, Any]:
    """One (unwritten) storage of each kind under ``root``."""
    return {
        "stream": StreamStorage(root / "s", StreamNumpyFormat(TOKENS)),
        "document": DocumentStorage(root / "d", DocumentPickleFormat()),
        "meta": StreamWithMetaStorage(root / "m", PairsMetaFormat()),
    }


#: What each kind of object is: (storage kind, how to get it from the storage, GuideLoom base).
CONCRETE = {
    "stream storage": ("stream", lambda s: s, "StreamStorageAbstract"),
    "stream writer": ("stream", lambda s: s.sync_writer(), "StreamStorageSyncWriterAbstract"),
    "stream reader": ("stream", lambda s: s.sync_reader(), "StreamStorageSyncReaderAbstract"),
    "stream async": ("stream", lambda s: s.async_reader(), "StreamStorageAsyncReaderAbstract"),
    "meta storage": ("meta", lambda s: s, "StreamStorageAbstract"),
    "meta writer": ("meta", lambda s: s.sync_writer(), "StreamStorageSyncWriterAbstract"),
    "meta reader": ("meta", lambda s: s.sync_reader(), "StreamStorageSyncReaderAbstract"),
    "meta async": ("meta", lambda s: s.async_reader(), "StreamStorageAsyncReaderAbstract"),
    "document storage": ("document", lambda s: s, "DocumentStorageAbstract"),
    "document writer": ("document", lambda s: s.sync_writer(), "DocumentStorageSyncWriterAbstract"),
    "document reader": ("document", lambda s: s.sync_reader(), "DocumentStorageSyncReaderAbstract"),
    "document async": (
        "document",
        lambda s: s.async_reader(),
        "DocumentStorageAsyncReaderAbstract",
    ),
    "stream dataset": ("stream", lambda s: StreamDataset(s, 2), "DatasetAbstract"),
    "stream dataset reader": (
        "stream",
        lambda s: StreamDataset(s, 2).sync_reader(),
        "DatasetSyncReaderAbstract",
    ),
    "stream dataset async": (
        "stream",
        lambda s: StreamDataset(s, 2).async_reader(),
        "DatasetAsyncReaderAbstract",
    ),
    "document dataset": ("document", DocumentDataset, "DatasetAbstract"),
    "document dataset reader": (
        "document",
        lambda s: DocumentDataset(s).sync_reader(),
        "DatasetSyncReaderAbstract",
    ),
    "document dataset async": (
        "document",
        lambda s: DocumentDataset(s).async_reader(),
        "DatasetAsyncReaderAbstract",
    ),
    "StreamNumpyFormat": ("stream", lambda s: s.format, "StreamStorageFormat"),
    "DocumentPickleFormat": ("document", lambda s: s.format, "DocumentStorageFormat"),
    "MmapIO": ("stream", lambda s: MmapIO(), "IOReaderAbstract"),
    "PosixPreadIO": ("stream", lambda s: PosixPreadIO(), "IOReaderAbstract"),
    "SeekIO": ("stream", lambda s: SeekIO(), "IOReaderAbstract"),
}


@pytest.mark.parametrize("name", list(CONCRETE))
def test_concrete_classes_subclass_guideloom_bases(tmp_path: Path, name: str) -> None:
    kind, make, base = CONCRETE[name]
    obj = make(storages(tmp_path)[kind])
    try:
        assert getattr(guideloom.types, base) in type(obj).__mro__
    finally:
        if hasattr(obj, "abort"):
            obj.abort()  # an unused writer


#: How many type parameters GuideLoom 1.1's concrete classes take (``StreamStorage[In, Out, D]``).
GENERIC_ARITY = {
    StreamStorage: 3,
    StreamWithMetaStorage: 3,
    DocumentStorage: 2,
    StreamDataset: 1,
    DocumentDataset: 1,
    StreamNumpyFormat: 2,
    DocumentPickleFormat: 1,
}


@pytest.mark.parametrize("cls", list(GENERIC_ARITY), ids=lambda c: c.__name__)
def test_concrete_classes_take_guideloom_type_parameters(cls: Any) -> None:
    """Annotations such as ``StreamStorage[Tokens, Tokens, np.void]`` evaluate at run time."""
    assert len(cls.__parameters__) == GENERIC_ARITY[cls]
    assert typing.get_origin(cls[(Any,) * GENERIC_ARITY[cls]]) is cls


# read backends: GuideLoom's convention --------------------------------------------------------


@pytest.mark.parametrize("name", list(BACKENDS))
def test_builtin_backends_sync_reader_returns_a_factory_taking_the_path(
    tmp_path: Path, name: str
) -> None:
    write_stream(tmp_path)
    factory = BACKENDS[name]().sync_reader()
    reader = factory(tmp_path / "0000001.in_band.bin")
    assert isinstance(reader, types.IOSyncReaderAbstract)
    reader.open()
    try:
        assert reader.filesize() == 12
        assert bytes(reader.read(4, 8)) == np.array([6, 7], dtype="<i4").tobytes()
    finally:
        reader.close()


@pytest.mark.parametrize("name", list(BACKENDS))
def test_builtin_backends_async_reader_returns_a_factory_of_async_readers(
    tmp_path: Path, name: str
) -> None:
    write_stream(tmp_path)
    reader = BACKENDS[name]().async_reader()(tmp_path / "0000001.in_band.bin")
    assert isinstance(reader, types.IOAsyncReaderAbstract)

    async def main() -> tuple[int, bytes]:
        await reader.open()
        try:
            return await reader.filesize(), bytes(await reader.read(0, 4))
        finally:
            await reader.close()

    assert asyncio.run(main()) == (12, np.array([5], dtype="<i4").tobytes())


@pytest.mark.parametrize("name", list(BACKENDS))
def test_builtin_async_readers_close_without_an_event_loop(tmp_path: Path, name: str) -> None:
    write_stream(tmp_path)
    reader = BACKENDS[name]().async_reader()(tmp_path / "0000000.in_band.bin")
    asyncio.run(reader.open())
    reader.close_sync()
    with pytest.raises(RuntimeError, match="not open"):
        asyncio.run(reader.filesize())


@pytest.mark.parametrize("name", list(BACKENDS))
def test_builtin_readers_return_bytearrays(tmp_path: Path, name: str) -> None:
    write_stream(tmp_path)
    reader = BACKENDS[name]().sync_reader()(tmp_path / "0000000.in_band.bin")
    with contextlib.closing(reader):
        reader.open()
        assert type(reader.read(0, 8)) is bytearray


@pytest.mark.parametrize("name", list(BACKENDS))
def test_builtin_readers_return_what_there_is_past_the_end(tmp_path: Path, name: str) -> None:
    write_stream(tmp_path)
    reader = BACKENDS[name]().sync_reader()(tmp_path / "0000001.in_band.bin")
    with contextlib.closing(reader):
        reader.open()
        assert len(reader.read(8, 100)) == 4


@pytest.mark.parametrize("name", list(BACKENDS))
def test_builtin_readers_refuse_a_missing_file(tmp_path: Path, name: str) -> None:
    reader = BACKENDS[name]().sync_reader()(tmp_path / "missing.bin")
    with pytest.raises(FileNotFoundError):
        reader.open()


def test_builtin_backends_are_supported_here() -> None:
    assert MmapIO.is_supported() and SeekIO.is_supported() and PosixPreadIO.is_supported()
    assert PosixPreadIO.is_supported(advice=True) == hasattr(os, "posix_fadvise")


def test_posix_pread_io_takes_advice_by_keyword() -> None:
    assert PosixPreadIO(advice=True).advice is True


@pytest.mark.parametrize("name", list(BACKENDS))
def test_builtin_backends_give_factories_only(tmp_path: Path, name: str) -> None:
    """``backend.sync_reader()(path)``; the path-taking form of 0.1 is gone."""
    write_stream(tmp_path)
    with pytest.raises(TypeError):
        BACKENDS[name]().sync_reader(tmp_path / "0000002.in_band.bin")  # type: ignore[call-arg]
    reader = BACKENDS[name]().sync_reader()(tmp_path / "0000002.in_band.bin")
    with contextlib.closing(reader):
        reader.open()
        assert reader.filesize() == 16


# a user backend subclassing IOReaderAbstract -------------------------------------------------

BUCKET = PurePosixPath("/bucket/datasets")


class MemorySyncReader(types.IOSyncReaderAbstract):
    """Reads a file of an in-memory "object store" (a dict of ``PurePosixPath`` -> bytes)."""

    def __init__(self, files: dict[PurePath, bytes], path: PurePath) -> None:
        self.files, self.path = files, path
        self.data: bytes | None = None

    def open(self) -> None:
        if self.path not in self.files:
            raise FileNotFoundError(str(self.path))
        self.data = self.files[self.path]

    def close(self) -> None:
        self.data = None

    def filesize(self) -> int:
        assert self.data is not None, "filesize() before open()"
        return len(self.data)

    def read(self, offset: int, size: int) -> memoryview:
        assert self.data is not None, "read() before open()"
        return memoryview(self.data)[offset : offset + size]  # a view of the store's bytes


class MemoryAsyncReader(types.IOAsyncReaderAbstract):
    def __init__(self, files: dict[PurePath, bytes], path: PurePath) -> None:
        self.sync = MemorySyncReader(files, path)

    async def open(self) -> None:
        self.sync.open()

    async def close(self) -> None:
        self.sync.close()

    def close_sync(self) -> None:
        self.sync.close()

    async def filesize(self) -> int:
        return self.sync.filesize()

    async def read(self, offset: int, size: int) -> memoryview:
        return self.sync.read(offset, size)


class MemoryIO(types.IOReaderAbstract[PurePosixPath]):
    """GuideLoom's convention: ``sync_reader()`` returns a factory taking the path."""

    def __init__(self, files: dict[PurePath, bytes]) -> None:
        self.files = files
        self.opened: list[PurePath] = []

    @staticmethod
    def is_supported() -> bool:
        return True

    def _open(self, path: PurePath) -> MemorySyncReader:
        self.opened.append(path)
        return MemorySyncReader(self.files, path)

    def sync_reader(self) -> Callable[[PurePath], MemorySyncReader]:
        return self._open

    def async_reader(self) -> Callable[[PurePath], MemoryAsyncReader]:
        return functools.partial(MemoryAsyncReader, self.files)


class ListingMemoryIO(MemoryIO):
    """The same, with our optional ``list_dir`` (discovery then sees gaps)."""

    def list_dir(self, path: PurePath) -> Iterable[str]:
        names = [p.name for p in self.files if p.parent == path]
        if not names:
            raise FileNotFoundError(str(path))
        return names


def load_into_memory(root: Path) -> dict[PurePath, bytes]:
    return {
        BUCKET / path.relative_to(root): path.read_bytes()
        for path in root.rglob("*")
        if path.is_file()
    }


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> dict[PurePath, bytes]:
    root = tmp_path_factory.mktemp("bucket")
    write_stream(root / "stream")
    write_documents(root / "documents")
    with StreamWithMetaStorage(root / "meta", PairsMetaFormat()).sync_writer() as writer:
        writer.append(0, [(1, b"one"), (2, b"two")])
        writer.append(1, [(3, b"three")])
    return load_into_memory(root)


def test_a_user_io_reader_abstract_subclass_missing_a_method_cannot_be_instantiated() -> None:
    class NoAsync(types.IOReaderAbstract[PurePath]):
        @staticmethod
        def is_supported() -> bool:
            return True

        def sync_reader(self) -> Callable[[PurePath], types.IOSyncReaderAbstract]:
            raise NotImplementedError

    with pytest.raises(TypeError, match="async_reader"):
        NoAsync()  # type: ignore[abstract]


@pytest.mark.parametrize("backend_class", [MemoryIO, ListingMemoryIO])
def test_a_user_io_reader_abstract_subclass_serves_a_stream_storage(
    bucket: dict[PurePath, bytes], backend_class: type[MemoryIO]
) -> None:
    backend = backend_class(bucket)
    storage = StreamStorage(BUCKET / "stream", StreamNumpyFormat(TOKENS), backend)
    with storage.sync_reader() as reader:
        assert [reader.length(k) for k in range(reader.num_shards)] == [5, 3, 4]
        assert reader.read(3, 4)["tokens"].tolist() == [3, 4, 5, 6]
    assert backend.opened and all(isinstance(p, PurePosixPath) for p in backend.opened)


@pytest.mark.parametrize("backend_class", [MemoryIO, ListingMemoryIO])
def test_a_user_io_reader_abstract_subclass_serves_a_stream_dataset(
    bucket: dict[PurePath, bytes], backend_class: type[MemoryIO]
) -> None:
    storage = StreamStorage(BUCKET / "stream", StreamNumpyFormat(TOKENS), backend_class(bucket))
    with StreamDataset(storage, 4).sync_reader() as reader:
        assert [s["tokens"].tolist() for s in reader] == [
            [0, 1, 2, 3],
            [4, 5, 6, 7],
            [8, 9, 10, 11],
        ]


@pytest.mark.parametrize("backend_class", [MemoryIO, ListingMemoryIO])
def test_a_user_io_reader_abstract_subclass_serves_a_document_storage(
    bucket: dict[PurePath, bytes], backend_class: type[MemoryIO]
) -> None:
    storage = DocumentStorage(BUCKET / "documents", DocumentPickleFormat(), backend_class(bucket))
    with DocumentDataset(storage).sync_reader() as reader:
        assert list(reader) == [d for documents in DOCUMENTS for d in documents]


@pytest.mark.parametrize("backend_class", [MemoryIO, ListingMemoryIO])
def test_a_user_io_reader_abstract_subclass_serves_a_stream_with_meta_storage(
    bucket: dict[PurePath, bytes], backend_class: type[MemoryIO]
) -> None:
    storage = StreamWithMetaStorage(BUCKET / "meta", PairsMetaFormat(), backend_class(bucket))
    with storage.sync_reader() as reader:
        stream, _, _, payloads = reader.read(1, 2)
    assert stream.tolist() == [2, 3]
    assert [bytes(p) for p in payloads] == [b"two", b"three"]


def test_a_user_io_reader_abstract_subclass_serves_async_storage_readers(
    bucket: dict[PurePath, bytes],
) -> None:
    storage = DocumentStorage(BUCKET / "documents", DocumentPickleFormat(), MemoryIO(bucket))

    async def main() -> list[Any]:
        async with storage.async_reader() as reader:
            return [await reader.read(4), *await reader.read_many(np.array([0, 2]))]

    assert asyncio.run(main()) == ["e", "a", [2, 3]]


def test_a_user_io_reader_abstract_subclass_with_list_dir_detects_a_gap(
    bucket: dict[PurePath, bytes],
) -> None:
    files = {p: data for p, data in bucket.items() if not p.name.startswith("0000001.")}
    storage = StreamStorage(BUCKET / "stream", StreamNumpyFormat(TOKENS), ListingMemoryIO(files))
    with pytest.raises(FileNotFoundError, match="shard 0000001 is missing"):
        storage.sync_reader().open()


def test_a_user_io_reader_abstract_class_is_instantiated_like_the_builtin_ones(
    tmp_path: Path,
) -> None:
    class LocalIO(types.IOReaderAbstract[PurePath]):
        @staticmethod
        def is_supported() -> bool:
            return True

        def sync_reader(self) -> Callable[[PurePath], types.IOSyncReaderAbstract]:
            return SeekIO().sync_reader()

        def async_reader(self) -> Callable[[PurePath], types.IOAsyncReaderAbstract]:
            return SeekIO().async_reader()

    write_stream(tmp_path)
    with StreamStorage(tmp_path, StreamNumpyFormat(TOKENS), LocalIO).sync_reader() as reader:
        assert reader.total_length == 12


# the resolver: both conventions ---------------------------------------------------------------


class PathStyleIO:
    """The path-taking form of 0.1, removed: ``sync_reader(path)`` returns the reader."""

    def __init__(self, files: dict[PurePath, bytes]) -> None:
        self.files = files

    def sync_reader(self, path: PurePath) -> MemorySyncReader:
        return MemorySyncReader(self.files, path)


def test_resolve_backend_calls_a_guideloom_style_factory_with_the_path(
    bucket: dict[PurePath, bytes],
) -> None:
    resolved = resolve_backend(MemoryIO(bucket))
    reader = resolved.reader(BUCKET / "stream" / "0000000.in_band.bin")
    assert isinstance(reader, MemorySyncReader)


def test_resolve_backend_refuses_a_path_taking_sync_reader_saying_how_to_change_it(
    bucket: dict[PurePath, bytes],
) -> None:
    with pytest.raises(
        TypeError, match=r"PathStyleIO\.sync_reader\(path\) takes the path"
    ) as error:
        resolve_backend(PathStyleIO(bucket))
    assert "def sync_reader(self): return self.open_reader" in str(error.value)

    class AsyncPathStyle(MemoryIO):
        def async_reader(self, path: PurePath) -> Any:  # type: ignore[override]
            raise AssertionError("never called")

    with pytest.raises(TypeError, match=r"AsyncPathStyle\.async_reader\(path\) takes the path"):
        resolve_backend(AsyncPathStyle(bucket))
    storage = StreamStorage(BUCKET / "stream", StreamNumpyFormat(TOKENS), PathStyleIO(bucket))
    with pytest.raises(TypeError, match="takes the path"):  # as a storage's, when it opens
        storage.sync_reader().open()


def test_resolve_backend_treats_the_builtin_backends_as_guideloom_style() -> None:
    calls: list[tuple[Any, ...]] = []

    class Spy(MmapIO):
        def sync_reader(self, *args: Any) -> Any:
            calls.append(args)
            return super().sync_reader(*args)

    resolve_backend(Spy()).reader(PurePath("x"))
    assert calls == [()]


def test_resolve_backend_runs_a_sync_reader_in_a_thread_for_a_backend_without_async_reader(
    bucket: dict[PurePath, bytes],
) -> None:
    class SyncOnlyIO:
        def sync_reader(self) -> Any:
            return lambda path: MemorySyncReader(bucket, path)

    reader = resolve_backend(SyncOnlyIO()).async_reader(BUCKET / "stream" / "0000000.in_band.bin")

    async def main() -> int:
        await reader.open()
        try:
            return await reader.filesize()
        finally:
            await reader.close()

    assert asyncio.run(main()) == 20


def test_resolve_backend_refuses_a_factory_that_is_not_callable() -> None:
    class Broken(MemoryIO):
        def sync_reader(self) -> Any:
            return "not a factory"

    with pytest.raises(TypeError, match=r"Broken.sync_reader\(\) must return a factory"):
        resolve_backend(Broken({}))


def test_resolve_backend_gives_the_default_backend_for_none() -> None:
    assert isinstance(resolve_backend(None).backend, MmapIO)


def test_resolve_backend_returns_a_resolved_backend_unchanged() -> None:
    resolved = resolve_backend(SeekIO())
    assert resolve_backend(resolved) is resolved and isinstance(resolved, ResolvedBackend)


def test_resolved_backend_reports_the_list_dir_extension_and_descriptors() -> None:
    assert resolve_backend(ListingMemoryIO({})).list_dir is not None
    assert resolve_backend(MemoryIO({})).list_dir is None
    assert not resolve_backend(MmapIO()).holds_fd
    assert resolve_backend(MemoryIO({})).holds_fd  # unknown: assume a descriptor each


def test_storage_backend_is_the_read_interface_object() -> None:
    backend = SeekIO()
    assert StreamStorage(Path("x"), StreamNumpyFormat(TOKENS), backend).backend is backend


# unpack's arguments ---------------------------------------------------------------------------


def test_stream_unpack_gets_int64_shard_lengths_and_shards(tmp_path: Path) -> None:
    write_stream(tmp_path)
    storage = StreamStorage(tmp_path, Recording(StreamNumpyFormat(TOKENS)))
    with storage.sync_reader() as reader:
        _, shard_lengths, shards = reader.read(3, 10)
    assert shard_lengths.dtype == np.int64 and shards.dtype == np.int64
    assert shard_lengths.tolist() == [2, 3, 4, 1] and shards.tolist() == [0, 1, 2, 0]


def test_stream_dataset_unpack_gets_int64_shard_lengths_and_shards(tmp_path: Path) -> None:
    write_stream(tmp_path)
    storage = StreamStorage(tmp_path, Recording(StreamNumpyFormat(TOKENS)))
    with StreamDataset(storage, 4).sync_reader() as reader:
        samples = [reader[1], *reader.read_batch(np.array([1, 2]))]
    for _, shard_lengths, shards in samples:
        assert shard_lengths.dtype == np.int64 and shards.dtype == np.int64
    assert [(s[1].tolist(), s[2].tolist()) for s in samples] == [
        ([1, 3], [0, 1]),
        ([1, 3], [0, 1]),
        ([4], [2]),
    ]


def test_stream_unpack_gets_a_writable_array_it_owns(tmp_path: Path) -> None:
    write_stream(tmp_path)
    with StreamStorage(tmp_path, Recording(StreamNumpyFormat(TOKENS))).sync_reader() as reader:
        stream, _, _ = reader.read(0, 3)
    assert stream.flags.writeable and stream.dtype == TOKENS


def write_meta(directory: Path, format: Any) -> StreamWithMetaStorage:
    storage = StreamWithMetaStorage(directory, format)
    with storage.sync_writer() as writer:
        writer.append(0, [(10, b"p0"), (11, b"p1")])
        writer.append(1, [(12, b"q0")])
    return storage


def test_stream_with_meta_unpack_gets_memoryview_payloads(tmp_path: Path) -> None:
    with write_meta(tmp_path, PairsMetaFormat()).sync_reader() as reader:
        _, _, _, document_data = reader.read(1, 2)
    assert all(type(payload) is memoryview for payload in document_data)
    assert [bytes(payload) for payload in document_data] == [b"p1", b"q0"]


def test_stream_with_meta_payloads_stay_valid_and_writable_after_close(tmp_path: Path) -> None:
    with write_meta(tmp_path, PairsMetaFormat()).sync_reader() as reader:
        _, _, _, document_data = reader.read(0, 3)
    assert [bytes(payload) for payload in document_data] == [b"p0", b"p1", b"q0"]
    assert not any(payload.readonly for payload in document_data)


def test_stream_with_meta_unpack_gets_int64_shards_and_int32_indexes(tmp_path: Path) -> None:
    with write_meta(tmp_path, PairsMetaFormat()).sync_reader() as reader:
        _, document_shard, document_index, _ = reader.read(2, 3)  # wraps to shard 0
    assert document_shard.dtype == np.int64 and document_shard.tolist() == [1, 0, 0]
    assert document_index.dtype == np.int32 and document_index.tolist() == [0, 1, 2]


def test_stream_with_meta_dataset_unpack_gets_the_same_types(tmp_path: Path) -> None:
    storage = write_meta(tmp_path, PairsMetaFormat())
    with StreamDataset(storage, 3).sync_reader() as reader:
        stream, document_shard, document_index, document_data = reader[0]
    assert stream.tolist() == [10, 11, 12]
    assert (document_shard.dtype, document_index.dtype) == (np.int64, np.int32)
    assert [type(p) for p in document_data] == [memoryview] * 3


def test_document_unpack_gets_a_bytearray_from_read(tmp_path: Path) -> None:
    write_documents(tmp_path)
    storage = DocumentStorage(tmp_path, Recording(DocumentPickleFormat()))
    with storage.sync_reader() as reader:
        encoded_data, shard = reader.read(2)
    assert type(encoded_data) is bytearray and shard == 1


def test_document_unpack_gets_memoryviews_of_bytearrays_from_read_many(tmp_path: Path) -> None:
    write_documents(tmp_path)
    storage = DocumentStorage(tmp_path, Recording(DocumentPickleFormat()))
    with storage.sync_reader() as reader:
        decoded = reader.read_many(np.array([4, 0], dtype=np.int64))
    assert [type(encoded) for encoded, _ in decoded] == [memoryview, memoryview]
    assert all(type(encoded.obj) is bytearray for encoded, _ in decoded)
    assert [shard for _, shard in decoded] == [2, 0]


@pytest.mark.parametrize("backend", [None, "MmapIO", "PosixPreadIO", "SeekIO", "memory"])
def test_document_unpack_buffers_stay_valid_after_close(
    tmp_path: Path, bucket: dict[PurePath, bytes], backend: str | None
) -> None:
    if backend == "memory":
        directory: PurePath = BUCKET / "documents"
        read_interface: Any = MemoryIO(bucket)
    else:
        directory = write_documents(tmp_path).dir
        read_interface = backend and BACKENDS[backend]()
    storage = DocumentStorage(directory, Recording(DocumentPickleFormat()), read_interface)
    with storage.sync_reader() as reader:
        one, _ = reader.read(0)
        many = [encoded for encoded, _ in reader.read_many([1, 2])]
    assert [bytes(b) for b in [one, *many]] == [
        DocumentPickleFormat().pack(d) for d in ["a", {"b": 1}, [2, 3]]
    ]


def test_document_buffers_from_a_user_backend_are_copies(bucket: dict[PurePath, bytes]) -> None:
    """A backend may hand out views of its own memory; ``unpack`` still gets its own bytes."""
    storage = DocumentStorage(
        BUCKET / "documents", Recording(DocumentPickleFormat()), MemoryIO(bucket)
    )
    with storage.sync_reader() as reader:
        encoded, _ = reader.read(0)
    encoded[:] = b"x" * len(encoded)  # writable, and writing it changes nothing stored
    with DocumentStorage(
        BUCKET / "documents", DocumentPickleFormat(), MemoryIO(bucket)
    ).sync_reader() as reader:
        assert reader.read(0) == "a"


# dataset readers: Sequence and awaitable indexing ----------------------------------------------


def test_sync_dataset_readers_are_sequences(tmp_path: Path) -> None:
    with DocumentDataset(write_documents(tmp_path)).sync_reader() as reader:
        assert isinstance(reader, collections.abc.Sequence)


def test_iterating_a_sync_dataset_reader_yields_every_sample_in_order(tmp_path: Path) -> None:
    with StreamDataset(write_stream(tmp_path), 2).sync_reader() as reader:
        assert [s["tokens"].tolist() for s in reader] == [[2 * i, 2 * i + 1] for i in range(6)]


def test_iterating_a_long_reader_crosses_batches(tmp_path: Path) -> None:
    storage = StreamStorage(tmp_path, StreamNumpyFormat(TOKENS))
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(300)})
    with StreamDataset(storage, 2).sync_reader() as reader:
        assert [int(s["tokens"][0]) for s in reader] == list(range(0, 300, 2))


def test_reversed_sync_dataset_reader_yields_samples_backwards(tmp_path: Path) -> None:
    with DocumentDataset(write_documents(tmp_path)).sync_reader() as reader:
        assert list(reversed(reader)) == ["e", "d", [2, 3], {"b": 1}, "a"]


def test_in_finds_a_sample_of_a_sync_dataset_reader(tmp_path: Path) -> None:
    with DocumentDataset(write_documents(tmp_path)).sync_reader() as reader:
        assert [2, 3] in reader and "z" not in reader
        assert reader.index("d") == 3 and reader.count("a") == 1


def test_iterating_a_closed_dataset_reader_is_refused(tmp_path: Path) -> None:
    reader = DocumentDataset(write_documents(tmp_path)).sync_reader()
    with pytest.raises(RuntimeError, match="not open"):
        list(reader)


def test_async_dataset_reader_index_is_awaitable(tmp_path: Path) -> None:
    async def main() -> Any:
        async with DocumentDataset(write_documents(tmp_path)).async_reader() as reader:
            pending = reader[1]
            assert inspect.isawaitable(pending)
            return await pending

    assert asyncio.run(main()) == {"b": 1}


def test_async_dataset_reader_slice_awaits_a_list(tmp_path: Path) -> None:
    async def main() -> Any:
        async with StreamDataset(write_stream(tmp_path), 3).async_reader() as reader:
            return await reader[1:3]

    assert [s["tokens"].tolist() for s in asyncio.run(main())] == [[3, 4, 5], [6, 7, 8]]


def test_async_dataset_reader_has_a_length(tmp_path: Path) -> None:
    async def main() -> int:
        async with StreamDataset(write_stream(tmp_path), 5).async_reader() as reader:
            return len(reader)

    assert asyncio.run(main()) == 2


def test_async_dataset_reader_index_out_of_range_raises_before_awaiting(tmp_path: Path) -> None:
    async def main() -> None:
        async with DocumentDataset(write_documents(tmp_path)).async_reader() as reader:
            with pytest.raises(IndexError, match="sample index 5 out of range"):
                reader[5]  # raises at once, as in GuideLoom

    asyncio.run(main())


def test_async_dataset_reader_keeps_read_and_read_batch(tmp_path: Path) -> None:
    async def main() -> tuple[Any, Any]:
        async with DocumentDataset(write_documents(tmp_path)).async_reader() as reader:
            return await reader.read(0), await reader.read_batch(np.array([4, 3]))

    assert asyncio.run(main()) == ("a", ["e", "d"])


def test_read_many_takes_an_int64_vector(tmp_path: Path) -> None:
    with write_documents(tmp_path).sync_reader() as reader:
        assert reader.read_many(np.array([3, 1], dtype=np.int64)) == ["d", {"b": 1}]


def test_read_many_still_takes_any_iterable_of_ints(tmp_path: Path) -> None:
    with write_documents(tmp_path).sync_reader() as reader:
        assert reader.read_many(i for i in (0, 2)) == ["a", [2, 3]]


# parameter names keyword callers use ----------------------------------------------------------


@pytest.mark.parametrize("storage_class", [StreamStorage, DocumentStorage, StreamWithMetaStorage])
def test_storages_take_guideloom_parameter_names(storage_class: type) -> None:
    parameters = inspect.signature(storage_class).parameters
    assert list(parameters)[:3] == ["storage_dir", "storage_format", "read_interface"]
    # ours (docs/remote.md) come after GuideLoom's, keyword-only: positions unchanged
    assert {name: p.kind for name, p in list(parameters.items())[3:]} == {
        "storage_options": inspect.Parameter.KEYWORD_ONLY,
        "retry": inspect.Parameter.KEYWORD_ONLY,
        "cache_dir": inspect.Parameter.KEYWORD_ONLY,
        "cache_limit_bytes": inspect.Parameter.KEYWORD_ONLY,
    }


def test_a_storage_built_with_keywords_reads_like_one_built_positionally(tmp_path: Path) -> None:
    write_stream(tmp_path)
    storage = StreamStorage(
        storage_dir=tmp_path, storage_format=StreamNumpyFormat(TOKENS), read_interface=SeekIO()
    )
    with storage.sync_reader() as reader:
        assert reader.read(global_index=10, global_length=2)["tokens"].tolist() == [10, 11]


def test_a_storage_exposes_its_storage_format_and_dir(tmp_path: Path) -> None:
    format = DocumentPickleFormat()
    storage = DocumentStorage(tmp_path, format)
    assert storage.storage_format is format is storage.format
    assert storage.storage_dir == tmp_path == storage.dir


def test_stream_numpy_format_takes_guideloom_parameter_names() -> None:
    format = StreamNumpyFormat(stream_dtype=TOKENS, data_type=dict)
    assert format.stream_dtype == TOKENS


def test_stream_numpy_format_data_type_changes_nothing_at_run_time() -> None:
    class Record(typing.TypedDict):
        tokens: np.ndarray

    typed = StreamNumpyFormat(TOKENS, Record)
    plain = StreamNumpyFormat(TOKENS)
    stream = plain.pack({"tokens": np.arange(3)})
    pieces = np.array([3], dtype=np.int64), np.array([0], dtype=np.int64)
    out = typed.unpack(stream, *pieces)
    assert type(out) is dict and out["tokens"].tolist() == [0, 1, 2]
    assert typed == plain and np.array_equal(typed.pack({"tokens": np.arange(3)}), stream)


SIGNATURES: dict[str, tuple[Callable[..., Any], list[str]]] = {
    "StreamNumpyFormat.pack": (StreamNumpyFormat.pack, ["data"]),
    "StreamNumpyFormat.unpack": (StreamNumpyFormat.unpack, ["stream", "shard_lengths", "shards"]),
    "DocumentPickleFormat.pack": (DocumentPickleFormat.pack, ["data"]),
    "DocumentPickleFormat.unpack": (DocumentPickleFormat.unpack, ["encoded_data", "shard"]),
    "StreamDataset": (StreamDataset, ["storage", "sequence_length"]),
    "DocumentDataset": (DocumentDataset, ["storage"]),
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_public_callables_take_guideloom_parameter_names(name: str) -> None:
    function, expected = SIGNATURES[name]
    names = [p for p in inspect.signature(function).parameters if p != "self"]
    assert names[: len(expected)] == expected


def _method_names(obj: Any, method: str) -> list[str]:
    return list(inspect.signature(getattr(obj, method)).parameters)


#: (storage kind, how to get the object, method, GuideLoom's parameter names).
METHODS = {
    "stream writer append": ("stream", "sync_writer", "append", ["shard", "data"]),
    "stream writer length": ("stream", "sync_writer", "length", ["shard"]),
    "document writer append": ("document", "sync_writer", "append", ["shard", "data"]),
    "document writer length": ("document", "sync_writer", "length", ["shard"]),
    "meta writer append": ("meta", "sync_writer", "append", ["shard", "data"]),
    "stream read": ("stream", "sync_reader", "read", ["global_index", "global_length"]),
    "stream async read": ("stream", "async_reader", "read", ["global_index", "global_length"]),
    "stream length": ("stream", "sync_reader", "length", ["shard"]),
    "meta read": ("meta", "sync_reader", "read", ["global_index", "global_length"]),
    "meta async read": ("meta", "async_reader", "read", ["global_index", "global_length"]),
    "document read": ("document", "sync_reader", "read", ["global_index"]),
    "document read_many": ("document", "sync_reader", "read_many", ["global_indexes"]),
    "document async read": ("document", "async_reader", "read", ["global_index"]),
    "document async read_many": ("document", "async_reader", "read_many", ["global_indexes"]),
    "document async length": ("document", "async_reader", "length", ["shard"]),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_storage_methods_take_guideloom_parameter_names(tmp_path: Path, name: str) -> None:
    kind, factory, method, expected = METHODS[name]
    obj = getattr(storages(tmp_path)[kind], factory)()
    try:
        assert _method_names(obj, method) == expected
    finally:
        if hasattr(obj, "abort"):
            obj.abort()  # an unused writer


@pytest.mark.parametrize("factory", ["sync_reader", "async_reader"])
def test_dataset_readers_take_an_index(tmp_path: Path, factory: str) -> None:
    dataset = StreamDataset(storages(tmp_path)["stream"], 2)
    assert _method_names(getattr(dataset, factory)(), "__getitem__") == ["index"]
