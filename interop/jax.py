"""JAX in and out of zeroshard states, and specs as ``NamedSharding``.

``jax.sharding.NamedSharding`` needs a dimension to divide evenly by its mesh
axis; a Shard(0) leaf whose rows do not divide (zeroshard pads them) is placed
replicated instead, and :func:`shardings` says which leaves that was.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from interop._dlpack import to_jax
from ops._tree import tree_util
from shard import Replicate, Shard, TrainState, to_partition_spec
from shard.core._specs import DP_AXIS, resolve_specs

__all__ = ["global_params", "local_params", "mesh", "shardings"]

log = logging.getLogger(__name__)


def mesh(n: int | None = None, axis: str = DP_AXIS, *, backend: str | None = None) -> Any:
    """A 1-D mesh over ``n`` JAX devices (all by default) named ``axis``.

    ``backend`` picks the platform as ``jax.devices(backend)`` does (``"cpu"``,
    ``"gpu"``; default: JAX's default backend). For N CPU devices, set
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX is
    imported.
    """
    import jax
    from jax.sharding import Mesh

    devices = jax.devices(backend)
    n = len(devices) if n is None else n
    if n > len(devices):
        raise ValueError(f"mesh: {n} devices asked for, JAX has {len(devices)}; for CPU devices "
                         f"set XLA_FLAGS=--xla_force_host_platform_device_count={n} before "
                         "importing jax")
    return Mesh(np.array(devices[:n]), (axis,))


def shardings(params: Any, specs: Any, mesh: Any, axis: str = DP_AXIS) -> Any:
    """A ``NamedSharding`` per leaf of ``params`` from zeroshard specs."""
    from jax.sharding import NamedSharding

    size = mesh.shape[axis]
    full = resolve_specs(params, specs, fn="shardings")

    def one(x: Any, spec: Any) -> Any:
        if isinstance(spec, Shard) and x.shape[0] % size:
            log.info("leaf of shape %s does not divide over %d devices: replicated",
                     x.shape, size)
            spec = Replicate()
        return NamedSharding(mesh, to_partition_spec(spec, axis))

    return tree_util().tree_map(one, params, full)


def global_params(full_params: Any, mesh: Any, specs: Any = None,
                  axis: str = DP_AXIS) -> Any:
    """Whole params (e.g. ``shard.gather``'s) as jax arrays sharded over ``mesh``,
    ready for ``jax.jit`` code."""
    import jax

    return jax.device_put(full_params, shardings(full_params, specs, mesh, axis))


def local_params(state: TrainState) -> Any:
    """This rank's master shards as jax arrays over the state's own memory
    (zero-copy where a leaf's view is 64-byte aligned)."""
    return tree_util().tree_map(to_jax, state.params)
