"""Per-step machinery: getting units' full params, and reducing their gradients.

[Note: ZeRO-3 schedule]
At stage 3 a unit's full parameters exist only while that unit computes:
:meth:`Units.flat` all-gathers the unit's compute-dtype shards (the next
unit's all-gather is already in flight: ``prefetch`` units ahead, and more
while they fit in the memory bound below, so a small unit such as a norm
does not leave the next large one's gather exposed), copies them out into
one flat buffer, each leaf whole at its place in the one-rank layout, in
one launch over the unit's runs (``ops/_runs.py``), and the caller drops it
after use. A torch module keeps each unit's activations and saves its params
by reference (see [Note: torch ZeRO-3] in ``interop/torch.py``). For a :class:`Layered` loss
the forward pass keeps each layer's VJP residuals except those that are its
own inputs; the backward pass re-gathers each unit in reverse order, hands
the layer's VJP its params again (so no residual pins a unit's params; with
``activation_checkpointing=True`` it recomputes the layer's forward from its
input instead), and hands the unit's gradient to :class:`GradReducer`, whose
reduce-scatter runs asynchronously while the next unit computes. A monolithic
loss gathers every unit first (it cannot be split), as the docs say.
At stages 0-2 the whole compute params are the state's, and at stage 3 on
one rank the shards are the whole params: :meth:`Units.flat` returns those
buffers themselves, the same every step, and nothing is gathered, copied or
sent. Gradients enter a unit's reduce layout the same way, in one launch
over runs that read each gradient where it lies; where the gradient buffers
have the whole params' layout (one rank, or stage 0), a torch module's
autograd sums into them directly (:meth:`GradReducer.bucket`).
Every buffer here is allocated on the state's device (see [Note: devices]).

Dropping a unit's arrays does not free them at once: JAX releases an input
buffer a moment after the computation that read it has finished. So, like
FSDP's all-gather rate limiter, a new gather or copy-out waits (briefly, and
at most ``RELEASE_WAIT`` seconds) until the full params still alive leave room
for it within ``1 + prefetch`` units beyond the pinned ones (a unit gathered
with ``pinned=True`` stays for the whole step, as a torch module's root unit
does); the bound is then a measured fact.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from typing import Any

import numpy as np

from ops import Communicator, Device
from ops._kernels import runs_kernel
from ops._runs import Runs, contiguous_on, copy_runs
from shard._layout import Layout
from shard._profile import timed

__all__ = ["CopyPlans", "GradBuffers", "GradReducer", "LiveBytes", "Units"]

log = logging.getLogger(__name__)
RELEASE_WAIT = 0.05  # seconds


class LiveBytes:
    """Counts the bytes of full unit parameters alive right now, and the peak.

    Arrays are counted until they are garbage collected (weakref finalizers),
    so anything that keeps a gathered unit alive shows up: a measurement, not
    bookkeeping of intent.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def track(self, a: Any, device: Device) -> Any:
        self.live += a.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(device.memory_owner(a), self._release, a.nbytes)
        return a

    def _release(self, n: int) -> None:
        self.live -= n


class Units:
    """Full parameters of one unit at a time (see [Note: ZeRO-3 schedule])."""

    def __init__(self, layout: Layout, comm: Communicator, *, stage: int, device: Device,
                 local: list[Any], full: list[Any] | None,
                 full_layout: Layout | None, prefetch: int = 1,
                 tracker: LiveBytes | None = None, plans: CopyPlans | None = None) -> None:
        self.layout, self.comm, self.stage, self.device = layout, comm, stage, device
        self.plans = plans or CopyPlans(layout, full_layout)
        self.local, self.full, self.full_layout = local, full, full_layout
        self.prefetch = prefetch
        self.tracker = tracker if tracker is not None else LiveBytes()
        self.bounded = True  # False: gather everything (a monolithic loss)
        self.pinned_bytes = 0
        self._warned = False
        self._inflight: dict[int, tuple[Any, Any, Any]] = {}  # u: (gathered, work, shard)
        self._unit_bytes = max((self._gather_bytes(u) for u in range(len(layout.units))),
                               default=0)
        # One rank at stage 3: its shards are the whole params, laid out as the
        # full layout's units (no padding rows), where they are on the device
        # (not so for compute params offloaded to the host).
        on_host = not device.host and bool(local) and isinstance(local[0], np.ndarray)
        self.solo = stage == 3 and comm.world_size == 1 and not on_host
        # The state's own buffers serve as the whole params of every unit (stages
        # 0-2, and stage 3 on one rank): nothing is gathered, copied or freed.
        self.persistent = stage < 3 or self.solo

    def _gather_bytes(self, u: int) -> int:
        """Bytes of unit ``u``'s all-gathered sections."""
        return (self.layout.units[u].sharded_size * self.comm.world_size
                * self.local[u].dtype.itemsize)

    def _wait_for_room(self, nbytes: int) -> None:
        """Block until ``nbytes`` more fit in ``1 + prefetch`` units (see the Note)."""
        if not self.bounded:
            return
        deadline = time.monotonic() + RELEASE_WAIT
        while not self._fits(nbytes):
            if time.monotonic() > deadline:
                if not self._warned:
                    log.warning("full unit params are still referenced %.2f s after use (held "
                                "by the loss function?); ZeRO-3 goes over its memory bound",
                                RELEASE_WAIT)
                    self._warned = True
                return
            time.sleep(2e-5)

    def _fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit in ``1 + prefetch`` units beyond the pinned ones."""
        limit = self.pinned_bytes + self._unit_bytes * (1 + self.prefetch)
        return not self.bounded or self.tracker.live + nbytes <= limit

    def start(self, u: int, *, wait: bool = True) -> bool:
        """Begin all-gathering unit ``u`` (stage 3; no-op otherwise). With
        ``wait=False`` only if it fits in the memory bound now; returns whether
        the unit is in flight."""
        if self.persistent or not 0 <= u < len(self.layout.units):
            return False
        if u in self._inflight:
            return True
        unit, shard = self.layout.units[u], self.local[u]
        # an extra prefetch leaves room for the copy-out of every unit in flight,
        # which briefly holds that unit twice
        copies = sum(out.nbytes for out, _, _ in self._inflight.values())
        if not wait and not self._fits(self._gather_bytes(u) + copies):
            return False
        self._wait_for_room(self._gather_bytes(u))
        out = self.tracker.track(self.device.empty(unit.sharded_size * self.comm.world_size,
                                                   shard.dtype), self.device)
        if not self.device.host and isinstance(shard, np.ndarray):  # compute params on the
            shard = self.device.asarray(shard)  # host (Offload(params="host")): a copy over
        work = (self.comm.all_gather_async(out, shard[:unit.sharded_size])
                if unit.sharded_size else None)
        self._inflight[u] = (out, work, shard)
        return True

    def get(self, u: int, upcoming: list[int] | tuple = (), *,
            pinned: bool = False) -> list[Any]:
        """Unit ``u``'s full leaves (views of :meth:`flat`), then start the gathers
        of ``upcoming`` units.

        The next gathers start only once this unit is copied out and its gather
        buffer freed, so at most this unit and ``prefetch`` more are alive.
        ``pinned`` units are kept for the step and counted outside that bound.
        More units may be prefetched while they fit (:meth:`prefetch_after`).
        """
        return self.leaf_views(u, self.flat(u, upcoming, pinned=pinned))

    def flat(self, u: int, upcoming: list[int] | tuple = (), *, pinned: bool = False) -> Any:
        """Unit ``u``'s whole params as one flat buffer, laid out as the full
        layout's unit (each leaf whole and contiguous at its offset there; see
        :meth:`leaf_views`). Where :attr:`persistent`, it is the state's own
        buffer, the same object every step; otherwise freshly gathered (stage 3)."""
        if self.stage < 3:
            return self.full[u]
        if self.solo:
            return self.local[u]
        with timed("library"):
            return self._gather(u, upcoming, pinned)

    def leaf_views(self, u: int, flat: Any) -> list[Any]:
        """The leaves of unit ``u`` (in its leaf order) as views of its flat buffer."""
        leaves = self.full_layout.leaves
        return [flat[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape)
                for leaf in (leaves[i] for i in self.full_layout.units[u].leaves)]

    def _gather(self, u: int, upcoming: Any, pinned: bool) -> Any:
        if pinned:
            self.pinned_bytes += self._gather_bytes(u)
        self.start(u)
        gathered, work, shard = self._inflight.pop(u)
        if work is not None:
            with timed("all_gather_wait"):
                work.wait()
        del work  # the handle references the buffer; the copy-out below is its last use
        self._wait_for_room(gathered.nbytes)
        # one buffer for the unit, tracked once: its views keep it alive
        flat = self.tracker.track(
            self.device.empty(self.full_layout.units[u].local_size, gathered.dtype), self.device)
        sharded, replicated = self.plans.gather(u)
        copy_runs(flat, sharded, sharded.table(self.device), device=self.device, src=gathered)
        copy_runs(flat, replicated, replicated.table(self.device), device=self.device, src=shard)
        del gathered, shard
        self.prefetch_after(upcoming)
        return flat

    def prefetch_after(self, upcoming: Any) -> None:
        """Start the gathers of the next ``prefetch`` units of ``upcoming``, then of
        more while they fit in the memory bound (small units, such as norms,
        would otherwise leave the next large unit's gather with nothing to hide
        behind)."""
        for i, v in enumerate(upcoming):
            if not self.start(v, wait=i < self.prefetch):
                return


class GradReducer:
    """Collects each unit's gradient and reduces it over the ranks.

    Stages 2 and 3 reduce-scatter every unit's gradient as soon as it is
    complete (asynchronously) and keep only this rank's shard, summed over
    micro-batches. Stages 0 and 1 accumulate the full gradient locally and
    reduce once, in :meth:`finish`. Replicated leaves are all-reduced.
    """

    def __init__(self, layout: Layout, comm: Communicator, *, stage: int, dtype: Any,
                 device: Device, buffers: GradBuffers | None = None,
                 plans: CopyPlans | None = None) -> None:
        self.layout, self.comm, self.stage, self.device = layout, comm, stage, device
        self.plans = plans or CopyPlans(layout, layout)
        self.dtype = np.dtype(dtype)
        w = comm.world_size if stage > 0 else 1
        # one rank (a single process, or a pipeline stage's data axis of width 1):
        # the sums are the shards, accumulated where the optimizer reads them, and
        # nothing is reduced
        self.solo = comm.world_size == 1
        buffers = buffers or GradBuffers(layout, self.dtype, device)
        if stage >= 2 and not self.solo:  # the first reduce-scatter writes the section
            self.shards = buffers.units
            for u, shard in zip(layout.units, self.shards, strict=True):
                if u.replicated_size:
                    shard[u.sharded_size:] = 0
        else:  # sums from zero: one fill
            self.shards = buffers.zeroed()
        self._written: set[int] = set()  # stages 2-3: units whose shard holds a sum
        # stages 0-1 (and one rank): the full gradients, summed over micro-batches;
        # where they have the shards' layout (one rank, or stage 0, whose
        # all-reduce works in place) they are the shards' sharded sections
        self._full = (None if stage > 1 and not self.solo else
                      [s[:u.sharded_size] for u, s in zip(layout.units, self.shards, strict=True)]
                      if self.solo or stage == 0 else
                      [device.zeros(u.sharded_size * w, self.dtype) for u in layout.units])
        self._pending: list[tuple[int, Any, Any]] = []
        self._early: dict[int, Any] = {}  # stages 0-1: units whose reduction is in flight
        self.final = True  # the micro-batch being added is the step's last
        # on_final(u, parts): takes unit u's reductions, [(later, work)] in order,
        # instead of finish() (an overlapped offload; see [Note: overlapped offload])
        self.on_final: Any = None
        self._handed: set[int] = set()

    def add(self, u: int, grads: list[Any]) -> None:
        """Add unit ``u``'s full leaf gradients (in the unit's leaf order): arrays of
        the state's device, or torch tensors and jax arrays on it (viewed through
        DLPack, no copy); None is a zero gradient."""
        with timed("library"):
            self._add(u, grads)

    def _add(self, u: int, grads: list[Any]) -> None:
        unit, w = self.layout.units[u], self.layout.world_size
        shard = self.shards[u]
        replicated = shard[unit.sharded_size:]
        if self._full is not None:  # stages 0-1: accumulate the full gradient
            first = u not in self._written  # zeros so far: a copy is the sum
            self._written.add(u)
            if not (first and not unit.replicated_size and self._pack(u, grads, self._full[u])):
                grads = [None if g is None else self._on_device(i, g)
                         for i, g in zip(unit.leaves, grads, strict=True)]
                for i, g in zip(unit.leaves, grads, strict=True):
                    self.layout.pack_grad(self.layout.leaves[i], g, self._full[u], replicated,
                                          add=True)
            if self.final and unit.sharded_size:  # complete: reduce it while others compute
                if self.on_final is not None and self.stage >= 1 and not unit.replicated_size:
                    self._handed.add(u)
                    self.on_final(u, [(None, _DONE if self.solo else
                                       self.comm.reduce_scatter_async(
                                           shard[:unit.sharded_size], self._full[u], op="sum"))])
                    return
                if self.solo:
                    return
                self._early[u] = (
                    self.comm.all_reduce_async(self._full[u], "sum") if self.stage == 0 else
                    self.comm.reduce_scatter_async(shard[:unit.sharded_size], self._full[u],
                                                   op="sum"))
            return
        packed = self.device.empty(unit.sharded_size * w, self.dtype)
        if self._pack(u, grads, packed):  # the sharded leaves in one launch
            for i, g in zip(unit.leaves, grads, strict=True):
                leaf = self.layout.leaves[i]
                if not leaf.sharded:
                    self.layout.pack_grad(leaf, None if g is None else self._on_device(i, g),
                                          packed, replicated, add=True)
        else:
            grads = [None if g is None else self._on_device(i, g)
                     for i, g in zip(unit.leaves, grads, strict=True)]
            for i, g in zip(unit.leaves, grads, strict=True):
                leaf = self.layout.leaves[i]
                self.layout.pack_grad(leaf, g, packed, replicated, add=not leaf.sharded)
        if unit.sharded_size:
            first = u not in self._written
            out = (shard[:unit.sharded_size] if first
                   else self.device.empty(unit.sharded_size, self.dtype))
            self._written.add(u)
            work = self.comm.reduce_scatter_async(out, packed, op="sum")
            if self.final and self.on_final is not None and not unit.replicated_size:
                self._handed.add(u)
                parts = [(o, wk) for v, o, wk in self._pending if v == u]
                self._pending = [p for p in self._pending if p[0] != u]
                self.on_final(u, [*parts, (None if first else out, work)])
            else:
                self._pending.append((u, None if first else out, work))

    def _pack(self, u: int, grads: list[Any], packed: Any) -> bool:
        """Copy unit ``u``'s sharded leaves' gradients into ``packed`` (its (W, S)
        reduce layout, padding rows zero) in one launch, reading each gradient
        where it lies; False (nothing done) unless every one can be read so,
        with one dtype the kernel takes."""
        unit = self.layout.units[u]
        addresses = np.zeros(len(unit.leaves), np.int64)
        dtype = None
        for j, (i, g) in enumerate(zip(unit.leaves, grads, strict=True)):
            leaf = self.layout.leaves[i]
            if g is None or not leaf.sharded:
                continue
            found = contiguous_on(g, self.device)
            if found is None or found[2] != leaf.size or dtype not in (None, found[1]):
                return False
            addresses[j], dtype = found[0], found[1]
        dtype = dtype if dtype is not None else self.dtype  # every gradient zero
        if runs_kernel(dtype, self.dtype) is None:
            return False
        runs = self.plans.grads(u, dtype.itemsize)
        copy_runs(packed, runs, runs.with_addresses(addresses, self.device), device=self.device,
                  src_dtype=dtype)
        return True

    def bucket(self, u: int) -> Any | None:
        """Where the caller may sum unit ``u``'s whole gradient itself (a torch
        module's ``.grad`` tensors are views of it, as DDP's
        ``gradient_as_bucket_view``), announcing it with :meth:`added`: the
        shards where they are the whole gradients, leaf by leaf as in the full
        layout (one rank, or stage 0). None where a reduction needs another
        layout."""
        return self.shards[u] if self.solo or self.stage == 0 else None

    def added(self, u: int) -> None:
        """Unit ``u``'s gradient of this micro-batch was summed into its bucket."""
        unit = self.layout.units[u]
        if not (self.final and unit.sharded_size):
            return
        if self.solo:
            if self.on_final is not None and self.stage >= 1 and not unit.replicated_size:
                self._handed.add(u)
                self.on_final(u, [(None, _DONE)])
            return
        # stage 0: the whole gradient is complete; all-reduce it while others compute
        self._early[u] = self.comm.all_reduce_async(self.shards[u][:unit.sharded_size], "sum")

    def _on_device(self, i: int, g: Any) -> Any:
        leaf = self.layout.leaves[i]
        g = self.device.asarray(g, what=f"the gradient of {leaf.path}")
        if tuple(g.shape) != leaf.shape and g.size != leaf.size:
            raise ValueError(f"the gradient of {leaf.path} has shape {tuple(g.shape)}; the "
                             f"param has {leaf.shape}")
        return g

    def finish(self) -> list[Any]:
        """Wait for the reductions; return per-unit gradient shards (sums over ranks)."""
        if self.solo:  # summed in place, nothing in flight
            return self.shards
        for u, out, work in self._pending:
            with timed("reduce_wait"):
                work.wait()
            if out is not None:  # a later micro-batch: add to the sum
                self.shards[u][:self.layout.units[u].sharded_size] += out
        self._pending.clear()
        if self.stage >= 2:
            for u, unit in enumerate(self.layout.units):
                if u not in self._written:  # no gradient reached this unit
                    self.shards[u][:unit.sharded_size] = 0
        for u, unit in enumerate(self.layout.units):
            shard = self.shards[u]
            if self._full is not None and unit.sharded_size and u not in self._handed and (
                    not self.solo):
                work = self._early.pop(u, None)
                with timed("reduce_wait"):
                    if work is not None:
                        work.wait()
                    elif self.stage == 0:
                        self.comm.all_reduce_(self._full[u], "sum")
                    else:
                        self.comm.reduce_scatter_into(shard[:unit.sharded_size], self._full[u],
                                                      "sum")
            if unit.replicated_size and not self.solo:
                with timed("reduce_wait"):
                    self.comm.all_reduce_(shard[unit.sharded_size:], "sum")
        return self.shards


class CopyPlans:
    """The run tables of a layout's unit copies (see ``ops/_runs.py``), each made
    once and kept by the step with its device tables."""

    def __init__(self, layout: Layout, full_layout: Layout) -> None:
        self.layout, self.full_layout = layout, full_layout
        self._plans: dict[tuple, Any] = {}

    def gather(self, u: int) -> tuple[Runs, Runs]:
        """Unit ``u``'s copy-out (see :meth:`Layout.gather_runs`): one launch for its
        sharded leaves, one for its replicated ones."""
        key = ("gather", u)
        if key not in self._plans:
            self._plans[key] = self.layout.gather_runs(u, self.full_layout)
        return self._plans[key]

    def grads(self, u: int, itemsize: int) -> Runs:
        """Unit ``u``'s gradient copy-in (see :meth:`Layout.grad_runs`)."""
        key = ("grads", u, itemsize)
        if key not in self._plans:
            self._plans[key] = self.layout.grad_runs(u, itemsize)
        return self._plans[key]


class GradBuffers:
    """The gradient shards, as views of one flat buffer kept by the step across
    steps (as DeepSpeed keeps its gradient partitions): one allocation, at most
    one fill a step, and the same memory every step, so a torch module's
    ``.grad`` views of them (see :meth:`GradReducer.bucket`) and the optimizer's
    pointer tables are made once."""

    def __init__(self, layout: Layout, dtype: Any, device: Device) -> None:
        self.layout, self.dtype, self.device = layout, np.dtype(dtype), device
        self.flat = device.empty(layout.local_size(), dtype)
        bounds = np.cumsum([0, *(u.local_size for u in layout.units)]).tolist()
        self.units = [self.flat[a:b] for a, b in itertools.pairwise(bounds)]

    def serves(self, layout: Layout, dtype: Any, device: Device) -> bool:
        return layout is self.layout and dtype == self.dtype and device is self.device

    def zeroed(self) -> list[Any]:
        self.flat[...] = 0
        return self.units


class _Done:
    """A reduction with nothing to wait for (one rank)."""

    @staticmethod
    def wait() -> None:
        return None


_DONE = _Done()
