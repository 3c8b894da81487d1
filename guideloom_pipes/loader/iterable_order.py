"""The order of :class:`~guideloom_pipes.DataLoader` over an ``IterableDataset``: each
worker's own pass over its copy, interleaved round robin as torch interleaves them
(:class:`~guideloom_pipes.pipes.iterable.IterableReads`), one step per batch delivered.

Its state holds, for each worker, its :class:`~guideloom_pipes.pipes.workers.iteration.
WorkerRecord` as of its last batch delivered (the dataset's ``state_dict()`` and its
iterator's where they have one, else the number of samples the worker's pass gave, skipped
again on resume), and whose turn is next. Those are the passes of ``num_workers`` workers
(``max(num_workers, 1)`` records): such a state resumes on the same ``num_workers`` only. At
an epoch's end the records keep each dataset's own state where the same dataset objects go on
into the next epoch (:meth:`IterableOrder.carried`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from guideloom_pipes.loader.sampler_order import check_header
from guideloom_pipes.pipes.iterable import IterableReads
from guideloom_pipes.pipes.workers.iteration import WorkerRecord

if TYPE_CHECKING:
    from guideloom_pipes.loader.torch_loader import DataLoader

#: What identifies a state of this order (``state_dict()['kind']``), and its version.
KIND = "guideloom_pipes.DataLoader/iterable"
VERSION = 1


def passes(loader: DataLoader[Any]) -> int:
    """How many passes over the dataset an epoch makes: one per worker (one without)."""
    return max(loader.num_workers, 1)


class IterableOrder:
    """The order a :class:`~guideloom_pipes.DataLoader` reads an ``IterableDataset`` in."""

    name = "iterable"

    def forget(self) -> None:
        """(Nothing is kept from an open reader.)"""

    def steps(self, loader: DataLoader[Any], epoch: int) -> int:
        return len(loader)

    def steps_left(self, loader: DataLoader[Any], epoch: int, offset: int) -> int:
        """Batches left after ``offset`` by the dataset's ``len()`` (what torch's
        ``len(loader)`` says); 1 without one (the end is seen when it comes)."""
        try:
            return max(len(loader) - offset, 0)
        except TypeError:
            return 1

    def carried(self, loader: DataLoader[Any], reads: IterableReads) -> list[WorkerRecord] | None:
        """What the next epoch's passes start from, once every pass of ``reads`` has
        ended: each dataset's own state as its pass left it, where the same dataset objects
        go on (in the training process, or in persistent workers; new workers get new
        copies, as in torch); None where nothing carries over."""
        if loader.num_workers and not loader.persistent_workers:
            return None
        records = [WorkerRecord(dataset_state=record.dataset_state) for record in reads.records]
        return records if any(r.dataset_state is not None for r in records) else None

    @staticmethod
    def starts(state: Mapping[str, Any]) -> bool:
        """Whether ``state`` says where its workers' passes start beyond "from the
        beginning": mid-epoch, or a pass's states at an epoch's start."""
        return bool(state["batches"]) or any(
            saved.get("dataset_state") is not None or saved.get("iterator_state") is not None
            for saved in state["workers"]
        )

    def records(self, loader: DataLoader[Any], state: Mapping[str, Any]) -> list[WorkerRecord]:
        """The workers' records of a state :meth:`check_state` passed."""
        return [
            WorkerRecord.of_dict(saved, f"state_dict['workers'][{index}]")
            for index, saved in enumerate(state["workers"])
        ]

    def state(
        self,
        loader: DataLoader[Any],
        epoch: int,
        batches: int,
        records: list[WorkerRecord] | None,
        turn: int,
    ) -> dict[str, Any]:
        if records is None:
            records = [WorkerRecord()] * passes(loader)
        return {
            "kind": KIND,
            "version": VERSION,
            "epoch": epoch,
            "batches": batches,
            "num_workers": loader.num_workers,
            "workers": [record.as_dict() for record in records],
            "turn": turn,
        }

    def state_of(self, loader: DataLoader[Any], iterator: Any) -> dict[str, Any]:
        """The loader's state: each worker's record as of its last batch delivered by the
        active ``iterator`` (None: none is), and whose turn is next."""
        records: list[WorkerRecord] | None = None
        turn, started = 0, False
        if iterator is None:
            epoch, offset = loader._position.epoch, loader._position.offset
            if not offset:
                records = loader._carried  # (the datasets' states after the last epoch)
        else:
            reads = iterator.source
            assert isinstance(reads, IterableReads)
            epoch, offset = iterator._epoch, iterator._position()
            if offset and all(record.ended for record in reads.records):
                epoch, offset = epoch + 1, 0  # every pass has ended: the next epoch's start
                records = self.carried(loader, reads)
            else:
                records, turn, started = reads.records, reads.turn, offset == 0
        state = self.state(loader, epoch, offset, records, turn)
        state.update(loader._draws(offset, started))
        return state

    def check_state(self, loader: DataLoader[Any], state: Mapping[str, Any]) -> None:
        """Refuse a state that is not of this order, or of another number of workers."""
        check_header(
            state,
            kind=KIND,
            version=VERSION,
            over="an IterableDataset",
            instead="a map-style dataset's state loads into a loader of that dataset",
            counts=("epoch", "batches", "turn", "num_workers"),
        )
        saved = state["num_workers"]
        workers = state.get("workers")
        if not isinstance(workers, list) or len(workers) != max(saved, 1):
            raise ValueError(
                f"state_dict['workers'] = {workers!r} must be a list of {max(saved, 1)} "
                "worker records: the state was changed, or is not a DataLoader state"
            )
        self.records(loader, state)  # (each record checked)
        if max(saved, 1) != passes(loader) and self.starts(state):
            raise ValueError(
                f"this state was taken with num_workers={saved} and this loader has "
                f"num_workers={loader.num_workers}: an IterableDataset's state holds where "
                f"each worker's own pass over its copy stood ({max(saved, 1)} passes), which "
                "cannot be split or merged into another number of workers. Resume with "
                f"num_workers={saved} (a map-style dataset's state resumes on any number)"
            )
        if state["turn"] >= max(saved, 1):
            raise ValueError(
                f"state_dict['turn'] = {state['turn']} names no worker of "
                f"{max(saved, 1)}: the state was changed"
            )
