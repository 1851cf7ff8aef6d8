"""The public transforms: ``zero0`` (plain data parallelism) to ``zero3``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ops import Communicator
from shard.core._layout import Units
from shard.core._policy import LossScale, Precision
from shard.offload._offload import Offload
from shard.step._step import ZeroStep

__all__ = ["zero0", "zero1", "zero2", "zero3"]


def _make(stage: int) -> Callable[..., ZeroStep]:
    def transform(loss_fn: Any = None, /, *, optimizer: Any, comm: Communicator,
                  specs: Any = None, units: Units = None, precision: Precision | None = None,
                  clip_norm: float | None = None, loss_scale: LossScale | None = None,
                  prefetch: int = 1, loggers: Any = (), offload: Offload | None = None,
                  gradient_accumulation_steps: int | None = None, has_aux: bool = False,
                  weight_by_rows: bool = False, replicate: Communicator | None = None,
                  tensor_parallel: Any = None, reshard_after_forward: bool | int = True,
                  trainable: Any = None, gradient_divide_factor: float | None = None,
                  key: Any = None, axis_name: str | None = None) -> Any:
        kw = dict(stage=stage, optimizer=optimizer, comm=comm, specs=specs, units=units,
                  precision=precision, clip_norm=clip_norm, loss_scale=loss_scale,
                  prefetch=prefetch, loggers=loggers, offload=offload,
                  gradient_accumulation_steps=gradient_accumulation_steps, has_aux=has_aux,
                  weight_by_rows=weight_by_rows, replicate=replicate,
                  tensor_parallel=tensor_parallel, reshard_after_forward=reshard_after_forward,
                  trainable=trainable, gradient_divide_factor=gradient_divide_factor, key=key)
        if axis_name is not None:  # see [Note: the data axis in the loss]
            def bound(fn: Any) -> Any:
                return ZeroStep(_bound_to_ranks(fn, axis_name, comm, kw, f"zero{stage}"), **kw)
        else:
            def bound(fn: Any) -> Any:
                return ZeroStep(fn, **kw)
        if loss_fn is None:  # used as a decorator with arguments
            return bound
        return bound(loss_fn)

    return transform


def _bound_to_ranks(fn: Any, axis_name: Any, comm: Any, kw: dict[str, Any], where: str) -> Any:
    """``fn`` with ``axis_name`` bound to this rank's data ranks: its
    ``jax.lax.psum`` over the name is an all-reduce over ``comm`` (the
    all-reduce of the cotangent its derivative), its ``axis_index`` the rank.
    Each rank's loss is then its own function, compiled by that rank alone,
    so no rank waits on another's compile while its collectives wait."""
    import jax
    import jax.numpy as jnp

    from shard.core._data_rank import bind_axis
    from shard.core._protocol import classify
    from shard.tensor_parallel._jax import Collectives

    if not isinstance(axis_name, str):
        raise TypeError(f"{where}: axis_name must be a string (the name the loss's "
                        f"jax.lax.pmean uses); got {type(axis_name).__name__}")
    if not callable(fn) or classify(fn) != "jax":
        raise TypeError(f"{where}: axis_name= binds the data ranks in a JAX function "
                        f"(params, batch) -> loss; got {type(fn).__name__}")
    if kw.get("tensor_parallel") is not None:
        raise NotImplementedError(f"{where}: axis_name= with tensor_parallel= is not built")
    # the data ranks: comm's, times the replicas under HSDP, where replica r's rank
    # k is data rank r * S + k (as for the keys)
    groups = [Collectives(comm)]
    size, rank = comm.world_size, comm.rank
    replicate = kw.get("replicate")
    if replicate is not None:
        groups.append(Collectives(replicate))
        size, rank = size * replicate.world_size, replicate.rank * size + rank

    def total(x: Any) -> Any:
        for group in groups:
            x = group.all_reduce(x)
        return x

    @jax.custom_vjp
    def psum(x: Any) -> Any:
        return total(x)
    psum.defvjp(lambda x: (total(x), None), lambda _, ct: (total(ct),))
    return bind_axis(fn, axis_name, size, psum=psum,
                     index=lambda: jnp.asarray(rank, jnp.int32), where=where)


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
  comm: this rank's communicator (``ops.spawn`` or ``ops.init_from_env``).
  specs: a spec per leaf, a prefix of the params tree, or one spec
    (default ``Shard(0)`` everywhere; scalars are replicated).
  units: how leaves group into units: None (top-level subtrees), a depth, or a
    function from a leaf's key path to its unit key.
  precision: a :class:`shard.Precision` (e.g. bf16 params, fp32 reduction).
    Default: the params' own dtype, so bfloat16 or float16 params compute in
    it, with float32 masters and moments (params mixing dtypes must say).
  clip_norm: clip gradients to this global norm (computed across all shards).
  loss_scale: a :class:`shard.LossScale` for dynamic float16 loss scaling.
  prefetch: how many units ahead to all-gather at stage 3.
  loggers: callables ``(step, metrics)`` run after every step on rank 0, such
    as ``shard.CSVLogger(path)`` or ``shard.TensorBoardLogger(log_dir)``.
  offload: a :class:`shard.Offload`: the fp32 masters and Adam's moments in host
    memory (``Offload("host")``) or in files (``Offload("disk", path=...)``),
    updated there by the same kernel; stages 1-3. ``Offload("host",
    overlap=True)`` updates each unit during the backward (not with
    ``clip_norm``).
  gradient_accumulation_steps: if given, every step takes
    ``shard.MicroBatches`` of exactly this many micro-batches (DeepSpeed's
    key; a refusal names the count otherwise). Default: any number.
  has_aux: the loss returns ``(loss, aux)`` (JAX's ``value_and_grad``
    convention; a JAX function or ``interop.torch.functional``'s loss), and
    ``metrics["aux"]`` holds aux, its numeric leaves averaged over the
    micro-batches and the ranks (a small host collective each step).
  weight_by_rows: ranks whose batches hold different numbers of rows (the
    leading dimension) weigh by their rows, so the step's update and loss are
    those of the ranks' batches concatenated, as micro-batches of unequal rows
    always are (see [Note: rows across ranks]); costs one pass over the
    gradient shards. Without it each rank's mean weighs the same, and a step
    whose ranks' rows differ says so in a warning.
  replicate: hierarchical ZeRO (FSDP2's HSDP): the communicator of the ranks
    that hold the same shards as this one, typically one per node, while
    ``comm`` shards within a node: ``mesh = shard.Mesh(comm, {{"replicate": R,
    "shard": S}})``, then ``comm=mesh["shard"], replicate=mesh["replicate"]``.
    Gathers and reduce-scatters stay inside ``comm``; the reduced gradient
    shards are summed over the replicas, and the update is that of ZeRO over
    all R x S ranks (see [Note: replicas]). Stages 1-3.
  tensor_parallel: a :class:`shard.TensorParallel` over the ``model`` axis of
    a mesh whose ``data`` axis is ``comm``: ``init`` keeps this model rank's
    slices of the whole params and shards them over ``comm``; the loss joins
    the slices with its building blocks; the gradient norm (and clipping) is
    the whole model's (see [Note: tensor parallelism with ZeRO]). Host or
    device state.
  reshard_after_forward: stage 3 (FSDP2's argument; DeepSpeed's ZeRO++ hpZ,
    ``zero_hpz_partition_size``): True (default) frees each unit's gathered
    params after use; an int ``L`` dividing the world size, the ranks per
    node, keeps a secondary shard of each unit inside every group of ``L``
    consecutive ranks: the forward's gather crosses nodes once (each rank's
    counterparts on the other nodes), and the backward's gather stays inside
    the node; it costs ``1/L`` of the compute params per rank for the step
    (see [Note: secondary shards]). ``False`` keeps them whole (``L = 1``).
  trainable: which leaves train, for fine-tuning: a pytree of bools shaped like
    the params (or a prefix of it), or a function of the params returning one,
    as ``optax.masked`` takes. A leaf marked False is sharded and gathered like
    the rest but never updated (no weight decay, moments stay zero) and its
    gradient is left out of the norm. A torch module's ``requires_grad=False``
    parameters are frozen without it (see [Note: frozen leaves]). Default: all.
  gradient_divide_factor: what the gradients summed over the data ranks are
    divided by (FSDP2's ``set_gradient_divide_factor``). Default: the number
    of data ranks, a mean; ``1.0`` keeps the sum (DeepSpeed's
    ``"gradient_allreduce_op": "sum"``). Micro-batches are averaged either way.
  key: a JAX PRNG key (``jax.random.key(0)``) for a JAX loss that draws
    random numbers (dropout): the loss is then called with a keyword argument
    ``key``, a different key on every data rank, step and micro-batch, derived
    from this one (``shard.step_key``; see [Note: per-rank keys]).
  axis_name: the data ranks' axis name inside a JAX loss, as under
    ``shard_map``: ``jax.lax.pmean(x, axis_name)`` is the mean over the data
    ranks, ``comm``'s and every replica's with ``replicate`` (``psum`` and
    ``axis_index`` too), so flax's
    ``BatchNorm(axis_name=...)`` normalises with the global batch's
    statistics, as torch's ``SyncBatchNorm`` (see [Note: the data axis in the
    loss]). Each rank then compiles its own loss.

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

zero0 = _make(0)
zero0.__doc__ = _DOC.format(stage=0, what="plain data parallelism (everything replicated; "
                            "gradients all-reduced)")
zero1 = _make(1)
zero1.__doc__ = _DOC.format(stage=1, what="optimizer states and fp32 masters sharded")
zero2 = _make(2)
zero2.__doc__ = _DOC.format(stage=2, what="optimizer states, masters and gradients sharded")
zero3 = _make(3)
zero3.__doc__ = _DOC.format(stage=3, what="optimizer states, gradients and parameters sharded; "
                            "each unit gathered only while it computes")
for _f, _n in ((zero0, "zero0"), (zero1, "zero1"), (zero2, "zero2"), (zero3, "zero3")):
    _f.__name__ = _f.__qualname__ = _n
