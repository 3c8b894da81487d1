"""A loader's checkpoint names the version of the dataset it was taken on (shard count,
file sizes, record checksums), and is refused on another version with what changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from guideloom_pipes import (
    DocumentPickleFormat,
    DocumentStorage,
    MixtureDataset,
    PackedDataset,
    StatefulDataLoader,
    StreamDataset,
    StreamNumpyFormat,
    StreamStorage,
)

FIXTURES = Path(__file__).parents[1] / "data" / "guideloom-1.1"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
TOKENS = StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
L = 4


def _write(directory: Path, shards: list[list[int]]) -> StreamStorage:
    storage = StreamStorage(directory, TOKENS)
    with storage.sync_writer() as writer:
        for shard, values in enumerate(shards):
            writer.append(shard, {"tokens": np.asarray(values, dtype="<i4")})
    return storage


def _loader(storage: StreamStorage, **kw: Any) -> StatefulDataLoader:
    options = {"batch_size": 2, "shuffle": True, "shuffle_seed": 5, "device": "cpu", **kw}
    return StatefulDataLoader.from_storage(storage, sequence_length=L, **options)


def _state_after(loader: StatefulDataLoader, steps: int) -> dict[str, Any]:
    with loader:
        iterator = iter(loader)
        for _ in range(steps):
            next(iterator)
        return loader.state_dict()


def _rest(loader: StatefulDataLoader, state: dict[str, Any]) -> list[list[int]]:
    with loader:
        loader.load_state_dict(state)
        return [batch["tokens"][:, 0].tolist() for batch in loader]


def test_the_state_carries_the_fingerprint_and_resumes_on_the_same_dataset(
    tmp_path: Path,
) -> None:
    storage = _write(tmp_path / "data", [list(range(40)), list(range(100, 140))])
    state = _state_after(_loader(storage), 3)
    fingerprint = state["dataset_fingerprint"]
    assert fingerprint["shards"] == 2 and fingerprint["checksums"] is not None
    # a new loader on the same files (another process, after a restart) resumes
    again = StreamStorage(tmp_path / "data", TOKENS)
    uninterrupted = _loader(storage)
    with uninterrupted:
        batches = [batch["tokens"][:, 0].tolist() for batch in uninterrupted]
    assert _rest(_loader(again), state) == batches[3:]
    json.dumps(state)  # a checkpoint stays plain JSON


def test_a_state_is_refused_after_a_shard_was_added(tmp_path: Path) -> None:
    storage = _write(tmp_path / "data", [list(range(40)), list(range(100, 140))])
    state = _state_after(_loader(storage), 2)
    with storage.sync_writer() as writer:
        writer.append(2, {"tokens": np.arange(8, dtype="<i4")})
    with pytest.raises(ValueError, match=r"it had 2 shard\(s\), it has 3 now") as caught:
        _loader(storage).load_state_dict(state)
    assert "state.pop('dataset_fingerprint')" in str(caught.value)


def test_a_state_is_refused_after_a_shard_was_rewritten_with_the_same_size(
    tmp_path: Path,
) -> None:
    storage = _write(tmp_path / "data", [list(range(40)), list(range(100, 140))])
    state = _state_after(_loader(storage), 2)
    with storage.sync_writer() as writer:
        writer.append(1, {"tokens": np.arange(500, 540, dtype="<i4")})  # same length
    with pytest.raises(ValueError, match="their contents changed"):
        _loader(storage).load_state_dict(state)


def test_a_state_is_refused_after_a_shard_changed_size(tmp_path: Path) -> None:
    storage = _write(tmp_path / "data", [list(range(40)), list(range(100, 140))])
    state = _state_after(_loader(storage), 2)
    with pytest.warns(UserWarning, match="remain above it"), storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(44, dtype="<i4")})
    with pytest.raises(ValueError, match="shard files changed size"):
        _loader(storage).load_state_dict(state)


def test_dropping_the_key_loads_the_state_anyway_with_the_size_warning(tmp_path: Path) -> None:
    storage = _write(tmp_path / "data", [list(range(40)), list(range(100, 140))])
    state = _state_after(_loader(storage), 2)
    with storage.sync_writer() as writer:
        writer.append(2, {"tokens": np.arange(8, dtype="<i4")})
    state.pop("dataset_fingerprint")
    loader = _loader(storage)
    with pytest.warns(UserWarning, match="dataset of 20 samples, this loader's has 22"):
        loader.load_state_dict(state)
    assert loader.state_dict()["observation_offset"] == 4


def test_guideloom_states_and_fixture_datasets_without_records_still_load(
    tmp_path: Path,
) -> None:
    shutil.copytree(FIXTURES / "stream", tmp_path / "stream")
    dtype = np.dtype([tuple(field) for field in EXPECTED["stream"]["dtype"]])
    storage = StreamStorage(tmp_path / "stream", StreamNumpyFormat(dtype))
    loader = StatefulDataLoader.from_storage(
        storage, sequence_length=5, batch_size=2, shuffle=True, shuffle_seed=1, device="cpu"
    )
    state = _state_after(loader, 1)
    assert state["dataset_fingerprint"]["checksums"] is None  # GuideLoom writes no records
    guideloom_keys = ("epoch", "observation_offset", "shuffle", "shuffle_seed", "drop_last")
    for loadable in (state, {key: state[key] for key in guideloom_keys}):
        fresh = StatefulDataLoader.from_storage(
            storage, sequence_length=5, batch_size=2, shuffle=True, shuffle_seed=1, device="cpu"
        )
        fresh.load_state_dict(loadable)
        assert fresh.state_dict()["observation_offset"] == state["observation_offset"]


def test_a_dataset_that_cannot_tell_adds_no_key() -> None:
    loader = StatefulDataLoader(list(range(10)), batch_size=2, device="cpu")
    assert "dataset_fingerprint" not in loader.state_dict()


def test_a_mixture_names_the_component_that_changed(tmp_path: Path) -> None:
    web = _write(tmp_path / "web", [list(range(40))])
    code = _write(tmp_path / "code", [list(range(100, 140))])

    def mixture() -> MixtureDataset:
        return MixtureDataset(
            {"web": StreamDataset(web, L), "code": StreamDataset(code, L)},
            {"web": 0.5, "code": 0.5},
            seed=3,
        )

    loader = StatefulDataLoader(mixture(), batch_size=2, device="cpu")
    state = _state_after(loader, 2)
    assert set(state["dataset_fingerprint"]["components"]) == {"web", "code"}
    with code.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(900, 940, dtype="<i4")})
    with pytest.raises(ValueError, match=r"component 'code': .*contents changed"):
        StatefulDataLoader(mixture(), batch_size=2, device="cpu").load_state_dict(state)


def _documents(directory: Path) -> DocumentStorage:
    storage = DocumentStorage(directory, DocumentPickleFormat())
    rng = np.random.default_rng(0)
    with storage.sync_writer() as writer:
        for index in range(40):
            writer.append(index % 2, rng.integers(1, 99, int(rng.integers(3, 30))).tolist())
    return storage


@pytest.mark.parametrize(
    "other",
    [{"seed": 8}, {"packing": "best_fit", "pad_token": 0}, {"eos_token": 99}],
    ids=["another-document-order", "another-packing", "another-end-token"],
)
def test_a_packed_dataset_state_is_refused_on_the_same_data_packed_otherwise(
    tmp_path: Path, other: dict[str, Any]
) -> None:
    """The windows of a packed dataset depend on how it is packed, not on its data alone: a
    state taken with other settings (of as many windows, or not) would resume on other
    windows, so it is refused, naming the settings."""
    documents = _documents(tmp_path / "documents")
    packed = {"eos_token": 0, "seed": 7}

    def loader(**settings: Any) -> StatefulDataLoader:
        dataset = PackedDataset(documents, 8, **{**packed, **settings})
        return StatefulDataLoader(dataset, batch_size=2, shuffle=True, drop_last=True, device="cpu")

    state = _state_after(loader(), 2)
    assert state["dataset_fingerprint"]["packing"]["seed"] == 7
    with pytest.raises(ValueError, match=r"packed with other settings \(packing .*: its windows"):
        loader(**other).load_state_dict(state)
    with loader() as same:
        same.load_state_dict(state)  # (the same settings: resumed)


def test_a_state_saved_before_fingerprints_named_the_packing_still_resumes(
    tmp_path: Path,
) -> None:
    """A state whose fingerprint predates a key (a packed dataset's ``packing``, added
    later) is compared on the keys it has: it resumes where it was taken, on the same
    data, also as a component of a mixture."""
    documents = _documents(tmp_path / "documents")

    def packed() -> PackedDataset:
        return PackedDataset(documents, 8, eos_token=0, seed=7)

    def mixture() -> MixtureDataset:
        return MixtureDataset({"a": packed(), "b": packed()}, {"a": 0.5, "b": 0.5}, seed=3)

    for make in (packed, mixture):
        whole = StatefulDataLoader(make(), batch_size=2, shuffle=True, drop_last=True, device="cpu")
        state = _state_after(whole, 2)
        fingerprint = state["dataset_fingerprint"]
        for part in fingerprint.get("components", {"": fingerprint}).values():
            del part["packing"]  # (as saved by the version before)
        resumed = StatefulDataLoader(
            make(), batch_size=2, shuffle=True, drop_last=True, device="cpu"
        )
        with resumed:
            resumed.load_state_dict(state)
            rest = [batch["tokens"].tolist() for batch in resumed]
        with whole:
            whole.load_state_dict(_state_after(whole, 2))
            assert rest == [batch["tokens"].tolist() for batch in whole]
