"""The loader's public shape as GuideLoom 1.1 has it: bases, generics, helpers, signature."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterable, Sized
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch

from guideloom_pipes import StatefulDataLoader, StreamNumpyFormat, StreamStorage
from guideloom_pipes.types import SyncContextManager

GUIDELOOM_KEYWORDS = {
    "sequence_length": None,
    "device": None,
    "local_batch_size": 1,
    "rank": 0,
    "world_size": 1,
    "num_workers": 0,
    "parallel_method": "thread",
    "shuffle": False,
    "shuffle_seed": None,
    "pin_memory": False,
    "drop_last": True,
    "prefetch": 0,
}


def test_loader_is_an_iterable_sized_context_manager() -> None:
    loader = StatefulDataLoader(list(range(8)), batch_size=2)
    assert isinstance(loader, Iterable)
    assert isinstance(loader, Sized)
    assert isinstance(loader, SyncContextManager)


def test_loader_class_takes_type_arguments_like_guideloom() -> None:
    alias = StatefulDataLoader[int, list[int]]
    assert alias.__origin__ is StatefulDataLoader  # type: ignore[attr-defined]


def test_get_default_device_is_cpu_without_cuda() -> None:
    expected = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    assert StatefulDataLoader.get_default_device() == expected


def test_dataset_size_counts_samples_open_or_not() -> None:
    loader = StatefulDataLoader(list(range(10)), batch_size=3)
    assert loader.dataset_size == 10
    with loader:
        assert loader.dataset_size == 10


def test_from_storage_spells_out_guideloom_keywords_and_defaults() -> None:
    parameters = inspect.signature(StatefulDataLoader.from_storage).parameters
    for name, default in GUIDELOOM_KEYWORDS.items():
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert parameters[name].default == default, name


def test_the_timeout_error_is_exported_from_the_package() -> None:
    import guideloom_pipes
    from guideloom_pipes import DataLoaderTimeoutError
    from guideloom_pipes.pipes import DataLoaderTimeoutError as from_pipes

    assert DataLoaderTimeoutError is from_pipes
    assert "DataLoaderTimeoutError" in guideloom_pipes.__all__
    assert issubclass(DataLoaderTimeoutError, RuntimeError)
    assert issubclass(DataLoaderTimeoutError, TimeoutError)


def _documented_state(page: Path) -> dict[str, Any]:
    """The ``state_dict()`` that ``page`` prints: the comment after its ``print(state)``."""
    lines = page.read_text().splitlines()
    start = lines.index("print(state)") + 1
    text = []
    for line in lines[start:]:
        if not line.startswith("#"):
            break
        text.append(line[1:])
    return ast.literal_eval("\n".join(text))


def test_the_state_dict_docs_loader_md_prints_has_the_real_keys(tmp_path) -> None:
    documented = _documented_state(Path(__file__).parents[2] / "docs" / "loader.md")
    # the page's dataset and loader (docs/loader.md, quick start and checkpoints)
    storage = StreamStorage(tmp_path / "tokens", StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    with storage.sync_writer() as writer:
        for shard in range(4):
            writer.append(shard, {"tokens": np.arange(shard * 100_000, (shard + 1) * 100_000)})
    loader = StatefulDataLoader.from_storage(
        storage, list, sequence_length=2048, local_batch_size=8, shuffle=True, shuffle_seed=42
    )
    with loader:
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        state = loader.state_dict()
    assert list(documented) == list(state)
    varying = {"base_seed", "dataset_fingerprint"}  # drawn per run; the data's digests
    assert {k: v for k, v in documented.items() if k not in varying} == {
        k: v for k, v in state.items() if k not in varying
    }
    assert list(documented["dataset_fingerprint"]) == list(state["dataset_fingerprint"])
