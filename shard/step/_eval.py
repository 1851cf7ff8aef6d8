"""Evaluation: the loss at a state's params with no gradients and no update
(:meth:`ZeroStep.evaluate`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

import ops
from shard.core._loss import JaxLoss
from shard.step import _grads, _traced
from shard.step._runtime import Units

if TYPE_CHECKING:
    from shard.step._plan import Plan

__all__ = ["evaluate"]


def evaluate(plan: Plan, units: Units, batch: Any, loss_fn: Any = None) -> Any:
    """The loss at ``units``' params on this rank's ``batch``, averaged over the
    ranks (a collective); with ``has_aux``, ``(loss, aux)``, aux averaged as the
    step's metrics are. ``loss_fn`` (a ``JaxLoss``) replaces the step's loss. A
    ``Layered`` loss, ``interop.torch.layered``'s and a pipeline's run unit by
    unit, a JAX loss at stage 3 segment by segment (see [Note: traced units]);
    other losses see the whole params at once."""
    c = plan.config
    fn = c.loss_fn if loss_fn is None else loss_fn
    aux = None
    with _grads.placement(plan):
        if loss_fn is None and fn.loss_units is not None:  # Layered's too
            loss = fn.loss_units(units, batch)  # unit by unit
        elif c.kind == "jax" and not units.persistent:  # see [Note: traced units]
            loss = _traced.traced(fn).loss_units(units, batch)
        else:
            params = _grads.whole_params(plan, units)
            loss = fn.loss_value(params, batch) if fn.loss_value is not None else \
                fn.value_and_grad(params, batch)[0]
            del params
        with_aux = fn.has_aux if isinstance(fn, JaxLoss) else c.has_aux
        if with_aux and isinstance(loss, tuple):
            loss, aux = loss
        total = _grads.on_device(plan, loss, "the loss").astype(np.float64)
    # a pipeline's loss is its last stage's: summed over the whole mesh, where
    # each model rank holds the same loss (counted at model rank 0)
    mesh = c.topology.whole
    if mesh is not None and c.tensor_parallel is not None and c.tensor_parallel.rank > 0:
        total = total * 0
    total = ops.all_reduce(mesh or c.comm, total)
    if c.replicate is not None:
        total = ops.all_reduce(c.replicate, total)
    value = float(plan.device.to_host(total)[0]) / c.ranks
    return (value, _grads.mean_aux(plan, [aux])) if with_aux else value
