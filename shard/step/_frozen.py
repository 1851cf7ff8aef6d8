"""Frozen leaves: params a step carries and gathers but never updates.

[Note: frozen leaves]
Fine-tuning trains a few params of a pretrained model (LoRA's adapters, a new
head) and keeps the rest as they are. A leaf is frozen when the step's
``trainable=`` says so (a pytree of bools shaped like the params, or a
function of the params returning one, as ``optax.masked`` takes), or, for a
torch module, when its parameter has ``requires_grad=False``. A frozen leaf
is laid out, sharded and gathered like any other (the loss needs it), and its
gradient, if the loss makes one, is left out of the global norm; the
optimizer never sees it, so its value stays bit for bit the value it was
given, with no weight decay, and its moments stay zero.

The optimizer runs on the trainable runs of each unit's buffers: the ranges of
a unit's local buffer outside its frozen leaves, found once per layout (one
or two ranges for a unit whose frozen leaves sit together, as a LoRA block's
base weights do). The per-step cost is then a fixed list of views, whatever
the number of leaves (see ``_update.apply``).

Frozen leaves keep no optimizer moments and no gradients: each moment's
unit buffer holds the unit's trainable runs alone, packed end to end
(:class:`Packing`), so a LoRA model's moments are those of its adapters; and
the step's gradients are laid out by :func:`gradient_layout`, the params'
layout with every frozen leaf of size zero, whose unit buffers are those same
packed runs. The reducer then copies in, reduce-scatters and all-reduces the
trainable leaves alone (a LoRA model's adapters, not its base weights), a
frozen leaf's gradient, if the loss makes one, is dropped at the copy-in, and
the optimizer reads gradients and moments through the same packed views. An
optax transformation updates every leaf of the tree it was given: there the
gradients are expanded to the masters' layout with zeros for the frozen
leaves (its state for them stays zero) and the frozen masters are put back
after it. Everything outside the step sees
moments in the layout of the masters: ``state.opt`` and checkpoints expand
them (frozen leaves' entries zero), and a checkpoint's are packed again on
load, so a checkpoint is the same with frozen leaves or without.

Frozen leaves keep no masters either where the compute params hold them in
their own dtype (:func:`masters_in_compute`): at stages 1-2, whose whole
compute params every rank keeps, and at stages 0 and 3 with mixed precision
when the frozen leaves have the compute dtype (a bfloat16 model's base
weights under LoRA), with a fused optimizer and no offload. The masters are
then packed as the moments are, so a LoRA model's per-rank state is its
frozen bytes in their dtype plus the adapters' masters and moments. The
optimizer writes each step's compute-dtype params on the trainable runs: at
stages 0 and 3 into the compute params, laid out as the params, whose frozen
entries stay as they were; at stages 1-2 into fresh buffers packed as the
masters, whose all-gather then carries the trainable leaves alone, copied out
into the whole compute params by the gradients' layout (frozen leaves are
never gathered: they never change). Where frozen leaves keep their masters
(a frozen float32 leaf under bfloat16 compute, an optax transformation, the
offload tiers), stages 1-2 cast the frozen leaves' copies from their masters
(:func:`copy_left`). Everything outside the step sees masters in the
params' layout: ``state.params``, ``shard.gather`` and checkpoints cast the
frozen leaves' values from the compute params (exact: the compute dtype is
theirs), and a checkpoint's are packed again on load. The offload tiers keep
moments in the masters' layout (zero for frozen leaves) and run the kernel on
the trainable ranges of each unit or chunk, reading the packed gradients
(``shard/offload/_offloader.py``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

import numpy as np

import ops
from ops._types import tree_util
from shard.core._layout import Layout
from shard.core._state import Packing, TrainState

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import DTypeLike

    from ops._types import Array
    from shard.step._plan import Plan

__all__ = ["Packing", "copies_packing", "copy_left", "copy_views", "frozen_leaves", "full_grads",
           "grad_views", "gradient_layout", "hold_frozen", "master_views", "masters_in_compute",
           "outside", "trainable_runs", "views"]


def frozen_leaves(trainable: object, names: frozenset[str] | None, params: object,
                  fn: str) -> frozenset[int]:
    """The indices (in leaf order) of the leaves of ``params`` that do not train:
    ``trainable``'s False entries, or a torch loss's ``requires_grad=False``
    parameters (``names``, a loss object's ``frozen``)."""
    tu = tree_util()
    with_paths, treedef = tu.tree_flatten_with_path(params)
    if trainable is None:
        if not names:
            return frozenset()
        return frozenset(i for i, (path, _) in enumerate(with_paths)
                         if getattr(path[0], "key", None) in names)
    mask = trainable(params) if callable(trainable) else trainable
    try:
        flags = treedef.flatten_up_to(_broadcast(mask, params, fn))
    except (ValueError, KeyError) as e:
        raise ValueError(f"{fn}: trainable= must be a pytree of bools shaped like the params "
                         f"(or a prefix of it), or a function of the params returning one, "
                         f"as optax.masked takes: {e}") from None
    out = []
    for i, ((path, _), flag) in enumerate(zip(with_paths, flags, strict=True)):
        if names and getattr(path[0], "key", None) in names and flag:
            raise ValueError(f"{fn}: trainable{tu.keystr(path)} is True but the torch "
                             "parameter has requires_grad=False; set one or the other")
        if not flag:
            out.append(i)
    if len(out) == len(with_paths):
        raise ValueError(f"{fn}: trainable= freezes every leaf: nothing to train")
    return frozenset(out)


def _broadcast(mask: object, params: object, fn: str) -> object:
    """``mask`` with each bool at a prefix node repeated over that subtree."""
    tu = tree_util()

    def spread(path: tuple, m: object, sub: object) -> object:
        if not isinstance(m, (bool, np.bool_)):
            raise TypeError(f"{fn}: trainable{tu.keystr(path)} must be True or False; got "
                            f"{type(m).__name__}")
        return tu.tree_map(lambda _: bool(m), sub)

    return tu.tree_map_with_path(spread, mask, params)


def trainable_runs(layout: Layout, frozen: frozenset[int]) -> tuple[tuple[tuple[int, int], ...],
                                                                     ...]:
    """Per unit, the ranges ``(start, end)`` of its local buffer outside its
    frozen leaves (see [Note: frozen leaves])."""
    return tuple(tuple(outside([(0, unit.local_size)], sorted(
        (leaf.offset, leaf.offset + leaf.local_size)
        for leaf in (layout.leaves[i] for i in unit.leaves if i in frozen))))
        for unit in layout.units)


def masters_in_compute(layout: Layout, frozen: frozenset[int], *, stage: int,
                       compute_dtype: DTypeLike, master_dtype: DTypeLike, fused: bool,
                       offload: bool) -> bool:
    """Whether the frozen leaves keep no masters, the compute params holding
    their values in their own dtype (see [Note: frozen leaves]): with a fused
    optimizer and no offload, when every frozen leaf has the compute dtype (a
    frozen float32 leaf under bfloat16 compute keeps its float32 master), at
    stages 1-2, whose whole compute params every rank keeps, and at stages 0
    and 3 with mixed precision (without it the masters are the compute
    params)."""
    compute = np.dtype(compute_dtype)
    if not (frozen and fused and not offload) or any(
            np.dtype(layout.leaves[i].dtype) != compute for i in frozen):
        return False
    return stage in (1, 2) or compute != np.dtype(master_dtype)


def gradient_layout(layout: Layout, frozen: frozenset[int]) -> Layout:
    """``layout`` with every frozen leaf of size zero: the layout of the step's
    gradients (see [Note: frozen leaves]). Leaf and unit indices stay those of
    ``layout``; a frozen leaf keeps its shape but holds no rows on any rank
    (sharded, ``rows_per_rank`` 0), so its copy-in drops it. Each unit's local
    buffer is its trainable runs packed end to end, as :class:`Packing` packs
    them."""
    if not frozen:
        return layout
    leaves = list(layout.leaves)
    units = []
    for unit in layout.units:
        offset, sections = 0, [0, 0]  # the trainable sharded and replicated sizes
        for i in sorted(unit.leaves, key=lambda i: layout.leaves[i].offset):
            leaf = layout.leaves[i]
            if i in frozen:
                leaves[i] = dataclasses.replace(leaf, sharded=True, rows_per_rank=0, offset=offset)
                continue
            leaves[i] = dataclasses.replace(leaf, offset=offset)
            offset += leaf.local_size
            sections[not leaf.sharded] += leaf.local_size
        units.append(dataclasses.replace(unit, sharded_size=sections[0],
                                         replicated_size=sections[1]))
    return dataclasses.replace(layout, leaves=tuple(leaves), units=tuple(units))


def outside(sections: list[tuple[int, int]], cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The non-empty parts of ``sections`` outside every range of ``cuts`` (sorted)."""
    out = []
    for a, b in sections:
        for c, d in cuts:
            if c >= b or d <= a:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if b > a:
            out.append((a, b))
    return out


def views(bufs: Sequence[Array], runs: tuple) -> tuple[Array, ...]:
    """The trainable runs of per-unit buffers ``bufs``, as one flat tuple of views."""
    return tuple(buf[a:b] for buf, unit_runs in zip(bufs, runs, strict=True)
                 for a, b in unit_runs)



def copy_left(plan: Plan, state: TrainState, copies: tuple, skip: frozenset[int]) -> None:
    """Stages 1-2's compute copies are fresh buffers that the kernel writes on
    the ranges it updates: the leaves it left (frozen, or without a gradient
    this step) get their masters cast, one launch per run of such leaves (the
    frozen ones' runs are the plan's, found once). Where frozen leaves keep no
    masters the copies hold the trainable runs alone, packed, and only the
    leaves without a gradient are left (see [Note: frozen leaves])."""
    packing = plan.master_packing
    if packing is not None:
        if skip:
            updated = trainable_runs(plan.layout, plan.frozen | skip)
            frozen_runs = cast(tuple, plan.runs)  # packing is made where leaves are frozen
            for u, (runs, done) in enumerate(zip(frozen_runs, updated, strict=True)):
                for a, b in outside(list(runs), list(done)):
                    pa, pb = packing.where(u, a, b)
                    ops.cast(state.master[u][pa:pb], copies[u].dtype, out=copies[u][pa:pb])
        return
    updated = plan.runs if not skip and plan.runs is not None else \
        trainable_runs(plan.layout, plan.frozen | skip)
    for u, (unit, runs) in enumerate(zip(plan.layout.units, updated, strict=True)):
        for a, b in outside([(0, unit.local_size)], list(runs)):
            ops.cast(state.master[u][a:b], copies[u].dtype, out=copies[u][a:b])


def full_grads(plan: Plan, shards: list[Array]) -> list[Array]:
    """For an optax transformation, which takes gradients shaped like the
    params: the packed gradient shards in the masters' layout, zero for the
    frozen leaves, so that its state for them stays zero (see [Note: frozen
    leaves])."""
    if plan.packing is None:
        return shards
    return [plan.packing.expand(u, g, plan.device.zeros(unit.local_size, g.dtype))
            for u, (unit, g) in enumerate(zip(plan.layout.units, shards, strict=True))]


def hold_frozen(plan: Plan, state: TrainState) -> list:
    """For an optax transformation, which updates every leaf: the frozen leaves'
    masters, to be put back after the update (see [Note: frozen leaves])."""
    held = []
    for i in sorted(plan.frozen):
        leaf = plan.layout.leaves[i]
        a, b = leaf.offset, leaf.offset + leaf.local_size
        held.append(((leaf.unit, a, b), state.master[leaf.unit][a:b].copy()))
    return held


def grad_views(plan: Plan, bufs: tuple[Array, ...] | list[Array],
               runs: tuple) -> tuple[Array, ...]:
    """The gradients' (and a fused optimizer's moments') views of ``runs``:
    packed where leaves are frozen (see [Note: frozen leaves])."""
    return views(bufs, runs) if plan.packing is None else plan.packing.views(bufs, runs)


def master_views(plan: Plan, bufs: tuple[Array, ...] | list[Array],
                 runs: tuple) -> tuple[Array, ...]:
    """The masters' views of ``runs``: packed where frozen leaves keep no
    masters (see [Note: frozen leaves])."""
    packing = plan.master_packing
    return views(bufs, runs) if packing is None else packing.views(bufs, runs)


def copies_packing(plan: Plan) -> Packing | None:
    """Where the trainable runs live in the buffers the optimizer writes the
    compute-dtype params into: stages 0 and 3 write the compute params, laid
    out as the params; stages 1-2 fresh buffers, packed as the masters."""
    return plan.master_packing if plan.config.stage in (1, 2) else None


def copy_views(plan: Plan, copies: tuple[Array, ...] | list[Array],
               runs: tuple) -> tuple[Array, ...]:
    """The compute-dtype copies' views of ``runs`` (see :func:`copies_packing`)."""
    packing = copies_packing(plan)
    return views(copies, runs) if packing is None else packing.views(copies, runs)
