"""A step's gradients, reduced over the ranks into the shards the optimizer reads.

:class:`GradReducer` takes each unit's gradients as soon as they are complete
(see [Note: ZeRO-3 schedule] in ``shard/step/_runtime.py``); :class:`GradBuffers`
are the shards, kept by the step across steps; :class:`CopyPlans` the run
tables of a layout's unit copies (``ops/device/_runs.py``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ops import Communicator, Device, sum_of_squares
from ops._quant import reduce_scatter_quantized
from ops.device._runs import Runs, contiguous_on, copy_runs
from ops.kernels._table import runs_kernel
from shard.core._layout import Layout
from shard.monitor._profile import timed

if TYPE_CHECKING:
    from typing import TypeAlias

    import jax
    import torch
    from numpy.typing import DTypeLike

    from ops._types import Array
    from ops.comm._base import Pending

    # a leaf's gradient as a loss hands it over: an array of the state's device,
    # or a torch tensor or jax array on it (viewed through DLPack)
    Grad: TypeAlias = Array | jax.Array | torch.Tensor

__all__ = ["CopyPlans", "GradBuffers", "GradReducer", "wait_quietly"]


class GradReducer:
    """Collects each unit's gradient and reduces it over the ranks.

    Stages 2 and 3 reduce-scatter every unit's gradient as soon as it is
    complete (asynchronously) and keep only this rank's shard, summed over
    micro-batches. Stages 0 and 1 accumulate the full gradient locally and
    reduce once, in :meth:`finish`. Replicated leaves are all-reduced.
    ``accumulate=False``: none of those sums (a subclass that reduces each
    gradient as it comes writes the shards itself). ``quantized``: 8 or 4,
    the reduce-scatters send int8 or int4 (ZeRO++'s qgZ, see [Note: quantized
    gradient reduction] in ``ops/_quant.py``), in two hops over ``hierarchy``
    (the node's ranks, this place's ranks on every node) where it is given;
    0: exact.
    """

    def __init__(self, layout: Layout, comm: Communicator, *, stage: int, dtype: DTypeLike,
                 device: Device, buffers: GradBuffers | None = None,
                 plans: CopyPlans | None = None, accumulate: bool = True,
                 quantized: int = 0,
                 hierarchy: tuple[Communicator, Communicator] | None = None) -> None:
        self.layout, self.comm, self.stage, self.device = layout, comm, stage, device
        self.quantized, self.hierarchy = quantized, hierarchy
        if quantized and np.dtype(dtype).name not in ("float32", "bfloat16", "float16"):
            raise TypeError(f"quantized_gradients=: the gradients are reduced in "
                            f"{np.dtype(dtype)}; block quantization takes float32, bfloat16 "
                            "or float16")
        self.plans = plans or CopyPlans(layout, layout)
        self.dtype = np.dtype(dtype)
        w = comm.world_size if stage > 0 else 1
        # one rank (a single process, or a pipeline stage's data axis of width 1):
        # the sums are the shards, accumulated where the optimizer reads them, and
        # nothing is reduced
        self.solo = comm.world_size == 1
        buffers = buffers or GradBuffers(layout, self.dtype, device)
        if (stage >= 2 and not self.solo) or not accumulate:  # the first reduction writes it
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
        self._full = (None if (stage > 1 and not self.solo) or not accumulate else
                      [s[:u.sharded_size] for u, s in zip(layout.units, self.shards, strict=True)]
                      if self.solo or stage == 0 else
                      [device.zeros(u.sharded_size * w, self.dtype) for u in layout.units])
        self._pending: list[tuple[int, Array | None, Pending]] = []
        # stages 0-1: units whose reduction is in flight (Any: a Pending, which
        # finish pops with a None default into a name its loop over _pending typed)
        self._early: dict[int, Any] = {}
        self.final = True  # the micro-batch being added is the step's last
        # on_final(u, parts): takes unit u's reductions, [(later, work)] in order,
        # instead of finish() (an overlapped offload; see [Note: overlapped offload])
        self.on_final: Callable[[int, list[tuple[Array | None, Pending]]], None] | None = None
        self._handed: set[int] = set()

    def add(self, u: int, grads: Sequence[Grad | None]) -> None:
        """Add unit ``u``'s full leaf gradients (in the unit's leaf order): arrays of
        the state's device, or torch tensors and jax arrays on it (viewed through
        DLPack, no copy); None is a zero gradient. A leaf the layout gives no
        rows (a frozen one in the gradients' layout) takes nothing."""
        with timed("library"):
            self._add(u, grads)

    # grads: Any: each a Grad or None, until replaced by its device array (Array | None)
    def _add(self, u: int, grads: Sequence[Any]) -> None:
        unit, w = self.layout.units[u], self.layout.world_size
        shard = self.shards[u]
        replicated = shard[unit.sharded_size:]
        if self._full is not None:  # stages 0-1: accumulate the full gradient
            self._accumulate(u, grads)
            if self.final and unit.sharded_size:  # complete: reduce it while others compute
                if self.on_final is not None and self.stage >= 1 and not unit.replicated_size:
                    self._handed.add(u)
                    self.on_final(u, [(None, _DONE if self.solo else self._reduce_scatter(
                        shard[:unit.sharded_size], self._full[u]))])
                    return
                if self.solo:
                    return
                self._early[u] = (
                    self.comm.all_reduce_async(self._full[u], "sum") if self.stage == 0 else
                    self._reduce_scatter(shard[:unit.sharded_size], self._full[u]))
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
            work = self._reduce_scatter(out, packed)
            if self.final and self.on_final is not None and not unit.replicated_size:
                self._handed.add(u)
                parts = [(o, wk) for v, o, wk in self._pending if v == u]
                self._pending = [p for p in self._pending if p[0] != u]
                self.on_final(u, [*parts, (None if first else out, work)])
            else:
                self._pending.append((u, None if first else out, work))

    def _accumulate(self, u: int, grads: Sequence[Any]) -> None:  # grads: as _add's
        """Add unit ``u``'s gradients to its full sum (stages 0-1): the sharded
        leaves' in the (W, S) reduce layout, the replicated ones' in the shard."""
        unit, full = self.layout.units[u], cast(list, self._full)[u]
        replicated = self.shards[u][unit.sharded_size:]
        first = u not in self._written  # zeros so far: a copy is the sum
        self._written.add(u)
        if not (first and not unit.replicated_size and self._pack(u, grads, full)):
            grads = [None if g is None else self._on_device(i, g)
                     for i, g in zip(unit.leaves, grads, strict=True)]
            for i, g in zip(unit.leaves, grads, strict=True):
                self.layout.pack_grad(self.layout.leaves[i], g, full, replicated, add=True)

    def _own_sumsq(self, scale: float) -> Array:
        """The sum of squares of this rank's own gradient (stages 0-1: its sums,
        times ``scale``), on the device (float64, one element)."""
        parts = [x for u, unit in enumerate(self.layout.units) for x in (
            cast(list, self._full)[u], self.shards[u][unit.sharded_size:]) if x.size]
        return sum_of_squares(parts) * (scale * scale) if parts else self.device.xp.zeros(1)

    def _clip_coef(self, sumsq: Array, max_norm: float | None) -> Array | None:
        """The 1-bit family's compressed phases clip each rank's own gradient,
        as DeepSpeed's engine does there, by ``min(1, max_norm / (norm +
        1e-6))`` as ``clip_grad_norm_``: that factor on the device (float32,
        one element), or None (no clip)."""
        if max_norm is None:
            return None
        xp = self.device.xp
        return xp.minimum(max_norm / (xp.sqrt(sumsq) + 1e-6), 1.0).astype(np.float32)

    def _reduce_scatter(self, out: Array, x: Array) -> Pending:
        """The sum over the ranks of ``x``'s sections, this rank's into ``out``,
        started (a handle)."""
        if self.quantized:
            return reduce_scatter_quantized(self.comm, out, x, hierarchy=self.hierarchy,
                                            bits=self.quantized)
        return self.comm.reduce_scatter_async(out, x, op="sum")

    def _pack(self, u: int, grads: Sequence[Grad | None], packed: Array) -> bool:
        """Copy unit ``u``'s sharded leaves' gradients into ``packed`` (its (W, S)
        reduce layout, padding rows zero) in one launch, reading each gradient
        where it lies; False (nothing done) unless every one can be read so,
        with one dtype the kernel takes."""
        unit = self.layout.units[u]
        addresses = np.zeros(len(unit.leaves), np.int64)
        dtype = None
        for j, (i, g) in enumerate(zip(unit.leaves, grads, strict=True)):
            leaf = self.layout.leaves[i]
            if g is None or not leaf.sharded or not leaf.local_size:
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

    def bucket(self, u: int) -> Array | None:
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

    def _on_device(self, i: int, g: Grad) -> Array | None:
        leaf = self.layout.leaves[i]
        if not leaf.local_size:  # no rows here: a frozen leaf's gradient is dropped
            return None
        g = self.device.asarray(g, what=f"the gradient of {leaf.path}")
        if tuple(g.shape) != leaf.shape and g.size != leaf.size:
            raise ValueError(f"the gradient of {leaf.path} has shape {tuple(g.shape)}; the "
                             f"param has {leaf.shape}")
        return g

    def drain(self) -> None:
        """Wait for every reduction still in flight and drop it (a failed step: see
        [Note: failed steps]), so none writes into the buffers the next step uses."""
        pending, early = self._pending, self._early
        self._pending, self._early = [], {}
        wait_quietly([w for _, _, w in pending] + list(early.values()))

    def finish(self) -> list[Array]:
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
                        self._reduce_scatter(shard[:unit.sharded_size], self._full[u]).wait()
            if unit.replicated_size and not self.solo:
                with timed("reduce_wait"):
                    self.comm.all_reduce_(shard[unit.sharded_size:], "sum")
        return self.shards


class CopyPlans:
    """The run tables of a layout's unit copies (see ``ops/device/_runs.py``), each made
    once and kept by the step with its device tables."""

    def __init__(self, layout: Layout, full_layout: Layout) -> None:
        self.layout, self.full_layout = layout, full_layout
        self._plans: dict[tuple, Any] = {}  # Any: (Runs, Runs) for a gather, Runs for grads

    def gather(self, u: int, order: tuple[int, ...] | None = None) -> tuple[Runs, Runs]:
        """Unit ``u``'s copy-out (see :meth:`Layout.gather_runs`): one launch for its
        sharded leaves, one for its replicated ones; ``order[w]``: where rank
        ``w``'s section lies in the gathered buffer (default: at ``w``)."""
        key = ("gather", u, order)
        if key not in self._plans:
            self._plans[key] = self.layout.gather_runs(u, self.full_layout, order=order)
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

    def __init__(self, layout: Layout, dtype: DTypeLike, device: Device) -> None:
        self.layout, self.dtype, self.device = layout, np.dtype(dtype), device
        self.flat = device.empty(layout.local_size(), dtype)
        bounds = np.cumsum([0, *(u.local_size for u in layout.units)]).tolist()
        self.units = [self.flat[a:b] for a, b in itertools.pairwise(bounds)]
        # scratch buffers by size, kept for the next step: the ordered reduction's
        # partial sums (see [Note: the same bits at any world size])
        self.spare: dict[int, list[Array]] = {}

    def serves(self, layout: Layout, dtype: DTypeLike, device: Device) -> bool:
        return layout is self.layout and dtype == self.dtype and device is self.device

    def zeroed(self) -> list[Array]:
        self.flat[...] = 0
        return self.units


class _Done:
    """A reduction with nothing to wait for (one rank)."""

    @staticmethod
    def wait() -> None:
        return None


_DONE = _Done()


def wait_quietly(works: Iterable[Pending | None]) -> None:
    """Wait for each collective (None: nothing in flight), ignoring its errors:
    a failed step's, which the caller raises."""
    for work in works:
        if work is not None:
            with contextlib.suppress(Exception):
                work.wait()
