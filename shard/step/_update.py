"""A step's update phase: the gradients' norm, the fused optimizer, and stages
1-2's all-gather of the new compute params (steps 2, 4 and 5 of the step in
``shard/step/_step.py``).

[Note: rows across ranks]
Micro-batches of unequal rows always weigh by their rows (``_checks.weights``).
Ranks do by default not: each rank's mean loss counts the same, as in DDP
and DeepSpeed, since only the ranks together know their rows. The step's one
all-reduce carries each rank's rows, their square and a 1 (the rank could
count them) beside the sum of squares and the loss, so whenever its numbers
are read the step can tell that rows differed (W * sum(r^2) != sum(r)^2)
and warns once (not for a pipeline, whose all-reduce spans its stages). With
``weight_by_rows=True`` each micro-batch's loss is scaled by its rows
instead, and after the all-reduce the gradient shards, the sum of squares
and the loss sum are multiplied on the device by ``W * k / rows`` (k
micro-batches, ``rows`` over every rank), so that the usual ``1 / (W * k)``
scale of the update gives the mean over every row: the update and the loss of
the ranks' batches concatenated (:func:`weigh_by_rows`; one pass over the
gradient shards, no host read). The batch's rows are the leading dimension
its array leaves share.

[Note: replicas]
With a mesh of ``replicate`` x ``shard`` axes (hierarchical ZeRO, FSDP2's
HSDP) the ``shard`` axis shards the state among the ranks of a node and
``replicate`` joins the ranks of other nodes that hold the same shards.
Everything that gathers or reduce-scatters stays inside ``shard``. After the
reduce-scatter, each rank's gradient shards are summed over the replicas (one
all-reduce per unit, the only traffic between nodes), so every replica holds
the sum over all R x S ranks and the update is flat ZeRO's over R x S ranks;
the losses and rows of the step's one all-reduce are summed over the replicas
too, the norm (the same on every replica) not. ``init`` checks that the
replicas hold the same params and layout; replica 0 alone writes checkpoints.

[Note: missing gradients]
A torch parameter whose ``.grad`` stays None in a step (a branch the forward
did not take, a head used every other step) is left out of that step by
torch's optimizers: its value, its moments and its own step count stay as
they were. The step does the same. Each micro-batch the torch loss reports
the trainable leaves it gave no gradient (``missing``); those missing from
every micro-batch are counted into the step's one all-reduce, after the five
totals (a rank with nothing missing adds zeros and writes nothing), so that
a leaf is left out only where no rank had a gradient for it. A leaf some
ranks used is reduced as usual, the others' part being zero, as DDP's
``find_unused_parameters`` and FSDP2 do, and every rank issues the same
collectives in the same order whatever its forward touched. Only a rank that
missed something reads the counts back. ``state.skips`` counts each leaf's
skipped steps: the optimizer runs on the trainable runs of each group of
leaves that share an update count (``step - skips``), so Adam's bias
correction is the leaf's own, as torch's per-parameter ``state["step"]``.
A JAX loss's gradient is always defined (zero where a leaf is unused), as
``jax.grad``'s, so JAX leaves are never skipped; freeze them with
``trainable=`` instead.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import numpy as np

import ops
from ops.device._runs import copy_runs
from shard.core._state import TrainState
from shard.monitor._profile import timed
from shard.step._frozen import (
    copies_packing,
    copy_left,
    copy_views,
    full_grads,
    grad_views,
    hold_frozen,
    master_views,
    outside,
    trainable_runs,
)
from shard.step._ordered import exact_norm_and_loss
from shard.step.reduction._compressed import OneBitMomentum, write_sections

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ops import Device
    from ops._types import Array
    from shard.core._state import Packing
    from shard.step._config import StepConfig
    from shard.step._plan import Plan

__all__ = ["add_skips", "apply", "copy_out", "count_missing", "fresh_totals",
           "local_norm_and_loss", "norm_and_loss", "onebit_update", "refresh", "skipped_leaves",
           "tracks_missing", "warn_if_rows_differ", "weigh_by_rows"]

log = logging.getLogger("shard.step")


def norm_and_loss(plan: Plan, shards: list[Array], totals: Array, losses: list[Array]) -> None:
    """``totals`` (on the device) becomes [global sum of squares of the summed
    gradients, sum of the losses (``losses``, each call's) over ranks]."""
    c, layout = plan.config, plan.grad_layout  # frozen leaves hold nothing there
    if plan.replica is not None and not c.invariant_shards:  # see [Note: replicas]
        with timed("reduce_wait"):  # (ordered ones sum the replicas per micro-batch)
            for g in shards:
                plan.replica.all_reduce_(g, "sum")
    sharded: list[Array] = []
    replicated: list[Array] = []
    skip = set(c.loss_fn.norm_skip)  # copies of a tied weight
    tp = c.tensor_parallel  # see [Note: tensor parallelism with ZeRO]
    if tp is not None and tp.rank > 0:
        skip |= plan.model_whole  # counted at model rank 0
    for unit, g in zip(layout.units, shards, strict=True):
        cuts = sorted((leaf.offset, leaf.offset + leaf.local_size) for leaf in
                      (layout.leaves[i] for i in unit.leaves if i in skip))
        for a, b in outside([(0, unit.sharded_size), (unit.sharded_size, unit.local_size)], cuts):
            (sharded if b <= unit.sharded_size else replicated).append(g[a:b])
    if c.stage == 0:  # everything is whole (and the same) on every rank
        replicated, sharded = sharded + replicated, []
    if sharded and not c.invariant_shards:
        ops.sum_of_squares(sharded, out=totals[SUMSQ])
    mesh = c.topology.whole
    if mesh is not None:  # a pipeline stage: over the whole mesh (see [Note: pipeline])
        if replicated and c.comm.rank == 0:  # once per stage
            totals[SUMSQ] += ops.sum_of_squares(replicated)
        if tp is not None and tp.rank > 0:  # the same loss on every model rank: count one
            totals[LOSS] *= 0
        mesh.all_reduce_(totals, "sum")
        return
    plan.fast.all_reduce_(totals, "sum")
    if plan.replica is not None:  # the losses and rows of every replica; the norm is theirs
        plan.replica.all_reduce_(totals[LOSS.start:], "sum")
    if c.invariant_shards:  # exact sums (see [Note: the same bits at any world size])
        totals[SUMSQ], totals[LOSS] = exact_norm_and_loss(plan, sharded, replicated, losses)
        return
    if replicated:
        totals[SUMSQ] += ops.sum_of_squares(replicated)
    if tp is not None and tp.size > 1:  # the model ranks' slices; the loss is theirs already
        tp.comm.all_reduce_(totals[SUMSQ], "sum")


# sumsq: Any: a device array (LocalReducer's), multiplied here
def local_norm_and_loss(plan: Plan, sumsq: Any, totals: Array) -> None:
    """0/1 Adam's local steps (see [Note: 0/1 Adam] in ``ops/_zeroone.py``):
    ``totals`` becomes [the mean over the ranks of each one's squared gradient
    norm (``sumsq``: its own), the losses summed over the ranks]."""
    totals[SUMSQ] = sumsq * (1.0 / plan.fast.world_size)
    plan.fast.all_reduce_(totals, "sum")


def onebit_update(plan: Plan, state: TrainState, held: OneBitMomentum) -> None:
    """1-bit Adam after ``freeze_step`` (see [Note: 1-bit Adam] in
    ``ops/_onebit.py``): every rank updates its whole params from the momentum
    the ranks agreed on, alike, so no params are gathered; the state's masters
    and ``exp_avg`` take this rank's sections, the compute params the whole."""
    fused = cast(ops.FusedOptimizer, plan.optimizer.fused)
    plan.config.optimizer.apply(
        tuple(held.momentum), fused.state(state.step, tuple(held.scratch),
                                          tuple(held.variance)),
        tuple(held.params), finite=True, momentum=True)
    write_sections(plan.layout, plan.fast.rank, held.params, state.master)
    write_sections(plan.layout, plan.fast.rank, held.momentum, state.moments[0])
    with timed("library"):
        copy_out(plan, state, held.params)


def copy_out(plan: Plan, state: TrainState, wholes: Sequence[Array]) -> None:
    """Stages 1-2: each unit's whole params on this rank (float32, the (W, S)
    reduce layout, then the replicated leaves) into its compute params, with
    no collective (0/1 Adam's local steps)."""
    device, w = plan.device, plan.fast.world_size
    for u, (unit, x) in enumerate(zip(plan.layout.units, wholes, strict=True)):
        dst = state.compute[u]
        x = x if x.dtype == dst.dtype else ops.cast(x, dst.dtype)
        k = unit.sharded_size * w  # the replicated runs read a shard's layout: from k - S
        for runs, source in zip(plan.refresh_plans.gather(u), (x[:k], x[k - unit.sharded_size:]),
                                strict=True):
            copy_runs(dst, runs, runs.table(device), device=device, src=source)


# The slots of a step's one all-reduce (``fresh_totals``), as slices of it;
# ``value(host, SLOT)`` reads one back.
SUMSQ = slice(0, 1)  # the sum of squares of the summed gradients
LOSS = slice(1, 2)  # the micro-batches' losses, summed over the ranks
ROWS = slice(2, 3)  # the batch's rows, summed over the ranks (0: not counted)
ROWS_SQ = slice(3, 4)  # each rank's rows squared, summed
COUNTED = slice(4, 5)  # the ranks that counted their rows
MISSING = slice(5, None)  # per leaf: the ranks that gave it no gradient


def value(host: np.ndarray, s: slice) -> float:
    """A one-element slot of the totals read back to the host."""
    return float(host[s.start])


def fresh_totals(kept: dict[tuple[str, int, int], Array], device: Device, rows: int,
                 leaves: int = 0) -> Array:
    """A step's ``[sum of squares, sum of losses, rows, rows squared, ranks that
    counted rows]`` for ``rows`` rows (0: not counted), then with ``leaves``
    the ranks that had no gradient for each leaf (0 here; see [Note: missing
    gradients]), summed over the ranks by its all-reduce: a copy of a device
    array kept in ``kept`` (one device operation, no host copy)."""
    base = kept.get((device.name, rows, leaves))
    if base is None:
        if len(kept) >= 64:  # rows that change every step: keep the latest few
            kept.clear()
        base = kept[device.name, rows, leaves] = device.asarray(
            np.concatenate([[0.0, 0.0, rows, rows * rows, 1.0 if rows else 0.0],
                            np.zeros(leaves)]))
    return base.copy()


def warn_if_rows_differ(c: StepConfig, host: np.ndarray) -> bool:
    """Warn that the ranks' rows differed in a step that weighs each rank's mean
    the same (see [Note: rows across ranks]); whether it did."""
    n, total = c.ranks, value(host, ROWS)
    if (value(host, COUNTED) != n or n * value(host, ROWS_SQ) == total * total
            or c.topology.whole is not None):
        return False  # some rank could not count, rows agreed, or a pipeline
    if c.comm.rank == 0:
        log.warning("%s: the ranks' batches hold different numbers of rows (%d rows over %d "
                    "ranks, not %d equal parts): each rank's mean loss weighs the same, so "
                    "the update is not the mean over all %d rows; pass "
                    "options=shard.ZeroOptions(weight_by_rows=True) for that, or give every "
                    "rank the same rows", c.name, total, n, n, total)
    return True


def tracks_missing(c: StepConfig) -> bool:
    """Whether the step asks its loss which leaves got no gradient: a torch
    module's (a JAX gradient is always defined), outside a pipeline, whose
    stages' all-reduce spans other layouts (see [Note: missing gradients])."""
    return c.kind == "provider" and c.loss_fn.reports_missing and c.topology.whole is None


def count_missing(totals: Array, missing: frozenset[int], device: Device) -> None:
    """Count this rank's missing leaves into ``totals`` before its all-reduce."""
    flags = np.zeros(totals.shape[0] - MISSING.start)
    flags[sorted(missing)] = 1.0
    totals[MISSING] = device.asarray(flags)


def skipped_leaves(totals: Array, missing: frozenset[int], ranks: int,
                   device: Device) -> frozenset[int]:
    """The leaves no rank had a gradient for (after the all-reduce): a host read,
    on the ranks that missed any."""
    counts = device.to_host(totals)[MISSING]
    return frozenset(i for i in missing if counts[i] >= ranks)


def add_skips(skips: np.ndarray, skip: frozenset[int]) -> np.ndarray:
    """``state.skips`` after a step that left out the leaves ``skip``."""
    if not skip:
        return skips
    out = skips.copy()
    out[sorted(skip)] += 1
    return out


def warn_unskipped(plan: Plan, skip: frozenset[int], where: str) -> None:
    """An optimizer path that updates every leaf: say so, once per step object."""
    if getattr(plan, "_warned_skip", False):
        return
    object.__setattr__(plan, "_warned_skip", True)
    names = [plan.layout.leaves[i].path for i in sorted(skip)][:5]
    log.warning("%s: params %s had no gradient on any rank, and the %s updates them as with a "
                "zero gradient (weight decay, moments); the fused optimizers on device or host "
                "state leave them as torch's optimizers do", plan.config.name, names, where)


def _count_groups(plan: Plan, state: TrainState, skip: frozenset[int]) -> list | None:
    """The trainable runs of each group of leaves sharing an update count, with
    that count; None where every leaf has the step's (see [Note: missing
    gradients])."""
    if not skip and not state.skips.any():
        return None
    counts = int(state.step) - state.skips
    groups: dict[int, set[int]] = {}
    for i in range(len(plan.layout.leaves)):
        if i not in plan.frozen and i not in skip:
            groups.setdefault(int(counts[i]), set()).add(i)
    everything = frozenset(range(len(plan.layout.leaves)))
    return [(np.asarray(t, np.int64), trainable_runs(plan.layout, everything - members))
            for t, members in sorted(groups.items())]


def weigh_by_rows(shards: list[Array], totals: Array, parts: int) -> None:
    """``weight_by_rows``'s correction (see [Note: rows across ranks]): each
    micro-batch's loss was scaled by its rows, so the summed gradients become
    the mean over all rows under the step's usual ``1 / parts`` scale once
    multiplied by ``parts / rows`` (slot ``ROWS``, summed over the ranks), and
    so do the sum of squares and the losses. On the device: no host read."""
    f = parts / totals[ROWS]
    for g in shards:
        if g.dtype.itemsize >= 4:
            g *= f
        else:  # 16-bit gradients: the product in float32, rounded once
            wide = ops.cast(g, np.float32)
            wide *= f
            ops.cast(wide, g.dtype, out=g)
    totals[SUMSQ] *= f * f
    totals[LOSS] *= f


# shards: Any: device arrays (numpy ones for an optax transformation, on the host);
# grad_sumsq: Any: a device array or None, an array wherever the optimizer is optax's
def apply(plan: Plan, state: TrainState, shards: list[Any], grad_scale: float,
          grad_sumsq: Any, skip: frozenset[int] = frozenset(),
          compressed: str | None = None) -> TrainState:
    """The optimizer on every unit's shard of a device-resident state, then stages
    1-2's all-gather of the new compute params. With ``grad_sumsq`` (a device
    array) the kernel clips by it and skips the update where it is not finite,
    reading it on the device (see [Note: non-finite gradients]). ``compressed``:
    the shards are 0/1 Adam's compressed mean gradient ("gradients"), each
    rank's part clipped already (see [Note: 0/1 Adam] in ``ops/_zeroone.py``)."""
    c = plan.config
    max_norm = None if compressed else c.clip_norm
    copies = _copies(plan, state)
    if plan.optimizer.fused is None:  # an optax transformation (see [Note: optax on shards])
        if skip:
            warn_unskipped(plan, skip, "optax transformation")
        with timed("optimizer"):
            shards = full_grads(plan, shards)
            held = hold_frozen(plan, state)
            rest = plan.optimizer.apply_optax(
                plan.layout, state.master, state.moments, state.opt_rest, shards, grad_scale,
                grad_sumsq, c.clip_norm, rank=c.comm.rank if c.stage else 0,
                reduce=lambda x: _summed(plan, x))
            for (u, a, b), kept in held:  # as they were, whatever the transformation did
                state.master[u][a:b] = kept
            if rest is not None:
                state = state.replace(opt_rest=rest)
            for dst, m in zip(copies, state.master, strict=True) if copies else ():
                ops.cast(m, dst.dtype, out=dst)
        refresh(plan, state, copies)
        return state
    fused = plan.optimizer.fused
    with timed("optimizer"):
        groups = None if fused.per_tensor else _count_groups(plan, state, skip)
        if fused.per_tensor:
            _per_leaf(plan, state, shards, grad_scale, grad_sumsq, copies, skip)
        elif groups is not None or plan.runs is not None:  # see [Note: frozen leaves]
            pairs = groups if groups is not None else [(state.step, cast(tuple, plan.runs))]
            for count, runs in pairs:
                c.optimizer.apply(
                    grad_views(plan, shards, runs),
                    fused.state(count, *(grad_views(plan, m, runs) for m in state.moments)),
                    master_views(plan, state.master, runs), grad_scale=grad_scale,
                    grad_sumsq=grad_sumsq,
                    max_norm=max_norm,
                    param_copies=copy_views(plan, copies, runs) if copies else None,
                    finite=True)
        else:
            c.optimizer.apply(tuple(shards), fused.state(state.step, *state.moments),
                              state.master, grad_scale=grad_scale, grad_sumsq=grad_sumsq,
                              max_norm=max_norm, param_copies=copies, finite=True)
        if copies and c.stage in (1, 2) and (plan.frozen or skip):
            copy_left(plan, state, copies, skip)
    refresh(plan, state, copies)
    return state


def _per_leaf(plan: Plan, state: TrainState, shards: list[Array], grad_scale: float,
              grad_sumsq: Array | None, copies: tuple | None, skip: frozenset[int]) -> None:
    """A fused optimizer whose update reduces over each whole leaf (LAMB's trust
    ratio), on each leaf's local view: the split leaves first, so that their
    per-leaf sums are one leading block, summed over the data ranks by one
    all-reduce between the kernel's passes; a replicated leaf's are its own."""
    c = plan.config
    leaves = plan.layout.leaves
    split = [c.stage > 0 and c.comm.world_size > 1 and leaf.sharded for leaf in leaves]
    order = sorted((i for i in range(len(leaves)) if i not in plan.frozen and i not in skip),
                   key=lambda i: not split[i])
    nsplit = sum(split[i] for i in order)

    def views(bufs: Sequence[Array]) -> tuple[Array, ...]:
        return tuple(bufs[leaves[i].unit][leaves[i].offset:leaves[i].offset +
                                          leaves[i].local_size] for i in order)

    def packed_views(bufs: tuple[Array, ...] | list[Array],  # gradients', moments'
                     packing: Packing | None = plan.packing) -> tuple[Array, ...]:
        if packing is None:
            return views(bufs)
        out = []
        for i in order:
            a, b = packing.where(leaves[i].unit, leaves[i].offset,
                                 leaves[i].offset + leaves[i].local_size)
            out.append(bufs[leaves[i].unit][a:b])
        return tuple(out)

    def reduce(sums: Array) -> Array:
        if nsplit:
            with timed("reduce_wait"):
                plan.fast.all_reduce_(sums[:nsplit], "sum")
        return sums

    fused = cast(ops.FusedOptimizer, plan.optimizer.fused)  # a fused optimizer's per-leaf update
    c.optimizer.apply(packed_views(shards), fused.state(
        state.step, *(packed_views(m) for m in state.moments)),
        packed_views(state.master, plan.master_packing),
        grad_scale=grad_scale, grad_sumsq=grad_sumsq, max_norm=c.clip_norm,
        param_copies=packed_views(copies, copies_packing(plan)) if copies else None,
        finite=True, reduce=reduce)


def _summed(plan: Plan, x: np.ndarray) -> np.ndarray:
    """``x`` summed over the data ranks (host arrays)."""
    plan.fast.all_reduce_(x, "sum")
    return x


def _copies(plan: Plan, state: TrainState) -> tuple | None:
    """Buffers the optimizer writes the new compute-dtype params into, if any."""
    if state.meta.compute_dtype == state.meta.master_dtype or not state.compute:
        return None
    if plan.config.stage in (0, 3):
        return state.compute
    sizes = [u.local_size for u in plan.layout.units] if plan.master_packing is None else \
        plan.master_packing.sizes  # packed as the masters (see [Note: frozen leaves])
    return tuple(plan.device.empty(n, state.compute[0].dtype) for n in sizes)


def refresh(plan: Plan, state: TrainState, copies: tuple | None) -> None:
    """Stages 1-2: all-gather the updated shards into the whole compute params."""
    c, layout, device = plan.config, plan.layout, plan.device
    if c.stage not in (1, 2):
        return
    src = copies or state.master
    packed = plan.master_packing is not None  # the trainable leaves alone: the grads' layout
    if c.comm.world_size == 1 and plan.full_layout == layout and not packed:
        with timed("library"):  # one rank: its shards are the whole params, laid out alike
            for dst, x in zip(state.compute, src, strict=True):
                dst[...] = x
        return
    for u, unit in enumerate(plan.grad_layout.units if packed else layout.units):
        gathered = device.empty(unit.sharded_size * c.comm.world_size, src[u].dtype)
        if unit.sharded_size:
            with timed("all_gather_wait"):
                plan.fast.all_gather_into(gathered, src[u][:unit.sharded_size])
        # the unit's copy-out, as ZeRO-3's (see Units.flat)
        for runs, source in zip(plan.refresh_plans.gather(u), (gathered, src[u]), strict=True):
            copy_runs(state.compute[u], runs, runs.table(device), device=device, src=source)

