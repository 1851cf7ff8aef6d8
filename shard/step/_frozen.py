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

Where the optimizer writes the compute-dtype params (mixed precision), it
writes them on the trainable runs: at stages 0 and 3 the compute copies
persist and the frozen leaves' stay as they were; stages 1-2 write fresh
buffers each step, so the frozen leaves' copies are cast from their masters
there (``_update._copy_left``). The offload tiers keep moments in the
masters' layout (zero for frozen leaves) and run the kernel on the trainable
ranges of each unit or chunk, reading the packed gradients
(``shard/offload/_step.py``).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from ops._tree import tree_util
from shard.core._layout import Layout

__all__ = ["Packing", "frozen_leaves", "gradient_layout", "outside", "trainable_runs", "views"]


def frozen_leaves(trainable: Any, loss_fn: Any, params: Any, fn: str) -> frozenset[int]:
    """The indices (in leaf order) of the leaves of ``params`` that do not train:
    ``trainable``'s False entries, or a torch loss's ``requires_grad=False``
    parameters (its ``frozen`` names)."""
    tu = tree_util()
    with_paths, treedef = tu.tree_flatten_with_path(params)
    names = getattr(loss_fn, "frozen", None)
    if trainable is None:
        if not names:
            return frozenset()
        return frozenset(i for i, (path, _) in enumerate(with_paths)
                         if getattr(path[0], "key", None) in names)
    mask = trainable(params) if isinstance(trainable, Callable) else trainable
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


def _broadcast(mask: Any, params: Any, fn: str) -> Any:
    """``mask`` with each bool at a prefix node repeated over that subtree."""
    tu = tree_util()

    def spread(path: tuple, m: Any, sub: Any) -> Any:
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


def views(bufs: Any, runs: tuple) -> tuple:
    """The trainable runs of per-unit buffers ``bufs``, as one flat tuple of views."""
    return tuple(buf[a:b] for buf, unit_runs in zip(bufs, runs, strict=True)
                 for a, b in unit_runs)



class Packing:
    """Where each trainable run of a unit's local buffer lives in the unit's
    packed moment buffer (see [Note: frozen leaves])."""

    def __init__(self, runs: tuple) -> None:
        self.runs = runs
        self.starts: list[list[int]] = []  # per unit, each run's start in the local buffer
        self.packed: list[list[int]] = []  # per unit, each run's start in the packed buffer
        self.sizes: list[int] = []
        for unit_runs in runs:
            at, packed = 0, []
            for a, b in unit_runs:
                packed.append(at)
                at += b - a
            self.starts.append([a for a, _ in unit_runs])
            self.packed.append(packed)
            self.sizes.append(at)

    def where(self, u: int, a: int, b: int) -> tuple[int, int]:
        """The packed range of unit ``u``'s local range [a, b) (inside one run)."""
        k = bisect.bisect_right(self.starts[u], a) - 1
        start = self.packed[u][k] + a - self.starts[u][k]
        return start, start + b - a

    def views(self, bufs: Any, runs: tuple) -> tuple:
        """The packed buffers' views of ``runs`` (ranges inside trainable runs)."""
        out = []
        for u, (buf, unit_runs) in enumerate(zip(bufs, runs, strict=True)):
            for a, b in unit_runs:
                pa, pb = self.where(u, a, b)
                out.append(buf[pa:pb])
        return tuple(out)

    def expand(self, u: int, packed: Any, full: Any) -> Any:
        """``full`` (unit ``u``'s local size, zeros) with the packed runs in place."""
        for (a, b), p in zip(self.runs[u], self.packed[u], strict=True):
            full[a:b] = packed[p:p + b - a]
        return full

    def pack(self, u: int, full: Any, packed: Any) -> Any:
        """``packed`` filled from unit ``u``'s local-layout buffer ``full``."""
        for (a, b), p in zip(self.runs[u], self.packed[u], strict=True):
            packed[p:p + b - a] = full[a:b]
        return packed
