"""Layouts: which leaf lives where in each rank's flat unit buffers.

[Note: unit buffers]
Leaves are grouped into units (by default one per top-level subtree of the
params; an FSDP unit, e.g. one transformer block). Each rank keeps one flat
buffer per unit, laid out as

    [ sharded section: this rank's rows of every Shard(0) leaf, in leaf order
      | replicated section: every Replicate() leaf, whole ]

A Shard(0) leaf of shape (n, *rest) gives rank r its rows [r*R, (r+1)*R) with
R = ceil(n / W); rows past n are zero padding (so any n shards on any W). Its
local shard is therefore R * prod(rest) elements on every rank, and leaves are
views into the buffer, so one collective and one fused optimizer launch serve
a whole unit. All-gathering the sharded sections gives a (W, S) array whose
row r is rank r's section; a leaf is the concatenation of its column block
over the W rows, cut back to n rows (one copy, as FSDP2's copy-out). Gradients
travel the other way (copy-in to the (W, S) layout, then one reduce-scatter);
replicated leaves' gradients are all-reduced.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ops import HOST, Device, device_of
from ops._types import tree_util
from ops.device._runs import Runs
from shard.core._paths import meta_shape
from shard.core._specs import Shard, resolve_specs

__all__ = ["Layout", "LeafLayout", "UnitLayout", "make_layout", "min_num_params_of", "partition",
           "unpartition"]

if TYPE_CHECKING:
    from jax.tree_util import PyTreeDef
    from numpy.typing import DTypeLike

    from ops._types import Array

Units = None | int | Callable[[tuple], Hashable]


@dataclass(frozen=True)
class LeafLayout:
    """Where one leaf lives. Sizes are in elements."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    sharded: bool
    unit: int
    offset: int  # in the unit's local buffer
    rows_per_rank: int  # R for sharded leaves, the leaf's rows for replicated ones

    # Derived sizes, computed once: the step's per-leaf paths read them often.
    @functools.cached_property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @functools.cached_property
    def row_size(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @functools.cached_property
    def size(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def local_size(self) -> int:
        return self.rows_per_rank * self.row_size if self.sharded else self.size

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        return (self.rows_per_rank, *self.shape[1:]) if self.sharded else self.shape


@dataclass(frozen=True)
class UnitLayout:
    """One unit: its leaves (indices into ``Layout.leaves``) and section sizes."""

    name: str
    leaves: tuple[int, ...]
    sharded_size: int  # S, per rank
    replicated_size: int  # P

    @property
    def local_size(self) -> int:
        return self.sharded_size + self.replicated_size


@dataclass(frozen=True)
class Layout:
    """The layout of a params pytree over ``world_size`` ranks (hashable, static)."""

    treedef: PyTreeDef
    leaves: tuple[LeafLayout, ...]
    units: tuple[UnitLayout, ...]
    world_size: int

    def fingerprint(self) -> int:
        """A 63-bit hash of everything ranks must agree on."""
        text = repr((str(self.treedef), self.leaves, self.units, self.world_size))
        return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)

    def local_size(self) -> int:
        return sum(u.local_size for u in self.units)

    # -- per-rank buffers <-> leaves ----------------------------------------------
    def local_views(self, buffers: Sequence[Array]) -> list[Array]:
        """Each leaf's local shard, as a view into its unit's buffer."""
        out = []
        for leaf in self.leaves:
            buf = buffers[leaf.unit]
            out.append(buf[leaf.offset:leaf.offset + leaf.local_size].reshape(leaf.local_shape))
        return out

    def scatter_leaf(self, leaf: LeafLayout, x: Array, rank: int, dst: Array) -> None:
        """Write rank ``rank``'s part of the full leaf ``x`` into ``dst`` (its local
        view); ``x`` is an array of ``dst``'s device."""
        if not leaf.sharded:
            dst[...] = x.reshape(leaf.local_shape)
            return
        rows = x.reshape(leaf.rows, leaf.row_size)
        lo = min(rank * leaf.rows_per_rank, leaf.rows)
        hi = min(lo + leaf.rows_per_rank, leaf.rows)
        flat = dst.reshape(leaf.rows_per_rank, leaf.row_size)
        flat[:hi - lo] = rows[lo:hi]
        flat[hi - lo:] = 0

    def gathered_leaf(self, leaf: LeafLayout, gathered: Array, local: Array) -> Array:
        """The full leaf from a unit's all-gathered (W * S) sharded sections.

        Replicated leaves come from ``local`` (this rank's unit buffer).
        """
        if not leaf.sharded:
            return local[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape)
        unit = self.units[leaf.unit]
        block = gathered.reshape(self.world_size, unit.sharded_size)[
            :, leaf.offset:leaf.offset + leaf.local_size]
        rows = block.reshape(self.world_size * leaf.rows_per_rank, leaf.row_size)
        return rows[:leaf.rows].reshape(leaf.shape)

    def gather_runs(self, u: int, full: Layout, *,
                    order: Sequence[int] | None = None) -> tuple[Runs, Runs]:
        """Unit ``u``'s copy-out as runs (see ``ops/device/_runs.py``): from its all-gathered
        (W, S) sections, each sharded leaf's rows on each rank into the unit's flat
        buffer in the ``full`` (one-rank) layout; and each replicated leaf from
        this rank's unit buffer. ``order[w]`` is the section that holds rank
        ``w``'s rows, where a gather put them out of rank order (default ``w``)."""
        sharded: list[tuple[int, int, int]] = []
        replicated: list[tuple[int, int, int]] = []
        unit = self.units[u]
        for i in unit.leaves:
            leaf, dst = self.leaves[i], full.leaves[i].offset
            if not leaf.sharded:
                replicated.append((leaf.offset, dst, leaf.size))
                continue
            r = leaf.rows_per_rank
            for w in range(self.world_size):
                rows = max(0, min(r, leaf.rows - w * r))
                at = w if order is None else order[w]
                sharded.append((at * unit.sharded_size + leaf.offset, dst + w * r * leaf.row_size,
                                rows * leaf.row_size))
        return Runs(*_columns(sharded)), Runs(*_columns(replicated))

    def grad_runs(self, u: int, itemsize: int) -> Runs:
        """Unit ``u``'s copy-in of whole gradients as runs over separate tensors
        (tensor j: the unit's j-th leaf, elements of ``itemsize`` bytes): each
        sharded leaf's rows for each rank into the (W, S) reduce layout, the
        padding rows zero. Replicated leaves have no runs here."""
        src, dst, lengths, tensor = [], [], [], []
        unit = self.units[u]
        for j, i in enumerate(unit.leaves):
            leaf = self.leaves[i]
            if not leaf.sharded:
                continue
            r, row = leaf.rows_per_rank, leaf.row_size
            for w in range(self.world_size):
                lo = min(w * r, leaf.rows)
                rows = min(lo + r, leaf.rows) - lo
                at = w * unit.sharded_size + leaf.offset
                src += [lo * row * itemsize, 0]
                dst += [at, at + rows * row]
                lengths += [rows * row, (r - rows) * row]
                tensor += [j, -1]
        return Runs(src, dst, lengths, tensor=tensor)

    def pack_grad(self, leaf: LeafLayout, g: Array | None, sharded: Array, replicated: Array,
                  *, add: bool = False) -> None:
        """Copy (or with ``add``, add) a full gradient into a unit's reduce layout
        (see [Note: unit buffers]); the padding rows are left at zero. ``g`` is an
        array of the buffers' device, or None for a zero gradient."""
        unit = self.units[leaf.unit]
        if not leaf.local_size:  # no rows here (a frozen leaf's gradient: dropped)
            return
        if g is None:
            if not add:
                self.pack_grad(leaf, device_of(sharded).zeros(leaf.size, sharded.dtype), sharded,
                               replicated)
            return
        if not leaf.sharded:
            off = leaf.offset - unit.sharded_size
            dst = replicated[off:off + leaf.size]
            if add:
                dst += g.reshape(-1)
            else:
                dst[...] = g.reshape(-1)
            return
        rows = g.reshape(leaf.rows, leaf.row_size)
        dst = sharded.reshape(self.world_size, unit.sharded_size)[
            :, leaf.offset:leaf.offset + leaf.local_size].reshape(
                self.world_size, leaf.rows_per_rank, leaf.row_size)
        for r in range(self.world_size):
            lo = min(r * leaf.rows_per_rank, leaf.rows)
            hi = min(lo + leaf.rows_per_rank, leaf.rows)
            if add:
                dst[r, :hi - lo] += rows[lo:hi]
            else:
                dst[r, :hi - lo] = rows[lo:hi]
                dst[r, hi - lo:] = 0


def _columns(rows: list[tuple[int, int, int]]) -> tuple[list[int], list[int], list[int]]:
    return ([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def _unit_keys(paths: list[tuple], units: Units) -> list[Hashable]:
    tu = tree_util()
    if units is None or isinstance(units, int):
        depth = 1 if units is None else units
        if depth < 1:
            raise ValueError(f"units: a depth must be >= 1; got {depth}")
        return [tu.keystr(p[:depth]) if p else "<root>" for p in paths]
    if callable(units):
        return [units(p) for p in paths]
    raise TypeError(f"units must be None, a depth (int) or a function path -> unit key; got "
                    f"{type(units).__name__}")


def min_num_params_of(fn: str, value: object) -> int:
    """``min_num_params`` as an int (``1e5`` is 100000); a ValueError naming it
    for anything else than a whole number >= 0."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{fn}: min_num_params must be a whole number of elements >= 0; got "
                         f"{value!r}")
    return value


def _merge_small(order: list[Hashable], unit_of: list[int], sizes: list[int],
                 dtypes: list[str], min_num_params: int) -> tuple[list[str], list[int]]:
    """Consecutive units of one dtype joined until each holds ``min_num_params``
    elements, a short tail joining the group before it (FSDP's size-based
    wrapping): the groups' names and each leaf's group."""
    per_unit = [0] * len(order)
    kinds: list[set[str]] = [set() for _ in order]
    for i, u in enumerate(unit_of):
        per_unit[u] += sizes[i]
        kinds[u].add(dtypes[i])
    groups: list[list[int]] = []
    held: list[int] = []  # each group's elements
    for u in range(len(order)):
        if groups and kinds[groups[-1][0]] == kinds[u] and held[-1] < min_num_params:
            groups[-1].append(u)
            held[-1] += per_unit[u]
        else:
            groups.append([u])
            held.append(per_unit[u])
    if len(groups) > 1 and held[-1] < min_num_params and \
            kinds[groups[-2][0]] == kinds[groups[-1][0]]:
        tail = groups.pop()
        groups[-1] += tail
    merged = [0] * len(order)
    for g, members in enumerate(groups):
        for u in members:
            merged[u] = g
    return ([" + ".join(str(order[u]) for u in members) for members in groups],
            [merged[u] for u in unit_of])


def make_layout(params: object, specs: object = None, *, world_size: int, units: Units = None,
                min_num_params: int = 0, fn: str = "layout") -> Layout:
    """The layout of ``params`` (arrays or ``jax.ShapeDtypeStruct``-like) on W
    ranks; with ``min_num_params``, consecutive units of fewer elements are
    joined (see :func:`_merge_small`)."""
    tu = tree_util()
    if world_size < 1:
        raise ValueError(f"{fn}: world_size must be >= 1; got {world_size}")
    specs = resolve_specs(params, specs, fn=fn)
    with_paths, treedef = tu.tree_flatten_with_path(params)
    spec_leaves = treedef.flatten_up_to(specs)
    paths = [p for p, _ in with_paths]
    keys = _unit_keys(paths, units)
    order = list(dict.fromkeys(keys))
    index = {k: u for u, k in enumerate(order)}
    unit_of = [index[k] for k in keys]
    names = [str(k) for k in order]
    if min_num_params > 0 and len(order) > 1:
        sizes = [math.prod(int(d) for d in getattr(x, "shape", ())) for _, x in with_paths]
        names, unit_of = _merge_small(order, unit_of, sizes,
                                      [str(np.dtype(x.dtype)) for _, x in with_paths],
                                      min_num_params)
    leaves: list[LeafLayout | None] = [None] * len(paths)
    unit_layouts = []
    for u, name in enumerate(names):
        members = [i for i, uu in enumerate(unit_of) if uu == u]
        offset, sharded_members = 0, [i for i in members if isinstance(spec_leaves[i], Shard)]
        for section in (sharded_members, [i for i in members if i not in sharded_members]):
            for i in section:
                x = with_paths[i][1]
                shape = tuple(int(d) for d in getattr(x, "shape", ()))
                sharded = i in sharded_members
                rows = shape[0] if shape else 1
                leaf = LeafLayout(tu.keystr(paths[i]), shape, str(np.dtype(x.dtype)), sharded, u,
                                  offset, -(-rows // world_size) if sharded else rows)
                leaves[i] = leaf
                offset += leaf.local_size
            if section is sharded_members:
                sharded_size = offset
        unit_layouts.append(UnitLayout(name, tuple(members), sharded_size,
                                       offset - sharded_size))
    placed = cast(list[LeafLayout], leaves)  # every leaf is in one unit's sections
    return Layout(treedef, tuple(placed), tuple(unit_layouts), world_size)


def master_dtype_of(layout: Layout) -> np.dtype:
    """float64 when every leaf is float64 (exact CPU runs), else float32."""
    if layout.leaves and all(leaf.dtype == "float64" for leaf in layout.leaves):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def alloc_units(layout: Layout, dtype: DTypeLike, device: Device = HOST) -> list[Array]:
    """Zeroed local buffers on ``device``, one per unit (64-byte aligned on the host)."""
    return [device.zeros(unit.local_size, dtype) for unit in layout.units]


def native_leaves(leaves: Sequence[object], fn: str) -> tuple[Device | None, list[Any]]:
    """Array leaves as arrays of the one device they live on.

    numpy and device arrays stay as they are, torch tensors and jax arrays are
    viewed through DLPack (zero-copy), torch tensors on the meta device become
    :class:`Shape` s, and numbers and lists go through ``np.asarray``. Returns
    ``(device, leaves)``, the device None when no leaf is an array (shapes
    only); a TypeError names the first leaf on another device than the others.
    """
    from ops.device._device import device_of_or_none
    from ops.device._dlpack import to_native

    found: tuple[Device, int] | None = None
    out: list[object] = []
    for i, x in enumerate(leaves):
        if getattr(x, "is_meta", False) is True:  # a torch tensor on the meta device
            out.append(meta_shape(x))
            continue
        if device_of_or_none(x) is None and hasattr(x, "__dlpack__"):
            x = to_native(x)[0]
        d = device_of_or_none(x)
        if d is None:
            scalar_or_list = isinstance(x, (np.generic, int, float, bool, list, tuple))
            out.append(np.asarray(x) if scalar_or_list else x)  # shapes stay as they are
            continue
        if found is None:
            found = (d, i)
        elif d is not found[0]:
            raise TypeError(f"{fn}: leaf {i} is a {d.name} array but leaf {found[1]} is a "
                            f"{found[0].name} array; put every leaf on one device")
        out.append(x)
    return (None if found is None else found[0]), out


def partition(tree: object, specs: object = None, *, rank: int, world_size: int,
              units: Units = None, dtype: DTypeLike | None = None) -> Any:
    """This rank's shards of a full pytree (see [Note: unit buffers]).

    Args:
      tree: the full pytree of arrays (numpy, or anything ``np.asarray`` takes; or
        arrays of one device, where the shards are then made).
      specs: a spec per leaf, a prefix of the tree, or one spec (default Shard(0)).
      rank: which shards: this rank's.
      world_size: which shards: of this many ranks.
      units: how leaves group into flat buffers (default: top-level subtrees).
      dtype: the shards' dtype (default: each unit's first leaf's dtype).

    Returns:
      The pytree of local shards: a Shard(0) leaf of shape (n, *rest) becomes
      (ceil(n / world_size), *rest), zero-padded; a replicated leaf stays whole.
      Leaves of one unit are views into one flat buffer.

    Examples:
      >>> import numpy as np, shard
      >>> tree = {"w": np.arange(10.0).reshape(5, 2), "b": np.ones(3)}
      >>> shard.partition(tree, rank=1, world_size=2)["w"].tolist()
      [[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"partition: rank must be in [0, {world_size}); got {rank}")
    layout = make_layout(tree, specs, world_size=world_size, units=units, fn="partition")
    device, full = native_leaves(layout.treedef.flatten_up_to(tree), "partition")
    device = device or HOST
    dtypes = [np.dtype(dtype) if dtype is not None else
              np.dtype(layout.leaves[u.leaves[0]].dtype) for u in layout.units]
    buffers = [device.empty(u.local_size, d) for u, d in zip(layout.units, dtypes, strict=True)]
    views = layout.local_views(buffers)
    for leaf, x, dst in zip(layout.leaves, full, views, strict=True):
        layout.scatter_leaf(leaf, device.asarray(x).astype(dst.dtype, copy=False), rank, dst)
    return layout.treedef.unflatten(views)


def unpartition(shards: Sequence[object], like: object, specs: object = None) -> Any:
    """The full pytree from every rank's shards (the inverse of :func:`partition`).

    Args:
      shards: ``world_size`` pytrees of local shards, in rank order.
      like: the full tree, or a tree of anything with ``shape`` and ``dtype``
        (e.g. ``jax.ShapeDtypeStruct``), to cut padding off.
      specs: the specs the shards were made with.
    """
    tu = tree_util()
    world_size = len(shards)
    layout = make_layout(like, specs, world_size=world_size, fn="unpartition")
    per_rank = [native_leaves(layout.treedef.flatten_up_to(s), "unpartition")[1]
                for s in shards]
    device = native_leaves([p[0] for p in per_rank if p], "unpartition")[0] or HOST
    out = []
    for i, leaf in enumerate(layout.leaves):
        parts = [device.asarray(p[i]) for p in per_rank]
        if leaf.sharded:
            out.append(device.xp.concatenate(parts, axis=0)[:leaf.rows])
        else:
            out.append(parts[0])
    return tu.tree_unflatten(layout.treedef, out)
