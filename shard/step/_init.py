"""A step's ``init``: this rank's state from whole params, from the shapes of a
torch module built on the meta device (materialised one unit at a time, see
[Note: meta-device init]), or from a JAX init function, unit by unit."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import ops._types
from ops import Device
from ops.comm._programs import SharedJit
from ops.device._device import device_of_or_none
from ops.device._dlpack import to_native
from shard.core._layout import alloc_units, native_leaves
from shard.core._paths import is_shape
from shard.core._state import TrainState
from shard.offload._offloader import Offloader
from shard.step import _checks
from shard.step._config import StepConfig
from shard.step._plan import Plan, make_plan, moment_buffers, new_state

if TYPE_CHECKING:
    import jax

    from ops._types import Array

__all__ = ["from_function", "from_params", "host_copy", "rows_of", "split_over_devices",
           "with_optax_state"]

log = logging.getLogger("shard.step")

Made = tuple[TrainState, Plan, Offloader | None]


def from_params(c: StepConfig, params: object, device: Device | None,
                current: Device) -> Made:
    """``step.init(params)``: arrays (on ``current``'s device unless they say
    otherwise), or shapes a loss object can materialise."""
    fn = f"{c.name}.init"
    tu = ops._types.tree_util()
    if c.tensor_parallel is not None and c.loss_fn.tensor_parallel is None:
        params = c.tensor_parallel.shard(params)  # this model rank's slices of the whole params
    _checks.refuse_keys(params, fn)
    raw, treedef = tu.tree_flatten(params)
    if c.stage == 3 and c.tensor_parallel is None and device is None and \
            any(split_over_devices(x) for x in raw):
        made = _from_split_arrays(c, params, current)
        if made is not None:
            return made
    _, leaves = native_leaves(raw, fn)
    if not any(is_shape(x) for x in leaves):
        if device is not None:
            raise ValueError(f"{fn}: device= is for params given as shapes; these are "
                             "arrays, and the state lives where they do")
        plan = make_plan(c, params, device=current)
        leaves = [plan.device.asarray(x) for x in native_leaves(
            plan.layout.treedef.flatten_up_to(params), fn)[1]]
        digest = _checks.digest(plan.device, leaves)
        remedy = () if c.kind == "provider" else (
            "make them from the same PRNG key on every rank (jax.random.key(seed)), or give "
            "every rank rank 0's params",)
        for comm in (c.comm, c.replicate) if c.replicate is not None else (c.comm,):
            _checks.agree_on_values(comm, digest, fn, *remedy)
        return by_units(c, plan, lambda u, i: [leaves[j] for j in i], check=False)
    materialize = c.loss_fn.materialize
    if materialize is None:
        raise TypeError(f"{fn}: the params are shapes only (no values); give arrays, or "
                        f"let each rank build them one unit at a time with "
                        f"{c.name}.init_from(init_fn, key)")
    paths = [p for p, _ in tu.tree_flatten_with_path(params)[0]]
    shapes = tu.tree_unflatten(treedef, leaves)  # meta tensors read as Shapes
    plan = make_plan(c, shapes, device=device or c.loss_fn.materialize_device)
    return by_units(c, plan, lambda u, i: materialize([paths[j] for j in i]))


def split_over_devices(x: object) -> bool:
    """A JAX array laid out over several CPU devices, not whole on each (a
    ``NamedSharding`` over a mesh axis)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or type(x).__module__.split(".")[0] not in ("jax", "jaxlib"):
        return False
    devices = sharding.device_set
    return len(devices) > 1 and not sharding.is_fully_replicated and all(
        d.platform == "cpu" for d in devices)


# A JAX array split over devices is one object that every thread rank reads (the
# user's params), and jaxlib reads its device shards without a lock of its own: four
# thread ranks reading one such leaf at once failed once in the suite with an
# IndexError inside jax (ArrayImpl._value). Host reads of them go one at a time.
_SPLIT_READS = threading.Lock()


def host_copy(x: object) -> np.ndarray:
    """``x`` as a host numpy array: a numpy array as it is, an array of a device,
    torch or JAX copied explicitly from where it lives (a CuPy array refuses
    ``np.asarray``), one thread at a time where it is split over devices."""
    if isinstance(x, np.ndarray):
        return x
    if not split_over_devices(x):
        return _host(x)
    with _SPLIT_READS:
        return _host(x)


def _host(x: object) -> np.ndarray:
    try:
        native = to_native(x)[0]  # an array of its device: on the host, a view (DLPack)
    except TypeError:  # numbers, lists, numpy scalars
        return np.asarray(x)
    device = device_of_or_none(native)
    return np.asarray(native) if device is None or device.host else device.to_host(native)


def rows_of(x: jax.Array, lo: int, hi: int) -> np.ndarray | None:
    """Rows ``[lo, hi)`` of a JAX array split along its first axis only, copied
    from the device shards that hold them; None where it is split otherwise."""
    with _SPLIT_READS:
        return _rows_of(x, lo, hi)


def _rows_of(x: jax.Array, lo: int, hi: int) -> np.ndarray | None:
    out, have = np.empty((hi - lo, *x.shape[1:]), x.dtype), np.zeros(hi - lo, bool)
    for piece in x.addressable_shards:
        first, *rest = piece.index
        if any(r != slice(None) and r.indices(n)[:2] != (0, n)
               for r, n in zip(rest, x.shape[1:], strict=True)):
            return None
        a, b, _ = first.indices(x.shape[0])
        a2, b2 = max(a, lo), min(b, hi)
        if a2 < b2 and not have[a2 - lo:b2 - lo].all():
            out[a2 - lo:b2 - lo] = np.asarray(piece.data[a2 - a:b2 - a])
            have[a2 - lo:b2 - lo] = True
    return out if have.all() else None


def _from_split_arrays(c: StepConfig, params: object, current: Device) -> Made | None:
    """Stage 3's state from JAX arrays split over several devices (a
    ``NamedSharding`` pytree, ``interop.jax.global_params``'): each rank copies
    the rows it keeps from the device shards that hold them, never the whole
    leaf (the whole-shaped buffer the unit path takes is zeros outside those
    rows, and a large one's untouched pages are never given memory by the
    operating system). The params are one global value, so the ranks'
    agreement is not checked. None where the state would not live on the
    host: the caller then reads whole leaves."""
    import jax

    tu = ops._types.tree_util()
    shapes = tu.tree_map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype), params)
    plan = make_plan(c, shapes, device=current)
    if not plan.device.host:
        return None
    leaves = plan.layout.treedef.flatten_up_to(params)
    rank = c.comm.rank

    def values(u: int, idx: list[int]) -> list[np.ndarray]:
        out = []
        for j in idx:
            leaf, x = plan.layout.leaves[j], leaves[j]
            lo = min(rank * leaf.rows_per_rank, leaf.rows)
            hi = min(lo + leaf.rows_per_rank, leaf.rows)
            mine = rows_of(x, lo, hi) if leaf.sharded and split_over_devices(x) else None
            if mine is None:
                out.append(host_copy(x))
                continue
            whole = np.zeros(leaf.shape, mine.dtype)  # pages outside the rows stay untouched
            whole[lo:hi] = mine
            out.append(whole)
        return out

    log.info("%s: reading this rank's rows from the device shards of the params", c.name)
    return by_units(c, plan, values, check=False)


def from_function(c: StepConfig, init_fn: Callable[..., object], args: tuple,
                  device: Device | None) -> Made:
    """``step.init_from(init_fn, *args)``: one program per unit, keeping only
    that unit's outputs, compiled once for a group's thread ranks (and for a
    later call with the same program: see [Note: one program for a group's
    ranks])."""
    import jax

    if c.tensor_parallel is not None:
        raise NotImplementedError(f"{c.name}.init_from: with a 'model' axis, give the whole "
                                  f"params to {c.name}.init (it keeps this model rank's slices)")
    tu = ops._types.tree_util()
    plan = make_plan(c, jax.eval_shape(init_fn, *args), device=device)

    def unit(u: int, idx: list[int]) -> list[jax.Array | np.ndarray]:
        part = SharedJit(lambda *a: [tu.tree_leaves(init_fn(*a))[j] for j in idx])
        out = part(*args)
        on_cpu = [all(d.platform == "cpu" for d in x.devices()) for x in out]
        if plan.device.host:  # JAX on a GPU and the state on the CPU: an explicit copy
            return [x if cpu else np.asarray(jax.device_get(x)) for x, cpu in zip(out, on_cpu,
                                                                                strict=True)]
        # JAX on the CPU and the state on a GPU: an explicit copy through the host
        return [np.asarray(x) if cpu else x for x, cpu in zip(out, on_cpu, strict=True)]

    return by_units(c, plan, unit, remedy="pass every rank the same arguments (the same key) "
                    "to init_from")


# values: its leaves' values (numpy, jax or device arrays, or a loss's materialised ones)
def by_units(c: StepConfig, plan: Plan, values: Callable[[int, list[int]], list[Any]], *,
             check: bool = True,
             remedy: str | None = None) -> Made:
    """The state over ``plan``, unit by unit: ``values(u, leaf_indices)`` gives
    unit ``u``'s whole leaves, of which this rank keeps its part; with
    ``check``, the ranks' values are compared afterwards (a collective)."""
    layout, device = plan.layout, plan.device
    fn = f"{c.name}.init"
    rank = c.comm.rank if c.stage > 0 else 0
    whole: list[Array | None] = [None] * len(layout.leaves)  # stages 0-2 keep the params whole
    checksum = 1

    def unit_values(u: int) -> list[Array]:
        nonlocal checksum
        idx = list(layout.units[u].leaves)
        got = values(u, idx)
        got = [device.asarray(x) for x in native_leaves(list(got), fn)[1]]
        for j, x in zip(idx, got, strict=True):
            leaf = layout.leaves[j]
            if tuple(x.shape) != leaf.shape or str(x.dtype) != leaf.dtype:
                raise ValueError(f"{fn}: params{leaf.path} was materialised as "
                                 f"{x.dtype}{list(x.shape)}; its shape says "
                                 f"{leaf.dtype}{list(leaf.shape)}")
            if c.stage < 3:
                whole[j] = x
        if check:
            checksum = _checks.digest(device, got, checksum)
        return got

    offloader = plan.offloader()
    rest: tuple = ()
    master: Sequence[Array]
    if offloader is not None:  # masters and moments in host memory or on disk
        master, *moments, copies = offloader.init_buffers(unit_values, rank)
    else:
        master = alloc_units(layout, plan.master_dtype, device)
        views = layout.local_views(master)
        for u in range(len(layout.units)):
            for j, x in zip(layout.units[u].leaves, unit_values(u), strict=True):
                layout.scatter_leaf(layout.leaves[j], x, rank, views[j])
        copies = None
        if plan.optimizer.fused is None:  # an optax state: tx.init of the local views
            moments, rest = plan.optimizer.init(layout, master)
        else:
            moments = moment_buffers(plan)
    if check:
        for comm in (c.comm, c.replicate) if c.replicate is not None else (c.comm,):
            _checks.agree_on_values(comm, checksum, fn, *(remedy,) if remedy else ())
    state = new_state(plan, master, moments, opt_rest=rest, full_leaves=whole, copies=copies)
    log.info("%s: %d units, %d of %d elements on rank %d", c.name, len(layout.units),
             layout.local_size(), plan.full_layout.local_size(), c.comm.rank)
    return state, plan, offloader


_OPTAX_FIELDS = {"exp_avg": "mu", "exp_avg_sq": "nu"}  # a fused moment: optax's field


def _has(x: object, field: str) -> bool:
    """Whether ``x`` is a named tuple with ``field`` (optax's states are)."""
    return field in getattr(type(x), "_fields", ())


def with_optax_state(c: StepConfig, plan: Plan, state: TrainState, opt_state: object) -> TrainState:
    """``init(params, opt_state=...)``: ``state`` continuing an optax optimizer's
    state for the whole params (``tx.init(params)``'s structure, after any
    number of updates): this rank's part of its moments, and its count as the
    state's step, so Adam's bias correction and a schedule go on where they
    were. For the fused optimizers the first node with ``mu`` (and ``nu``) and
    ``count`` is read (``optax.adam``'s, ``adamw``'s, ``lion``'s, ``lamb``'s);
    for an optax transformation, the whole state."""
    fn = f"{c.name}.init"
    if c.offload is not None:
        raise NotImplementedError(f"{fn}: opt_state= with offload= is not built; init without "
                                  "it and load a checkpoint instead")
    tu = ops._types.tree_util()
    opt = plan.optimizer
    rank = c.comm.rank if c.stage > 0 else 0
    found = [x for x in tu.tree_leaves(opt_state, is_leaf=lambda x: _has(x, "count"))
             if _has(x, "count")]
    count = int(host_copy(found[0].count)) if found else None
    full, rest = _moments_of(fn, plan, opt_state, state.opt_rest, have_count=count is not None)
    if count is None:
        raise TypeError(f"{fn}: opt_state holds no count: without it the state's step, and "
                        "with it Adam's bias correction and the schedule, would start again")
    buffers, checksum = _scattered(fn, plan, full, rank, count + 1)
    for comm in (c.comm, c.replicate) if c.replicate is not None else (c.comm,):
        _checks.agree_on_values(comm, checksum, fn, "give every rank the same opt_state")
    if opt.fused is not None:
        buffers = [[plan.device.asarray(b) for b in bufs] for bufs in buffers]
        moments = plan.packed_moments(buffers)
    else:
        moments = buffers
    return state.replace(moments=tuple(tuple(m) for m in moments), opt_rest=rest,
                         step=np.asarray(count, np.int64))


def _moments_of(fn: str, plan: Plan, opt_state: object, rest: tuple,
                have_count: bool) -> tuple[list[object], tuple]:
    """The whole moments in ``opt_state`` (the fused optimizer's, or an optax
    transformation's own) and the optimizer's other state leaves (``rest``
    where there are none)."""
    tu = ops._types.tree_util()
    opt = plan.optimizer
    if opt.fused is None:  # an optax transformation: its own structure
        try:
            tops = opt._treedef.flatten_up_to(opt_state)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{fn}: opt_state does not have the structure of the optimizer's "
                            f"init(params): {e}") from None
        rest = tuple(np.array(host_copy(t)) for t, m in zip(tops, opt._is_moment, strict=True)
                     if not m)
        for x, (shape, dtype) in zip(rest, opt.rest, strict=True):
            if tuple(x.shape) != tuple(shape) or str(x.dtype) != dtype:
                raise TypeError(f"{fn}: opt_state has a {x.dtype}{list(x.shape)} leaf where "
                                f"the optimizer keeps {dtype}{list(shape)}")
        return [t for t, m in zip(tops, opt._is_moment, strict=True) if m], rest
    adam = [x for x in tu.tree_leaves(opt_state, is_leaf=lambda x: _has(x, "mu"))
            if _has(x, "mu")]
    fields = [_OPTAX_FIELDS[m] for m in opt.moments]
    if not adam or not all(_has(adam[0], f) for f in fields) or not have_count:
        raise TypeError(f"{fn}: opt_state holds no optax state with "
                        f"{', '.join(fields)} and count (optax.adam's, adamw's, lion's or "
                        f"lamb's) for this step's {'/'.join(opt.moments)}")
    return [getattr(adam[0], f) for f in fields], rest


def _scattered(fn: str, plan: Plan, full: list[object], rank: int,
               checksum: int) -> tuple[list[list[Array]], int]:
    """This rank's shards of each whole moment tree in ``full`` (host buffers,
    one per unit), and ``checksum`` with every moment's values digested in."""
    layout = plan.layout
    buffers = [alloc_units(layout, plan.master_dtype) for _ in full]
    for tree, bufs in zip(full, buffers, strict=True):
        try:
            leaves = layout.treedef.flatten_up_to(tree)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{fn}: opt_state's moments are not shaped like the params: "
                            f"{e}") from None
        for leaf, x, view in zip(layout.leaves, leaves, layout.local_views(bufs), strict=True):
            x = host_copy(x)
            if tuple(x.shape) != leaf.shape:
                raise TypeError(f"{fn}: opt_state's moment of params{leaf.path} has shape "
                                f"{list(x.shape)}; the leaf has {list(leaf.shape)}")
            x = x.astype(plan.master_dtype, copy=False)
            checksum = _checks.digest(ops.HOST, [x], checksum)
            layout.scatter_leaf(leaf, x, rank, view)
    return buffers, checksum
