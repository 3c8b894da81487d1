"""``guideloom_pipes.DataLoader`` over torch's DataPipes, as torch's ``DataLoader`` reads
them: an ``IterDataPipe``'s ``shuffle()`` seeded from one shared seed per epoch (drawn as
torch draws it), its ``sharding_filter()`` keeping each worker's share (each sample once
per epoch, not once per worker), a ``MapDataPipe`` read by index; checked against torch's
own loader with the same arguments, and resumed at every step."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

import torch
import torch.utils.data as tud
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.datapipes.map import SequenceWrapper
from torch_loader_helpers import plain, seed_all, stop_and_resume

from guideloom_pipes import DataLoader

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:This DataLoader will create"),
]

_CASES: dict[str, dict[str, Any]] = {
    "inline": {"num_workers": 0},
    "workers": {"num_workers": 2},
    "persistent": {"num_workers": 2, "persistent_workers": True},
    "generator": {"num_workers": 2, "generator": "seeded"},
}


def _pipe(n: int = 23) -> Any:
    return IterableWrapper(range(n)).shuffle(buffer_size=5).sharding_filter()


def _options(name: str) -> dict[str, Any]:
    options: dict[str, Any] = {"batch_size": 3, "shuffle": True, **_CASES[name]}
    if options.get("generator") == "seeded":
        options["generator"] = torch.Generator().manual_seed(5)
    return options


def _epochs(cls: type, dataset: Any, epochs: int, **options: Any) -> list[Any]:
    """Each epoch's batches, then a draw of torch's global generator (the loader's draws
    from it compared too)."""
    seed_all()
    loader = cls(dataset, **options)
    out: list[Any] = [[plain(batch) for batch in loader] for _ in range(epochs)]
    return [*out, float(torch.rand(()))]


@pytest.mark.parametrize("name", list(_CASES))
def test_a_sharded_shuffled_iter_datapipe_gives_torchs_batches_and_draws(name: str) -> None:
    ours = _epochs(DataLoader, _pipe(), 3, **_options(name))
    assert ours == _epochs(tud.DataLoader, _pipe(), 3, **_options(name))
    for epoch in ours[:-1]:  # each sample once an epoch, whatever the workers
        assert sorted(i for batch in epoch for i in batch) == list(range(23))
    assert ours[0] != ours[1]  # (a new shuffle each epoch)


def test_an_epoch_after_the_same_global_seed_is_the_same_with_persistent_workers() -> None:
    loader: DataLoader[Any] = DataLoader(
        _pipe(), batch_size=3, num_workers=1, persistent_workers=True
    )
    torch.manual_seed(123)
    first = [plain(batch) for batch in loader]
    torch.manual_seed(123)
    assert [plain(batch) for batch in loader] == first


def test_a_worker_init_fn_runs_after_the_workers_copy_is_sharded() -> None:
    seed_all()
    loader: DataLoader[Any] = DataLoader(
        _pipe(12), batch_size=2, num_workers=2, worker_init_fn=_only_mine
    )
    assert sorted(i for batch in loader for i in plain(batch)) == list(range(12))


def _only_mine(worker_id: int) -> None:
    # (torch's order: the copy is sharded before worker_init_fn runs)
    info = tud.get_worker_info()
    assert info is not None
    share = list(info.dataset)  # type: ignore[call-overload]
    assert len(share) == 6, share


@pytest.mark.parametrize("name", ["inline", "workers", "persistent"])
def test_a_stop_at_every_step_of_a_datapipe_run_resumes_with_the_rest(name: str) -> None:
    # (the pipe keeps no state: the resume draws the same shared seed and replays)
    epochs = 2
    options = _options(name)
    seed_all()
    loader: DataLoader[Any] = DataLoader(_pipe(11), **options)
    whole = [plain(batch) for _ in range(epochs) for batch in loader]
    assert len(whole) >= 8
    for k in range(len(whole) + 1):
        got, _ = stop_and_resume(k, lambda: DataLoader(_pipe(11), **options), epochs)
        assert got == whole, k


@pytest.mark.parametrize("workers", [0, 2])
def test_a_map_datapipe_gives_torchs_batches(workers: int) -> None:
    def run(cls: type) -> list[Any]:
        return _epochs(
            cls, SequenceWrapper(range(10)), 2, batch_size=4, shuffle=True, num_workers=workers
        )

    assert run(DataLoader) == run(tud.DataLoader)
