"""One epoch of a :class:`~guideloom_pipes.StatefulDataLoader` being delivered
(:class:`LoaderIterator`), and ``steps(n)`` across epochs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torchdata.nodes import BaseNode

from guideloom_pipes.pipes import close_pipeline
from guideloom_pipes.pipes.errors import DataLoaderTimeoutError, is_batch_failure
from guideloom_pipes.pipes.read import together_text
from guideloom_pipes.pipes.workers.threads import seconds_text

if TYPE_CHECKING:
    from guideloom_pipes.loader.stateful import StatefulDataLoader


class LoaderIterator(Iterator[Any]):
    """One epoch (or the rest of one) of a :class:`StatefulDataLoader`.

    Owns the pipeline: its threads and processes stop when it is drained, closed, fails, or
    is garbage-collected.
    """

    def __init__(self, loader: StatefulDataLoader, root: BaseNode[Any], epoch: int, offset: int):
        self._active = False
        self._loader = loader
        self._root = root
        self._epoch = epoch
        self._offset0 = offset
        self._global = loader.global_batch_size
        self._delivered = 0
        self._failed = False  # the last next() raised a batch's own error
        try:
            root.reset()
        except BaseException:
            close_pipeline(root)
            raise
        # reset above: the node's own next(), without BaseNode.__next__'s check that it was
        self._next_batch = root.next
        self._active = True

    def _position(self) -> int:
        return self._offset0 + self._delivered * self._global

    def _offset_batch(self) -> int:
        """The global batch size of the run that reached :meth:`_position`."""
        return self._global if self._delivered else self._loader._position.batch

    def __iter__(self) -> LoaderIterator:
        return self

    def __len__(self) -> int:
        """Batches this iterator delivers from where it started: ``len(loader)`` for a
        whole epoch, fewer for the rest of a resumed one."""
        return self._loader._order.steps_left(self._loader, self._epoch, self._offset0)

    def __next__(self) -> Any:
        if not self._active:
            raise StopIteration
        try:
            batch = self._next_batch()
        except StopIteration:
            self._finish(self._epoch + 1, 0)
            raise
        except BaseException as error:
            if is_batch_failure(error):
                # A read or collate_fn failed this batch alone: it counts as delivered, and
                # the next next() delivers the batch after it (as in torch).
                self._delivered += 1
                self._failed = True
                raise
            # Nothing more was delivered: a resume (or the next iter()) retries this batch.
            self._finish(self._epoch, self._position())
            if isinstance(error, DataLoaderTimeoutError):
                timed_out = DataLoaderTimeoutError(self._timeout_message(error.batches))
                timed_out.batches = error.batches
                raise timed_out from None
            raise
        self._delivered += 1
        self._failed = False
        return batch

    def _timeout_message(self, together: int) -> str:
        loader = self._loader
        settings = loader.settings
        if settings.num_workers:
            workers = settings.num_workers
            source = f"{workers} {settings.parallel_method} worker" + "s" * (workers > 1)
        elif settings.prefetch:
            source = "the prefetch thread"
        else:
            source = "the read thread (num_workers=0 with a timeout reads in one thread)"
        return (
            f"DataLoader timed out after {seconds_text(settings.timeout)} seconds waiting for "
            f"batch {self._delivered} of this iterator (epoch {self._epoch}, global position "
            f"{self._position()}, rank {settings.rank} of {settings.world_size}) from {source}"
            f"{together_text(together)}: a read or collate_fn took longer than timeout=, or hangs. "
            "Raise timeout= or find what blocks; the state still points at this batch, so the "
            "next iterator (or a resume) retries it"
        )

    def _resume_point(self) -> tuple[int, int]:
        """Where the loader goes on after what was delivered: ``(epoch, position)``, or the
        next epoch's start when this one has no batch left."""
        loader, offset = self._loader, self._position()
        if loader._order.steps_left(loader, self._epoch, offset) == 0:
            return self._epoch + 1, 0
        return self._epoch, offset

    def close(self) -> None:
        """Stop early: workers stop and the loader's offset returns to 0 (same epoch),
        except right after a batch raised: the loader then goes on after that batch (a loop
        that ended with a read or ``collate_fn`` error resumes past it, as its state says)."""
        if self._active:
            if self._failed:
                self._finish(*self._resume_point())
                return
            position = self._position()
            self._finish(self._epoch, 0)
            if position:  # a state taken now would not resume there: state_dict() warns
                self._loader._position.closed_early = (self._epoch, position)

    def _finish(self, epoch: int, offset: int) -> None:
        self._active = False
        loader = self._loader
        loader._position.move(epoch, offset, self._offset_batch() if offset else self._global)
        close_pipeline(self._root)

    def __del__(self) -> None:
        if getattr(self, "_active", False):
            self.close()


def run_steps(loader: StatefulDataLoader[Any, Any], count: int) -> Iterator[Any]:
    """``loader.steps(count)``: ``count`` batches from where the loader stands, one epoch
    iterator after another; the last batch is handed over with no iterator left active."""
    left = count
    while left:
        iterator: Any = iter(loader)
        try:
            for batch in iterator:
                left -= 1
                if left == 0:
                    # hand the last batch over with no iterator left active; an epoch that
                    # has no batch left moves to the next one
                    iterator._finish(*iterator._resume_point())
                    yield batch
                    return
                yield batch
        finally:
            if iterator._active:  # closed early (or a batch raised): keep what was
                # delivered; an epoch with no batch left moves to the next one
                iterator._finish(*iterator._resume_point())


def skip_steps(loader: StatefulDataLoader[Any, Any], count: int) -> None:
    """``loader.skip(count)``: the position ``count`` global batches on, across epoch ends
    as :func:`run_steps` goes (an epoch with no batch left moves to the next one), with
    nothing read."""
    here = loader._position
    epoch, offset, batch = here.epoch, here.offset, here.batch
    order, size = loader._order, loader.global_batch_size
    left = count
    while left:
        steps = order.steps_left(loader, epoch, offset)
        if left < steps:
            offset, batch, left = offset + left * size, size, 0
        elif steps == 0 and offset == 0:
            raise ValueError(
                f"epoch {epoch} of this loader has no batch (the dataset holds fewer samples "
                f"than a global batch of {size}): there is nothing to skip"
            )
        else:
            epoch, offset, batch, left = epoch + 1, 0, size, left - steps
    if not order.steps_left(loader, epoch, offset):
        epoch, offset = epoch + 1, 0  # (as steps() leaves an epoch whose batches ran out)
    here.move(epoch, offset, batch)


def close_failed_iterator(loader: StatefulDataLoader[Any, Any]) -> None:
    """Close the loader's active iterator if its last ``next()`` raised a batch's own error.

    Such an iterator could go on, but a loop that got the error has usually left it, and it
    lives on until that exception is collected (tracebacks hold it, often in a reference
    cycle): ``iter()``, ``steps()``, ``load_state_dict()`` and ``sampler.set_epoch()`` close
    it rather than refuse (the loader then stands after the failed batch), as torch's
    ``iter()`` leaves an old iterator behind.
    """
    iterator = loader._active_iterator()
    if iterator is not None and iterator._failed:
        iterator.close()


def refuse_active(loader: StatefulDataLoader[Any, Any], what: str) -> None:
    """``what`` (a call) cannot run while an iterator of the loader is active: say so."""
    close_failed_iterator(loader)
    if loader._active_iterator() is not None:
        raise RuntimeError(
            f"{what} while an iterator of this loader is active: drain it or call its close() first"
        )
