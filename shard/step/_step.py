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

One step, in order (the part that does each in brackets):
1. for each micro-batch: gradients of the (loss-scaled) loss, unit by unit,
   handed to the GradReducer (``_grads.py``, ``reduction/``; stage 3:
   [Note: ZeRO-3 schedule] in ``_runtime.py``);
2. finish the reductions; the global sum of squares of the gradients and the
   mean loss in one all-reduce (``_update.norm_and_loss``);
3. dynamic loss scaling: on inf/nan skip the step and back the scale off
   (:meth:`ZeroStep._advance_on_host`, below);
4. the fused optimizer on every unit's shard: unscale, clip, AdamW, and the
   compute-dtype copy of the new params, in one pass (``_update.apply``, or
   the :class:`~shard.offload._offloader.Offloader` where the masters are
   offloaded);
5. stages 1-2: all-gather the new compute params for the next step
   (``_update.refresh``).

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

[Note: failed steps]
A step changes nothing of the state it is given until its gradients are
reduced and their norm is known. Before that come the checks (the state,
every micro-batch, and this step's learning rate: a schedule's nan or
negative value is refused here), then every micro-batch's forward and
backward and the reductions, which write only into the step's own buffers.
An exception there (a loss that raises, a batch that does not fit, a
collective that fails on every rank) waits for the step's collectives still
in flight and leaves the state valid: step it again, and the run goes on as
one that never saw the failure. From the update on, the state is donated (its
buffers are reused), and a failure there leaves it refused
(``DonatedStateError``) rather than half updated.

"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ops import HOST, Device, FusedOptimizer
from ops._optim import OneBit, ZeroOne
from ops._zeroone import LocalSteps, synchronises, updates_variance
from shard.core._gather import MicroBatches
from shard.core._layout import Layout
from shard.core._mesh import Topology
from shard.core._policy import Precision
from shard.core._state import TrainState
from shard.monitor._flops import FlopCount
from shard.monitor._metrics import StepMetrics
from shard.monitor._profile import step_breakdown, timed
from shard.offload._offloader import Offloader
from shard.step import _checks, _grads, _init, _ordered, _update
from shard.step._config import StepConfig, ZeroOptions
from shard.step._ordered import OrderedReducer
from shard.step._plan import Plan, plan_of
from shard.step._runtime import LiveBytes
from shard.step.reduction._compressed import Compressed, LocalReducer, OneBitMomentum, ZeroOneLocal
from shard.step.reduction._reduce import GradBuffers

if TYPE_CHECKING:
    from ops._types import Array

__all__ = ["ZeroStep"]

log = logging.getLogger(__name__)
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(StepConfig))


@dataclasses.dataclass
class _Reduced:
    """The gradient phase's result (steps 1-2), what the update reads."""

    shards: list[Array]  # each unit's reduced gradient shard
    totals: Array  # on the device: the sum of squares, the loss, the rows (see _update)
    skip: frozenset[int]  # leaves no micro-batch gave a gradient on any rank
    aux: Any  # the mean aux, with has_aux
    model_state: Any  # the new model state, or None
    onebit: Compressed | None  # what a compressed phase of the 1-bit family sent
    grad_scale: float  # the gradients' factor: 1 / (divide factor x micro-batches x scale)
    parts: int  # the losses summed: ranks x micro-batches


class ZeroStep:
    """A ZeRO train step; build it with :func:`zero0` ... :func:`zero3`.

    It holds its frozen configuration (``step.config``) and calls the step's
    parts with explicit inputs: the checks (``_checks.py``), the gradient phase
    (``_grads.py``, ``reduction/``, ``_runtime.py``), the update
    (``_update.py``, or ``shard/offload/``'s :class:`Offloader`) and
    evaluation (``_grads.py``). What it derives from the params, a
    :class:`~shard.step._plan.Plan`, comes with each state (``init`` and
    ``shard.load`` make it); what it keeps between steps are buffers only.
    """

    def __init__(self, loss_fn: object, *, stage: int, optimizer: object, topology: Topology,
                 options: ZeroOptions | None = None, tensor_parallel: object = None) -> None:
        self.config = StepConfig.make(loss_fn, stage=stage, optimizer=optimizer,
                                      topology=topology, options=options or ZeroOptions(),
                                      tensor_parallel=tensor_parallel)
        self.tracker = LiveBytes()  # live gathered bytes (stage 3's memory bound)
        self._plan: Plan | None = None
        self._grad_buffers: GradBuffers | None = None
        self._offloader: Offloader | None = None
        self.model_state_like: Any = None  # init's model_state: what shard.load restores
        self._flops = FlopCount()  # see [Note: model FLOPs]

    def __getattr__(self, name: str) -> Any:
        """The configuration's fields as the step's (``step.stage``,
        ``step.optimizer``, ``step.offload``...), as DeepSpeed's engine shows them."""
        config = self.__dict__.get("config")
        if config is not None and name in _CONFIG_FIELDS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        if name in _CONFIG_FIELDS:
            raise AttributeError(f"{self.name}: the step's {name} is part of its frozen "
                                 f"configuration; build a new step with {name}=...")
        object.__setattr__(self, name, value)

    @property
    def plan(self) -> Plan | None:
        """The plan of the last state this step made or ran (None before ``init``)."""
        return self._plan

    @property
    def layout(self) -> Layout | None:
        return self._plan.layout if self._plan else None

    @property
    def device(self) -> Device:
        return self._plan.device if self._plan else HOST

    @property
    def precision(self) -> Precision:
        return self._plan.precision if self._plan else self.config.precision

    # -- init -----------------------------------------------------------------
    def init(self, params: object, *, model_state: object = None, opt_state: object = None,
             device: Device | None = None) -> TrainState:
        """Partition full ``params`` (the same on every rank) into this rank's state.

        ``model_state``: a JAX loss's non-trainable state (batch-norm
        statistics: flax nnx ``BatchStat``, equinox ``State``, any pytree of
        arrays), the same on every rank; the loss then takes it as a third
        argument and returns the new one (see [Note: model state]).

        ``opt_state``: an optax optimizer's state for the whole ``params``
        (``tx.init(params)`` after any number of updates: ``optax.adamw``'s
        for ``ops.adamw``, or the optax transformation's own), to continue
        from; its count becomes the state's step, so Adam's bias correction
        and the schedule go on where they were.

        ``params`` may also be shapes only: those of a torch module built on the
        meta device (``interop.torch.functional`` materialises it one unit at a
        time, see [Note: meta-device init]); ``device`` is then where the state
        lives (default: the module's, else the host).

        Raises ValueError if the ranks' params differ (a checksum is compared):
        seed the model's initialisation identically on every rank.
        """
        if model_state is not None:
            model_state = _checks.model_state(self.config, model_state)
            self.model_state_like = model_state
        state, plan, offloader = _init.from_params(self.config, params, device, self.device)
        self.use_plan(plan, offloader)
        if opt_state is not None:
            state = _init.with_optax_state(self.config, plan, state, opt_state)
        return state if model_state is None else state.replace(model_state=model_state)

    def init_from(self, init_fn: Callable[..., object], *args: object,
                  device: Device | None = None) -> TrainState:
        """This rank's state from ``init_fn(*args)``, a JAX function returning the
        params (``model.init`` with its key and inputs, say), without holding
        them whole: each rank computes one unit's leaves at a time (``jax.jit``
        of ``init_fn`` keeping only that unit's outputs) and keeps its shards,
        so the peak is its state plus one unit, as ``zero.Init`` and FSDP2's
        meta-device init give. Every rank must pass the same ``args`` (the same
        key); the values do not depend on the world size.

        Examples:
          >>> import jax, jax.numpy as jnp, ops, shard
          >>> def init_fn(key):
          ...     k1, k2 = jax.random.split(key)
          ...     return {"w": jax.random.normal(k1, (8, 4)), "b": jnp.zeros(4)}
          >>> def loss(p, x):
          ...     return jnp.mean((x @ p["w"] + p["b"]) ** 2)
          >>> def run(comm):
          ...     step = shard.zero3(loss, optimizer=ops.adam(1e-2), comm=comm)
          ...     state = step.init_from(init_fn, jax.random.key(0))
          ...     return [m.size for m in state.master]  # b's and w's units: half each
          >>> ops.spawn(run, 2)
          [[2, 16], [2, 16]]
        """
        state, plan, offloader = _init.from_function(self.config, init_fn, args, device)
        self.use_plan(plan, offloader)
        return state

    def use_plan(self, plan: Plan, offloader: Offloader | None = None) -> Plan:
        """Hold ``plan`` (and its offloader) as this step's: ``init`` and
        ``shard.load`` give it the plan of the state they make, whose metadata
        keeps only the plan's key (see [Note: TrainState])."""
        if plan is not self._plan:
            self._plan = plan
            self._offloader = offloader or plan.offloader()
        return plan

    def _plan_for(self, state: TrainState) -> Plan:
        """The plan ``state`` was made with, where this step (its ``init``, or
        ``shard.load`` into it) made it; a state of another step must fit this
        step's own plan."""
        c = self.config
        _checks.check_is_state(c.name, state)
        mine = self._plan
        if mine is not None and state.meta.origin == mine.key:
            return mine
        plan = plan_of(state)
        if plan is not None and plan.config is c:
            return self.use_plan(plan)
        if self._plan is None:
            raise RuntimeError(f"{c.name}: call init(params) before stepping")
        _checks.check_fits(self._plan, state)
        return self._plan

    # -- step -------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: object, *,
                 tokens: int | None = None) -> tuple[TrainState, StepMetrics]:
        """One optimizer step. ``tokens``: how many tokens (or samples) this rank's
        ``batch`` holds, for ``metrics["tokens_per_s"]`` (this rank's rate)."""
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(
                tokens, (int, np.integer)) or tokens < 0):
            raise ValueError(f"{self.config.name}: tokens must be a count >= 0; got {tokens!r}")
        with step_breakdown() as b:  # see [Note: step profile]
            with timed("library", step=True):
                state, metrics = self._step(state, batch)
        split = b.split_ms()
        metrics.add(time_ms=split)
        if tokens is not None:
            metrics.add(tokens_per_s=1e3 * int(tokens) / max(split["step"], 1e-9))
        c = self.config
        if c.count_flops:  # see [Note: model FLOPs]
            per_s = self._flops.step * 1e3 / max(split["step"], 1e-9)
            metrics.add(flops=self._flops.step, flops_per_s=per_s)
            if c.peak_flops:
                metrics.add(mfu=per_s / c.peak_flops)
        for logger in c.loggers if c.topology.first else ():
            logger(int(state.step), metrics)
        return state, metrics

    def _step(self, state: TrainState, batch: object) -> tuple[TrainState, StepMetrics]:
        plan = self._plan_for(state)
        state.check_live()
        micro = list(batch) if isinstance(batch, MicroBatches) else [batch]
        c = self.config
        n = c.gradient_accumulation_steps
        if n is not None and len(micro) != n:
            raise ValueError(f"{c.name}: gradient_accumulation_steps is {n}: give "
                             f"shard.MicroBatches of {n} micro-batches per step"
                             f"{' (or one batch)' if n == 1 else ''}; got {len(micro)}")
        for b in micro:
            _checks.check_batch(c.name, c.comm.rank, b)
        lr = _checks.learning_rate(c, int(state.step))
        if c.weight_by_rows:  # see [Note: rows across ranks]
            counts = [_checks.counted_rows(c.name, c.comm.rank, b) for b in micro]
            weights: list[float] | None = [float(n) for n in counts]
            rows = sum(counts)
        else:
            weights, rows = _checks.weights(micro), _checks.total_rows(micro)
        micro = [_checks.cast_inputs(plan, b) for b in micro]
        if c.invariant_shards:  # see [Note: the same bits at any world size]
            micro, weights = _ordered.virtual_shards(plan, state, micro), None
        try:
            return self._run(plan, state, micro, lr, weights, rows)
        finally:
            if self._offloader is not None:  # the overlapped offload's threads, if started
                self._offloader.end_overlap()

    def _run(self, plan: Plan, state: TrainState, micro: list[object], lr: float | None,
             weights: list[float] | None, rows: int) -> tuple[TrainState, StepMetrics]:
        """The step after its checks. Nothing of ``state`` changes until the
        gradients are reduced and their norm is known; an exception before that
        leaves it valid (see [Note: failed steps])."""
        c = self.config
        scale = float(state.loss_scale)
        grad_scale = 1.0 / ((c.gradient_divide_factor or c.ranks) * len(micro) * scale)
        reduced = self._reduce(plan, state, micro, weights, rows, scale, grad_scale)
        state.donate()  # from here on the update reuses its buffers
        if reduced.model_state is not None:
            state = state.replace(model_state=reduced.model_state)
        known = {"lr": lr, "loss_scale": scale, "skipped": False}
        if lr is None:  # an optax transformation's rate is its own
            del known["lr"]
        if c.has_aux:
            known["aux"] = reduced.aux
        fresh_copies = c.stage in (1, 2) and bool(state.compute) and (
            state.meta.compute_dtype != state.meta.master_dtype)
        family = plan.optimizer.fused is not None and plan.optimizer.fused.onebit is not None
        if c.clip_norm is None and c.loss_scale is None and not fresh_copies and not family:
            return self._advance_on_device(plan, state, reduced, known)
        return self._advance_on_host(plan, state, reduced, known)

    def _reduce(self, plan: Plan, state: TrainState, micro: list[object],
                weights: list[float] | None, rows: int, scale: float,
                grad_scale: float) -> _Reduced:
        """Steps 1-2: every micro-batch's gradients reduced into the shards, their
        norm and the mean loss; on an exception, the step's collectives are
        waited for and ``state`` is as it was."""
        c, device = self.config, plan.device
        onebit = self._compressed(plan, state, grad_scale)  # see [Note: 1-bit Adam]
        if onebit is not None and plan.reduce_dtype != np.float32:  # compressed: f32
            buffers = self.__dict__["_grad_buffers32"] = _grads.grad_buffers(
                plan, self.__dict__.get("_grad_buffers32"), np.float32)
        else:
            buffers = self._grad_buffers = _grads.grad_buffers(plan, self._grad_buffers)
        reducer = _ordered.reducer(plan, buffers, onebit)
        units = _grads.unit_params(plan, state, self.tracker)
        leaves = len(plan.layout.leaves) if _update.tracks_missing(c) else 0
        totals = _update.fresh_totals(self.__dict__.setdefault("_totals_cache", {}), device,
                                      rows, leaves)
        offloader = self._offloader
        overlap = offloader.start_overlap(state, reducer, grad_scale) if offloader else None
        try:
            got = _grads.accumulate(plan, units, reducer, state, micro, weights, scale, totals,
                                    self._flops, ordered=isinstance(reducer, OrderedReducer))
            shards = reducer.finish()
            if got.missing:  # see [Note: missing gradients]
                _update.count_missing(totals, got.missing, device)
            if overlap is not None:  # see [Note: overlapped offload]
                overlap.submit_rest()
                with timed("reduce_wait"):
                    overlap.wait_copied()
            with timed("optimizer"):
                if onebit is not None and onebit.kind == "local":  # see [Note: 0/1 Adam]
                    _update.local_norm_and_loss(plan, cast(LocalReducer, reducer).sumsq,
                                                totals)
                else:
                    _update.norm_and_loss(plan, shards, totals, got.losses)
                if c.weight_by_rows:
                    _update.weigh_by_rows(shards, totals, c.ranks * len(micro))
            aux = _grads.mean_aux(plan, got.auxes) if c.has_aux else None
            model_state = None if got.model_state is None else _grads.mean_model_state(
                plan, got.model_state)
            skip = _update.skipped_leaves(totals, got.missing, c.ranks, device) if \
                got.missing and onebit is None else frozenset()  # 1-bit Adam: every leaf
        except BaseException:
            units.drain()  # no collective of this step still writes anywhere
            reducer.drain()
            raise
        return _Reduced(shards, totals, skip, aux, model_state, onebit, grad_scale,
                        c.ranks * len(micro))

    def _metrics(self, reduced: _Reduced, host: np.ndarray) -> dict[str, float]:
        """The loss and the gradients' norm from the totals read back."""
        c = self.config
        if (not c.weight_by_rows and _update.value(host, _update.ROWS) > 0
                and not self.__dict__.get("_rows_warned")):
            self._rows_warned = _update.warn_if_rows_differ(c, host)
        sumsq = _update.value(host, _update.SUMSQ)
        # 1-bit Adam's compressed phase: the norm of the momentum the ranks agreed on
        norm = math.sqrt(sumsq) * (1.0 if reduced.onebit else reduced.grad_scale) if \
            math.isfinite(sumsq) else sumsq
        return {"loss": _update.value(host, _update.LOSS) / reduced.parts, "grad_norm": norm}

    def _advance_on_device(self, plan: Plan, state: TrainState, reduced: _Reduced,
                           known: dict[str, Any]) -> tuple[TrainState, StepMetrics]:
        """Steps 4-5 with nothing to decide on the host: no read back until the
        metrics are looked at. The kernel reads the sum of squares on the
        device and skips the update when it is not finite (see [Note:
        non-finite gradients])."""
        c, step = self.config, int(state.step)
        del known["skipped"]

        def finish_and_flag(host: np.ndarray) -> dict[str, Any]:
            out: dict[str, Any] = self._metrics(reduced, host)
            out["skipped"] = not math.isfinite(_update.value(host, _update.SUMSQ))
            if out["skipped"]:
                log.warning("%s: non-finite gradients (inf or nan) at step %d: the update "
                            "was skipped", c.name, step)
            return out

        totals = reduced.totals
        state = self._apply(plan, state, reduced.shards, reduced.grad_scale,
                            totals[_update.SUMSQ], reduced.skip)
        return (state.replace(step=np.asarray(step + 1, np.int64),
                              batches=np.asarray(int(state.batches) + 1, np.int64),
                              skips=_update.add_skips(state.skips, reduced.skip)),
                StepMetrics(known, totals, finish_and_flag, plan.device.to_host))

    def _advance_on_host(self, plan: Plan, state: TrainState, reduced: _Reduced,
                         known: dict[str, Any]) -> tuple[TrainState, StepMetrics]:
        """Steps 3-5 where the host decides (clipping, loss scaling, the 1-bit
        family, fresh compute copies): the totals read back once, the step
        skipped on a non-finite norm, the loss scale updated."""
        c, onebit, totals = self.config, reduced.onebit, reduced.totals
        host = plan.device.to_host(totals)  # the step's one read: skip it or not
        known.update(self._metrics(reduced, host))
        finite = math.isfinite(_update.value(host, _update.SUMSQ))
        scale = float(state.loss_scale)
        new_scale, good, left = scale, int(state.good_steps), int(state.hysteresis)
        if c.loss_scale is not None:
            new_scale, good, left = c.loss_scale.update(scale, good, finite, left)
        if finite:
            needs_norm = c.clip_norm is not None or plan.optimizer.fused is None
            if onebit is not None and onebit.kind == "local":  # see [Note: 0/1 Adam]
                self._local_step(plan, state, onebit.held, reduced.shards)
            elif onebit is not None and onebit.kind == "momentum":  # see [Note: 1-bit Adam]
                with timed("optimizer"):
                    _update.onebit_update(plan, state, onebit.held)
            else:
                state = self._apply(plan, state, reduced.shards,
                                    1.0 if onebit else reduced.grad_scale,
                                    totals[_update.SUMSQ] if needs_norm else None, reduced.skip,
                                    onebit.kind if onebit is not None else None)
            for held in (self.__dict__.get("_onebit_momentum"),  # (a skipped update leaves
                         self.__dict__.get("_zero_one_local")):  # them for the state to remake)
                if held is not None:
                    held.advanced(int(state.step), state.moments[0] if isinstance(
                        held, OneBitMomentum) else state.master)
            state = state.replace(skips=_update.add_skips(state.skips, reduced.skip))
        elif c.loss_scale is None:
            log.warning("%s: non-finite gradients (inf or nan) at step %d: the update was "
                        "skipped", c.name, int(state.step))
        known["skipped"] = not finite
        return state.replace(step=np.asarray(int(state.step) + finite, np.int64),
                             batches=np.asarray(int(state.batches) + 1, np.int64),
                             loss_scale=np.asarray(new_scale, np.float64),
                             good_steps=np.asarray(good, np.int64),
                             hysteresis=np.asarray(left, np.int64)), StepMetrics(known)

    def _apply(self, plan: Plan, state: TrainState, shards: list[Array], grad_scale: float,
               grad_sumsq: Array | None, skip: frozenset[int] = frozenset(),
               compressed: str | None = None) -> TrainState:
        """The update where the state's masters live; returns the new state.
        ``compressed``: the kind of the 1-bit family's phase the shards are of
        (see :class:`~shard.step.reduction._reduce.Compressed`)."""
        if state.meta.offload is None:
            return _update.apply(plan, state, shards, grad_scale, grad_sumsq, skip, compressed)
        if skip:
            _update.warn_unskipped(plan, skip, "offloaded state")
        offloader = cast(Offloader, self._offloader)  # made with an offloaded step's plan
        state, new_compute = offloader.apply(state, shards, grad_scale, grad_sumsq)
        if new_compute is not None:
            _update.refresh(plan, state, new_compute)
        return state

    def _compressed(self, plan: Plan, state: TrainState, grad_scale: float) -> Compressed | None:
        """What a step of the 1-bit family's compressed phases sends, on more
        than one rank (see [Note: 1-bit Adam] in ``ops/_onebit.py`` and [Note:
        0/1 Adam] in ``ops/_zeroone.py``); None for an exact reduction."""
        fused = plan.optimizer.fused
        spec = fused.onebit if fused is not None else None
        n, w = int(state.step) + 1, plan.fast.world_size  # the update's number
        if spec is None or w == 1:
            return None
        scale = grad_scale * w
        if isinstance(spec, ZeroOne) and n > spec.var_freeze_step:
            local = self.__dict__.setdefault("_zero_one_local", ZeroOneLocal())
            if local.ready(plan.layout, plan.fast, plan.device, spec, state.master,
                           state.moments, int(state.step)):  # from the last synchronisation
                _update.copy_out(plan, state, cast(LocalSteps, local.steps).params)
            return Compressed("local", local, scale)
        if (isinstance(spec, ZeroOne) and updates_variance(spec, n)) or (
                isinstance(spec, OneBit) and n <= spec.freeze_step):
            return None
        held = self.__dict__.setdefault("_onebit_momentum", OneBitMomentum())
        held.ready(plan.layout, plan.fast, plan.device, state, int(state.step),
                   momentum=isinstance(spec, OneBit))
        return Compressed("momentum" if isinstance(spec, OneBit) else "gradients", held, scale)

    def _local_step(self, plan: Plan, state: TrainState, local: ZeroOneLocal,
                    grads: list[Array]) -> None:
        """0/1 Adam's local step, and the ranks' synchronisation where it is due
        (see [Note: 0/1 Adam] in ``ops/_zeroone.py``): the compute params
        become this rank's own; the masters and moments change at a
        synchronisation only."""
        fused = cast(FusedOptimizer, plan.optimizer.fused)
        spec, count = cast(ZeroOne, fused.onebit), int(state.step)
        steps = cast(LocalSteps, local.steps)
        local.key = None  # until the step ends (advanced): a failure starts them again
        with timed("optimizer"):
            steps.local(grads, fused.learning_rate(count))
        if synchronises(spec, count + 1):
            with timed("reduce_wait"):
                steps.synchronise()
            local.write(plan.layout, plan.fast.rank, state.master, state.moments[0])
        with timed("library"):
            _update.copy_out(plan, state, steps.params)

    # -- evaluation -------------------------------------------------------------
    def evaluate(self, state: TrainState, batch: object, *, loss_fn: object = None) -> Any:
        """The loss at ``state``'s params on this rank's ``batch``, averaged over
        the ranks (a collective: every rank calls it); no gradients, no update,
        the state stays usable. With ``has_aux=True`` it returns ``(loss, aux)``,
        aux averaged over the ranks as ``metrics["aux"]`` is.

        ``loss_fn``: for a JAX loss, another function of the same params, such
        as the model in eval mode (``functools.partial(loss, train=False)``,
        flax's ``deterministic=True``); it returns ``(loss, aux)`` where the
        step's loss does. A torch module runs in eval mode already.

        A ``Layered`` loss, ``interop.torch.layered``'s and a pipeline's run
        unit by unit, and a JAX loss at stage 3 segment by segment (each within
        the training step's memory bound; a pipeline passes each micro-batch's
        activations forward through its stages); other losses see the whole
        params at once, as FSDP's ``summon_full_params``. A torch module runs in
        eval mode (BatchNorm's running statistics, no dropout) under
        ``torch.no_grad``.
        """
        plan = self._plan_for(state)
        state.check_live()
        _checks.check_batch(self.config.name, self.config.comm.rank, batch)
        if loss_fn is not None:
            loss_fn = _checks.eval_loss(self.config, loss_fn)
        with_state = state.model_state is not None  # see [Note: model state]
        called = _grads.step_loss(plan, with_state, loss_fn)
        if called is not None:  # a model state or a key (see [Note: per-rank keys])
            loss_fn = called
            batch = _grads.keyed_batch(plan, batch, int(state.step), 0)
            batch = (batch, state.model_state) if with_state else batch
        out = _grads.evaluate(plan, _grads.unit_params(plan, state, self.tracker), batch, loss_fn)
        if state.model_state is None:
            return out
        value, (_, aux) = out  # (loss, (new model state, aux)): the state stays as it was
        return (value, aux) if self.config.has_aux else value

