"""Checks a ZeRO step makes before it changes anything (that every rank agrees on
the params and layout at init, and that a state and batch fit the step), and
the batch's cast to the compute dtype."""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

import ops._types
from ops import Communicator, Device, FusedOptimizer
from ops._optim import ZeroOne
from ops.comm._collectives import all_gather_host
from ops.device._dlpack import host_copy
from shard.core._layout import Layout
from shard.core._state import TrainState

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ops._types import Array
    from shard.core._mesh import Topology
    from shard.core.losses._jax import JaxLoss
    from shard.step._config import StepConfig, ZeroOptions
    from shard.step._plan import Plan

__all__ = ["agree_on_layout", "agree_on_values", "batch_rows", "cast_inputs", "check_batch",
           "check_fits", "check_is_state", "counted_rows", "digest", "eval_loss", "learning_rate",
           "model_state", "refuse_keys", "total_rows", "virtual_shards", "weights"]


def digest(device: Device, arrays: Sequence[Array], start: int = 1) -> int:
    """A checksum of ``arrays``' bytes, continued from ``start`` (on a GPU, an
    explicit copy of each to the host: ``init`` runs once)."""
    for x in arrays:
        host = np.ascontiguousarray(x if device.host else device.to_host(x))
        start = zlib.adler32(host.view(np.uint8).reshape(-1).data, start)
    return start


def agree_on_values(comm: Communicator, checksum: int, fn: str, remedy: str = "seed the "
                    "model's initialisation identically on every rank (thread ranks share "
                    "torch's global RNG: build the model once and deepcopy it)") -> None:
    """Every rank's params equal rank 0's: their :func:`digest` s are compared (a
    collective)."""
    every = all_gather_host(comm, np.array([checksum], np.int64))
    if np.any(every != every[0]):
        bad = [r for r, d in enumerate(every.tolist()) if d != int(every[0])]
        raise ValueError(f"{fn}: the params on rank(s) {bad} differ from rank 0's; {remedy}")


def agree_on_layout(comm: Communicator, layout: Layout, fn: str) -> None:
    """Every rank built the same layout (a fingerprint is compared; a collective)."""
    mine = np.array([layout.fingerprint()], np.int64)
    every = all_gather_host(comm, mine)
    if np.any(every != mine[0]):
        bad = [r for r, f in enumerate(every.tolist()) if f != int(mine[0])]
        raise ValueError(f"{fn}: rank(s) {bad} built a different layout than rank "
                         f"{comm.rank} (params shapes, dtypes, specs or units differ); "
                         "every rank must init with the same params")


def check_batch(name: str, rank: int, batch: object) -> None:
    """An empty batch would give a nan loss (a mean over nothing) silently."""
    tu = ops._types.tree_util()
    for path, x in tu.tree_flatten_with_path(batch)[0]:
        shape = getattr(x, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] == 0:
            raise ValueError(f"{name}: batch{tu.keystr(path)} has no rows (shape "
                             f"{tuple(shape)}) on rank {rank}; every rank needs a "
                             "non-empty part of the batch")


def weights(batches: Sequence[object]) -> list[float] | None:
    """Each micro-batch's weight in the step's mean: its rows over the mean rows,
    so that micro-batches of 3 and 1 rows give the gradient of their 4 rows'
    mean, as their concatenation would. None where every micro-batch weighs the
    same (equal rows, or rows that cannot be counted: no array leaves, or
    leaves that disagree on their leading dimension)."""
    if len(batches) < 2:
        return None
    counted = [_rows(b) for b in batches]
    rows = [n for n in counted if n is not None]
    if len(rows) < len(counted) or len(set(rows)) == 1:
        return None
    mean = sum(rows) / len(rows)
    return [n / mean for n in rows]


def counted_rows(name: str, rank: int, batch: object) -> int:
    """A batch's rows for ``weight_by_rows`` (see :func:`batch_rows`)."""
    return batch_rows(f"{name}: weight_by_rows weighs each batch by its rows, but on rank "
                      f"{rank}", batch)


def batch_rows(where: str, batch: object) -> int:
    """A batch's rows, the leading dimension its array leaves share; a
    ValueError (after ``where``) names the leaves that disagree, or a batch
    with none."""
    tu = ops._types.tree_util()
    seen: tuple[str, int] | None = None
    for path, x in tu.tree_flatten_with_path(batch)[0]:
        shape: tuple[int, ...] = getattr(x, "shape", ())
        if len(shape) == 0:
            continue
        if seen is None:
            seen = (tu.keystr(path), int(shape[0]))
        elif int(shape[0]) != seen[1]:
            raise ValueError(f"{where} batch{seen[0]} has {seen[1]} rows but "
                             f"batch{tu.keystr(path)} {int(shape[0])}; give array leaves that "
                             "share their leading dimension")
    if seen is None:
        raise ValueError(f"{where} the batch has no array leaves to count rows of")
    return seen[1]


def virtual_shards(batch: object, rows: int, group: int) -> list[Any]:
    """``batch`` (of ``rows`` rows, which ``group`` divides) cut into ``group``
    equal, contiguous parts along its rows (see [Note: the same bits at any
    world size])."""
    tu = ops._types.tree_util()
    flat, tree = tu.tree_flatten(batch)
    n = rows // group
    return [tu.tree_unflatten(tree, [x[j * n:(j + 1) * n] if len(getattr(x, "shape", ())) else x
                                     for x in flat]) for j in range(group)]


def total_rows(batches: Sequence[object]) -> int:
    """The rows of all ``batches`` together, or 0 where some cannot be counted."""
    rows = [_rows(b) for b in batches]
    counted = [n for n in rows if n is not None]
    return sum(counted) if len(counted) == len(rows) else 0


def _rows(batch: object) -> int | None:
    dims = {x.shape[0] for x in ops._types.tree_util().tree_leaves(batch)
            if len(getattr(x, "shape", ())) > 0}
    return dims.pop() if len(dims) == 1 else None


def learning_rate(config: StepConfig, count: int) -> float | None:
    """The rate of the update after ``count`` updates: a finite number >= 0, or a
    ValueError before the step changes anything (see [Note: failed steps])."""
    if not isinstance(config.optimizer, FusedOptimizer):
        return None  # an optax transformation keeps its rate inside
    lr = config.optimizer.learning_rate(count)
    try:
        lr = float(lr)
    except (TypeError, ValueError):
        raise TypeError(f"{config.name}: the learning-rate schedule gave {lr!r} at step "
                        f"{count}; it must return a number") from None
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"{config.name}: the learning-rate schedule gave {lr!r} at step "
                         f"{count}; it must be a finite number >= 0 (the state is unchanged)")
    return lr


def cast_inputs(plan: Plan, batch: object) -> Any:
    """A JAX loss's batch with its floating arrays in the compute dtype (see
    ``Precision.cast_forward_inputs``; a torch module casts in its forward)."""
    p, c = plan.precision, plan.config
    jax_batch = c.kind != "provider" or c.loss_fn.jax_batch
    if (not jax_batch or not p.cast_forward_inputs or p.param_dtype is None
            or p.param_dtype == plan.master_dtype):
        return batch

    def cast(x: object) -> object:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not hasattr(x, "astype"):
            return x
        d = np.dtype(dtype)
        return x.astype(p.param_dtype) if d.kind == "f" and d != p.param_dtype else x

    return ops._types.tree_map(cast, batch)


def check_is_state(name: str, state: object) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"{name}: expected the TrainState from {name}.init; got "
                        f"{type(state).__name__}")


def check_fits(plan: Plan, state: TrainState) -> None:
    """A state another step made fits ``plan``: the same stage, rank, layout and
    device."""
    c, m = plan.config, state.meta
    if m.stage != c.stage or m.rank != c.comm.rank or (
            m.layout.world_size != plan.layout.world_size):
        raise ValueError(
            f"{c.name}: this TrainState was made for stage {m.stage}, rank {m.rank} of "
            f"{m.layout.world_size if m.stage else 'any'} ranks, but this step is stage "
            f"{c.stage} on rank {c.comm.rank} of {c.comm.world_size}; load it "
            "through shard.load to re-shard, or init a new state")
    if m.layout != plan.layout:
        raise ValueError(
            f"{c.name}: this TrainState does not fit the params this step was set up for: "
            f"{layout_difference(m.layout, plan.layout)}; pass the state of this model "
            "(shard.load re-shards a checkpoint), or init a new state")
    if m.frozen != plan.frozen:
        paths = [plan.layout.leaves[i].path for i in sorted(m.frozen ^ plan.frozen)]
        raise ValueError(
            f"{c.name}: this TrainState was made with other leaves frozen (differing: "
            f"{', '.join(paths[:5])}{' and more' if len(paths) > 5 else ''}): its moments keep "
            "the trainable leaves alone; save it and shard.load it into this step, which "
            "lays them out for its own trainable=")
    if (m.master_packing is None) != (plan.master_packing is None):
        kept = "keeps" if m.master_packing is None else "keeps no"
        raise ValueError(
            f"{c.name}: this TrainState {kept} masters for its frozen leaves, unlike this "
            "step (made with another precision, optimizer or offload): save it and "
            "shard.load it into this step")
    if m.device != plan.device.name:
        raise ValueError(f"{c.name}: this TrainState lives on {m.device} but the step was "
                         f"set up for {plan.device.name} params; load it onto this device "
                         "with shard.load(..., device=), or init a new state")


def layout_difference(have: Layout, want: Layout, limit: int = 5) -> str:
    """What differs between two layouts, by leaf and unit name: the state's
    (``have``) against the step's (``want``)."""
    mine = {leaf.path: leaf for leaf in have.leaves}
    theirs = {leaf.path: leaf for leaf in want.leaves}
    parts = []

    def named(kind: str, paths: list[str]) -> None:
        if paths:
            more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
            parts.append(f"{kind}: {', '.join(paths[:limit])}{more}")

    named("leaves only the state has", [p for p in mine if p not in theirs])
    named("leaves only the step has", [p for p in theirs if p not in mine])
    named("leaves of another shape or dtype", [
        f"{p} {mine[p].shape} {mine[p].dtype} vs {theirs[p].shape} {theirs[p].dtype}"
        for p in mine if p in theirs and (mine[p].shape, mine[p].dtype) !=
        (theirs[p].shape, theirs[p].dtype)])
    if not parts:
        units = [u.name for u in have.units], [u.name for u in want.units]
        if units[0] != units[1]:
            parts.append(f"units {units[0]} vs {units[1]}")
        elif have.world_size != want.world_size:
            parts.append(f"laid out for {have.world_size} ranks, not {want.world_size}")
        else:
            parts.append("the same leaves, laid out otherwise (another specs= or units=)")
    return "; ".join(parts)


def eval_loss(c: StepConfig, loss_fn: object) -> JaxLoss:
    """``ZeroStep.evaluate``'s ``loss_fn``: a JAX function of the step's params,
    for a step on a JAX loss."""
    from shard.core.losses._jax import JaxLoss, classify

    if c.kind != "jax":
        raise TypeError(f"{c.name}.evaluate: loss_fn= is for a step on a JAX loss function; "
                        "this step's loss is a "
                        f"{'shard.Layered' if c.kind == 'layered' else 'loss object'} (a torch "
                        "module already evaluates in eval mode)")
    if not callable(loss_fn) or classify(loss_fn) != "jax":
        raise TypeError(f"{c.name}.evaluate: loss_fn must be a JAX function (params, batch) -> "
                        f"loss; got {type(loss_fn).__name__}")
    return JaxLoss.shared(loss_fn, c.has_aux)


def refuse_keys(params: object, fn: str) -> None:
    """A TypeError naming the first leaf that is a typed JAX PRNG key: a key is
    state of the model, not a parameter the optimizer can train."""
    tu = ops._types.tree_util()
    for path, x in tu.tree_leaves_with_path(params):
        dtype = str(getattr(x, "dtype", ""))
        if dtype.startswith("key<"):
            raise TypeError(f"{fn}: params{tu.keystr(path)} is a JAX PRNG key ({dtype}), not a "
                            "trainable parameter; pass keys in the batch or close over them in "
                            "the loss (with flax nnx, split the parameters apart: graphdef, "
                            "params, rest = nnx.split(model, nnx.Param, ...))")


def model_state(c: StepConfig, tree: object) -> Any:
    """``init``'s ``model_state``: for a JAX loss; arrays (numpy, as every rank
    holds its own copy), no PRNG keys, the same on every rank (a checksum is
    compared: a collective)."""
    fn = f"{c.name}.init"
    if c.kind != "jax":
        raise TypeError(f"{fn}: model_state= is for a JAX loss function; a torch module's "
                        "buffers are its model state already")
    tu = ops._types.tree_util()
    for path, x in tu.tree_leaves_with_path(tree):
        if str(getattr(x, "dtype", "")).startswith("key<"):
            raise TypeError(f"{fn}: model_state{tu.keystr(path)} is a JAX PRNG key; keep keys "
                            "out of the model state (pass them in the batch)")
        if not hasattr(x, "shape") and not isinstance(x, (int, float, bool, np.generic)):
            raise TypeError(f"{fn}: model_state{tu.keystr(path)} is a {type(x).__name__}, not "
                            "an array")
    tree = tu.tree_map(host_copy, tree)  # explicit where a leaf is on a device
    leaves = tu.tree_leaves(tree)
    from ops import HOST

    for comm in (c.comm, c.replicate) if c.replicate is not None else (c.comm,):
        agree_on_values(comm, digest(HOST, leaves) if leaves else 1, fn,
                        "give every rank the same model_state (rank 0's)")
    return tree


def check_onebit(name: str, stage: int, options: ZeroOptions, topology: Topology,
                 optimizer: object, tensor_parallel: object) -> None:
    """Refuse, by name, what 1-bit Adam and 0/1 Adam (``ops.onebit_adam``,
    ``ops.zero_one_adam``; see [Note: 1-bit Adam] in ``ops/_onebit.py``) do
    not run with: their compressed phases sum no gradients over the ranks
    (each rank clips its own, as DeepSpeed's engine does there), so nothing
    that needs the summed gradient, or a shard of it, has one."""
    if not isinstance(optimizer, FusedOptimizer) or optimizer.onebit is None:
        return
    opt = "ops.zero_one_adam" if isinstance(optimizer.onebit, ZeroOne) else "ops.onebit_adam"
    o = options
    if stage not in (1, 2):
        raise NotImplementedError(f"{name}: {opt} runs under zero1 and zero2, whose ranks hold "
                                  "the whole params to fold each rank's gradient into; use "
                                  "shard.zero1 or shard.zero2")
    for what, bad in (("weight_by_rows=", o.weight_by_rows),
                      ("invariant_shards=", o.invariant_shards is not None),
                      ("quantized_gradients=", bool(o.quantized_gradients)),
                      ("offload=", o.offload is not None),
                      ("trainable= (frozen leaves)", o.trainable is not None),
                      ("a 'replicate' axis (HSDP)", topology.replicate is not None),
                      ("a 'model' axis (tensor parallelism)", tensor_parallel is not None),
                      ("a pipeline", topology.whole is not None)):
        if bad:
            raise NotImplementedError(f"{name}: {opt} does not compose with {what}; "
                                      "drop one of them")
