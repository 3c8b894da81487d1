"""``pack_columns``, the whole-batch computation of packed windows, against the slow
pure-Python reference: random documents (one-token ones, windows without an EOS, an EOS at
a window's start or end), both ways of giving the boundaries (an EOS token, flat starts),
batches of growing and shrinking sizes (the cached ramps), windows longer than int16 holds,
reused output memory, and ``collate_packed``'s ``cu_seqlens`` from the read's bounds
(torch-free)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_packing import EOS, reference_stream

from guideloom_pipes import Batch, PackedDataset, packing_columns, packing_reader
from guideloom_pipes.packing import FIELDS, known_sequences, pack_columns


def _stream(sizes: list[int], rng: np.random.Generator) -> list[int]:
    """Documents of ``sizes`` tokens (the last one the EOS; size 1: the EOS alone)."""
    tokens: list[int] = []
    for size in sizes:
        tokens += [*rng.integers(1, 90, size - 1).tolist(), EOS]
    return tokens


def _document_starts(tokens: list[int], rows: int, length: int) -> np.ndarray:
    """The flat indexes inside the windows where a document starts (after an EOS)."""
    starts = [k for k in range(1, rows * length) if tokens[k - 1] == EOS and k % length]
    return np.array(starts, dtype=np.int64)


def _check(
    columns: dict[str, np.ndarray], segments: np.ndarray, expected: list[dict[str, Any]]
) -> None:
    rows = len(expected)
    for name in FIELDS:
        assert columns[name].dtype == np.int64
        assert columns[name].tolist() == [window[name] for window in expected]
    length = columns["tokens"].shape[1]
    flat = columns["position_ids"].reshape(-1)
    assert segments.tolist() == [k for k in range(rows * length) if flat[k] == 0]


sizes_st = st.lists(st.integers(1, 30), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    sizes=sizes_st,
    length=st.integers(1, 24),
    dtype=st.sampled_from(["<i4", "<u2", "<i8", "<u1"]),
    strided=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_pack_columns_equals_the_reference(sizes, length, dtype, strided, seed):
    rng = np.random.default_rng(seed)
    tokens = _stream(sizes, rng)
    rows = len(tokens) // length
    expected = reference_stream(tokens, length, EOS)
    windows = np.array(tokens[: rows * length], dtype=dtype).reshape(rows, length)
    if strided:  # windows with odd strides: every other column of a wider array
        wide = np.zeros((rows, 2 * length), dtype=dtype)
        wide[:, ::2] = windows
        windows = wide[:, ::2]
    starts = _document_starts(tokens, rows, length)
    garbage = np.full((len(FIELDS), rows, length), -7, dtype=np.int64)  # reused memory
    for given_out in (None, garbage):
        _check(*pack_columns(windows, eos_token=EOS, out=given_out), expected)
        _check(*pack_columns(windows, starts=starts, out=given_out), expected)


def test_windows_at_their_edges():
    """No EOS in a window, an EOS first and last in one, one-token documents in a row."""
    length = 6
    tokens = [5, 6, 7, 8, 9, 10]  # no EOS: one document over the whole window
    tokens += [EOS, 1, 2, 3, 4, EOS]  # EOS first (ends the previous one) and last
    tokens += [EOS, EOS, EOS, 7, EOS, EOS]  # one-token documents
    windows = np.array(tokens).reshape(3, length)
    columns, segments = pack_columns(windows, eos_token=EOS)
    _check(columns, segments, reference_stream(tokens, length, EOS))
    assert columns["position_ids"][2].tolist() == [0, 0, 0, 0, 1, 0]
    assert columns["document_ids"][2].tolist() == [0, 1, 2, 3, 3, 4]


def test_batches_of_varying_sizes_share_the_ramps():
    rng = np.random.default_rng(4)
    length = 7
    packing_columns._RAMPS.clear()
    tokens = _stream(rng.integers(1, 12, 200).tolist(), rng)
    expected = reference_stream(tokens, length, EOS)
    start = 0
    for rows in (1, 5, 2, 9, 30, 3, 64, 1):  # grows twice as needed, then slices
        windows = np.array(tokens[start * length : (start + rows) * length]).reshape(rows, -1)
        _check(*pack_columns(windows, eos_token=EOS), expected[start : start + rows])
        start += rows
    ramps = packing_columns._RAMPS
    assert len(ramps) == 1 and len(next(iter(ramps.values()))) >= 64 * length


def test_a_read_larger_than_the_kept_ramps_is_right_and_not_kept(monkeypatch):
    rng = np.random.default_rng(8)
    length = 5
    monkeypatch.setattr(packing_columns, "_RAMP_KEPT", 40)
    packing_columns._RAMPS.clear()
    tokens = _stream(rng.integers(1, 9, 40).tolist(), rng)
    expected = reference_stream(tokens, length, EOS)
    for rows in (4, 12, 3):  # 20 values kept, then 60 (built, not kept), then a slice
        windows = np.array(tokens[: rows * length]).reshape(rows, length)
        _check(*pack_columns(windows, eos_token=EOS), expected[:rows])
        assert all(len(kept) <= 40 for kept in packing_columns._RAMPS.values())
    assert len(next(iter(packing_columns._RAMPS.values()))) == 4 * length


def test_windows_longer_than_int16_holds():
    rng = np.random.default_rng(5)
    length = 40_000  # positions and columns beyond int16: counted in int32
    tokens = _stream([5, 35_000, 50_000, 3, 1, 1, 20_000, 12_000], rng)
    rows = len(tokens) // length
    windows = np.array(tokens[: rows * length], dtype=np.int32).reshape(rows, length)
    expected = reference_stream(tokens, length, EOS)
    _check(*pack_columns(windows, eos_token=EOS), expected)
    _check(*pack_columns(windows, starts=_document_starts(tokens, rows, length)), expected)
    assert int(pack_columns(windows, eos_token=EOS)[0]["position_ids"].max()) > 32_767


def test_a_read_keeps_its_sequence_bounds_for_collate():
    rng = np.random.default_rng(6)
    documents = [rng.integers(1, 50, rng.integers(1, 20)).tolist() for _ in range(60)]
    with PackedDataset(documents, 8, eos_token=0).sync_reader() as reader:
        ids = np.array([5, 0, 9, 3])
        columns = reader.read_arrays(ids).columns
        found = known_sequences(columns["position_ids"])
        assert found is not None
        bounds, sizes = found
        flat = columns["position_ids"].reshape(-1)
        starts = [k for k in range(len(flat)) if flat[k] == 0]
        assert bounds.tolist() == [*starts, len(flat)]
        assert sizes.tolist() == np.diff(bounds).tolist()
        assert known_sequences(columns["position_ids"].copy()) is None  # not the read's
        assert known_sequences(columns["position_ids"][1:]) is None


def test_collate_packed_takes_a_reads_columns_as_they_are_and_checks_changed_ones():
    torch = pytest.importorskip("torch")
    from guideloom_pipes import collate_packed

    rng = np.random.default_rng(7)
    documents = [rng.integers(1, 50, rng.integers(1, 20)).tolist() for _ in range(60)]
    with PackedDataset(documents, 8, eos_token=0).sync_reader() as reader:
        ids = np.array([4, 1, 7])
        batch = reader.read_arrays(ids)
        expected = collate_packed([dict(sample) for sample in reader.read_batch(ids)])
        ours = collate_packed(batch)
        for name in (*FIELDS, "cu_seqlens"):
            assert torch.equal(ours[name], expected[name])
        assert ours["cu_seqlens"].dtype == torch.int32
        assert ours["max_seqlen"] == expected["max_seqlen"]
        assert np.shares_memory(ours["tokens"].numpy(), batch.columns["tokens"])
        # a column replaced after the read (another dtype, a tensor): checked and widened
        tokens = batch.columns["tokens"]
        for replaced in ((tokens + 1).astype(np.int32), torch.from_numpy(tokens + 1)):
            changed = dict(batch.columns, tokens=replaced)
            for given in (Batch.of_columns(changed), changed):
                got = collate_packed(given)
                assert got["tokens"].dtype == torch.int64
                assert torch.equal(got["tokens"], expected["tokens"] + 1)
                assert torch.equal(got["cu_seqlens"], expected["cu_seqlens"])
        assert collate_packed(reader.read_arrays(np.zeros(0, dtype=np.int64))) == []


def _same_batch(got: Batch, expected: Batch) -> None:
    assert got.columns is not None and expected.columns is not None
    for name in FIELDS:
        assert got.columns[name].tolist() == expected.columns[name].tolist()
    found = known_sequences(got.columns["position_ids"])
    wanted = known_sequences(expected.columns["position_ids"])
    assert found is not None and wanted is not None
    assert found[0].tolist() == wanted[0].tolist() and found[1].tolist() == wanted[1].tolist()


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=0, max_size=12),
    group_tokens=st.integers(1, 200),
    documents=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_batches_read_together_are_the_batches_read_alone(
    sizes, group_tokens, documents, seed, tmp_path_factory
):
    """``read_arrays_many``: the batches of ``read_arrays`` for each id array, also when a
    chunk is packed in several groups, with empty batches and repeated ids among them; each
    batch in an output block of its own, with its own sequence bounds for collate."""
    rng = np.random.default_rng(seed)
    length = 6
    tokens = _stream(rng.integers(1, 15, 80).tolist(), rng)
    if documents:
        source: Any = [rng.integers(1, 50, rng.integers(1, 20)).tolist() for _ in range(40)]
        dataset = PackedDataset(source, length, eos_token=0, seed=3)
    else:
        from guideloom_pipes import StreamNumpyFormat, StreamStorage

        directory = tmp_path_factory.mktemp("stream")
        storage = StreamStorage(directory, StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
        with storage.sync_writer() as writer:
            writer.append(0, {"tokens": np.array(tokens[:200], dtype="<i4")})
            writer.append(1, {"tokens": np.array(tokens[200:], dtype="<i4")})
        dataset = PackedDataset(storage, length, eos_token=EOS)
    original = packing_reader._GROUP_TOKENS
    packing_reader._GROUP_TOKENS = group_tokens
    try:
        with dataset.sync_reader() as reader:
            batches = [rng.integers(0, len(reader), size) for size in sizes]
            together = reader.read_arrays_many(batches)
            assert len(together) == len(batches)
            blocks = set()
            for ids, got in zip(batches, together, strict=True):
                _same_batch(got, reader.read_arrays(ids))
                blocks.add(id(got.columns["tokens"].base))
            assert len(blocks) == len(batches)  # one block per batch
    finally:
        packing_reader._GROUP_TOKENS = original


def test_an_id_out_of_range_in_a_chunk_is_refused_naming_it():
    dataset = PackedDataset([[1, 2, 3, 4, 5]] * 10, 4, eos_token=0)
    with dataset.sync_reader() as reader, pytest.raises(IndexError, match="15"):
        reader.read_arrays_many([np.array([0, 1]), np.array([2, 15])])
