"""Evaluation: :meth:`ZeroStep.evaluate`, the loss at a state's params with no
gradients and no update."""

from __future__ import annotations

from typing import Any

import numpy as np

import ops

__all__ = ["EvalPhase"]


class EvalPhase:
    """The evaluation method of ``ZeroStep`` (which provides the attributes)."""

    layout: Any
    comm: Any
    device: Any
    kind: str
    loss_fn: Any
    name: str
    _whole_params: Any

    def evaluate(self, state: Any, batch: Any) -> float:
        """The loss at ``state``'s params on this rank's ``batch``, averaged over
        the ranks (a collective: every rank calls it); no gradients, no update,
        the state stays usable.

        A ``Layered`` loss, ``interop.torch.layered``'s and a pipeline's run
        unit by unit (at stage 3 within the training step's memory bound; a
        pipeline passes each micro-batch's activations forward through its
        stages); other losses see the whole params at once, as FSDP's
        ``summon_full_params``. A torch module runs in eval mode (BatchNorm's
        running statistics, no dropout) under ``torch.no_grad``.
        """
        self._check_state(state)
        state.check_live()
        self._check_batch(batch)
        units = self._unit_params(state)
        with self._jax_placement():
            if self.kind == "layered" or hasattr(self.loss_fn, "loss_units"):
                loss = self.loss_fn.loss_units(units, batch)  # unit by unit
            else:
                params = self._whole_params(units)
                value = getattr(self.loss_fn, "loss_value", None)
                loss = value(params, batch) if value is not None else \
                    self.loss_fn.value_and_grad(params, batch)[0]
                del params
            total = self._on_device(loss, "the loss").astype(np.float64)
        # a pipeline's loss is its last stage's: summed over the whole mesh
        total = ops.all_reduce(getattr(self.loss_fn, "norm_comm", self.comm), total)
        return float(self.device.to_host(total)[0]) / self.comm.world_size
