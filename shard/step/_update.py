"""A step's update phase: the gradients' norm, the fused optimizer, and stages
1-2's all-gather of the new compute params (steps 2, 4 and 5 of the step in
``shard/step/_step.py``)."""

from __future__ import annotations

from typing import Any

import ops
from ops import AdamState
from ops.device._runs import copy_runs
from shard.core._state import TrainState
from shard.monitor._profile import timed

__all__ = ["UpdatePhase"]


class UpdatePhase:
    """The update-phase methods of ``ZeroStep`` (which provides the attributes)."""

    layout: Any
    full_layout: Any
    comm: Any
    device: Any
    stage: int
    optimizer: Any
    clip_norm: Any
    _fast: Any
    _plans: Any
    _apply_offloaded: Any
    loss_fn: Any

    def _norm_and_loss(self, shards: list[Any], totals: Any) -> None:
        """``totals`` (on the device) becomes [global sum of squares of the summed
        gradients, sum of the micro-batch losses over ranks]: one all-reduce."""
        sharded, replicated = [], []
        skip = set(getattr(self.loss_fn, "norm_skip", ()))  # copies of a tied weight
        for unit, g in zip(self.layout.units, shards, strict=True):
            cuts = sorted((leaf.offset, leaf.offset + leaf.local_size) for leaf in
                          (self.layout.leaves[i] for i in unit.leaves if i in skip))
            for a, b in _kept([(0, unit.sharded_size), (unit.sharded_size, unit.local_size)],
                              cuts):
                (sharded if b <= unit.sharded_size else replicated).append(g[a:b])
        if self.stage == 0:  # everything is whole (and the same) on every rank
            replicated, sharded = sharded + replicated, []
        if sharded:
            ops.sum_of_squares(sharded, out=totals[0:1])
        mesh = getattr(self.loss_fn, "norm_comm", None)
        if mesh is not None:  # a pipeline stage: over the whole mesh (see [Note: pipeline])
            if replicated and self.comm.rank == 0:  # once per stage
                totals[0:1] += ops.sum_of_squares(replicated)
            mesh.all_reduce_(totals, "sum")
            return
        self._fast.all_reduce_(totals, "sum")
        if replicated:
            totals[0:1] += ops.sum_of_squares(replicated)

    def _apply(self, state: TrainState, shards: list[Any], grad_scale: float,
               grad_sumsq: Any) -> TrainState:
        """The optimizer on every unit's shard, then stages 1-2's all-gather of the
        new compute params; returns the state (new buffers for the disk tier).
        With ``grad_sumsq`` (a device array) the kernel clips by it and skips the
        update where it is not finite, reading it on the device (see [Note:
        non-finite gradients])."""
        if state.meta.offload is not None:
            return self._apply_offloaded(state, shards, grad_scale, grad_sumsq)
        copies = self._copies(state)
        opt = AdamState(state.step, state.exp_avg, state.exp_avg_sq)
        with timed("optimizer"):
            self.optimizer.apply(tuple(shards), opt, state.master, grad_scale=grad_scale,
                                 grad_sumsq=grad_sumsq, max_norm=self.clip_norm,
                                 param_copies=copies, finite=True)
        self._refresh(state, copies)
        return state

    def _copies(self, state: TrainState) -> tuple | None:
        """Buffers the optimizer writes the new compute-dtype params into, if any."""
        if state.meta.compute_dtype == state.meta.master_dtype or not state.compute:
            return None
        if self.stage in (0, 3):
            return state.compute
        return tuple(self.device.empty(u.local_size, state.compute[0].dtype)
                     for u in self.layout.units)

    def _refresh(self, state: TrainState, copies: tuple | None) -> None:
        """Stages 1-2: all-gather the updated shards into the whole compute params."""
        if self.stage not in (1, 2):
            return
        src = copies or state.master
        if self.comm.world_size == 1 and self.full_layout == self.layout:
            with timed("library"):  # one rank: its shards are the whole params, laid out alike
                for dst, x in zip(state.compute, src, strict=True):
                    dst[...] = x
            return
        for u, unit in enumerate(self.layout.units):
            gathered = self.device.empty(unit.sharded_size * self.comm.world_size, src[u].dtype)
            if unit.sharded_size:
                with timed("all_gather_wait"):
                    self._fast.all_gather_into(gathered, src[u][:unit.sharded_size])
            # the unit's copy-out, as ZeRO-3's (see Units.flat)
            for runs, source in zip(self._plans.gather(u), (gathered, src[u]), strict=True):
                copy_runs(state.compute[u], runs, runs.table(self.device), device=self.device,
                          src=source)


def _kept(sections: list[tuple[int, int]], cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The non-empty parts of ``sections`` outside every ``cuts`` range."""
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
