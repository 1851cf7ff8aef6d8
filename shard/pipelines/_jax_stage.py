"""A ``shard.Layered`` loss's layers as one pipeline stage (see [Note: pipeline]
in ``shard/pipelines/_pipeline.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ops.device._dlpack import jax_view
from shard.core.losses._layered import Layered
from shard.monitor._profile import timed

if TYPE_CHECKING:
    import jax
    import numpy as np

    from shard.core._protocol import GradSink
    from shard.step._runtime import Units

__all__ = ["JaxStage"]


class JaxStage:
    """A ``Layered`` loss's layers of one stage over a step's micro-batches:
    ``forward(k, x, batch)`` and ``backward(k, ct)`` in the schedule's order,
    then ``finish(reducer)`` (the runner protocol ``interop.torch.layered``'s
    stages share)."""

    def __init__(self, loss: Layered, units: Units, layers: range, checkpointing: bool) -> None:
        fwd, bwd = loss.compiled()
        self.fwd, self.bwd = [fwd[i] for i in layers], [bwd[i] for i in layers]
        self.units, self.checkpointing = units, checkpointing
        self.subtrees = units.layout.treedef.children()
        n = len(self.fwd)
        self.grads: list[Any] = [None] * n
        self.carries: dict[int, tuple[list[Any], Any]] = {}
        self.forward_passes = 0
        # stages 0-2 keep whole params for the step: view them once; stage 3
        # gathers a unit each time it computes (its memory bound)
        self.whole = [self._view(u) for u in range(n)] if units.stage < 3 else None

    def _view(self, u: int) -> object:
        return self.subtrees[u].unflatten([jax_view(x) for x in self.units.get(u)])

    def _tree(self, u: int) -> object:
        return self.whole[u] if self.whole is not None else self._view(u)

    def _run(self, carry: object, batch: object, upto: int) -> tuple[Any, list[Any]]:
        import jax

        saved = []
        for u in range(upto):
            saved.append(carry)
            with timed("forward"):
                carry = jax.block_until_ready(self.fwd[u](self._tree(u), carry, batch))
            self.forward_passes += 1
        return carry, saved

    def forward(self, k: int, x: np.ndarray | None, batch: object) -> jax.Array:
        import jax.numpy as jnp

        out, saved = self._run(None if x is None else jnp.asarray(x), batch, len(self.fwd))
        self.out_dtype = jnp.result_type(out)  # on the last stage: the loss's, for its cotangent
        self.carries[k] = (saved[:1] if self.checkpointing else saved, batch)
        return out

    # ct: the loss's cotangent (a float) or a received array, rebound to its jax array
    def backward(self, k: int, ct: Any) -> jax.Array:
        import jax
        import jax.numpy as jnp

        saved, batch = self.carries.pop(k)
        n = len(self.fwd)
        if self.checkpointing:  # the layers' inputs, computed again
            last_input, inputs = self._run(saved[0], batch, n - 1)
            saved = [*inputs, last_input]
        ct = jnp.asarray(ct, dtype=self.out_dtype) if isinstance(ct, float) else jnp.asarray(ct)
        for u in reversed(range(n)):
            with timed("backward"):
                g, ct = jax.block_until_ready(self.bwd[u](self._tree(u), saved[u], batch, ct))
            self.grads[u] = g if self.grads[u] is None else jax.tree_util.tree_map(
                jnp.add, self.grads[u], g)
        return ct

    def finish(self, reducer: GradSink) -> None:
        for u in range(len(self.fwd)):
            reducer.add(u, self.subtrees[u].flatten_up_to(self.grads[u]))
