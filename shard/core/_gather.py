"""Whole params from shards, and a global batch cut into per-rank parts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ops import HOST, Communicator
from ops._types import tree_util
from ops.device._device import device_named
from shard.core._layout import make_layout, native_leaves
from shard.core._state import TrainState, full_masters

if TYPE_CHECKING:
    from jax.tree_util import KeyPath

    from ops._types import Array

__all__ = ["MicroBatches", "gather", "split_batch"]


class MicroBatches(tuple):
    """The micro-batches of one optimizer step (gradient accumulation).

    ``step(state, shard.MicroBatches([b1, b2, b3]))`` takes the gradients of
    each micro-batch (each this rank's part), sums them, and steps once; the
    loss and gradients are means over micro-batches and ranks, as one batch of
    their concatenation would give: micro-batches of unequal rows (the leading
    dimension of their arrays) weigh by their rows, so parts of 3 and 1 rows
    give the mean over 4 rows. Ranks weigh equally: give every rank the same
    number of rows (``shard.split_batch`` does where the batch divides). Any
    other batch (a list from a torch ``DataLoader`` included) is one
    micro-batch, handed to the loss as it is.
    DeepSpeed calls this ``gradient_accumulation_steps``.

    Examples:
      >>> import numpy as np, shard
      >>> batch = {"x": np.ones((8, 3))}
      >>> len(shard.MicroBatches(shard.split_batch(batch, rank=i, world_size=4)
      ...                        for i in range(4)))
      4
    """

    __slots__ = ()

    def __new__(cls, batches: object) -> MicroBatches:
        if isinstance(batches, (dict, str, bytes)) or not hasattr(batches, "__iter__"):
            raise TypeError(f"MicroBatches takes an iterable of batches; got "
                            f"{type(batches).__name__}")
        out = super().__new__(cls, batches)
        if not out:
            raise ValueError("MicroBatches: no micro-batches (an optimizer step needs at least "
                             "one)")
        return out

    def __repr__(self) -> str:
        return f"MicroBatches({len(self)} micro-batches)"


def gather(x: object, comm: Communicator, *, specs: object = None, like: object = None) -> Any:
    """The full parameters on every rank (a collective: every rank must call it).

    Args:
      x: a :class:`TrainState` (its fp32 master params are gathered), or a
        pytree of local shards as made by :func:`shard.partition`.
      comm: this rank's communicator.
      specs: for a pytree of shards, the specs it was made with.
      like: for a pytree of shards (required), the full tree or anything with
        its shapes and dtypes, such as ``jax.ShapeDtypeStruct``s.

    Returns:
      The full params pytree, the same on every rank, as arrays of the shards'
      device (numpy for host state, CuPy for GPU state).
    """
    if isinstance(x, TrainState):
        x.check_live()
        layout = x.meta.layout
        buffers = list(full_masters(x))
        if x.meta.stage and (comm.world_size, comm.rank) != (layout.world_size, x.meta.rank):
            raise ValueError(f"gather: this state is rank {x.meta.rank}'s of {layout.world_size}"
                             f" but comm is rank {comm.rank} of {comm.world_size}; gather over "
                             "the communicator the step ran on (a pipeline stage's: pipe.data)")
        device = device_named(x.meta.device)
        if x.meta.offload:  # host or disk-tier masters: explicit copies to the device
            buffers = [device.asarray(b) for b in buffers]
        if x.meta.stage == 0:
            return layout.treedef.unflatten([v.copy() for v in layout.local_views(buffers)])
    else:
        if like is None:
            raise TypeError("gather: a pytree of shards does not say the full shapes (shards "
                            "carry padding rows, and stage 0 'shards' are whole params); pass "
                            "the TrainState itself, gather(state, comm), or like=the full "
                            "params (or their shapes) and specs=")
        layout = make_layout(like, specs, world_size=comm.world_size, fn="gather")
        found, local = native_leaves(layout.treedef.flatten_up_to(x), "gather")
        device = found or HOST
        local = [device.asarray(s) for s in local]
        for leaf, s in zip(layout.leaves, local, strict=True):
            if tuple(s.shape) != leaf.local_shape:
                raise ValueError(f"gather: shard {leaf.path} has shape {tuple(s.shape)}, but a "
                                 f"{leaf.shape} leaf on {comm.world_size} ranks has "
                                 f"{leaf.local_shape} shards (made with other specs or another "
                                 "world size?)")
        buffers = [device.empty(u.local_size, local[u.leaves[0]].dtype) for u in layout.units]
        for dst, src in zip(layout.local_views(buffers), local, strict=True):
            dst[...] = src.reshape(dst.shape)
    out: list[Array | None] = [None] * len(layout.leaves)
    for u, unit in enumerate(layout.units):
        gathered = device.empty(unit.sharded_size * comm.world_size, buffers[u].dtype)
        if unit.sharded_size:
            comm.all_gather_into(gathered, buffers[u][:unit.sharded_size])
        for i in unit.leaves:
            out[i] = layout.gathered_leaf(layout.leaves[i], gathered, buffers[u]).copy()
    return layout.treedef.unflatten(out)


def split_batch(batch: object, *, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s part of a global batch: each leaf's rows, split evenly.

    Leaves keep their kind (numpy, CuPy, torch or jax arrays are sliced as they
    are; numbers and lists become numpy arrays). Raises ValueError, naming the
    leaf, when a leading dimension does not divide by ``world_size``.
    """
    tu = tree_util()

    def cut(path: KeyPath, x: Any) -> object:
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
