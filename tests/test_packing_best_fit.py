"""PackedDataset(packing="best_fit" | "first_fit"): the plan against a slow pure-Python
best-fit / first-fit decreasing, the windows against a slow reference (pieces back to back,
padding its own sequence labelled -100), whole documents never cut, every token once, the
plan sidecar (reused, per options, rebuilt when the dataset changes or the file is damaged),
and the refusals (torch-free)."""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom_pipes import (
    DocumentDataset,
    DocumentPickleFormat,
    DocumentStorage,
    MixtureDataset,
    PackedDataset,
    StreamNumpyFormat,
    StreamStorage,
    packing_plan,
)
from guideloom_pipes.packing import IGNORE_INDEX
from guideloom_pipes.packing_index import _order_key
from guideloom_pipes.packing_plan import plan_windows
from guideloom_pipes.shuffle import FeistelPermutation

EOS = 99
PAD = -7


# -- slow references ------------------------------------------------------------------------


def reference_plan(
    lengths: list[int], length: int, lookahead: int, best: bool
) -> list[list[tuple[int, int]]]:
    """Each window's pieces ``(position, start)``: best- (or first-) fit decreasing over
    blocks of ``lookahead`` documents, scanning every open window."""
    windows: list[list[tuple[int, int]]] = []
    for begin in range(0, len(lengths), lookahead):
        block = range(begin, min(len(lengths), begin + lookahead))
        full: list[list[tuple[int, int]]] = []
        items = []
        for position in block:
            whole, rest = divmod(lengths[position], length)
            full += [[(position, k * length)] for k in range(whole)]
            if rest:
                items.append((rest, position, whole * length))
        items.sort(key=lambda item: -item[0])  # stable: ties in packing order
        open_windows: list[list[Any]] = []  # [free space, pieces]
        for size, position, start in items:
            fits = [w for w in open_windows if w[0] >= size]
            if not fits:
                chosen: list[Any] = [length, []]
                open_windows.append(chosen)
            elif best:
                chosen = min(fits, key=lambda w: w[0])  # (the earliest among equals)
            else:
                chosen = fits[0]
            chosen[0] -= size
            chosen[1].append((position, start))
        windows += full + [w[1] for w in open_windows]
    return windows


def reference_windows(
    documents: list[list[int]],
    length: int,
    eos: int | None,
    order: list[int],
    lookahead: int,
    best: bool,
) -> list[dict[str, list[int]]]:
    """The samples of the reference plan, built token by token."""
    texts = [list(documents[d]) + ([eos] if eos is not None else []) for d in order]
    out = []
    for pieces in reference_plan([len(t) for t in texts], length, lookahead, best):
        tokens: list[int] = []
        owner: list[int] = []
        for k, (position, start) in enumerate(pieces):
            piece = texts[position][start : start + length]
            tokens += piece
            owner += [k] * len(piece)
        padding = length - len(tokens)
        tokens += [PAD] * padding
        owner += [len(pieces)] * padding
        positions, document_ids, labels = [], [], []
        for j in range(length):
            new = j == 0 or owner[j] != owner[j - 1]
            positions.append(0 if new else positions[-1] + 1)
            document_ids.append(owner[j])
            same_next = j + 1 < length and owner[j + 1] == owner[j]
            is_pad = owner[j] == len(pieces)
            labels.append(tokens[j + 1] if same_next and not is_pad else IGNORE_INDEX)
        out.append(
            {
                "tokens": tokens,
                "position_ids": positions,
                "document_ids": document_ids,
                "labels": labels,
            }
        )
    return out


def read_all(dataset: PackedDataset) -> list[dict[str, list[int]]]:
    with dataset.sync_reader() as reader:
        samples = reader.read_batch(np.arange(len(reader)))
    for sample in samples:
        assert all(v.dtype == np.int64 for v in sample.values())
    return [{k: v.tolist() for k, v in sample.items()} for sample in samples]


def seeded_order(count: int, seed: int | None) -> list[int]:
    if seed is None or count == 0:
        return list(range(count))
    permutation = FeistelPermutation(count, _order_key(seed))
    return [permutation(p) for p in range(count)]


# -- the plan and the windows ---------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), max_size=40),
    length=st.integers(1, 12),
    lookahead=st.integers(1, 12),
    packing=st.sampled_from(["best_fit", "first_fit"]),
)
def test_the_plan_is_the_slow_fit_decreasing(lengths, length, lookahead, packing):
    plan = plan_windows(lengths, length, packing=packing, lookahead=lookahead)
    got = [
        list(zip(plan.positions[a:b].tolist(), plan.starts[a:b].tolist()))
        for a, b in zip(plan.offsets[:-1].tolist(), plan.offsets[1:].tolist())
    ]
    assert got == reference_plan(lengths, length, lookahead, packing == "best_fit")


documents_st = st.lists(st.lists(st.integers(0, 50), max_size=20), max_size=25)


@settings(max_examples=120, deadline=None)
@given(
    documents=documents_st,
    length=st.integers(1, 12),
    eos=st.sampled_from([None, EOS]),
    seed=st.one_of(st.none(), st.integers(0, 2**40)),
    lookahead=st.integers(1, 30),
    packing=st.sampled_from(["best_fit", "first_fit"]),
)
def test_fitted_windows_match_the_slow_reference(documents, length, eos, seed, lookahead, packing):
    order = seeded_order(len(documents), seed)
    expected = reference_windows(documents, length, eos, order, lookahead, packing == "best_fit")
    dataset = PackedDataset(
        documents,
        length,
        eos_token=eos,
        seed=seed,
        packing=packing,
        pad_token=PAD,
        lookahead=lookahead,
    )
    assert len(dataset) == len(expected)
    assert read_all(dataset) == expected
    if expected:  # a shuffled batch, and one window alone, read the same
        with dataset.sync_reader() as reader:
            ids = np.arange(len(expected))[::-1]
            got = [{k: v.tolist() for k, v in s.items()} for s in reader.read_batch(ids)]
            assert got == [expected[i] for i in ids]
            last = {k: v.tolist() for k, v in reader[len(expected) - 1].items()}
            assert last == expected[-1]


def test_a_best_fit_window_by_hand():
    """Documents of 3, 5, 2, 9 and 4 tokens (the EOS counted) in windows of 5, four at a
    time: the 5 and the first 5 of the 9 are windows of their own; the 4 left of the 9 and
    the 3 open windows, and the 2 goes where it fits best (after the 3: 0 left, not 1)."""
    documents = [[1, 2], [3, 4, 5, 6], [7], [10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22]]
    dataset = PackedDataset(
        documents, 5, eos_token=0, packing="best_fit", pad_token=PAD, lookahead=4
    )
    samples = read_all(dataset)
    assert [s["tokens"] for s in samples] == [
        [3, 4, 5, 6, 0],  # document 1 fills a window: a full piece of its own
        [10, 11, 12, 13, 14],  # the first full piece of document 3
        [15, 16, 17, 0, PAD],  # the rest of document 3 (4 tokens), then padding
        [1, 2, 0, 7, 0],  # 3 tokens, and the 2 that fit exactly
        [20, 21, 22, 0, PAD],  # the next block
    ]
    assert samples[2]["position_ids"] == [0, 1, 2, 3, 0]
    assert samples[2]["document_ids"] == [0, 0, 0, 0, 1]
    assert samples[2]["labels"] == [16, 17, 0, IGNORE_INDEX, IGNORE_INDEX]
    assert samples[3]["labels"] == [2, 0, IGNORE_INDEX, 0, IGNORE_INDEX]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30), max_size=40),
    length=st.integers(2, 12),
    lookahead=st.integers(1, 40),
    packing=st.sampled_from(["best_fit", "first_fit"]),
)
def test_every_token_is_in_one_window_once_and_no_document_that_fits_is_cut(
    sizes, length, lookahead, packing
):
    """Documents of distinct tokens (document k's token j is 1000 k + j), rebuilt from the
    windows' sequences: each exactly once, in order; one that fits a window is one
    sequence; the padding is the trailing sequence of a window, all PAD and -100."""
    documents = [[1000 * k + j for j in range(size)] for k, size in enumerate(sizes)]
    dataset = PackedDataset(documents, length, packing=packing, pad_token=PAD, lookahead=lookahead)
    pieces: dict[int, list[list[int]]] = {}
    padding = 0
    for sample in read_all(dataset):
        tokens, labels, positions = sample["tokens"], sample["labels"], sample["position_ids"]
        starts = [j for j in range(length) if positions[j] == 0] + [length]
        for a, b in itertools.pairwise(starts):
            sequence = tokens[a:b]
            if sequence[0] == PAD:
                assert b == length and set(sequence) == {PAD}  # the last sequence only
                assert set(labels[a:b]) == {IGNORE_INDEX}
                padding += b - a
                continue
            assert PAD not in sequence
            pieces.setdefault(sequence[0] // 1000, []).append(sequence)
            assert labels[a : b - 1] == sequence[1:] and labels[b - 1] == IGNORE_INDEX
    for k, size in enumerate(sizes):
        got = pieces.pop(k, [])
        assert [t for piece in got for t in piece] == documents[k]
        if size <= length:
            assert len(got) == (1 if size else 0)
        else:
            assert len(got) == -(-size // length)
            assert all(len(piece) == length for piece in got[:-1])
    assert pieces == {}
    assert padding == len(dataset) * length - sum(sizes)


def test_the_fits_lose_fewer_tokens_to_padding_than_windows_would_waste():
    """Best fit wastes no more padding than first fit on a log-normal spread, both far less
    than one document per window would (a check that the fit fits, not a benchmark)."""
    rng = np.random.default_rng(5)
    lengths = np.maximum(1, rng.lognormal(4.0, 1.0, 3000).astype(np.int64))
    padded = {}
    for packing in ("best_fit", "first_fit"):
        plan = plan_windows(lengths, 256, packing=packing, lookahead=64)
        padded[packing] = plan.windows * 256 - int(lengths.sum())
        assert int(plan.piece_sizes(lengths, 256).sum()) == int(lengths.sum())
    assert padded["best_fit"] <= padded["first_fit"] < 0.1 * len(lengths) * 256


def test_two_builds_give_the_same_windows():
    rng = np.random.default_rng(3)
    documents = [rng.integers(1, 90, rng.integers(1, 40)).tolist() for _ in range(200)]
    options: dict[str, Any] = {"packing": "best_fit", "pad_token": 0, "lookahead": 16}
    first = read_all(PackedDataset(documents, 16, eos_token=EOS, seed=2, **options))
    again = read_all(
        PackedDataset([list(d) for d in documents], 16, eos_token=EOS, seed=2, **options)
    )
    assert first == again
    other = read_all(PackedDataset(documents, 16, eos_token=EOS, seed=3, **options))
    assert other != first  # (the seed orders the documents before they are fitted)


def test_a_fitted_dataset_is_a_component_of_a_mixture():
    a = PackedDataset([[1, 2, 3]] * 10, 4, packing="best_fit", pad_token=0)
    b = PackedDataset([[7, 8]] * 10, 4, eos_token=9)  # concat beside a fit
    mixture = MixtureDataset({"a": a, "b": b}, {"a": 1, "b": 1}, seed=0)
    component, index = mixture.locate(np.arange(len(mixture)))
    with mixture.sync_reader() as reader:
        samples = reader.read_batch(np.arange(len(mixture)))
    for c, i, sample in zip(component.tolist(), index.tolist(), samples):
        assert {k: v.tolist() for k, v in sample.items()} == read_all([a, b][c])[i]


def test_concat_stays_the_default_and_keeps_no_plan(tmp_path):
    write_documents(tmp_path / "docs", [[1, 2, 3]] * 6)
    dataset = PackedDataset(_storage(tmp_path / "docs"), 4, eos_token=EOS)
    assert dataset.packing == "concat" and dataset.plan_paths() == []
    assert len(dataset) == 6  # 24 tokens // 4: cut, nothing padded
    assert len(sidecars(tmp_path / "docs")) == 1  # the prefix sums only
    assert "packing" not in repr(dataset)
    fitted = PackedDataset(_storage(tmp_path / "docs"), 4, packing="best_fit", pad_token=0)
    assert "packing='best_fit', pad_token=0, lookahead=1024" in repr(fitted)


# -- the plan sidecar -----------------------------------------------------------------------


def write_documents(directory: Path, documents: list[list[int]], shards: int = 2) -> None:
    storage = DocumentStorage(directory, DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for k, document in enumerate(documents):
            writer.append(k * shards // max(1, len(documents)), document)


def sidecars(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "guideloom-packing" in p.name)


def plans(directory: Path) -> list[str]:
    return [name for name in sidecars(directory) if "_fit-" in name]


def _storage(directory: Path) -> DocumentStorage:
    return DocumentStorage(directory, DocumentPickleFormat())


@pytest.fixture
def documents_dir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 9, rng.integers(0, 30)).tolist() for _ in range(80)]
    write_documents(tmp_path / "docs", documents)
    return tmp_path / "docs"


def fitted(directory: Path, lookahead: int = 8, **options: Any) -> PackedDataset:
    return PackedDataset(
        _storage(directory),
        6,
        eos_token=EOS,
        packing=options.pop("packing", "best_fit"),
        pad_token=PAD,
        lookahead=lookahead,
        **options,
    )


class Builds:
    """Counts the plans computed (``packing_plan.plan_windows`` calls)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = packing_plan.plan_windows

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(packing_plan, "plan_windows", counted)


@pytest.mark.parametrize("seed", [None, 4])
def test_the_plan_sidecar_is_written_once_and_reused(documents_dir, monkeypatch, seed):
    builds = Builds(monkeypatch)
    expected = read_all(fitted(documents_dir, seed=seed))
    assert builds.count == 1
    (name,) = plans(documents_dir)
    assert name.endswith("-best_fit-L6-k8.bin") and name.startswith(".guideloom-packing-")
    again = PackedDataset(
        DocumentDataset(_storage(documents_dir)),
        6,
        eos_token=EOS,
        seed=seed,
        packing="best_fit",
        pad_token=PAD,
        lookahead=8,
    )
    assert read_all(again) == expected
    assert len(again) == len(expected)
    assert builds.count == 1  # reused, in this process, without a check
    with _storage(documents_dir).sync_reader() as reader:
        documents = [reader.read(i) for i in range(len(reader))]
    order = seeded_order(len(documents), seed)
    assert expected == reference_windows(documents, 6, EOS, order, 8, True)


def test_other_options_get_a_plan_of_their_own(documents_dir, monkeypatch):
    builds = Builds(monkeypatch)
    by_options = {}
    for lookahead, packing in ((8, "best_fit"), (3, "best_fit"), (8, "first_fit")):
        by_options[lookahead, packing] = read_all(fitted(documents_dir, lookahead, packing=packing))
    assert builds.count == 3
    assert len(plans(documents_dir)) == 3
    assert by_options[8, "best_fit"] != by_options[3, "best_fit"]
    assert read_all(fitted(documents_dir, 3)) == by_options[3, "best_fit"]
    assert builds.count == 3


def test_a_plan_sidecar_of_other_options_is_refused_and_rebuilt(documents_dir, monkeypatch):
    """A plan file under the name of other options (copied, renamed) is not used: its
    header's options are checked, the plan is computed again and written over it."""
    read_all(fitted(documents_dir, 3))
    (three,) = plans(documents_dir)
    eight = three.replace("-k3.bin", "-k8.bin")
    (documents_dir / eight).write_bytes((documents_dir / three).read_bytes())
    builds = Builds(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = read_all(fitted(documents_dir, 8))
    assert builds.count == 1
    with _storage(documents_dir).sync_reader() as reader:
        documents = [reader.read(i) for i in range(len(reader))]
    assert got == reference_windows(documents, 6, EOS, list(range(len(documents))), 8, True)
    assert json.loads((documents_dir / eight).read_bytes().split(b"\n")[0])["lookahead"] == 8


def test_the_plan_is_rebuilt_when_the_dataset_changes(documents_dir, monkeypatch):
    read_all(fitted(documents_dir))
    (name,) = plans(documents_dir)
    changed = [[1, 2, 3, 4, 5, 6, 7]] * 20 + [[8]] * 9
    write_documents(documents_dir, changed)
    builds = Builds(monkeypatch)
    got = read_all(fitted(documents_dir))
    assert builds.count == 1
    assert got == reference_windows(changed, 6, EOS, list(range(len(changed))), 8, True)
    assert plans(documents_dir) == [name]


def _damage(path: Path, index: int) -> None:
    raw = bytearray(path.read_bytes())
    data = raw.index(b"\n") + 1
    values = np.frombuffer(bytes(raw[data:]), dtype="<i8").copy()
    values[index] += 1
    path.write_bytes(bytes(raw[:data]) + values.tobytes())


@pytest.mark.parametrize("index", [1, -1])
def test_a_damaged_plan_sidecar_is_rebuilt_with_a_warning(documents_dir, index):
    expected = read_all(fitted(documents_dir))
    (name,) = plans(documents_dir)
    _damage(documents_dir / name, index)
    with pytest.warns(UserWarning, match=r"plan sidecar .*checksum.*rebuilt"):
        assert read_all(fitted(documents_dir)) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_all(fitted(documents_dir)) == expected


def test_a_plan_that_passes_its_checksum_but_not_its_documents_is_rebuilt(documents_dir):
    """A plan rewritten whole (its checksum holds) with a piece moved off its window
    boundary: the checks of its shape find it."""
    from guideloom_pipes.packing_index import _read_header
    from guideloom_pipes.packing_plan import PackingPlan, _write_plan

    expected = read_all(fitted(documents_dir))
    (name,) = plans(documents_dir)
    path = documents_dir / name
    found = _read_header(path)
    assert found is not None
    meta, header, _ = found
    values = np.frombuffer(path.read_bytes()[len(header) :], dtype="<i8").copy()
    windows, pieces = meta["windows"], meta["pieces"]
    starts = values[windows + 1 + pieces :]
    starts[int(np.argmax(starts == 0))] = 1
    plan = PackingPlan(values[: windows + 1], values[windows + 1 : windows + 1 + pieces], starts)
    keys = ("windows", "pieces", "crc32")
    assert _write_plan(path, {k: v for k, v in meta.items() if k not in keys}, plan)
    with pytest.warns(UserWarning, match=r"plan sidecar .*off a window boundary.*rebuilt"):
        assert read_all(fitted(documents_dir)) == expected


def test_the_plan_goes_under_cache_dir_when_the_directory_is_read_only(
    documents_dir, tmp_path, monkeypatch
):
    from guideloom_pipes import packing_index

    real = packing_index._create_temporary

    def read_only(path: Path) -> Any:
        if path.parent == documents_dir:
            raise PermissionError(13, "Read-only file system")
        return real(path)

    monkeypatch.setattr(packing_index, "_create_temporary", read_only)
    cache = tmp_path / "cache"
    expected = read_all(fitted(documents_dir, cache_dir=cache))
    assert sidecars(documents_dir) == []
    assert len(plans(cache)) == 1
    with pytest.warns(UserWarning) as record:
        assert read_all(fitted(documents_dir)) == expected
    messages = [str(warning.message) for warning in record]
    assert len(messages) == 2  # the prefix sums, and the plan
    assert "prefix sums" in messages[0]
    assert "best_fit plan" in messages[1] and "cache_dir=" in messages[1]


def test_listing_verify_and_recover_ignore_the_plan_sidecar(documents_dir):
    read_all(fitted(documents_dir))
    names = sidecars(documents_dir)
    assert len(names) == 2 and plans(documents_dir)
    storage = _storage(documents_dir)
    storage.verify()
    with DocumentDataset(storage).sync_reader() as reader:
        assert len(reader) == 80
    assert storage.recover() == {"rolled_forward": [], "removed": [], "cleaned": []}
    assert sidecars(documents_dir) == names


# -- refusals -------------------------------------------------------------------------------


def test_bad_arguments_are_refused_with_the_fix(tmp_path):
    documents = [[1, 2, 3]]
    with pytest.raises(ValueError, match=r"packing must be one of 'concat', .*got 'bestfit'"):
        PackedDataset(documents, 4, packing="bestfit")
    with pytest.raises(ValueError, match=r"packing='best_fit' pads .*pass pad_token="):
        PackedDataset(documents, 4, packing="best_fit")
    with pytest.raises(TypeError, match=r"pad_token must be an int token id, got 1.5"):
        PackedDataset(documents, 4, packing="best_fit", pad_token=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pad_token must be an int token id, got True"):
        PackedDataset(documents, 4, packing="first_fit", pad_token=True)
    with pytest.raises(ValueError, match=r"lookahead must be >= 1 .*got 0"):
        PackedDataset(documents, 4, packing="best_fit", pad_token=0, lookahead=0)
    with pytest.raises(TypeError, match=r"lookahead must be an int, got '8'"):
        PackedDataset(documents, 4, packing="best_fit", pad_token=0, lookahead="8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pad_token=0 is an option of .*drop pad_token"):
        PackedDataset(documents, 4, pad_token=0)
    with pytest.raises(ValueError, match=r"lookahead=8 is an option of .*drop lookahead"):
        PackedDataset(documents, 4, packing="concat", lookahead=8)
    stream = StreamStorage(tmp_path / "s", StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    with stream.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(10)})
    with pytest.raises(ValueError, match=r"packing='best_fit' places whole documents.*concat"):
        PackedDataset(stream, 4, eos_token=0, packing="best_fit", pad_token=0)
    with pytest.raises(ValueError, match=r"lengths must be a 1-D sequence"):
        plan_windows([3, -1], 4)


def test_a_pad_token_outside_the_documents_dtype_is_refused_on_open():
    documents = [np.array([1, 2, 3], dtype=np.uint16)]
    dataset = PackedDataset(documents, 4, packing="best_fit", pad_token=70_000)
    with pytest.raises(ValueError, match=r"pad_token=70000 .*uint16 \(0\.\.65535\)"):
        len(dataset)
    assert len(PackedDataset(documents, 4, packing="best_fit", pad_token=65_535)) == 1


def test_a_document_that_changed_under_an_open_reader_is_an_error():
    documents = [[1, 2, 3], [4, 5]]
    dataset = PackedDataset(documents, 4, packing="best_fit", pad_token=0)
    with dataset.sync_reader() as reader:
        documents[0].append(9)
        with pytest.raises(RuntimeError, match=r"document 0 has 4 tokens.*count 3"):
            reader.read_batch(np.arange(len(reader)))


def test_an_empty_dataset_has_no_windows():
    assert len(PackedDataset([], 4, packing="best_fit", pad_token=0)) == 0
    assert len(PackedDataset([[], []], 4, packing="first_fit", pad_token=0)) == 0
