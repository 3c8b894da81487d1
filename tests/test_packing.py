"""PackedDataset: windows and boundaries against a slow pure-Python reference (streams and
documents, storage and seeded order), the prefix-sum sidecar (written, reused, rebuilt when
the dataset changes, cache_dir fallback, ignored by listing and verify), refusals (torch-free)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from storage_formats import ChunkMetaFormat

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    MixtureDataset,
    PackedDataset,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
    StreamWithMetaStorage,
    packing_index,
)
from guideloom_pipes import packing as packing_module
from guideloom_pipes.packing import IGNORE_INDEX
from guideloom_pipes.packing_index import _order_key
from guideloom_pipes.shuffle import FeistelPermutation

EOS = 99


def reference_windows(tokens: list[int], owner: list[int], length: int) -> list[dict[str, Any]]:
    """The slow reference: windows of a token list whose document of each token is known."""
    out = []
    for i in range(len(tokens) // length):
        window = tokens[i * length : (i + 1) * length]
        docs = owner[i * length : (i + 1) * length]
        positions, document_ids, labels = [], [], []
        for j in range(length):
            new = j == 0 or docs[j] != docs[j - 1]
            positions.append(0 if new else positions[-1] + 1)
            document_ids.append(0 if j == 0 else document_ids[-1] + (1 if new else 0))
            same_next = j + 1 < length and docs[j + 1] == docs[j]
            labels.append(window[j + 1] if same_next else IGNORE_INDEX)
        out.append(
            {
                "tokens": window,
                "position_ids": positions,
                "document_ids": document_ids,
                "labels": labels,
            }
        )
    return out


def reference_documents(
    documents: list[list[int]], length: int, eos: int | None, order: list[int]
) -> list[dict[str, Any]]:
    tokens: list[int] = []
    owner: list[int] = []
    for k, d in enumerate(order):
        piece = list(documents[d]) + ([eos] if eos is not None else [])
        tokens += piece
        owner += [k] * len(piece)
    return reference_windows(tokens, owner, length)


def reference_stream(tokens: list[int], length: int, eos: int) -> list[dict[str, Any]]:
    owner, document = [], 0
    for token in tokens:
        owner.append(document)
        if token == eos:
            document += 1
    return reference_windows(tokens, owner, length)


def as_lists(samples: list[dict[str, np.ndarray]]) -> list[dict[str, list[int]]]:
    for sample in samples:
        assert set(sample) == {"tokens", "position_ids", "document_ids", "labels"}
        assert all(v.dtype == np.int64 for v in sample.values())
    return [{k: v.tolist() for k, v in sample.items()} for sample in samples]


def read_all(dataset: PackedDataset) -> list[dict[str, list[int]]]:
    with dataset.sync_reader() as reader:
        return as_lists(reader.read_batch(np.arange(len(reader))))


documents_st = st.lists(st.lists(st.integers(0, 50), max_size=15), max_size=25)


@settings(max_examples=150, deadline=None)
@given(
    documents=documents_st,
    length=st.integers(1, 12),
    eos=st.sampled_from([None, EOS]),
    seed=st.one_of(st.none(), st.integers(0, 2**40)),
)
def test_document_windows_match_the_slow_reference(documents, length, eos, seed):
    order = list(range(len(documents)))
    if seed is not None and documents:
        permutation = FeistelPermutation(len(documents), _order_key(seed))
        order = [permutation(p) for p in order]
    expected = reference_documents(documents, length, eos, order)
    dataset = PackedDataset(documents, length, eos_token=eos, seed=seed)
    assert len(dataset) == len(expected)
    got = read_all(dataset)
    assert got == expected
    if expected:  # one window at a time, and in a shuffled batch, read the same
        with dataset.sync_reader() as reader:
            assert as_lists([reader[len(expected) - 1]]) == [expected[-1]]
            ids = np.arange(len(expected))[::-1]
            assert as_lists(reader.read_batch(ids)) == [expected[i] for i in ids]


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.sampled_from([1, 2, 3, EOS]), min_size=1, max_size=120),
    length=st.integers(1, 12),
    split=st.integers(0, 120),
)
def test_stream_windows_match_the_slow_reference(tokens, length, split):
    with tempfile.TemporaryDirectory() as tmp:
        storage = StreamStorage(Path(tmp), StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
        split = min(split, len(tokens))
        with storage.sync_writer() as writer:  # windows may cross the shard boundary
            writer.append(0, {"tokens": np.array(tokens[:split] or tokens, dtype="<i4")})
            if split and tokens[split:]:
                writer.append(1, {"tokens": np.array(tokens[split:], dtype="<i4")})
        expected = reference_stream(tokens, length, EOS)
        dataset = PackedDataset(storage, length, eos_token=EOS)
        assert len(dataset) == len(expected)
        assert read_all(dataset) == expected


def test_an_eos_outside_the_streams_dtype_never_ends_a_document(tmp_path):
    storage = StreamStorage(tmp_path / "s", StreamNumpyFormat(np.dtype([("tokens", "<i2")])))
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(8, dtype="<i2")})
    (sample,) = read_all(PackedDataset(storage, 8, eos_token=70_000))
    assert sample["document_ids"] == [0] * 8


def test_samples_pickle_as_plain_dicts():
    import pickle

    with PackedDataset([[1, 2, 3, 4]], 2).sync_reader() as reader:
        sample = reader[0]
    copy = pickle.loads(pickle.dumps(sample))
    assert type(copy) is dict
    assert {k: v.tolist() for k, v in copy.items()} == {k: v.tolist() for k, v in sample.items()}


def test_a_window_by_hand():
    dataset = PackedDataset([[5, 6, 7], [8], [9, 10, 11, 12]], 4, eos_token=0)
    # concatenation: 5 6 7 0 | 8 0 9 10 | 11 12 0 (dropped: 3 of 4)
    first, second = read_all(dataset)
    assert first == {
        "tokens": [5, 6, 7, 0],
        "position_ids": [0, 1, 2, 3],
        "document_ids": [0, 0, 0, 0],
        "labels": [6, 7, 0, IGNORE_INDEX],
    }
    assert second == {
        "tokens": [8, 0, 9, 10],
        "position_ids": [0, 1, 0, 1],
        "document_ids": [0, 0, 1, 1],
        "labels": [0, IGNORE_INDEX, 10, IGNORE_INDEX],
    }


def test_documents_as_dicts_use_the_field():
    documents = [{"ids": np.array([1, 2])}, {"ids": np.array([3, 4])}]
    dataset = PackedDataset(documents, 2, field="ids")
    assert [s["tokens"] for s in read_all(dataset)] == [[1, 2], [3, 4]]
    with pytest.raises(KeyError, match=r"no 'tokens' field.*field="):
        len(PackedDataset(documents, 2))


def test_a_seed_orders_the_documents_and_every_document_appears_once():
    documents = [[k] * 3 for k in range(40)]
    plain = [s["tokens"][0] for s in read_all(PackedDataset(documents, 3))]
    seeded = [s["tokens"][0] for s in read_all(PackedDataset(documents, 3, seed=1))]
    other = [s["tokens"][0] for s in read_all(PackedDataset(documents, 3, seed=2))]
    assert plain == list(range(40))
    assert sorted(seeded) == sorted(other) == plain
    assert seeded != plain and seeded != other


def test_packed_windows_are_a_component_of_a_mixture():
    a = PackedDataset([[1, 2, 3]] * 10, 4, eos_token=0)
    b = PackedDataset([[7, 8]] * 10, 4, eos_token=0)
    mixture = MixtureDataset({"a": a, "b": b}, {"a": 1, "b": 1}, seed=0)
    component, index = mixture.locate(np.arange(len(mixture)))
    with mixture.sync_reader() as reader:
        samples = as_lists(reader.read_batch(np.arange(len(mixture))))
    for c, i, sample in zip(component.tolist(), index.tolist(), samples):
        assert sample == read_all([a, b][c])[i]


# -- the sidecar ----------------------------------------------------------------------------


def write_documents(directory: Path, documents: list[list[int]], shards: int = 2) -> None:
    storage = DocumentStorage(directory, DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for k, document in enumerate(documents):
            writer.append(k * shards // max(1, len(documents)), document)


def sidecars(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "guideloom-packing" in p.name)


@pytest.fixture
def documents_dir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 9, rng.integers(0, 20)).tolist() for _ in range(60)]
    write_documents(tmp_path / "docs", documents)
    return tmp_path / "docs"


def _storage(directory: Path) -> DocumentStorage:
    return DocumentStorage(directory, DocumentPickleFormat())


def _documents(directory: Path) -> list[list[int]]:
    with DocumentDataset(_storage(directory)).sync_reader() as reader:
        return list(reader)


@pytest.mark.parametrize("seed", [None, 3])
def test_the_sidecar_is_written_once_and_reused(documents_dir, monkeypatch, seed):
    documents = _documents(documents_dir)
    dataset = PackedDataset(_storage(documents_dir), 5, eos_token=EOS, seed=seed)
    expected = read_all(dataset)
    assert len(sidecars(documents_dir)) == (1 if seed is None else 2)

    def no_build(self, source):
        raise AssertionError("the prefix sums were built again")

    monkeypatch.setattr(packing_module.PackedReader, "_build_storage_sums", no_build)
    again = PackedDataset(DocumentDataset(_storage(documents_dir)), 5, eos_token=EOS, seed=seed)
    assert read_all(again) == expected
    order = list(range(len(documents)))
    if seed is not None:
        permutation = FeistelPermutation(len(documents), _order_key(seed))
        order = [permutation(p) for p in order]
    assert expected == reference_documents(documents, 5, EOS, order)


def test_a_seeded_order_reuses_the_storage_order_sums(documents_dir, monkeypatch):
    read_all(PackedDataset(_storage(documents_dir), 5, eos_token=EOS))

    def no_build(self, source):
        raise AssertionError("the documents were read again")

    monkeypatch.setattr(packing_module.PackedReader, "_build_storage_sums", no_build)
    assert read_all(PackedDataset(_storage(documents_dir), 5, eos_token=EOS, seed=9))


def test_the_sidecar_is_refused_and_rebuilt_when_the_dataset_changes(documents_dir):
    dataset = PackedDataset(_storage(documents_dir), 4, eos_token=EOS)
    read_all(dataset)
    (name,) = sidecars(documents_dir)
    before = (documents_dir / name).read_bytes()
    changed = [[1, 2, 3, 4, 5]] * 30 + [[7]] * 7
    write_documents(documents_dir, changed)  # both shards rewritten
    after_change = read_all(PackedDataset(_storage(documents_dir), 4, eos_token=EOS))
    assert after_change == reference_documents(changed, 4, EOS, list(range(len(changed))))
    assert sidecars(documents_dir) == [name]
    assert (documents_dir / name).read_bytes() != before


def test_one_rewritten_shard_is_a_change(documents_dir):
    documents = _documents(documents_dir)
    read_all(PackedDataset(_storage(documents_dir), 4))
    first_shard = documents[: len(documents) // 2]
    swapped = [[*reversed(d), 0] for d in first_shard]  # one token longer each
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shard 1 stays, on purpose
        with _storage(documents_dir).sync_writer() as writer:
            for document in swapped:
                writer.append(0, document)
    new = swapped + documents[len(documents) // 2 :]
    got = read_all(PackedDataset(_storage(documents_dir), 4))
    assert got == reference_documents(new, 4, None, list(range(len(new))))


def test_listing_verify_recover_and_the_cli_ignore_the_sidecar(documents_dir):
    read_all(PackedDataset(_storage(documents_dir), 4, eos_token=EOS))
    assert sidecars(documents_dir)
    storage = _storage(documents_dir)
    storage.verify()
    with DocumentDataset(storage).sync_reader() as reader:
        assert len(reader) == 60
        assert reader.storage_reader.num_shards == 2
    names = sidecars(documents_dir)
    for command in ("info", "verify", "recover"):
        done = subprocess.run(
            [sys.executable, "-m", "guideloom_pipes", command, str(documents_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        assert "packing" not in done.stdout + done.stderr
    assert storage.recover() == {"rolled_forward": [], "removed": [], "cleaned": []}
    assert sidecars(documents_dir) == names


def test_a_corrupt_sidecar_is_rebuilt(documents_dir):
    expected = read_all(PackedDataset(_storage(documents_dir), 4))
    (name,) = sidecars(documents_dir)
    (documents_dir / name).write_bytes(b"not a header\n1234")
    with pytest.warns(UserWarning, match=r"sidecar .*header does not parse.*rebuilt"):
        assert read_all(PackedDataset(_storage(documents_dir), 4)) == expected
    assert (documents_dir / name).read_bytes().startswith(b"{")


def _sums_of(path: Path) -> tuple[bytes, np.ndarray]:
    raw = path.read_bytes()
    header = raw[: raw.index(b"\n") + 1]
    return header, np.frombuffer(raw[len(header) :], dtype="<i8").copy()


@pytest.mark.parametrize("seed", [None, 3])
def test_a_sidecar_with_a_damaged_prefix_sum_is_rebuilt_with_a_warning(documents_dir, seed):
    """One sum one larger (still increasing, the fingerprint unchanged) failed every reopen
    with "the dataset changed"; the sums' checksum finds it, once: the rebuilt sidecar is
    used quietly after."""
    dataset = PackedDataset(_storage(documents_dir), 4, eos_token=EOS, seed=seed)
    expected = read_all(dataset)
    for name in sidecars(documents_dir):
        path = documents_dir / name
        header, sums = _sums_of(path)
        sums[5] += 1
        assert (np.diff(sums) >= 0).all()
        path.write_bytes(header + sums.tobytes())
    with pytest.warns(UserWarning, match=r"sidecar .*fail their checksum.*rebuilt"):
        assert read_all(PackedDataset(_storage(documents_dir), 4, eos_token=EOS, seed=seed)) == (
            expected
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_all(PackedDataset(_storage(documents_dir), 4, eos_token=EOS, seed=seed)) == (
            expected
        )


def test_a_sidecar_that_contradicts_its_documents_is_rebuilt_with_a_warning(documents_dir):
    """Sums that are whole (their own checksum holds, increasing, first 0) but count
    document 0 one token longer than it is: the sample of documents checked on open finds
    it."""
    dataset = PackedDataset(_storage(documents_dir), 4, eos_token=EOS)
    expected = read_all(dataset)
    (name,) = sidecars(documents_dir)
    header, sums = _sums_of(documents_dir / name)
    fingerprint = json.loads(header)["fingerprint"]
    sums[1:] += 1
    assert packing_index._write_sidecar(documents_dir / name, fingerprint, sums)
    with pytest.warns(UserWarning, match=r"document 0 has \d+ tokens, but the sums count"):
        assert read_all(PackedDataset(_storage(documents_dir), 4, eos_token=EOS)) == expected
    assert _sums_of(documents_dir / name)[1][1] == sums[1] - 1  # rebuilt in place


def test_a_sidecar_that_contradicts_a_document_outside_the_sample_fails_one_read_only(
    documents_dir,
):
    """Whole sums (checksum, increasing) that move one token from document 2 to document 1,
    which the sample of three documents does not look at: the read that meets them fails
    naming the sidecar, which it removes, and the next open rebuilds it."""
    documents = _documents(documents_dir)
    assert len(documents[2]) > 0
    dataset = PackedDataset(_storage(documents_dir), 4, eos_token=EOS)
    expected = read_all(dataset)
    (name,) = sidecars(documents_dir)
    header, sums = _sums_of(documents_dir / name)
    sums[2] += 1
    assert packing_index._write_sidecar(
        documents_dir / name, json.loads(header)["fingerprint"], sums
    )
    with pytest.raises(RuntimeError, match=r"document 1 has .*removed: .*next open rebuilds"):
        read_all(PackedDataset(_storage(documents_dir), 4, eos_token=EOS))
    assert sidecars(documents_dir) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_all(PackedDataset(_storage(documents_dir), 4, eos_token=EOS)) == expected
    assert sidecars(documents_dir) == [name]


def test_a_sidecar_of_the_first_version_is_rebuilt_quietly(documents_dir):
    """A sidecar written before the sums had a checksum (version 1) is of another version:
    rebuilt once, without a warning."""
    expected = read_all(PackedDataset(_storage(documents_dir), 4))
    (name,) = sidecars(documents_dir)
    header, sums = _sums_of(documents_dir / name)
    meta = json.loads(header)
    old = json.dumps({"version": 1, "fingerprint": meta["fingerprint"], "count": len(sums)})
    (documents_dir / name).write_bytes(old.encode() + b"\n" + sums.tobytes())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_all(PackedDataset(_storage(documents_dir), 4)) == expected
    assert json.loads(_sums_of(documents_dir / name)[0])["version"] == 2


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_sidecar_has_the_permissions_of_the_shard_files(tmp_path, umask):
    """Created as the shards are (0o644 less the umask), not -rw------- as a private
    temporary file would be."""
    previous = os.umask(umask)
    try:
        write_documents(tmp_path / "docs", [[1, 2, 3], [4, 5]])
        read_all(PackedDataset(_storage(tmp_path / "docs"), 2))
    finally:
        os.umask(previous)
    (name,) = sidecars(tmp_path / "docs")
    mode = (tmp_path / "docs" / name).stat().st_mode & 0o777
    assert mode == (tmp_path / "docs" / "0000000.out_of_band.bin").stat().st_mode & 0o777
    assert mode == 0o644 & ~umask


def test_a_read_only_dataset_directory_puts_the_sidecar_under_cache_dir(
    documents_dir, tmp_path, monkeypatch
):
    real = packing_index._create_temporary

    def read_only(path: Path) -> Any:
        if path.parent == documents_dir:
            raise PermissionError(13, "Read-only file system")
        return real(path)

    monkeypatch.setattr(packing_index, "_create_temporary", read_only)
    cache = tmp_path / "cache"
    expected = read_all(PackedDataset(_storage(documents_dir), 4, cache_dir=cache))
    assert sidecars(documents_dir) == []
    assert len(sidecars(cache)) == 1
    with pytest.warns(UserWarning, match="cache_dir="):
        assert read_all(PackedDataset(_storage(documents_dir), 4)) == expected


def test_a_sidecar_write_leaves_no_temporary_behind(documents_dir):
    read_all(PackedDataset(_storage(documents_dir), 4))
    assert not [n for n in os.listdir(documents_dir) if n.endswith(".tmp")]


# -- refusals -------------------------------------------------------------------------------


def test_bad_arguments_are_refused_with_the_fix(tmp_path):
    stream = StreamStorage(tmp_path / "s", StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    with stream.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(10)})
    with pytest.raises(ValueError, match="eos_token="):
        PackedDataset(stream, 4)
    with pytest.raises(ValueError, match=r"seed=1 .*drop seed"):
        PackedDataset(stream, 4, eos_token=0, seed=1)
    with pytest.raises(ValueError, match=r"no field 'ids'.*'tokens'"):
        PackedDataset(stream, 4, eos_token=0, field="ids")
    with pytest.raises(TypeError, match=r"dataset.storage"):
        PackedDataset(StreamDataset(stream, 4), 4, eos_token=0)
    with pytest.raises(TypeError, match="StreamWithMetaStorage"):
        PackedDataset(StreamWithMetaStorage(tmp_path / "m", ChunkMetaFormat()), 4)
    with pytest.raises(ValueError, match="sequence_length must be >= 1, got 0"):
        PackedDataset([[1]], 0)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        PackedDataset([[1]], 1, seed=-1)
    with pytest.raises(TypeError, match="eos_token must be an int"):
        PackedDataset([[1]], 1, eos_token=1.5)  # type: ignore[arg-type]


def test_a_document_that_changed_under_an_open_reader_is_an_error():
    documents = [[1, 2, 3], [4, 5]]
    dataset = PackedDataset(documents, 2)
    with dataset.sync_reader() as reader:
        documents[0].append(9)
        with pytest.raises(RuntimeError, match=r"document 0 has 4 tokens.*count 3"):
            reader.read_batch(np.array([0]))


def test_documents_given_as_lists_pack_as_their_arrays_do():
    """Lists of Python ints take a quicker conversion than ``np.asarray``; lists that hold
    numpy integers, bools or big ints, tuples and empty documents pack exactly as the
    same documents given as arrays."""
    documents: list[Any] = [
        [3, 1, 4, 1, 5],
        (9, 2, 6),
        [],
        [1, np.int32(7), True],
        [2**40, 8],
        [np.int16(5), 3],
        list(range(30)),
    ]
    as_lists = read_all(PackedDataset(documents, 4, eos_token=EOS))
    as_arrays = read_all(
        PackedDataset([np.asarray(d, dtype=np.int64) for d in documents], 4, eos_token=EOS)
    )
    assert as_lists == as_arrays
    assert as_lists == reference_documents(
        [[int(t) for t in d] for d in documents], 4, EOS, list(range(len(documents)))
    )
