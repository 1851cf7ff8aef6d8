"""The host tier's update overlapped with the backward: ``Offload("host", overlap=True)``.

[Note: overlapped offload]
Without overlap, an offloaded step runs the whole update after the backward
(see [Note: offload]): the host must know that every gradient is finite before
it changes a master. With ``overlap=True`` the update of a unit starts as soon
as its reduced gradient shard exists, while the device still runs the backward
of the units before it, and the step decides at the end whether to keep it:

- a copier thread waits for unit ``u``'s reduction (adding a later
  micro-batch's part, as :class:`GradReducer` would), and copies the shard
  into a page-locked host buffer;
- an updater thread runs the fused kernel's CPU build out of place: it reads
  ``u``'s masters and moments and writes the new ones into a spare set of
  host buffers (one pass, as many bytes as the in-place update), and the new
  compute-dtype params into a host buffer;
- after the backward the step reads the gradients' sum of squares as before.
  Finite: the spare set becomes the state's masters and moments (the old set
  is the next step's spare) and the new params go to the device. Not finite,
  or any thread failed: the spare set is dropped and the state is as it was.

The kernel gets the same arguments as without overlap (the gradient scale, the
step count and learning rate are known when the step starts), so the
trajectory is the same bit for bit (the out-of-place pass computes each
element with the in-place kernel's code). What it costs: a second set of
masters and moments in host memory (``estimate_memory`` counts it in
``on_host``), and host cores busy beside the backward. Clipping
needs the global norm before any update, so ``overlap=True`` refuses
``clip_norm``; the disk tier streams units in file order and does not overlap.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ops import Device
    from ops._types import Array
    from ops.comm._base import Pending
    from shard.core._state import TrainState

__all__ = ["HostStaging", "OverlappedUpdate", "Reducing", "Spare"]

_STOP = object()


class Reducing(Protocol):
    """What the overlapped update reads of the step's gradient reducer: its
    device gradient shards, and where it hands each unit's reductions."""

    @property
    def shards(self) -> list[Array]: ...

    on_final: Callable[[int, list[tuple[Array | None, Pending]]], None] | None


@dataclass
class HostStaging:
    """Page-locked host buffers a device step copies through, kept across steps:
    per unit, the gradient shard (device state only) and the new compute-dtype
    params (unless the compute shards live on the host); empty lists otherwise."""

    grads: list[np.ndarray]
    out: list[np.ndarray]
    key: tuple

    @classmethod
    def make(cls, device: Device, sizes: list[int], grad_dtype: DTypeLike | None,
             out_dtype: DTypeLike | None,
             grad_sizes: list[int]) -> HostStaging:
        """``grad_dtype`` / ``out_dtype`` None: that set is not needed;
        ``grad_sizes``: the gradient shards' (the trainable leaves' alone, see
        [Note: frozen leaves])."""
        def bufs(dtype: DTypeLike | None, sizes: list[int]) -> list[np.ndarray]:
            return [] if dtype is None else [device.pinned_empty(n, dtype) for n in sizes]

        return cls(bufs(grad_dtype, grad_sizes), bufs(out_dtype, sizes),
                   _key(sizes, grad_dtype, out_dtype, grad_sizes))

    def fits(self, sizes: list[int], grad_dtype: DTypeLike | None, out_dtype: DTypeLike | None,
             grad_sizes: list[int]) -> bool:
        return self.key == _key(sizes, grad_dtype, out_dtype, grad_sizes)


def _key(sizes: list[int], grad_dtype: DTypeLike | None, out_dtype: DTypeLike | None,
         grad_sizes: list[int]) -> tuple:
    return (tuple(sizes), tuple(grad_sizes), None if grad_dtype is None else np.dtype(grad_dtype),
            None if out_dtype is None else np.dtype(out_dtype))


@dataclass
class Spare:
    """The set of host buffers an overlapped update writes into: masters and
    moments per unit, and the compute shards where they live on the host."""

    master: list[np.ndarray]
    exp_avg: list[np.ndarray]
    exp_avg_sq: list[np.ndarray]
    compute: list[np.ndarray] | None

    @classmethod
    def like(cls, state: TrainState, resident: bool) -> Spare:
        def empty(bufs: tuple[np.ndarray, ...]) -> list[np.ndarray]:
            return [np.empty_like(b) for b in bufs]

        return cls(empty(state.master), empty(state.exp_avg), empty(state.exp_avg_sq),
                   empty(state.compute) if resident else None)

    def fits(self, state: TrainState, resident: bool) -> bool:
        same = all(a.shape == b.shape and a.dtype == b.dtype
                   for a, b in zip(self.master, state.master, strict=True))
        return same and (self.compute is not None) == resident

    def nbytes(self) -> int:
        bufs = self.master + self.exp_avg + self.exp_avg_sq + (self.compute or [])
        return sum(b.nbytes for b in bufs)


class OverlappedUpdate:
    """One step's overlapped update (see [Note: overlapped offload]).

    ``run_unit(u, grad, spare)`` updates unit ``u`` from its host gradient into
    ``spare``; ``shards`` are the reducer's device gradient shards.
    """

    def __init__(self, device: Device, shards: list[Array], staging: HostStaging, spare: Spare,
                 run_unit: Callable[[int, np.ndarray, Spare], None]) -> None:
        self.device, self.shards, self.units = device, shards, len(shards)
        self.staging, self.spare, self.run_unit = staging, spare, run_unit
        self.handed: set[int] = set()
        self._grads: list[np.ndarray | None] = [None] * self.units  # on the host, per unit
        self._copy_q: queue.Queue = queue.Queue()
        self._update_q: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._copied = 0
        self._updated = 0
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True,
                                          name=f"zeroshard-offload-{fn.__name__.strip('_')}")
                         for fn in (self._copier, self._updater)]
        for t in self._threads:
            t.start()

    # -- the step's side -----------------------------------------------------------
    def submit(self, u: int, parts: list[tuple[Array | None, Pending]]) -> None:
        """Unit ``u``'s reductions in flight, in order: ``(later, work)``, where
        ``later`` is a later micro-batch's part to add to the shard once ``work``
        is done (None: it reduced into the shard)."""
        self.handed.add(u)
        self._copy_q.put((u, parts))

    def submit_rest(self) -> None:
        """Every unit not handed over yet (their reductions are complete)."""
        for u in range(self.units):
            if u not in self.handed:
                self.submit(u, [])

    def wait_copied(self) -> None:
        """Until every unit's gradient shard is complete on the device and on the
        host (the step's norm reads the device shards next)."""
        self._wait(lambda: self._copied == self.units)

    def wait_updated(self) -> None:
        self._wait(lambda: self._updated == self.units)

    def close(self) -> None:
        """Stop the threads (after a failure too); idempotent."""
        self._copy_q.put(_STOP)
        self._update_q.put(_STOP)
        for t in self._threads:
            t.join()

    # -- threads ---------------------------------------------------------------
    def _wait(self, done: Callable[[], bool]) -> None:
        with self._lock:
            while not done() and self._error is None:
                self._lock.wait(0.5)
            if self._error is not None:
                raise RuntimeError("the overlapped offload update failed; the state is "
                                   "unchanged") from self._error

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # re-raised on the step's thread
            with self._lock:
                self._error = self._error or e
                self._lock.notify_all()

    def _copier(self) -> None:
        while (item := self._copy_q.get()) is not _STOP and self._error is None:
            u, parts = item
            shard = self.shards[u]
            with self.device.using(shard):  # this thread's current GPU is the shard's
                for later, work in parts:
                    work.wait()
                    if later is not None:
                        shard[:later.size] += later
                self._grads[u] = shard if self.device.host else \
                    self.device.to_host_into(shard, self.staging.grads[u])
            with self._lock:
                self._copied += 1
                self._lock.notify_all()
            self._update_q.put(u)

    def _updater(self) -> None:
        while (u := self._update_q.get()) is not _STOP and self._error is None:
            self.run_unit(u, self._grads[u], self.spare)
            with self._lock:
                self._updated += 1
                self._lock.notify_all()
