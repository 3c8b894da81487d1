"""The loader's public shape as GuideLoom 1.1 has it: bases, generics, helpers, signature."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sized

import pytest

pytest.importorskip("torch")

import torch

from guideloom_pipes import StatefulDataLoader
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
