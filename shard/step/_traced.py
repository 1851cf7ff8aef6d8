"""ZeRO-3 for any JAX loss: the traced program cut into one piece per unit.

[Note: traced units]
A JAX loss ``loss_fn(params, batch)`` is written as one function, but ZeRO-3
needs each unit's full params only while that unit computes. At stage 3 on
several ranks the loss is traced once per batch structure and shapes
(``jax.make_jaxpr``, with nested ``jax.jit`` calls inlined so a jitted model
is cut too), and its equations are cut into one segment per unit, in the
order the program first uses the units: segment ``k`` runs from the first
equation that reads unit ``order[k]``'s params to the equation before the
next unit's first use (the equations before any use go with the first).
What a later segment reads from an earlier one (activations, and the params
of an earlier unit that it reads again, such as a tied embedding) is
carried between them; the batch and the program's constants reach every
segment directly.

Each segment then runs as a :class:`~shard.core.losses._layered.Layered` layer does
(see [Note: ZeRO-3 schedule] in ``shard/step/_runtime.py``): its unit is
gathered just before it runs with the next unit's gather in flight, its
forward keeps its VJP residuals less its own inputs (those that [Note: what
a forward keeps] names), and the backward
gathers the unit again, runs the segment's VJP and hands the unit's
gradient to the reduction while the next segment's backward computes. So a
rank holds its shards plus about two units, whatever the model library (a
flax, equinox or plain-dict model as its authors wrote it).

What this costs and where it does not reach: each segment is two compiled
calls (forward and backward), like ``Layered``, except the last, whose
backward follows its forward at once: it is one call of its value and
gradient (no residuals leave the compiled program, and its leaves'
gradients go to the reduction as they are, not joined first; the MNIST CNN
of ``benchmarks/jax_models.py`` as one unit took 9.4 against 11.4 ms for
half its batch); a unit's params read again
later are carried (kept alive) until their last use; an equation that reads
several units at once (a ``lax.scan`` over stacked layers, a
``jax.checkpoint`` or custom-derivative call taking the params of several
units) puts those units in one segment, gathered together. Units that the
program never reads get a zero gradient.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ops.comm._programs import SharedJit, program_key, ready
from ops.device._dlpack import jax_view
from shard.core.losses._layered import _UnitLayer, kept_vjp, placed
from shard.monitor._profile import timed
from shard.step._cut import Cut, CutProgram, dtype_of, evaluate_eqns, trace

if TYPE_CHECKING:
    from typing import TypeAlias

    import jax
    from jax.extend.core import ClosedJaxpr
    from jax.tree_util import PyTreeDef
    from jax.typing import ArrayLike

    from shard.core._layout import Layout
    from shard.core.losses._jax import JaxLoss
    from shard.step._runtime import Units
    from shard.step.reduction._reduce import GradReducer

    # a batch's leaves' dtypes and structure: (the units' compute dtypes, the
    # batch's treedef, each leaf's shape and dtype, or type where it has none)
    _Signature: TypeAlias = tuple[tuple[np.dtype, ...], PyTreeDef,
                                  tuple[tuple[tuple[int, ...], object], ...]]
    # a segment's forward: its compiled forward and backward, and its residuals
    # that are not its own inputs
    _Saved: TypeAlias = tuple[tuple[SharedJit, SharedJit], list[jax.Array]]

__all__ = ["TracedUnits", "traced"]

KEEP = 8  # programs kept per loss function


_TRACED: weakref.WeakKeyDictionary[JaxLoss, TracedUnits] = weakref.WeakKeyDictionary()
_TRACED_LOCK = threading.Lock()


def traced(loss: Any) -> TracedUnits:  # Any: the step's LossProvider, a JaxLoss here
    """The one :class:`TracedUnits` of a ``JaxLoss`` (shared, as the loss is,
    by every step and thread rank of its function)."""
    with _TRACED_LOCK:
        found = _TRACED.get(loss)
        if found is None:
            found = _TRACED[loss] = TracedUnits(loss.fn, loss.has_aux)
        return found


class TracedUnits:
    """A JAX loss run segment by segment at stage 3 (see [Note: traced units]).

    One per loss function; thread ranks share it, so each program is traced
    and each segment compiled once per (layout, batch shapes and dtypes).
    """

    def __init__(self, fn: Callable[..., object], has_aux: bool) -> None:
        self.fn, self.has_aux = fn, has_aux
        # (program, ranks operand)
        self._programs: dict[tuple[Layout, _Signature], tuple[_Program, jax.Array]] = {}
        self._by_id: dict[tuple[int, _Signature],
                          tuple[Layout, tuple[_Program, jax.Array]]] = {}
        self._lock = threading.Lock()

    def program(self, units: Units, batch: object) -> tuple[_Program, jax.Array]:
        """The cut program for this layout and batch, and this loss's ranks
        operand for it (traced on first use; the last :data:`KEEP` are kept,
        keyed by value, so step objects of equal layouts share them; a program
        equal to another loss's, as the thread ranks' tensor-parallel losses
        are, is that one: see [Note: one program for a group's ranks] in
        ``ops/comm/_xla.py``)."""
        import jax

        layout = units.full_layout
        dtypes = tuple(np.dtype(x.dtype) for x in units.local)
        leaves, tree = jax.tree_util.tree_flatten(batch)
        signature: _Signature = (dtypes, tree, tuple((np.shape(x), dtype_of(x)) for x in leaves))
        with self._lock:
            seen = self._by_id.get((id(layout), signature))
            if seen is not None and seen[0] is layout:
                return seen[1]
            key = (layout, signature)
            found = self._programs.pop(key, None)
            if found is None:
                closed, aux_tree, values = trace(self.fn, self.has_aux, layout, dtypes, batch)
                found = (_shared(closed, aux_tree, self.has_aux, layout, signature),
                         ready(jax.device_put(values)))
            self._programs[key] = found  # the most recent last
            while len(self._programs) > KEEP:
                self._programs.pop(next(iter(self._programs)))
            self._by_id = {k: v for k, v in self._by_id.items()
                           if (v[0], k[1]) in self._programs}
            self._by_id[(id(layout), signature)] = (layout, found)
        return found

    def run_units(self, units: Units, reducer: GradReducer, batch: object,
                  scale: float) -> ArrayLike | tuple[ArrayLike, Any]:
        """One micro-batch segment by segment: returns the loss (and aux, with
        ``has_aux``); each unit's gradient of ``scale * loss`` goes to
        ``reducer``."""
        batch = placed(batch)
        program, ranks = self.program(units, batch)
        return program.run(units, reducer, (batch, ranks), scale)

    def loss_units(self, units: Units, batch: object) -> ArrayLike | tuple[ArrayLike, Any]:
        """The loss (and aux), forward only, segment by segment."""
        batch = placed(batch)
        program, ranks = self.program(units, batch)
        return program.forward_only(units, (batch, ranks))


# programs by value, for every loss that traces one
_SHARED: dict[tuple[str, Layout, _Signature, bool], _Program] = {}
_SHARED_LOCK = threading.Lock()


def _shared(closed: ClosedJaxpr, aux_tree: PyTreeDef, has_aux: bool, layout: Layout,
            signature: _Signature) -> _Program:
    """The one :class:`_Program` of this traced program, layout and signature."""
    key = (program_key(closed, aux_tree)[0], layout, signature, has_aux)
    with _SHARED_LOCK:
        found = _SHARED.pop(key, None)
        if found is None:
            found = _Program(closed, aux_tree, has_aux, layout)
        _SHARED[key] = found  # the most recent last
        while len(_SHARED) > 4 * KEEP:
            _SHARED.pop(next(iter(_SHARED)))
        return found


class _Program(CutProgram):
    """The loss's program for one layout and batch signature, cut into segments
    (see :class:`~shard.step._cut.CutProgram`), and run segment by segment."""

    def __init__(self, closed: ClosedJaxpr, aux_tree: PyTreeDef, has_aux: bool,
                 layout: Layout) -> None:
        super().__init__(closed, layout)
        self.has_aux, self.aux_tree = has_aux, aux_tree
        self.layers = [_Segment(self, cut, layout) for cut in self.segments]

    # -- running ---------------------------------------------------------------

    def _finish(self, loss: ArrayLike,
                aux: list[ArrayLike]) -> ArrayLike | tuple[ArrayLike, object]:
        import jax

        if not self.has_aux:
            return loss
        return loss, jax.tree_util.tree_unflatten(self.aux_tree, aux)

    def run(self, units: Units, reducer: GradReducer, batch: tuple[object, jax.Array],
            scale: float) -> ArrayLike | tuple[ArrayLike, object]:
        import jax

        b = tuple(jax.tree_util.tree_leaves(batch))
        n = len(self.layers)
        if n == 0:
            return self._without_params(units, reducer, b)
        seed = (np.asarray(scale, dtype=self._outvars[0].aval.dtype),)  # the loss's cotangent
        carries: list[tuple[tuple[ArrayLike, ...], tuple[ArrayLike, ...]]] = [((), ())]
        saved: list[Any] = [None] * n  # Any: each _Saved, None before its forward and after
        order = self.order
        for k in range(n - 1):
            u = order[k]
            flat = jax_view(units.flat(u, order[k + 1:]))
            with timed("forward"):
                out_d, out_nd, saved[k] = self.layers[k].forward(flat, *carries[-1], b)
                carries.append(jax.block_until_ready((out_d, out_nd)))
            del flat
        # the last segment's value and gradient in one call (see the Note)
        u = order[n - 1]
        flat = jax_view(units.flat(u, order[n - 2::-1] if n > 1 else ()))
        with timed("compute"):
            (loss,), aux, grads, ct = jax.block_until_ready(
                self.layers[n - 1].whole(flat, *carries[n - 1], b, seed))
        del flat
        carries[n - 1] = ((), ())
        reducer.add(u, [units.device.from_jax(g) for g in grads])  # copied in, leaf by leaf
        for k in reversed(range(n - 1)):
            u = order[k]
            flat = jax_view(units.flat(u, order[k - 1::-1] if k > 0 else ()))
            with timed("backward"):
                grad, ct = self.layers[k].backward(saved[k], flat, *carries[k], b, ct)
                saved[k] = None
                jax.block_until_ready((grad, ct))
            del flat
            carries[k] = ((), ())
            reducer.add(u, units.leaf_views(u, units.device.from_jax(grad)))
        for u in self.unused:
            reducer.add(u, [None] * len(self.layout.units[u].leaves))
        return self._finish(loss, list(aux))

    def _without_params(self, units: Units, reducer: GradReducer,
                        b: tuple[ArrayLike, ...]) -> ArrayLike | tuple[ArrayLike, object]:
        outs = evaluate_eqns([], self.constvars, self.consts, self.batch_vars, b, self._eqns,
                         self._outvars)
        for u in self.unused:
            reducer.add(u, [None] * len(self.layout.units[u].leaves))
        return self._finish(outs[0], outs[1:])

    def forward_only(self, units: Units,
                     batch: tuple[object, jax.Array]) -> ArrayLike | tuple[ArrayLike, object]:
        import jax

        b = tuple(jax.tree_util.tree_leaves(batch))
        n = len(self.layers)
        carry: tuple[tuple[ArrayLike, ...], tuple[ArrayLike, ...]] = ((), ())
        for k in range(n):
            flat = jax_view(units.flat(self.order[k], self.order[k + 1:]))
            carry = jax.block_until_ready(self.layers[k].apply(flat, carry, b))
            del flat  # (waited for: async dispatch would keep it alive)
        (loss,), aux = carry
        return self._finish(loss, list(aux))


class _Segment(_UnitLayer):
    """One segment over its unit's flat params buffer, compiled as a
    :class:`~shard.core.losses._layered.Layered` layer is: ``apply`` (forward only),
    ``forward`` keeping its VJP residuals less its own inputs, ``backward``."""

    def __init__(self, program: _Program, cut: Cut, layout: Layout) -> None:
        import jax

        unit = layout.units[cut.u]
        pieces = tuple((layout.leaves[i].offset, layout.leaves[i].size, layout.leaves[i].shape)
                       for i in unit.leaves)
        self.cut = cut

        def f(ls: list[jax.Array], carry: tuple[tuple[ArrayLike, ...], tuple[ArrayLike, ...]],
              b: tuple[ArrayLike, ...]) -> tuple[tuple[ArrayLike, ...], tuple[ArrayLike, ...]]:
            cd, cnd = carry
            pairs = [*zip(cut.own, ls, strict=True), *zip(cut.in_d, cd, strict=True),
                     *zip(cut.in_nd, cnd, strict=True)]
            outs = evaluate_eqns(pairs, program.constvars, program.consts, program.batch_vars, b,
                             cut.eqns, [*cut.out_d, *cut.out_nd])
            return tuple(outs[:len(cut.out_d)]), tuple(outs[len(cut.out_d):])

        super().__init__(f, jax.tree_util.tree_structure(list(range(len(pieces)))), pieces,
                         unit.local_size)
        self._kept: tuple[SharedJit, SharedJit] | None = None

        def whole(flat: jax.Array, cd: tuple[ArrayLike, ...], cnd: tuple[ArrayLike, ...],
                  b: tuple[ArrayLike, ...], ct: tuple[ArrayLike, ...]
                  ) -> tuple[tuple[ArrayLike, ...], tuple[ArrayLike, ...], list[jax.Array],
                             tuple[jax.Array, ...]]:
            out_d, vjp, out_nd = jax.vjp(lambda ls, cd: f(ls, (cd, cnd), b),
                                         self.leaves(flat), cd, has_aux=True)
            g, dcd = vjp(ct)
            return out_d, out_nd, g, dcd

        self.whole = SharedJit(whole)  # the program's last segment

    def forward(  # type: ignore[override]  # a segment's carry comes in two parts
            self, flat: jax.Array, cd: tuple[ArrayLike, ...], cnd: tuple[ArrayLike, ...],
            b: tuple[ArrayLike, ...]
    ) -> tuple[tuple[ArrayLike, ...], tuple[ArrayLike, ...], _Saved]:
        """``(float outputs, other outputs, saved)`` (``saved`` for :meth:`backward`)."""
        plan = self._kept
        if plan is None:
            with self._lock:  # thread ranks: one of them traces, the others wait
                plan = self._kept
                if plan is None:
                    plan = self._plan()
                    plan[0].prepare(flat, cd, cnd, b)  # traces and compiles; runs nothing
                    self._kept = plan
        out_d, out_nd, kept = plan[0](flat, cd, cnd, b)
        return out_d, out_nd, (plan, kept)

    def _plan(self) -> tuple[SharedJit, SharedJit]:
        import jax

        sources: list[int | None] = []
        meta: list[PyTreeDef] = []

        def fwd(flat: jax.Array, cd: tuple[jax.Array, ...], cnd: tuple[jax.Array, ...],
                b: tuple[jax.Array, ...]
                ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], list[jax.Array]]:
            ls = self.leaves(flat)
            out_d, vjp, out_nd = kept_vjp(lambda ls, cd: self.f(ls, (cd, cnd), b), ls, cd,
                                          has_aux=True)
            res, structure = jax.tree_util.tree_flatten(vjp)
            ins = {id(x): k for k, x in enumerate(jax.tree_util.tree_leaves((ls, cd, cnd, b)))}
            sources[:] = [ins.get(id(r)) for r in res]
            meta[:] = [structure]
            return out_d, out_nd, [r for r, s in zip(res, sources, strict=True) if s is None]

        def bwd(kept: list[jax.Array], flat: jax.Array, cd: tuple[jax.Array, ...],
                cnd: tuple[jax.Array, ...], b: tuple[jax.Array, ...],
                ct: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
            ins = jax.tree_util.tree_leaves((self.leaves(flat), cd, cnd, b))
            rest = iter(kept)
            res = [next(rest) if s is None else ins[s] for s in sources]
            g, dcd = jax.tree_util.tree_unflatten(meta[0], res)(ct)
            return self.flat_grad(g, flat.dtype), dcd

        return SharedJit(fwd), SharedJit(bwd)

    def backward(self, saved: _Saved, flat: jax.Array,  # type: ignore[override]
                 cd: tuple[ArrayLike, ...], cnd: tuple[ArrayLike, ...], b: tuple[ArrayLike, ...],
                 ct: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        (_, bwd), kept = saved
        return bwd(kept, flat, cd, cnd, b, ct)
