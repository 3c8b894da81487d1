"""The pipeline's errors: :class:`DataLoaderTimeoutError`, and batch failures (an exception
that a dataset read or ``collate_fn`` raised for one batch).

Such an error fails its batch alone: the stages that raise it mark it, stages between them
and the caller (``Prefetcher``) keep going past it, and the loader's iterator delivers the
next batch on the next ``next()``, as torch's ``DataLoader`` does. Any other error (a
timeout, a worker process that died, Ctrl-C) ends the iterator.
"""

from __future__ import annotations

import contextlib

__all__ = ["DataLoaderTimeoutError", "is_batch_failure", "mark_batch_failure"]

_MARK = "_guideloom_batch_failure"


def mark_batch_failure(error: BaseException) -> None:
    """Mark ``error`` as raised by reading or collating one batch (an ``Exception`` only;
    one whose class takes no attributes stays unmarked, so it ends the iterator)."""
    if isinstance(error, Exception):
        with contextlib.suppress(AttributeError, TypeError):
            setattr(error, _MARK, True)


def is_batch_failure(error: BaseException) -> bool:
    """Whether ``error`` failed one batch only (see :func:`mark_batch_failure`)."""
    return isinstance(error, Exception) and getattr(error, _MARK, False) is True


class DataLoaderTimeoutError(RuntimeError, TimeoutError):
    """No batch came within the loader's ``timeout=``: a read or ``collate_fn`` hangs or is
    slower than that. A ``RuntimeError`` (what torch's ``DataLoader`` raises) and a
    ``TimeoutError``.

    ``batches`` is how many batches the job that did not come held, the awaited one first:
    quick batches are read a few at a time, and the one that hangs may be any of them.
    """

    batches = 1
