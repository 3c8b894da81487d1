"""``ParquetStorage``: Parquet tables written by pyarrow itself, read in place: windows equal
to the rows' tokens concatenated as pyarrow reads them (across row groups and files),
documents equal to the rows, the row lengths scanned once into a sidecar (scanned again
when a file changes), a bounded cache of decoded row groups, and every bad table refused by
name."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from corpus_writers import parquet, parquet_read_back, random_documents, write_parquet

pa, pq = parquet()

from guideloom_pipes import (  # noqa: E402
    DocumentDataset,
    MixtureDataset,
    PackedDataset,
    ParquetStorage,
    StreamDataset,
    open_storage,
)
from guideloom_pipes import progress as progress_module  # noqa: E402
from guideloom_pipes.storage import CorruptShardError, StorageError  # noqa: E402
from guideloom_pipes.storage.corpora import sidecar  # noqa: E402


def _documents_of(seed: int, count: int, dtype: str, empty: bool = True) -> list[np.ndarray]:
    return [d[0] for d in random_documents(seed, count, dtype, longest=12, empty=empty)]


def _three_files(folder: Path, dtype: str = "uint16", **options: Any) -> list[Path]:
    """Three files of 5, 11 and 9 rows (row groups of 3 and 4 rows; some rows empty)."""
    paths = []
    for name, seed, count, rows in (("a", 1, 5, 3), ("b", 2, 11, 4), ("c", 3, 9, 3)):
        documents = _documents_of(seed, count, dtype)
        paths.append(
            write_parquet(
                folder / f"{name}.parquet", documents, dtype, row_group_size=rows, **options
            )
        )
    return paths


def _rows(paths: list[Path], column: str = "input_ids") -> list[list[int]]:
    return [row for path in paths for row in parquet_read_back(path, column)]


def _windows(storage: ParquetStorage, length: int) -> np.ndarray:
    with StreamDataset(storage, length).sync_reader() as reader:
        return reader.read_arrays(np.arange(len(reader))).columns["tokens"]


def _documents(storage: ParquetStorage) -> list[list[int]]:
    with DocumentDataset(storage).sync_reader() as reader:
        return [sample["tokens"].tolist() for sample in reader]


@pytest.mark.parametrize(
    ("dtype", "large"),
    [("uint16", False), ("int32", False), ("int64", True), ("uint8", False), ("int8", True)],
)
def test_windows_and_documents_are_the_rows_as_pyarrow_reads_them(
    tmp_path: Path, dtype: str, large: bool
) -> None:
    paths = _three_files(tmp_path, dtype, large=large)
    storage = ParquetStorage(paths, "input_ids")
    rows = _rows(paths)
    stream = np.array([token for row in rows for token in row], dtype=dtype)
    for length in (1, 5, 13):  # (windows that cross row groups and files)
        windows = _windows(storage, length)
        assert windows.dtype == np.dtype(dtype)
        assert windows.size == len(stream) // length * length
        assert np.array_equal(windows.reshape(-1), stream[: windows.size])
    with StreamDataset(storage, 7).sync_reader() as reader:  # one at a time, and a span
        for index in range(len(reader)):
            assert reader[index]["tokens"].tolist() == stream[index * 7 : index * 7 + 7].tolist()
        assert [w["tokens"].tolist() for w in reader[2:5]] == stream[14:35].reshape(3, 7).tolist()
    assert _documents(storage) == rows
    with storage.sync_reader() as reader:
        assert reader.num_shards == 3
        assert [reader.length(shard) for shard in range(3)] == [
            sum(len(row) for row in parquet_read_back(path)) for path in paths
        ]


def test_tokens_are_read_as_the_dtype_asked_for_and_refused_past_it(tmp_path: Path) -> None:
    documents = [np.array([1, 2, 3], np.uint32), np.array([4, 70000, 6], np.uint32)]
    path = write_parquet(tmp_path / "t.parquet", documents, "uint32", row_group_size=1)
    wide = ParquetStorage(path, "input_ids", dtype="int64")
    assert _windows(wide, 3).dtype == np.int64
    assert _windows(wide, 3).tolist() == [[1, 2, 3], [4, 70000, 6]]
    narrow = ParquetStorage(path, "input_ids", dtype="uint16")
    with StreamDataset(narrow, 3).sync_reader() as reader:
        assert reader[0]["tokens"].tolist() == [1, 2, 3]
        assert reader[0]["tokens"].dtype == np.uint16
        with pytest.raises(StorageError, match=r"token 70000 at element 4 of .*t\.parquet"):
            reader[1]
    with pytest.raises(StorageError, match=r"token 70000 at element 4 of .*t\.parquet"):
        narrow.verify()
    with pytest.raises(ValueError, match="integer dtype"):
        ParquetStorage(path, "input_ids", dtype="float32")


def test_a_uint16_table_blends_with_an_int32_one_read_as_int32(tmp_path: Path) -> None:
    small = write_parquet(tmp_path / "small.parquet", _documents_of(4, 30, "uint16"), "uint16")
    large = write_parquet(tmp_path / "large.parquet", _documents_of(5, 30, "int32"), "int32")
    with pytest.raises(ValueError, match="dtype"):
        MixtureDataset(
            {
                "small": StreamDataset(ParquetStorage(small, "input_ids"), 4),
                "large": StreamDataset(ParquetStorage(large, "input_ids"), 4),
            },
            {"small": 0.5, "large": 0.5},
            seed=0,
        )
    blend = MixtureDataset(
        {
            "small": StreamDataset(ParquetStorage(small, "input_ids", dtype="int32"), 4),
            "large": StreamDataset(ParquetStorage(large, "input_ids"), 4),
        },
        {"small": 0.5, "large": 0.5},
        seed=0,
    )
    with blend.sync_reader() as reader:
        assert reader.read_arrays(np.arange(10)).columns["tokens"].dtype == np.int32


def _sidecars(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(".guideloom_pipes-parquet-")]


def test_the_row_lengths_are_scanned_once_and_kept_in_a_sidecar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _three_files(tmp_path)
    scans = []
    scan = ParquetStorage._scan_files

    def counted(self: ParquetStorage, versions: Any) -> Any:
        scans.append(self.column)
        return scan(self, versions)

    monkeypatch.setattr(ParquetStorage, "_scan_files", counted)
    assert _documents(ParquetStorage(paths, "input_ids")) == _rows(paths)
    assert len(scans) == 1
    [sidecar] = _sidecars(tmp_path)
    written = sidecar.stat().st_mtime_ns
    for _ in range(2):  # later opens read the sidecar
        assert _documents(ParquetStorage(paths, "input_ids")) == _rows(paths)
        assert _windows(ParquetStorage(paths, "input_ids"), 5).size
    assert len(scans) == 1 and sidecar.stat().st_mtime_ns == written
    # a file changed (other rows, another row-group layout): scanned again, never the
    # sidecar's lengths
    write_parquet(paths[1], _documents_of(9, 14, "uint16"), "uint16", row_group_size=5)
    info = paths[1].stat()
    os.utime(paths[1], ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    assert _documents(ParquetStorage(paths, "input_ids")) == _rows(paths)
    assert len(scans) == 2
    stream = np.array([t for row in _rows(paths) for t in row], np.uint16)
    windows = _windows(ParquetStorage(paths, "input_ids"), 6)
    assert np.array_equal(windows.reshape(-1), stream[: windows.size]) and len(scans) == 2


def test_storages_over_other_files_or_columns_keep_their_own_sidecars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _three_files(tmp_path)
    scans = []
    scan = ParquetStorage._scan_files

    def counted(self: ParquetStorage, versions: Any) -> Any:
        scans.append(len(self.files))
        return scan(self, versions)

    monkeypatch.setattr(ParquetStorage, "_scan_files", counted)
    for _ in range(2):  # (the second round reads both sidecars: neither overwrote the other)
        assert _documents(ParquetStorage(paths, "input_ids")) == _rows(paths)
        assert _documents(ParquetStorage(paths[:2], "input_ids")) == _rows(paths[:2])
    assert scans == [3, 2] and len(_sidecars(tmp_path)) == 2


def test_a_directory_it_cannot_write_keeps_the_sidecar_under_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    path = write_parquet(data / "t.parquet", _documents_of(8, 10, "int32"), "int32")
    write = sidecar._write

    def refused_in_data(where: Path, *args: Any) -> bool:
        # (as a read-only directory refuses it; the tests may run as root, who is never refused)
        return False if where.parent == data else write(where, *args)

    monkeypatch.setattr(sidecar, "_write", refused_in_data)
    with pytest.warns(UserWarning, match="could not keep the row lengths"):
        assert _documents(ParquetStorage(path, "input_ids")) == parquet_read_back(path)
    cache = tmp_path / "cache"
    assert _documents(ParquetStorage(path, "input_ids", cache_dir=cache)) == parquet_read_back(path)
    assert len(list(cache.iterdir())) == 1 and sorted(os.listdir(data)) == ["t.parquet"]


def test_the_cache_of_decoded_row_groups_keeps_to_its_bound(tmp_path: Path) -> None:
    # 6 row groups of 4 rows of 10 int64 tokens: 320 bytes each
    documents = [np.arange(10, dtype=np.int64) + 10 * row for row in range(24)]
    path = write_parquet(tmp_path / "t.parquet", documents, "int64", row_group_size=4)
    bound = 2 * 320
    with StreamDataset(ParquetStorage(path, "input_ids", cache_bytes=bound), 5).sync_reader() as r:
        cache = r.storage_reader._io.backend.cache
        for index in range(len(r)):  # in order: each row group decoded once
            assert r[index]["tokens"].tolist() == list(range(index * 5, index * 5 + 5))
            assert cache.nbytes <= bound and len(cache) <= 2
        assert cache.decoded == 6
        for index in (0, 8, 16, 0, 8, 16):  # three groups in turn, two kept: decoded again
            r[index]
        assert cache.decoded == 12 and cache.nbytes <= bound
    with StreamDataset(ParquetStorage(path, "input_ids"), 5).sync_reader() as r:
        cache = r.storage_reader._io.backend.cache
        for index in (0, 8, 16, 0, 8, 16, 47):
            r[index]
        assert cache.decoded == 4 and len(cache) == 4  # (the default bound keeps them all)
    with pytest.raises(ValueError, match="cache_bytes"):
        ParquetStorage(path, "input_ids", cache_bytes=-1)


def _table(path: Path, **columns: Any) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=2)
    return path


@pytest.mark.parametrize(
    ("write", "column", "error", "match"),
    [
        (
            lambda p: _table(p, ids=pa.array([[1, 2]], pa.list_(pa.int32()))),
            "input_ids",
            ValueError,
            r"has no column 'input_ids' \(its columns: ids \(list<element: int32>\)\): "
            r"pass column=",
        ),
        (
            lambda p: _table(p, input_ids=pa.array([[1.5, 2.0]], pa.list_(pa.float32()))),
            "input_ids",
            ValueError,
            r"holds lists of float: token ids are integers; cast the column",
        ),
        (
            lambda p: _table(p, input_ids=pa.array([1, 2, 3], pa.int32())),
            "input_ids",
            ValueError,
            r"is int32: ParquetStorage reads a column of token ids \(a list of integers",
        ),
        (
            lambda p: p.write_bytes(b"not parquet at all"),
            "input_ids",
            CorruptShardError,
            r"is not a Parquet file pyarrow can read",
        ),
    ],
    ids=["missing column", "float lists", "not a list", "not parquet"],
)
def test_a_bad_table_is_refused_naming_it_and_the_fix(
    tmp_path: Path, write: Any, column: str, error: type[Exception], match: str
) -> None:
    path = tmp_path / "bad.parquet"
    write(path)
    with pytest.raises(error, match=match) as caught:
        ParquetStorage(path, column)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([[1, 2], [3], None, [4]], r"row 2 of .*bad\.parquet is null in column 'input_ids'"),
        ([[1, 2], [3], [4, None], [5]], r"row 2 of .*bad\.parquet holds a null token"),
    ],
    ids=["null row", "null token"],
)
def test_nulls_are_refused_naming_the_file_and_the_row(
    tmp_path: Path, rows: list[Any], match: str
) -> None:
    path = _table(tmp_path / "bad.parquet", input_ids=pa.array(rows, pa.list_(pa.int32())))
    storage = ParquetStorage(path, "input_ids")
    with pytest.raises(ValueError, match=match):
        storage.verify()
    assert not _sidecars(tmp_path)


def test_files_that_disagree_or_are_missing_are_refused(tmp_path: Path) -> None:
    first = write_parquet(tmp_path / "a.parquet", _documents_of(1, 3, "uint16"), "uint16")
    second = write_parquet(tmp_path / "b.parquet", _documents_of(2, 3, "int32"), "int32")
    with pytest.raises(ValueError, match=r"different types in the files: .*a\.parquet \(uint16"):
        ParquetStorage([first, second], "input_ids")
    with pytest.raises(FileNotFoundError, match=r"gone\.parquet does not exist"):
        ParquetStorage([first, tmp_path / "gone.parquet"], "input_ids")
    with pytest.raises(TypeError, match="column must be a column name"):
        ParquetStorage(first, 3)  # type: ignore[arg-type]


def test_without_pyarrow_the_error_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_parquet(tmp_path / "t.parquet", _documents_of(1, 3, "uint16"), "uint16")
    for name in [name for name in sys.modules if name.split(".")[0] == "pyarrow"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"pip install pyarrow"):
        ParquetStorage(path, "input_ids")


def test_a_text_column_reads_as_text_documents_and_refuses_windows(tmp_path: Path) -> None:
    texts = ["the first", "", "a third, longer document", "é ü 漢字", "five"]
    path = _table(tmp_path / "t.parquet", text=pa.array(texts), n=pa.array(range(5)))
    storage = ParquetStorage(path, "text")
    with DocumentDataset(storage).sync_reader() as reader:
        assert len(reader) == 5
        assert [sample["text"] for sample in reader] == texts
        assert reader.read_batch(np.array([4, 0])) == [{"text": "five"}, {"text": "the first"}]
    with pytest.raises(TypeError, match=r"holds text .*a tokenizer"):
        StreamDataset(storage, 4).sync_reader().open()
    with pytest.raises(TypeError, match=r"holds text .*a tokenizer"):
        PackedDataset(storage, 8).sync_reader().open()
    with pytest.raises(TypeError, match="drop dtype="):
        ParquetStorage(path, "text", dtype="int32")
    categories = _table(tmp_path / "c.parquet", text=pa.array(texts).dictionary_encode())
    with DocumentDataset(ParquetStorage(categories, "text")).sync_reader() as reader:
        assert [sample["text"] for sample in reader] == texts
    nulls = _table(tmp_path / "n.parquet", text=pa.array(["a", None]))
    with pytest.raises(ValueError, match=r"row 1 of .*n\.parquet is null in column 'text'"):
        ParquetStorage(nulls, "text").verify()


def test_open_storage_recognises_a_parquet_file_and_a_directory_of_them(tmp_path: Path) -> None:
    paths = _three_files(tmp_path)
    one = open_storage(paths[1])
    assert isinstance(one, ParquetStorage) and one.files == [paths[1]]
    assert one.column == "input_ids"
    every = open_storage(tmp_path, dtype="int32")
    assert every.files == paths and every.dtype == np.int32
    assert _documents(every) == _rows(paths)
    with pytest.raises(TypeError, match="drop eos_id="):
        open_storage(tmp_path, eos_id=0)
    # no input_ids / tokens column: the one to read is named
    other = tmp_path / "other"
    other.mkdir()
    _table(other / "t.parquet", ids=pa.array([[1]], pa.list_(pa.int32())), n=pa.array([1]))
    with pytest.raises(ValueError, match=r"its columns: ids \(list<element: int32>\), n \(int64\)"):
        open_storage(other)
    assert _documents(open_storage(other, column="ids")) == [[1]]
    both = tmp_path / "both"
    both.mkdir()
    kind = pa.list_(pa.int32())
    _table(both / "t.parquet", input_ids=pa.array([[1]], kind), tokens=pa.array([[2]], kind))
    with pytest.raises(ValueError, match=r"has both of the token columns .*pass column="):
        open_storage(both)
    assert _documents(open_storage(both, column="tokens")) == [[2]]
    text = tmp_path / "text"
    text.mkdir()
    _table(text / "t.parquet", text=pa.array(["hello"]))
    with DocumentDataset(open_storage(text)).sync_reader() as reader:
        assert reader[0] == {"text": "hello"}


def test_packing_takes_the_document_lengths_from_the_rows(tmp_path: Path) -> None:
    from guideloom_pipes import DocumentPickleFormat, DocumentStorage

    paths = _three_files(tmp_path, "int32")
    copy = DocumentStorage(tmp_path / "copy", DocumentPickleFormat())
    with copy.sync_writer() as writer:
        for row in _rows(paths):
            writer.append(0, {"tokens": np.array(row, np.int32)})
    for seed in (None, 2):
        packed = PackedDataset(ParquetStorage(paths, "input_ids"), 8, seed=seed)
        reference = PackedDataset(copy, 8, seed=seed)
        with packed.sync_reader() as mine, reference.sync_reader() as theirs:
            assert len(mine) == len(theirs) > 5
            for a, b in zip(mine, theirs):
                assert all(np.array_equal(a[k], b[k]) for k in b)


def test_the_fingerprint_changes_with_the_files(tmp_path: Path) -> None:
    paths = _three_files(tmp_path)
    with ParquetStorage(paths, "input_ids").sync_reader() as reader:
        before = reader.fingerprint()
    with ParquetStorage(paths, "input_ids").sync_reader() as reader:
        assert reader.fingerprint() == before
    write_parquet(paths[2], _documents_of(12, 9, "uint16"), "uint16", row_group_size=3)
    with ParquetStorage(paths, "input_ids").sync_reader() as reader:
        assert reader.fingerprint() != before


def test_the_scan_of_the_column_shows_progress_when_asked_and_for_large_tables_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shown = "scanning column 'input_ids' of a.parquet and 2 more files"

    def scan(progress: bool | None, folder: str) -> str:
        """What a first open (a scan) of three new files shows on stderr."""
        (tmp_path / folder).mkdir()
        paths = _three_files(tmp_path / folder)
        assert _documents(ParquetStorage(paths, "input_ids", progress=progress)) == _rows(paths)
        return capsys.readouterr().err

    assert shown in scan(True, "asked")
    assert scan(False, "refused") == ""
    assert scan(None, "small") == ""  # (a few kB: below the automatic threshold)
    monkeypatch.setattr(progress_module, "AUTO_BYTES", 1)
    assert shown in scan(None, "large")
    # a later open reads the sidecar: nothing scanned, nothing shown
    paths = [tmp_path / "asked" / f"{name}.parquet" for name in "abc"]
    _documents(ParquetStorage(paths, "input_ids", progress=True))
    assert capsys.readouterr().err == ""
    with pytest.raises(TypeError, match=r"progress must be True .* got 1"):
        ParquetStorage(tmp_path / "asked", "input_ids", progress=1)  # type: ignore[arg-type]


def test_two_threads_decode_row_groups_of_one_file_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    documents = _documents_of(4, 40, "int32", empty=False)
    path = write_parquet(tmp_path / "one.parquet", documents, "int32", row_group_size=10)
    barrier = threading.Barrier(2, timeout=20)
    decode = pq.ParquetFile.read_row_group

    def meet(self: Any, *args: Any, **kwargs: Any) -> Any:
        barrier.wait()  # (reads of one file one at a time would never meet: broken barrier)
        return decode(self, *args, **kwargs)

    with DocumentDataset(ParquetStorage(path, "input_ids")).sync_reader() as reader:
        monkeypatch.setattr(pq.ParquetFile, "read_row_group", meet)
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda index: reader[index]["tokens"].tolist(), [3, 35]))
    assert got == [documents[3].tolist(), documents[35].tolist()]
