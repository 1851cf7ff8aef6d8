"""ZeRO stages 0-3 as one code path: :class:`ZeroStep`.

``step = shard.zero3(loss_fn, optimizer=ops.adamw(1e-3), comm=comm)`` (see
``shard/_stages.py``) builds a :class:`ZeroStep`; ``state = step.init(params)``
partitions the params; ``state, metrics = step(state, batch)`` runs one
optimizer step (``shard.MicroBatches([b1, b2])`` is one step with gradient
accumulation; any other batch, lists included, is one micro-batch).

What each stage shards (the ZeRO paper's P_os, P_os+g, P_os+g+p):

| stage | masters + Adam moments | gradients kept                | compute params  |
|-------|------------------------|-------------------------------|-----------------|
| 0     | whole on every rank    | whole, all-reduced            | whole           |
| 1     | this rank's shard      | whole, reduce-scattered once  | whole           |
| 2     | this rank's shard      | shard, reduce-scattered early | whole           |
| 3     | this rank's shard      | shard, reduce-scattered early | shard; gathered |
|       |                        |                               | per unit        |

One step, in order (each a small function below):
1. for each micro-batch: gradients of the (loss-scaled) loss, unit by unit,
   handed to the GradReducer (stage 3: [Note: ZeRO-3 schedule]);
2. finish the reductions; the global sum of squares of the gradients and the
   mean loss in one all-reduce;
3. dynamic loss scaling: on inf/nan skip the step and back the scale off;
4. the fused optimizer on every unit's shard: unscale, clip, AdamW, and the
   compute-dtype copy of the new params, in one pass;
5. stages 1-2: all-gather the new compute params for the next step.

Every buffer lives on the device of the params given to ``init`` (numpy,
CuPy, or the stand-in of :mod:`ops.testing`; see [Note: devices]). The loss,
the sum of squares and the overflow flag stay device arrays; the step reads
them back once, as two numbers, when it must decide on the host (clipping or
loss scaling on: skip the step or not) and otherwise only when its metrics
are looked at.

[Note: non-finite gradients]
A step whose gradients hold an inf or a nan anywhere (on any rank) is skipped,
in every configuration: params, moments and the compute copy stay as they
were, ``metrics["skipped"]`` is True and a warning is logged. With a loss
scale the scale backs off as well (and no warning: overflow is expected
there). Where the host decides anyway (clipping, loss scaling, or stages 1-2
with a 16-bit compute copy, whose fresh copy buffers a skipped kernel would
leave unwritten) the step counter does not advance. Otherwise the fused kernel
reads the sum of squares on the device and skips there, so a GPU step still
reads nothing back: the counter advances (the learning-rate schedule and Adam's
bias correction count the skipped step), and ``skipped`` is known when the
metrics are looked at.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import numpy as np

import ops
import ops._tree
from ops import HOST, Communicator, Device, FusedAdam
from ops.device._dlpack import jax_view
from shard.core._gather import MicroBatches
from shard.core._layout import (
    Layout,
    Units,
    alloc_units,
    make_layout,
    master_dtype_of,
    native_leaves,
)
from shard.core._loss import JaxLoss, classify
from shard.core._policy import LossScale, Precision
from shard.core._state import StateMeta, TrainState
from shard.monitor._metrics import StepMetrics
from shard.monitor._profile import step_breakdown, timed
from shard.offload._offload import Offload
from shard.offload._step import OffloadPhase, check_offload
from shard.step._checks import StepChecks
from shard.step._eval import EvalPhase
from shard.step._reduce import CopyPlans, GradBuffers, GradReducer
from shard.step._runtime import LiveBytes
from shard.step._runtime import Units as UnitParams
from shard.step._update import UpdatePhase

__all__ = ["ZeroStep"]

log = logging.getLogger(__name__)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


class ZeroStep(UpdatePhase, OffloadPhase, EvalPhase, StepChecks):
    """A ZeRO train step; build it with :func:`zero0` ... :func:`zero3`."""

    def __init__(self, loss_fn: Any, *, stage: int, optimizer: FusedAdam, comm: Communicator,
                 specs: Any = None, units: Units = None, precision: Precision | None = None,
                 clip_norm: float | None = None, loss_scale: LossScale | None = None,
                 prefetch: int = 1, loggers: Any = (), offload: Offload | None = None) -> None:
        name = f"zero{stage}"
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3; got {stage!r}")
        if not isinstance(optimizer, FusedAdam):
            raise TypeError(f"{name}: optimizer must be an ops.adamw(...) or ops.adam(...); got "
                            f"{type(optimizer).__name__}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"{name}: comm must be an ops.Communicator (from ops.spawn or "
                            f"ops.init_from_env); got {type(comm).__name__}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"{name}: clip_norm must be > 0; got {clip_norm!r}")
        if prefetch < 0:
            raise ValueError(f"{name}: prefetch must be >= 0; got {prefetch}")
        check_offload(name, stage, offload, clip_norm)
        self.offload, self._tier = offload, None
        self.loggers = (loggers,) if callable(loggers) else tuple(loggers or ())
        for lg in self.loggers:
            if not callable(lg):
                raise TypeError(f"{name}: loggers must be callables (step, metrics), such as "
                                f"shard.CSVLogger; got {type(lg).__name__}")
        self.kind = classify(loss_fn)
        self.loss_fn = JaxLoss(loss_fn) if self.kind == "jax" else loss_fn
        if units is None:  # a loss object may know its model's units (interop.torch does)
            units = getattr(loss_fn, "units", None) if self.kind == "provider" else None
        self.stage, self.optimizer, self.comm = stage, optimizer, comm
        self.specs, self.units = specs, units
        self.precision = self._precision_arg = precision or Precision()
        self.clip_norm, self.loss_scale, self.prefetch = clip_norm, loss_scale, prefetch
        self.layout: Layout | None = None
        self.master_dtype = np.dtype(np.float32)
        self.full_layout: Layout | None = None
        self.tracker = LiveBytes()
        self._grad_store: GradBuffers | None = None
        self._plans: CopyPlans | None = None  # the layout's run tables (see ops/device/_runs.py)
        self.device: Device = HOST
        self.name = name

    # -- init -----------------------------------------------------------------
    def init(self, params: Any) -> TrainState:
        """Partition full ``params`` (the same on every rank) into this rank's state.

        Raises ValueError if the ranks' params differ (a checksum is compared):
        seed the model's initialisation identically on every rank.
        """
        self.setup(params)
        _, leaves = native_leaves(self.layout.treedef.flatten_up_to(params), f"{self.name}.init")
        leaves = [self.device.asarray(x) for x in leaves]
        self._agree_on_values(leaves)
        rank = self.comm.rank if self.stage > 0 else 0
        if self.offload is not None:  # masters and moments in host memory or on disk
            return self._offloaded_init(leaves, rank)
        master = alloc_units(self.layout, self.master_dtype, self.device)
        for leaf, x, dst in zip(self.layout.leaves, leaves,
                                self.layout.local_views(master), strict=True):
            self.layout.scatter_leaf(leaf, x, rank, dst)
        zeros = [alloc_units(self.layout, self.master_dtype, self.device) for _ in range(2)]
        state = self.state_from(master, *zeros, full_leaves=leaves)
        log.info("%s: %d units, %d of %d elements on rank %d", self.name, len(self.layout.units),
                 self.layout.local_size(), self.full_layout.local_size(), self.comm.rank)
        return state

    def setup(self, params: Any) -> None:
        """Build the layouts for ``params`` (arrays or shapes) and check that every
        rank built the same one; ``init`` and ``shard.load`` call this. Arrays
        decide the step's device; shapes keep the device it has."""
        w, fn = self.comm.world_size, f"{self.name}.init"
        if hasattr(self.loss_fn, "claim"):  # a loss object that serves one rank
            self.loss_fn.claim(self.comm)
        device, _ = native_leaves(self.layout_leaves(params), fn)
        layout = make_layout(params, self.specs, world_size=1 if self.stage == 0 else w,
                             units=self.units, fn=fn)
        if not layout.leaves:
            raise ValueError(f"{fn}: the params tree has no leaves: nothing to train")
        for leaf in layout.leaves:
            if leaf.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{fn}: params{leaf.path} is {leaf.dtype}; ZeRO trains "
                                "floating-point params (float16, bfloat16, float32, float64): "
                                "keep integer, boolean and complex state out of params")
        precision = self._precision_arg
        dtypes = sorted({leaf.dtype for leaf in layout.leaves})
        if precision.param_dtype is None and {"float16", "bfloat16"} & set(dtypes):
            if len(dtypes) > 1:  # 16-bit params: compute in their dtype, if they agree
                raise ValueError(f"{fn}: the params mix dtypes {dtypes}; say which one the loss "
                                 "computes in: precision=shard.Precision(param_dtype=...)")
            precision = Precision(param_dtype=dtypes[0], reduce_dtype=precision.reduce_dtype)
        master_dtype = master_dtype_of(layout)
        if master_dtype == np.float64 and precision.param_dtype not in (
                None, np.dtype(np.float64)):
            raise NotImplementedError(f"{fn}: float64 params keep float64 masters, which mixed "
                                      "precision does not support; give float32 params or drop "
                                      "precision=")
        if self.kind == "layered" and len(self.loss_fn.layers) != len(layout.units):
            raise ValueError(f"{fn}: Layered has {len(self.loss_fn.layers)} layers but the "
                             f"params form {len(layout.units)} units "
                             f"({[u.name for u in layout.units]}); give one layer per unit")
        self._agree_on_layout(layout)
        self.device = device or self.device
        self.layout, self.master_dtype, self.precision = layout, master_dtype, precision
        self._setup_offload()
        if hasattr(self.loss_fn, "cast_forward_inputs"):  # the torch adapter casts itself
            self.loss_fn.cast_forward_inputs = precision.cast_forward_inputs
        self.full_layout = make_layout(params, self.specs, world_size=1, units=self.units)
        self._plans = CopyPlans(layout, self.full_layout)

    @staticmethod
    def layout_leaves(params: Any) -> list[Any]:
        return ops._tree.tree_leaves(params)

    def state_from(self, master: list[Any], exp_avg: list[Any],
                   exp_avg_sq: list[Any], *, full_leaves: list[Any], step: int = 0,
                   loss_scale: float | None = None, good_steps: int = 0,
                   copies: list[Any] | None = None) -> TrainState:
        """A TrainState over the given master and moment buffers (this step's layout).

        ``full_leaves`` are the whole params in leaf order (arrays of the step's
        device), for the compute params stages 0-2 keep whole. ``copies``: an
        offloaded state's compute-dtype copy of each unit's masters (host
        arrays), which stage 3 keeps on the device.
        """
        master_dtype = self.master_dtype
        compute_dtype = self.precision.param_dtype or master_dtype
        compute: tuple = ()
        if self.stage in (1, 2) or (self.stage == 0 and compute_dtype != master_dtype):
            full = alloc_units(self.full_layout, compute_dtype, self.device)
            for leaf, x, dst in zip(self.full_layout.leaves, full_leaves,
                                    self.full_layout.local_views(full), strict=True):
                self.full_layout.scatter_leaf(leaf, x.astype(compute_dtype), 0, dst)
            compute = tuple(full)
        elif self.stage == 3 and copies is not None:
            compute = tuple(copies if self._compute_on_host() else
                            (self.device.asarray(c) for c in copies))
        elif self.stage == 3 and compute_dtype != master_dtype:
            compute = tuple(ops.cast(m, compute_dtype) for m in master)
        meta = StateMeta(self.layout, self.stage, self.comm.rank, self.precision,
                         str(master_dtype), str(compute_dtype), self.device.name,
                         self.offload.optimizer if self.offload else None,
                         self._compute_on_host(), getattr(self.loss_fn, "module_state", None))
        if loss_scale is None:
            loss_scale = self.loss_scale.initial if self.loss_scale else 1.0
        return TrainState(tuple(master), tuple(exp_avg), tuple(exp_avg_sq), compute,
                          np.asarray(step, np.int64), np.asarray(loss_scale, np.float64),
                          np.asarray(good_steps, np.int64), meta)

    # -- step -------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any, *,
                 tokens: int | None = None) -> tuple[TrainState, StepMetrics]:
        """One optimizer step. ``tokens``: how many tokens (or samples) this rank's
        ``batch`` holds, for ``metrics["tokens_per_s"]`` (this rank's rate)."""
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(
                tokens, (int, np.integer)) or tokens < 0):
            raise ValueError(f"{self.name}: tokens must be a count >= 0; got {tokens!r}")
        with step_breakdown() as b:  # see [Note: step profile]
            with timed("library", step=True):
                state, metrics = self._step(state, batch)
        split = b.split_ms()
        metrics.add(time_ms=split)
        if tokens is not None:
            metrics.add(tokens_per_s=1e3 * int(tokens) / max(split["step"], 1e-9))
        world = getattr(self.loss_fn, "norm_comm", self.comm)  # a pipeline's whole mesh
        for logger in self.loggers if world.rank == 0 else ():
            logger(int(state.step), metrics)
        return state, metrics

    def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, StepMetrics]:
        self._check_state(state)
        micro = list(batch) if isinstance(batch, MicroBatches) else [batch]
        for b in micro:
            self._check_batch(b)
        micro = [self._cast_inputs(b) for b in micro]
        state.donate()
        try:
            return self._run(state, micro)
        finally:
            self._end_overlap()  # the overlapped offload's threads, if it started them

    def _run(self, state: TrainState, micro: list[Any]) -> tuple[TrainState, StepMetrics]:
        scale = float(state.loss_scale)
        reducer = GradReducer(self.layout, self._fast, stage=self.stage,
                              dtype=self._reduce_dtype(), device=self.device,
                              buffers=self._grad_buffers(), plans=self._plans)
        units = self._unit_params(state)
        totals = self.device.zeros(2, np.float64)  # [sum of squares, sum of losses]
        w, k = self.comm.world_size, len(micro)
        grad_scale = 1.0 / (w * k * scale)
        overlap = self._start_overlap(state, reducer, grad_scale)
        with self._jax_placement():
            for i, b in enumerate(micro):
                reducer.final = i == len(micro) - 1
                totals[1:2] += self._on_device(self._grads(units, reducer, b, scale), "the loss")
        shards = reducer.finish()
        if overlap is not None:  # see [Note: overlapped offload]
            overlap.submit_rest()
            with timed("reduce_wait"):
                overlap.wait_copied()
        with timed("optimizer"):
            self._norm_and_loss(shards, totals)
        known = {"lr": float(self.optimizer.learning_rate(int(state.step))),
                 "loss_scale": scale, "skipped": False}

        def finish(host: np.ndarray) -> dict[str, float]:
            sumsq = float(host[0])
            norm = math.sqrt(sumsq) * grad_scale if math.isfinite(sumsq) else sumsq
            return {"loss": float(host[1]) / (w * k), "grad_norm": norm}

        fresh_copies = self.stage in (1, 2) and bool(state.compute) and (
            state.meta.compute_dtype != state.meta.master_dtype)
        if self.clip_norm is None and self.loss_scale is None and not fresh_copies:
            # Nothing to decide on the host: no read back until metrics are looked
            # at. The kernel reads the sum of squares on the device and skips the
            # update when it is not finite (see [Note: non-finite gradients]).
            del known["skipped"]

            def finish_and_flag(host: np.ndarray) -> dict[str, Any]:
                out = finish(host)
                out["skipped"] = not math.isfinite(float(host[0]))
                if out["skipped"]:
                    log.warning("%s: non-finite gradients (inf or nan) at step %d: the update "
                                "was skipped", self.name, int(state.step))
                return out

            state = self._apply(state, shards, grad_scale, totals[0:1])
            return (state.replace(step=np.asarray(int(state.step) + 1, np.int64)),
                    StepMetrics(known, totals, finish_and_flag, self.device.to_host))
        host = self.device.to_host(totals)  # the step's one read: skip it or not
        known.update(finish(host))
        finite = math.isfinite(float(host[0]))
        new_scale, good = scale, int(state.good_steps)
        if self.loss_scale is not None:
            new_scale, good = self.loss_scale.update(scale, good, finite)
        if finite:
            state = self._apply(state, shards, grad_scale,
                                totals[0:1] if self.clip_norm is not None else None)
        elif self.loss_scale is None:
            log.warning("%s: non-finite gradients (inf or nan) at step %d: the update was "
                        "skipped", self.name, int(state.step))
        known["skipped"] = not finite
        return state.replace(step=np.asarray(int(state.step) + finite, np.int64),
                             loss_scale=np.asarray(new_scale, np.float64),
                             good_steps=np.asarray(good, np.int64)), StepMetrics(known)

    def _on_device(self, x: Any, what: str) -> Any:
        """A loss (a number, or a torch, jax or device scalar) as a device array."""
        if isinstance(x, (int, float)):
            x = np.asarray(x, np.float64)
        return self.device.asarray(x, what=f"{self.name}: {what}").reshape(1)

    def _jax_placement(self) -> Any:
        """JAX computations over host state run on JAX's CPU device, even where
        JAX's default device is a GPU."""
        if not self.device.host or self.kind == "provider":
            return contextlib.nullcontext()
        import jax

        return jax.default_device(jax.devices("cpu")[0])

    def _grad_buffers(self) -> GradBuffers:
        """The gradient shards, kept across steps (see :class:`GradBuffers`)."""
        dtype, store = self._reduce_dtype(), self._grad_store
        if store is None or not store.serves(self.layout, dtype, self.device):
            store = self._grad_store = GradBuffers(self.layout, dtype, self.device)
        return store

    def _reduce_dtype(self) -> np.dtype:
        p = self.precision
        return np.dtype(p.reduce_dtype or p.param_dtype or self.master_dtype)

    def _unit_params(self, state: TrainState) -> UnitParams:
        local = list(state.compute) if self.stage == 3 and state.compute else list(state.master)
        full = list(state.compute) if self.stage in (1, 2) or (
            self.stage == 0 and state.compute) else (list(state.master) if self.stage == 0
                                                     else None)
        return UnitParams(self.layout, self._fast, stage=self.stage, device=self.device,
                          local=local, full=full,
                          full_layout=self.full_layout, prefetch=self.prefetch,
                          tracker=self.tracker, plans=self._plans)

    def _whole_params(self, units: UnitParams) -> Any:
        """Every unit gathered at once, as the params pytree (jax arrays for a JAX
        loss): what a monolithic loss needs."""
        n = len(self.layout.units)
        units.bounded = False
        leaves: list[Any] = [None] * len(self.layout.leaves)
        for u in range(n):
            for i, x in zip(self.layout.units[u].leaves, units.get(u, range(u + 1, n)),
                            strict=True):
                leaves[i] = jax_view(x) if self.kind == "jax" else x
        return self.layout.treedef.unflatten(leaves)

    # -- gradients ----------------------------------------------------------------
    def _grads(self, units: UnitParams, reducer: GradReducer, batch: Any, scale: float) -> Any:
        """Loss of one micro-batch (a number or a scalar array); its gradients (of
        loss * scale) go to ``reducer``."""
        if self.kind == "layered":
            return self.loss_fn.run_units(units, reducer, batch, scale)
        # Unit by unit: stage 3 within its memory bound, each reduction overlapped
        if hasattr(self.loss_fn, "run_units") and (
                getattr(self.loss_fn, "hooks_usable", lambda comm: True)(self.comm)):
            return self.loss_fn.run_units(units, reducer, batch, scale)
        n = len(self.layout.units)
        params = self._whole_params(units)
        kwargs = {"loss_scale": scale} if (self.loss_scale or self.kind == "jax") else {}
        with timed("compute"):
            loss, grads = self.loss_fn.value_and_grad(params, batch, **kwargs)
        del params
        flat = self.layout.treedef.flatten_up_to(grads)
        for u in reversed(range(n)):
            reducer.add(u, [flat[i] for i in self.layout.units[u].leaves])
        return loss
