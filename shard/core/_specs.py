"""Sharding specs: how one leaf is split over the data-parallel ranks.

A spec is a leaf of its own (as ``jax.sharding.PartitionSpec`` is), so a pytree
of specs mirrors the params pytree; it may also be given as a *prefix* of it
(one spec for a whole subtree), or as a single spec for everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ops._tree import tree_util

__all__ = ["DP_AXIS", "Replicate", "Shard", "Spec", "from_partition_spec", "resolve_specs",
           "to_partition_spec"]

DP_AXIS = "dp"


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


def _is_spec(x: Any) -> bool:
    return isinstance(x, (Shard, Replicate)) or _is_partition_spec(x)


def _is_partition_spec(x: Any) -> bool:
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


def resolve_specs(params: Any, specs: Any = None, *, fn: str = "specs") -> Any:
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

    def fix(path: Any, leaf: Any, spec: Any) -> Any:
        spec = _spec_of(tu.keystr(path), spec, fn)
        shape = getattr(leaf, "shape", ())
        return Replicate() if len(shape) == 0 or shape[0] == 0 else spec

    return tu.tree_map_with_path(fix, params, full)


def to_partition_spec(spec: Spec, axis: str = DP_AXIS) -> Any:
    """The ``jax.sharding.PartitionSpec`` of a spec over mesh axis ``axis``."""
    from jax.sharding import PartitionSpec

    return PartitionSpec(axis) if isinstance(spec, Shard) else PartitionSpec()


def from_partition_spec(pspec: Any, axis: str = DP_AXIS) -> Spec:
    """The spec of a ``jax.sharding.PartitionSpec`` over mesh axis ``axis``."""
    entries = tuple(pspec)
    if not entries or all(e is None for e in entries):
        return Replicate()
    if entries[0] == axis and all(e is None for e in entries[1:]):
        return Shard(0)
    raise NotImplementedError(f"PartitionSpec{entries}: only sharding dim 0 over {axis!r} or "
                              "full replication is supported")
