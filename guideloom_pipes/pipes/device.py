"""Pin memory, prefetch and device placement of finished batches."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torchdata.nodes import BaseNode

from guideloom_pipes.checks import check_int
from guideloom_pipes.pipes.errors import is_batch_failure
from guideloom_pipes.pipes.ring import PinnedRing
from guideloom_pipes.pipes.workers.threads import WAKE_SECONDS

__all__ = ["PinMemory", "Prefetcher", "ToDevice", "apply_to_tensors"]


def apply_to_tensors(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor nested in dicts, lists, tuples, named tuples and dataclasses.

    Containers are rebuilt with the same type; anything that is not a tensor or one of these
    containers is returned unchanged.

    Args:
        data: A batch.
        fn: tensor -> tensor.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        items = {key: apply_to_tensors(value, fn) for key, value in data.items()}
        try:
            return type(data)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(data, tuple):
        values = [apply_to_tensors(value, fn) for value in data]
        if hasattr(data, "_fields"):  # named tuple
            return type(data)(*values)
        return tuple(values)
    if isinstance(data, list):
        return [apply_to_tensors(value, fn) for value in data]
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {
            field.name: apply_to_tensors(getattr(data, field.name), fn)
            for field in dataclasses.fields(data)
            if field.init
        }
        return dataclasses.replace(data, **changes)
    return data


def _source_reset(source: BaseNode[Any], initial_state: dict[str, Any] | None, key: str) -> None:
    if initial_state is not None:
        source.reset(initial_state[key])
    else:
        source.reset()


class PinMemory(BaseNode[Any]):
    """Copies every tensor of each batch into page-locked (pinned) host memory.

    Pinned batches copy to a CUDA device asynchronously (``non_blocking=True``). The work runs
    in the thread that pulls from this stage: put a :class:`Prefetcher` after it to overlap
    it with training. Needs a CUDA build of torch with a GPU.

    Args:
        source: Emits batches (tensors nested in containers, see :func:`apply_to_tensors`).
    """

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[Any]) -> None:
        super().__init__()
        self.source = source

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        _source_reset(self.source, initial_state, self.SOURCE_KEY)

    def next(self) -> Any:
        return apply_to_tensors(next(self.source), torch.Tensor.pin_memory)

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}


class ToDevice(BaseNode[Any]):
    """Moves every tensor of each batch to ``device``, in the calling (training) thread.

    With ``ring``, the batches' host tensors live in the buffers of a
    :class:`~guideloom_pipes.pipes.PinnedRing` (their windows were read into them): every
    tensor is copied (also to the CPU, so nothing delivered shares a buffer), an event is
    recorded after the copies and given to the ring, and the buffers go back to it once the
    batch is dropped; a buffer is handed out again only after that event has completed.

    Args:
        source: Emits batches (tensors nested in containers, see :func:`apply_to_tensors`).
        device: Target device.
        non_blocking: Asynchronous copies; by default on for CUDA (useful with pinned batches).
        ring: The ring the batches' host buffers come from, if any.
    """

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode[Any],
        device: torch.device | str | int,
        non_blocking: bool | None = None,
        ring: PinnedRing | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        self.device = torch.device(device)
        self.non_blocking = self.device.type == "cuda" if non_blocking is None else non_blocking
        self.ring = ring

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        _source_reset(self.source, initial_state, self.SOURCE_KEY)

    def next(self) -> Any:
        device, non_blocking = self.device, self.non_blocking
        if self.ring is None:
            return apply_to_tensors(
                next(self.source), lambda t: t.to(device, non_blocking=non_blocking)
            )
        batch = next(self.source)
        addresses: list[int] = []

        def move(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type == "cpu":
                addresses.append(tensor.data_ptr())
            return tensor.to(device, non_blocking=non_blocking, copy=True)

        try:
            return apply_to_tensors(batch, move)
        finally:
            # (also after a failed copy: those issued before it are covered by the event)
            self.ring.copied(addresses)

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self.source.state_dict()}


_ITEM, _END, _ERROR, _FAILED = 0, 1, 2, 3


class _Puller:
    """The prefetch thread's loop: pull from ``source`` into ``out`` while a slot is free;
    always end with _END or _ERROR. :meth:`halt` stops it without waiting for a pull."""

    __slots__ = ("busy", "lock", "out", "slots", "source", "stop")

    def __init__(self, source: BaseNode[Any], prefetch: int) -> None:
        self.source = source
        self.out: queue.SimpleQueue[tuple[int, Any, Any]] = queue.SimpleQueue()
        self.slots = threading.Semaphore(prefetch)
        self.lock = threading.Lock()
        self.stop = False
        self.busy = False  # inside next(source)

    def run(self) -> None:
        source, out, lock = self.source, self.out, self.lock
        try:
            while True:
                self.slots.acquire()
                with lock:
                    if self.stop:
                        return
                    self.busy = True
                try:
                    item = next(source)
                except StopIteration:
                    out.put((_END, None, source.state_dict()))
                    return
                except Exception as error:
                    if not is_batch_failure(error):
                        raise
                    # One batch failed: hand its error over in its place and go on.
                    item, kind = error, _FAILED
                else:
                    kind = _ITEM
                finally:
                    with lock:
                        self.busy = False
                # Handed over with no name left bound to it here, so that this thread (about
                # to wait for a slot) holds neither the batch nor an error, whose traceback,
                # once raised, holds the caller's frames.
                handover = [(kind, item, source.state_dict())]
                del item
                out.put(handover.pop())
        except BaseException as error:
            handover = [(_ERROR, error, None)]
            del error
            out.put(handover.pop())

    def halt(self) -> bool:
        """Ask the loop to stop; whether it is pulling from ``source`` right now (it then
        stops once that pull returns, and drops the item)."""
        with self.lock:
            self.stop = True
            busy = self.busy
        self.slots.release()  # wake the thread if it waits for a slot
        return busy


class Prefetcher(BaseNode[Any]):
    """Keeps up to ``prefetch`` finished batches waiting, pulled from ``source`` by a thread.

    Unlike torchdata's ``Prefetcher`` it never polls: the thread sleeps until a slot frees.
    :meth:`close` stops it at once, without waiting for a batch being pulled; the next
    ``reset()`` stops and joins it before resetting the source. The state is that
    of ``source`` as of the last batch delivered, so prefetched batches never count.
    Exceptions from ``source`` are re-raised in the caller with their type and traceback;
    after one that failed a batch alone (a read or ``collate_fn`` error) the next batch
    follows, after any other the stage is done.

    Args:
        source: The stage to read ahead of.
        prefetch: How many finished batches may wait (>= 1).
    """

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[Any], prefetch: int) -> None:
        super().__init__()
        self.prefetch = check_int("prefetch", prefetch, minimum=1, hint="for a Prefetcher")
        self.source = source
        self._thread: threading.Thread | None = None
        self._puller: _Puller | None = None
        self._snapshot: Any = None
        self._done = False

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._halt(wait=True)  # the source is reset next: no pull of the old thread may run
        _source_reset(self.source, initial_state, self.SOURCE_KEY)
        self._snapshot = self.source.state_dict()
        self._done = False
        self._puller = puller = _Puller(self.source, self.prefetch)
        self._thread = threading.Thread(target=puller.run, name="guideloom-prefetch", daemon=True)
        self._thread.start()

    def next(self) -> Any:
        if self._done or self._puller is None:
            raise StopIteration()
        puller = self._puller
        while True:  # in slices, so that a KeyboardInterrupt is raised while it waits
            try:
                kind, value, snapshot = puller.out.get(timeout=WAKE_SECONDS)
                break
            except queue.Empty:
                continue
        if kind in (_ITEM, _FAILED):
            puller.slots.release()
            self._snapshot = snapshot
            if kind == _FAILED:
                raise value
            return value
        self._done = True
        self._halt(wait=True)  # it has ended
        if kind == _END:
            self._snapshot = snapshot
            raise StopIteration()
        raise value

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self._snapshot}

    def close(self) -> None:
        """Stop the prefetch thread (the stage can be reset again). It is joined unless it
        is inside ``next(source)`` (a slow batch): then it ends when that returns, and the
        batch is dropped; close the source too (:func:`close_pipeline` does) to stop it."""
        self._halt(wait=False)

    def _halt(self, wait: bool) -> None:
        thread, puller = self._thread, self._puller
        self._thread = self._puller = None
        if thread is None or puller is None:
            return
        busy = puller.halt()
        if thread is not threading.current_thread() and (wait or not busy):
            thread.join()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()
