"""An optax transformation as its parts, and the parts that reduce over whole
leaves computed on shards (see [Note: optax on shards] in ``_optim.py``).

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ops._tree import tree_util

__all__ = ["PER_LEAF", "Part", "Segments", "free_var", "parts_of"]

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


def outer_name(f: Any) -> str:
    """``chain`` for ``chain.<locals>.update_fn``; '' for a module-level function."""
    qual = getattr(f, "__qualname__", "")
    return qual.split(".<locals>.")[0] if ".<locals>." in qual else ""


def parts_of(tx: Any) -> list[Part]:
    """``tx``'s transformations in the order they apply, nested chains flattened."""
    return _flatten(tx.init, tx.update, ())


def _flatten(init: Any, update: Any, path: tuple[int, ...]) -> list[Part]:
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


def _get(state: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        state = state[i]
    return state


def _put(state: Any, path: tuple[int, ...], value: Any) -> Any:
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

    def __init__(self, parts: list[Part], treedef: Any, valid: list[int],
                 sharded: list[bool], sizes: list[int]) -> None:
        import jax

        self.parts, self.treedef = parts, treedef
        self.valid, self.sharded, self.sizes = valid, sharded, sizes
        self.runs: list[Any] = []  # (part indices, jitted fn) or a per-leaf part index
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

    def __call__(self, grads: Any, state: Any, params: Any,
                 reduce: Callable[[np.ndarray], np.ndarray]) -> tuple[list, Any]:
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

    def _per_leaf(self, i: int, u: Any, params: Any, reduce: Callable) -> Any:
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


def _safe(norm: float, floor: Any) -> float:
    """optax's ``safe_norm`` / ``safe_root_mean_squares``: ``floor`` where the
    value is at most it."""
    floor = float(floor)
    return floor if norm <= floor else norm


def _run_fn(parts: list[Part]) -> Callable:
    def run(u: Any, states: list, params: Any) -> tuple[Any, list]:
        new = []
        for part, s in zip(parts, states, strict=True):
            u, s = part.update(u, s, params)
            new.append(s)
        return u, new

    return run
