"""An optax transformation as its parts, the parts that reduce over whole
leaves computed on shards, and whether the others can run on ZeRO's shards:
the element-wise probe and the names read from a transformation's closures
(see [Note: optax on shards] in ``_optim.py``).

Nested ``optax.chain`` s flatten into the transformations they apply in turn,
each with the place of its state in the chains' state tuples. LAMB's
``scale_by_trust_ratio`` and Adafactor's ``clip_by_block_rms`` and
``scale_by_param_block_rms`` scale each leaf by a norm or RMS of the whole
leaf: :class:`Segments` computes those from per-leaf sums of squares over
every rank's rows (padding rows left out, replicated leaves counted once; one
all-reduce each), with optax's formulas, and runs the element-wise parts
between them as one ``jax.jit`` each.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, SupportsFloat, TypeVar

import numpy as np

from ops._types import tree_util

if TYPE_CHECKING:
    import optax
    from jax.tree_util import PyTreeDef

    from shard.core._layout import Layout

__all__ = ["PER_LEAF", "Part", "PerTransformation", "Segments", "check_parts", "clip_first",
           "describe", "free_var", "parts_of", "probe"]

# per-leaf reductions computed here: their optax hyper-parameters, by closure name
PER_LEAF = {"scale_by_trust_ratio": ("min_norm", "trust_coefficient", "eps"),
            "clip_by_block_rms": ("threshold",),
            "scale_by_param_block_rms": ("min_scale",)}


@dataclass(frozen=True)
class Part:
    """One transformation of a chain: its name (``scale_by_adam``), functions,
    and the indices of its state in the nested chains' state tuples."""

    name: str
    init: Callable
    update: Callable
    path: tuple[int, ...]


def free_var(f: Any, var: str) -> Any:
    """The value of the free variable ``var`` of function ``f`` (or None)."""
    code = getattr(f, "__code__", None)
    if code is None or var not in code.co_freevars:
        return None
    return f.__closure__[code.co_freevars.index(var)].cell_contents


def outer_name(f: object) -> str:
    """``chain`` for ``chain.<locals>.update_fn``; '' for a module-level function."""
    qual = getattr(f, "__qualname__", "")
    return qual.split(".<locals>.")[0] if ".<locals>." in qual else ""


def parts_of(tx: optax.GradientTransformation) -> list[Part]:
    """``tx``'s transformations in the order they apply, nested chains flattened."""
    return _flatten(tx.init, tx.update, ())


def _flatten(init: Callable[..., object], update: Callable[..., object],
             path: tuple[int, ...]) -> list[Part]:
    while outer_name(update) == "with_extra_args_support":  # optax's wrapper: the inner one
        inner = free_var(update, "tx")
        if inner is None:
            break
        update = inner.update
    inits, updates = free_var(init, "init_fns"), free_var(update, "update_fns")
    if outer_name(update) == "chain" and inits is not None and updates is not None:
        out = []
        for i, (a, b) in enumerate(zip(inits, updates, strict=True)):
            out += _flatten(a, b, (*path, i))
        return out
    return [Part(outer_name(update), init, update, path)]


def _get(state: Any, path: tuple[int, ...]) -> object:
    for i in path:
        state = state[i]
    return state


def _put(state: Any, path: tuple[int, ...], value: object) -> object:
    if not path:
        return value
    items = list(state)
    items[path[0]] = _put(items[path[0]], path[1:], value)
    return tuple(items)


class Segments:
    """``tx``'s update on one rank's shards: element-wise runs jitted, per-leaf
    reductions over the ranks in between.

    ``reduce(x)`` sums a float64 vector over the data ranks (an all-reduce);
    ``valid[i]`` is how many leading rows of leaf ``i``'s local view are this
    rank's (the rest padding) and ``sharded[i]`` whether the leaf is split.
    """

    def __init__(self, parts: list[Part], treedef: PyTreeDef, valid: list[int],
                 sharded: list[bool], sizes: list[int]) -> None:
        import jax

        self.parts, self.treedef = parts, treedef
        self.valid, self.sharded, self.sizes = valid, sharded, sizes
        # (part indices, jitted fn) or a per-leaf part index
        self.runs: list[tuple[list[int], Callable[..., Any]] | int] = []
        run: list[int] = []
        for i, part in enumerate([*parts, None]):
            if part is None or part.name in PER_LEAF:
                if run:
                    self.runs.append((run, jax.jit(_run_fn([parts[j] for j in run]))))
                    run = []
                if part is not None:
                    self.runs.append(i)
            else:
                run.append(i)
        self.hyper = {i: {v: free_var(p.update, v) for v in PER_LEAF[p.name]}
                      for i, p in enumerate(parts) if p.name in PER_LEAF}

    def __call__(self, grads: object, state: object, params: object,
                 reduce: Callable[[np.ndarray], np.ndarray]) -> tuple[list[np.ndarray], object]:
        tu = tree_util()
        states = [_get(state, p.path) for p in self.parts]
        u = grads
        for run in self.runs:
            if isinstance(run, int):
                u = self._per_leaf(run, u, params, reduce)
                continue
            idx, fn = run
            u, new = fn(u, [states[i] for i in idx], params)
            for i, s in zip(idx, new, strict=True):
                states[i] = s
        for p, s in zip(self.parts, states, strict=True):
            state = _put(state, p.path, s)
        return [np.asarray(x) for x in tu.tree_leaves(u)], state

    def _sums(self, leaves: list[np.ndarray], reduce: Callable) -> np.ndarray:
        """Each whole leaf's sum of squares: this rank's rows, summed over the
        ranks for split leaves (one all-reduce), as they are for replicated ones."""
        k = len(leaves) // len(self.valid)  # trust ratio: updates, then params
        valid, sharded = self.valid * k, np.array(self.sharded * k)
        local = np.array([float(np.sum(np.square(x.reshape((*x.shape[:1], -1))[:n]
                                                 if x.ndim else x, dtype=np.float64)))
                          for x, n in zip(leaves, valid, strict=True)])
        return reduce(np.where(sharded, local, 0.0)) + np.where(sharded, 0.0, local)

    def _per_leaf(self, i: int, u: object, params: object, reduce: Callable) -> object:
        tu = tree_util()
        name, h = self.parts[i].name, self.hyper[i]
        us = [np.array(x, np.float32) for x in tu.tree_leaves(u)]
        ps = tu.tree_leaves(params)
        if name == "scale_by_trust_ratio":
            sums = self._sums(us + [np.asarray(p) for p in ps], reduce)  # one all-reduce
            for j, x in enumerate(us):
                pn = _safe(math.sqrt(sums[len(us) + j]), h["min_norm"])
                un = _safe(math.sqrt(sums[j]), h["min_norm"])
                ratio = 1.0 if pn == 0.0 or un == 0.0 else \
                    h["trust_coefficient"] * pn / (un + h["eps"])
                x *= np.float32(ratio)
        elif name == "clip_by_block_rms":
            sums = self._sums(us, reduce)
            for x, s, n in zip(us, sums, self.sizes, strict=True):
                x /= np.float32(max(1.0, math.sqrt(s / max(n, 1)) / h["threshold"]))
        else:  # scale_by_param_block_rms
            sums = self._sums([np.asarray(p) for p in ps], reduce)
            for x, s, n in zip(us, sums, self.sizes, strict=True):
                x *= np.float32(_safe(math.sqrt(s / max(n, 1)), h["min_scale"]))
        return self.treedef.unflatten(us)


def _safe(norm: float, floor: SupportsFloat) -> float:
    """optax's ``safe_norm`` / ``safe_root_mean_squares``: ``floor`` where the
    value is at most it."""
    floor = float(floor)
    return floor if norm <= floor else norm


def _run_fn(parts: list[Part]) -> Callable:
    def run(u: object, states: list, params: object) -> tuple[object, list]:
        new = []
        for part, s in zip(parts, states, strict=True):
            u, s = part.update(u, s, params)
            new.append(s)
        return u, new

    return run


# optax transformations whose update reduces over a whole leaf or tree
_REDUCERS = {
    "clip_by_global_norm": "the whole tree's norm (first in a chain, the step provides it)",
    "scale_by_trust_ratio": "each whole leaf's norm (LAMB, LARS)",
    "scale_by_factored_rms": "each whole leaf's row and column means (Adafactor)",
    "clip_by_block_rms": "each whole leaf's RMS",
    "scale_by_param_block_rms": "each whole leaf's RMS",
    "scale_by_param_block_norm": "each whole leaf's norm",
    "adaptive_grad_clip": "each whole leaf's norm",
    "normalize_by_update_norm": "the whole tree's norm",
    "add_noise": "noise drawn for each whole leaf",
    "scale_by_polyak": "the whole tree's norm",
    "scale_by_lbfgs": "inner products over the whole tree",
    "centralize": "each whole leaf's mean",
}
_PROBE_SCALES = (1.0, 1e12, 1e-6, 1.0, 3.0)


def describe(tx: optax.GradientTransformation) -> str:
    """``optax.chain(clip_by_global_norm, scale_by_adam, ...)``: the transformations a
    GradientTransformation is built of, found in its functions' closures."""
    names = _parts(tx.update)
    return f"optax transformation ({', '.join(names)})" if names else type(tx).__name__


_T = TypeVar("_T")


class PerTransformation(Generic[_T]):
    """Answers about an optax transformation on a layout, kept by the
    transformation's update function, the layout's geometry and ``extra``, so
    that thread ranks passing one transformation for equal layouts share one
    answer: the first computes it, the others wait for it. The transformation
    is kept beside its answer (an update's id is not reused while it lives);
    at most 64 answers are kept (all are dropped when a 65th comes)."""

    def __init__(self) -> None:
        self._kept: dict[tuple, tuple[object, _T]] = {}
        self._lock = threading.Lock()

    def get(self, tx: optax.GradientTransformation, layout: Layout, extra: tuple,
            make: Callable[[], _T]) -> _T:
        key = (id(tx.update), layout.treedef, extra,
               tuple((leaf.shape, leaf.local_shape, leaf.sharded) for leaf in layout.leaves))
        with self._lock:
            hit = self._kept.get(key)
            if hit is None or hit[0] is not tx:
                if len(self._kept) >= 64:
                    self._kept.clear()
                hit = self._kept[key] = (tx, make())
        return hit[1]


_CHECKED: PerTransformation[Exception | None] = PerTransformation()  # (the refusal)


def check_parts(tx: optax.GradientTransformation, parts: list[Part], layout: Layout, what: str,
                fn: str) -> None:
    """Refuse ``tx`` unless each of its parts is a per-leaf reduction computed on
    shards (``PER_LEAF``), a ``clip_by_global_norm`` first in it, or acts
    element by element: by the names of the reductions it holds, then by the
    probe (see [Note: optax on shards]). Thread ranks passing one ``tx`` for
    equal layouts share one check (:class:`PerTransformation`)."""

    def refusal() -> Exception | None:
        try:
            _check_parts(tx, parts, layout, what, fn)
        except (TypeError, ValueError) as e:
            return e
        return None

    refused = _CHECKED.get(tx, layout, (what, fn), refusal)
    if refused is not None:
        raise type(refused)(*refused.args)


def _check_parts(tx: optax.GradientTransformation, parts: list[Part], layout: Layout,
                 what: str, fn: str) -> None:
    for k, part in enumerate(parts):
        if part.name in PER_LEAF or (k == 0 and clip_first(tx) is not None):
            continue
        found = [n for n in _parts(part.update) if n in _REDUCERS]
        if found == ["scale_by_factored_rms"] and not _factors_a_split_leaf(part, layout):
            found = []  # no split leaf is big enough to factor: Adafactor is element-wise
        if found:
            _refuse(tx, layout, None, what, fn, found)
        probe(_Tx(part.init, part.update), layout, what, fn, tx)


class _Tx(NamedTuple):
    init: Callable[..., object]  # params -> state (an optax state: any pytree)
    update: Callable[..., tuple[object, object]]  # (grads, state, params) -> (updates, state)


def _factors_a_split_leaf(part: Part, layout: Layout) -> bool:
    """Whether Adafactor's ``scale_by_factored_rms`` keeps row and column
    statistics (optax's ``_factored_dims``) for a leaf ZeRO splits."""
    update = next((f for f in _functions(part.update)
                   if f.__qualname__.startswith("scale_by_factored_rms.<locals>.")), None)
    factored = free_var(update, "factored") if update is not None else None
    least = free_var(update, "min_dim_size_to_factor") if update is not None else None
    if factored is None or least is None:
        return True  # cannot tell: assume it does
    return bool(factored) and any(
        leaf.sharded and len(leaf.shape) >= 2 and sorted(leaf.shape)[-2] >= least
        for leaf in layout.leaves)


# -- the element-wise probe ------------------------------------------------------
def probe(tx: _Tx, layout: Layout, what: str, fn: str,
          whole: optax.GradientTransformation | None = None) -> None:
    """Refuse ``tx`` (a part of ``whole``) unless its update on two ranks' row
    blocks equals its update on the whole leaves (see [Note: optax on shards])."""
    tu = tree_util()
    td, rng = layout.treedef, np.random.default_rng(0)
    shapes = [(7, *(min(d, 3) for d in leaf.shape[1:])) if leaf.sharded else
              tuple(min(d, 3) for d in leaf.shape) for leaf in layout.leaves]
    params = [np.asarray(rng.standard_normal(s), np.float32) for s in shapes]
    grads = [[np.asarray(scale * rng.standard_normal(s), np.float32) for s in shapes]
             for scale in _PROBE_SCALES]

    def part(xs: list[np.ndarray], r: int) -> list[np.ndarray]:
        return [x[(0, 3, 7)[r]:(0, 3, 7)[r + 1]] if leaf.sharded else x
                for x, leaf in zip(xs, layout.leaves, strict=True)]

    def run(r: int | None) -> list[tuple]:
        p = params if r is None else part(params, r)
        out = []
        try:
            state = tx.init(td.unflatten(p))
            # eager, op by op: each primitive is compiled once a process for these
            # tiny shapes and every later probe reuses it (a probe compiled as one
            # program compiles again for each transformation and layout)
            step = _probe_step(tx, td)
            for g_all in grads:
                g = g_all if r is None else part(g_all, r)
                updates, state, p = step(td.unflatten(g), state, td.unflatten(p))
                p = [np.asarray(x) for x in tu.tree_leaves(p)]
                rest = [np.asarray(x) for x in tu.tree_leaves(state) if np.ndim(x) == 0]
                out.append(([np.asarray(x) for x in tu.tree_leaves(updates)], rest))
        except Exception as e:  # the user's transformation failed
            raise TypeError(f"{fn}: optimizer= {what} failed on a probe of the params' "
                            f"structure: {type(e).__name__}: {e}") from None
        return out

    whole_tx = tx if whole is None else whole
    whole, ranks = run(None), [run(0), run(1)]
    for k, (updates, rest) in enumerate(whole):
        for r, got in enumerate(ranks):
            same = all(_close(a, b) for a, b in zip(part(updates, r), got[k][0], strict=True))
            same = same and all(_close(a, b) for a, b in zip(rest, got[k][1], strict=True))
            if not same:
                _refuse(whole_tx, layout, k, what, fn, part=outer_name(tx.update))


def _probe_step(tx: _Tx, td: PyTreeDef) -> Callable[..., tuple]:
    def step(g: object, state: object, p: object) -> tuple:
        tu = tree_util()
        updates, state = tx.update(g, state, p)
        return updates, state, tu.tree_map(lambda a, u: a + u.astype(a.dtype), p, updates)

    return step


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    scale = float(np.nanmax(np.abs(a), initial=0.0)) if a.size else 0.0
    return bool(np.allclose(a, b, rtol=1e-4, atol=1e-6 * scale + 1e-30, equal_nan=True))


def _refuse(tx: optax.GradientTransformation | _Tx, layout: Layout, k: int | None, what: str,
            fn: str,
            found: Sequence[str] = (), part: str = "") -> None:
    """A ValueError naming the reductions ``found`` in ``tx``, or its ``part``
    whose update differed on the probe's step ``k``."""
    why = "; ".join(f"{n} needs {_REDUCERS[n]}" for n in found) or (
        f"{part or 'its update'} updates a row by other rows, leaves or ranks")
    seen = ("" if k is None else f": on a probe of the params' structure, its update of a "
            f"rank's rows (step {k + 1}) differs from its update of the whole leaves")
    raise ValueError(
        f"{fn}: optimizer= {what} does not act element by element, so it cannot run on "
        f"ZeRO's shards over {layout.world_size} ranks{seen}. {why}. Inside a chain, "
        f"ZeRO computes {', '.join(sorted(PER_LEAF))} over the ranks, and a "
        "clip_by_global_norm first (or clip_norm=); otherwise use stage 0 (whole leaves on "
        "every rank)")


# -- reading a GradientTransformation's parts -------------------------------------
def _functions(f: object, depth: int = 0,
               seen: set[int] | None = None) -> list[Callable[..., object]]:
    """``f`` and the functions its closure holds, depth first, in order."""
    seen = set() if seen is None else seen
    if depth > 8 or id(f) in seen or not callable(f):
        return []
    seen.add(id(f))
    out: list[Callable[..., object]] = [f]
    for cell in getattr(f, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if callable(x) and hasattr(x, "__code__"):
                out += _functions(x, depth + 1, seen)
            elif _is_transformation(x):
                out += _functions(x.update, depth + 1, seen)
    return out


def _parts(update: object) -> list[str]:
    names = []
    for f in _functions(update):
        qual = getattr(f, "__qualname__", "")
        outer = qual.split(".<locals>.")[0] if ".<locals>." in qual else ""
        if outer and outer not in ("chain", "with_extra_args_support", "named_chain") and \
                outer not in names:
            names.append(outer)
    return names


def clip_first(tx: optax.GradientTransformation) -> float | None:
    """The max norm of a ``clip_by_global_norm`` that comes first in ``tx``."""
    fs = [f for f in _functions(tx.update)
          if ".<locals>." in getattr(f, "__qualname__", "")
          and f.__qualname__.split(".<locals>.")[0] not in ("chain", "with_extra_args_support")]
    if not fs or not fs[0].__qualname__.startswith("clip_by_global_norm.<locals>."):
        return None
    m = free_var(fs[0], "max_norm")
    try:
        return float(m)
    except (TypeError, ValueError):
        return None


def _is_transformation(x: object) -> bool:
    return callable(getattr(x, "init", None)) and callable(getattr(x, "update", None))
