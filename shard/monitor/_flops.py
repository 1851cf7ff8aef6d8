"""A step's model FLOPs: :class:`FlopCount`.

[Note: model FLOPs]
With ``ZeroOptions(count_flops=True)`` (or a ``peak_flops``) a step's metrics
carry ``flops``: the floating-point operations of this rank's forward and
backward over the step's micro-batches (the optimizer's are left out, as in
the MFU of the PaLM and Megatron papers), ``flops_per_s``, those over the
step's wall time, and with ``peak_flops`` (this rank's peak, FLOP/s, as the
user states it for the device and dtype) ``mfu``, their ratio. They are
counted once per batch shape and kept: a JAX loss's from its compiled
program (XLA's cost analysis of the jitted value and gradient: the model's
FLOPs, whatever the step's unit schedule runs), a torch module's by torch's
``FlopCounterMode`` around the first step of that shape (the matrix
products and convolutions it ran, activation recomputation included). A
matrix product of ``m x k`` by ``k x n`` counts ``2 m k n``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ops._types import tree_util

if TYPE_CHECKING:
    import jax.stages

__all__ = ["FlopCount", "signature"]


def signature(tree: object) -> tuple:
    """A batch's structure, shapes and dtypes: what its FLOPs depend on."""
    leaves, treedef = tree_util().tree_flatten(tree)
    return (str(treedef), tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", "")))
                                for x in leaves))


def xla_flops(jitted: jax.stages.Wrapped, *args: object) -> float:
    """The FLOPs XLA's cost analysis gives for ``jitted`` at ``args`` (arrays or
    ``jax.ShapeDtypeStruct``), compiled for nothing but the count."""
    cost = jitted.lower(*args).cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


class FlopCount:
    """A step's FLOP counts by loss and batch signature, made once each."""

    def __init__(self) -> None:
        self._known: dict[tuple, float] = {}
        self.step = 0.0  # the FLOPs of the micro-batches counted since the last reset

    @contextlib.contextmanager
    def micro_batch(self, how: str | None, loss: object, batch: object,
                    program: Callable[[], float]) -> Iterator[None]:
        """Count one micro-batch of ``loss`` on ``batch``: ``how`` is ``"xla"``
        (``program()`` gives the count) or ``"torch"`` (counted around the run
        inside this block, the first time)."""
        key = (id(loss), signature(batch))
        known = self._known.get(key)
        if known is None and how == "xla":
            known = self._known[key] = program()
        if known is not None or how != "torch":
            yield
            self.step += known or 0.0
            return
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            yield
        self._known[key] = float(counter.get_total_flops())
        self.step += self._known[key]
