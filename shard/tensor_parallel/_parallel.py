"""Tensor (model) parallelism over one axis of a mesh: :class:`TensorParallel`.

[Note: tensor parallelism with ZeRO]
A tensor-parallel leaf is split along one dimension over the ``model`` ranks
(its spec, a ``jax.sharding.PartitionSpec`` naming the axis at that dimension,
as JAX writes it); every other leaf is whole on each model rank. ZeRO then runs
on the ``data`` axis over what each model rank holds: ``step.init(params)``
takes the whole params, keeps this model rank's slices, and shards those over
the data ranks, so the model ranks of one data index hold different state
(their slices and the moments of their slices) of the same layout.

Inside the loss, the building blocks of :mod:`shard.tensor_parallel._megatron`
join the slices (see [Note: tensor-parallel collectives]). With Megatron's
conjugate collectives every model rank computes the same loss, and the
gradient of a replicated leaf comes out the same on every model rank (a
sequence-parallel region's replicated leaves pass through :meth:`copy`, whose
backward sums their partial gradients), so the data ranks reduce gradients as
without tensor parallelism. What the step adds is the global norm: the sum of
squares of the split leaves' gradients is summed over the model ranks, a
replicated leaf's counted once (at model rank 0), so clipping sees the norm
of the whole model's gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ops import Communicator
from ops._types import tree_util
from ops.device._dlpack import host_copy
from shard.core._mesh import Mesh
from shard.core._specs import Split, joined_stack, take_split
from shard.tensor_parallel._megatron import Collectives

if TYPE_CHECKING:
    import jax
    from jax.sharding import PartitionSpec

__all__ = ["Packed", "TensorParallel"]


class Packed:
    """The spec of a packed leaf: ``blocks`` equal blocks laid end to end along
    the dimension ``spec`` splits, each split over the model ranks on its own
    (see [Note: packed splits] in ``shard/core/_specs.py``).

    A fused query-key-value weight ``(d, 3 d)`` used as ``x @ w`` is
    ``Packed(P(None, "model"), 3)``: each model rank holds its heads' columns of
    the query, the key and the value, ``(d, 3 d / T)``.
    """

    def __init__(self, spec: PartitionSpec, blocks: int) -> None:
        from jax.sharding import PartitionSpec

        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"Packed: spec must be a jax.sharding.PartitionSpec; got "
                            f"{type(spec).__name__}")
        if isinstance(blocks, bool) or not isinstance(blocks, (int, np.integer)) or blocks < 1:
            raise ValueError(f"Packed: blocks must be an int >= 1; got {blocks!r}")
        self.spec, self.blocks = spec, int(blocks)

    def __repr__(self) -> str:
        return f"Packed({self.spec}, {self.blocks})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Packed) and (self.spec, self.blocks) == (other.spec,
                                                                          other.blocks)

    def __hash__(self) -> int:
        return hash((self.spec, self.blocks))


def _is_pspec(x: object) -> bool:
    from jax.sharding import PartitionSpec

    return x is None or isinstance(x, (PartitionSpec, Packed))


class TensorParallel:
    """This rank's tensor-parallel group: which dimension of each leaf is split
    over it, and the differentiable collectives and layers that join the splits.

    Args:
      mesh: a :class:`shard.Mesh` with axis ``axis``, or the communicator of the
        model ranks itself; or a number of model ranks, for specs, ``shard``
        (model rank 0's slices) and ``shard.estimate_memory`` without ranks
        to run on (its collectives then refuse to run).
      specs: a ``jax.sharding.PartitionSpec`` per leaf of the params (a prefix
        of their tree, or one spec), naming ``axis`` at the dimension that is
        split; ``None`` or ``PartitionSpec()`` keeps a leaf whole. Default:
        every leaf whole. Specs of a list of per-layer params also fit a
        pipeline stage's ``{layer index: params}``.
      axis: the mesh axis of the model ranks.

    Megatron's layers, for weights laid out as ``x @ w``: a column-parallel
    weight ``(d_in, d_out)`` is ``P(None, "model")`` and its bias
    ``P("model")``; a row-parallel weight is ``P("model", None)``; a
    vocabulary-parallel embedding ``P("model", None)``.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, shard
      >>> from jax.sharding import PartitionSpec as P
      >>> def run(comm):
      ...     tp = shard.TensorParallel(comm, {"w1": P(None, "model"), "w2": P("model", None)})
      ...     p = tp.shard({"w1": np.ones((4, 8)), "w2": np.ones((8, 4))})
      ...     h = tp.column_linear(jnp.ones((2, 4)), p["w1"])
      ...     return tuple(p["w1"].shape), float(tp.row_linear(h, p["w2"])[0, 0])
      >>> shard.spawn(run, 2)[1]
      ((4, 4), 32.0)
    """

    def __init__(self, mesh: Mesh | Communicator | int, specs: object = None, *,
                 axis: str = "model") -> None:
        if isinstance(mesh, (int, np.integer)) and not isinstance(mesh, bool):
            if mesh < 1:
                raise ValueError(f"TensorParallel: a number of model ranks must be >= 1; got "
                                 f"{mesh}")
            comm, ranks = None, int(mesh)
        elif isinstance(mesh, Mesh):
            if axis not in mesh.axis_names:
                raise ValueError(f"TensorParallel: the mesh has no axis {axis!r}; its axes are "
                                 f"{list(mesh.axis_names)}")
            comm = mesh[axis]
            ranks = comm.world_size
        elif isinstance(mesh, Communicator):
            comm, ranks = mesh, mesh.world_size
        else:
            raise TypeError(f"TensorParallel: mesh must be a shard.Mesh, an ops.Communicator or "
                            f"a number of model ranks; got {type(mesh).__name__}")
        if specs is not None and not _is_pspec(specs) and not hasattr(specs, "items") \
                and not isinstance(specs, (list, tuple)):
            raise TypeError(f"TensorParallel: specs must be a PartitionSpec per leaf (a pytree "
                            f"of them); got {type(specs).__name__}")
        self.comm, self.axis, self.specs = comm, axis, specs
        self.rank, self.size = (comm.rank if comm is not None else 0), ranks
        self.collectives = Collectives(comm) if comm is not None else _NoRanks(self.size)

    def __repr__(self) -> str:
        return f"TensorParallel({self.axis}={self.size}; rank {self.rank})"

    # -- specs --------------------------------------------------------------------
    def dims(self, params: object, *, whole: bool = True) -> list[int | None]:
        """The split dimension of each leaf of ``params`` (its flattened order),
        or None for a whole leaf; a ValueError naming the leaf whose spec does
        not fit it, or (``whole``: the params are the whole leaves) whose split
        does not divide over the model ranks."""
        return [None if s is None else s.dim for s in self.splits(params, whole=whole)]

    def splits(self, params: object, *, whole: bool = True) -> list[Split | None]:
        """:meth:`dims` with each split's packed blocks: a :class:`Split` per
        leaf, or None for a whole leaf."""
        tu = tree_util()
        leaves = tu.tree_leaves_with_path(params)
        if self.specs is None:
            return [None] * len(leaves)
        specs = self.specs
        if isinstance(specs, (list, tuple)) and isinstance(params, dict) and all(
                isinstance(k, int) and 0 <= k < len(specs) for k in params):
            specs = {k: specs[k] for k in params}  # a pipeline stage's {layer: params}
        try:
            full = tu.tree_map(lambda s, sub: tu.tree_map(lambda _: s, sub), specs, params,
                               is_leaf=_is_pspec)
        except ValueError as e:
            raise ValueError(f"TensorParallel: the spec tree does not match the params tree "
                             f"({e}); give a PartitionSpec per leaf, a prefix of the params "
                             "tree, or one spec") from None
        bad = [p for p, s in tu.tree_leaves_with_path(specs, is_leaf=_is_pspec)
               if not _is_pspec(s)]
        if bad:
            raise TypeError(f"TensorParallel: specs{tu.keystr(bad[0])} is not a "
                            "jax.sharding.PartitionSpec or None")
        specs = tu.tree_leaves(full, is_leaf=_is_pspec)
        out: list[Split | None] = []
        for (path, leaf), spec in zip(leaves, specs, strict=True):
            out.append(self._dim(tu.keystr(path), tuple(getattr(leaf, "shape", ())), spec, whole))
        return out

    def _dim(self, where: str, shape: tuple[int, ...], spec: Any, whole: bool) -> Split | None:
        # spec: a PartitionSpec, a Packed or None (Any: mypy narrows ``spec`` to the
        # PartitionSpec mid-way through the unpacking below)
        blocks = 1
        if isinstance(spec, Packed):
            spec, blocks = spec.spec, spec.blocks
        entries = () if spec is None else tuple(spec)
        named = [i for i, e in enumerate(entries) if e is not None]
        for i in named:
            if entries[i] != self.axis:
                raise ValueError(f"TensorParallel: params{where}'s spec {spec} names "
                                 f"{entries[i]!r}; name only {self.axis!r} (ZeRO shards every "
                                 "leaf over the data ranks by itself)")
        if not named:
            return None
        if len(named) > 1 or len(entries) > len(shape):
            raise ValueError(f"TensorParallel: params{where}'s spec {spec} does not fit its "
                             f"shape {shape}: name {self.axis!r} at one dimension")
        d = named[0]
        if shape[d] % blocks:
            raise ValueError(f"TensorParallel: params{where} has {shape[d]} along dimension "
                             f"{d}, which is not {blocks} equal packed blocks")
        if whole and shape[d] % (blocks * self.size):
            each = " in each packed block" if blocks > 1 else ""
            raise ValueError(f"TensorParallel: params{where} has {shape[d] // blocks} along "
                             f"dimension {d}{each}, which does not divide over {self.size} "
                             "model ranks (pad it, as Megatron pads the vocabulary)")
        return Split(d, blocks)

    def shard(self, params: object) -> Any:
        """This model rank's slice of each leaf of the whole ``params`` (numpy,
        JAX or torch leaves: each keeps its type; a ``jax.ShapeDtypeStruct``
        becomes its slice's)."""
        import jax

        tu = tree_util()
        leaves, treedef = tu.tree_flatten(params)
        out = []
        for leaf, split in zip(leaves, self.splits(params), strict=True):
            if split is None:
                out.append(leaf)
            elif isinstance(leaf, jax.ShapeDtypeStruct):
                d = split.dim
                out.append(jax.ShapeDtypeStruct(
                    (*leaf.shape[:d], leaf.shape[d] // self.size, *leaf.shape[d + 1:]),
                    leaf.dtype))
            else:
                out.append(take_split(leaf, split, self.rank, self.size))
        return tu.tree_unflatten(treedef, out)

    def unshard(self, params: object) -> Any:
        """The whole leaves from every model rank's slices (a collective over
        the model ranks; host numpy arrays, device arrays copied to the host):
        :meth:`shard`'s inverse."""
        tu = tree_util()
        leaves, treedef = tu.tree_flatten(params)
        splits = self.splits(params, whole=False)
        out = []
        for leaf, split in zip(leaves, splits, strict=True):
            x = leaf if isinstance(leaf, np.ndarray) else host_copy(leaf)  # explicit from a device
            out.append(x if split is None or self.size == 1
                       else joined_stack(self.collectives.stacked(x), split))
        return tu.tree_unflatten(treedef, out)

    # -- the collectives (see [Note: tensor-parallel collectives]) -----------------
    def _rank_value(self) -> jax.Array | int:
        """This model rank inside a JAX program: an operand where the ranks
        share the program (see :class:`~shard.tensor_parallel._megatron.Collectives`)."""
        return self.collectives.ids()[0] if self.size > 1 else 0

    def copy(self, x: jax.Array) -> jax.Array:
        """Megatron's *f*: the identity forward, an all-reduce of the gradient."""
        return self.collectives.apply("copy", x)

    def reduce(self, x: jax.Array) -> jax.Array:
        """Megatron's *g*: an all-reduce (sum) forward, the identity backward."""
        return self.collectives.apply("reduce", x)

    def gather(self, x: jax.Array, axis: int = -1) -> jax.Array:
        """Every rank's ``x`` concatenated along ``axis``; the backward keeps
        this rank's slice of the gradient."""
        return self.collectives.apply("gather", x, axis)

    def scatter(self, x: jax.Array, axis: int = -1) -> jax.Array:
        """This rank's slice of ``x`` along ``axis``; the backward all-gathers."""
        return self.collectives.apply("scatter", x, axis)

    def gather_sequence(self, x: jax.Array, axis: int = 1) -> jax.Array:
        """Sequence parallelism's all-gather along ``axis`` into a
        column-parallel layer; the backward reduce-scatters the gradient."""
        return self.collectives.apply("gather_sequence", x, axis)

    def reduce_scatter(self, x: jax.Array, axis: int = 1) -> jax.Array:
        """Sequence parallelism's reduce-scatter along ``axis`` out of a
        row-parallel layer; the backward all-gathers the gradient."""
        return self.collectives.apply("reduce_scatter", x, axis)

    # -- Megatron's layers -----------------------------------------------------
    def column_linear(self, x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
                      gather_output: bool = False, sequence_parallel: bool = False,
                      sequence_axis: int = 1) -> jax.Array:
        """``x @ w + b`` with ``w``'s output columns split over the model ranks
        (``w``: this rank's ``(d_in, d_out / T)``, ``b``: its ``(d_out / T,)``):
        each rank's slice of the output, or the whole output with
        ``gather_output``. With ``sequence_parallel``, ``x`` is this rank's part
        of the sequence (along ``sequence_axis``), gathered first."""
        x = self.gather_sequence(x, sequence_axis) if sequence_parallel else self.copy(x)
        y = x @ w
        if b is not None:
            y = y + b
        return self.gather(y, -1) if gather_output else y

    def row_linear(self, x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
                   sequence_parallel: bool = False, sequence_axis: int = 1) -> jax.Array:
        """``x @ w + b`` with ``w``'s input rows split over the model ranks
        (``x``: this rank's ``(..., d_in / T)``, as a column-parallel layer
        leaves it; ``b`` whole): the whole output on every rank, or with
        ``sequence_parallel`` this rank's part of the sequence."""
        y = x @ w
        if sequence_parallel:
            y = self.reduce_scatter(y, sequence_axis)
            return y if b is None else y + self.copy(b)
        y = self.reduce(y)
        return y if b is None else y + b

    def embedding(self, ids: jax.Array, table: jax.Array, *, sequence_parallel: bool = False,
                  sequence_axis: int = 1) -> jax.Array:
        """A vocabulary-parallel embedding: ``table`` is this rank's rows of the
        vocabulary (``(V / T, d)``, rank r's rows ``[r V/T, (r+1) V/T)``); each
        rank looks up the ids it holds, and the sum over ranks is every id's
        row (with ``sequence_parallel``: this rank's part of the sequence)."""
        import jax.numpy as jnp

        n = table.shape[0]
        local = ids - self._rank_value() * n
        inside = (local >= 0) & (local < n)
        rows = jnp.take(table, jnp.where(inside, local, 0), axis=0)
        rows = jnp.where(inside[..., None], rows, jnp.zeros((), rows.dtype))
        if sequence_parallel:
            return self.reduce_scatter(rows, sequence_axis)
        return self.reduce(rows)

    def cross_entropy(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        """The per-token cross-entropy of vocabulary-parallel ``logits`` (this
        rank's ``(..., V / T)`` slice of the vocabulary, rank r's classes
        ``[r V/T, (r+1) V/T)``) against integer ``labels`` ``(...)``, without
        gathering the logits (see [Note: tensor-parallel collectives]); computed
        in float32, the same on every model rank."""
        import jax
        import jax.numpy as jnp

        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
        n = logits.shape[-1]
        top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
        rank = self._rank_value()
        if self.size > 1:  # the same shift on every rank: the largest of theirs
            top = jnp.max(self.collectives._all_gather(top[None], self.collectives.ids(), 0),
                          axis=0)
        z = logits - top[..., None]
        local = labels - rank * n
        inside = (local >= 0) & (local < n)
        picked = jnp.take_along_axis(z, jnp.where(inside, local, 0)[..., None], axis=-1)[..., 0]
        picked = jnp.where(inside, picked, jnp.zeros((), z.dtype))
        sums = self.reduce(jnp.stack([picked, jnp.sum(jnp.exp(z), axis=-1)]))
        return jnp.log(sums[1]) - sums[0]


class _NoRanks:
    """The collectives of a TensorParallel given a number of ranks: none to run on."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __getattr__(self, name: str) -> NoReturn:
        raise RuntimeError(f"TensorParallel({self.size}) describes a split without ranks (for "
                           "specs, shard and estimate_memory); give it a shard.Mesh or a "
                           "communicator to run its collectives")
