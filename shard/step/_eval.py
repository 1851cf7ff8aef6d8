"""Evaluation: the loss at a state's params with no gradients and no update
(:meth:`ZeroStep.evaluate`)."""

from __future__ import annotations

from typing import Any

import numpy as np

import ops
from shard.step import _grads
from shard.step._runtime import Units

__all__ = ["evaluate"]


def evaluate(plan: Any, units: Units, batch: Any) -> float:
    """The loss at ``units``' params on this rank's ``batch``, averaged over the
    ranks (a collective). A ``Layered`` loss, ``interop.torch.layered``'s and a
    pipeline's run unit by unit; other losses see the whole params at once."""
    c = plan.config
    with _grads.placement(plan):
        if c.kind == "layered" or hasattr(c.loss_fn, "loss_units"):
            loss = c.loss_fn.loss_units(units, batch)  # unit by unit
        else:
            params = _grads.whole_params(plan, units)
            value = getattr(c.loss_fn, "loss_value", None)
            loss = value(params, batch) if value is not None else \
                c.loss_fn.value_and_grad(params, batch)[0]
            if c.has_aux and isinstance(loss, tuple):  # a provider's (loss, aux)
                loss = loss[0]
            del params
        total = _grads.on_device(plan, loss, "the loss").astype(np.float64)
    # a pipeline's loss is its last stage's: summed over the whole mesh, where
    # each model rank holds the same loss (counted at model rank 0)
    mesh = getattr(c.loss_fn, "norm_comm", None)
    if mesh is not None and c.tensor_parallel is not None and c.tensor_parallel.rank > 0:
        total = total * 0
    total = ops.all_reduce(mesh or c.comm, total)
    if c.replicate is not None:
        total = ops.all_reduce(c.replicate, total)
    return float(plan.device.to_host(total)[0]) / c.ranks
