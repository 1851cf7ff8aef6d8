"""The step's optimizer on this rank's shards: ``ops.adamw``, ``ops.adam``,
``ops.lion`` or ``ops.lamb`` (fused kernels) or any optax ``GradientTransformation``.

[Note: optax on shards]
An optax transformation sees pytrees shaped like the params, and ZeRO gives a
rank only some rows of each sharded leaf. The step hands it exactly that: the
rank's local views of the masters and of the reduced gradients (each sharded
leaf ``(rows_per_rank, *rest)``, the replicated ones whole), so masks and
per-leaf choices see the params' structure, and its state is
``tx.init(local views)``. That state splits into *moments*, subtrees shaped
like the params (Adam's ``mu`` and ``nu``, a momentum trace), which live in
flat unit buffers laid out like the masters and are checkpointed, resharded
and counted like Adam's moments, and *the rest* (counts, injected
hyper-parameters), small leaves every rank keeps alike.

That is the single-process update where each part of the transformation
(nested ``optax.chain`` s flattened, ``_parts.py``) acts element by element,
or reduces over whole leaves in a way the step computes on shards. Three
per-leaf reductions are computed over the ranks (LAMB's
``scale_by_trust_ratio``, Adafactor's ``clip_by_block_rms`` and
``scale_by_param_block_rms``: per-leaf sums of squares of this rank's rows,
one all-reduce each, between jitted runs of the other parts); a whole-tree
``clip_by_global_norm`` at the head of a chain is the step's own (its one
all-reduce already has the global norm, replicated leaves counted once, so it
clips the gradients first and the chain's clip then sees a norm within its
bound on every rank). Every other part is refused if it holds a reduction
known by name (Adafactor's factored statistics on a split leaf, a
``clip_by_global_norm`` later in the chain, whose bound a small probe may
never reach, a trust ratio hidden inside ``masked``...), and is otherwise
tried before any state exists (``_parts.py``): a probe tree with the params'
structure and each leaf's rank, a few rows per split leaf, is updated over
five steps as a whole and as two ranks' row blocks, with gradients from 1e-6
to 1e12 (never NaN: the step skips non-finite gradients before any
transformation sees them); an update or a rest leaf that differs refuses the
optimizer, naming the part. At stage 0, or on one rank, every leaf is whole
and any transformation runs as it is.

The update runs under ``jax.jit`` on the host's masters; on device (GPU)
state the fused kernels (``ops.adamw``, ``ops.lion``, ``ops.lamb``) run, and offload keeps
Adam's.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ops import FusedOptimizer
from ops._adam import grad_multiplier
from ops._types import Array, tree_util
from shard.core._layout import Layout
from shard.core._parts import (
    PER_LEAF,
    Part,
    PerTransformation,
    Segments,
    check_parts,
    clip_first,
    describe,
    parts_of,
)

if TYPE_CHECKING:
    import jax
    import optax
    from numpy.typing import DTypeLike

    from ops import AdamState, LionState
    from ops._types import Array

__all__ = ["ADAM_MOMENTS", "OptimizerTree", "ShardOptimizer", "is_transformation", "moment_names",
           "on_shards"]

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
_REST_DTYPES = ("float32", "float64", "int32", "int64", "uint32", "bool")


def is_transformation(x: object) -> bool:
    """An optax ``GradientTransformation`` (or anything shaped like one), not
    one of the fused optimizers."""
    return (not isinstance(x, FusedOptimizer) and callable(getattr(x, "init", None))
            and callable(getattr(x, "update", None)))


@dataclass(frozen=True)
class OptimizerTree:
    """How an optimizer's state, as a pytree, is made of a state's buffers:
    static, so a state's metadata carries it (``state.opt`` needs no step).

    Attributes:
      state: a fused optimizer's state type (``AdamState``, ``LionState``),
        built from the step count and the moments; None for optax.
      treedef: an optax state's top level, whose leaves are its moments (as
        pytrees shaped like the params) and its other leaves.
      is_moment: per top-level leaf, whether it is a moment.
    """

    state: Callable[..., AdamState | LionState] | None = None
    # Any: a PyTreeDef where state is None (optax), None beside a fused state
    treedef: Any = None
    is_moment: tuple[bool, ...] = ()

    def tree(self, layout: Layout, step: np.ndarray | None,
             moments: tuple[tuple[np.ndarray, ...], ...], rest: tuple[np.ndarray, ...]) -> Any:
        """The optimizer's state as pytrees of views: ``AdamState`` or optax's."""
        views = [layout.treedef.unflatten(layout.local_views(m)) for m in moments]
        if self.state is not None:
            return self.state(step, *views)
        it, rest_it = iter(views), iter(rest)
        return self.treedef.unflatten([next(it) if m else next(rest_it)
                                       for m in self.is_moment])


@dataclass(frozen=True, eq=False)
class ShardOptimizer:
    """How the step's optimizer keeps and updates its state on one layout.

    Attributes:
      moments: the names of the per-element moments (unit buffers laid out
        like the masters): ``exp_avg``/``exp_avg_sq`` for the fused Adam,
        ``exp_avg`` for Lion, the optax state's paths (``0.mu``) otherwise.
      fused: the fused optimizer (``ops.adamw``, ``ops.lion``...), or None for
        an optax transformation.
      tx: the optax transformation.
      clip_first: the max norm of a ``clip_by_global_norm`` heading ``tx``.
      rest: the shape and dtype of each of the optax state's other leaves.
    """

    moments: tuple[str, ...]
    fused: FusedOptimizer | None = None
    # Any: the optax transformation, None beside a fused optimizer
    tx: Any = None
    clip_first: float | None = None
    rest: tuple[tuple[tuple[int, ...], str], ...] = ()  # the other leaves' shapes, dtypes
    _treedef: Any = None  # the optax state's top level: moments and rest leaves
    _is_moment: tuple[bool, ...] = ()
    _parts: tuple[Part, ...] = ()  # the transformation's parts, where some reduce over whole leaves
    _jitted: list = field(default_factory=list)
    _segments: dict[int, Segments] = field(default_factory=dict)

    @property
    def reduces_leaves(self) -> bool:
        """Whether an update sums over whole leaves across the ranks (LAMB's
        trust ratio, Adafactor's block RMS)."""
        return bool(self._parts) or (self.fused is not None and self.fused.per_tensor)

    # -- state ------------------------------------------------------------------
    def init(self, layout: Layout, master: Sequence[Array]
             ) -> tuple[list[list[np.ndarray]], tuple[np.ndarray, ...]]:
        """An optax transformation's fresh moment buffers (one list of unit
        buffers per moment, host arrays) and rest leaves for ``master``'s
        params (host arrays: optax runs on host state)."""
        tu = tree_util()
        state = self.tx.init(layout.treedef.unflatten(layout.local_views(master)))
        tops = self._treedef.flatten_up_to(state)
        moments, rest = [], []
        for top, moment in zip(tops, self._is_moment, strict=True):
            if not moment:
                rest.append(np.array(top))
                continue
            bufs = [np.zeros(b.shape, b.dtype) for b in master]
            for dst, x in zip(layout.local_views(bufs), tu.tree_leaves(top), strict=True):
                dst[...] = np.asarray(x)
            moments.append(bufs)
        return moments, tuple(rest)

    @functools.cached_property
    def opt_tree(self) -> OptimizerTree:
        """How this optimizer's state is made of a state's buffers (made once:
        the optax path reads it every step)."""
        return OptimizerTree(self.fused.state if self.fused is not None else None,
                             self._treedef, self._is_moment)

    def tree(self, layout: Layout, step: np.ndarray | None,
             moments: tuple[tuple[np.ndarray, ...], ...], rest: tuple[np.ndarray, ...]) -> Any:
        """The optimizer's state as pytrees of views: ``AdamState`` or optax's."""
        return self.opt_tree.tree(layout, step, moments, rest)

    # -- update -------------------------------------------------------------------
    def apply_optax(self, layout: Layout, master: tuple[np.ndarray, ...],
                    moments: tuple[tuple[np.ndarray, ...], ...], rest: tuple[np.ndarray, ...],
                    grads: list[Any], grad_scale: float, grad_sumsq: Array,
                    max_norm: float | None, rank: int = 0,
                    reduce: Callable[[np.ndarray], np.ndarray] | None = None
                    ) -> tuple[np.ndarray, ...] | None:
        """One optax update of host buffers, in place; returns the new rest
        leaves, or None where the gradients are not finite (nothing changed).
        ``reduce`` sums a vector over the data ranks, for the parts that reduce
        over whole leaves (``rank`` is this rank's index among them)."""
        factor = grad_multiplier(grad_sumsq, grad_scale, max_norm or 0.0)  # the kernels' clip
        if factor is None:
            return None
        norm = math.sqrt(float(grad_sumsq[0])) * factor
        if self.clip_first is not None and norm >= self.clip_first:  # optax's clip
            factor *= self.clip_first / norm
        tu, td = tree_util(), layout.treedef
        state = self.tree(layout, None, moments, rest)
        views = layout.local_views(list(master))
        if self._parts:  # per-leaf reductions over the ranks between jitted runs
            if reduce is None:
                raise ValueError("this optimizer's transformation reduces over whole leaves: "
                                 "apply needs reduce=, the sum over the data ranks")
            with _lock:
                segments = self._segments.get(rank)
                if segments is None:
                    segments = self._segments[rank] = _segments_for(self._parts, layout, rank)
            grads_tree = td.unflatten([np.asarray(g, np.float32) * np.float32(factor)
                                       for g in layout.local_views(list(grads))])
            updates, new_state = segments(grads_tree, state, td.unflatten(views), reduce)
            for dst, u in zip(views, updates, strict=True):
                dst += u.astype(dst.dtype)
        else:
            with _lock:  # thread ranks share this object and its compiled update
                if not self._jitted:
                    self._jitted.append(_jit_update(self.tx))
            new_params, new_state = self._jitted[0](
                td.unflatten(layout.local_views(list(grads))), state, td.unflatten(views),
                np.float32(factor))
            for dst, x in zip(views, tu.tree_leaves(new_params), strict=True):
                dst[...] = np.asarray(x)
        new_rest = []
        it = iter(moments)
        for top, moment in zip(self._treedef.flatten_up_to(new_state), self._is_moment,
                               strict=True):
            if moment:
                for dst, x in zip(layout.local_views(list(next(it))), tu.tree_leaves(top),
                                  strict=True):
                    dst[...] = np.asarray(x)
            else:
                new_rest.append(np.array(top))
        return tuple(new_rest)


_SHARDED: PerTransformation[ShardOptimizer] = PerTransformation()  # ranks share one probe
_lock = threading.Lock()  # what thread ranks build lazily in a ShardOptimizer they share


def on_shards(optimizer: FusedOptimizer | optax.GradientTransformation, layout: Layout, *,
              stage: int, master_dtype: DTypeLike,
              device_host: bool, offload: bool, fn: str) -> ShardOptimizer:
    """The :class:`ShardOptimizer` for ``optimizer`` on ``layout``, or a
    TypeError / ValueError naming what cannot run on these shards (before
    any state exists; see [Note: optax on shards])."""
    if isinstance(optimizer, FusedOptimizer):
        if offload and optimizer.per_tensor:
            raise TypeError(f"{fn}: offload= updates its tiers unit by unit with Adam's "
                            "element-wise kernel; this fused optimizer (ops.lamb) scales each "
                            "whole leaf by its trust ratio: drop offload=, or use "
                            "ops.adamw(...)")
        if offload and optimizer.moments != ADAM_MOMENTS:
            raise TypeError(f"{fn}: offload= keeps Adam's moments in its tiers; this fused "
                            f"optimizer keeps {list(optimizer.moments)}: drop offload=, or "
                            "use ops.adamw(...)")
        return ShardOptimizer(optimizer.moments, fused=optimizer)
    what = describe(optimizer)
    if not device_host:
        raise TypeError(f"{fn}: optimizer= {what} runs on host (numpy) state; this state lives "
                        "on a device: use the fused ops.adamw(...) or ops.adam(...)")
    if offload:
        raise TypeError(f"{fn}: offload= keeps Adam's moments in its tiers; with optimizer= "
                        f"{what} drop offload=, or use ops.adamw(...)")
    if np.dtype(master_dtype) != np.float32:
        raise TypeError(f"{fn}: optimizer= {what} runs in float32; these params keep "
                        f"{master_dtype} masters (use ops.adamw(...) for them)")
    sharded = stage > 0 and any(leaf.sharded and leaf.rows_per_rank < leaf.rows
                                for leaf in layout.leaves)
    return _SHARDED.get(optimizer, layout, (sharded,),
                        lambda: _make(optimizer, layout, sharded, what, fn))


def moment_names(optimizer: object, layout: Layout) -> tuple[str, ...]:
    """The moments ``optimizer`` keeps for ``layout``'s params (no probe)."""
    if isinstance(optimizer, FusedOptimizer):
        return optimizer.moments
    if not is_transformation(optimizer):
        raise TypeError("optimizer must be an ops.adamw(...) or ops.adam(...), or an optax "
                        f"GradientTransformation; got {type(optimizer).__name__}")
    return _make(optimizer, layout, False, describe(optimizer), "estimate_memory").moments


def _make(tx: optax.GradientTransformation, layout: Layout, sharded: bool, what: str,
          fn: str) -> ShardOptimizer:
    import jax

    first, parts = clip_first(tx), parts_of(tx)
    if sharded:
        check_parts(tx, parts, layout, what, fn)
    tu = tree_util()
    td = layout.treedef
    shapes = td.unflatten([jax.ShapeDtypeStruct(leaf.local_shape, np.float32)
                           for leaf in layout.leaves])
    try:
        abstract = jax.eval_shape(tx.init, shapes)
    except Exception as e:  # any failure of the user's init is reported
        raise TypeError(f"{fn}: optimizer= {what}: its init(params) failed: "
                        f"{type(e).__name__}: {e}") from None
    local = [leaf.local_shape for leaf in layout.leaves]

    def params_like(x: object) -> bool:
        if tu.tree_structure(x) != td:
            return False
        leaves = tu.tree_leaves(x)
        return len(leaves) == len(local) and all(
            tuple(a.shape) == s and jax.numpy.issubdtype(a.dtype, jax.numpy.floating)
            for a, s in zip(leaves, local, strict=True))

    tops, treedef = tu.tree_flatten(abstract, is_leaf=params_like)
    paths = [p for p, _ in tu.tree_flatten_with_path(abstract, is_leaf=params_like)[0]]
    is_moment = tuple(params_like(t) for t in tops)
    names = tuple(_name(p) for p, m in zip(paths, is_moment, strict=True) if m)
    for top, m, p in zip(tops, is_moment, paths, strict=True):
        if m and any(np.dtype(a.dtype) != np.float32 for a in tu.tree_leaves(top)):
            raise TypeError(f"{fn}: optimizer= {what} keeps its state {_name(p)} in "
                            f"{tu.tree_leaves(top)[0].dtype}; ZeRO keeps moments in float32 "
                            "(drop the optimizer's state dtype option, such as mu_dtype=)")
    for t, m, p in zip(tops, is_moment, paths, strict=True):
        if not m and str(getattr(t, "dtype", None)) not in _REST_DTYPES:
            raise TypeError(f"{fn}: optimizer= {what} keeps {_name(p)} as "
                            f"{getattr(t, 'dtype', type(t).__name__)}; ZeRO keeps an optax "
                            f"state's leaves of {sorted(_REST_DTYPES)}")
    rest = tuple((tuple(t.shape), str(t.dtype))
                 for t, m in zip(tops, is_moment, strict=True) if not m)
    per_leaf = sharded and any(p.name in PER_LEAF for p in parts)
    return ShardOptimizer(names, tx=tx, clip_first=first, rest=rest, _treedef=treedef,
                          _is_moment=is_moment, _parts=tuple(parts) if per_leaf else ())

def _name(path: tuple) -> str:
    parts = [str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path]
    return ".".join(parts) or "state"


def _jit_update(tx: optax.GradientTransformation) -> Callable[..., tuple]:
    import jax

    def update(g: object, state: object, p: object, factor: jax.Array) -> tuple:
        tu = tree_util()
        g = tu.tree_map(lambda x: x.astype(np.float32) * factor, g)
        updates, state = tx.update(g, state, p)
        return tu.tree_map(lambda a, u: a + u.astype(a.dtype), p, updates), state

    return jax.jit(update)


def _segments_for(parts: tuple[Part, ...], layout: Layout, rank: int) -> Segments:
    """The :class:`Segments` of rank ``rank``: which leading rows of each local
    view are its own, which leaves are split."""
    valid = [max(0, min(leaf.rows_per_rank, leaf.rows - rank * leaf.rows_per_rank))
             if leaf.sharded else leaf.rows for leaf in layout.leaves]
    return Segments(list(parts), layout.treedef, valid,
                    [leaf.sharded for leaf in layout.leaves],
                    [leaf.size for leaf in layout.leaves])
