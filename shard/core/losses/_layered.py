"""The unit-by-unit JAX losses: :class:`Layered`, a loss written as one layer per
unit, and :class:`_UnitLayer`, one layer compiled over its unit's flat params
buffer (the traced units of any JAX loss run as these too: see [Note: traced
units] in ``shard/step/_traced.py``). At stage 3 each unit is gathered just
before its layer runs and freed after (see [Note: ZeRO-3 schedule] in
``shard/step/_runtime.py``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ops.comm._programs import SharedJit
from ops.device._dlpack import jax_view
from shard.core._protocol import GradSink, LossProvider, UnitSource
from shard.monitor._profile import timed

if TYPE_CHECKING:
    import jax
    from jax.tree_util import PyTreeDef

    from shard.core._layout import Layout

    # a layer function, its unit's subtree structure, its leaves' (offset, size,
    # shape) in the unit's buffer, and the buffer's size
    _LayerKey = tuple[Callable[..., Any], PyTreeDef, tuple[tuple[int, int, tuple[int, ...]], ...],
                      int]
    # a kept forward's plan (forward, backward) and the residuals it kept
    _Saved = tuple[tuple[SharedJit, SharedJit], list[jax.Array]]

__all__ = ["Layered"]


class Layered(LossProvider):
    """A loss written as one JAX layer per unit.

    ``layers[i](params_i, carry, batch) -> carry`` where ``params_i`` is the
    i-th unit's subtree (in the order of the params' top-level subtrees, so a
    list of per-layer params lines up), ``carry`` is None for the first layer
    and the last layer returns the scalar loss.

    Examples:
      >>> import jax.numpy as jnp, shard
      >>> loss = shard.Layered([
      ...     lambda p, _, b: jnp.tanh(b["x"] @ p["w"]),
      ...     lambda p, h, b: jnp.mean((h @ p["w"] - b["y"]) ** 2)])
    """

    def __init__(self, layers: Sequence[Callable[..., object]], *,
                 activation_checkpointing: bool = False) -> None:
        if not layers:
            raise ValueError("Layered needs at least one layer")
        self.layers = list(layers)
        self.activation_checkpointing = activation_checkpointing
        self._fwd: list[SharedJit] = []
        self._bwd: list[SharedJit] = []
        self._unit_layers: dict[_LayerKey, _UnitLayer] = {}
        self._for_layout: dict[int, tuple[Layout, list[_UnitLayer]]] = {}
        self._lock = threading.Lock()  # thread ranks share one Layered

    def compiled(self) -> tuple[list[SharedJit], list[SharedJit]]:
        """Jitted forward and vector-Jacobian functions, one per layer."""
        with self._lock:
            if not self._fwd:
                import jax

                def make_bwd(f: Callable[..., object]) -> Callable[..., object]:
                    def bwd(p: object, c: object, b: object, ct: object) -> object:
                        return jax.vjp(lambda p, c: f(p, c, b), p, c)[1](ct)
                    return bwd

                self._bwd = [SharedJit(make_bwd(f)) for f in self.layers]
                self._fwd = [SharedJit(f) for f in self.layers]
        return self._fwd, self._bwd

    def unit_layers(self, layout: Layout) -> list[_UnitLayer]:
        """Each layer over its unit's flat params buffer (laid out as ``layout``'s
        unit); units of one geometry running one layer function share one, so
        each is traced and compiled once. Made once per layout, not per step."""
        found = self._for_layout.get(id(layout))
        if found is None or found[0] is not layout:
            subtrees = layout.treedef.children()
            if len(subtrees) != len(layout.units):
                raise ValueError("Layered needs units = the top-level subtrees of the params "
                                 "(units=None)")
            made = []
            for u, unit in enumerate(layout.units):
                pieces = tuple((layout.leaves[i].offset, layout.leaves[i].size,
                                layout.leaves[i].shape) for i in unit.leaves)
                key = (self.layers[u], subtrees[u], pieces, unit.local_size)
                with self._lock:
                    if key not in self._unit_layers:
                        self._unit_layers[key] = _UnitLayer(*key)
                    made.append(self._unit_layers[key])
            found = self._for_layout[id(layout)] = (layout, made)  # (kept: its id stays its)
        return found[1]

    def run_units(self, units: UnitSource, reducer: GradSink, batch: object,
                  scale: float) -> jax.Array:
        """One micro-batch unit by unit (see [Note: ZeRO-3 schedule]): ``units.flat``
        gives each unit's whole params as one buffer (one DLPack exchange, sliced
        into the leaves inside the compiled layer), ``reducer.add`` takes its
        gradients (of ``scale * loss``, one flat buffer's views); returns the loss
        (a jax scalar). Each layer's forward keeps VJP residuals for the
        backward (see [Note: what a forward keeps]), less those that are its
        own inputs (see :class:`_UnitLayer`):
        with ``activation_checkpointing`` it keeps only its input and recomputes
        the forward in the backward."""
        import jax

        n = len(self.layers)
        layers = self.unit_layers(units.full_layout)
        batch = placed(batch)
        carries: list[Any] = [None]
        saved: list[Any] = [None] * n  # Any: a _Saved, None once used
        for u in range(n):
            # the last unit's backward comes next: it stays gathered for it (as
            # FSDP2's root does), and the backward's first gather starts now
            flat = jax_view(units.flat(u, range(u + 1, n) if u < n - 1 else
                                       range(n - 2, -1, -1)))
            # Wait for the layer before dropping its params: JAX's async dispatch
            # would otherwise keep them alive into the next unit's compute.
            with timed("forward"):
                if self.activation_checkpointing:
                    carries.append(jax.block_until_ready(layers[u].apply(flat, carries[-1],
                                                                         batch)))
                else:
                    out, saved[u] = layers[u].forward(flat, carries[-1], batch)
                    carries.append(jax.block_until_ready(out))
            if u < n - 1:
                del flat
        loss = carries.pop()
        ct = np.asarray(scale, dtype=loss.dtype)  # the seed cotangent: host, no dispatch
        for u in reversed(range(n)):
            if u < n - 1:
                flat = jax_view(units.flat(u, range(u - 1, -1, -1)))
            with timed("backward"):
                if self.activation_checkpointing:
                    grad, ct = layers[u].recompute(flat, carries[u], batch, ct)
                else:
                    grad, ct = layers[u].backward(saved[u], flat, carries[u], batch, ct)
                    saved[u] = None
                jax.block_until_ready((grad, ct))
            del flat
            carries[u] = None
            reducer.add(u, units.leaf_views(u, units.device.from_jax(grad)))
        return loss

    def loss_units(self, units: UnitSource, batch: object) -> Any:
        """The loss, forward only, unit by unit (for ``ZeroStep.evaluate``)."""
        import jax

        n = len(self.layers)
        batch = placed(batch)
        carry = None
        for u in range(n):
            flat = jax_view(units.flat(u, range(u + 1, n)))
            carry = jax.block_until_ready(self.unit_layers(units.full_layout)[u].apply(
                flat, carry, batch))
            del flat  # (waited for: async dispatch would keep it alive)
        return carry


def placed(batch: object) -> object:
    """The batch with its numpy arrays made jax arrays once for every layer of the
    step (a jitted call would convert them at each): copied in by one call of a
    compiled identity, whose arguments JAX's C++ dispatch converts (31 us for an
    image batch's two leaves, where ``jax.device_put``'s Python took 182 us: a
    thread rank's step holds the GIL for it)."""
    import jax

    leaves, tree = jax.tree_util.tree_flatten(batch)
    at = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray)]
    if not at:
        return batch
    for i, x in zip(at, _to_device()(*(leaves[i] for i in at)), strict=True):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(tree, leaves)


@functools.cache
def _to_device() -> Callable[..., tuple[jax.Array, ...]]:
    import jax

    return jax.jit(lambda *xs: xs)


def kept_vjp(f: Callable[..., Any], *primals: object,
             has_aux: bool = False) -> tuple[Any, ...]:
    """``jax.vjp(f, *primals)`` whose residuals are the ones a layer's forward
    keeps for its backward (see [Note: what a forward keeps]).

    [Note: what a forward keeps]
    A layer's (or a traced segment's) forward keeps the outputs of its matrix
    products without batch dimensions and of its convolutions; its backward,
    one compiled call, recomputes the rest from them and from its inputs
    (elementwise functions, normalisations, softmax, matrix products with
    batch dimensions such as attention's scores and weighted values): ``f``
    runs under ``jax.checkpoint`` with that policy (JAX's
    ``dots_with_no_batch_dims_saveable``, convolutions added). XLA does much
    the same inside one program, where it fuses the elementwise work into its
    neighbours instead of writing it out. Keeping every residual, as
    ``jax.vjp`` alone does, wrote each of them out of the forward and read it
    back: a block of the equinox encoder of ``benchmarks/jax_models.py`` (half
    its batch) kept 35 arrays, 4.87 MB, against 6 arrays, 1.18 MB, and the
    encoder's ZeRO-3 step at 2 thread ranks took a median 63.1 against
    67.2 ms (eight runs of each, interleaved with the tree before). The
    gradients are ``jax.vjp``'s, to rounding where XLA fuses a recomputed
    value otherwise than the forward did. A forward with effects that
    ``jax.checkpoint`` refuses (the ordered host callbacks of synchronised
    batch statistics) keeps every residual.
    """
    import jax

    def vjp(fn: Callable[..., Any]) -> tuple[Any, ...]:
        return jax.vjp(fn, *primals, has_aux=True) if has_aux else jax.vjp(fn, *primals)

    try:
        return vjp(jax.checkpoint(f, policy=_kept))
    except NotImplementedError:  # "Effects not supported in partial-eval of checkpoint"
        return vjp(f)


def _kept(prim: Any, *_: Any, **params: Any) -> bool:
    from jax import lax

    if prim is lax.dot_general_p:
        _, (lhs_batch, rhs_batch) = params["dimension_numbers"]
        return not lhs_batch and not rhs_batch
    return prim is lax.conv_general_dilated_p


class _UnitLayer:
    """One layer over its unit's flat params buffer: compiled forward, forward
    keeping its VJP residuals, and backward; the params are sliced out of the
    buffer inside the compiled functions, and the backward returns the params'
    gradient as one buffer of the same layout.

    The kept forward runs :func:`kept_vjp` under ``jax.jit`` and returns the
    residuals except those that are the layer's own inputs (a weight a matrix
    product needs in its backward, the layer's input): it finds them by
    identity while tracing, and the backward puts the inputs it is handed back
    in their place. So no residual pins a copy of a unit's params (stage 3
    re-gathers them for the backward, as it would to recompute). The compiled
    forward, and which of its residuals are inputs, are kept per input
    structure and shapes.
    """

    def __init__(self, f: Callable[..., Any], treedef: PyTreeDef,
                 pieces: tuple[tuple[int, int, tuple[int, ...]], ...], size: int) -> None:
        import jax

        self.f, self.treedef, self.pieces, self.size = f, treedef, pieces, size
        self._plans: dict[tuple[PyTreeDef, tuple[tuple[tuple[int, ...], object], ...]],
                          tuple[SharedJit, SharedJit]] = {}
        self._lock = threading.Lock()
        self.apply = SharedJit(lambda flat, c, b: f(self.params(flat), c, b))

        def recompute(flat: jax.Array, c: object, b: object,
                      ct: object) -> tuple[jax.Array, object]:
            g, dc = jax.vjp(lambda ls, c: f(self.treedef.unflatten(ls), c, b),
                            self.leaves(flat), c)[1](ct)
            return self.flat_grad(g, flat.dtype), dc

        self.recompute = SharedJit(recompute)

    def leaves(self, flat: jax.Array) -> list[jax.Array]:
        return [flat[o:o + n].reshape(shape) for o, n, shape in self.pieces]

    def params(self, flat: jax.Array) -> object:
        return self.treedef.unflatten(self.leaves(flat))

    def flat_grad(self, grads: list[jax.Array], dtype: np.dtype) -> jax.Array:
        """The leaves' gradients as one buffer laid out as the params'.

        [Note: joining leaves in XLA]
        Each leaf's gradient is written into a zero buffer at its offset
        (``dynamic_update_slice``), not joined with ``jnp.concatenate``: XLA's
        CPU backend was several times slower with the concatenate. The
        segment of the MNIST CNN's linear layer (3136 x 256) took 11-13 ms a
        backward call at 2 thread ranks with it and 2.7 ms without; the CNN's
        ZeRO-3 step went from 44 to 31 ms (``python benchmarks/jax_models.py``).
        The values are the same.
        """
        import jax
        import jax.numpy as jnp

        out = jnp.zeros(self.size, dtype)
        for (o, _, _), g in zip(self.pieces, grads, strict=True):
            out = jax.lax.dynamic_update_slice(out, jnp.ravel(g).astype(dtype), (o,))
        return out

    def forward(self, flat: jax.Array, c: object, b: object) -> tuple[object, _Saved]:
        """``(output, saved)``: the layer's output and what :meth:`backward` needs."""
        import jax

        leaves, structure = jax.tree_util.tree_flatten((flat, c, b))
        key = (structure, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves))
        plan = self._plans.get(key)
        if plan is None:
            with self._lock:  # thread ranks: one of them traces, the others wait
                plan = self._plans.get(key)
                if plan is None:
                    plan = self._plan()
                    plan[0].prepare(flat, c, b)  # traces (fills the plan's sources); runs nothing
                    self._plans[key] = plan
        out, kept = plan[0](flat, c, b)
        return out, (plan, kept)

    def _plan(self) -> tuple[SharedJit, SharedJit]:
        import jax

        sources: list[int | None] = []
        meta: list[PyTreeDef] = []  # the residuals' structure, set while tracing

        def fwd(flat: jax.Array, c: object, b: object) -> tuple[object, list[jax.Array]]:
            ls = self.leaves(flat)
            out, vjp = kept_vjp(lambda ls, c: self.f(self.treedef.unflatten(ls), c, b), ls, c)
            res, structure = jax.tree_util.tree_flatten(vjp)
            ins = {id(x): k for k, x in enumerate(jax.tree_util.tree_leaves((ls, c, b)))}
            sources[:] = [ins.get(id(r)) for r in res]
            meta[:] = [structure]
            return out, [r for r, s in zip(res, sources, strict=True) if s is None]

        def bwd(kept: list[jax.Array], flat: jax.Array, c: object, b: object,
                ct: object) -> tuple[jax.Array, object]:
            ins = jax.tree_util.tree_leaves((self.leaves(flat), c, b))
            rest = iter(kept)
            res = [next(rest) if s is None else ins[s] for s in sources]
            g, dc = jax.tree_util.tree_unflatten(meta[0], res)(ct)
            return self.flat_grad(g, flat.dtype), dc

        return SharedJit(fwd), SharedJit(bwd)

    def backward(self, saved: _Saved, flat: jax.Array, c: object, b: object,
                 ct: object) -> tuple[jax.Array, Any]:
        """``(d params, d carry)`` of the cotangent ``ct``, from the saved residuals
        and the layer's inputs (params gathered again); d params is one buffer
        laid out as ``flat``."""
        (_, bwd), kept = saved
        return bwd(kept, flat, c, b, ct)
