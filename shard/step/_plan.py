"""What a step derives from its params: a :class:`Plan` (layouts, dtypes,
device), and the :class:`~shard.TrainState` over a plan's buffers.

``step.init(params)`` and ``shard.load(path, step, ...)`` make a plan from the
step's :class:`~shard.step._config.StepConfig` and the params (or their
shapes) and hand it to the step, which holds it; every state made with it
carries its key (``state.meta.origin``), by which the step knows its own states
and a checkpoint finds the step's plan (``plan_of``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

import ops
import ops._types
from ops import HOST, Communicator, Device
from shard.core._layout import Layout, alloc_units, make_layout, master_dtype_of, native_leaves
from shard.core._optim import ShardOptimizer, on_shards
from shard.core._policy import Precision
from shard.core._state import StateMeta, TrainState
from shard.core.losses._layered import Layered
from shard.offload._offloader import Offloader
from shard.step._checks import agree_on_layout
from shard.step._config import StepConfig
from shard.step._frozen import (
    Packing,
    frozen_leaves,
    gradient_layout,
    masters_in_compute,
    trainable_runs,
)
from shard.step.reduction._reduce import CopyPlans

if TYPE_CHECKING:
    import numpy.typing as npt

    from ops._types import Array

__all__ = ["Plan", "make_plan", "moment_buffers", "new_state", "plan_of"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_LARGE = 1 << 20  # params from which a dominant unit is worth a warning

log = logging.getLogger("shard.step")


_KEYS = itertools.count(1)
_PLANS: weakref.WeakValueDictionary[tuple[int, int], Plan] = weakref.WeakValueDictionary()


def _new_key() -> tuple[int, int]:
    """Unique in this process (a count) and, for states that travel, across
    processes and machines (64 random bits)."""
    return next(_KEYS), secrets.randbits(64)


def plan_of(state: TrainState) -> Plan | None:
    """The plan ``state`` was made with, while the step holding it lives (a
    state's metadata keeps only its key, ``meta.origin``); None for a state
    made elsewhere (another process, a step since collected)."""
    origin = state.meta.origin
    return None if origin is None else _PLANS.get(origin)


@dataclass(frozen=True, eq=False)
class Plan:
    """One step's layouts, dtypes and device for one params tree.

    Attributes:
      config: the step's configuration.
      layout: where each leaf lives in this rank's unit buffers.
      full_layout: the same leaves whole (one rank), for stages 0-2's compute
        params.
      master_dtype: the masters' and moments' dtype (float32, or float64 for
        float64 params).
      precision: the step's precision, with a 16-bit params tree's dtype as
        the compute dtype where none was given.
      device: where the state's buffers live.
      fast: the communicator without per-call argument checks (every rank's
        layout was found equal when the plan was made).
      copy_plans: the layout's run tables (see ``ops/device/_runs.py``).
      optimizer: the step's optimizer on this layout (its moments, and for an
        optax transformation the checked update; see [Note: optax on shards]).
      replica: the replicas' communicator without per-call checks, or None
        (see [Note: replicas]).
      model_whole: with tensor parallelism, the leaves (indices) that are
        whole on every model rank (see [Note: tensor parallelism with ZeRO]).
      secondary: with ``reshard_after_forward=L``, the node's and the
        counterparts' communicators without per-call checks (see [Note:
        secondary shards]), or None.
      frozen: the leaves (indices) that do not train (see [Note: frozen
        leaves]).
      runs: with frozen leaves, each unit's trainable ranges of its local
        buffer, which the optimizer updates; None without.
      packing: with frozen leaves, where those ranges live in the units'
        packed gradient buffers (and a fused optimizer's moment buffers);
        None without.
      grad_layout: the gradients' layout: ``layout``, or with frozen leaves
        the same leaves with the frozen ones of size zero, whose unit buffers
        are the packed trainable runs (see [Note: frozen leaves]).
      grad_plans: ``grad_layout``'s run tables.
    """

    config: StepConfig
    layout: Layout
    full_layout: Layout
    master_dtype: np.dtype
    precision: Precision
    device: Device
    fast: Communicator
    copy_plans: CopyPlans
    optimizer: ShardOptimizer
    grad_layout: Layout
    grad_plans: CopyPlans
    replica: Communicator | None = None
    model_whole: frozenset[int] = frozenset()
    secondary: tuple[Communicator, Communicator] | None = None
    frozen: frozenset[int] = frozenset()
    runs: tuple | None = None
    packing: Packing | None = None
    key: tuple[int, int] = dataclasses.field(init=False, default_factory=_new_key)

    def __post_init__(self) -> None:
        _PLANS[self.key] = self

    @property
    def moment_packing(self) -> Packing | None:
        """Where the moments' trainable runs live: packed for a fused optimizer
        with frozen leaves; an optax transformation keeps its state in the
        masters' layout, and so do the offload tiers."""
        return self.packing if self.optimizer.fused is not None and \
            self.config.offload is None else None

    @functools.cached_property
    def master_packing(self) -> Packing | None:
        """Where the masters' trainable runs live: packed where the frozen leaves
        keep no masters, their compute params holding them (see [Note: frozen
        leaves] and :func:`masters_in_compute`)."""
        c = self.config
        return self.packing if masters_in_compute(
            self.layout, self.frozen, stage=c.stage, compute_dtype=self.compute_dtype,
            master_dtype=self.master_dtype, fused=self.optimizer.fused is not None,
            offload=c.offload is not None) else None

    @functools.cached_property
    def refresh_plans(self) -> CopyPlans:
        """Stages 1-2's copy-out of the gathered masters (or their compute-dtype
        copies) into the whole compute params: the trainable leaves' alone
        where frozen leaves keep no masters (they are never gathered: the
        compute params hold them)."""
        if self.master_packing is None:
            return self.copy_plans
        return CopyPlans(self.grad_layout, self.full_layout)

    def packed_masters(self, master: Sequence[Array]) -> list:
        """Master unit buffers in the params' layout as this plan keeps them:
        the trainable runs alone where frozen leaves keep no masters."""
        packing = self.master_packing
        if packing is None:
            return list(master)
        return [packing.pack(u, m, self.device.empty(n, m.dtype))
                for u, (m, n) in enumerate(zip(master, packing.sizes, strict=True))]

    @property
    def compute_dtype(self) -> np.dtype:
        return np.dtype(self.precision.param_dtype or self.master_dtype)

    @property
    def reduce_dtype(self) -> np.dtype:
        """The gradients' dtype in their reduction and shards."""
        p = self.precision
        return np.dtype(p.reduce_dtype or p.param_dtype or self.master_dtype)

    @property
    def compute_on_host(self) -> bool:
        """Stage 3's compute shards in host memory (``Offload(params="host")``)."""
        off = self.config.offload
        return bool(off and off.params == "host" and not self.device.host)

    def on(self, device: Device) -> Plan:
        """This plan with its buffers on ``device``."""
        if self.optimizer.fused is None and not device.host:
            on_shards(self.optimizer.tx, self.layout, stage=self.config.stage,
                      master_dtype=self.master_dtype, device_host=False, offload=False,
                      fn=self.config.name)  # raises: optax runs on host state
        return dataclasses.replace(self, device=device)

    def packed_moments(self, moments: Sequence[Sequence[Array]]) -> list:
        """Moment unit buffers in the masters' layout (a checkpoint's) as this
        plan keeps them: packed where leaves are frozen."""
        packing = self.moment_packing
        if packing is None:
            return [list(bufs) for bufs in moments]
        return [[packing.pack(u, buf, self.device.empty(n, buf.dtype))
                 for u, (buf, n) in enumerate(zip(bufs, packing.sizes, strict=True))]
                for bufs in moments]

    def offloader(self) -> Offloader | None:
        """A fresh :class:`Offloader` for this plan's offloaded state, or None."""
        c = self.config
        if c.offload is None:
            return None
        return Offloader(c.offload, name=c.name, stage=c.stage, layout=self.layout,
                         device=self.device, master_dtype=self.master_dtype,
                         compute_dtype=self.compute_dtype, rank=c.comm.rank,
                         optimizer=c.optimizer, clip_norm=c.clip_norm, runs=self.runs,
                         packing=self.packing)


def make_plan(config: StepConfig, params: object, *, device: Device | None = None) -> Plan:
    """The plan for ``params`` (arrays or shapes), after checking that every rank
    made the same one (a collective). Arrays decide the device; for shapes,
    ``device`` does (default: the host)."""
    w, fn = config.comm.world_size, f"{config.name}.init"
    loss_fn = config.loss_fn
    loss_fn.claim(config.comm)  # a loss object that serves one rank binds to it
    found, _ = native_leaves(ops._types.tree_leaves(params), fn)
    layout = make_layout(params, config.specs, world_size=1 if config.stage == 0 else w,
                         units=config.units, min_num_params=config.min_num_params, fn=fn)
    if not layout.leaves:
        raise ValueError(f"{fn}: the params tree has no leaves: nothing to train")
    precision, master_dtype = _dtypes(config.precision, layout, fn)
    if isinstance(loss_fn, Layered) and len(loss_fn.layers) != len(layout.units):
        raise ValueError(f"{fn}: Layered has {len(loss_fn.layers)} layers but the "
                         f"params form {len(layout.units)} units "
                         f"({[u.name for u in layout.units]}); give one layer per unit")
    model_whole = _agreed(config, layout, params, fn)
    full_layout = make_layout(params, config.specs, world_size=1, units=config.units,
                              min_num_params=config.min_num_params)
    if config.stage == 3 and w > 1 and config.comm.rank == 0:
        _warn_if_one_unit_dominates(config.name, full_layout)
    where = found or device or HOST
    optimizer = on_shards(config.optimizer, layout, stage=config.stage, master_dtype=master_dtype,
                          device_host=where.host, offload=config.offload is not None, fn=fn)
    if config.invariant_shards and optimizer.reduces_leaves:
        raise NotImplementedError(f"{fn}: invariant_shards= does not compose with an optimizer "
                                  "that sums over whole leaves across the ranks (LAMB's trust "
                                  "ratio, Adafactor's block RMS)")
    frozen = frozen_leaves(config.trainable, loss_fn.frozen, params, fn)
    copy_plans = CopyPlans(layout, full_layout)
    grads = gradient_layout(layout, frozen)
    runs, packing = _frozen_runs(layout, frozen)
    secondary = config.topology.secondary
    return Plan(config, layout, full_layout, np.dtype(master_dtype), precision, where,
                fast=config.comm.unchecked(), copy_plans=copy_plans, optimizer=optimizer,
                grad_layout=grads,
                grad_plans=copy_plans if grads is layout else CopyPlans(grads, grads),
                replica=config.replicate.unchecked() if config.replicate is not None else None,
                model_whole=model_whole,
                secondary=(secondary[0].unchecked(), secondary[1].unchecked())
                if secondary else None,
                frozen=frozen, runs=runs, packing=packing)


def _dtypes(precision: Precision, layout: Layout, fn: str) -> tuple[Precision, np.dtype]:
    """The precision (16-bit params compute in their own dtype unless it says
    otherwise) and the masters' dtype, once the params are floating point and
    their dtypes agree with it."""
    for leaf in layout.leaves:
        if leaf.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{fn}: params{leaf.path} is {leaf.dtype}; ZeRO trains "
                            "floating-point params (float16, bfloat16, float32, float64): "
                            "keep integer, boolean and complex state out of params")
    dtypes = sorted({leaf.dtype for leaf in layout.leaves})
    if precision.param_dtype is None and {"float16", "bfloat16"} & set(dtypes):
        if len(dtypes) > 1:  # 16-bit params: compute in their dtype, if they agree
            raise ValueError(f"{fn}: the params mix dtypes {dtypes}; say which one the loss "
                             "computes in: precision=shard.Precision(param_dtype=...)")
        precision = dataclasses.replace(precision, param_dtype=dtypes[0])
    master_dtype = master_dtype_of(layout)
    if master_dtype == np.float64 and precision.param_dtype not in (None, np.dtype(np.float64)):
        raise NotImplementedError(f"{fn}: float64 params keep float64 masters, which mixed "
                                  "precision does not support; give float32 params or drop "
                                  "precision=")
    return precision, master_dtype


def _agreed(config: StepConfig, layout: Layout, params: object, fn: str) -> frozenset[int]:
    """Every rank of the data axis (and of the replicas' and the model ranks')
    made the same layout (a collective); returns the leaves each model rank
    holds whole (none without tensor parallelism)."""
    agree_on_layout(config.comm, layout, fn)
    if config.replicate is not None:  # every replica holds the same shards
        agree_on_layout(config.replicate, layout, fn)
    tp = config.tensor_parallel
    if tp is not None:  # every model rank holds slices of one shape
        agree_on_layout(tp.comm, layout, fn)
        return frozenset(i for i, d in enumerate(tp.dims(params, whole=False)) if d is None)
    return frozenset()


def _frozen_runs(layout: Layout, frozen: frozenset[int]) -> tuple:
    """``(runs, packing)`` for a layout with frozen leaves, else ``(None, None)``."""
    if not frozen:
        return None, None
    runs = trainable_runs(layout, frozen)
    return runs, Packing(runs)


def moment_buffers(plan: Plan) -> list[list[Any]]:
    """Zeroed moment buffers for a fused optimizer: per moment, per unit, the
    unit's local size, or its trainable runs' where leaves are frozen (see
    [Note: frozen leaves])."""
    if plan.moment_packing is None:
        return [alloc_units(plan.layout, plan.master_dtype, plan.device)
                for _ in plan.optimizer.moments]
    return [[plan.device.zeros(n, plan.master_dtype) for n in plan.moment_packing.sizes]
            for _ in plan.optimizer.moments]


# master, moments, full_leaves: Any: arrays of the plan's device (the first two kept in
# a TrainState, which types its buffers np.ndarray; a checkpoint's leaves may be None)
def new_state(plan: Plan, master: list[Any], moments: list[list[Any]], *,
              full_leaves: list[Any], opt_rest: tuple = (), step: int = 0,
              loss_scale: float | None = None, good_steps: int = 0, hysteresis: int | None = None,
              skips: npt.ArrayLike | None = None, batches: int = 0,
              copies: Sequence[Array] | None = None) -> TrainState:
    """A TrainState over the given master and moment buffers (``plan``'s layout;
    one list of unit buffers per ``plan.optimizer.moments``), and an optax
    state's other leaves ``opt_rest``.

    ``full_leaves`` are the whole params in leaf order (arrays of the plan's
    device), for the compute params stages 0-2 keep whole. ``copies``: an
    offloaded state's compute-dtype copy of each unit's masters (host arrays),
    which stage 3 keeps on the device.
    """
    c, device = plan.config, plan.device
    master_dtype = plan.master_dtype
    compute_dtype = plan.precision.param_dtype or master_dtype
    compute: tuple = ()
    if c.stage in (1, 2) or (c.stage == 0 and compute_dtype != master_dtype):
        full = alloc_units(plan.full_layout, compute_dtype, device)
        for leaf, x, dst in zip(plan.full_layout.leaves, full_leaves,
                                plan.full_layout.local_views(full), strict=True):
            plan.full_layout.scatter_leaf(leaf, x.astype(compute_dtype), 0, dst)
        compute = tuple(full)
    elif c.stage == 3 and copies is not None:
        compute = tuple(copies if plan.compute_on_host else (device.asarray(x) for x in copies))
    elif c.stage == 3 and compute_dtype != master_dtype:
        compute = tuple(ops.cast(m, compute_dtype) for m in master)
    master = plan.packed_masters(master)  # the compute params, made above, keep frozen leaves
    packed = plan.master_packing is not None
    meta = StateMeta(plan.layout, c.stage, c.comm.rank, plan.precision, str(master_dtype),
                     str(compute_dtype), device.name,
                     c.offload.optimizer if c.offload else None, plan.compute_on_host,
                     plan.optimizer.moments, plan.optimizer.opt_tree, plan.frozen,
                     plan.master_packing, plan.moment_packing,
                     plan.full_layout if packed and c.stage in (1, 2) else None,
                     c.loss_fn.module_state is not None,
                     c.replicate.world_size if c.replicate is not None else 1,
                     c.tensor_parallel.size if c.tensor_parallel is not None else 1, plan.key)
    if loss_scale is None:
        loss_scale = c.loss_scale.initial if c.loss_scale else 1.0
    if hysteresis is None:
        hysteresis = c.loss_scale.hysteresis if c.loss_scale else 1
    return TrainState(tuple(master), tuple(tuple(m) for m in moments), tuple(opt_rest), compute,
                      np.asarray(step, np.int64), np.asarray(loss_scale, np.float64),
                      np.asarray(good_steps, np.int64), np.asarray(hysteresis, np.int64),
                      np.zeros(len(plan.layout.leaves), np.int64) if skips is None else
                      np.asarray(skips, np.int64), meta, batches=np.asarray(batches, np.int64))


def _warn_if_one_unit_dominates(name: str, full_layout: Layout) -> None:
    """ZeRO-3 gathers a whole unit at a time: a unit that holds most of a large
    model's params bounds what sharding saves, silently otherwise."""
    total = full_layout.local_size()
    big = max(full_layout.units, key=lambda u: u.local_size)
    if total >= _LARGE and big.local_size > total / 2:
        log.warning("%s: unit %r holds %.0f%% of the %d params: ZeRO-3 gathers a whole unit at "
                    "a time, so every rank holds it whole in each step; split it with units= "
                    "(for a torch module, units=[its blocks])", name, big.name,
                    100 * big.local_size / total, total)
