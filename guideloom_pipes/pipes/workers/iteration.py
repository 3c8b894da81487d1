"""One pass over an iterable dataset (torch's ``IterableDataset``, any object with
``__iter__``), a batch at a time, as a worker (a process, or the calling thread) makes it:
where it starts, the batches, and the record of where it stands after each.

Numpy- and torch-free: worker processes import it first (see ``process_main``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

__all__ = ["DatasetIteration", "IterationStep", "WorkerRecord", "is_stateful"]


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` keeps its own position (torchdata's ``Stateful`` protocol:
    ``state_dict()`` and ``load_state_dict()``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


@dataclass(frozen=True)
class WorkerRecord:
    """Where one worker's pass over its dataset copy stands, as of the last batch of it that
    was delivered: what a resume starts that worker from."""

    #: Samples its iterator has given (a resume without states skips as many).
    yielded: int = 0
    #: ``dataset.state_dict()`` after them, where the dataset has one.
    dataset_state: Any = None
    #: ``state_dict()`` of the iterator ``iter(dataset)`` returned, where it has one.
    iterator_state: Any = None
    #: It has no batch left: its iterator ended (or its last batch was the partial one).
    ended: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "yielded": self.yielded,
            "dataset_state": self.dataset_state,
            "iterator_state": self.iterator_state,
            "ended": self.ended,
        }

    @classmethod
    def of_dict(cls, saved: Any, where: str) -> WorkerRecord:
        keys = ("yielded", "dataset_state", "iterator_state", "ended")
        if not isinstance(saved, dict) or set(saved) != set(keys):
            raise ValueError(
                f"{where} = {saved!r} is not a worker's record of a guideloom_pipes.DataLoader "
                f"state (a dict of {', '.join(keys)}): pass a dict from its state_dict()"
            )
        yielded = saved["yielded"]
        if type(yielded) is not int or yielded < 0:
            raise ValueError(f"{where}['yielded'] = {yielded!r} must be an int >= 0")
        return cls(yielded, saved["dataset_state"], saved["iterator_state"], bool(saved["ended"]))


class IterationStep(NamedTuple):
    """What a worker answers to "your next batch": the batch (None when it has no more) and
    its record after it."""

    batch: Any
    record: WorkerRecord


class DatasetIteration:
    """A worker's pass over its copy of ``dataset``, from ``start``.

    Started as torchdata's ``StatefulDataLoader`` resumes one: ``dataset.load_state_dict``
    with the record's dataset state, then ``iter(dataset)``, then the iterator's own
    ``load_state_dict``; where neither the dataset nor its iterator keeps a state, the first
    ``start.yielded`` samples are drawn and dropped (a replay: it costs their reading). A
    dataset that is its own iterator (``iter(dataset) is dataset``) has one state, kept as the
    iterator's and loaded after ``iter()``. ``prepare`` is applied to the dataset before the
    pass (a DataPipe seeded for the epoch); :attr:`record` holds the states from the start.

    Each :meth:`step` reads ``batch_size`` samples (one, unbatched, for ``None``) and
    collates them, as torch's fetcher does: a last partial batch is delivered unless
    ``drop_last``; after the iterator ends no more of it is asked.
    """

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[Any], Any] | None,
        batch_size: int | None,
        drop_last: bool,
        start: WorkerRecord | None = None,
        *,
        copy_states: bool = False,
        prepare: Callable[[Any], Any] | None = None,
    ) -> None:
        start = start or WorkerRecord()
        if prepare is not None and not start.ended:
            dataset = prepare(dataset)  # (seeded, sharded: before its pass starts)
        self._dataset = dataset
        self._collate = collate_fn
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._copy = copy_states  # (states kept in this process: not aliased to live ones)
        self._stateful_dataset = is_stateful(dataset)
        self._stateful_iterator = False
        #: The dataset is its own iterator: its one state is the pass's (saved once).
        self._own = callable(getattr(dataset, "__next__", None))
        self.record = start
        self._iterator: Iterator[Any] | None = None
        if start.ended:
            return
        saved = start.dataset_state if self._stateful_dataset else None
        if saved is not None and not self._own:
            dataset.load_state_dict(saved)
            saved = None
        iterator = iter(dataset)
        self._own = iterator is dataset
        self._stateful_iterator = is_stateful(iterator)
        pass_state = start.iterator_state
        if self._own:  # (its one state; an older release saved it as the dataset's too)
            pass_state, saved = (saved if pass_state is None else pass_state), None
        if pass_state is not None and self._stateful_iterator:
            iterator.load_state_dict(pass_state)
        if saved is not None:
            dataset.load_state_dict(saved)  # (its __next__ is not its iterator's)
        if start.yielded and not self._stateful_dataset and not self._stateful_iterator:
            for skipped in range(start.yielded):
                try:
                    next(iterator)
                except StopIteration:
                    raise ValueError(
                        f"the state says this worker's pass had given {start.yielded} "
                        f"samples, but the dataset's iterator ended after {skipped}: the "
                        "state belongs to another dataset (or one whose samples change "
                        "between runs)"
                    ) from None
        self._iterator = iterator
        # where the pass stands before its first batch (a state taken then resumes here)
        self.record = WorkerRecord(start.yielded, *self._states())

    def _states(self) -> tuple[Any, Any]:
        """``(dataset state, iterator state)`` now; a dataset that is its own iterator has
        one state, the pass's (as the iterator's, as torchdata keeps it)."""
        own_dataset = self._stateful_dataset and not self._own
        dataset_state = self._dataset.state_dict() if own_dataset else None
        iterator_state = (
            self._iterator.state_dict()  # type: ignore[attr-defined]
            if self._iterator is not None and self._stateful_iterator
            else None
        )
        if self._copy:
            return copy.deepcopy(dataset_state), copy.deepcopy(iterator_state)
        return dataset_state, iterator_state

    def step(self) -> IterationStep:
        """The next batch, or ``batch=None`` with ``record.ended`` when there is none; a
        read or ``collate_fn`` error is raised (the pass goes on after it, as in torch)."""
        iterator = self._iterator
        if iterator is None:
            return IterationStep(None, replace(self.record, ended=True))
        wanted = 1 if self._batch_size is None else self._batch_size
        samples: list[Any] = []
        ended = False
        try:
            while len(samples) < wanted:
                try:
                    samples.append(next(iterator))
                except StopIteration:
                    ended = True
                    break
        finally:
            # (a sample's error: what was drawn before it counts as given)
            if ended:
                self._iterator = None
            self.record = WorkerRecord(
                self.record.yielded + len(samples), *self._states(), ended=ended
            )
        if not samples or (ended and self._drop_last):  # (ended: the record says so)
            return IterationStep(None, self.record)
        data: Any = samples[0] if self._batch_size is None else samples
        if self._collate is not None:
            data = self._collate(data)
        return IterationStep(data, self.record)
