"""Loss functions the ZeRO transforms accept, and how their gradients are taken.

Three forms:
- a JAX function ``loss_fn(params, batch) -> scalar``: gradients by
  ``jax.value_and_grad``. At stage 3 every unit is gathered before it runs.
- :class:`Layered`: a chain of per-unit JAX layers. At stage 3 each unit is
  gathered just before its layer runs and freed after (see [Note: ZeRO-3
  schedule] in ``shard/_runtime.py``).
- any object with ``value_and_grad(params, batch) -> (loss, grads)`` (the torch
  adapter is one). With dynamic loss scaling it is called with
  ``loss_scale=s`` and must return the gradients of ``s * loss``.

The unit-by-unit protocol (``Layered`` has it; an object may too, as the torch
adapter does, to run stage 3 within the memory bound):
``run_units(units, reducer, batch, scale) -> loss``, where ``units.get(u,
upcoming)`` returns unit ``u``'s full leaves (starting the gathers of
``upcoming``), ``reducer.add(u, grads)`` takes its leaf gradients of ``scale *
loss`` (arrays of the state's device, torch tensors or jax arrays on it, or
None for zero), and the loss is a number or a scalar array.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ops._dlpack import jax_view
from shard._profile import timed

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

    def __init__(self, layers: Sequence[Callable[..., Any]], *,
                 activation_checkpointing: bool = False) -> None:
        if not layers:
            raise ValueError("Layered needs at least one layer")
        self.layers = list(layers)
        self.activation_checkpointing = activation_checkpointing
        self._fwd: list[Any] = []
        self._bwd: list[Any] = []
        self._vjp: list[_LayerVJP] = []
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
                self._vjp = [_LayerVJP(f) for f in self.layers]
        return self._fwd, self._bwd

    def run_units(self, units: Any, reducer: Any, batch: Any, scale: float) -> Any:
        """One micro-batch unit by unit (see [Note: ZeRO-3 schedule]): ``units.get``
        gives each unit's full leaves, ``reducer.add`` takes its gradients (of
        ``scale * loss``); returns the loss (a jax scalar). Each layer's forward
        keeps its VJP residuals for the backward, less those that are its own
        inputs (see :class:`_LayerVJP`): with ``activation_checkpointing`` it
        keeps only its input and recomputes the forward in the backward."""
        import jax
        import jax.numpy as jnp

        layout = units.layout
        subtrees = layout.treedef.children()
        if len(subtrees) != len(layout.units):
            raise ValueError("Layered needs units = the top-level subtrees of the params "
                             "(units=None)")

        def tree(u: int, leaves: list[Any]) -> Any:
            return subtrees[u].unflatten([jax_view(x) for x in leaves])

        fwd, bwd = self.compiled()
        n = len(fwd)
        carries: list[Any] = [None]
        saved: list[Any] = [None] * n
        for u in range(n):
            params = tree(u, units.get(u, range(u + 1, n)))
            # Wait for the layer before dropping its params: JAX's async dispatch
            # would otherwise keep them alive into the next unit's compute.
            with timed("forward"):
                if self.activation_checkpointing:
                    carries.append(jax.block_until_ready(fwd[u](params, carries[-1], batch)))
                else:
                    out, saved[u] = self._vjp[u].forward(params, carries[-1], batch)
                    carries.append(jax.block_until_ready(out))
            del params
        loss = carries.pop()
        ct = jnp.asarray(scale, dtype=jnp.result_type(loss))
        for u in reversed(range(n)):
            params = tree(u, units.get(u, range(u - 1, -1, -1)))
            with timed("backward"):
                if self.activation_checkpointing:
                    g_params, ct = bwd[u](params, carries[u], batch, ct)
                else:
                    g_params, ct = self._vjp[u].backward(saved[u], params, carries[u], batch,
                                                         ct)
                    saved[u] = None
                jax.block_until_ready((g_params, ct))
            del params
            carries[u] = None
            reducer.add(u, subtrees[u].flatten_up_to(g_params))
        return loss

    def loss_units(self, units: Any, batch: Any) -> Any:
        """The loss, forward only, unit by unit (for ``ZeroStep.evaluate``)."""
        import jax

        subtrees = units.layout.treedef.children()
        fwd, _ = self.compiled()
        carry = None
        for u in range(len(fwd)):
            params = subtrees[u].unflatten([jax_view(x) for x in
                                            units.get(u, range(u + 1, len(fwd)))])
            carry = jax.block_until_ready(fwd[u](params, carry, batch))
            del params  # (waited for: async dispatch would keep it alive)
        return carry


class _LayerVJP:
    """One layer's forward keeping its VJP residuals, and the backward from them.

    The forward runs ``jax.vjp`` under ``jax.jit`` and returns the residuals
    except those that are the layer's own inputs (a weight a matrix product
    needs in its backward, the layer's input): it finds them by identity
    while tracing, and the backward puts the inputs it is handed back in
    their place. So no residual pins a copy of a unit's params (stage 3
    re-gathers them for the backward, as it would to recompute), while the
    backward costs what autograd's does. The compiled forward, and which of
    its residuals are inputs, are kept per input structure and shapes.
    """

    def __init__(self, f: Callable[..., Any]) -> None:
        import jax

        self.f = f
        self._plans: dict[Any, tuple[Any, list[int | None], list[Any]]] = {}
        self._apply = jax.jit(lambda vjp, ct: vjp(ct))
        self._lock = threading.Lock()

    def forward(self, p: Any, c: Any, b: Any) -> tuple[Any, Any]:
        """``(output, saved)``: the layer's output and what :meth:`backward` needs."""
        import jax

        leaves, structure = jax.tree_util.tree_flatten((p, c, b))
        key = (structure, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves))
        plan = self._plans.get(key)
        if plan is None:
            with self._lock:  # thread ranks: one of them traces, the others wait
                plan = self._plans.get(key)
                if plan is None:
                    plan = self._plan()
                    out, kept = plan[0](p, c, b)  # traces: fills the plan's sources
                    self._plans[key] = plan
                    return out, (plan, kept)
        out, kept = plan[0](p, c, b)
        return out, (plan, kept)

    def _plan(self) -> tuple[Any, list[int | None], list[Any]]:
        import jax

        sources: list[int | None] = []
        meta: list[Any] = []  # the residuals' structure, set while tracing

        def fwd(p: Any, c: Any, b: Any) -> Any:
            out, vjp = jax.vjp(lambda p, c: self.f(p, c, b), p, c)
            res, structure = jax.tree_util.tree_flatten(vjp)
            ins = {id(x): k for k, x in enumerate(jax.tree_util.tree_leaves((p, c, b)))}
            sources[:] = [ins.get(id(r)) for r in res]
            meta[:] = [structure]
            return out, [r for r, s in zip(res, sources, strict=True) if s is None]

        return jax.jit(fwd), sources, meta

    def backward(self, saved: Any, p: Any, c: Any, b: Any, ct: Any) -> tuple[Any, Any]:
        """The gradients ``(d params, d carry)`` of the cotangent ``ct``, from the
        saved residuals and the layer's inputs (params gathered again)."""
        import jax

        (_, sources, meta), kept = saved
        ins = jax.tree_util.tree_leaves((p, c, b))
        rest = iter(kept)
        res = [next(rest) if s is None else ins[s] for s in sources]
        return self._apply(jax.tree_util.tree_unflatten(meta[0], res), ct)


class JaxLoss:
    """A monolithic JAX loss with a jitted, loss-scaled value_and_grad."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        import jax

        self.fn = fn
        self._vg = jax.jit(jax.value_and_grad(lambda p, b, s: fn(p, b) * s))
        self.loss_value = jax.jit(fn)

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
