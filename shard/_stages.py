"""The public transforms: ``zero0`` (plain data parallelism) to ``zero3``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ops import Communicator
from shard.core._mesh import Mesh, Topology
from shard.core._policy import Precision
from shard.offload._offload import Offload
from shard.step._config import ZeroOptions, option_docs, resolve_topology
from shard.step._step import ZeroStep
from shard.tensor_parallel._parallel import TensorParallel

if TYPE_CHECKING:
    import jax

__all__ = ["zero0", "zero1", "zero2", "zero3"]


def _make(stage: int) -> Callable[..., ZeroStep]:
    name = f"zero{stage}"

    # loss_fn: a JAX function, a Layered or an object with value_and_grad, told apart by
    # classify; optimizer: a fused one or an optax transformation, checked by the step
    def transform(loss_fn: object, /, *, optimizer: object, mesh: Mesh | None = None,
                  comm: Communicator | None = None, specs: object = None, trainable: object = None,
                  precision: Precision | None = None, offload: Offload | None = None,
                  clip_norm: float | None = None, has_aux: bool = False,
                  options: ZeroOptions | None = None) -> ZeroStep:
        if options is not None and not isinstance(options, ZeroOptions):
            raise TypeError(f"{name}: options must be a shard.ZeroOptions(...); got "
                            f"{type(options).__name__}")
        opts = (options or ZeroOptions()).merged(
            name, specs=specs, trainable=trainable, precision=precision, offload=offload,
            clip_norm=clip_norm, has_aux=has_aux)
        split = opts.specs if isinstance(opts.specs, TensorParallel) else None
        if split is not None:  # the params' split over the mesh's model axis
            opts = dataclasses.replace(opts, specs=None)

        topology, tp = resolve_topology(name, stage, loss_fn, mesh=mesh, comm=comm,
                                        tensor_parallel=split,
                                        reshard_after_forward=opts.reshard_after_forward)
        fn = loss_fn
        if opts.axis_name is not None:  # see [Note: the data axis in the loss]
            fn = _bound_to_ranks(loss_fn, opts.axis_name, topology, tp, name)
        return ZeroStep(fn, stage=stage, optimizer=optimizer, topology=topology, options=opts,
                        tensor_parallel=tp)

    return transform


def _bound_to_ranks(fn: object, axis_name: object, topology: Topology,
                    tp: TensorParallel | None, where: str) -> Callable[..., object]:
    """``fn`` with ``axis_name`` bound to this rank's data ranks: its
    ``jax.lax.psum`` over the name is an all-reduce over the data ranks (the
    all-reduce of the cotangent its derivative), its ``axis_index`` the rank.
    Both take the rank as an operand, so every data rank traces the same
    program (see [Note: one program for a group's ranks] in
    ``ops/comm/_xla.py``)."""
    import jax.numpy as jnp

    from shard.core._data_rank import bind_axis
    from shard.core.losses._jax import classify
    from shard.tensor_parallel._megatron import Collectives

    if not isinstance(axis_name, str):
        raise TypeError(f"{where}: axis_name must be a string (the name the loss's "
                        f"jax.lax.pmean uses); got {type(axis_name).__name__}")
    if not callable(fn) or classify(fn) != "jax":
        raise TypeError(f"{where}: axis_name= binds the data ranks in a JAX function "
                        f"(params, batch) -> loss; got {type(fn).__name__}")
    if tp is not None:
        raise NotImplementedError(f"{where}: axis_name= with a 'model' axis (tensor "
                                  "parallelism) is not built")
    # the data ranks, every replica's included, where replica r's rank k is
    # data rank r * S + k (as for the keys)
    data = Collectives(topology.data)
    replicas = Collectives(topology.replicate) if topology.replicate is not None else None

    def psum(x: jax.Array) -> jax.Array:
        # "copy" all-reduces the cotangent, "reduce" the value: together an
        # all-reduce both ways, each with the rank an operand
        for group in (data, replicas):
            if group is not None:
                x = group.apply("reduce", group.apply("copy", x))
        return x

    def index() -> jax.Array:
        k = data.ids()[0] if data.size > 1 else 0
        r = replicas.ids()[0] if replicas is not None and replicas.size > 1 else 0
        return jnp.asarray(r * data.size + k, jnp.int32)

    return bind_axis(fn, axis_name, topology.ranks, psum=psum, index=index, where=where)


_DOC = """ZeRO stage {stage} of ``loss_fn``: {what}.

Args:
  loss_fn: a JAX function ``(params, batch) -> scalar loss``, a
    :class:`shard.Layered` chain of per-unit layers, or an object with
    ``value_and_grad(params, batch) -> (loss, grads)`` (e.g. the torch adapter).
    At stage 3 on several ranks a JAX function runs unit by unit as a
    ``Layered`` does: its program is traced once per batch shape and cut at
    the first use of each unit, so a flax, equinox or plain-dict model holds
    about two units' full params at a time (see [Note: traced units]).
  optimizer: ``ops.adamw(...)``, ``ops.adam(...)`` or ``ops.lion(...)`` (fused
    kernels, host or device state), or any optax ``GradientTransformation`` on
    host state
    (``optax.sgd(1e-2, momentum=0.9)``, ``optax.lion(1e-4)``,
    ``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))``,
    ``optax.lamb``): its state is sharded like the masters, and one that
    reduces over whole leaves in a way the step cannot compute on shards is
    refused at ``init``, by name (see [Note: optax on shards]).
  mesh: a :class:`shard.Mesh` of this rank's ranks, its axes named ``data``
    (ZeRO shards over it), or ``replicate`` and ``shard`` (HSDP, FSDP2's 2-D
    mesh: ZeRO within ``shard``, the shards' gradients summed over
    ``replicate``; see [Note: replicas]), plus ``model`` (tensor parallelism:
    give the split as ``specs=shard.TensorParallel(mesh, ...)``) and ``pipe``
    (a :class:`shard.Pipeline`'s own mesh) (see [Note: topology]).
  comm: this rank's communicator, for one data axis (``ops.spawn`` or
    ``ops.init_from_env``); give ``mesh=`` or ``comm=``.
{direct}
  options: a :class:`shard.ZeroOptions` with any of the options above and
    these:
{rest}

Returns:
  A :class:`ZeroStep`: ``state = step.init(params)``, then
  ``state, metrics = step(state, batch)``, where ``batch`` is this rank's part
  of the global batch (any pytree: a dict, a tuple or list of arrays...);
  ``step(state, shard.MicroBatches([b1, b2]))`` is one step with gradient
  accumulation; ``step(state, batch, tokens=n)`` adds ``tokens_per_s``;
  ``step.evaluate(state, batch)`` is the loss with no gradients and no update
  (``(loss, aux)`` with ``has_aux``; ``loss_fn=`` an eval-mode JAX loss).
  metrics: loss (mean over ranks), grad_norm (before clipping), lr,
  loss_scale, skipped, time_ms (this rank's step time and its split: forward,
  backward, all_gather_wait, reduce_wait, optimizer, ...; see
  ``shard.profile``).

Examples:
  >>> import numpy as np, jax.numpy as jnp, ops, shard
  >>> def loss(p, b):
  ...     return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
  >>> def run(comm):
  ...     step = shard.zero{stage}(loss, optimizer=ops.adamw(1e-2), comm=comm)
  ...     state = step.init({{"w": np.ones((3, 1), np.float32)}})
  ...     batch = {{"x": np.ones((4, 3), np.float32), "y": np.zeros((4, 1), np.float32)}}
  ...     state, metrics = step(state, batch)
  ...     return round(metrics["loss"], 3)
  >>> ops.spawn(run, 2)
  [9.0, 9.0]
"""

DIRECT = ("specs", "trainable", "precision", "offload", "clip_norm", "has_aux")


def _args(names: Iterable[str], indent: str) -> str:
    """The Args entries of ``names``, from :class:`ZeroOptions`'s docstring."""
    docs = option_docs()
    return "\n".join(f"{indent}{n}: " + docs[n].replace("\n      ", "\n" + indent + "  ")
                      for n in names)


def _doc(stage: int, what: str) -> str:
    rest = [n for n in option_docs() if n not in DIRECT]
    return _DOC.format(stage=stage, what=what, direct=_args(DIRECT, "  "),
                       rest=_args(rest, "    "))


zero0 = _make(0)
zero0.__doc__ = _doc(0, "plain data parallelism (everything replicated; gradients "
                     "all-reduced)")
zero1 = _make(1)
zero1.__doc__ = _doc(1, "optimizer states and fp32 masters sharded")
zero2 = _make(2)
zero2.__doc__ = _doc(2, "optimizer states, masters and gradients sharded")
zero3 = _make(3)
zero3.__doc__ = _doc(3, "optimizer states, gradients and parameters sharded; each unit "
                     "gathered only while it computes")
for _f, _n in ((zero0, "zero0"), (zero1, "zero1"), (zero2, "zero2"), (zero3, "zero3")):
    _f.__name__ = _f.__qualname__ = _n
