"""Loss functions the ZeRO transforms accept, and how their gradients are taken.

Three forms:
- a JAX function ``loss_fn(params, batch) -> scalar``: gradients by
  ``jax.value_and_grad``. At stage 3 every unit is gathered before it runs.
- :class:`Layered`: a chain of per-unit JAX layers. At stage 3 each unit is
  gathered just before its layer runs and freed after (see [Note: ZeRO-3
  schedule] in ``shard/_zero.py``).
- any object with ``value_and_grad(params, batch) -> (loss, grads)`` (the torch
  adapter is one). With dynamic loss scaling it is called with
  ``loss_scale=s`` and must return the gradients of ``s * loss``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Layered"]


class Layered:
    """A loss written as one JAX layer per unit.

    ``layers[i](params_i, carry, batch) -> carry`` where ``params_i`` is the
    i-th unit's subtree (in the order of the params' top-level subtrees, so a
    list of per-layer params lines up), ``carry`` is None for the first layer
    and the last layer returns the scalar loss.

    Example:
      >>> import jax.numpy as jnp, shard
      >>> loss = shard.Layered([
      ...     lambda p, _, b: jnp.tanh(b["x"] @ p["w"]),
      ...     lambda p, h, b: jnp.mean((h @ p["w"] - b["y"]) ** 2)])
    """

    def __init__(self, layers: Sequence[Callable[..., Any]]) -> None:
        if not layers:
            raise ValueError("Layered needs at least one layer")
        self.layers = list(layers)
        self._fwd: list[Any] = []
        self._bwd: list[Any] = []
        self._lock = threading.Lock()  # thread ranks share one Layered

    def compiled(self) -> tuple[list[Any], list[Any]]:
        """Jitted forward and vector-Jacobian functions, one per layer."""
        with self._lock:
            if not self._fwd:
                import jax

                def make_bwd(f: Callable[..., Any]) -> Callable[..., Any]:
                    def bwd(p: Any, c: Any, b: Any, ct: Any) -> Any:
                        return jax.vjp(lambda p, c: f(p, c, b), p, c)[1](ct)
                    return bwd

                self._bwd = [jax.jit(make_bwd(f)) for f in self.layers]
                self._fwd = [jax.jit(f) for f in self.layers]
        return self._fwd, self._bwd


class JaxLoss:
    """A monolithic JAX loss with a jitted, loss-scaled value_and_grad."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        import jax

        self.fn = fn
        self._vg = jax.jit(jax.value_and_grad(lambda p, b, s: fn(p, b) * s))

    def value_and_grad(self, params: Any, batch: Any, loss_scale: float = 1.0) -> tuple[Any, Any]:
        scaled, grads = self._vg(params, batch, loss_scale)
        return scaled / loss_scale, grads  # stays a jax array: no host read


def classify(loss_fn: Any) -> str:
    """'layered', 'provider' or 'jax'; a TypeError for anything else."""
    if isinstance(loss_fn, Layered):
        return "layered"
    if hasattr(loss_fn, "value_and_grad"):
        return "provider"
    if callable(loss_fn):
        return "jax"
    raise TypeError(f"loss_fn must be a JAX function (params, batch) -> loss, a shard.Layered, or "
                    f"an object with value_and_grad(params, batch); got {type(loss_fn).__name__}")
