"""Per-rank memory of a ZeRO state, from shapes alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ops._optim import FusedOptimizer
from shard.core._layout import Units, make_layout, master_dtype_of
from shard.core._optim import moment_names
from shard.core._policy import Precision
from shard.offload._offload import Offload
from shard.step._frozen import frozen_leaves, masters_in_compute

if TYPE_CHECKING:
    from shard.tensor_parallel._parallel import TensorParallel

__all__ = ["estimate_memory"]


def estimate_memory(params: object, *, stage: int, world_size: int,
                    policy: Precision | None = None, specs: object = None,
                    units: Units = None, offload: Offload | None = None,
                    optimizer: object = None, tensor_parallel: TensorParallel | None = None,
                    trainable: object = None) -> dict[str, int]:
    """Bytes per rank, by kind, that a ZeRO stage keeps for ``params``.

    The ZeRO paper's accounting, with this library's padding (each Shard(0)
    leaf rounds its rows up to a multiple of the world size):

    - params: fp32 masters (fp64 when every param is fp64), whole at stage 0,
      this rank's shard from stage 1; none for frozen leaves of the compute
      dtype at stages 0 and 3 (a bfloat16 model's base weights under LoRA:
      their compute params hold them) with a fused optimizer and no offload;
    - optimizer: the optimizer's moments, in the masters' dtype and layout:
      Adam's two by default, or those of ``optimizer`` (an optax
      transformation's param-shaped state, e.g. one for Lion or SGD with
      momentum, none for plain SGD); none for frozen leaves under a fused
      optimizer (zeros in the offload tiers and an optax transformation's
      state, which keep the masters' layout);
    - compute_params: the params the loss sees, kept between steps: whole at
      stages 1-2 (and at stage 0 when they differ in dtype from the masters);
      the compute-dtype shard at stage 3 (none when it is fp32: the masters
      are gathered directly);
    - grads: the gradient buffer a step accumulates into, in the reduce
      dtype: whole at stages 0-1, this rank's shard at stages 2-3; the
      trainable leaves' alone;
    - total: their sum. Live units at stage 3 (at most ``1 + prefetch`` full
      units), with ``reshard_after_forward=L`` the step's secondary shards
      (``1/L`` of the compute params), and activations come on top.

    With ``offload`` (a :class:`shard.Offload`) the masters and moments leave
    the device, stage 3 keeps a compute-dtype shard there even in fp32, and
    ``on_device``, ``on_host`` and ``on_disk`` say where the bytes are (for CPU
    training the device is host memory too).

    Args:
      params: a pytree of arrays or of anything with ``shape`` and ``dtype``
        (``jax.ShapeDtypeStruct``), so nothing need be allocated.
      stage: 0-3.
      world_size: the number of data-parallel ranks.
      policy: the :class:`Precision` the step will use.
      specs: as given to the ZeRO transform.
      units: as given to the ZeRO transform.
      optimizer: the transform's ``optimizer=`` (default: Adam's two moments).
      tensor_parallel: a :class:`shard.TensorParallel` (the step's, or
        ``shard.TensorParallel(T, specs)`` for T model ranks without ranks to
        run on): ``params`` are the whole model's, and the estimate is a model
        rank's, for its slices (Megatron's split: a split leaf's bytes divided
        by T, a whole leaf's on every model rank). For a pipeline stage, give
        that stage's params.
      trainable: the transform's ``trainable=`` (a pytree of bools, or a
        function of the params returning one): frozen leaves keep no moments
        and no gradients (see [Note: frozen leaves]). For a torch module, its
        parameters' ``requires_grad``: ``{n: p.requires_grad for n, p in
        model.named_parameters()}``.

    Examples:
      >>> import jax, jax.numpy as jnp, shard
      >>> big = {"w": jax.ShapeDtypeStruct((70_000_000_000,), jnp.float32)}
      >>> bf16 = shard.Precision(param_dtype=jnp.bfloat16)
      >>> est = shard.estimate_memory(big, stage=3, world_size=1024, policy=bf16)
      >>> round(est["total"] / 2**30, 2)  # GiB per rank: 16 bytes/param / 1024 ranks
      1.02
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"estimate_memory: stage must be 0-3; got {stage!r}")
    policy = policy or Precision()
    if tensor_parallel is not None:  # a model rank's slices
        import jax

        params = tensor_parallel.shard(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), params))
    layout = make_layout(params, specs, world_size=1 if stage == 0 else world_size, units=units,
                         fn="estimate_memory")
    master = master_dtype_of(layout)
    dtypes = {leaf.dtype for leaf in layout.leaves}
    if policy.param_dtype is None and len(dtypes) == 1 and dtypes <= {"float16", "bfloat16"}:
        policy = Precision(param_dtype=dtypes.pop(), reduce_dtype=policy.reduce_dtype)  # as a step
    compute = np.dtype(policy.param_dtype or master)
    reduce = np.dtype(policy.reduce_dtype or policy.param_dtype or master)
    local = layout.local_size()
    full = make_layout(params, specs, world_size=1, units=units).local_size()
    separate = compute != master
    if stage in (1, 2):
        compute_n = full
    elif stage == 0:
        compute_n = full if separate else 0
    else:
        compute_n = local if separate or offload is not None else 0
    moments = 2 if optimizer is None else len(moment_names(optimizer, layout))
    frozen = frozen_leaves(trainable, None, params, "estimate_memory")
    kept = sum(layout.leaves[i].local_size for i in range(len(layout.leaves)) if i not in frozen)
    # the gradients of the trainable leaves alone (see [Note: frozen leaves])
    grads_n = (sum(leaf.size for i, leaf in enumerate(layout.leaves) if i not in frozen)
               if stage <= 1 else kept)
    fused = optimizer is None or isinstance(optimizer, FusedOptimizer)
    # the tiers and an optax transformation keep moments in the masters' layout
    moments_n = kept if fused and offload is None else local
    masters_n = kept if masters_in_compute(
        layout, frozen, stage=stage, compute_dtype=compute, master_dtype=master, fused=fused,
        offload=offload is not None) else local
    out = {"params": master.itemsize * masters_n,
           "optimizer": moments * master.itemsize * moments_n,
           "compute_params": compute_n * compute.itemsize, "grads": grads_n * reduce.itemsize}
    out["total"] = sum(out.values())
    if offload is not None:
        kept = out["params"] + out["optimizer"]
        compute_host = out["compute_params"] if offload.params == "host" and stage == 3 else 0
        out.update(on_device=out["compute_params"] - compute_host + out["grads"],
                   on_host=compute_host + (kept if offload.optimizer == "host" else 0) +
                   (kept + compute_host if offload.overlap else 0),  # the spare set
                   on_disk=kept if offload.optimizer == "disk" else 0)
    return out
