"""Per-step machinery: getting units' full params, and reducing their gradients.

[Note: ZeRO-3 schedule]
At stage 3 a unit's full parameters exist only while that unit computes:
:meth:`Units.flat` all-gathers the unit's compute-dtype shards (the next
unit's all-gather is already in flight: ``prefetch`` units ahead, and more
while they fit in the memory bound below, so a small unit such as a norm
does not leave the next large one's gather exposed), copies them out into
one flat buffer, each leaf whole at its place in the one-rank layout, in
one launch over the unit's runs (``ops/device/_runs.py``), and the caller drops it
after use. A torch module keeps each unit's activations and saves its params
by reference (see [Note: torch ZeRO-3] in ``interop/torch/_adapter.py``). For a
:class:`Layered` loss each layer takes its unit's flat buffer (one DLPack
exchange, sliced into leaves inside the compiled layer) and the forward pass keeps the VJP
residuals that [Note: what a forward keeps] in ``shard/core/losses/_layered.py`` names,
except those that are its own inputs; the backward pass re-gathers
each unit in reverse order (the last unit stays gathered from its forward,
as FSDP2's root does), hands the layer's VJP its params again (so no residual
pins a unit's params; with ``activation_checkpointing=True`` it recomputes
the layer's forward from its input instead), and hands the unit's gradient
(one flat buffer) to :class:`~shard.step.reduction._reduce.GradReducer`, whose
reduce-scatter runs asynchronously while the next unit computes. A JAX loss
function runs the same way, its traced program cut into one segment per
unit (see [Note: traced units] in ``shard/step/_traced.py``); a loss object
without the unit-by-unit protocol gathers every unit first.
At stages 0-2 the whole compute params are the state's, and at stage 3 on
one rank the shards are the whole params: :meth:`Units.flat` returns those
buffers themselves, the same every step, and nothing is gathered, copied or
sent. Gradients enter a unit's reduce layout the same way, in one launch
over runs that read each gradient where it lies; where the gradient buffers
have the whole params' layout (one rank, or stage 0), a torch module's
autograd sums into them directly (``GradReducer.bucket`` in
``shard/step/reduction/_reduce.py``).
Every buffer here is allocated on the state's device (see [Note: devices]).

[Note: secondary shards]
With ``zero3(..., reshard_after_forward=L)`` (FSDP2's argument; ZeRO++'s hpZ)
the W ranks are ``W / L`` nodes of ``L`` consecutive ranks, rank ``n * L + l``
being place ``l`` of node ``n``. A unit's first gather in a step runs in two
hops: over ``node`` (the ranks at place ``l`` of every node, one per node) into
the unit's secondary shard, the sections of those ranks, ``W / L`` of them,
and then over ``local`` (this node's ranks), which gathers the node's
secondary shards into the whole unit. The secondary shard is kept until the
step ends, so every later gather of the unit (the backward's, the next
micro-batch's) is the second hop alone and stays inside the node. A
prefetch starts the first hop, the slow one; the second starts when the unit
is needed, after the first is done (on NCCL the two are ordered on the
communicator's stream as well). Across
nodes, a node then receives each unit's other sections once a step, where a
flat gather sends every rank all of them at every gather: ``1 / L`` of that
for one gather, and nothing for the rest. The cost is the secondary shards,
``1 / L`` of the unit's compute params per rank, counted as pinned in the
bound below. The second hop leaves rank ``n * L + l``'s section at position
``l * (W / L) + n``: the unit's copy-out reads each from there
(:meth:`~shard.core._layout.Layout.gather_runs`'s ``order``), so the
result is the flat gather's, bit for bit. The optimizer state, the
reduce-scatter and checkpoints are flat ZeRO-3's: the secondary shards live
only within a step.

Dropping a unit's arrays does not free them at once: JAX releases an input
buffer a moment after the computation that read it has finished. So, like
FSDP's all-gather rate limiter, a new gather or copy-out waits (briefly, and
at most ``RELEASE_WAIT`` seconds) until the full params still alive leave room
for it within ``1 + prefetch`` units beyond the pinned ones (a unit gathered
with ``pinned=True`` stays for the whole step, as a torch module's root unit
does); the bound is then a measured fact.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from ops import Communicator, Device
from ops._quant import dequantize_blocks, quantize_blocks
from ops.device._runs import copy_runs, dequantize_runs
from shard.core._layout import Layout
from shard.monitor._profile import timed
from shard.step.reduction._reduce import CopyPlans, wait_quietly

if TYPE_CHECKING:
    from ops._types import Array
    from ops.comm._base import Pending

_A = TypeVar("_A", bound="Array")

__all__ = ["LiveBytes", "Units"]

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

    def track(self, a: _A, device: Device) -> _A:
        self.live += a.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(device.memory_owner(a), self._release, a.nbytes)
        return a

    def _release(self, n: int) -> None:
        self.live -= n


class Units:
    """Full parameters of one unit at a time (see [Note: ZeRO-3 schedule])."""

    def __init__(self, layout: Layout, comm: Communicator, *, stage: int, device: Device,
                 local: Sequence[Array], full: Sequence[Array] | None,
                 full_layout: Layout, prefetch: int = 1,
                 tracker: LiveBytes | None = None, plans: CopyPlans | None = None,
                 secondary: tuple[Communicator, Communicator] | None = None,
                 quantized: bool = False) -> None:
        self.layout, self.comm, self.stage, self.device = layout, comm, stage, device
        self.quantized = quantized  # see [Note: quantized gathers]
        self.secondary = secondary  # (local, node): see [Note: secondary shards]
        self._secondaries: dict[int, Array] = {}  # u: its secondary shard, kept for the step
        self._order: tuple[int, ...] | None = None
        if secondary is not None:
            per_node, nodes = secondary[0].world_size, secondary[1].world_size
            self._order = tuple(w % per_node * nodes + w // per_node
                                for w in range(comm.world_size))
        self.plans = plans or CopyPlans(layout, full_layout)
        self.local, self.full, self.full_layout = local, full, full_layout
        self.prefetch = prefetch
        self.tracker = tracker if tracker is not None else LiveBytes()
        self.bounded = True  # False: gather everything (a monolithic loss)
        self.pinned_bytes = 0
        self._in_use = 0  # bytes of the unit in use, as the schedule counts them
        self._warned = False
        # u: (gathered, work, shard)
        self._inflight: dict[int, tuple[Array, Pending | None, Array]] = {}
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
        """Whether ``nbytes`` more fit in ``1 + prefetch`` units beyond the pinned
        ones, counting what is alive now (for waiting only: see :meth:`_planned`)."""
        limit = self.pinned_bytes + self._unit_bytes * (1 + self.prefetch)
        return not self.bounded or self.tracker.live + nbytes <= limit

    def _planned(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit in the same bound, counting what the
        schedule holds beyond the pinned units: the unit in use and the gathers
        in flight. Which units
        are prefetched or dropped starts or skips collectives, so it is decided
        from this count, the same on every rank, never from the bytes alive
        (those depend on when each rank's arrays are freed)."""
        inflight = sum(out.nbytes for out, _, _ in self._inflight.values())
        return not self.bounded or (self._in_use + inflight + nbytes
                                    <= self._unit_bytes * (1 + self.prefetch))

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
        if not wait and not self._planned(self._gather_bytes(u) + copies):
            return False
        self._wait_for_room(self._gather_bytes(u))
        if not self.device.host and isinstance(shard, np.ndarray):  # compute params on the
            shard = self.device.asarray(shard)  # host (Offload(params="host")): a copy over
        if self.quantized and self.secondary is None and unit.sharded_size:
            # the int8 values in flight, dequantized by the copy-out (see the Note)
            fused = self._quantized(self.comm, None, shard[:unit.sharded_size])
            self._inflight[u] = (self.tracker.track(fused.q, self.device), fused, shard)
            return True
        out = self.tracker.track(self.device.empty(unit.sharded_size * self.comm.world_size,
                                                   shard.dtype), self.device)
        work: Pending | None
        if not unit.sharded_size:
            work = None
        elif self.secondary is None:
            work = self.comm.all_gather_async(out, shard[:unit.sharded_size])
        else:
            work = self._two_hops(u, out, shard[:unit.sharded_size])
        self._inflight[u] = (out, work, shard)
        return True

    # out: Any: an Array or None, read by the closure made only where it is an array
    def _quantized(self, comm: Communicator, out: Any, shard: Array) -> _Dequantized:
        """[Note: quantized gathers]
        With ``quantized_weights=`` (ZeRO++'s qwZ) each rank block-quantizes
        its section of the unit (:func:`ops.quantize_blocks`: int8 values, a
        float32 scale per 256 of them, its blocks starting at the section's
        start) and the ranks all-gather the values and the scales. The unit's
        copy-out dequantizes them as it copies (``ops/device/_runs.py``'s
        ``dequantize_runs``: one launch, the same bits as dequantizing each
        section then copying), so no float buffer of the gathered sections is
        made; the bytes in flight are the int8 values and the scales, a
        quarter of float32's. A section's bytes on the wire are ``n + 4 *
        ceil(n / 256)`` for ``n`` elements, against ``4 n`` (float32) or
        ``2 n`` (bfloat16); the values the loss sees are each within half its
        block's scale (``amax / 127``) of the master's. With secondary shards
        (hpZ) the first hop, across nodes, is the quantized one: each node's
        secondary shard is dequantized once a step (into ``out``, section by
        section) and the gathers inside the node move it exactly, so the values
        are those of the flat quantized gather (ZeRO++ composes qwZ and hpZ
        so)."""
        if np.dtype(shard.dtype).name not in ("float32", "bfloat16", "float16"):
            raise TypeError(f"quantized_weights=: the compute params are {shard.dtype}; "
                            "block quantization takes float32, bfloat16 or float16")
        q, scales = quantize_blocks(shard)
        w, n, k = comm.world_size, shard.size, scales.size
        q_all = self.device.empty(n * w, np.int8)
        s_all = self.device.empty(k * w, np.float32)
        works = [comm.all_gather_async(q_all, q), comm.all_gather_async(s_all, scales)]

        def dequantized() -> Array:
            for r in range(w):
                dequantize_blocks(q_all[r * n:(r + 1) * n], s_all[r * k:(r + 1) * k],
                                  out.dtype, out=out[r * n:(r + 1) * n])
            return out
        return _Dequantized(works, dequantized if out is not None else None, q_all, s_all, n)

    def _two_hops(self, u: int, out: Array, shard: Array) -> Pending:
        """Unit ``u``'s gather into ``out`` from its secondary shard, gathering
        that first if this step has not (see [Note: secondary shards])."""
        local, node = cast(tuple, self.secondary)  # only a step with secondary shards
        kept = self._secondaries.get(u)
        if kept is not None:
            return local.all_gather_async(out, kept)
        kept = self.tracker.track(self.device.empty(shard.size * node.world_size, shard.dtype),
                                  self.device)
        self._secondaries[u] = kept
        self.pinned_bytes += kept.nbytes
        first = (self._quantized(node, kept, shard) if self.quantized else
                 node.all_gather_async(kept, shard))
        return _Then(first, lambda: local.all_gather_async(out, kept))

    def get(self, u: int, upcoming: Sequence[int] = (), *,
            pinned: bool = False) -> list[Array]:
        """Unit ``u``'s full leaves (views of :meth:`flat`), then start the gathers
        of ``upcoming`` units.

        The next gathers start only once this unit is copied out and its gather
        buffer freed, so at most this unit and ``prefetch`` more are alive.
        ``pinned`` units are kept for the step and counted outside that bound.
        More units may be prefetched while they fit (:meth:`prefetch_after`).
        """
        return self.leaf_views(u, self.flat(u, upcoming, pinned=pinned))

    def flat(self, u: int, upcoming: Sequence[int] = (), *, pinned: bool = False) -> Array:
        """Unit ``u``'s whole params as one flat buffer, laid out as the full
        layout's unit (each leaf whole and contiguous at its offset there; see
        :meth:`leaf_views`). Where :attr:`persistent`, it is the state's own
        buffer, the same object every step; otherwise freshly gathered (stage 3)."""
        if self.stage < 3:
            return cast(list, self.full)[u]  # stages 0-2 keep whole params
        if self.solo:
            return self.local[u]
        with timed("library"):
            return self._gather(u, upcoming, pinned)

    def leaf_views(self, u: int, flat: Array) -> list[Array]:
        """The leaves of unit ``u`` (in its leaf order) as views of its flat buffer."""
        leaves = self.full_layout.leaves
        return [flat[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape)
                for leaf in (leaves[i] for i in self.full_layout.units[u].leaves)]

    def _gather(self, u: int, upcoming: Sequence[int], pinned: bool) -> Array:
        if pinned:
            self.pinned_bytes += self._gather_bytes(u)
        self._in_use = 0  # the caller is done with the unit before (pinned ones aside)
        if u not in self._inflight and not self._planned(self._gather_bytes(u)):
            self._drop_prefetches({u, *list(upcoming)[:self.prefetch]})
        self.start(u)
        gathered, work, shard = self._inflight.pop(u)
        if work is not None:
            with timed("all_gather_wait"):
                work.wait()
        # qwZ's int8 sections, dequantized by the copy-out (see [Note: quantized gathers])
        quantized = work if isinstance(work, _Dequantized) and work.then is None else None
        del work  # the handle references the buffer; the copy-out below is its last use
        nbytes = gathered.nbytes if quantized is None else self._gather_bytes(u)
        self._in_use = nbytes  # and its copy-out, next
        if not self._planned(nbytes):
            self._drop_prefetches(set(list(upcoming)[:self.prefetch]))
        self._wait_for_room(nbytes)
        # one buffer for the unit, tracked once: its views keep it alive
        flat = self.tracker.track(
            self.device.empty(self.full_layout.units[u].local_size, shard.dtype), self.device)
        sharded, replicated = self.plans.gather(u, self._order)
        if quantized is not None:
            dequantize_runs(flat, sharded, sharded.table(self.device), q=quantized.q,
                            scales=quantized.scales, section=quantized.section,
                            device=self.device)
        else:
            copy_runs(flat, sharded, sharded.table(self.device), device=self.device,
                      src=gathered)
        copy_runs(flat, replicated, replicated.table(self.device), device=self.device, src=shard)
        del gathered, shard, quantized
        self.prefetch_after(upcoming)
        return flat

    def prefetch_after(self, upcoming: Sequence[int]) -> None:
        """Start the gathers of the next ``prefetch`` units of ``upcoming``, then of
        more while they fit in the memory bound (small units, such as norms,
        would otherwise leave the next large unit's gather with nothing to hide
        behind)."""
        upcoming = list(upcoming)
        if upcoming and upcoming[0] not in self._inflight and not self.persistent and \
                not self._planned(self._gather_bytes(upcoming[0])):
            self._drop_prefetches(set(upcoming[:self.prefetch]))
        for i, v in enumerate(upcoming):
            if not self.start(v, wait=i < self.prefetch):
                return

    def _drop_prefetches(self, keep: set[int]) -> None:
        """Free the prefetched units not in ``keep`` once their gathers are done:
        a unit is needed now, or next, and there is no room for it, so those
        prefetches guessed wrong (a unit the forward passed over, such as a
        branch not taken, or one that runs in another order than the units').
        Each is gathered again if it is needed after all. Only the first hop of
        a two-hop gather is waited for: the second would start a collective."""
        stale = [v for v in self._inflight if v not in keep]
        works = [self._inflight.pop(v)[1] for v in stale]
        wait_quietly(getattr(work, "first", work) for work in works if work is not None)

    def drain(self) -> None:
        """Wait for every gather still in flight and drop it (a failed step: see
        [Note: failed steps]); errors of those gathers are the failure's."""
        inflight, self._inflight = self._inflight, {}
        # a two-hop gather's first hop only: the second would start a collective
        wait_quietly(getattr(work, "first", work) for _, work, _ in inflight.values())


class _Dequantized:
    """The gathers of a unit's int8 values ``q`` and ``scales`` (``section``
    elements a rank), then ``then()`` where it is given: the sections
    dequantized (see [Note: quantized gathers])."""

    def __init__(self, works: Sequence[Pending], then: Callable[[], Array] | None, q: Array,
                 scales: Array, section: int) -> None:
        self.works, self.then = works, then
        self.q, self.scales, self.section = q, scales, section

    def wait(self) -> Array | None:
        for work in self.works:
            work.wait()
        return self.then() if self.then is not None else None


class _Then:
    """A collective, then another started once it is done (the second hop of
    a unit's gather; see [Note: secondary shards])."""

    def __init__(self, first: Pending, then: Callable[[], Pending]) -> None:
        self.first, self.then = first, then

    def wait(self) -> Array | None:
        self.first.wait()
        return self.then().wait()
