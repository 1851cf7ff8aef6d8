"""Whole params from shards, and a global batch cut into per-rank parts."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ops import HOST, Communicator
from ops._device import device_named
from ops._tree import tree_util
from shard._layout import make_layout, native_leaves
from shard._state import TrainState

__all__ = ["gather", "split_batch"]


class _Shape(NamedTuple):
    shape: tuple[int, ...]
    dtype: Any


def gather(x: Any, comm: Communicator, *, specs: Any = None, like: Any = None) -> Any:
    """The full parameters on every rank (a collective: every rank must call it).

    Args:
      x: a :class:`TrainState` (its fp32 master params are gathered), or a
        pytree of local shards as made by :func:`shard.partition`.
      comm: this rank's communicator.
      specs: for a pytree of shards, the specs it was made with.
      like: for a pytree of shards, the full tree or its shapes (to cut the
        padding off); without it the padded rows are kept.

    Returns:
      The full params pytree, the same on every rank, as arrays of the shards'
      device (numpy for host state, CuPy for GPU state).
    """
    if isinstance(x, TrainState):
        x.check_live()
        layout, buffers = x.meta.layout, list(x.master)
        device = device_named(x.meta.device)
        if x.meta.stage == 0:
            return layout.treedef.unflatten([v.copy() for v in layout.local_views(buffers)])
    else:
        tu = tree_util()
        shapes = like if like is not None else tu.tree_map(
            lambda s: _Shape((s.shape[0] * comm.world_size, *s.shape[1:]) if s.ndim else (),
                             s.dtype), x)
        layout = make_layout(shapes, specs, world_size=comm.world_size, fn="gather")
        device, local = native_leaves(layout.treedef.flatten_up_to(x), "gather")
        device = device or HOST
        local = [device.asarray(s) for s in local]
        buffers = [device.empty(u.local_size, local[u.leaves[0]].dtype) for u in layout.units]
        for dst, src in zip(layout.local_views(buffers), local, strict=True):
            dst[...] = src.reshape(dst.shape)
    out: list[Any] = [None] * len(layout.leaves)
    for u, unit in enumerate(layout.units):
        gathered = device.empty(unit.sharded_size * comm.world_size, buffers[u].dtype)
        if unit.sharded_size:
            comm.all_gather_into(gathered, buffers[u][:unit.sharded_size])
        for i in unit.leaves:
            out[i] = layout.gathered_leaf(layout.leaves[i], gathered, buffers[u]).copy()
    return layout.treedef.unflatten(out)


def split_batch(batch: Any, *, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s part of a global batch: each leaf's rows, split evenly.

    Leaves keep their kind (numpy, CuPy, torch or jax arrays are sliced as they
    are; numbers and lists become numpy arrays). Raises ValueError, naming the
    leaf, when a leading dimension does not divide by ``world_size``.
    """
    tu = tree_util()

    def cut(path: Any, x: Any) -> Any:
        if not hasattr(x, "shape"):
            x = np.asarray(x)  # numbers and lists: host data
        if x.ndim == 0 or x.shape[0] % world_size:
            raise ValueError(f"split_batch: batch{tu.keystr(path)} has leading dimension "
                             f"{x.shape[0] if x.ndim else '(scalar)'}, which does not split "
                             f"into {world_size} equal parts; use a global batch size divisible "
                             "by the world size")
        n = x.shape[0] // world_size
        return x[rank * n:(rank + 1) * n]

    return tu.tree_map_with_path(cut, batch)
