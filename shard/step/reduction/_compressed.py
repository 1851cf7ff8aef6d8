"""The 1-bit family's reductions (1-bit Adam after ``freeze_step``, 0/1 Adam's
compressed and local steps; see [Note: 1-bit Adam] in ``ops/_onebit.py`` and
[Note: 0/1 Adam] in ``ops/_zeroone.py``), and the buffers they keep across
steps: the momentum the ranks agreed on and the compression's errors, or 0/1
Adam's local steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from ops import Communicator, Device
from ops._onebit import compressed_all_reduce
from ops._optim import ZeroOne
from ops._zeroone import LocalSteps
from shard.core._layout import Layout
from shard.monitor._profile import timed
from shard.step.reduction._reduce import CopyPlans, GradBuffers, GradReducer

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ops._types import Array
    from shard.core._state import TrainState
    from shard.step.reduction._reduce import Grad

__all__ = ["Compressed", "LocalReducer", "OneBitMomentum", "OneBitReducer", "ZeroOneLocal",
           "check_float32", "gather_whole", "write_sections"]


class Compressed(NamedTuple):
    """A step of the 1-bit family's compressed phases: ``kind`` is "momentum"
    (1-bit Adam after ``freeze_step``: ``held`` a :class:`OneBitMomentum`),
    "gradients" (0/1 Adam's updates that hold the variance: a
    :class:`OneBitMomentum` of errors alone) or "local" (0/1 Adam after
    ``var_freeze_step``: a :class:`ZeroOneLocal`); ``scale`` turns a rank's
    gradient sum into its own mean."""

    kind: str
    held: Any  # Any: a OneBitMomentum or a ZeroOneLocal, as kind says
    scale: float


class OneBitMomentum:
    """1-bit Adam's buffers, kept by the step across steps (see [Note: 1-bit
    Adam] in ``ops/_onebit.py``): per unit the momentum the ranks agreed on
    (the sharded leaves' in the (W, S) reduce layout, the replicated ones'
    whole), the worker error like it and the server error (this rank's
    section); with the momentum, the whole params and the frozen variance,
    float32, which every rank updates alike from the agreed momentum, so no
    params are gathered after an update. They hold for the state whose
    ``exp_avg`` buffers and step they were made or last updated with; any
    other state (a resumed one, one whose last update was skipped or failed)
    starts them again from its masters and moments, the errors from zero."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.worker: list[Array] = []
        self.server: list[Array] = []
        self.momentum: list[Array] = []
        self.params: list[Array] = []
        self.variance: list[Array] = []
        self.scratch: list[Array] = []  # the update's exp_avg, which it overwrites

    def ready(self, layout: Layout, comm: Communicator, device: Device, state: TrainState,
              step: int, momentum: bool = True) -> bool:
        """Make the buffers hold for ``state`` (its masters and moments) at
        ``step`` (a collective when they are made: the agreed momentum, the
        params and the variance are gathered from the shards); whether they
        were made. ``momentum=False``: the errors alone (0/1 Adam's
        compressed gradients)."""
        exp_avg = state.moments[0]
        key = (step, tuple(id(b) for b in exp_avg))
        if key == self.key:
            return False
        w = comm.world_size
        self.worker, self.server = [], []
        self.momentum, self.params, self.variance, self.scratch = [], [], [], []
        if momentum:
            self.momentum = gather_whole(layout, comm, device, exp_avg)
            self.params = gather_whole(layout, comm, device, state.master)
            self.variance = gather_whole(layout, comm, device, state.moments[1])
            # zeros: the update reads it (times 0) before it overwrites it
            self.scratch = [device.zeros(x.size, np.float32) for x in self.params]
        for unit in layout.units:
            s = unit.sharded_size
            self.worker.append(device.zeros(s * w, np.float32))
            self.server.append(device.zeros(s, np.float32))
        self.key = key
        return True

    def advanced(self, step: int, exp_avg: Sequence[Array]) -> None:
        """The update of ``step`` ran: the buffers hold for the next one."""
        self.key = (step + 1, tuple(id(b) for b in exp_avg))


def gather_whole(layout: Layout, comm: Communicator, device: Device,
                 bufs: Sequence[Array]) -> list[Array]:
    """Each unit's whole vector on every rank (a collective), float32: the
    sharded leaves' in the (W, S) reduce layout, then the replicated ones'."""
    w, out = comm.world_size, []
    for unit, b in zip(layout.units, bufs, strict=True):
        s = unit.sharded_size
        x = device.empty(s * w + unit.replicated_size, np.float32)
        if s:
            comm.all_gather_into(x[:s * w], b[:s])
        x[s * w:] = b[s:]
        out.append(x)
    return out


def write_sections(layout: Layout, rank: int, wholes: Sequence[Array],
                   shards: Sequence[Array]) -> None:
    """This rank's sections of whole vectors (see :func:`gather_whole`) into
    its shards."""
    for unit, x, dst in zip(layout.units, wholes, shards, strict=True):
        s = unit.sharded_size
        dst[:s] = x[rank * s:(rank + 1) * s]
        dst[s:] = x[x.size - unit.replicated_size:]


class OneBitReducer(GradReducer):
    """1-bit Adam's steps after ``freeze_step`` (see [Note: 1-bit Adam] in
    ``ops/_onebit.py``): each rank sums its own gradients over the
    micro-batches, nothing is reduced during the backward, and :meth:`finish`
    folds them into the momentum, ``m = b1 m + (1 - b1) scale g``, which the
    ranks agree on through the compressed all-reduce (the replicated leaves'
    through an exact one). The shards it returns are this rank's sections of
    that momentum, for the optimizer's ``momentum=True`` update. With
    ``beta1=None`` (0/1 Adam's compressed gradients, see [Note: 0/1 Adam] in
    ``ops/_zeroone.py``) the ranks agree on ``scale g`` itself, and the shards
    are this rank's sections of that mean gradient."""

    def __init__(self, layout: Layout, comm: Communicator, *, dtype: DTypeLike, device: Device,
                 buffers: GradBuffers, plans: CopyPlans, momentum: OneBitMomentum,
                 beta1: float | None, scale: float, max_norm: float | None = None) -> None:
        check_float32(dtype)
        super().__init__(layout, comm, stage=1, dtype=dtype, device=device, buffers=buffers,
                         plans=plans)
        self.momentum, self.beta1 = momentum, None if beta1 is None else np.float32(beta1)
        # (1 - b1) x the mean's scale
        self.weight = np.float32((1.0 - (beta1 or 0.0)) * scale)
        self.scale, self.max_norm = scale, max_norm

    def _add(self, u: int, grads: Sequence[Grad | None]) -> None:
        self._accumulate(u, grads)

    def finish(self) -> list[Array]:
        mo, rank, w = self.momentum, self.comm.rank, self.comm.world_size
        mo.key = None  # they hold for the state again once its update ran (advanced)
        coef = None if self.max_norm is None else self._clip_coef(
            self._own_sumsq(self.scale), self.max_norm)
        for u, unit in enumerate(self.layout.units):
            s, shard = unit.sharded_size, self.shards[u]
            whole = mo.momentum[u] if self.beta1 is not None else None
            if s:
                m = self._fold(cast(list, self._full)[u], None if whole is None else
                               whole[:s * w], coef)
                with timed("reduce_wait"):
                    compressed_all_reduce(self.comm, m, mo.worker[u], mo.server[u])
                shard[:s] = m[rank * s:(rank + 1) * s]
            if unit.replicated_size:
                m = self._fold(shard[s:], None if whole is None else whole[s * w:], coef)
                with timed("reduce_wait"):
                    self.comm.all_reduce_(m, "mean")
                shard[s:] = m
        return self.shards

    def _fold(self, g: Array, m: Array | None, coef: Array | None) -> Array:
        """``g`` (a rank's gradient sums) scaled, clipped and folded into the
        momentum ``m`` in place, ``m = b1 m + (1 - b1) g``; with no momentum
        (0/1 Adam's compressed gradients) ``g`` itself, scaled."""
        g *= self.weight
        if coef is not None:
            g *= coef
        if m is None:
            return g
        m *= self.beta1
        m += g
        return m

    def drain(self) -> None:
        self.momentum.key = None  # a failed step: start again from the state's exp_avg


class LocalReducer(GradReducer):
    """0/1 Adam's local steps (see [Note: 0/1 Adam] in ``ops/_zeroone.py``):
    each rank sums its own gradients over the micro-batches and nothing is
    reduced. :meth:`finish` returns per unit this rank's mean gradient, whole:
    the sharded leaves' in the (W, S) reduce layout, then the replicated
    ones', float32, clipped by ``max_norm``; ``sumsq`` is then its sum of
    squares before the clip."""

    def __init__(self, layout: Layout, comm: Communicator, *, dtype: DTypeLike, device: Device,
                 buffers: GradBuffers, plans: CopyPlans, scale: float,
                 max_norm: float | None = None) -> None:
        check_float32(dtype)
        super().__init__(layout, comm, stage=1, dtype=dtype, device=device, buffers=buffers,
                         plans=plans)
        self.scale, self.max_norm = scale, max_norm

    def _add(self, u: int, grads: Sequence[Grad | None]) -> None:
        self._accumulate(u, grads)

    def finish(self) -> list[Array]:
        out = []
        self.sumsq = self._own_sumsq(self.scale)  # before the clip, as the norm reported
        coef = self._clip_coef(self.sumsq, self.max_norm)
        for u, unit in enumerate(self.layout.units):
            k = unit.sharded_size * self.comm.world_size
            whole = self.device.empty(k + unit.replicated_size, np.float32)
            whole[:k] = cast(list, self._full)[u]
            whole[k:] = self.shards[u][unit.sharded_size:]
            whole *= np.float32(self.scale)
            if coef is not None:
                whole *= coef
            out.append(whole)
        return out


class ZeroOneLocal:
    """0/1 Adam's local steps (:class:`ops._zeroone.LocalSteps`), kept by the
    step across steps. They hold for the state whose masters and step they
    were made or last updated with; any other state (a resumed one, one whose
    update failed) starts them again from its masters and moments, at its
    last synchronisation (see [Note: 0/1 Adam] in ``ops/_zeroone.py``)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.steps: LocalSteps | None = None

    def ready(self, layout: Layout, comm: Communicator, device: Device, spec: ZeroOne,
              masters: Sequence[Array], moments: Sequence[Sequence[Array]], step: int) -> bool:
        """Make the local steps hold for ``masters`` at ``step`` (a collective
        when they are made: the whole vectors are gathered from the shards);
        whether they were made (the compute params are then to be copied out
        of them)."""
        key = (step, tuple(id(b) for b in masters))
        if key == self.key and self.steps is not None:
            return False
        w = comm.world_size
        self.steps = LocalSteps(spec, comm, gather_whole(layout, comm, device, masters),
                                gather_whole(layout, comm, device, moments[0]),
                                gather_whole(layout, comm, device, moments[1]),
                                [u.sharded_size * w for u in layout.units])
        self.key = key
        return True

    def write(self, layout: Layout, rank: int, masters: Sequence[Array],
              exp_avg: Sequence[Array]) -> None:
        """This rank's sections of the synchronised params and momentum into the
        state's masters and ``exp_avg``."""
        steps = cast(LocalSteps, self.steps)
        write_sections(layout, rank, steps.params, masters)
        write_sections(layout, rank, steps.exp_avg, exp_avg)

    def advanced(self, step: int, masters: Sequence[Array]) -> None:
        """The update of ``step`` ran: the local steps hold for the next one."""
        self.key = (step + 1, tuple(id(b) for b in masters))


def check_float32(dtype: DTypeLike) -> None:
    """1-bit and 0/1 Adam compress float32 gradients."""
    if np.dtype(dtype) != np.float32:
        raise TypeError(f"onebit_adam and zero_one_adam: the gradients are reduced in "
                        f"{np.dtype(dtype)}; their compression takes float32 "
                        "(Precision(reduce_dtype='float32'))")
