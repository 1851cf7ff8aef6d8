"""A ZeRO-3 step that JAX can hold: a pure function of arrays, for jit and scan.

[Note: pure steps]
``shard.zero3`` is a Python object that runs one step per call: its state
holds NumPy (or CuPy) buffers and its count is read on the host, so it cannot
run inside the user's ``jax.jit`` or ``jax.lax.scan`` over steps. A
:class:`PureStep` is the same algorithm written as one JAX function of a
:class:`PureState` whose every leaf is a JAX array, the count included:

- each split leaf is this rank's rows (``Shard(0)``, padded to a multiple of
  the world size with zero rows, as the rest of the library pads); scalars,
  empty leaves and ``Replicate()`` leaves are whole on every rank;
- the loss sees the whole params: a unit's split leaves are all-gathered
  where the program uses them, as one flat buffer, through a
  ``jax.custom_vjp`` whose derivative is the reduce-scatter of their
  gradients (a unit's replicated leaves' gradients are all-reduced, also as
  one buffer), so the gradients arrive sharded, each the mean over the data
  ranks of their losses' gradients;
- a model state (batch-norm statistics: ``init(params, model_state=...)``)
  is passed to the loss, which returns the new one, as for ``zero3``; after
  each step every rank holds the mean of its floating-point leaves over the
  ranks and rank 0's other leaves; with ``key=`` the loss gets ``key=`` the
  key folded with the step count and the rank (``zero3``'s keys);
- the optax transformation runs on the shards, as it would on the whole
  params for the element-wise transformations (Adam, AdamW, Lion, SGD with
  momentum, schedules); a ``clip_by_global_norm`` first in it gets the norm
  of the whole gradient (one all-reduce of the shards' sums of squares), and
  a transformation that reduces over a whole leaf (LAMB's trust ratio) is
  refused by name at ``init``.

The collectives are the rank's :class:`ops.Communicator` called through
*ordered* ``io_callback``s (see [Note: tensor-parallel collectives]): JAX keeps
them in program order under ``jit``, ``grad`` and ``scan``, so every rank
issues the same collectives in the same order. A callback's arrays are host
arrays: on a GPU each collective copies its input to the host and the result
back, which is what a held step pays for being held. The gathered params live
as long as XLA's schedule keeps them (from their use in the forward to their
use in the backward); ``zero3`` bounds them unit by unit instead. Each thread
rank compiles its own program (its callbacks close over its communicator).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ops import Communicator, FusedOptimizer
from shard.core._keys import check_key
from shard.core._layout import make_layout
from shard.core._loss import check_scalar, split_aux
from shard.core._optim import is_transformation
from shard.core._parts import PER_LEAF, check_parts, clip_first, describe, parts_of
from shard.step._checks import agree_on_layout
from shard.step._init import rows_of, split_over_devices
from shard.step._plan import FLOAT_DTYPES

__all__ = ["PureState", "PureStep", "pure_zero3"]


class PureState(NamedTuple):
    """One rank's state of a :class:`PureStep`: a pytree of JAX arrays.

    Attributes:
      params: this rank's rows of each split leaf (``rows_per_rank`` rows,
        padding rows zero) and the whole of each replicated leaf, in the
        params' tree.
      opt_state: the optax transformation's state over ``params``.
      step: int32 scalar, updates applied.
      model_state: the model's non-trainable state (batch-norm statistics),
        the same on every rank; None without one.
    """

    params: Any
    opt_state: Any
    step: Any
    model_state: Any = None


class PureStep:
    """ZeRO-3 as one JAX function (see [Note: pure steps]): ``init(params)``
    gives this rank's :class:`PureState`; ``step(state, batch)`` returns the
    next state and the metrics (``loss``: the mean over the ranks;
    ``grad_norm``: of the whole gradient; ``aux`` with ``has_aux``: its
    numbers averaged over the ranks, in float32), and runs inside ``jax.jit``,
    ``jax.lax.scan`` and
    ``jax.lax.fori_loop``. Every rank calls it with its own batch."""

    def __init__(self, loss_fn: Any, *, optimizer: Any, comm: Communicator,
                 specs: Any = None, units: Any = None, has_aux: bool = False,
                 key: Any = None) -> None:
        from shard.tensor_parallel._jax import Collectives

        if not callable(loss_fn):
            raise TypeError(f"pure_zero3: loss_fn must be a function (params, batch) -> loss; "
                            f"got {type(loss_fn).__name__}")
        if not is_transformation(optimizer):
            fused = " (ops.adamw and friends are zero3's kernels on its own buffers)" if \
                isinstance(optimizer, FusedOptimizer) else ""
            raise TypeError("pure_zero3: optimizer must be an optax GradientTransformation "
                            f"(optax.adamw(...)); got {type(optimizer).__name__}{fused}")
        if not hasattr(comm, "world_size"):
            raise TypeError("pure_zero3: comm must be this rank's ops.Communicator; got "
                            f"{type(comm).__name__}")
        self.loss_fn, self.optimizer, self.comm = loss_fn, optimizer, comm
        if key is not None:
            check_key("pure_zero3", key)
        self.specs, self.units, self.has_aux, self.key = specs, units, has_aux, key
        self.collectives = Collectives(comm)
        self.max_norm = clip_first(optimizer)
        self.layout: Any = None

    # -- state ------------------------------------------------------------------
    def init(self, params: Any, *, model_state: Any = None) -> PureState:
        """This rank's state for ``params`` (the whole params, the same on every
        rank: a collective compares their layouts). A JAX array split over
        several devices (a ``NamedSharding``) gives this rank's rows from the
        device shards that hold them, without a whole copy. ``model_state``:
        the model's non-trainable state, the same on every rank; the loss then
        takes it and returns the new one, as for ``zero3``."""
        import jax
        import jax.numpy as jnp

        fn, w = "pure_zero3.init", self.comm.world_size
        layout = make_layout(params, self.specs, world_size=w, units=self.units, fn=fn)
        for leaf in layout.leaves:
            if leaf.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{fn}: params{leaf.path} is {leaf.dtype}; the step trains "
                                "floating-point params: keep other leaves out of params")
        if w > 1 and any(leaf.sharded for leaf in layout.leaves):
            parts, what = parts_of(self.optimizer), describe(self.optimizer)
            whole = [p.name for p in parts if p.name in PER_LEAF]
            if whole:  # zero3 all-reduces their per-leaf sums between its passes
                raise TypeError(f"{fn}: optimizer= {what} holds {whole}, which reduces over "
                                "each whole leaf; this step keeps only its rows: use "
                                "shard.zero3, or an element-wise transformation")
            check_parts(self.optimizer, parts, layout, what, fn)
        agree_on_layout(self.comm, layout, fn)
        self.layout = layout
        groups: dict[tuple, list[int]] = {}  # (unit, split, dtype): its leaves, in order
        for i, leaf in sorted(enumerate(layout.leaves), key=lambda e: (e[1].unit, e[1].offset)):
            groups.setdefault((leaf.unit, leaf.sharded, leaf.dtype), []).append(i)
        self._groups = [(split, idx) for (_, split, _), idx in groups.items()]
        rank = self.comm.rank
        shards = []
        for leaf, x in zip(layout.leaves, layout.treedef.flatten_up_to(params), strict=True):
            lo = min(rank * leaf.rows_per_rank, leaf.rows)
            mine = rows_of(x, lo, min(lo + leaf.rows_per_rank, leaf.rows)) if (
                leaf.sharded and split_over_devices(x)) else None  # a NamedSharding's rows
            if mine is not None:
                out = np.zeros(leaf.local_shape, mine.dtype)
                out[:len(mine)] = mine
                x = out
            elif leaf.sharded:
                x = np.asarray(x)
                out = np.zeros(leaf.local_shape, x.dtype)
                layout.scatter_leaf(leaf, x, rank, out)
                x = out
            shards.append(jnp.asarray(x))
        mine = layout.treedef.unflatten(shards)
        if model_state is not None:
            model_state = jax.tree_util.tree_map(jnp.asarray, model_state)
        return PureState(mine, self.optimizer.init(mine), jnp.zeros((), jnp.int32), model_state)

    def _layout(self, fn: str) -> Any:
        if self.layout is None:
            raise RuntimeError(f"pure_zero3.{fn}: call init(params) first")
        return self.layout

    # -- the step ---------------------------------------------------------------
    def whole(self, params: Any) -> Any:
        """The whole params from this rank's shards ``params`` (a collective:
        every rank calls it), differentiable: the gradient of a split leaf is
        reduce-scattered, a replicated one's all-reduced (summed). One
        collective per unit and dtype: its split leaves' shards go as one flat
        buffer, as do its replicated leaves."""
        import jax.numpy as jnp

        layout, col, w = self._layout("whole"), self.collectives, self.comm.world_size
        leaves = layout.treedef.flatten_up_to(params)
        if w == 1:  # one rank's rows are the whole leaves
            return layout.treedef.unflatten([x.reshape(leaf.shape)
                                             for leaf, x in zip(layout.leaves, leaves,
                                                                strict=True)])
        out: list[Any] = [None] * len(leaves)
        for split, idx in self._groups:
            flat = jnp.concatenate([leaves[i].reshape(-1) for i in idx])
            if split:  # (W, S): rank r's shards in row r
                flat = col.apply("gather_sequence", flat, 0).reshape(w, -1)
            else:
                flat = col.apply("copy", flat)
            at = 0
            for i in idx:
                leaf = layout.leaves[i]
                if split:
                    part = flat[:, at:at + leaf.local_size].reshape(
                        w * leaf.rows_per_rank, *leaf.shape[1:])[:leaf.rows]
                else:
                    part = flat[at:at + leaf.size]
                out[i] = part.reshape(leaf.shape)
                at += leaf.local_size
        return layout.treedef.unflatten(out)

    def _loss(self, fn: Any, params: Any, state: PureState, batch: Any) -> tuple[Any, Any, Any]:
        """``fn`` on the whole ``params``: ``(loss, new model state, aux)``, with the
        model state and the key it takes (see [Note: pure steps])."""
        import jax

        # the model state rebuilt inside the traced function, so that containers that
        # remember the trace that made them (flax nnx Variables) take the loss's updates
        args = (batch,) if state.model_state is None else (
            batch, jax.tree_util.tree_map(lambda x: x, state.model_state))
        kw = {}
        if self.key is not None:  # shard.step_key's: the step, the rank, micro-batch 0
            key = self.key
            for v in (state.step, self.comm.rank, 0):
                key = jax.random.fold_in(key, v)
            kw["key"] = key
        out = fn(self.whole(params), *args, **kw)
        new = None
        if state.model_state is not None:
            what = "(loss, (new_model_state, aux))" if self.has_aux else "(loss, new_model_state)"
            if not (isinstance(out, (tuple, list)) and len(out) == 2) or (
                    self.has_aux and not (isinstance(out[1], (tuple, list)) and len(out[1]) == 2)):
                raise TypeError(f"pure_zero3: a loss with a model state returns {what}; got "
                                f"{type(out).__name__}")
            if self.has_aux:  # (loss, aux) for split_aux, and the new state
                out, new = (out[0], out[1][1]), out[1][0]
            else:
                out, new = out[0], out[1]
            if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(
                    state.model_state):
                raise TypeError("pure_zero3: the loss returned a model state of another "
                                "structure than the state's")
        value, aux = split_aux(out, self.has_aux)
        check_scalar(value)
        return value, new, aux

    def _same_everywhere(self, tree: Any) -> Any:
        """``tree`` made the same on every rank: floating-point leaves averaged,
        the others rank 0's (two collectives, as for ``zero3``'s model state)."""
        import jax
        import jax.numpy as jnp

        col, w = self.collectives, self.comm.world_size
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if w == 1 or not leaves:
            return tree
        out = list(leaves)
        for floating in (True, False):
            idx = [i for i, x in enumerate(leaves)
                   if bool(jnp.issubdtype(x.dtype, jnp.floating)) == floating]
            if not idx:
                continue
            kind = jnp.float32 if floating else jnp.int32
            flat = jnp.concatenate([leaves[i].reshape(-1).astype(kind) for i in idx])
            if floating:
                flat = col.all_reduce(flat) / w
            else:
                flat = col.all_reduce(flat if self.comm.rank == 0 else jnp.zeros_like(flat))
            at = 0
            for i in idx:
                n = leaves[i].size
                out[i] = flat[at:at + n].reshape(leaves[i].shape).astype(leaves[i].dtype)
                at += n
        return treedef.unflatten(out)

    def _mean(self, tree: Any) -> Any:
        """Every numeric leaf of ``tree`` averaged over the ranks, in float32 (one
        collective)."""
        import jax
        import jax.numpy as jnp

        leaves, treedef = jax.tree_util.tree_flatten(tree)
        w = self.comm.world_size
        if w == 1 or not leaves:
            return tree
        leaves = [jnp.asarray(x, jnp.float32) for x in leaves]
        flat = self.collectives.all_reduce(jnp.concatenate([x.reshape(-1) for x in leaves])) / w
        out, at = [], 0
        for x in leaves:
            out.append(flat[at:at + x.size].reshape(x.shape))
            at += x.size
        return treedef.unflatten(out)

    def evaluate(self, state: PureState, batch: Any, *, loss_fn: Any = None) -> Any:
        """The loss at ``state``'s params on this rank's ``batch``, averaged over
        the ranks (a collective), with no update: ``(loss, aux)`` with
        ``has_aux``. ``loss_fn``: another function of the same params (the
        model in eval mode); the model state it returns is dropped."""
        import jax.numpy as jnp

        self._layout("evaluate")
        value, _, aux = self._loss(loss_fn or self.loss_fn, state.params, state, batch)
        w = self.comm.world_size
        mean = self.collectives.all_reduce(jnp.asarray(value, jnp.float32)) / w if w > 1 \
            else value
        return (mean, self._mean(aux)) if self.has_aux else mean

    def __call__(self, state: PureState, batch: Any) -> tuple[PureState, dict[str, Any]]:
        import jax
        import jax.numpy as jnp
        import optax

        layout, col, w = self._layout("step"), self.collectives, self.comm.world_size

        def loss(shards: Any) -> Any:
            value, new, aux = self._loss(self.loss_fn, shards, state, batch)
            return value, (new, aux)

        (value, (model_state, aux)), grads = jax.value_and_grad(loss, has_aux=True)(
            state.params)
        if model_state is not None:
            model_state = self._same_everywhere(model_state)
        grads = jax.tree_util.tree_map(lambda g: g / w, grads)  # the sum over ranks: the mean
        flat = layout.treedef.flatten_up_to(grads)
        split = [jnp.sum(jnp.square(g.astype(jnp.float32)))
                 for leaf, g in zip(layout.leaves, flat, strict=True) if leaf.sharded]
        whole = [jnp.sum(jnp.square(g.astype(jnp.float32)))
                 for leaf, g in zip(layout.leaves, flat, strict=True) if not leaf.sharded]
        sumsq = sum(split, jnp.float32(0))
        if w > 1 and split:
            sumsq = col.all_reduce(sumsq)
        norm = jnp.sqrt(sumsq + sum(whole, jnp.float32(0)))
        if self.max_norm is not None:  # as optax.clip_by_global_norm, over the whole gradient
            scale = jnp.where(norm < self.max_norm, 1.0, self.max_norm / norm)
            grads = jax.tree_util.tree_map(lambda g: (g * scale).astype(g.dtype), grads)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        mean = col.all_reduce(jnp.asarray(value, jnp.float32)) / w if w > 1 else value
        metrics = {"loss": mean, "grad_norm": norm}
        if self.has_aux:  # averaged over the ranks, as zero3's
            metrics["aux"] = self._mean(aux)
        return PureState(params, opt_state, state.step + 1, model_state), metrics

    step = __call__


def pure_zero3(loss_fn: Any, *, optimizer: Any, comm: Communicator, specs: Any = None,
               units: Any = None, has_aux: bool = False, key: Any = None) -> PureStep:
    """ZeRO-3 as a pure JAX function of a :class:`PureState`, for the user's
    ``jax.jit`` and ``jax.lax.scan`` over steps (see [Note: pure steps]).

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (``(scalar, aux)`` with
        ``has_aux``), a JAX function of the whole params.
      optimizer: an optax ``GradientTransformation`` (element-wise, with an
        optional ``clip_by_global_norm`` first).
      comm: this rank's communicator.
      specs: ``Shard(0)`` (the default) or ``Replicate()`` per leaf, as for
        ``zero3``.
      units: how leaves group into units, as for ``zero3`` (default: the
        top-level subtrees); a unit's split leaves are gathered by one
        collective, its replicated ones' gradients reduced by another.
      has_aux: the loss returns ``(loss, aux)``.
      key: a JAX PRNG key: the loss is called with ``key=``, the key folded
        with the step count and the rank (``shard.step_key``'s, so the same
        keys as ``zero3(..., key=)``), after the model state if there is one.

    Example (each of 2 thread ranks):
      >>> import jax, jax.numpy as jnp, numpy as np, optax, ops, shard
      >>> def run(comm):
      ...     loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
      ...     step = shard.pure_zero3(loss, optimizer=optax.adam(1e-2), comm=comm)
      ...     state = step.init({"w": np.ones((3, 2), np.float32)})
      ...     batches = jnp.ones((4, 5, 3))  # four steps of this rank's rows
      ...     state, metrics = jax.jit(lambda s, b: jax.lax.scan(step, s, b))(state, batches)
      ...     return int(state.step), state.params["w"].shape
      >>> ops.spawn(run, 2)
      [(4, (2, 2)), (4, (2, 2))]
    """
    return PureStep(loss_fn, optimizer=optimizer, comm=comm, specs=specs, units=units,
                    has_aux=has_aux, key=key)
