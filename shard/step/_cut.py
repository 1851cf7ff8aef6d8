"""A JAX loss's program, traced once and cut into one segment per unit (see
[Note: traced units] in ``shard/step/_traced.py``): :func:`trace` makes the
program over the params' leaves, the batch's and the ranks operand;
:class:`CutProgram` cuts it; :func:`evaluate_eqns` runs a segment's equations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ops.comm._xla import SLOTS, rank_scope
from shard.core._data_rank import evaluate, named_axes_refused
from shard.core.losses._jax import check_scalar, split_aux
from shard.monitor._profile import timed

if TYPE_CHECKING:
    from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, Var
    from jax.tree_util import PyTreeDef
    from jax.typing import ArrayLike

    from shard.core._layout import Layout

__all__ = ["Cut", "CutProgram", "dtype_of", "evaluate_eqns", "inexact", "trace"]


def trace(fn: Callable[..., object], has_aux: bool, layout: Layout, dtypes: tuple[np.dtype, ...],
          batch: object) -> tuple[ClosedJaxpr, PyTreeDef, np.ndarray]:
    """The loss's program over the params' leaves, the batch's leaves and the
    ranks operand, with nested jit calls inlined: (closed jaxpr, aux tree,
    this loss's values of the ranks operand)."""
    import jax

    leaf_unit = [0] * len(layout.leaves)
    for u, unit in enumerate(layout.units):
        for i in unit.leaves:
            leaf_unit[i] = u
    params = [jax.ShapeDtypeStruct(leaf.shape, dtypes[leaf_unit[i]])
              for i, leaf in enumerate(layout.leaves)]
    b_leaves, b_tree = jax.tree_util.tree_flatten(batch)
    n_p = len(layout.leaves)
    found: dict[str, Any] = {}

    def flat_fn(*xs: jax.Array) -> list[jax.Array]:
        p = layout.treedef.unflatten(list(xs[:n_p]))
        with rank_scope(xs[-1]) as scope:
            out = fn(p, jax.tree_util.tree_unflatten(b_tree, list(xs[n_p:-1])))
        found["values"] = scope.values
        loss, aux = split_aux(out, has_aux)
        check_scalar(loss)
        found["aux_tree"] = jax.tree_util.tree_structure(aux)
        return [loss, *jax.tree_util.tree_leaves(aux)]

    args = [*params, *b_leaves, jax.ShapeDtypeStruct((SLOTS,), np.int32)]
    with timed("forward"):
        with named_axes_refused("zero3"):
            closed = jax.make_jaxpr(flat_fn)(*args)
        closed = jax.make_jaxpr(lambda *xs: evaluate(closed.jaxpr, list(closed.consts),
                                                     list(xs)))(*args)
    return closed, found["aux_tree"], found["values"]


def dtype_of(x: object) -> object:
    return getattr(x, "dtype", type(x))


def inexact(v: Any) -> bool:  # Any: a jaxpr Var (JAX types its aval without a dtype)
    import jax.numpy as jnp

    dtype = v.aval.dtype
    return not jax_extended(dtype) and jnp.issubdtype(dtype, jnp.inexact)


def jax_extended(dtype: np.dtype) -> bool:
    import jax

    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


class CutProgram:
    """A loss's program for one layout and batch signature, cut into one
    segment per unit (see [Note: traced units] in ``shard/step/_traced.py``;
    its batch leaves end with the ranks operand): ``order`` the units in the
    order of first use, ``segments`` a :class:`Cut` each, ``unused`` the units
    it never reads."""

    def __init__(self, closed: ClosedJaxpr, layout: Layout) -> None:
        self.layout = layout
        n_units = len(layout.units)
        leaf_unit = [0] * len(layout.leaves)
        for u, unit in enumerate(layout.units):
            for i in unit.leaves:
                leaf_unit[i] = u
        n_p = len(layout.leaves)
        jaxpr = closed.jaxpr
        self.consts = list(closed.consts)
        self.constvars = list(jaxpr.constvars)
        self.param_vars = list(jaxpr.invars[:n_p])
        self.batch_vars = list(jaxpr.invars[n_p:])
        unit_of = {v: leaf_unit[i] for i, v in enumerate(self.param_vars)}

        order, starts = _first_uses(jaxpr.eqns, unit_of)
        self.order = order
        self.unused = [u for u in range(n_units) if u not in order]
        bounds = [*starts, len(jaxpr.eqns)]
        seg_of_eqn = np.zeros(len(jaxpr.eqns), np.int64)
        for k in range(len(order)):
            seg_of_eqn[bounds[k]:bounds[k + 1]] = k
        position = {u: k for k, u in enumerate(order)}
        n = len(order)

        made = {v: position[unit_of[v]] for v in self.param_vars if unit_of[v] in position}
        last = _last_reads(jaxpr.eqns, jaxpr.outvars, seg_of_eqn, made, n)
        outs = list(jaxpr.outvars)
        self._eqns, self._outvars = list(jaxpr.eqns), outs
        carried = [v for v in made if last.get(v, -1) > made[v]]
        self.segments: list[Cut] = []
        for k, u in enumerate(order):
            ins = [v for v in carried if made[v] < k <= last[v]]
            keep = [v for v in carried if made[v] <= k < last[v]]
            own = [self.param_vars[i] for i in layout.units[u].leaves]
            self.segments.append(Cut(k, u, jaxpr.eqns[bounds[k]:bounds[k + 1]], own,
                                      [v for v in ins if inexact(v)],
                                      [v for v in ins if not inexact(v)],
                                      [v for v in keep if inexact(v)],
                                      [v for v in keep if not inexact(v)]))
        if self.segments:  # the last one returns the program's outputs
            final = self.segments[-1]
            final.out_d, final.out_nd = [outs[0]], outs[1:]


def _first_uses(eqns: list[JaxprEqn], unit_of: dict[Var, int]) -> tuple[list[int], list[int]]:
    """The units in the order the equations first read their params, and the
    equation where each one's segment starts (the first segment at 0)."""
    from jax.extend.core import Literal

    order: list[int] = []
    starts: list[int] = []
    seen: set[int] = set()
    for e, eqn in enumerate(eqns):
        for v in eqn.invars:
            first = unit_of.get(v) if not isinstance(v, Literal) else None
            if first is not None and first not in seen:
                seen.add(first)
                order.append(first)
                starts.append(e)
    if order:
        starts[0] = 0
    return order, starts


def _last_reads(eqns: list[JaxprEqn], outvars: list[Var | Literal], seg_of_eqn: np.ndarray,
                made: dict[Var, int], n: int) -> dict[Var, int]:
    """The last segment reading each value (``n`` for the program's outputs);
    ``made`` (each value's segment, the params' given) gets every equation's
    outputs."""
    from jax.extend.core import Literal

    last: dict[Var, int] = {}
    for e, eqn in enumerate(eqns):
        k = int(seg_of_eqn[e])
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last[v] = max(last.get(v, k), k)
        for v in eqn.outvars:
            made[v] = k
    for v in outvars:
        if not isinstance(v, Literal):
            last[v] = n  # read after the last segment
    return last


class Cut:
    """Segment ``k``: unit ``u``'s equations, its own params, what it reads from
    earlier segments (float ``in_d``, others ``in_nd``) and what it passes on."""

    def __init__(self, k: int, u: int, eqns: list[JaxprEqn], own: list[Var], in_d: list[Var],
                 in_nd: list[Var], out_d: list[Var | Literal],
                 out_nd: list[Var | Literal]) -> None:
        self.k, self.u, self.eqns, self.own = k, u, eqns, own
        self.in_d, self.in_nd, self.out_d, self.out_nd = in_d, in_nd, out_d, out_nd


def evaluate_eqns(pairs: list[tuple[Var, ArrayLike]], constvars: list[Var],
              consts: list[ArrayLike], batch_vars: list[Var], batch: tuple[ArrayLike, ...],
              eqns: list[JaxprEqn], outvars: list[Var | Literal]) -> list[ArrayLike]:
    from jax.extend.core import Literal

    env: dict[Var, ArrayLike] = dict(zip(constvars, consts, strict=True))
    env.update(zip(batch_vars, batch, strict=True))
    env.update(pairs)

    def read(v: Var | Literal) -> ArrayLike:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in eqns:
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*[read(v) for v in eqn.invars],
                                      **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs],
                       strict=True))
    return [read(v) for v in outvars]
