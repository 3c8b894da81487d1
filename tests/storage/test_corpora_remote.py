"""Corpora at a URL (docs/corpora.md): Megatron indexed datasets, numpy token files and
Parquet tables served by real servers on loopback (nginx over HTTP, moto's S3 server through
s3fs), read in byte ranges pinned to the ETag the open found, exactly as the same files
read locally; what a scan finds kept under ``cache_dir``, never beside the data.

The tests skip when the ``[remote]`` packages or nginx are missing, except under
``GUIDELOOM_PIPES_REQUIRE_SERVERS=1`` (CI), where a server that does not start fails them.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from corpus_writers import megatron, parquet, random_documents, write_megatron, write_parquet
from remote_servers import HttpServer, S3Server

from guideloom_pipes import (
    DocumentDataset,
    MegatronIndexedStorage,
    NumpyTokensStorage,
    ParquetStorage,
    StreamDataset,
    open_storage,
)
from guideloom_pipes.storage import DatasetChangedError
from guideloom_pipes.storage.remote import FsspecIO, RetryPolicy

#: These tests run against servers on loopback (nginx, moto).
pytestmark = pytest.mark.remote

FAST = RetryPolicy(attempts=6, base_delay=0.001, max_delay=0.01, timeout=10)
BUCKET = "corpora"
EOS = 0


class Served:
    """Files put where a server serves them: their URLs and the storages' options."""

    def __init__(self, kind: str, http: HttpServer | None, s3: S3Server | None) -> None:
        self.kind = kind
        self.http = http
        self.s3 = s3

    @property
    def options(self) -> dict[str, Any]:
        return {"storage_options": self.s3.options(), "retry": FAST} if self.s3 else {"retry": FAST}

    def put(self, local: Path, name: str) -> str:
        """Serve the local file or directory ``local`` as ``name``: its URL."""
        if self.http is not None:
            target = self.http.root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if local.is_dir():
                shutil.copytree(local, target)
            else:
                shutil.copyfile(local, target)
            return f"{self.http.url}/{name}"
        assert self.s3 is not None
        fs = self.s3.filesystem()
        if local.is_dir():
            fs.put(f"{local}/", f"{BUCKET}/{name}/", recursive=True)
        else:
            fs.put(str(local), f"{BUCKET}/{name}")
        return f"s3://{BUCKET}/{name}"


@pytest.fixture(params=["http", "s3"])
def served(request: pytest.FixtureRequest) -> Served:
    if request.param == "http":
        return Served("http", request.getfixturevalue("http"), None)
    return Served("s3", None, request.getfixturevalue("s3"))


class Ranges:
    """The byte ranges read through fsspec (``FsspecIO.ranged``), by URL."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, int, str | None]] = []
        original = FsspecIO.ranged

        def ranged(backend: FsspecIO, url: str, start: int, end: int, etag: str | None) -> bytes:
            self.calls.append((url, start, end, etag))
            return original(backend, url, start, end, etag)

        monkeypatch.setattr(FsspecIO, "ranged", ranged)

    def of(self, suffix: str) -> list[tuple[int, int, str | None]]:
        return [(s, e, tag) for url, s, e, tag in self.calls if url.endswith(suffix)]


def _windows(storage: Any, length: int) -> np.ndarray:
    with StreamDataset(storage, length).sync_reader() as reader:
        return reader.read_arrays(np.arange(len(reader))).columns["tokens"]


def _documents(storage: Any) -> list[list[int]]:
    with DocumentDataset(storage).sync_reader() as reader:
        return [sample["tokens"].tolist() for sample in reader]


# --- Megatron -------------------------------------------------------------------------------


def _megatron(folder: Path, seed: int = 1, count: int = 80) -> Path:
    megatron()
    folder.mkdir(parents=True, exist_ok=True)
    documents = random_documents(seed, count, "uint16", sequences=2, longest=60)
    return write_megatron(folder / "corpus_text_document", documents, "uint16")


def _serve_megatron(served: Served, prefix: Path, name: str) -> str:
    served.put(prefix.with_name(prefix.name + ".idx"), f"{name}.idx")
    return served.put(prefix.with_name(prefix.name + ".bin"), f"{name}.bin")[: -len(".bin")]


def test_a_megatron_corpus_at_a_url_reads_as_its_local_files(
    served: Served, tmp_path: Path
) -> None:
    prefix = _megatron(tmp_path / "local", count=24)  # (a ranged request per document read)
    url = _serve_megatron(served, prefix, f"megatron-{served.kind}/web_text_document")
    remote = MegatronIndexedStorage(url, dtype="int32", **served.options)
    local = MegatronIndexedStorage(prefix, dtype="int32")
    assert np.array_equal(_windows(remote, 17), _windows(local, 17))
    assert _documents(remote) == _documents(local)
    with (
        StreamDataset(remote, 17).sync_reader() as there,
        StreamDataset(local, 17).sync_reader() as here,
    ):
        assert there.fingerprint() == here.fingerprint()


def test_the_bin_at_a_url_is_read_in_byte_ranges_pinned_to_its_etag(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = _megatron(tmp_path / "local", count=400)
    url = _serve_megatron(served, prefix, f"ranges-{served.kind}/web_text_document")
    size = os.path.getsize(f"{prefix}.bin")
    ranges = Ranges(monkeypatch)
    with StreamDataset(MegatronIndexedStorage(url, **served.options), 16).sync_reader() as reader:
        reader.read_arrays(np.array([3, len(reader) - 1]))
    reads = ranges.of(".bin")
    assert reads and all(end - start < size for start, end, _ in reads)
    assert sum(end - start for start, end, _ in reads) < size // 4
    assert all(tag for _, _, tag in reads)  # If-Match: every read pinned


def test_a_bin_replaced_after_the_open_is_refused_not_mixed(
    http: HttpServer, tmp_path: Path
) -> None:
    prefix = _megatron(tmp_path / "local")
    served = Served("http", http, None)
    url = _serve_megatron(served, prefix, "replaced/web_text_document")
    with StreamDataset(MegatronIndexedStorage(url, retry=FAST), 8).sync_reader() as reader:
        first = reader[0]["tokens"].tolist()
        data = http.root / "replaced" / "web_text_document.bin"
        replaced = np.fromfile(data, np.uint16)[::-1].copy()
        replaced.tofile(data)  # (same size, new content, new mtime: a new ETag)
        os.utime(data, ns=(0, os.stat(data).st_mtime_ns + 10**9))
        with pytest.raises(DatasetChangedError, match=r"replaced/web_text_document\.bin"):
            reader.read_arrays(np.arange(len(reader)))
    assert first == np.fromfile(f"{prefix}.bin", np.uint16)[:8].tolist()


def test_the_idx_at_a_url_is_kept_in_the_shard_cache_under_cache_dir(
    http: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = _megatron(tmp_path / "local")
    url = _serve_megatron(Served("http", http, None), prefix, "cached/web_text_document")
    expected = _documents(MegatronIndexedStorage(prefix))
    cache = tmp_path / "cache"
    ranges = Ranges(monkeypatch)
    for _ in range(2):
        assert _documents(MegatronIndexedStorage(url, retry=FAST, cache_dir=cache)) == expected
    # downloaded once, then read from the cache (each constructor reads its 34-byte header)
    assert [end - start for start, end, _ in ranges.of(".idx")] == [
        34,
        os.path.getsize(f"{prefix}.idx"),
        34,
    ]
    entries = os.listdir(cache / "entries")
    assert [name.partition("-")[2] for name in entries] == ["web_text_document.idx"]
    assert not any(name.endswith(".bin") for name in entries)  # the .bin: byte ranges


def test_a_missing_idx_or_bin_at_a_url_is_named(http: HttpServer, tmp_path: Path) -> None:
    prefix = _megatron(tmp_path / "local")
    served = Served("http", http, None)
    served.put(Path(f"{prefix}.idx"), "only-idx/corpus.idx")
    with pytest.raises(FileNotFoundError, match=r"only-idx/corpus\.bin does not exist"):
        _documents(MegatronIndexedStorage(f"{http.url}/only-idx/corpus", retry=FAST))
    with pytest.raises(FileNotFoundError, match=r"nothing/corpus\.idx does not exist"):
        MegatronIndexedStorage(f"{http.url}/nothing/corpus", retry=FAST)


def test_local_paths_and_urls_are_not_mixed_and_urls_take_no_read_interface(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="mixes local paths and URLs"):
        MegatronIndexedStorage([tmp_path / "a", "http://127.0.0.1:1/b"])
    with pytest.raises(ValueError, match="URLs of different stores"):
        MegatronIndexedStorage(["s3://one/a", "s3://two/b"])
    with pytest.raises(ValueError, match=r"read_interface=.* cannot read"):
        MegatronIndexedStorage("http://127.0.0.1:1/b", read_interface=object())


# --- numpy token files ------------------------------------------------------------------------


def _tokens(seed: int, count: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 60_000, count).astype(np.uint16)
    tokens[rng.random(count) < 0.1] = EOS
    return tokens


def _serve_numpy(served: Served, folder: Path, name: str) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    # (small: every document read is a ranged request, ~20 ms each against moto's S3)
    np.save(folder / "a.npy", _tokens(1, 1500))
    _tokens(2, 900).tofile(folder / "b.bin")
    return [
        served.put(folder / "a.npy", f"{name}/a.npy"),
        served.put(folder / "b.bin", f"{name}/b.bin"),
    ]


def test_numpy_token_files_at_a_url_read_as_the_local_files(served: Served, tmp_path: Path) -> None:
    urls = _serve_numpy(served, tmp_path / "local", f"numpy-{served.kind}")
    files = [tmp_path / "local" / "a.npy", tmp_path / "local" / "b.bin"]
    local = NumpyTokensStorage(files, dtype="uint16", eos_id=EOS)
    remote = NumpyTokensStorage(
        urls, dtype="uint16", eos_id=EOS, cache_dir=tmp_path / "cache", **served.options
    )
    assert np.array_equal(_windows(remote, 13), _windows(local, 13))
    assert _documents(remote) == _documents(local)


def test_the_eos_scan_of_files_at_a_url_is_kept_under_cache_dir_never_beside_them(
    http: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = _serve_numpy(Served("http", http, None), tmp_path / "local", "numpy-sidecar")
    local = [tmp_path / "local" / "a.npy", tmp_path / "local" / "b.bin"]
    expected = _documents(NumpyTokensStorage(local, dtype="uint16", eos_id=EOS))
    served_before = sorted(os.listdir(http.root / "numpy-sidecar"))
    cache = tmp_path / "cache"
    assert (
        _documents(
            NumpyTokensStorage(urls, dtype="uint16", eos_id=EOS, cache_dir=cache, retry=FAST)
        )
        == expected
    )
    assert [p.name.startswith(".guideloom_pipes-eos-") for p in cache.iterdir()] == [True]
    assert sorted(os.listdir(http.root / "numpy-sidecar")) == served_before == ["a.npy", "b.bin"]

    def no_scan(self: NumpyTokensStorage, *args: object) -> np.ndarray:
        raise AssertionError("scanned again")

    monkeypatch.setattr(NumpyTokensStorage, "_scan_ends", no_scan)
    again = NumpyTokensStorage(urls, dtype="uint16", eos_id=EOS, cache_dir=cache, retry=FAST)
    assert _documents(again) == expected


def test_without_cache_dir_the_eos_scan_at_a_url_warns_that_each_open_scans(
    http: HttpServer, tmp_path: Path
) -> None:
    urls = _serve_numpy(Served("http", http, None), tmp_path / "local", "numpy-nowhere")
    with pytest.warns(UserWarning, match=r"at a URL.*Pass cache_dir="):
        documents = _documents(NumpyTokensStorage(urls, dtype="uint16", eos_id=EOS, retry=FAST))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = [tmp_path / "local" / "a.npy", tmp_path / "local" / "b.bin"]
        assert documents == _documents(NumpyTokensStorage(local, dtype="uint16", eos_id=EOS))


# --- Parquet tables ---------------------------------------------------------------------------


def _tables(folder: Path) -> list[Path]:
    """Two Parquet files of token-id rows (row groups of 16 rows) and a text column."""
    parquet()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for seed, name in ((1, "a.parquet"), (2, "b.parquet")):
        documents = [d[0] for d in random_documents(seed, 60, "int32", longest=50)]
        texts = [f"document {seed}-{k}" for k in range(len(documents))]
        paths.append(
            write_parquet(folder / name, documents, "int32", row_group_size=16, text=texts)
        )
    return paths


def _serve_tables(served: Served, paths: list[Path], name: str) -> list[str]:
    return [served.put(path, f"{name}/{path.name}") for path in paths]


def test_parquet_tables_at_a_url_read_as_the_local_files(served: Served, tmp_path: Path) -> None:
    paths = _tables(tmp_path / "local")
    urls = _serve_tables(served, paths, f"parquet-{served.kind}")
    cache = tmp_path / "cache"
    remote = ParquetStorage(urls, "input_ids", cache_dir=cache, **served.options)
    local = ParquetStorage(paths, "input_ids")
    assert np.array_equal(_windows(remote, 11), _windows(local, 11))
    assert _documents(remote) == _documents(local)
    assert [p.name.startswith(".guideloom_pipes-parquet-") for p in cache.iterdir()] == [True]
    text = ParquetStorage(urls, "text", **served.options)
    with DocumentDataset(text).sync_reader() as reader:
        assert reader[61] == {"text": "document 2-1"} and len(reader) == 120


def test_a_parquet_directory_is_listed_on_s3_and_refused_over_http(
    s3: S3Server, http: HttpServer, tmp_path: Path
) -> None:
    paths = _tables(tmp_path / "local")
    _serve_tables(Served("s3", None, s3), paths, "listed")
    storage = ParquetStorage(f"s3://{BUCKET}/listed", "input_ids", storage_options=s3.options())
    assert [path.name for path in storage.files] == ["a.parquet", "b.parquet"]
    with pytest.warns(UserWarning, match="at a URL"):
        assert _documents(storage) == _documents(ParquetStorage(paths, "input_ids"))
    _serve_tables(Served("http", http, None), paths, "unlisted")
    with pytest.raises(ValueError, match=r"http:// cannot list a directory: give the URLs"):
        ParquetStorage(f"{http.url}/unlisted", "input_ids", retry=FAST)


def test_parquet_at_a_url_reads_the_row_groups_it_needs_in_pinned_ranges(
    http: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parquet()
    (tmp_path / "local").mkdir()
    documents = [d[0] for d in random_documents(3, 3000, "int32", longest=200)]
    path = write_parquet(tmp_path / "local" / "big.parquet", documents, "int32", row_group_size=200)
    [url] = _serve_tables(Served("http", http, None), [path], "parquet-ranges")
    storage = ParquetStorage(url, "input_ids", cache_dir=tmp_path / "cache", retry=FAST)
    _documents(storage)  # (the first open scans the column: every row group)
    ranges = Ranges(monkeypatch)
    with DocumentDataset(storage).sync_reader() as reader:
        assert reader[2100]["tokens"].tolist() == documents[2100].tolist()
    reads = ranges.of("big.parquet")
    assert reads and all(tag for _, _, tag in reads)  # If-Match: every read pinned
    # the footer and the one row group of row 2100, not the file
    assert sum(end - start for start, end, _ in reads) < os.path.getsize(path) // 4
    # the file replaced on the server after the open: refused, never mixed
    with DocumentDataset(storage).sync_reader() as reader:
        reader[0]
        served = http.root / "parquet-ranges" / "big.parquet"
        write_parquet(served, documents[::-1], "int32", row_group_size=200)
        os.utime(served, ns=(0, os.stat(served).st_mtime_ns + 10**9))
        with pytest.raises(DatasetChangedError, match=r"parquet-ranges/big\.parquet"):
            reader[2100]


def test_open_storage_tells_a_corpus_at_a_url_by_its_files_suffix(
    http: HttpServer, tmp_path: Path
) -> None:
    served = Served("http", http, None)
    prefix = _megatron(tmp_path / "megatron")
    url = _serve_megatron(served, prefix, "opened/web_text_document")
    megatron_corpus = open_storage(f"{url}.bin", dtype="int32", retry=FAST)
    assert isinstance(megatron_corpus, MegatronIndexedStorage)
    assert _documents(megatron_corpus) == _documents(MegatronIndexedStorage(prefix))
    [npy, _] = _serve_numpy(served, tmp_path / "numpy", "opened-numpy")
    numpy_corpus = open_storage(npy, eos_id=EOS, cache_dir=tmp_path / "cache", retry=FAST)
    assert isinstance(numpy_corpus, NumpyTokensStorage) and numpy_corpus.eos_id == EOS
    [table, _] = _serve_tables(served, _tables(tmp_path / "tables"), "opened-parquet")
    parquet_corpus = open_storage(table, retry=FAST, cache_dir=tmp_path / "cache")
    assert isinstance(parquet_corpus, ParquetStorage) and parquet_corpus.column == "input_ids"
    with pytest.raises(TypeError, match=r"eos_id=0 splits flat token files.*Parquet"):
        open_storage(table, eos_id=EOS, retry=FAST)


def test_a_loader_reads_a_corpus_at_a_url_in_worker_processes(
    http: HttpServer, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from guideloom_pipes import StatefulDataLoader

    prefix = _megatron(tmp_path / "local", count=200)
    url = _serve_megatron(Served("http", http, None), prefix, "workers/web_text_document")

    def batches(storage: Any, **workers: Any) -> list[list[list[int]]]:
        loader = StatefulDataLoader.from_storage(
            storage,
            None,
            sequence_length=16,
            local_batch_size=4,
            shuffle=True,
            shuffle_seed=3,
            prefetch=2,
            device="cpu",
            **workers,
        )
        with loader:
            return [batch["tokens"].tolist() for batch in loader]

    remote = MegatronIndexedStorage(url, retry=FAST, cache_dir=tmp_path / "cache")
    expected = batches(MegatronIndexedStorage(prefix))
    assert batches(remote, num_workers=2, parallel_method="process") == expected
