"""Checks a ZeRO step makes before it changes anything (that every rank agrees on
the params and layout at init, and that a state and batch fit the step), and
the batch's cast to the compute dtype."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

import ops._tree
from ops.comm._collectives import all_gather_host
from shard.core._layout import Layout
from shard.core._state import TrainState

__all__ = ["StepChecks"]


class StepChecks:
    """The checking methods of ``ZeroStep`` (which provides the attributes)."""

    comm: Any
    device: Any
    name: str
    stage: int
    layout: Any
    kind: str
    precision: Any
    master_dtype: Any
    _fast: Any

    def _agree_on_values(self, leaves: list[Any]) -> None:
        digest = 1
        for x in leaves:  # on a GPU, an explicit copy to the host, once, at init
            host = np.ascontiguousarray(x if self.device.host else self.device.to_host(x))
            digest = zlib.adler32(host.view(np.uint8).reshape(-1), digest)
        every = all_gather_host(self.comm, np.array([digest], np.int64))
        if np.any(every != every[0]):
            bad = [r for r, d in enumerate(every.tolist()) if d != int(every[0])]
            raise ValueError(f"{self.name}.init: the params on rank(s) {bad} differ from rank "
                             "0's; seed the model's initialisation identically on every rank "
                             "(thread ranks share torch's global RNG: build the model once and "
                             "deepcopy it)")

    def _agree_on_layout(self, layout: Layout) -> None:
        mine = np.array([layout.fingerprint()], np.int64)
        every = all_gather_host(self.comm, mine)
        if np.any(every != mine[0]):
            bad = [r for r, f in enumerate(every.tolist()) if f != int(mine[0])]
            raise ValueError(f"{self.name}.init: rank(s) {bad} built a different layout than rank "
                             f"{self.comm.rank} (params shapes, dtypes, specs or units differ); "
                             "every rank must init with the same params")
        self._fast = self.comm.unchecked()

    def _check_batch(self, batch: Any) -> None:
        """An empty batch would give a nan loss (a mean over nothing) silently."""
        tu = ops._tree.tree_util()
        for path, x in tu.tree_flatten_with_path(batch)[0]:
            shape = getattr(x, "shape", None)
            if shape is not None and len(shape) > 0 and shape[0] == 0:
                raise ValueError(f"{self.name}: batch{tu.keystr(path)} has no rows (shape "
                                 f"{tuple(shape)}) on rank {self.comm.rank}; every rank needs a "
                                 "non-empty part of the batch")

    def _cast_inputs(self, batch: Any) -> Any:
        """A JAX loss's batch with its floating arrays in the compute dtype (see
        ``Precision.cast_forward_inputs``; a torch module casts in its forward)."""
        p = self.precision
        jax_batch = self.kind != "provider" or getattr(self.loss_fn, "jax_batch", False)
        if (not jax_batch or not p.cast_forward_inputs or p.param_dtype is None
                or p.param_dtype == self.master_dtype):
            return batch

        def cast(x: Any) -> Any:
            dtype = getattr(x, "dtype", None)
            if dtype is None or not hasattr(x, "astype"):
                return x
            d = np.dtype(dtype)
            return x.astype(p.param_dtype) if d.kind == "f" and d != p.param_dtype else x

        return ops._tree.tree_map(cast, batch)

    def _check_state(self, state: TrainState) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"{self.name}: expected the TrainState from {self.name}.init; got "
                            f"{type(state).__name__}")
        if self.layout is None:
            raise RuntimeError(f"{self.name}: call init(params) before stepping")
        m = state.meta
        if m.stage != self.stage or m.layout != self.layout or m.rank != self.comm.rank:
            raise ValueError(
                f"{self.name}: this TrainState was made for stage {m.stage}, rank {m.rank} of "
                f"{m.layout.world_size if m.stage else 'any'} ranks, but this step is stage "
                f"{self.stage} on rank {self.comm.rank} of {self.comm.world_size}; load it "
                "through shard.load to re-shard, or init a new state")
        if m.device != self.device.name:
            raise ValueError(f"{self.name}: this TrainState lives on {m.device} but the step was "
                             f"set up for {self.device.name} params; load it onto this device "
                             "with shard.load(..., device=), or init a new state")
