"""``NumpyTokensStorage``: flat token files written by numpy itself (``numpy.save``, raw
``ndarray.tofile``) read in place: every token equal to what ``numpy.load`` / ``numpy.fromfile``
read, documents split at the end-of-document token (found once, kept in a sidecar), and every
bad file refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from guideloom_pipes import (
    DocumentDataset,
    NumpyTokensStorage,
    PackedDataset,
    StreamDataset,
    open_storage,
)
from guideloom_pipes import progress as progress_module
from guideloom_pipes.storage import CorruptShardError, StorageError

EOS = 0


def _tokens(seed: int, count: int, dtype: str) -> np.ndarray:
    """Token ids of ``dtype``, an end-of-document token (0) about every 9th."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, min(np.iinfo(dtype).max, 2**31 - 1), count).astype(dtype)
    tokens[rng.random(count) < 0.11] = EOS
    return tokens


def _split(stream: np.ndarray, eos: int = EOS) -> list[list[int]]:
    """The documents of ``stream``: each ends with ``eos`` (the last may end the stream)."""
    documents: list[list[int]] = []
    current: list[int] = []
    for token in stream.tolist():
        current.append(token)
        if token == eos:
            documents.append(current)
            current = []
    return documents + ([current] if current else [])


def _windows(storage: NumpyTokensStorage, length: int) -> np.ndarray:
    with StreamDataset(storage, length).sync_reader() as reader:
        return reader.read_arrays(np.arange(len(reader))).columns["tokens"]


def _documents(storage: NumpyTokensStorage) -> list[list[int]]:
    with DocumentDataset(storage).sync_reader() as reader:
        return [sample["tokens"].tolist() for sample in reader]


@pytest.mark.parametrize("dtype", ["uint16", "int32", "uint32", "int64", "uint8"])
def test_npy_and_raw_files_read_as_numpy_reads_them(tmp_path: Path, dtype: str) -> None:
    first, second = _tokens(1, 1000, dtype), _tokens(2, 777, dtype)
    np.save(tmp_path / "first.npy", first)
    second.tofile(tmp_path / "second.bin")
    storage = NumpyTokensStorage(
        [tmp_path / "first.npy", tmp_path / "second.bin"], dtype=dtype, eos_id=EOS
    )
    stream = np.concatenate(
        [np.load(tmp_path / "first.npy"), np.fromfile(tmp_path / "second.bin", dtype)]
    )
    windows = _windows(storage, 13)
    assert windows.dtype == np.dtype(dtype)
    assert np.array_equal(windows.reshape(-1), stream[: windows.size])
    assert windows.size == len(stream) // 13 * 13
    assert _documents(storage) == _split(stream)


def test_npy_tokens_are_read_as_the_dtype_asked_for_and_refused_past_it(tmp_path: Path) -> None:
    tokens = np.array([1, 2, 3, 4, 70000, 6], np.uint32)
    np.save(tmp_path / "t.npy", tokens)
    wide = NumpyTokensStorage(tmp_path / "t.npy", dtype="int64")
    assert _windows(wide, 3).dtype == np.int64
    narrow = NumpyTokensStorage(tmp_path / "t.npy", dtype="uint16")
    with StreamDataset(narrow, 3).sync_reader() as reader:
        assert reader[0]["tokens"].tolist() == [1, 2, 3]
        with pytest.raises(StorageError, match=r"token 70000 at element 4 of .*t\.npy"):
            reader[1]


def test_the_document_ends_are_scanned_once_and_kept_beside_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    np.save(tmp_path / "t.npy", _tokens(3, 500, "uint16"))
    expected = _documents(NumpyTokensStorage(tmp_path / "t.npy", eos_id=EOS))
    sidecars = [p for p in tmp_path.iterdir() if p.name.startswith(".guideloom_pipes-eos-")]
    assert len(sidecars) == 1

    def no_scan(self: NumpyTokensStorage, *args: object) -> np.ndarray:
        raise AssertionError("scanned again")

    with monkeypatch.context() as patched:
        patched.setattr(NumpyTokensStorage, "_scan_ends", no_scan)
        assert _documents(NumpyTokensStorage(tmp_path / "t.npy", eos_id=EOS)) == expected
    # another eos, or changed tokens: scanned again, not the sidecar's ends
    stream = np.load(tmp_path / "t.npy")
    stream[5] = 7
    np.save(tmp_path / "t.npy", stream)
    assert _documents(NumpyTokensStorage(tmp_path / "t.npy", eos_id=7)) == _split(stream, 7)
    assert _documents(NumpyTokensStorage(tmp_path / "t.npy", eos_id=EOS)) == _split(stream)


def test_a_directory_it_cannot_write_keeps_the_sidecar_under_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guideloom_pipes.storage.corpora import sidecar

    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "t.npy", _tokens(5, 300, "int32"))
    write = sidecar._write

    def refused_in_data(path: Path, data_bytes: bytes) -> bool:
        # (as a read-only directory refuses it; the tests may run as root, who is never refused)
        return False if path.parent == data else write(path, data_bytes)

    monkeypatch.setattr(sidecar, "_write", refused_in_data)
    with pytest.warns(UserWarning, match="could not keep the document ends"):
        assert _documents(NumpyTokensStorage(data / "t.npy", eos_id=EOS))
    cache = tmp_path / "cache"
    documents = _documents(NumpyTokensStorage(data / "t.npy", eos_id=EOS, cache_dir=cache))
    assert documents == _split(np.load(data / "t.npy"))
    assert len(list(cache.iterdir())) == 1 and sorted(os.listdir(data)) == ["t.npy"]


@pytest.mark.parametrize(
    ("write", "error", "match"),
    [
        (lambda p: np.save(p, np.ones(4, np.float32)), ValueError, r"float32 values"),
        (lambda p: np.save(p, np.ones((2, 3), np.int32)), ValueError, r"shape \(2, 3\)"),
        (lambda p: np.save(p, np.ones(4, ">i4")), ValueError, r"big-endian"),
        (
            lambda p: p.write_bytes(_npy_bytes(np.arange(10, dtype=np.int32))[:-4]),
            CorruptShardError,
            r"its header describes 10 tokens",
        ),
        (lambda p: p.write_bytes(b"not numpy at all"), CorruptShardError, r"not a \.npy file"),
    ],
    ids=["floats", "two dimensions", "big-endian", "truncated", "not npy"],
)
def test_a_bad_npy_file_is_refused_naming_it_and_the_fix(
    tmp_path: Path, write: object, error: type[Exception], match: str
) -> None:
    path = tmp_path / "bad.npy"
    write(path)  # type: ignore[operator]
    with pytest.raises(error, match=match) as caught:
        NumpyTokensStorage(path)
    assert str(path) in str(caught.value)


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def test_raw_files_need_their_dtype_and_whole_tokens(tmp_path: Path) -> None:
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(TypeError, match="pass dtype= the dtype of its tokens"):
        NumpyTokensStorage(tmp_path / "t.bin")
    with pytest.raises(CorruptShardError, match=r"t\.bin is 20 bytes, not a whole number"):
        NumpyTokensStorage(tmp_path / "t.bin", dtype="int64").verify()
    with pytest.raises(ValueError, match=r"eos_id=70000 is outside the files' dtype uint16"):
        NumpyTokensStorage(tmp_path / "t.bin", dtype="uint16", eos_id=70000)
    np.save(tmp_path / "wide.npy", np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError, match="different dtypes"):
        NumpyTokensStorage([tmp_path / "wide.npy", tmp_path / "t.bin"], dtype="uint16")


def test_without_an_eos_there_are_windows_and_no_documents(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.arange(20, dtype=np.int32))
    storage = NumpyTokensStorage(tmp_path / "t.npy")
    assert _windows(storage, 5).tolist()[1] == [5, 6, 7, 8, 9]
    with pytest.raises(TypeError, match="DocumentDataset needs a DocumentStorage"):
        DocumentDataset(storage)


def test_open_storage_recognises_an_npy_file_and_a_directory_of_them(tmp_path: Path) -> None:
    for name, seed in (("b.npy", 6), ("a.npy", 7)):
        np.save(tmp_path / name, _tokens(seed, 50, "uint16"))
    one = open_storage(tmp_path / "b.npy", eos_id=EOS)
    assert isinstance(one, NumpyTokensStorage) and one.files == [tmp_path / "b.npy"]
    every = open_storage(tmp_path, eos_id=EOS, dtype="int32")
    assert every.files == [tmp_path / "a.npy", tmp_path / "b.npy"] and every.dtype == np.int32
    stream = np.concatenate([np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")])
    assert _documents(every) == _split(stream)


def test_packing_takes_the_document_lengths_from_the_eos_scan(tmp_path: Path) -> None:
    from guideloom_pipes import DocumentPickleFormat, DocumentStorage

    tokens = _tokens(8, 2000, "int32")
    np.save(tmp_path / "t.npy", tokens)
    copy = DocumentStorage(tmp_path / "copy", DocumentPickleFormat())
    with copy.sync_writer() as writer:
        for document in _split(tokens):
            writer.append(0, {"tokens": np.array(document, np.int32)})
    for seed in (None, 2):
        packed = PackedDataset(NumpyTokensStorage(tmp_path / "t.npy", eos_id=EOS), 32, seed=seed)
        reference = PackedDataset(copy, 32, seed=seed)
        with packed.sync_reader() as mine, reference.sync_reader() as theirs:
            assert len(mine) == len(theirs) > 10
            for a, b in zip(mine, theirs):
                assert all(np.array_equal(a[k], b[k]) for k in b)


def test_the_eos_scan_shows_progress_when_asked_and_for_large_files_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shown = "finding the documents (eos_id=0) of a.npy and 1 more files"

    def scan(progress: bool | None, folder: str) -> str:
        """What a first open (a scan) of two new files of 6 kB shows on stderr."""
        (tmp_path / folder).mkdir()
        files = [tmp_path / folder / "a.npy", tmp_path / folder / "b.npy"]
        for seed, path in enumerate(files):
            np.save(path, _tokens(seed, 3000, "uint16"))
        _documents(NumpyTokensStorage(files, eos_id=EOS, progress=progress))
        return capsys.readouterr().err

    assert shown in scan(True, "asked")
    assert scan(False, "refused") == ""
    assert scan(None, "small") == ""  # (12 kB: below the automatic threshold)
    monkeypatch.setattr(progress_module, "AUTO_BYTES", 12_000)
    assert shown in scan(None, "large")
    # a later open reads the sidecar: nothing scanned, nothing shown
    files = [tmp_path / "asked" / "a.npy", tmp_path / "asked" / "b.npy"]
    _documents(NumpyTokensStorage(files, eos_id=EOS, progress=True))
    assert capsys.readouterr().err == ""


def test_progress_other_than_true_false_or_none_is_refused_naming_it(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", _tokens(1, 10, "uint16"))
    with pytest.raises(TypeError, match=r"progress must be True .* got 'yes'"):
        NumpyTokensStorage(tmp_path / "t.npy", eos_id=EOS, progress="yes")  # type: ignore[arg-type]
