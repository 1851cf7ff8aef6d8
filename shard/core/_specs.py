"""Sharding specs: how one leaf is split over the data-parallel ranks.

A spec is a leaf of its own (as ``jax.sharding.PartitionSpec`` is), so a pytree
of specs mirrors the params pytree; it may also be given as a *prefix* of it
(one spec for a whole subtree), or as a single spec for everything.

A tensor-parallel leaf is also split over the model ranks: :class:`Split`, a
rank's slice and the join of every rank's slices.

[Note: packed splits]
A tensor-parallel leaf is split along one dimension. Most leaves split in one
run: model rank ``r`` of ``T`` holds rows ``[r n, (r + 1) n)`` of that
dimension. A *packed* leaf is ``blocks`` equal blocks laid end to end along the
dimension, e.g. a fused query-key-value projection ``(3 d, d)`` or a fused
gate-up projection ``(2 f, d)``; each block splits on its own, so rank ``r``
holds rows ``[r n, (r + 1) n)`` of every block, and its slice is the same
blocks, each ``n`` long (its part of the query, of the key and of the value).
Viewing the dimension as ``(blocks, rows per block)`` makes a packed split an
ordinary split of the second axis, which is how both functions below work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from ops._types import tree_util

if TYPE_CHECKING:
    import jax
    import torch
    from jax.sharding import PartitionSpec
    from jax.tree_util import KeyPath

__all__ = ["DP_AXIS", "Replicate", "Shard", "Spec", "Split", "from_partition_spec",
           "join_split", "joined_stack", "resolve_specs", "take_split", "to_partition_spec"]

DP_AXIS = "dp"

_Leaf = TypeVar("_Leaf", "np.ndarray", "jax.Array", "torch.Tensor")


@dataclass(frozen=True)
class Shard:
    """Split the leaf along dimension ``dim`` over the ranks (dimension 0; a
    step refuses another, naming the leaf).

    Rank r holds rows ``[r * R, (r + 1) * R)`` with ``R = ceil(shape[0] / W)``;
    the rows past the end of the leaf on the last ranks are zero padding, so a
    size that does not divide the world size still shards.
    """

    dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Shard(dim={self.dim!r}): dim must be an int >= 0")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Keep the whole leaf on every rank (its gradient is all-reduced)."""

    def __repr__(self) -> str:
        return "Replicate()"


Spec = Shard | Replicate


def _is_spec(x: object) -> bool:
    return isinstance(x, (Shard, Replicate)) or _is_partition_spec(x)


def _is_partition_spec(x: object) -> bool:
    """A ``jax.sharding.PartitionSpec`` (without importing jax for other specs)."""
    module = type(x).__module__
    if module != "jax" and not module.startswith("jax."):
        return False
    from jax.sharding import PartitionSpec

    return isinstance(x, PartitionSpec)


def _spec_of(path: str, spec: Any, fn: str) -> Spec:
    """``spec`` as a ``Shard``/``Replicate`` (a ``PartitionSpec`` converted: any
    one mesh axis on dimension 0 is ``Shard(0)``); NotImplementedError naming
    the leaf for a split of another dimension."""
    if _is_partition_spec(spec):
        entries = tuple(spec)
        if not entries or all(e is None for e in entries):
            return Replicate()
        if entries[0] is not None and all(e is None for e in entries[1:]):
            return Shard(0)
        dims = [d for d, e in enumerate(entries) if e is not None]
        raise NotImplementedError(f"{fn}: params{path}: {spec} splits dimension(s) {dims}; ZeRO "
                                  "shards split dimension 0 only: PartitionSpec('data') (or "
                                  "shard.Shard(0)), PartitionSpec() to replicate, or transpose "
                                  "the leaf")
    if isinstance(spec, Shard) and spec.dim != 0:
        raise NotImplementedError(f"{fn}: params{path}: Shard({spec.dim}) splits dimension "
                                  f"{spec.dim}; ZeRO shards split dimension 0 only: Shard(0), "
                                  "Replicate(), or transpose the leaf")
    return spec


def resolve_specs(params: object, specs: object = None, *, fn: str = "specs") -> Any:
    """A spec for every leaf of ``params``, from a full tree, a prefix or one spec.

    Scalars and empty leaves are replicated whatever the spec says (there is
    nothing to split). Raises ValueError naming the pytree path of a spec that
    has no leaf or a subtree that has no spec.
    """
    tu = tree_util()
    specs = Shard(0) if specs is None else specs
    if _is_spec(specs):
        full = tu.tree_map(lambda _: specs, params)
    else:
        try:
            full = tu.tree_map(lambda s, sub: tu.tree_map(lambda _: s, sub), specs, params,
                               is_leaf=_is_spec)
        except ValueError as e:
            raise ValueError(f"{fn}: the spec tree does not match the params tree ({e}); give a "
                             "spec per leaf, a prefix of the params tree, or one spec") from None
        bad = [p for p, s in tu.tree_leaves_with_path(specs, is_leaf=_is_spec) if not _is_spec(s)]
        if bad:
            raise TypeError(f"{fn}: {tu.keystr(bad[0])} is not a spec: Shard(0), Replicate() or "
                            "a jax.sharding.PartitionSpec (shard.from_partition_spec)")

    def fix(path: KeyPath, leaf: object, spec: object) -> Spec:
        spec = _spec_of(tu.keystr(path), spec, fn)
        shape: tuple[int, ...] = getattr(leaf, "shape", ())
        return Replicate() if len(shape) == 0 or shape[0] == 0 else spec

    return tu.tree_map_with_path(fix, params, full)


def to_partition_spec(spec: Spec, axis: str = DP_AXIS) -> PartitionSpec:
    """The ``jax.sharding.PartitionSpec`` of a spec over mesh axis ``axis``."""
    from jax.sharding import PartitionSpec

    return PartitionSpec(axis) if isinstance(spec, Shard) else PartitionSpec()


def from_partition_spec(pspec: PartitionSpec, axis: str = DP_AXIS) -> Spec:
    """The spec of a ``jax.sharding.PartitionSpec`` over mesh axis ``axis``."""
    entries = tuple(pspec)
    if not entries or all(e is None for e in entries):
        return Replicate()
    if entries[0] == axis and all(e is None for e in entries[1:]):
        return Shard(0)
    raise NotImplementedError(f"PartitionSpec{entries}: only sharding dim 0 over {axis!r} or "
                              "full replication is supported")


# -- tensor-parallel splits (see [Note: packed splits]) -------------------------
class Split(NamedTuple):
    """A leaf's split: along ``dim``, each of ``blocks`` blocks on its own."""

    dim: int
    blocks: int = 1


def _blocked(shape: Sequence[int], split: Split) -> list[int]:
    shape = list(shape)
    shape[split.dim:split.dim + 1] = [split.blocks, shape[split.dim] // split.blocks]
    return shape


def take_split(x: _Leaf, split: Split, rank: int, size: int) -> _Leaf:
    """Model rank ``rank``'s slice of the whole leaf ``x`` (numpy, JAX or torch;
    a view where the array type allows one)."""
    d, k = split
    n = x.shape[d] // (k * size)
    if k == 1:
        index = [slice(None)] * len(x.shape)
        index[d] = slice(rank * n, (rank + 1) * n)
        return x[tuple(index)]
    index = [slice(None)] * (len(x.shape) + 1)
    index[d + 1] = slice(rank * n, (rank + 1) * n)
    shape = list(x.shape)
    shape[d] = k * n
    return x.reshape(_blocked(x.shape, split))[tuple(index)].reshape(shape)


def join_split(parts: Sequence[np.ndarray], split: Split) -> np.ndarray:
    """The whole leaf from every model rank's slice, in rank order."""
    if split.blocks == 1:
        return np.concatenate(parts, axis=split.dim)
    whole = np.concatenate([np.asarray(p).reshape(_blocked(p.shape, split)) for p in parts],
                           axis=split.dim + 1)
    shape = list(parts[0].shape)
    shape[split.dim] *= len(parts)
    return whole.reshape(shape)


def joined_stack(stacked: np.ndarray, split: Split) -> np.ndarray:
    """:func:`join_split` of ``stacked[r]``, every rank's slice stacked on a
    new first axis (what an all-gather fills), in one copy."""
    size, shape = stacked.shape[0], list(stacked.shape[1:])
    blocked = _blocked(shape, split)  # (T, ..., k, n, ...)
    x = stacked.reshape(size, *blocked)
    x = np.moveaxis(x, 0, split.dim + 1)  # (..., k, T, n, ...)
    shape[split.dim] *= size
    return x.reshape(shape)
