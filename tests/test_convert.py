"""convert: a Parquet text table (tokenized with a tokenizer trained here), a Megatron corpus,
numpy token files and a dataset of ours written as our storage, every token what the source's
own tool reads back (and the tokenizer's own encode), EOS per document; a rerun skips the
committed shards; a process pool and a Dask LocalCluster write byte for byte what a serial run
writes; bad input is refused naming the value and the fix."""

from __future__ import annotations

import concurrent.futures as cf
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from corpus_writers import (
    megatron_read_back,
    parquet_read_back,
    random_documents,
    write_megatron,
    write_parquet,
)
from tokenizer_helpers import expected, texts, train_tokenizer

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    StreamNumpyFormat,
    StreamStorage,
    WriteParallelError,
    convert,
    open_storage,
)
from guideloom_pipes.tokenizing import load_tokenizer


class SerialExecutor(cf.Executor):
    """Runs every job at once in the caller: the serial reference."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        future: cf.Future[Any] = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:
            future.set_exception(error)
        return future


SERIAL = {"executor": SerialExecutor(), "progress": False}


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _stream(path: Path) -> np.ndarray:
    storage = open_storage(path)
    assert isinstance(storage, StreamStorage)
    with storage.sync_reader() as reader:
        return reader.read(0, reader.total_length)["tokens"]


def _documents(path: Path) -> list[list[int]]:
    storage = open_storage(path)
    assert isinstance(storage, DocumentStorage)
    with DocumentDataset(storage).sync_reader() as reader:
        return [document["tokens"].tolist() for document in reader]


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    train_tokenizer(tmp_path / "tokenizer.json")
    return tmp_path / "tokenizer.json"


@pytest.fixture
def table(tmp_path: Path) -> tuple[Path, list[str]]:
    """Two Parquet files of a text column (row groups of 4 rows), written by pyarrow."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "web"
    folder.mkdir()
    pq.write_table(pa.table({"text": texts(1, 13)}), folder / "a.parquet", row_group_size=4)
    pq.write_table(pa.table({"text": texts(2, 9)}), folder / "b.parquet", row_group_size=4)
    read = [
        text
        for name in ("a", "b")
        for text in pq.read_table(folder / f"{name}.parquet").column("text").to_pylist()
    ]
    return folder, read


def test_a_parquet_text_table_becomes_the_tokenizers_ids_with_eos_per_document(
    tmp_path: Path, tokenizer_file: Path, table: tuple[Path, list[str]]
) -> None:
    folder, read = table
    tokenizer = load_tokenizer(tokenizer_file)
    want = expected(tokenizer, read, eos=1)
    report = convert(folder, tmp_path / "out", tokenizer=tokenizer_file, eos_id="</s>", **SERIAL)
    assert report.written == [0, 1]  # one shard per file (a record per 256 documents)
    assert _stream(tmp_path / "out").tolist() == [t for ids in want for t in ids]
    assert open_storage(tmp_path / "out").format == StreamNumpyFormat(
        np.dtype([("tokens", "<u2")])  # (a vocabulary of 400: uint16 by default)
    )
    convert(folder, tmp_path / "docs", tokenizer=tokenizer_file, eos_id=1, documents=True, **SERIAL)
    assert _documents(tmp_path / "docs") == want


def test_without_eos_id_nothing_is_appended_and_dtype_is_the_one_given(
    tmp_path: Path, tokenizer_file: Path, table: tuple[Path, list[str]]
) -> None:
    folder, read = table
    convert(folder, tmp_path / "out", tokenizer=tokenizer_file, dtype="int32", **SERIAL)
    tokens = _stream(tmp_path / "out")
    assert tokens.dtype == np.int32
    want = expected(load_tokenizer(tokenizer_file), read, eos=None)
    assert tokens.tolist() == [t for ids in want for t in ids]


def test_a_megatron_corpus_is_written_as_megatron_reads_it_with_eos_appended(
    tmp_path: Path,
) -> None:
    documents = random_documents(3, 20, "uint16", sequences=2, longest=9)
    prefix = write_megatron(tmp_path / "corpus_text_document", documents, "uint16")
    _, read = megatron_read_back(prefix)
    convert(prefix, tmp_path / "docs", eos_id=7, dtype="int32", documents=True, **SERIAL)
    assert _documents(tmp_path / "docs") == [[*d.tolist(), 7] for d in read]
    convert(prefix, tmp_path / "stream", **SERIAL)  # (no eos_id: the tokens as they are)
    stream = _stream(tmp_path / "stream")
    assert stream.dtype == np.uint16 and stream.tolist() == np.concatenate(read).tolist()
    with cf.ProcessPoolExecutor(2) as pool:
        options = {"eos_id": 7, "dtype": "int32", "documents": True, "shard_documents": 6}
        convert(prefix, tmp_path / "serial", **options, **SERIAL)
        convert(prefix, tmp_path / "pool", **options, executor=pool, progress=False)
    assert _files(tmp_path / "pool") == _files(tmp_path / "serial")


def test_numpy_token_files_are_copied_and_split_at_their_eos(tmp_path: Path) -> None:
    first = np.array([5, 6, 0, 7, 8, 9, 0, 1], np.uint16)
    second = np.array([2, 3, 0, 4], np.uint16)
    np.save(tmp_path / "00.npy", first)
    np.save(tmp_path / "01.npy", second)
    files = [tmp_path / "00.npy", tmp_path / "01.npy"]
    report = convert(files[0], tmp_path / "one", **SERIAL)
    assert (
        report.written == [0] and _stream(tmp_path / "one").tolist() == np.load(files[0]).tolist()
    )
    (tmp_path / "npy").mkdir()
    for file in files:
        file.rename(tmp_path / "npy" / file.name)
    convert(tmp_path / "npy", tmp_path / "docs", eos_id=0, documents=True, **SERIAL)
    # (their documents end with the EOS already: nothing is appended)
    assert _documents(tmp_path / "docs") == [[5, 6, 0], [7, 8, 9, 0], [1, 2, 3, 0], [4]]
    with pytest.raises(ValueError, match=r"no document boundaries.*give eos_id="):
        convert(tmp_path / "npy", tmp_path / "nope", documents=True, **SERIAL)
    with cf.ProcessPoolExecutor(2) as pool:
        options = {"eos_id": 0, "documents": True, "shard_documents": 1}
        convert(tmp_path / "npy", tmp_path / "serial", **options, **SERIAL)
        convert(tmp_path / "npy", tmp_path / "pool", **options, executor=pool, progress=False)
    assert _files(tmp_path / "pool") == _files(tmp_path / "serial")


def test_a_dataset_of_ours_is_converted_too(tmp_path: Path) -> None:
    source = StreamStorage(tmp_path / "ours", StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    with source.sync_writer() as writer:
        for shard in range(3):
            writer.append(shard, {"tokens": np.arange(10 * shard, 10 * shard + 10)})
    report = convert(tmp_path / "ours", tmp_path / "out", dtype="uint8", shard_tokens=4, **SERIAL)
    assert len(report.written) == 9  # (three shards of 10 tokens, in pieces of at most 4)
    assert _stream(tmp_path / "out").tolist() == list(range(30))
    with pytest.raises(ValueError, match=r"eos_id=0 is appended to each document, but .* is a "):
        convert(tmp_path / "ours", tmp_path / "out", eos_id=0, **SERIAL)
    with pytest.raises(ValueError, match=r"is the source itself: .* give another directory"):
        convert(tmp_path / "ours", str(tmp_path / "ours"), **SERIAL)


def test_a_parquet_token_column_is_copied_with_eos_appended(tmp_path: Path) -> None:
    documents = [np.array(d[0]) for d in random_documents(4, 11, "int32", longest=6)]
    write_parquet(tmp_path / "t.parquet", documents, "int32", row_group_size=3)
    read = parquet_read_back(tmp_path / "t.parquet")
    report = convert(
        tmp_path / "t.parquet", tmp_path / "out", eos_id=0, shard_documents=4, **SERIAL
    )
    assert report.written == [0, 1, 2]
    assert _stream(tmp_path / "out").tolist() == [t for row in read for t in [*row, 0]]


def test_text_documents_of_ours_are_tokenized_too(tmp_path: Path, tokenizer_file: Path) -> None:
    documents = texts(3, 7)
    source = DocumentStorage(tmp_path / "ours", DocumentPickleFormat())
    with source.sync_writer() as writer:
        for index, text in enumerate(documents):
            writer.append(index % 2, {"text": text})
    convert(tmp_path / "ours", tmp_path / "out", tokenizer=tokenizer_file, eos_id=1, **SERIAL)
    with DocumentDataset(source).sync_reader() as reader:
        read = [document["text"] for document in reader]  # (shard 0's, then shard 1's)
    want = expected(load_tokenizer(tokenizer_file), read, eos=1)
    assert _stream(tmp_path / "out").tolist() == [t for ids in want for t in ids]


def test_each_worker_loads_the_tokenizer_once(
    tmp_path: Path, tokenizer_file: Path, table: tuple[Path, list[str]], monkeypatch: Any
) -> None:
    import tokenizers

    folder, _ = table
    loads = []
    real = tokenizers.Tokenizer.from_file

    def counted(path: str) -> Any:
        loads.append(path)
        return real(path)

    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", counted)
    report = convert(
        folder, tmp_path / "out", tokenizer=tokenizer_file, shard_documents=2, **SERIAL
    )
    assert len(report.written) == 12 and loads == [str(tokenizer_file)]


def test_a_large_file_is_split_into_shards_of_at_most_shard_documents(
    tmp_path: Path, tokenizer_file: Path, table: tuple[Path, list[str]]
) -> None:
    folder, read = table
    report = convert(
        folder, tmp_path / "out", tokenizer=tokenizer_file, shard_documents=4, **SERIAL
    )
    assert report.written == list(range(7))  # 13 rows: 4 shards; 9 rows: 3 shards
    want = expected(load_tokenizer(tokenizer_file), read, eos=None)
    assert _stream(tmp_path / "out").tolist() == [t for ids in want for t in ids]


def test_a_rerun_skips_the_committed_shards_and_redoes_a_missing_or_changed_one(
    tmp_path: Path, tokenizer_file: Path, table: tuple[Path, list[str]]
) -> None:
    folder, _ = table
    out = tmp_path / "out"
    convert(folder, out, tokenizer=tokenizer_file, eos_id=1, shard_documents=5, **SERIAL)
    written = _files(out)
    again = convert(folder, out, tokenizer=tokenizer_file, eos_id=1, shard_documents=5, **SERIAL)
    assert (again.written, again.skipped) == ([], [0, 1, 2, 3, 4])
    for name in [n for n in written if n.startswith("0000002.")]:
        (out / name).unlink()
    again = convert(folder, out, tokenizer=tokenizer_file, eos_id=1, shard_documents=5, **SERIAL)
    assert (again.written, again.skipped) == ([2], [0, 1, 3, 4])
    assert _files(out) == written
    other = convert(folder, out, tokenizer=tokenizer_file, eos_id=0, shard_documents=5, **SERIAL)
    assert other.written == [0, 1, 2, 3, 4]  # (another EOS: every shard rewritten)


def test_a_process_pool_writes_byte_for_byte_what_a_serial_run_writes(
    tmp_path: Path, tokenizer_file: Path, table: tuple[Path, list[str]]
) -> None:
    folder, _ = table
    options = {"tokenizer": tokenizer_file, "eos_id": 1, "shard_documents": 3}
    convert(folder, tmp_path / "serial", **options, **SERIAL)
    with cf.ProcessPoolExecutor(2) as pool:
        report = convert(folder, tmp_path / "pool", **options, executor=pool, progress=False)
    assert len(report.written) == 8
    assert _files(tmp_path / "pool") == _files(tmp_path / "serial")


@pytest.fixture(scope="module")
def dask_client() -> Iterator[Any]:
    distributed = pytest.importorskip("dask.distributed")
    cluster = distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        worker_dashboard_address=None,
    )
    try:
        client = distributed.Client(cluster)
        try:
            yield client
        finally:
            client.close()
    finally:
        cluster.close()


def test_a_dask_local_cluster_writes_byte_for_byte_what_a_serial_run_writes(
    tmp_path: Path, tokenizer_file: Path, table: tuple[Path, list[str]], dask_client: Any
) -> None:
    folder, _ = table
    options = {"tokenizer": tokenizer_file, "eos_id": 1, "shard_documents": 3}
    convert(folder, tmp_path / "serial", documents=True, **options, **SERIAL)
    executor = dask_client.get_executor()
    report = convert(
        folder, tmp_path / "dask", documents=True, **options, executor=executor, progress=False
    )
    assert len(report.written) == 8
    assert _files(tmp_path / "dask") == _files(tmp_path / "serial")


# --- bad input ------------------------------------------------------------------------------------


def test_text_without_a_tokenizer_and_a_tokenizer_for_tokens_are_refused(
    tmp_path: Path, tokenizer_file: Path, table: tuple[Path, list[str]]
) -> None:
    folder, _ = table
    with pytest.raises(TypeError, match=r"holds text.*give tokenizer="):
        convert(folder, tmp_path / "out", **SERIAL)
    np.save(tmp_path / "tokens.npy", np.arange(5, dtype=np.uint16))
    with pytest.raises(TypeError, match=r"holds token ids already.*drop tokenizer="):
        convert(tmp_path / "tokens.npy", tmp_path / "out", tokenizer=tokenizer_file, **SERIAL)
    assert not (tmp_path / "out").exists()


def test_a_missing_tokenizer_file_is_refused_naming_it(
    tmp_path: Path, table: tuple[Path, list[str]]
) -> None:
    folder, _ = table
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"tokenizer file {missing} does not exist")
    ):
        convert(folder, tmp_path / "out", tokenizer=missing, **SERIAL)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json is not a tokenizer file"):
        convert(folder, tmp_path / "out", tokenizer=tmp_path / "bad.json", **SERIAL)


def test_a_token_id_past_the_dtype_is_refused_naming_it_and_its_document(
    tmp_path: Path, tokenizer_file: Path, table: tuple[Path, list[str]]
) -> None:
    folder, read = table
    ids = expected(load_tokenizer(tokenizer_file), read, eos=None)
    first = next(i for i, d in enumerate(ids) if max(d, default=0) > 255)
    with pytest.raises(WriteParallelError) as caught:
        convert(folder, tmp_path / "out", tokenizer=tokenizer_file, dtype="uint8", **SERIAL)
    bad = next(t for t in ids[first] if t > 255)
    assert f"token id {bad} of document {first} of ParquetStorage(" in str(caught.value)
    assert "does not fit dtype=uint8 (0..255): give a wider dtype=" in str(caught.value)
    with pytest.raises(ValueError, match=r"token id 300 of eos_id=300 does not fit dtype=uint8"):
        convert(folder, tmp_path / "o", tokenizer=tokenizer_file, dtype="uint8", eos_id=300)


def test_an_eos_token_the_tokenizer_lacks_is_refused(
    tmp_path: Path, tokenizer_file: Path, table: tuple[Path, list[str]]
) -> None:
    folder, _ = table
    with pytest.raises(ValueError, match="eos_id='<eos>' is not a token of the tokenizer"):
        convert(folder, tmp_path / "out", tokenizer=tokenizer_file, eos_id="<eos>", **SERIAL)


def test_without_tokenizers_installed_the_error_says_how_to_install_it(
    tmp_path: Path, table: tuple[Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = table
    (tmp_path / "t.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        convert(folder, tmp_path / "out", tokenizer=tmp_path / "t.json", **SERIAL)
