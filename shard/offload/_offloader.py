"""The offloaded parts of a ZeRO step (see [Note: offload] in ``shard/offload/_offload.py``):
the state's masters and moments made in host memory or in the disk tier, and the
update that runs there."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

import ops
from ops import AdamState
from shard.monitor._profile import timed
from shard.offload._offload import KINDS, DiskTier, Offload
from shard.offload._overlap import HostStaging, OverlappedUpdate, Spare

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ops import Device, FusedOptimizer
    from ops._types import Array
    from shard.core._layout import Layout
    from shard.core._state import Packing, TrainState
    from shard.offload._overlap import Reducing

    # one unit's host buffers: masters, first and second moments, compute-dtype copy
    _Bufs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

__all__ = ["Offloader", "check_offload", "check_offload_device"]

log = logging.getLogger(__name__)


def check_offload(name: str, stage: int, offload: object, clip_norm: float | None) -> None:
    """``zero1``-``zero3``'s ``offload=`` argument, before anything is built."""
    if offload is None:
        return
    if not isinstance(offload, Offload):
        raise TypeError(f"{name}: offload must be a shard.Offload(...); got "
                        f"{type(offload).__name__}")
    if stage == 0:
        raise ValueError(f"{name}: offload is for stages 1-3 (stage 0 keeps everything whole "
                         "on every rank); use zero1, zero2 or zero3")
    if offload.params == "host" and stage != 3:
        raise ValueError(f"{name}: Offload(params='host') is for stage 3 (stages 1-2 keep "
                         "whole compute params on the device for the step); use zero3")
    if offload.overlap and clip_norm is not None:
        raise ValueError(f"{name}: clip_norm needs the global norm before any update, and "
                         "Offload(overlap=True) updates during the backward; drop one of them")


def check_offload_device(name: str, offload: Offload, device: Device) -> None:
    """What the offload does not run on a GPU (see [Note: offload on a GPU] in
    ``shard/offload/_offload.py``), refused before anything is built."""
    if device.name != "cupy":
        return
    what = ("Offload(overlap=True)" if offload.overlap else
            "Offload(params='host')" if offload.params == "host" else None)
    if what is not None:
        raise NotImplementedError(
            f"{name}: {what} on a CUDA device is refused: on an H100 its bfloat16 "
            "trajectory differed from the unoffloaded step's, differently from run to run "
            "(the same under CUDA_LAUNCH_BLOCKING=1), a race between the device's queued "
            f"work and the memory handed to it. Offload({offload.optimizer!r}) without it "
            "matched the unoffloaded step there (in float32)")


class Offloader:
    """An offloaded state's buffers and update, for one layout (see [Note:
    offload]): the disk tier's generation files, the host buffers for what
    crosses the bus, and the overlapped update's spare set (see [Note:
    overlapped offload]), kept from step to step."""

    def __init__(self, policy: Offload, *, name: str, stage: int, layout: Layout,
                 device: Device, master_dtype: DTypeLike, compute_dtype: DTypeLike, rank: int,
                 optimizer: FusedOptimizer, clip_norm: float | None,
                 runs: tuple[tuple[tuple[int, int], ...], ...] | None = None,
                 packing: Packing | None = None) -> None:
        check_offload_device(name, policy, device)
        self.policy, self.name, self.stage, self.layout = policy, name, stage, layout
        # with frozen leaves: each unit's trainable ranges, and where their
        # gradients lie in the packed gradient shards (see [Note: frozen leaves])
        self.runs, self.packing = runs, packing
        self.device, self.rank = device, rank
        self.master_dtype, self.compute_dtype = np.dtype(master_dtype), np.dtype(compute_dtype)
        self.optimizer, self.clip_norm = optimizer, clip_norm
        self.tier = None if policy.optimizer != "disk" else DiskTier(
            policy, rank, [u.local_size for u in layout.units], self.master_dtype)
        self.host_staging: HostStaging | None = None
        self.spare: Spare | None = None
        self.overlap: OverlappedUpdate | None = None

    def init_buffers(self, values: Callable[[int], Sequence[Array]], rank: int
                     ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray],
                                list[np.ndarray]]:
        """``init``'s masters (scattered straight into host memory or the disk tier,
        one unit at a time: ``values(u)`` gives unit ``u``'s whole leaves), zero
        moments, and the masters' compute-dtype copies."""
        def fill(u: int, kind: str, buf: np.ndarray) -> None:
            if kind != "master":
                return
            for i, x in zip(self.layout.units[u].leaves, values(u), strict=True):
                leaf = self.layout.leaves[i]
                x = x if self.device.host else self.device.to_host(x)
                self.layout.scatter_leaf(leaf, x, rank, buf[
                    leaf.offset:leaf.offset + leaf.local_size].reshape(leaf.local_shape))

        out = self.buffers(fill)
        log.info("%s: masters and moments offloaded to %s", self.name, self.policy.optimizer)
        return out

    def buffers(self, fill: Callable[[int, str, np.ndarray], None]
                ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray],
                           list[np.ndarray]]:
        """Masters and moments where the policy keeps them, unit by unit, and the
        compute-dtype copy of each unit's masters (host arrays, for the device).

        ``fill(u, kind, buf)`` writes unit ``u``'s values of ``kind`` into the
        host buffer ``buf`` (zeros already); only one unit is in memory at a time
        for the disk tier.
        """
        copies = []
        if self.tier is None:  # host memory
            bufs = {k: [np.zeros(u.local_size, self.master_dtype) for u in self.layout.units]
                    for k in KINDS}
            for u in range(len(self.layout.units)):
                for k in KINDS:
                    fill(u, k, bufs[k][u])
                copies.append(_cast(bufs["master"][u], self.compute_dtype))
            return bufs["master"], bufs["exp_avg"], bufs["exp_avg_sq"], copies
        tier = self.tier
        path = tier.new_file()
        for u, unit in enumerate(self.layout.units):
            for k in KINDS:
                buf = np.zeros(unit.local_size, self.master_dtype)
                fill(u, k, buf)
                if k == "master":
                    copies.append(_cast(buf, self.compute_dtype))
                if buf.any():  # zeros are the file's (sparse) default
                    tier.write(path, k, u, buf)
        tier.finish(path)
        maps = tier.maps(path)
        return maps["master"], maps["exp_avg"], maps["exp_avg_sq"], copies

    def apply(self, state: TrainState, shards: list[Array], grad_scale: float,
              grad_sumsq: Array | None) -> tuple[TrainState, tuple[Array, ...] | None]:
        """The update in host memory or streamed through the disk tier. Returns the
        new state, and the new compute-dtype params (device arrays) that stages
        1-2 still gather into their whole compute params, else None."""
        host_sumsq = None
        if grad_sumsq is not None:
            host_sumsq = np.asarray(self.device.to_host(grad_sumsq) if not self.device.host
                                    else grad_sumsq, np.float64).reshape(1)
            if not math.isfinite(float(host_sumsq[0])):
                return state, None  # skipped (see [Note: non-finite gradients])
        resident = self._resident(state)
        staging = self._staging(state, shards)
        overlap = self.overlap
        with timed("optimizer"):
            if overlap is not None:  # see [Note: overlapped offload]
                overlap.wait_updated()
                state = self._commit(state, overlap.spare, resident)
                out = cast(list, overlap.spare.compute) if resident else staging.out
            else:
                grads = [g if self.device.host else self.device.to_host_into(g, staging.grads[u])
                         for u, g in enumerate(shards)]
                out = list(state.compute) if resident else staging.out
                state = self._update_units(state, grads, out, grad_scale, host_sumsq)
            if resident:
                return state, None
            if self.stage == 3:  # the shard the next all-gather sends
                for dst, src in zip(state.compute, out, strict=True):
                    self.device.from_host_into(dst, src)
                return state, None
        return state, tuple(self.device.asarray(c) for c in out)

    def _resident(self, state: TrainState) -> bool:
        """Stage 3's compute shards are host memory: new params go straight in."""
        return self.stage == 3 and (self.device.host or state.meta.compute_on_host)

    def _staging(self, state: TrainState, shards: list[Array]) -> HostStaging:
        """Host buffers for what crosses the bus: gradients from a device, and new
        compute params wherever the compute shards are not host memory."""
        sizes = [u.local_size for u in self.layout.units]
        grad_sizes = [g.size for g in shards]  # the trainable leaves' (see [Note: frozen leaves])
        grad_dtype = None if self.device.host else shards[0].dtype
        out_dtype = None if self._resident(state) else np.dtype(state.meta.compute_dtype)
        if self.host_staging is None or not self.host_staging.fits(sizes, grad_dtype, out_dtype,
                                                                   grad_sizes):
            self.host_staging = HostStaging.make(self.device, sizes, grad_dtype, out_dtype,
                                                 grad_sizes)
        return self.host_staging

    def _unit_update(self, state: TrainState, grad_scale: float,
                     host_sumsq: np.ndarray | None) -> Callable[..., None]:
        """``run(u, lo, grad, p, m, v, copy, read_from=None)``: the kernel on unit
        ``u``'s host buffers from element ``lo`` (the whole unit, or a chunk of
        it: ``p``, ``m``, ``v`` and ``copy`` are views of the same elements),
        reading ``grad``, the unit's whole gradient shard, and writing the new
        compute-dtype params into ``copy``; with ``read_from=(p0, m0, v0)``,
        out of place. With frozen leaves the kernel runs on the trainable
        ranges alone; the frozen ones keep their values (copied over, out of
        place) and their compute-dtype copies."""
        separate = np.dtype(state.meta.compute_dtype) != np.dtype(state.meta.master_dtype)
        count = AdamState(state.step, (), ())

        def kernel(grads: tuple[Array, ...], p: tuple[np.ndarray, ...],
                   m: tuple[np.ndarray, ...], v: tuple[np.ndarray, ...],
                   copy: tuple[np.ndarray, ...],
                   read_from: tuple[tuple[np.ndarray, ...], ...] | None) -> None:
            self.optimizer.apply(grads, count._replace(mu=m, nu=v), p,
                                 grad_scale=grad_scale, grad_sumsq=host_sumsq,
                                 max_norm=self.clip_norm, param_copies=copy if separate
                                 else None, finite=True, read_from=read_from)

        def run(u: int, lo: int, grad: Array, p: np.ndarray, m: np.ndarray, v: np.ndarray,
                copy: np.ndarray,
                read_from: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
            hi = lo + p.size
            if self.runs is None:
                kernel((grad[lo:hi],), (p,), (m,), (v,), (copy,),
                       None if read_from is None else tuple((x,) for x in read_from))
            else:
                _trainable_update(kernel, self.runs[u], self.packing, u, lo, hi, grad,
                                  (p, m, v, copy), read_from, separate)
            if not separate:
                copy[...] = p

        return run

    def _update_units(self, state: TrainState, grads: list[Array], out: list[np.ndarray],
                      grad_scale: float, host_sumsq: np.ndarray | None) -> TrainState:
        run = self._unit_update(state, grad_scale, host_sumsq)
        if self.tier is None:
            for u in range(len(self.layout.units)):
                run(u, 0, grads[u], state.master[u], state.exp_avg[u], state.exp_avg_sq[u],
                    out[u])
            return state
        src = _file_of(state.master)
        new = self.tier.update(src, lambda u, lo, hi, p, m, v: run(
            u, lo, grads[u], p, m, v, out[u][lo:hi]))
        maps = self.tier.maps(new)
        self.tier.retire(src)
        return state.replace(master=tuple(maps["master"]),
                             moments=(tuple(maps["exp_avg"]), tuple(maps["exp_avg_sq"])))

    # -- overlap (see [Note: overlapped offload]) -----------------------------------
    def start_overlap(self, state: TrainState, reducer: Reducing,
                      grad_scale: float) -> OverlappedUpdate | None:
        """The step's :class:`OverlappedUpdate` (handed each unit's reduction by
        ``reducer``), or None where the policy does not overlap."""
        if not self.policy.overlap:
            return None
        resident = self._resident(state)
        spare = self.spare
        if spare is None or not spare.fits(state, resident):
            spare = self.spare = Spare.like(state, resident)
        staging = self._staging(state, reducer.shards)
        run = self._unit_update(state, grad_scale, None)
        copy_out = cast(list, spare.compute) if resident else staging.out  # resident: shards

        def run_unit(u: int, grad: np.ndarray, spare: Spare) -> None:
            run(u, 0, grad, spare.master[u], spare.exp_avg[u], spare.exp_avg_sq[u],
                copy_out[u], read_from=(state.master[u], state.exp_avg[u],
                                        state.exp_avg_sq[u]))

        self.overlap = OverlappedUpdate(self.device, reducer.shards, staging, spare, run_unit)
        reducer.on_final = self.overlap.submit
        return self.overlap

    def end_overlap(self) -> None:
        if self.overlap is not None:
            self.overlap.close()
            self.overlap = None

    def _commit(self, state: TrainState, spare: Spare, resident: bool) -> TrainState:
        """The spare set becomes the state's; the old set the next step's spare."""
        old = Spare(list(state.master), list(state.exp_avg), list(state.exp_avg_sq),
                    list(state.compute) if resident else None)
        changes = {"master": tuple(spare.master),
                   "moments": (tuple(spare.exp_avg), tuple(spare.exp_avg_sq))}
        if resident:
            changes["compute"] = tuple(cast(list, spare.compute))  # resident: its shards
        self.spare = old
        return state.replace(**changes)


def _trainable_update(kernel: Callable[..., None], runs: tuple[tuple[int, int], ...],
                      # Any: the Offloader's Packing, None only where runs is
                      packing: Any, u: int, lo: int, hi: int, grad: Array, bufs: _Bufs,
                      read_from: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
                      separate: bool) -> None:
    """The kernel on the trainable ranges of unit ``u``'s elements [lo, hi)
    (``bufs``: the masters', moments' and copy's views of them); the frozen
    ranges keep their masters and moments (copied from ``read_from`` out of
    place) and get their compute-dtype copies (see [Note: frozen leaves])."""
    parts = [(max(a, lo), min(b, hi)) for a, b in runs if a < hi and b > lo]
    ends = [lo, *(x for part in parts for x in part), hi]
    gaps = [(a - lo, b - lo) for a, b in zip(ends[::2], ends[1::2], strict=True) if b > a]
    p, m, v, copy = bufs
    for a, b in gaps:  # the frozen ranges
        if read_from is not None:  # out of place: as they were
            for dst, src in zip((p, m, v), read_from, strict=True):
                dst[a:b] = src[a:b]
        if separate:  # their compute-dtype copies
            ops.cast(p[a:b], copy.dtype, out=copy[a:b])
    if parts:
        def local(x: np.ndarray) -> tuple[np.ndarray, ...]:
            return tuple(x[a - lo:b - lo] for a, b in parts)

        kernel(tuple(grad[slice(*packing.where(u, a, b))] for a, b in parts), local(p),
               local(m), local(v), local(copy),
               None if read_from is None else tuple(local(x) for x in read_from))


def _cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return ops.cast(x, dtype) if x.dtype != dtype else x.copy()


def _file_of(bufs: Sequence[np.ndarray]) -> Path:
    for b in bufs:
        name = getattr(b, "filename", None)
        if name is not None:
            return Path(name)
    raise RuntimeError("this disk-tier state holds no file")
