"""The step's sums ordered by the data, not by the ranks: ``invariant_shards=``.

:class:`OrderedReducer` reduces each virtual shard's gradients in a fixed tree;
:func:`exact_norm_and_loss` sums the norm and the losses exactly;
:func:`virtual_shards` cuts a micro-batch into the shards.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import numpy as np

import ops
from ops import Communicator, Device
from ops._optim import OneBit
from ops.comm._collectives import all_gather_host
from ops.comm._ordered import TreeSum, tree_all_reduce, tree_reduce_scatter
from shard.core._layout import Layout
from shard.core._state import TrainState
from shard.monitor._profile import timed
from shard.step import _checks
from shard.step.reduction._compressed import Compressed, LocalReducer, OneBitReducer
from shard.step.reduction._reduce import CopyPlans, GradBuffers, GradReducer

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numpy.typing import DTypeLike

    from ops._types import Array
    from shard.core._layout import UnitLayout
    from shard.step._plan import Plan
    from shard.step.reduction._reduce import Grad

__all__ = ["OrderedReducer", "exact_norm_and_loss", "reducer", "virtual_shards"]

# [Note: the same bits at any world size]
# ``invariant_shards=V`` fixes every sum of a step by the data, not by the
# ranks. Each micro-batch (the global one: every data rank's part) is cut into
# V virtual shards of equal rows; data rank d (replica r's rank k is
# d = r * S + k) holds shards d * G to d * G + G - 1 (G = V / W), which is
# how ``shard.DataLoader`` and ``split_batch`` cut a batch: contiguous parts
# in rank order. Then:
#
# - each shard's loss and gradient come from the same program on the same
#   shapes wherever it runs (``virtual_shards``: G calls of the loss a
#   micro-batch), so they are the same bits on any rank;
# - :class:`OrderedReducer` sums them in one binary tree over the V shards
#   in order (see [Note: ordered sums] in ``ops/comm/_ordered.py``): a rank's
#   G in a TreeSum, the ranks' subtrees by recursive halving (stages 1-3) or
#   doubling (stage 0), then under HSDP the replicas' subtrees (the data
#   rank's low digits are the shard group's, so that is the same tree), each
#   micro-batch on its own; the micro-batches' sums are added in order, the
#   first copied;
# - the gradient norm is an exact sum (see [Note: exact sums of squares] in
#   ``ops/_norm.py``), integer parts summed over the ranks, and the loss the
#   exact sum (``math.fsum``) of every shard's loss;
# - the gradients are multiplied once, by 1 / (V * micro-batches * loss
#   scale), the same number on every layout, and the update acts on each
#   element alone (the fused kernels, optax's jitted update), whichever rank
#   and offset holds it;
# - a JAX loss's key (``key=``) is derived from the shard's index and the
#   micro-batch's, not from the rank.
#
# So worlds 1 to V (powers of two), ZeRO 0-3, HSDP, hpZ and host offload give
# the same bits, and a checkpoint resumes on another world size on the same
# trajectory. What still changes them: another machine or build (CPU or GPU
# model, BLAS, XLA or torch version), another thread count inside the
# compute (``torch.set_num_threads``), a batch order other than the one
# above, and what ``invariant_shards=`` refuses before anything changes
# (tensor and pipeline parallelism, a model state, a torch module's running
# statistics or dropout in training mode, ranks whose micro-batches differ in
# rows, ``axis_name=``, ``weight_by_rows``, ``gradient_divide_factor=``,
# ``Offload(overlap=True)``, LAMB's and Adafactor's whole-leaf sums, float64
# gradients). ``metrics["aux"]`` stays a mean of the ranks' means. The cost: V calls of the
# loss on smaller batches instead of W; up to log2(G) + 1 partial sums of the
# whole gradient held until the micro-batch ends (at stage 3 too); the
# reductions after the backward rather than during it; two small host reads
# a step (the norm's parts and the losses).


def reducer(plan: Plan, buffers: GradBuffers,
            compressed: Compressed | None = None) -> GradReducer:
    """The step's gradient reduction: ordered where ``invariant_shards=`` asks
    (see [Note: the same bits at any world size]); the 1-bit family's in its
    compressed phases (see :class:`~shard.step.reduction._reduce.Compressed`)."""
    c = plan.config
    if compressed is not None:
        if compressed.kind == "local":  # (float32 whatever the reductions' dtype)
            return LocalReducer(plan.grad_layout, plan.fast, dtype=np.float32,
                                device=plan.device, buffers=buffers, plans=plan.grad_plans,
                                scale=compressed.scale, max_norm=c.clip_norm)
        spec = cast(ops.FusedOptimizer, plan.optimizer.fused).onebit
        return OneBitReducer(plan.grad_layout, plan.fast, dtype=np.float32,
                             device=plan.device, buffers=buffers, plans=plan.grad_plans,
                             momentum=compressed.held, scale=compressed.scale,
                             beta1=cast(OneBit, spec).b1 if compressed.kind == "momentum"
                             else None, max_norm=c.clip_norm)
    if c.invariant_shards:
        return OrderedReducer(plan.grad_layout, plan.fast, stage=c.stage,
                              dtype=plan.reduce_dtype, device=plan.device, buffers=buffers,
                              plans=plan.grad_plans, group=c.invariant_shards // c.ranks,
                              replica=plan.replica)
    return GradReducer(plan.grad_layout, plan.fast, stage=c.stage, dtype=plan.reduce_dtype,
                       device=plan.device, buffers=buffers, plans=plan.grad_plans,
                       quantized=8 if c.quantized_gradients is True else
                       int(c.quantized_gradients), hierarchy=plan.secondary)


def virtual_shards(plan: Plan, state: TrainState, micro: list[object]) -> list[Any]:
    """Each micro-batch's virtual shards on this rank, in order (see [Note: the
    same bits at any world size]); a refusal for what would change the bits."""
    c = plan.config
    if state.model_state is not None:
        raise NotImplementedError(f"{c.name}: invariant_shards= does not keep a model state "
                                  "(statistics averaged over the ranks) invariant")
    if plan.reduce_dtype == np.float64:
        raise NotImplementedError(f"{c.name}: invariant_shards= sums float32, bfloat16 and "
                                  "float16 gradients exactly; not float64")
    why = c.loss_fn.layout_dependent()
    if why is not None:
        raise NotImplementedError(f"{c.name}: invariant_shards= cannot keep {why} the same "
                                  "at every world size")
    group = c.invariant_shards // c.ranks if c.invariant_shards else 1
    try:
        rows = np.array([_checks.batch_rows(f"{c.name}: invariant_shards cuts each micro-batch "
                                            f"by its rows, but on rank {c.comm.rank}", b)
                         for b in micro], np.int64)
        mine = None
    except ValueError as e:  # the others still gather, then refuse too
        rows, mine = np.full(len(micro), -1, np.int64), e
    every = all_gather_host(plan.fast, rows)  # every rank refuses alike, before any compute
    if plan.replica is not None:
        every = all_gather_host(plan.replica, every)
    every = every.reshape(c.ranks, len(micro))
    if mine is not None:
        raise mine
    if (every != every[0][0]).any() or every[0][0] % group:
        raise ValueError(f"{c.name}: invariant_shards cuts each micro-batch into {group} "
                         f"virtual shards a rank, of equal rows on every rank; the ranks' "
                         f"micro-batches have {every.tolist()} rows")
    return [v for b, n in zip(micro, rows.tolist(), strict=True)
            for v in _checks.virtual_shards(b, n, group)]


class OrderedReducer(GradReducer):
    """The reduction of ``invariant_shards=`` (see [Note: the same bits at any
    world size]): each virtual shard's gradient packed on its own (no sum
    with another), the ``group`` shards of a micro-batch summed per unit in a
    :class:`~ops.comm._ordered.TreeSum`; at the group's end (:meth:`end_call`)
    every unit, in order, is reduced by the ordered collectives (over the
    shard group, then HSDP's ``replica`` group), and the micro-batches' sums
    are added in order (the first copied). Nothing is in flight between
    calls."""

    def __init__(self, layout: Layout, comm: Communicator, *, stage: int, dtype: DTypeLike,
                 device: Device, group: int, replica: Communicator | None = None,
                 buffers: GradBuffers | None = None, plans: CopyPlans | None = None) -> None:
        buffers = buffers or GradBuffers(layout, dtype, device)
        super().__init__(layout, comm, stage=stage, dtype=dtype, device=device,
                         buffers=buffers, plans=plans, accumulate=False)
        self._spare = buffers.spare
        self.group, self.replica = group, replica
        self._trees: dict[int, TreeSum] = {}
        self._calls = 0  # the virtual shards of this micro-batch so far
        self._summed: set[int] = set()  # units whose shard holds a micro-batch's sum

    def bucket(self, u: int) -> None:
        return None  # every shard's gradient apart, never summed in place

    def _scratch(self, n: int, *, zero: bool = False) -> Array:
        """A buffer of ``n`` elements: a spare one kept from an earlier use."""
        free = self._spare.setdefault(n, [])
        buf = free.pop() if free else self.device.empty(n, self.dtype)
        if zero:
            buf[...] = 0
        return buf

    def _release(self, buf: Array) -> None:
        self._spare[buf.size].append(buf)

    def _tree(self, u: int) -> TreeSum:
        if u not in self._trees:
            self._trees[u] = TreeSum(release=self._release)
        return self._trees[u]

    def _add(self, u: int, grads: Sequence[Grad | None]) -> None:
        unit, w = self.layout.units[u], self.layout.world_size
        n = unit.sharded_size * w + unit.replicated_size
        tree = self._tree(u)
        while tree.count < self._calls:  # no gradient in an earlier shard: zero
            tree.add(self._scratch(n, zero=True))
        if tree.count > self._calls:
            raise RuntimeError(f"unit {u}'s gradient was added twice for one virtual shard")
        buf = self._scratch(n)
        packed, replicated = buf[:unit.sharded_size * w], buf[unit.sharded_size * w:]
        replicated[...] = 0
        kernel = self._pack(u, grads, packed)
        for i, g in zip(unit.leaves, grads, strict=True):
            leaf = self.layout.leaves[i]
            if not (kernel and leaf.sharded):
                self.layout.pack_grad(leaf, None if g is None else self._on_device(i, g),
                                      packed, replicated, add=not leaf.sharded)
        tree.add(buf)

    def added(self, u: int) -> None:
        raise RuntimeError("OrderedReducer keeps no bucket: add() each gradient")

    def end_call(self) -> None:
        """One virtual shard's gradients are all added; at the group's last,
        every unit is reduced over the ranks (in unit order, on every rank)."""
        self._calls += 1
        if self._calls < self.group:
            return
        with timed("reduce_wait"):
            for u, unit in enumerate(self.layout.units):
                if unit.local_size:
                    self._add_group(u, unit)
        self._trees, self._calls = {}, 0

    def _add_group(self, u: int, unit: UnitLayout) -> None:
        w, s = self.layout.world_size, unit.sharded_size
        tree = self._tree(u)
        while tree.count < self.group:
            tree.add(self._scratch(s * w + unit.replicated_size, zero=True))
        buf = tree.total()
        shard = self.shards[u]
        out = shard if u not in self._summed else self._scratch(unit.local_size)
        if s and self.stage == 0:  # whole gradients, the same on every rank
            out[:s] = tree_all_reduce(self.comm, buf[:s])
        elif s:
            tree_reduce_scatter(self.comm, out[:s], buf[:s * w])
        if unit.replicated_size:
            out[s:] = tree_all_reduce(self.comm, buf[s * w:])
        if self.replica is not None:  # HSDP: the replicas' subtrees, this micro-batch's
            tree_all_reduce(self.replica, out[:unit.local_size])
        if u in self._summed:
            shard += out
            self._release(out)
        self._release(buf)
        self._summed.add(u)

    def finish(self) -> list[Array]:
        if self._calls:
            raise RuntimeError(f"OrderedReducer: {self._calls} virtual shards of a micro-batch "
                               f"of {self.group} were added")
        for u, unit in enumerate(self.layout.units):
            if u not in self._summed:
                self.shards[u][:unit.local_size] = 0
        return self.shards


def exact_norm_and_loss(plan: Plan, sharded: list[Array], replicated: list[Array],
                        losses: list[Array]) -> tuple[float, float]:
    """The sum of squares of the gradients (this rank's ``sharded`` sections
    over the data ranks, the ``replicated`` ones once) and the sum of every
    virtual shard's loss, each exact, so the same bits however the ranks split
    them (see [Note: the same bits at any world size])."""
    parts = ops.exact_square_parts(sharded)
    parts = all_gather_host(plan.fast, parts).reshape(plan.fast.world_size, -1).sum(axis=0)
    parts += ops.exact_square_parts(replicated)
    mine = plan.device.to_host(plan.device.xp.concatenate(losses)).astype(np.float64)
    every = all_gather_host(plan.fast, mine)
    if plan.replica is not None:
        every = all_gather_host(plan.replica, every)
    return ops.exact_square_total(parts), math.fsum(every.tolist())
