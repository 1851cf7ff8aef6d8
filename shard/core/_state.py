"""TrainState: one rank's training state as a pure pytree.

[Note: TrainState]
The leaves are the flat unit buffers of [Note: unit buffers]: fp32 master
shards, the optimizer's moments (same layout: Adam's two, or an optax
state's, see [Note: optax on shards]) and its other state leaves, the
compute-dtype copy the next
all-gather sends (stage 3 with mixed precision; otherwise the masters serve),
the full compute params of stages 0-2 (what plain data parallelism and ZeRO-1/2
keep whole on every rank), and scalars (step, loss scale, good steps). Static
metadata (:class:`StateMeta`: the layout, stage, policies, the frozen leaves'
packing, the optimizer state's structure) is aux data: shapes, specs and
layouts, never the loss, a torch module or a communicator, so a state pickles,
compares and prints by itself. The step holds what it runs with (its plan,
``shard/step/_plan.py``) and knows its own states by the plan's key
(``meta.origin``); a checkpoint that needs the step (a torch module's buffers,
HSDP's replicas, the model ranks) finds it by that key while the step lives.
``params`` and ``opt`` present the buffers as pytrees shaped like the model's
params (views).

A step reuses the buffers of the state it is given: that state is donated, and
using it again raises :class:`DonatedStateError`. A step that fails before its
update leaves the state valid (see [Note: failed steps] in
``shard/step/_step.py``).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

import ops
from ops import AdamState
from ops._types import Array, tree_util
from ops.device._device import device_named
from shard.core._layout import Layout
from shard.core._optim import ADAM_MOMENTS, OptimizerTree
from shard.core._policy import Precision

__all__ = ["DonatedStateError", "Packing", "StateMeta", "TrainState", "full_masters",
           "full_moments"]


_ADAM = OptimizerTree(AdamState)


class DonatedStateError(RuntimeError):
    """A TrainState was used after a step consumed (donated) its buffers."""


A = TypeVar("A", bound=Array)


@dataclass(frozen=True)
class Packing:
    """Where each trainable run of a unit's local buffer lives in the unit's
    packed buffer (see [Note: frozen leaves] in ``shard/step/_frozen.py``).

    Attributes:
      runs: per unit, its trainable runs: ``(start, stop)`` ranges of its
        local buffer, in order.
      starts: per unit, each run's start in the local buffer.
      packed: per unit, each run's start in the packed buffer.
      sizes: per unit, its packed buffer's size.
    """

    runs: tuple[tuple[tuple[int, int], ...], ...]
    starts: tuple[tuple[int, ...], ...] = field(init=False, compare=False, repr=False)
    packed: tuple[tuple[int, ...], ...] = field(init=False, compare=False, repr=False)
    sizes: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        starts, packed, sizes = [], [], []
        for unit_runs in self.runs:
            at, mine = 0, []
            for a, b in unit_runs:
                mine.append(at)
                at += b - a
            starts.append(tuple(a for a, _ in unit_runs))
            packed.append(tuple(mine))
            sizes.append(at)
        object.__setattr__(self, "starts", tuple(starts))
        object.__setattr__(self, "packed", tuple(packed))
        object.__setattr__(self, "sizes", tuple(sizes))

    def where(self, u: int, a: int, b: int) -> tuple[int, int]:
        """The packed range of unit ``u``'s local range [a, b) (inside one run)."""
        k = bisect.bisect_right(self.starts[u], a) - 1
        start = self.packed[u][k] + a - self.starts[u][k]
        return start, start + b - a

    def views(self, bufs: tuple[Array, ...] | list[Array],
              runs: tuple[tuple[tuple[int, int], ...], ...]) -> tuple[Array, ...]:
        """The packed buffers' views of ``runs`` (ranges inside trainable runs)."""
        out = []
        for u, (buf, unit_runs) in enumerate(zip(bufs, runs, strict=True)):
            for a, b in unit_runs:
                pa, pb = self.where(u, a, b)
                out.append(buf[pa:pb])
        return tuple(out)

    def expand(self, u: int, packed: Array, full: A) -> A:
        """``full`` (unit ``u``'s local size, zeros) with the packed runs in place."""
        for (a, b), p in zip(self.runs[u], self.packed[u], strict=True):
            full[a:b] = packed[p:p + b - a]
        return full

    def pack(self, u: int, full: Array, packed: A) -> A:
        """``packed`` filled from unit ``u``'s local-layout buffer ``full``."""
        for (a, b), p in zip(self.runs[u], self.packed[u], strict=True):
            packed[p:p + b - a] = full[a:b]
        return packed


@dataclass(frozen=True)
class StateMeta:
    """What a TrainState's buffers mean; static, hashable, picklable: shapes,
    specs and layouts, never the loss, a module or a communicator (the step
    holds what it runs with; see [Note: TrainState])."""

    layout: Layout
    stage: int
    rank: int
    precision: Precision
    master_dtype: str
    compute_dtype: str
    device: str = "numpy"  # where every buffer lives (see [Note: devices])
    offload: str | None = None  # "host" or "disk": masters and moments there (the rest
    #                             on ``device``; see [Note: offload])
    compute_on_host: bool = False  # Offload(params="host"): stage 3's compute shards too
    moment_names: tuple[str, ...] = ADAM_MOMENTS  # TrainState.moments' names
    opt_tree: OptimizerTree = _ADAM  # how ``opt`` is made of the buffers
    # Frozen leaves (see [Note: frozen leaves]): their indices; where the masters
    # and the moments keep the trainable runs alone, packed, where those runs
    # live; and, at stages 1-2 with packed masters, the whole params' layout
    # (the compute params') from which the frozen leaves' masters are cast.
    frozen: frozenset[int] = frozenset()
    master_packing: Packing | None = None
    moment_packing: Packing | None = None
    full_layout: Layout | None = None
    # What a checkpoint needs of the step that made the state: whether its loss
    # has a torch module whose buffers checkpoints keep beside the params (see
    # [Note: torch buffers]), HSDP's replicas and the tensor-parallel ranks.
    module_buffers: bool = False
    replicas: int = 1
    model_size: int = 1
    # The key of the step's plan this state was made with (``shard.step._plan``):
    # the step recognises its own states by it. Not part of the state's identity.
    origin: tuple[int, int] | None = field(default=None, compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class TrainState:
    """One rank's training state (see [Note: TrainState]).

    Attributes:
      master: per unit, this rank's master shard (fp32; the whole unit at stage 0);
        its trainable runs alone where frozen leaves keep no masters
        (``params`` gives them in the params' layout; see [Note: frozen leaves]).
      moments: per moment the optimizer keeps (``meta.moment_names`` names them:
        ``exp_avg`` and ``exp_avg_sq`` for Adam), its unit buffers, laid out
        like ``master``.
      opt_rest: an optax state's other leaves (counts, hyper-parameters), the
        same on every rank; empty for Adam.
      compute: per unit, the params as the loss sees them: whole at stages 0-2,
        this rank's shard at stage 3 (empty tuple where ``master`` serves).
      step: int64 scalar array, optimizer updates applied.
      loss_scale: float64 scalar array (1.0 without dynamic loss scaling).
      good_steps: int64 scalar array, finite steps since the scale last changed
        (since the last overflow, under ``LossScale(rule="deepspeed")``).
      hysteresis: int64 scalar array, the overflows left before the loss scale
        backs off (``LossScale.hysteresis``; 1 without one).
      skips: int64 array, one entry per leaf: the steps the leaf was left out
        of because no rank had a gradient for it (a torch parameter whose
        ``.grad`` stayed None), so its own update count is ``step - skips``,
        as torch's optimizers count each parameter's steps (see [Note:
        missing gradients]).
      meta: static metadata (aux data).
      model_state: the model's non-trainable state (batch-norm statistics: flax
        nnx ``BatchStat``, equinox ``State``, any pytree of arrays), the same
        on every rank; None without one (see [Note: model state]).
      batches: int64 scalar array, the global batches the step has taken (one
        per call, a skipped update's included): where a ``shard.DataLoader``
        resumes (``loader.resume(state)``), checkpointed with the rest.
    """

    master: tuple[np.ndarray, ...]
    moments: tuple[tuple[np.ndarray, ...], ...]
    opt_rest: tuple[np.ndarray, ...]
    compute: tuple[np.ndarray, ...]
    step: np.ndarray
    loss_scale: np.ndarray
    good_steps: np.ndarray
    hysteresis: np.ndarray
    skips: np.ndarray
    meta: StateMeta
    model_state: Any = None
    batches: np.ndarray = field(default_factory=lambda: np.zeros((), np.int64))
    _live: list = field(default_factory=lambda: [True], compare=False, repr=False)

    _FIELDS = ("master", "moments", "opt_rest", "compute", "step", "loss_scale", "good_steps",
               "hysteresis", "skips", "model_state", "batches")

    # -- views ----------------------------------------------------------------
    @property
    def params(self) -> Any:
        """This rank's master shards as a pytree shaped like the params (views;
        copies where frozen leaves keep no masters, their values cast from the
        compute params: see [Note: frozen leaves])."""
        self.check_live()
        layout = self.meta.layout
        return layout.treedef.unflatten(layout.local_views(full_masters(self)))

    @property
    def opt(self) -> Any:
        """The optimizer's state with its moments as pytrees shaped like the
        params (views; zeros for frozen leaves, see [Note: frozen leaves]): an
        ``AdamState`` (``LionState``...), or the optax transformation's state."""
        self.check_live()
        return self.meta.opt_tree.tree(self.meta.layout, self.step, full_moments(self),
                                       self.opt_rest)

    def moment(self, name: str) -> tuple[np.ndarray, ...]:
        """The unit buffers of the optimizer's moment ``name`` (see ``meta.moment_names``),
        as the step keeps them: a unit's trainable runs packed end to end where
        leaves are frozen (``state.opt`` gives them in the params' layout)."""
        try:
            return self.moments[self.meta.moment_names.index(name)]
        except ValueError:
            raise AttributeError(f"this state's optimizer keeps no {name!r}; its moments are "
                                 f"{list(self.meta.moment_names)}") from None

    @property
    def exp_avg(self) -> tuple[np.ndarray, ...]:
        """Adam's first moment's unit buffers."""
        return self.moment("exp_avg")

    @property
    def exp_avg_sq(self) -> tuple[np.ndarray, ...]:
        """Adam's second moment's unit buffers."""
        return self.moment("exp_avg_sq")

    def nbytes(self) -> dict[str, int]:
        """Bytes this rank holds, by kind."""
        def size(bufs: tuple) -> int:
            return int(sum(b.nbytes for b in bufs))

        return {"params": size(self.master),
                "optimizer": sum(size(m) for m in self.moments) + size(self.opt_rest),
                "compute_params": size(self.compute)}

    def tiers(self) -> dict[str, int]:
        """Bytes this rank holds by where they live: ``device`` (the compute
        params; everything without offload), ``host`` and ``disk`` (an
        offloaded state's masters and moments; see [Note: offload])."""
        n = self.nbytes()
        kept = n["params"] + n["optimizer"]
        where, compute = self.meta.offload, n["compute_params"]
        on_host = compute if self.meta.compute_on_host else 0
        return {"device": compute - on_host + (0 if where else kept),
                "host": on_host + (kept if where == "host" else 0),
                "disk": kept if where == "disk" else 0}

    def padding(self) -> list[int]:
        """Per unit, the elements of this rank's shard that are padding rows (a
        Shard(0) leaf whose rows do not divide by the world size)."""
        layout, rank = self.meta.layout, (self.meta.rank if self.meta.stage else 0)
        out = [0] * len(layout.units)
        for leaf in layout.leaves:
            if leaf.sharded:
                mine = max(0, min(leaf.rows_per_rank, leaf.rows - rank * leaf.rows_per_rank))
                out[leaf.unit] += (leaf.rows_per_rank - mine) * leaf.row_size
        return out

    def describe(self) -> str:
        """A table of what this rank holds: units, sizes (with padding) and bytes."""
        m = self.meta
        lines = [repr(self)]
        lines.append(f"  {'unit':<28}{'leaves':>7}{'elements':>10}{'sharded':>10}{'padding':>9}")
        for u, pad in zip(m.layout.units, self.padding(), strict=True):
            lines.append(f"  {u.name[:28]:<28}{len(u.leaves):>7}{_count(u.local_size):>10}"
                         f"{_count(u.sharded_size):>10}{_count(pad):>9}")
        total = 0
        for kind, n in self.nbytes().items():
            lines.append(f"  {kind:<20}{_bytes(n):>12}")
            total += n
        lines.append(f"  {'total':<20}{_bytes(total):>12}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        m = self.meta
        if not self._live[0]:
            return f"TrainState(donated; stage {m.stage}, rank {m.rank})"
        here = m.layout.local_size()
        return (f"TrainState(stage {m.stage}, rank {m.rank} of {m.layout.world_size}, step "
                f"{int(self.step)}, {len(m.layout.units)} units, {_count(here)} elements here, "
                f"{_bytes(sum(self.nbytes().values()))}, {m.master_dtype} masters, "
                f"{m.compute_dtype} compute, on {m.device}"
                + (f"; masters and moments on {m.offload})" if m.offload else ")"))

    # -- donation -----------------------------------------------------------
    def check_live(self) -> None:
        if not self._live[0]:
            raise DonatedStateError(
                "this TrainState was donated to a step, which reused its buffers; use the state "
                "that step returned (state, metrics = step(state, batch))")

    def donate(self) -> None:
        self.check_live()
        self._live[0] = False

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, _live=[True], **changes)


def full_masters(state: TrainState) -> tuple:
    """The state's master unit buffers in the params' layout: its own, or,
    where frozen leaves keep none, copies with their entries cast from the
    compute params (exact: the compute dtype is theirs; see [Note: frozen
    leaves])."""
    meta, master, compute = state.meta, state.master, state.compute
    packing = meta.master_packing
    if packing is None:
        return tuple(master)
    dtype = np.dtype(meta.master_dtype)
    if meta.stage in (0, 3):  # the compute params are laid out as the masters
        return tuple(packing.expand(u, m, ops.cast(x, dtype))
                     for u, (m, x) in enumerate(zip(master, compute, strict=True)))
    layout, whole_layout = meta.layout, meta.full_layout  # stages 1-2: whole compute params
    if whole_layout is None:
        raise ValueError("StateMeta: packed masters at stages 1-2 need full_layout")
    device = device_named(meta.device)
    out = [packing.expand(u, m, device.empty(unit.local_size, m.dtype))
           for u, (unit, m) in enumerate(zip(layout.units, master, strict=True))]
    wide: dict[int, Array] = {}
    for i in sorted(meta.frozen):
        leaf, whole = layout.leaves[i], whole_layout.leaves[i]
        if leaf.unit not in wide:
            wide[leaf.unit] = ops.cast(compute[leaf.unit], dtype)
        layout.scatter_leaf(
            leaf, wide[leaf.unit][whole.offset:whole.offset + whole.size], meta.rank,
            out[leaf.unit][leaf.offset:leaf.offset + leaf.local_size].reshape(leaf.local_shape))
    return tuple(out)


def full_moments(state: TrainState) -> tuple:
    """The state's moment unit buffers in the masters' layout: its own, or,
    where frozen leaves keep none, copies with their entries zero (see [Note:
    frozen leaves])."""
    packing = state.meta.moment_packing
    if packing is None:
        return tuple(state.moments)
    device = device_named(state.meta.device)
    return tuple(tuple(packing.expand(u, buf, device.zeros(unit.local_size, buf.dtype))
                       for u, (unit, buf) in enumerate(zip(state.meta.layout.units, bufs,
                                                           strict=True)))
                 for bufs in state.moments)


def _count(n: int) -> str:
    """1234567 -> '1.23M'."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for div, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _flatten(s: TrainState) -> tuple[tuple, StateMeta]:
    return tuple(getattr(s, f) for f in TrainState._FIELDS), s.meta


def _flatten_with_keys(s: TrainState) -> tuple[tuple, StateMeta]:
    tu = tree_util()
    return tuple((tu.GetAttrKey(f), getattr(s, f)) for f in TrainState._FIELDS), s.meta


def _unflatten(meta: StateMeta, children: tuple) -> TrainState:
    return TrainState(**dict(zip(TrainState._FIELDS, children, strict=True)), meta=meta)


tree_util().register_pytree_with_keys(TrainState, _flatten_with_keys, _unflatten, _flatten)
