"""Fault injection: corrupt bytes and records in every file kind, descriptor limits, files
changing under a reader. Each error must name the file (and the value) and say what to do."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shard_kinds

from guideloom_pipes import DocumentDataset, DocumentPickleFormat, DocumentStorage, StreamDataset
from guideloom_pipes.io import MmapIO, PosixPreadIO, SeekIO
from guideloom_pipes.storage import CorruptShardError, ShardDecodeError

# (these tests change shard files behind the manifest's back: its StaleManifestWarning is
# the expected fallback, asserted where it matters, and would flood the report)
pytestmark = [
    pytest.mark.fault,
    pytest.mark.filterwarnings("ignore::guideloom_pipes.storage.errors.StaleManifestWarning"),
]


def _index(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype="<i8")


def _poke(path: Path, offset: int, value: int) -> None:
    """Overwrite one byte of ``path`` in place (its size stays the same)."""
    raw = bytearray(path.read_bytes())
    raw[offset] = value
    path.write_bytes(raw)


# --- decode errors --------------------------------------------------------------------


@pytest.fixture
def corrupt_documents(tmp_path: Path) -> DocumentStorage:
    """Two shards of five pickled documents; document 2 of shard 1 (global 7) is garbage."""
    shard_kinds.write("document", tmp_path, {0: range(5), 1: range(5, 10)})
    start = int(_index(tmp_path / "0000001.out_of_band.index")[2])
    _poke(tmp_path / "0000001.out_of_band.bin", start, 0x7F)  # not a pickle opcode
    return DocumentStorage(tmp_path, DocumentPickleFormat())


def _check_document_error(error: BaseException, directory: Path) -> None:
    message = str(error)
    assert str(directory / "0000001.out_of_band.bin") in message
    assert "document 7 (document 2 of shard 0000001" in message
    assert "invalid load key" in message
    assert "storage.verify()" in message and "rewrite shard 1" in message
    assert isinstance(error.__cause__, pickle.UnpicklingError)


def test_a_corrupt_document_names_the_shard_file_and_document(
    corrupt_documents: DocumentStorage,
) -> None:
    with corrupt_documents.sync_reader() as reader:
        assert reader.read(6) == {"n": 6}
        with pytest.raises(CorruptShardError) as caught:
            reader.read(7)
        _check_document_error(caught.value, corrupt_documents.dir)
        with pytest.raises(CorruptShardError) as caught:
            reader.read_many([0, 9, 7, 1])
        _check_document_error(caught.value, corrupt_documents.dir)


def test_a_corrupt_document_in_a_dataset_batch_names_the_document(
    corrupt_documents: DocumentStorage,
) -> None:
    with DocumentDataset(corrupt_documents).sync_reader() as samples:
        for read in (lambda: samples[7], lambda: samples[5:9], lambda: samples.read_batch([7])):
            with pytest.raises(CorruptShardError) as caught:
                read()
            _check_document_error(caught.value, corrupt_documents.dir)


def test_a_decode_error_is_still_the_formats_own_exception(
    corrupt_documents: DocumentStorage,
) -> None:
    # code written against GuideLoom's raw UnpicklingError keeps catching it
    with corrupt_documents.sync_reader() as reader, pytest.raises(pickle.UnpicklingError):
        reader.read(7)


def test_a_decode_error_survives_pickling(corrupt_documents: DocumentStorage) -> None:
    # errors of process workers travel to the parent as pickles
    with corrupt_documents.sync_reader() as reader, pytest.raises(ShardDecodeError) as caught:
        reader.read(7)
    again = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(again, ShardDecodeError) and isinstance(again, pickle.UnpicklingError)
    assert str(again) == str(caught.value)


class _Refusing(DocumentPickleFormat[Any]):
    """A user format whose ``unpack`` raises its own exception for document ``{"n": 3}``."""

    class Bad(Exception):
        def __init__(self, reason: str, code: int) -> None:  # not built from one message
            super().__init__(reason, code)

    def unpack(self, encoded_data: Any, shard: int) -> Any:
        document = super().unpack(encoded_data, shard)
        if document == {"n": 3}:
            raise self.Bad("checksum field wrong", 3)
        return document


def test_a_user_formats_exception_is_wrapped_with_the_original_chained(tmp_path: Path) -> None:
    shard_kinds.write("document", tmp_path, {0: range(5)})
    storage = DocumentStorage(tmp_path, _Refusing())
    with storage.sync_reader() as reader, pytest.raises(CorruptShardError) as caught:
        reader.read_many([1, 3])
    assert isinstance(caught.value.__cause__, _Refusing.Bad)
    assert "_Refusing.unpack raised Bad" in str(caught.value)
    assert "document 3 (document 3 of shard 0000000" in str(caught.value)


class _StrictPayloads(shard_kinds.PayloadPerElement):
    """Payloads must read ``p<digits>``; anything else raises ``UnicodeDecodeError``."""

    def unpack(
        self,
        stream_data: np.ndarray,
        document_shard: np.ndarray,
        document_index: np.ndarray,
        document_data: Sequence[memoryview],
    ) -> list[tuple[int, str]]:
        for payload in document_data:
            bytes(payload).decode("ascii")
        return super().unpack(stream_data, document_shard, document_index, document_data)


@pytest.fixture
def corrupt_payloads(tmp_path: Path) -> Any:
    """Stream with metadata, 2 shards of 4 elements; payload 1 of shard 1 is not ascii."""
    shard_kinds.write("stream_meta", tmp_path, {0: range(4), 1: range(4, 8)})
    start = int(_index(tmp_path / "0000001.out_of_band.index")[1])
    _poke(tmp_path / "0000001.out_of_band.bin", start, 0xFF)
    return shard_kinds.StreamWithMetaStorage(tmp_path, _StrictPayloads())


def test_a_corrupt_payload_names_the_shard_file_and_payload(corrupt_payloads: Any) -> None:
    path = corrupt_payloads.dir / "0000001.out_of_band.bin"
    with corrupt_payloads.sync_reader() as reader:
        assert len(reader.read(0, 5)) == 5  # payload 0 of shard 1 is fine
        with pytest.raises(CorruptShardError) as caught:
            reader.read(3, 3)  # shard 0's payload 3, shard 1's payloads 0..1
        message = str(caught.value)
        assert f"payloads 0..1 of {path}" in message and "rewrite shard 0, 1" in message
        assert isinstance(caught.value.__cause__, UnicodeDecodeError)
    with StreamDataset(corrupt_payloads, 2).sync_reader() as samples:
        samples[0]
        with pytest.raises(CorruptShardError) as caught:
            samples.read_batch(np.array([0, 2, 1]))
        assert f"payloads 0..1 of {path}" in str(caught.value)
        assert "storage.verify()" in str(caught.value)


# --- a directory where a data file should be ------------------------------------------

BACKENDS = {"mmap": MmapIO, "pread": PosixPreadIO, "seek": SeekIO}
FILE_KINDS = [(kind, suffix) for kind in shard_kinds.KINDS for suffix in shard_kinds.SUFFIXES[kind]]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "guideloom"])
@pytest.mark.parametrize(("kind", "suffix"), FILE_KINDS)
def test_a_directory_where_a_data_file_should_be_is_named_when_the_reader_opens(
    tmp_path: Path, kind: str, suffix: str, recorded: bool, backend: str
) -> None:
    shard_kinds.write(kind, tmp_path, {0: range(3), 1: range(3, 6), 2: range(6, 9)})
    if not recorded:  # as GuideLoom wrote it
        for record in tmp_path.glob("*.shard.json"):
            record.unlink()
    victim = tmp_path / f"0000001{suffix}"
    victim.unlink()
    victim.mkdir()
    storage = shard_kinds.storage(kind, tmp_path)
    storage.read_interface = BACKENDS[backend]()
    with pytest.raises(IsADirectoryError, match=rf"{victim} is a directory.*Move it out"):
        storage.sync_reader().open()


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_byte_reader_opened_on_a_directory_names_it(tmp_path: Path, backend: str) -> None:
    # a directory that appears after the listing: the backend's own error names it
    reader = BACKENDS[backend]().sync_reader()(tmp_path)
    with pytest.raises(IsADirectoryError, match=rf"{tmp_path} is a directory"):
        reader.open()


# --- descriptor limits ----------------------------------------------------------------

SHARDS_PAST_THE_LIMIT = 100  # more shards (of each file kind) than the 64 descriptors allowed

LIMIT_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    from pathlib import Path
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    import shard_kinds
    from guideloom_pipes import DocumentDataset, StreamDataset
    from guideloom_pipes.io import MmapIO, PosixPreadIO, SeekIO

    root, shards = Path(sys.argv[1]), int(sys.argv[3])
    order = np.random.default_rng(0).permutation(shards * 2)  # elements 2k, 2k+1: shard k
    result = {}
    for name, backend in (("mmap", MmapIO), ("pread", PosixPreadIO), ("seek", SeekIO)):
        for kind in shard_kinds.KINDS:
            storage = shard_kinds.storage(kind, root / kind)
            storage.read_interface = backend()
            key = f"{kind}/{name}"
            try:
                everything = shard_kinds.read(kind, root / kind, backend())
                if kind == "document":
                    dataset = DocumentDataset(storage)
                else:
                    dataset = StreamDataset(storage, 1)
                with dataset.sync_reader() as samples:
                    shuffled = samples.read_batch(order)
                    again = samples.read_batch(order[::-1])  # every shard reopened
                result[key] = [
                    everything == shard_kinds.expected(kind, {0: range(shards * 2)}),
                    len(shuffled) == len(again) == shards * 2,
                ]
            except OSError as error:
                result[key] = str(error)
    # every descriptor taken by something else: the reader's error says what to raise
    storage = shard_kinds.storage("stream", root / "stream")
    storage.read_interface = PosixPreadIO()
    hog = []
    with storage.sync_reader() as reader:
        try:
            while True:
                hog.append(open(os.devnull))
        except OSError:
            pass
        try:
            reader.read(0, 4)
            result["exhausted"] = "read"
        except OSError as error:
            result["exhausted"] = str(error)
    for file in hog:
        file.close()
    print(json.dumps(result))
    """
)


def _guideloom_shards(root: Path, shards: int) -> None:
    """Each kind's shards in GuideLoom's layout, written directly (fast): shard ``k`` holds
    the values ``2k, 2k+1``, as :mod:`shard_kinds` stores them."""
    for kind in shard_kinds.KINDS:
        (root / kind).mkdir()
    for k in range(shards):
        values = [2 * k, 2 * k + 1]
        name = f"{k:07d}"
        np.asarray(values, "<i4").tofile(root / "stream" / f"{name}.in_band.bin")
        for kind, payloads in (
            ("document", [pickle.dumps({"n": v}) for v in values]),
            ("stream_meta", [f"p{v}".encode() for v in values]),
        ):
            (root / kind / f"{name}.out_of_band.bin").write_bytes(b"".join(payloads))
            offsets = np.cumsum([0, *map(len, payloads)]).astype("<i8")
            offsets.tofile(root / kind / f"{name}.out_of_band.index")
        records = np.zeros(2, dtype=[("index", "<i4"), ("user", "<i4")])
        records["index"], records["user"] = [0, 1], values
        records.tofile(root / "stream_meta" / f"{name}.in_band.bin")


def test_readers_stay_under_a_64_descriptor_limit_across_100_shards(tmp_path: Path) -> None:
    _guideloom_shards(tmp_path, SHARDS_PAST_THE_LIMIT)
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            LIMIT_SCRIPT,
            str(tmp_path),
            str(Path(__file__).parent),
            str(SHARDS_PAST_THE_LIMIT),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    exhausted = result.pop("exhausted")
    assert result == {
        f"{kind}/{backend}": [True, True]
        for backend in ("mmap", "pread", "seek")
        for kind in shard_kinds.KINDS
    }
    assert exhausted.startswith("[Errno 24] too many open files opening ")
    assert "0000000.in_band.bin" in exhausted and "Raise that limit (ulimit -n" in exhausted


def test_a_read_error_is_not_reported_as_a_decode_error(
    corrupt_documents: DocumentStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guideloom_pipes.storage import io

    readinto = io._PreadReader.readinto

    def failing(self: Any, offset: int, buffer: memoryview) -> int:
        if str(self.path).endswith(".out_of_band.bin"):  # the data file; the index reads
            raise OSError(errno.EIO, "injected I/O error")
        return readinto(self, offset, buffer)

    monkeypatch.setattr(io._PreadReader, "readinto", failing)
    corrupt_documents.read_interface = PosixPreadIO()
    with corrupt_documents.sync_reader() as reader:
        for read in (lambda: reader.read(1), lambda: reader.read_many([1])):
            with pytest.raises(OSError, match="injected") as caught:
                read()
            assert not isinstance(caught.value, CorruptShardError)


# --- files changing under a reader ----------------------------------------------------


@pytest.mark.parametrize(("kind", "suffix"), FILE_KINDS)
def test_verify_names_a_file_truncated_under_an_open_reader(
    tmp_path: Path, kind: str, suffix: str
) -> None:
    shard_kinds.write(kind, tmp_path, {0: range(4), 1: range(4, 8)})
    victim = tmp_path / f"0000001{suffix}"
    size = victim.stat().st_size
    storage = shard_kinds.storage(kind, tmp_path)
    storage.read_interface = PosixPreadIO()  # a mapped read past the new end is a SIGBUS
    with storage.sync_reader() as reader:
        os.truncate(victim, size - 4)
        with pytest.raises(CorruptShardError) as caught:
            reader.verify()
    message = str(caught.value)
    assert f"0000001{suffix} is {size - 4} bytes, committed with {size} bytes (truncated)" in (
        message
    )
    assert "rewrite shard(s) 1" in message and "size mismatch" in message


def test_verify_checks_every_size_before_any_checksum(tmp_path: Path) -> None:
    shard_kinds.write("stream", tmp_path, {0: range(4), 1: range(4, 8)})
    storage = shard_kinds.storage("stream", tmp_path)
    with storage.sync_reader() as reader:
        _poke(tmp_path / "0000000.in_band.bin", 0, 0xFF)  # shard 0: same size, other bytes
        os.truncate(tmp_path / "0000001.in_band.bin", 8)  # shard 1: truncated
        with pytest.raises(CorruptShardError, match="size mismatch") as caught:
            reader.verify()
    assert "0000001.in_band.bin is 8 bytes, committed with 16 bytes" in str(caught.value)
    assert "0000000" not in str(caught.value)  # no checksum was read


@pytest.mark.parametrize("backend", ["pread", "seek"])
@pytest.mark.listing  # its last check is what an open that lists the directory finds
def test_a_byte_range_reader_names_a_stream_file_truncated_while_open(
    tmp_path: Path, backend: str
) -> None:
    # the documented alternative to a memory map's SIGBUS: a clear error
    shard_kinds.write("stream", tmp_path, {0: range(4), 1: range(4, 8)})
    storage = shard_kinds.storage("stream", tmp_path)
    storage.read_interface = BACKENDS[backend]()
    with storage.sync_reader() as reader:
        assert reader.read(0, 8)["tokens"].tolist() == list(range(8))
        os.truncate(tmp_path / "0000001.in_band.bin", 8)
        with pytest.raises(CorruptShardError, match=r"0000001\.in_band\.bin.*shrank while open"):
            reader.read(4, 4)
    with pytest.raises(CorruptShardError, match=r"0000001\.in_band\.bin.*8 bytes.*16 bytes"):
        storage.sync_reader().open()  # a reader opened now refuses the shard at once


# --- corrupt bytes and records, every file kind of every storage ----------------------


def _read_everything(kind: str, storage: Any) -> None:
    """Read every sample the way users and the loader do (a whole span, a shuffled batch)."""
    with storage.sync_reader() as reader:
        total = reader.total_length
        if kind == "document":
            reader.read_many(np.arange(total)[::-1])
            return
        reader.read(0, total)
    with StreamDataset(storage, 2).sync_reader() as samples:
        samples.read_batch(np.arange(len(samples))[::-1])


def _written(kind: str, path: Path, recorded: bool = True) -> Any:
    shard_kinds.write(kind, path, {0: range(4), 1: range(4, 8)})
    if not recorded:
        for record in path.glob("*.shard.json"):
            record.unlink()
    return shard_kinds.storage(kind, path)


@pytest.mark.parametrize(("kind", "suffix"), FILE_KINDS)
def test_changed_bytes_in_any_committed_file_are_named_by_verify(
    tmp_path: Path, kind: str, suffix: str
) -> None:
    storage = _written(kind, tmp_path)
    victim = tmp_path / f"0000001{suffix}"
    _poke(victim, victim.stat().st_size - 1, victim.read_bytes()[-1] ^ 0x55)
    with pytest.raises(CorruptShardError, match=rf"0000001{re.escape(suffix)}: crc32 .*rewrite"):
        storage.verify()


@pytest.mark.listing  # states what an open that lists the directory does
@pytest.mark.parametrize(
    "content",
    [b'{"guideloom_pipes_record": 1, "state": "comm', b"\x00\xff garbage \x13", b""],
    ids=["truncated-json", "garbage", "empty"],
)
@pytest.mark.parametrize("kind", shard_kinds.KINDS)
def test_a_broken_commit_record_is_named_when_the_reader_opens(
    tmp_path: Path, kind: str, content: bytes
) -> None:
    storage = _written(kind, tmp_path)
    (tmp_path / "0000001.shard.json").write_bytes(content)
    with pytest.raises(CorruptShardError, match=r"0000001\.shard\.json is unreadable.*rewrite"):
        storage.sync_reader().open()


@pytest.mark.parametrize("kind", shard_kinds.KINDS)
def test_a_data_file_of_the_wrong_size_is_named_when_the_reader_opens(
    tmp_path: Path, kind: str
) -> None:
    # GuideLoom's files carry no record: the sizes must agree with each other
    storage = _written(kind, tmp_path, recorded=False)
    suffix = shard_kinds.SUFFIXES[kind][0]
    victim = tmp_path / f"0000001{suffix}"
    with victim.open("ab") as file:
        file.write(b"\x01\x02\x03")
    with pytest.raises(CorruptShardError, match=rf"0000001{re.escape(suffix)}.*[Rr]ewrite"):
        _read_everything(kind, storage)


INDEXED = ["document", "stream_meta"]


def _rewrite_index(path: Path, change: Any) -> np.ndarray:
    """Apply ``change`` to shard 1's offsets in place (same file size, as bit rot would)."""
    index_path = path / "0000001.out_of_band.index"
    offsets = _index(index_path)
    change(offsets)
    offsets.astype("<i8").tofile(index_path)
    return offsets


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "guideloom"])
@pytest.mark.parametrize("kind", INDEXED)
def test_index_offsets_that_decrease_are_named(
    tmp_path: Path, kind: str, recorded: bool, backend: str
) -> None:
    storage = _written(kind, tmp_path, recorded)
    storage.read_interface = BACKENDS[backend]()

    def swap(offsets: np.ndarray) -> None:
        offsets[1], offsets[2] = offsets[2], offsets[1]  # entry 1 now ends before it starts

    _rewrite_index(tmp_path, swap)
    with pytest.raises(
        CorruptShardError, match=r"0000001\.out_of_band\.index has decreasing offsets at"
    ):
        _read_everything(kind, storage)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("kind", INDEXED)
def test_index_offsets_past_the_data_file_are_named(
    tmp_path: Path, kind: str, backend: str
) -> None:
    storage = _written(kind, tmp_path)
    storage.read_interface = BACKENDS[backend]()
    size = (tmp_path / "0000001.out_of_band.bin").stat().st_size

    def past(offsets: np.ndarray) -> None:
        offsets[2] = size + 1000

    _rewrite_index(tmp_path, past)
    with pytest.raises(
        CorruptShardError,
        match=rf"0000001\.out_of_band\.index has offsets outside the {size}-byte data file",
    ):
        _read_everything(kind, storage)


@pytest.mark.parametrize("first_or_last", [0, -1])
@pytest.mark.parametrize("kind", INDEXED)
def test_an_index_that_does_not_span_its_data_file_is_named(
    tmp_path: Path, kind: str, first_or_last: int
) -> None:
    storage = _written(kind, tmp_path)

    def shift(offsets: np.ndarray) -> None:
        offsets[first_or_last] += 1

    _rewrite_index(tmp_path, shift)
    with pytest.raises(
        CorruptShardError, match=r"0000001\.out_of_band\.index does not match its data file"
    ):
        _read_everything(kind, storage)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("bad", [4, -1, 2**31 - 1])
def test_a_stream_record_pointing_past_its_payloads_is_named(
    tmp_path: Path, bad: int, backend: str
) -> None:
    storage = _written("stream_meta", tmp_path)
    storage.read_interface = BACKENDS[backend]()
    in_band = tmp_path / "0000001.in_band.bin"
    records = np.fromfile(in_band, dtype=[("index", "<i4"), ("user", "<i4")])
    records["index"][2] = bad  # shard 1 has payloads 0..3
    records.tofile(in_band)
    with pytest.raises(
        CorruptShardError,
        match=rf"0000001\.in_band\.bin has a record pointing at payload {bad}, but "
        rf".*0000001\.out_of_band\.index has 4 entries \(0\.\.3\)",
    ):
        _read_everything("stream_meta", storage)
