"""A step's gradient phase: the units' params as the loss sees them, each
micro-batch's loss and gradients, handed unit by unit to the reduction (step 1
of the step in ``shard/step/_step.py``); and the loss alone, with no gradients
(:meth:`ZeroStep.evaluate`)."""

from __future__ import annotations

import contextlib
import dataclasses
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, cast

import numpy as np

import ops
import ops._types
from ops.comm._collectives import all_gather_host
from ops.device._dlpack import host_copy, jax_view
from shard.core._data_rank import derived_key, keyed
from shard.core._state import TrainState
from shard.core.losses._jax import JaxLoss
from shard.monitor._flops import FlopCount
from shard.monitor._profile import timed
from shard.step import _traced, _update
from shard.step._runtime import LiveBytes, Units
from shard.step.reduction._reduce import GradBuffers, GradReducer

if TYPE_CHECKING:
    import jax
    from numpy.typing import DTypeLike

    from ops._types import Array
    from shard.core._protocol import LossProvider
    from shard.step._ordered import OrderedReducer
    from shard.step._plan import Plan

__all__ = [
    "Accumulated",
    "accumulate",
    "configured",
    "evaluate",
    "grad_buffers",
    "keyed_batch",
    "loss_and_grads",
    "mean_model_state",
    "on_device",
    "placement",
    "same_model_state",
    "step_loss",
    "unit_params",
    "whole_params",
]


def grad_buffers(plan: Plan, kept: GradBuffers | None,
                 dtype: DTypeLike | None = None) -> GradBuffers:
    """The gradient shards, kept across steps (see :class:`GradBuffers`):
    ``kept`` where it serves ``plan``, else new ones; in ``dtype`` (default:
    the reductions')."""
    dtype = plan.reduce_dtype if dtype is None else np.dtype(dtype)
    if kept is not None and kept.serves(plan.grad_layout, dtype, plan.device):
        return kept
    return GradBuffers(plan.grad_layout, dtype, plan.device)


def unit_params(plan: Plan, state: TrainState, tracker: LiveBytes) -> Units:
    """Each unit's full params for this step: gathered (stage 3) or the state's
    own whole buffers."""
    stage = plan.config.stage
    local = list(state.compute) if stage == 3 and state.compute else list(state.master)
    full = list(state.compute) if stage in (1, 2) or (stage == 0 and state.compute) else (
        list(state.master) if stage == 0 else None)
    return Units(plan.layout, plan.fast, stage=stage, device=plan.device, local=local,
                 full=full, full_layout=plan.full_layout, prefetch=plan.config.prefetch,
                 tracker=tracker, plans=plan.copy_plans, secondary=plan.secondary,
                 quantized=plan.config.quantized_weights)


def whole_params(plan: Plan, units: Units) -> Any:
    """Every unit gathered at once, as the params pytree (jax arrays for a JAX
    loss): what a monolithic loss needs."""
    layout = plan.layout
    n = len(layout.units)
    units.bounded = False
    leaves: list[Array | jax.Array | None] = [None] * len(layout.leaves)
    for u in range(n):
        for i, x in zip(layout.units[u].leaves, units.get(u, tuple(range(u + 1, n))), strict=True):
            leaves[i] = jax_view(x) if plan.config.kind == "jax" else x
    return layout.treedef.unflatten(leaves)


def on_device(plan: Plan, x: object, what: str) -> Array:
    """A loss (a number, or a torch, jax or device scalar) as a device array."""
    if isinstance(x, (int, float)):
        x = np.asarray(x, np.float64)
    return plan.device.asarray(x, what=f"{plan.config.name}: {what}").reshape(1)


def placement(plan: Plan) -> AbstractContextManager[object]:
    """JAX computations over host state run on JAX's CPU device, even where
    JAX's default device is a GPU."""
    if not plan.device.host or plan.config.kind == "provider":
        return contextlib.nullcontext()
    import jax

    return jax.default_device(jax.devices("cpu")[0])


def configured(plan: Plan,
               loss_fn: LossProvider | None = None) -> AbstractContextManager[object]:
    """The step's loss (or ``loss_fn``) run with the step's ``has_aux`` and
    precision policy (see [Note: the loss protocol])."""
    c = plan.config
    loss = c.loss_fn if loss_fn is None else loss_fn
    return loss.configured(has_aux=c.has_aux,
                           cast_forward_inputs=plan.precision.cast_forward_inputs)


def step_loss(plan: Plan, with_state: bool,
              loss_fn: JaxLoss | None = None) -> JaxLoss | None:
    """The JAX loss the step calls in place of its own (or of ``loss_fn``, an
    eval-mode one), or None where it calls it as it is: one that threads a
    model state (see [Note: model state]) and takes a key (see [Note:
    per-rank keys]), one of them or both."""
    c = plan.config
    if c.key is None and not with_state:
        return loss_fn
    source = c.loss_fn if loss_fn is None else loss_fn
    if not isinstance(source, JaxLoss):
        raise TypeError(f"{c.name}: key= and a model state are for a JAX loss function; this "
                        f"step's loss is a {type(source).__name__}")
    fn = source.fn
    if c.key is not None:
        fn = keyed(fn, c.key[1])
    return JaxLoss.with_state(fn, c.has_aux) if with_state else JaxLoss.shared(fn, c.has_aux)


def keyed_batch(plan: Plan, batch: object, step: int, micro_batch: int) -> Any:
    """``(batch, key)`` with this data rank's key for ``micro_batch`` of step
    ``step`` where the step was given ``key=`` (see [Note: per-rank keys]);
    ``batch`` otherwise."""
    c = plan.config
    if c.key is None:
        return batch
    rank = c.topology.data_rank
    if c.invariant_shards:  # the virtual shard's own key, whatever the ranks
        group = c.invariant_shards // c.ranks
        micro_batch, rank = micro_batch // group, rank * group + micro_batch % group
    return batch, derived_key(*c.key, step=step, rank=rank, micro_batch=micro_batch)


def counted(plan: Plan, flops: FlopCount, called: LossProvider | None,
            batch: object) -> AbstractContextManager[object]:
    """Where the step counts FLOPs, one micro-batch's run counted into ``flops``
    (see [Note: model FLOPs]); else nothing. ``called``: the loss the step
    calls, as for :func:`loss_and_grads`."""
    if not plan.config.count_flops:
        return nullcontext()
    loss = called if called is not None else plan.config.loss_fn

    def program() -> float:
        import jax

        dtype = plan.precision.param_dtype
        like = [jax.ShapeDtypeStruct(leaf.shape, dtype or leaf.dtype)
                for leaf in plan.full_layout.leaves]
        return loss.program_flops(plan.full_layout.treedef.unflatten(like), batch)

    return flops.micro_batch(loss.counts_flops, loss, batch, program)


@dataclasses.dataclass
class Accumulated:
    """What a step's micro-batches leave besides their gradients (which went to
    the reducer) and their weighted losses (summed into the totals)."""

    auxes: list[Any]  # each micro-batch's aux, with has_aux
    losses: list[Any]  # each micro-batch's loss, for the ordered reduction only
    model_state: Any  # the model state after the last micro-batch (see [Note: model state])
    missing: frozenset[int] | None  # leaves no micro-batch gave a gradient


def accumulate(plan: Plan, units: Units, reducer: GradReducer, state: TrainState,
               micro: list[object], weights: list[float] | None, scale: float,
               totals: Array, flops: FlopCount, *, ordered: bool) -> Accumulated:
    """Every micro-batch's loss and gradients (of the loss times ``scale`` and its
    weight), in order: the gradients to ``reducer``, the weighted loss into
    ``totals``, the FLOPs counted into ``flops`` (step 1 of the step).
    ``ordered``: ``reducer`` is an ``OrderedReducer``, told where each
    micro-batch ends, and each loss is kept for its exact sum."""
    c = plan.config
    out = Accumulated([], [], state.model_state, None)
    tracked = _update.tracks_missing(c)  # see [Note: missing gradients]
    called = step_loss(plan, out.model_state is not None)  # see [Note: per-rank keys]
    flops.step = 0.0
    with placement(plan), configured(plan):
        for i, b in enumerate(micro):
            reducer.final = i == len(micro) - 1
            weight = weights[i] if weights else 1.0  # micro-batches of unequal rows
            b = keyed_batch(plan, b, int(state.step), i)
            loss = _micro_batch(plan, units, reducer, b, scale * weight, called, flops, out)
            if tracked:  # no gradient in the step: none in any of its micro-batches
                got = c.loss_fn.missing
                out.missing = got if out.missing is None else out.missing & got
            loss = on_device(plan, loss, "the loss")
            totals[_update.LOSS] += loss if weights is None else loss * weight
            if ordered:
                cast("OrderedReducer", reducer).end_call()
                out.losses.append(loss)
    return out


def _micro_batch(plan: Plan, units: Units, reducer: GradReducer, b: object, scale: float,
                 called: Any, flops: FlopCount, out: Accumulated) -> Any:
    """One micro-batch's loss; its aux and new model state into ``out``."""
    c = plan.config
    model_state = out.model_state
    with counted(plan, flops, called, b if model_state is None else (b, model_state)):
        if model_state is None:
            loss = loss_and_grads(plan, units, reducer, b, scale, called)
            if c.has_aux:
                loss, aux = loss
                out.auxes.append(aux)
            return loss
        loss, (new, aux) = loss_and_grads(plan, units, reducer, (b, model_state), scale,
                                          called)
        out.model_state = same_model_state(plan, model_state, new)
    if c.has_aux:
        out.auxes.append(aux)
    return loss


# loss_fn: Any: a JaxLoss, or the step's LossProvider in its place, whose optional
# callables (run_units, loss_units, loss_value) the step's kind says are there
def loss_and_grads(plan: Plan, units: Units, reducer: GradReducer, batch: object,
                   scale: float, loss_fn: Any = None) -> Any:
    """Loss of one micro-batch (a number or a scalar array); its gradients (of
    loss * scale) go to ``reducer``. ``loss_fn``: a JAX loss in place of the
    step's (one that threads a model state)."""
    c, layout = plan.config, plan.layout
    loss_fn = c.loss_fn if loss_fn is None else loss_fn
    if c.kind == "layered":
        return loss_fn.run_units(units, reducer, batch, scale)
    if c.kind == "jax" and not units.persistent:  # see [Note: traced units]
        return _traced.traced(loss_fn).run_units(units, reducer, batch, scale)
    # Unit by unit: stage 3 within its memory bound, each reduction overlapped
    if loss_fn.run_units is not None and loss_fn.hooks_usable(c.comm):
        return loss_fn.run_units(units, reducer, batch, scale)
    params = whole_params(plan, units)
    kwargs = {"loss_scale": scale} if (c.loss_scale or c.kind == "jax" or scale != 1.0) else {}
    with timed("compute"):
        loss, grads = loss_fn.value_and_grad(params, batch, **kwargs)
    del params
    flat = layout.treedef.flatten_up_to(grads)
    for u in reversed(range(len(layout.units))):
        reducer.add(u, [flat[i] for i in layout.units[u].leaves])
    return loss


def mean_aux(plan: Plan, auxes: list[object]) -> Any:
    """The micro-batches' aux (``has_aux``), numeric leaves averaged over the
    micro-batches and the ranks (one host all-gather); other leaves are this
    rank's last."""
    c = plan.config
    tu = ops._types.tree_util()
    flat = [tu.tree_flatten(a) for a in auxes]
    treedef = flat[-1][1]
    if any(t != treedef for _, t in flat):
        raise ValueError(f"{c.name}: the micro-batches' aux differ in structure: "
                         f"{[str(t) for _, t in flat]}")
    numeric = [i for i, x in enumerate(flat[-1][0]) if _number_like(x)]
    values = [np.mean([_host(leaves[i]) for leaves, _ in flat], axis=0) for i in numeric]
    shapes = [v.shape for v in values]
    if values:
        vec = np.concatenate([v.reshape(-1) for v in values]).astype(np.float64)
        vec = all_gather_host(c.comm, vec).reshape(c.comm.world_size, -1).mean(axis=0)
        if c.replicate is not None:  # every replica's mean counts the same (equal ranks)
            vec = all_gather_host(c.replicate, vec).reshape(-1, vec.size).mean(axis=0)
        values, at = [], 0
        for shape in shapes:
            n = int(np.prod(shape))
            values.append(vec[at:at + n].reshape(shape) if shape else float(vec[at]))
            at += n
    leaves = list(flat[-1][0])
    for i, v in zip(numeric, values, strict=True):
        leaves[i] = v
    return tu.tree_unflatten(treedef, leaves)


def _number_like(x: object) -> bool:
    """Numbers and arrays of them (numpy, JAX, torch, device arrays, bf16 too)."""
    if isinstance(x, (bool, int, float, np.number)):
        return True
    name = str(getattr(x, "dtype", ""))
    return any(k in name for k in ("float", "int", "bool"))


def _host(x: Any) -> np.ndarray:  # Any: a number or any library's array
    """An aux value on the host, as float64 (an explicit copy from a device)."""
    return np.asarray(host_copy(x.detach() if hasattr(x, "detach") else x), np.float64)


def same_model_state(plan: Plan, old: object, new: object) -> Any:
    """The loss's new model state, checked against the old one's structure,
    shapes and dtypes (a TypeError naming the leaf), as numpy arrays."""
    c = plan.config
    tu = ops._types.tree_util()
    before, tree = tu.tree_flatten_with_path(old)
    after, new_tree = tu.tree_flatten(new)
    if new_tree != tree:
        raise TypeError(f"{c.name}: the loss returned a model state of structure {new_tree}; "
                        f"the state's is {tree}")
    out = []
    for (path, a), b in zip(before, after, strict=True):
        b = host_copy(b)  # explicit where the loss left it on a device
        if b.shape != tuple(a.shape) or b.dtype != a.dtype:
            raise TypeError(f"{c.name}: model_state{tu.keystr(path)} came back as "
                            f"{b.dtype}{list(b.shape)}; it was {a.dtype}{list(a.shape)}")
        out.append(b)
    return tu.tree_unflatten(tree, out)


def mean_model_state(plan: Plan, model_state: object) -> Any:
    """Every rank's model state made the same (see [Note: model state]): its
    floating-point leaves averaged over the data ranks, its others rank 0's
    (one host all-gather each)."""
    c = plan.config
    tu = ops._types.tree_util()
    leaves, tree = tu.tree_flatten(model_state)
    if not leaves or (c.ranks == 1):
        return model_state
    import jax.numpy as jnp

    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]  # bf16 too
    others = [i for i in range(len(leaves)) if i not in set(floats)]
    out = list(leaves)
    for group, mean in ((floats, True), (others, False)):
        if not group:
            continue
        vec = np.concatenate([leaves[i].reshape(-1).astype(np.float64 if mean else np.int64)
                              for i in group])
        every = all_gather_host(c.comm, vec).reshape(c.comm.world_size, -1)
        vec = every.mean(axis=0) if mean else every[0]
        if c.replicate is not None:
            every = all_gather_host(c.replicate, vec).reshape(-1, vec.size)
            vec = every.mean(axis=0) if mean else every[0]
        at = 0
        for i in group:
            n = leaves[i].size
            out[i] = vec[at:at + n].reshape(leaves[i].shape).astype(leaves[i].dtype)
            at += n
    return tu.tree_unflatten(tree, out)


def evaluate(plan: Plan, units: Units, batch: object, loss_fn: Any = None) -> Any:
    """The loss at ``units``' params on this rank's ``batch``, averaged over the
    ranks (a collective); with ``has_aux``, ``(loss, aux)``, aux averaged as the
    step's metrics are. ``loss_fn`` (a ``JaxLoss``) replaces the step's loss. A
    ``Layered`` loss, ``interop.torch.layered``'s and a pipeline's run unit by
    unit, a JAX loss at stage 3 segment by segment (see [Note: traced units]);
    other losses see the whole params at once."""
    c = plan.config
    fn = c.loss_fn if loss_fn is None else loss_fn
    aux = None
    with placement(plan), configured(plan, fn):
        if loss_fn is None and fn.loss_units is not None:  # Layered's too
            loss = fn.loss_units(units, batch)  # unit by unit
        elif c.kind == "jax" and not units.persistent:  # see [Note: traced units]
            loss = _traced.traced(fn).loss_units(units, batch)
        else:
            params = whole_params(plan, units)
            loss = fn.loss_value(params, batch) if fn.loss_value is not None else \
                fn.value_and_grad(params, batch)[0]
            del params
        with_aux = fn.has_aux if isinstance(fn, JaxLoss) else c.has_aux
        if with_aux and isinstance(loss, tuple):
            loss, aux = loss
        total = on_device(plan, loss, "the loss").astype(np.float64)
    # a pipeline's loss is its last stage's: summed over the whole mesh, where
    # each model rank holds the same loss (counted at model rank 0)
    mesh = c.topology.whole
    if mesh is not None and c.tensor_parallel is not None and c.tensor_parallel.rank > 0:
        total = total * 0
    total = ops.all_reduce(mesh or c.comm, total)
    if c.replicate is not None:
        total = ops.all_reduce(c.replicate, total)
    value = float(plan.device.to_host(total)[0]) / c.ranks
    return (value, mean_aux(plan, [aux])) if with_aux else value
