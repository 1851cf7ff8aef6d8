"""JAX in and out of zeroshard states, and specs as ``NamedSharding``.

``jax.sharding.NamedSharding`` needs a dimension to divide evenly by its mesh
axis; a Shard(0) leaf whose rows do not divide (zeroshard pads them) is placed
replicated instead, and :func:`shardings` warns naming those leaves.
:func:`named_params` builds the global arrays from the ranks' states shard by
shard: device ``r`` of the mesh gets rank ``r``'s rows, and no rank's whole
params are made.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from interop._dlpack import to_jax
from ops._types import tree_util
from ops.device._dlpack import jax_view
from shard import Replicate, Shard, TrainState, to_partition_spec
from shard.core._specs import DP_AXIS, resolve_specs

if TYPE_CHECKING:
    from jax.sharding import Mesh, NamedSharding
    from jax.tree_util import KeyPath

    from shard.core._specs import Spec

__all__ = ["global_params", "local_params", "mesh", "named_params", "shardings"]

log = logging.getLogger(__name__)


def mesh(n: int | None = None, axis: str = DP_AXIS, *, backend: str | None = None) -> Mesh:
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


def shardings(params: object, specs: object, mesh: Mesh, axis: str = DP_AXIS) -> Any:
    """A ``NamedSharding`` per leaf of ``params`` from zeroshard specs."""
    from jax.sharding import NamedSharding

    size = mesh.shape[axis]
    full = resolve_specs(params, specs, fn="shardings")

    tu = tree_util()
    uneven = []

    def one(path: KeyPath, x: Any, spec: Spec) -> NamedSharding:
        if isinstance(spec, Shard) and x.shape[0] % size:
            uneven.append(f"{tu.keystr(path)}{list(x.shape)}")
            spec = Replicate()
        return NamedSharding(mesh, to_partition_spec(spec, axis))

    out = tu.tree_map_with_path(one, params, full)
    if uneven:
        log.warning("shardings: %d leaves have rows that do not divide over %d devices and are "
                    "replicated: %s", len(uneven), size, ", ".join(uneven[:8]))
    return out


def global_params(full_params: object, mesh: Mesh, specs: object = None,
                  axis: str = DP_AXIS) -> Any:
    """Whole params (e.g. ``shard.gather``'s) as jax arrays sharded over ``mesh``,
    ready for ``jax.jit`` code."""
    import jax

    return jax.device_put(full_params, shardings(full_params, specs, mesh, axis))


def local_params(state: TrainState) -> Any:
    """This rank's master shards as jax arrays over the state's own memory
    (zero-copy where a leaf's view is 64-byte aligned)."""
    return tree_util().tree_map(to_jax, state.params)


def named_params(states: list[TrainState], mesh: Mesh, axis: str = DP_AXIS) -> Any:
    """The params of the ranks' states (``ops.spawn``'s results: rank ``r``'s
    state on the mesh's device ``r``) as jax arrays sharded over ``mesh``,
    built shard by shard: each device gets its rank's rows of a Shard(0) leaf
    (``jax.make_array_from_single_device_arrays``), with no whole copy. A
    leaf whose rows do not divide over the ranks (zeroshard pads its last
    shards, which ``NamedSharding`` cannot express) and a replicated leaf are
    placed whole on every device; the former are named in a warning.

    Example (4 thread ranks, 4 JAX CPU devices):
      ``named = interop.jax.named_params(ops.spawn(run, 4), interop.jax.mesh(4))``
      where ``run`` returns each rank's state, then ``jax.jit(loss)(named, batch)``.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    if not states or not all(isinstance(s, TrainState) for s in states):
        raise TypeError("named_params: give the list of every rank's TrainState (as ops.spawn "
                        "returns it)")
    world = states[0].meta.layout.world_size
    devices = list(mesh.devices.flat)
    if len(states) != world or mesh.shape[axis] != world or len(devices) != world:
        raise ValueError(f"named_params: {len(states)} states of a {world}-rank layout on a "
                         f"mesh of {dict(mesh.shape)}: give every rank's state and a 1-D mesh "
                         f"of {world} devices over {axis!r}")
    if states[0].meta.stage == 0:
        raise ValueError("named_params: a stage-0 state holds the whole params on every rank; "
                         "use global_params(state.params, mesh)")
    layout = states[0].meta.layout
    ranks = [s.params for s in states]
    per_rank = [layout.treedef.flatten_up_to(p) for p in ranks]
    uneven, out = [], []
    for i, leaf in enumerate(layout.leaves):
        parts = [_on_jax(p[i]) for p in per_rank]
        if leaf.sharded and leaf.rows % world == 0:
            sharding = NamedSharding(mesh, PartitionSpec(axis))
            out.append(jax.make_array_from_single_device_arrays(
                leaf.shape, sharding,
                [jax.device_put(x, d) for x, d in zip(parts, devices, strict=True)]))
            continue
        if leaf.sharded:  # the ranks' rows, padding dropped, whole on every device
            uneven.append(f"{leaf.path}{list(leaf.shape)}")
            whole = jnp.concatenate(parts)[:leaf.rows].reshape(leaf.shape)
        else:
            whole = parts[0]
        out.append(jax.device_put(whole, NamedSharding(mesh, PartitionSpec())))
    if uneven:
        log.warning("named_params: %d leaves have rows that do not divide over %d ranks and are "
                    "replicated: %s", len(uneven), world, ", ".join(uneven[:8]))
    return layout.treedef.unflatten(out)


def _on_jax(x: Any) -> Any:
    """A rank's leaf for JAX: numpy as it is, a device array (CuPy) as a JAX
    array over its memory (DLPack), never an implicit copy to the host."""
    return x if isinstance(x, np.ndarray) else jax_view(x)
