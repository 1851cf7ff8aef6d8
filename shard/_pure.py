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
use in the backward); ``zero3`` bounds them unit by unit instead. The thread
ranks of a group that share the loss function and the optax transformation
object share one compiled program (see [Note: one program for the ranks] in
``shard/_pure_program.py``); inside the user's own ``jit`` or ``scan`` each
rank compiles the user's program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ops import Communicator, FusedOptimizer
from shard._pure_program import Program, ensure, program_for, register
from shard.core._data_rank import check_key
from shard.core._layout import make_layout, min_num_params_of
from shard.core._optim import is_transformation
from shard.core._parts import PER_LEAF, check_parts, clip_first, describe, parts_of
from shard.step._checks import agree_on_layout
from shard.step._frozen import frozen_leaves
from shard.step._init import host_copy, rows_of, split_over_devices
from shard.step._plan import FLOAT_DTYPES

if TYPE_CHECKING:
    import jax
    import optax

    from shard.core._layout import Units

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
    step: jax.Array
    model_state: Any = None


class PureStep:
    """ZeRO-3 as one JAX function (see [Note: pure steps]): ``init(params)``
    gives this rank's :class:`PureState`; ``step(state, batch)`` returns the
    next state and the metrics (``loss``: the mean over the ranks;
    ``grad_norm``: of the whole gradient; ``aux`` with ``has_aux``: its
    numbers averaged over the ranks, in float32), and runs inside ``jax.jit``,
    ``jax.lax.scan`` and ``jax.lax.fori_loop``. Every rank calls it with its
    own batch."""

    def __init__(self, loss_fn: Callable[..., object], *, optimizer: optax.GradientTransformation,
                 comm: Communicator, specs: object = None, units: Units = None,
                 has_aux: bool = False, key: jax.Array | None = None, trainable: object = None,
                 axis_name: str | None = None, min_num_params: int = 0) -> None:
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
        if key is not None:
            check_key("pure_zero3", key)
        if axis_name is not None and not isinstance(axis_name, str):
            raise TypeError(f"pure_zero3: axis_name must be a string (the name the loss's "
                            f"jax.lax.pmean uses); got {type(axis_name).__name__}")
        self.axis_name = axis_name
        self.min_num_params = min_num_params_of("pure_zero3", min_num_params)
        self.loss_fn, self.optimizer, self.comm = loss_fn, optimizer, comm
        self.specs, self.units, self.has_aux, self.key = specs, units, has_aux, key
        self.trainable = trainable
        self.max_norm = clip_first(optimizer)
        self.group = register(comm)
        self.program: Program | None = None

    # -- state ------------------------------------------------------------------
    def init(self, params: object, *, model_state: object = None) -> PureState:
        """This rank's state for ``params`` (the whole params, the same on every
        rank: a collective compares their layouts). A JAX array split over
        several devices (a ``NamedSharding``) gives this rank's rows from the
        device shards that hold them, without a whole copy. ``model_state``:
        the model's non-trainable state, the same on every rank; the loss then
        takes it and returns the new one, as for ``zero3``."""
        import jax
        import jax.numpy as jnp

        fn, w = "pure_zero3.init", self.comm.world_size
        layout = make_layout(params, self.specs, world_size=w, units=self.units,
                             min_num_params=self.min_num_params, fn=fn)
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
        frozen = frozen_leaves(self.trainable, None, params, fn)
        self.program = program_for(self.group, w, self.loss_fn, self.optimizer, layout,
                                   self.has_aux, self.max_norm, frozen, self.axis_name)
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
                x = host_copy(x)
                out = np.zeros(leaf.local_shape, x.dtype)
                layout.scatter_leaf(leaf, x, rank, out)
                x = out
            elif not isinstance(x, jax.Array):
                x = host_copy(x)  # a device array (CuPy's) copied explicitly
            shards.append(jnp.asarray(x))
        mine = layout.treedef.unflatten(shards)
        if model_state is not None:
            model_state = jax.tree_util.tree_map(jnp.asarray, model_state)
        return PureState(mine, self.program.optimizer.init(mine), jnp.zeros((), jnp.int32),
                         model_state)

    def _program(self, fn: str) -> Program:
        if self.program is None:
            raise RuntimeError(f"pure_zero3.{fn}: call init(params) first")
        return self.program

    def _rank(self) -> jax.Array:
        import jax.numpy as jnp

        ensure(self.comm, self.group)
        return jnp.asarray(self.comm.rank, jnp.int32)

    # -- the step ---------------------------------------------------------------
    def whole(self, params: object) -> Any:
        """The whole params from this rank's shards ``params`` (a collective:
        every rank calls it), differentiable: the gradient of a split leaf is
        reduce-scattered, a replicated one's all-reduced (summed). One
        collective per unit and dtype: its split leaves' shards go as one flat
        buffer, as do its replicated leaves."""
        return self._program("whole").run("whole", (params, self._rank()))

    def evaluate(self, state: PureState, batch: object, *,
                 loss_fn: Callable[..., object] | None = None) -> jax.Array | tuple[jax.Array, Any]:
        """The loss at ``state``'s params on this rank's ``batch``, averaged over
        the ranks (a collective), with no update: ``(loss, aux)`` with
        ``has_aux``. ``loss_fn``: another function of the same params (the
        model in eval mode); the model state it returns is dropped."""
        return self._program("evaluate").run("evaluate", (state, batch, self._rank(), self.key),
                                             fn=loss_fn or self.loss_fn)

    def __call__(self, state: PureState, batch: object) -> tuple[PureState, dict[str, Any]]:
        return self._program("step").run("step", (state, batch, self._rank(), self.key))

    step = __call__


def pure_zero3(loss_fn: Callable[..., object], *, optimizer: optax.GradientTransformation,
               comm: Communicator, specs: object = None, units: Units = None,
               has_aux: bool = False, key: jax.Array | None = None, trainable: object = None,
               axis_name: str | None = None, min_num_params: int = 0) -> PureStep:
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
      min_num_params: join consecutive units until each holds this many
        elements, as for ``zero3`` (``ZeroOptions(min_num_params=)``).
      has_aux: the loss returns ``(loss, aux)``.
      key: a JAX PRNG key: the loss is called with ``key=``, the key folded
        with the step count and the rank (``shard.step_key``'s, so the same
        keys as ``zero3(..., key=)``), after the model state if there is one.
      trainable: which leaves train, as for ``zero3`` (a pytree of bools, a
        prefix of one, or a function of the params returning one): a frozen
        leaf is gathered but never differentiated (no reduce-scatter) and
        keeps no optimizer state (``optax.masked``); its value stays as given.
      axis_name: the data ranks' axis name inside the loss, as under
        ``shard_map``: ``jax.lax.pmean(x, axis_name)`` is the mean over the
        ranks (``psum`` and ``axis_index`` too), so flax's
        ``BatchNorm(axis_name=...)`` normalises with the global batch's
        statistics, as torch's ``SyncBatchNorm`` (see [Note: the data axis in
        the loss] in ``shard/core/_data_rank.py``).

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
                    has_aux=has_aux, key=key, trainable=trainable, axis_name=axis_name,
                    min_num_params=min_num_params)
