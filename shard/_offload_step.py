"""The offloaded parts of a ZeRO step (see [Note: offload] in ``shard/_offload.py``):
the state's masters and moments made in host memory or in the disk tier, and the
update that runs there."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

import ops
from ops import AdamState
from shard._offload import KINDS, DiskTier, Offload
from shard._profile import timed

__all__ = ["OffloadPhase"]

log = logging.getLogger(__name__)


class OffloadPhase:
    """Offload methods of ``ZeroStep`` (which provides the attributes)."""

    offload: Offload | None
    layout: Any
    comm: Any
    device: Any
    stage: int
    optimizer: Any
    clip_norm: Any
    master_dtype: Any
    precision: Any
    _tier: DiskTier | None
    name: str
    state_from: Any
    _refresh: Any

    def _compute_on_host(self) -> bool:
        """Stage 3's compute shards in host memory (``Offload(params="host")``)."""
        return bool(self.offload and self.offload.params == "host" and not self.device.host)

    def _setup_offload(self) -> None:
        """The disk tier for this layout (host memory needs nothing)."""
        if self.offload is None or self.offload.optimizer != "disk":
            self._tier = None
            return
        sizes = [u.local_size for u in self.layout.units]
        tier = self._tier
        if tier is None or tier.sizes != sizes or tier.dtype != self.master_dtype:
            self._tier = DiskTier(self.offload, self.comm.rank, sizes, self.master_dtype)

    def _offloaded_init(self, leaves: list[Any], rank: int) -> Any:
        """``init``'s state with the masters scattered straight into host memory or
        the disk tier, one unit at a time."""
        def fill(u: int, kind: str, buf: Any) -> None:
            if kind != "master":
                return
            for i in self.layout.units[u].leaves:
                leaf = self.layout.leaves[i]
                x = leaves[i] if self.device.host else self.device.to_host(leaves[i])
                self.layout.scatter_leaf(leaf, x, rank, buf[
                    leaf.offset:leaf.offset + leaf.local_size].reshape(leaf.local_shape))

        *bufs, copies = self._offloaded_buffers(fill)
        log.info("%s: masters and moments offloaded to %s", self.name, self.offload.optimizer)
        return self.state_from(*bufs, full_leaves=leaves, copies=copies)

    def _offloaded_buffers(self, fill: Any) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        """Masters and moments where the policy keeps them, unit by unit, and the
        compute-dtype copy of each unit's masters (host arrays, for the device).

        ``fill(u, kind, buf)`` writes unit ``u``'s values of ``kind`` into the
        host buffer ``buf`` (zeros already); only one unit is in memory at a time
        for the disk tier.
        """
        compute_dtype = np.dtype(self.precision.param_dtype or self.master_dtype)
        copies = []
        if self._tier is None:  # host memory
            bufs = {k: [np.zeros(u.local_size, self.master_dtype) for u in self.layout.units]
                    for k in KINDS}
            for u in range(len(self.layout.units)):
                for k in KINDS:
                    fill(u, k, bufs[k][u])
                copies.append(_cast(bufs["master"][u], compute_dtype))
            return bufs["master"], bufs["exp_avg"], bufs["exp_avg_sq"], copies
        tier = self._tier
        path = tier.new_file()
        for u, unit in enumerate(self.layout.units):
            for k in KINDS:
                buf = np.zeros(unit.local_size, self.master_dtype)
                fill(u, k, buf)
                if k == "master":
                    copies.append(_cast(buf, compute_dtype))
                if buf.any():  # zeros are the file's (sparse) default
                    tier.write(path, k, u, buf)
        tier.finish(path)
        maps = tier.maps(path)
        return maps["master"], maps["exp_avg"], maps["exp_avg_sq"], copies

    def _apply_offloaded(self, state: Any, shards: list[Any], grad_scale: float,
                         grad_sumsq: Any) -> Any:
        """The update in host memory or streamed through the disk tier; the new
        compute-dtype params go back to the device. Returns the new state."""
        host_sumsq = None
        if grad_sumsq is not None:
            host_sumsq = np.asarray(self.device.to_host(grad_sumsq) if not self.device.host
                                    else grad_sumsq, np.float64).reshape(1)
            if not math.isfinite(float(host_sumsq[0])):
                return state  # skipped (see [Note: non-finite gradients])
        compute_dtype = np.dtype(state.meta.compute_dtype)
        separate = compute_dtype != np.dtype(state.meta.master_dtype)
        grads = [g if self.device.host else self.device.to_host(g) for g in shards]
        resident = self.stage == 3 and (self.device.host or state.meta.compute_on_host)
        if resident:  # the compute shards are host memory: the new params go straight in
            out = list(state.compute)
        else:
            out = [np.empty(u.local_size, compute_dtype) for u in self.layout.units]
        count = AdamState(state.step, (), ())

        def run(u: int, lo: int, hi: int, p: Any, m: Any, v: Any) -> None:
            copy = out[u][lo:hi]
            self.optimizer.apply((grads[u][lo:hi],), count._replace(mu=(m,), nu=(v,)), (p,),
                                 grad_scale=grad_scale, grad_sumsq=host_sumsq,
                                 max_norm=self.clip_norm, param_copies=(copy,) if separate
                                 else None, finite=True)
            if not separate:
                copy[...] = p

        with timed("optimizer"):
            if self._tier is None:
                for u, unit in enumerate(self.layout.units):
                    run(u, 0, unit.local_size, state.master[u], state.exp_avg[u],
                        state.exp_avg_sq[u])
            else:
                src = _file_of(state.master)
                new = self._tier.update(src, run)
                maps = self._tier.maps(new)
                self._tier.retire(src)
                state = state.replace(master=tuple(maps["master"]),
                                      exp_avg=tuple(maps["exp_avg"]),
                                      exp_avg_sq=tuple(maps["exp_avg_sq"]))
        if resident:
            return state
        on_device = [self.device.asarray(c) for c in out]  # explicit copies to a GPU
        if self.stage == 3:
            for dst, src in zip(state.compute, on_device, strict=True):
                dst[...] = src
            return state
        self._refresh(state, tuple(on_device))
        return state


def _cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return ops.cast(x, dtype) if x.dtype != dtype else x.copy()


def _file_of(bufs: Any) -> Path:
    for b in bufs:
        name = getattr(b, "filename", None)
        if name is not None:
            return Path(name)
    raise RuntimeError("this disk-tier state holds no file")
