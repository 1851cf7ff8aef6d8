"""The program of a pure ZeRO-3 step, one for every thread rank of a group.

[Note: one program for the ranks]
A :class:`Program` is the step as JAX functions of the state, the batch, the
rank and the key (see [Note: pure steps] in ``shard/_pure.py``). The rank is
an operand, not a constant: each collective is an ordered ``io_callback``
that receives it and finds the rank's communicator in ``_GROUPS`` (the
group's :class:`Collectives`, one a rank), so the compiled program is the
same on every rank of a group. The ranks' steps share one ``Program`` where
they share its parts (the group, the loss function, the optax transformation
object, the layout), and one compiled executable per shapes and dtypes,
compiled ahead of time under a lock by the first rank to need it (the
others wait for it; nothing runs under the lock, so no collective waits on
it). The ranks never call the shared jitted functions directly: jax's first
call of one compiles and runs it while the other callers wait on its cache
entry, and a waiting rank would never join the running one's collectives. A
program traced inside the user's own ``jax.jit`` or ``scan`` is compiled with
the user's program instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ops.comm._programs import placement
from shard.core._data_rank import bind_axis
from shard.core.losses._jax import check_scalar, split_aux

if TYPE_CHECKING:
    import jax
    import jax.stages
    import numpy as np
    import optax

    from ops import Communicator, ThreadGroup
    from shard._pure import PureState
    from shard.core._layout import Layout
    from shard.tensor_parallel._megatron import Collectives

__all__ = ["Program", "ensure", "program_for", "register"]

_LOCK = threading.Lock()
# id(group) -> (group, {rank: Collectives})
_GROUPS: dict[int, tuple[ThreadGroup | Communicator, dict[int, Collectives]]] = {}
_PROGRAMS: dict[tuple, Program] = {}
_MAX = 32  # both caches are cleared when they reach it: a few groups live at a time


def _group_of(comm: Communicator) -> ThreadGroup | Communicator:
    from ops.comm._threads import ThreadCommunicator

    return comm.group if isinstance(comm, ThreadCommunicator) else comm


def register(comm: Communicator) -> int:
    """Make ``comm``'s collectives reachable from the programs of its group;
    returns the group's key."""
    from shard.tensor_parallel._megatron import Collectives

    group = _group_of(comm)
    with _LOCK:
        if id(group) not in _GROUPS and len(_GROUPS) >= _MAX:
            _GROUPS.clear()
            _PROGRAMS.clear()
        _GROUPS.setdefault(id(group), (group, {}))[1][comm.rank] = Collectives(comm)
    return id(group)


def ensure(comm: Communicator, gid: int) -> None:
    """``comm`` registered under ``gid`` again where the registry was cleared
    since (past ``_MAX`` groups; the group itself lives while its steps do)."""
    entry = _GROUPS.get(gid)
    if entry is None or comm.rank not in entry[1]:
        register(comm)


def program_for(gid: int, world: int, loss_fn: Callable[..., object],
                optimizer: optax.GradientTransformation, layout: Layout, has_aux: bool,
                max_norm: float | None, frozen: frozenset[int] = frozenset(),
                axis_name: str | None = None) -> Program:
    """The group's program for these parts (made by the first rank to ask)."""
    key = (gid, id(loss_fn), id(optimizer), layout.fingerprint(), has_aux, max_norm,
           tuple(sorted(frozen)), axis_name)
    with _LOCK:
        hit = _PROGRAMS.get(key)
        if hit is None or hit.loss_fn is not loss_fn or hit.given is not optimizer:
            if len(_PROGRAMS) >= _MAX:
                _PROGRAMS.clear()
            hit = _PROGRAMS[key] = Program(gid, world, loss_fn, optimizer, layout, has_aux,
                                           max_norm, frozen, axis_name)
        return hit


def _host(gid: int, name: str) -> Callable[[np.ndarray | jax.Array, np.ndarray | jax.Array],
                                           np.ndarray]:
    import numpy as np

    def run(rank: np.ndarray | jax.Array, x: np.ndarray | jax.Array) -> np.ndarray:
        return _GROUPS[gid][1][int(np.asarray(rank))].host(name, x)
    return run


class Program:
    """The step's JAX functions for one group (see the Note)."""

    def __init__(self, gid: int, world: int, loss_fn: Callable[..., object],
                 optimizer: optax.GradientTransformation, layout: Layout, has_aux: bool,
                 max_norm: float | None, frozen: frozenset[int] = frozenset(),
                 axis_name: str | None = None) -> None:
        import jax
        import optax

        self.gid, self.w, self.layout, self.frozen = gid, world, layout, frozen
        self.axis_name = axis_name
        self.loss_fn, self.given, self.optimizer = loss_fn, optimizer, optimizer
        if frozen:  # no state for the frozen leaves; their updates are their zero gradients
            self.optimizer = optax.masked(optimizer, layout.treedef.unflatten(
                [i not in frozen for i in range(len(layout.leaves))]))
        self.has_aux, self.max_norm = has_aux, max_norm
        groups: dict[tuple, list[int]] = {}  # (unit, split, dtype, frozen): its leaves, in order
        for i, leaf in sorted(enumerate(layout.leaves), key=lambda e: (e[1].unit, e[1].offset)):
            groups.setdefault((leaf.unit, leaf.sharded, leaf.dtype, i in frozen), []).append(i)
        self.groups = [(split, still, idx) for (_, split, _, still), idx in groups.items()]
        self._build()
        self.step = jax.jit(self._step)
        self.whole = jax.jit(self._whole)
        self.evaluate = jax.jit(self._evaluate, static_argnames="fn")
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._compiling = threading.Lock()

    # -- collectives ------------------------------------------------------------
    def _call(self, name: str, x: jax.Array, n: int, rank: jax.Array) -> jax.Array:
        import jax
        from jax.experimental import io_callback

        return io_callback(_host(self.gid, name), jax.ShapeDtypeStruct((n,), x.dtype), rank, x,
                           ordered=True)

    def _build(self) -> None:
        import jax

        w = self.w

        # its derivative: the reduce-scatter
        @jax.custom_vjp
        def gather(x: jax.Array, rank: jax.Array) -> jax.Array:
            return self._call("all_gather", x, x.shape[0] * w, rank)
        gather.defvjp(lambda x, rank: (gather(x, rank), rank),
                      lambda rank, ct: (self._call("reduce_scatter", ct, ct.shape[0] // w,
                                                   rank), None))

        @jax.custom_vjp
        def copy(x: jax.Array, rank: jax.Array) -> jax.Array:  # its derivative: the all-reduce
            return x
        copy.defvjp(lambda x, rank: (x, rank),
                    lambda rank, ct: (self._call("all_reduce", ct, ct.shape[0], rank), None))

        # the loss's over the data axis; its derivative too
        @jax.custom_vjp
        def psum(x: jax.Array, rank: jax.Array) -> jax.Array:
            return self.all_reduce(x, rank)
        psum.defvjp(lambda x, rank: (psum(x, rank), rank),
                    lambda rank, ct: (self.all_reduce(ct, rank), None))
        self.gather, self.copy, self.psum = gather, copy, psum

    def all_reduce(self, x: jax.Array, rank: jax.Array) -> jax.Array:
        """The sum over the ranks of ``x`` (any shape; not differentiated)."""
        return self._call("all_reduce", x.reshape(-1), x.size, rank).reshape(x.shape)

    # -- the functions ----------------------------------------------------------
    def _whole(self, params: object, rank: jax.Array) -> object:
        import jax
        import jax.numpy as jnp

        layout, w = self.layout, self.w
        leaves = layout.treedef.flatten_up_to(params)
        if w == 1:  # one rank's rows are the whole leaves
            return layout.treedef.unflatten([x.reshape(leaf.shape) for leaf, x in
                                             zip(layout.leaves, leaves, strict=True)])
        out: list[jax.Array | None] = [None] * len(leaves)
        for split, still, idx in self.groups:
            flat = jnp.concatenate([leaves[i].reshape(-1) for i in idx])
            if still:  # frozen: gathered, but never differentiated, so never reduced
                flat = jax.lax.stop_gradient(flat)
            flat = self.gather(flat, rank).reshape(w, -1) if split else self.copy(flat, rank)
            at = 0
            for i in idx:
                leaf = layout.leaves[i]
                if split:  # (W, S): rank r's shards in row r
                    part = flat[:, at:at + leaf.local_size].reshape(
                        w * leaf.rows_per_rank, *leaf.shape[1:])[:leaf.rows]
                else:
                    part = flat[at:at + leaf.size]
                out[i] = part.reshape(leaf.shape)
                at += leaf.local_size
        return layout.treedef.unflatten(out)

    def _loss(self, fn: Callable[..., object], params: object, state: PureState, batch: object,
              rank: jax.Array, key: jax.Array | None) -> tuple[jax.Array, object, object]:
        """``fn`` on the whole ``params``: ``(loss, new model state, aux)``, with
        the model state and the key it takes."""
        import jax

        # the model state rebuilt inside the traced function, so that containers that
        # remember the trace that made them (flax nnx Variables) take the loss's updates
        args = (batch,) if state.model_state is None else (
            batch, jax.tree_util.tree_map(lambda x: x, state.model_state))
        kw = {}
        if key is not None:  # shard.step_key's: the step, the rank, micro-batch 0
            for v in (state.step, rank, 0):
                key = jax.random.fold_in(key, v)
            kw["key"] = key
        if self.axis_name is not None:  # see [Note: the data axis in the loss]
            fn = bind_axis(fn, self.axis_name, self.w, psum=lambda x: self.psum(x, rank),
                           index=lambda: jax.numpy.asarray(rank, jax.numpy.int32),
                           where="pure_zero3")
        out = fn(self._whole(params, rank), *args, **kw)
        new = None
        if state.model_state is not None:
            what = "(loss, (new_model_state, aux))" if self.has_aux else "(loss, new_model_state)"
            if not (isinstance(out, (tuple, list)) and len(out) == 2) or (
                    self.has_aux and not (isinstance(out[1], (tuple, list)) and len(out[1]) == 2)):
                raise TypeError(f"pure_zero3: a loss with a model state returns {what}; got "
                                f"{type(out).__name__}")
            if self.has_aux:  # (loss, aux) for split_aux, and the new state
                out, new = (out[0], out[1][1]), out[1][0]
            else:
                out, new = out[0], out[1]
            structure: object = jax.tree_util.tree_structure(new)  # only compared
            if structure != jax.tree_util.tree_structure(state.model_state):
                raise TypeError("pure_zero3: the loss returned a model state of another "
                                "structure than the state's")
        value, aux = split_aux(out, self.has_aux)
        check_scalar(value)
        return value, new, aux

    def _mean(self, tree: object, rank: jax.Array) -> Any:
        """Every numeric leaf of ``tree`` averaged over the ranks, in float32."""
        import jax
        import jax.numpy as jnp

        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if self.w == 1 or not leaves:
            return tree
        leaves = [jnp.asarray(x, jnp.float32) for x in leaves]
        flat = self.all_reduce(jnp.concatenate([x.reshape(-1) for x in leaves]), rank) / self.w
        out, at = [], 0
        for x in leaves:
            out.append(flat[at:at + x.size].reshape(x.shape))
            at += x.size
        return jax.tree_util.tree_unflatten(treedef, out)

    def _same_everywhere(self, tree: object, rank: jax.Array) -> object:
        """``tree`` made the same on every rank: floating-point leaves averaged,
        the others rank 0's (two collectives, as for ``zero3``'s model state)."""
        import jax
        import jax.numpy as jnp

        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if self.w == 1 or not leaves:
            return tree
        out = list(leaves)
        for floating in (True, False):
            idx = [i for i, x in enumerate(leaves)
                   if bool(jnp.issubdtype(x.dtype, jnp.floating)) == floating]
            if not idx:
                continue
            kind = jnp.float32 if floating else jnp.int32
            flat = jnp.concatenate([leaves[i].reshape(-1).astype(kind) for i in idx])
            if floating:
                flat = self.all_reduce(flat, rank) / self.w
            else:
                flat = self.all_reduce(jnp.where(rank == 0, flat, jnp.zeros_like(flat)), rank)
            at = 0
            for i in idx:
                n = leaves[i].size
                out[i] = flat[at:at + n].reshape(leaves[i].shape).astype(leaves[i].dtype)
                at += n
        return jax.tree_util.tree_unflatten(treedef, out)

    def _evaluate(self, state: PureState, batch: object, rank: jax.Array, key: jax.Array | None,
                  fn: Callable[..., object]) -> jax.Array | tuple[jax.Array, object]:
        import jax.numpy as jnp

        value, _, aux = self._loss(fn, state.params, state, batch, rank, key)
        value = jnp.asarray(value, jnp.float32)
        mean = self.all_reduce(value, rank) / self.w if self.w > 1 else value
        return (mean, self._mean(aux, rank)) if self.has_aux else mean

    def _step(self, state: PureState, batch: object, rank: jax.Array, key: jax.Array | None
              ) -> tuple[PureState, dict[str, Any]]:
        import jax
        import jax.numpy as jnp
        import optax

        from shard._pure import PureState

        layout, w = self.layout, self.w

        def loss(shards: object) -> tuple[jax.Array, tuple[object, object]]:
            value, new, aux = self._loss(self.loss_fn, shards, state, batch, rank, key)
            return value, (new, aux)

        (value, (model_state, aux)), grads = jax.value_and_grad(loss, has_aux=True)(
            state.params)
        if model_state is not None:
            model_state = self._same_everywhere(model_state, rank)
        grads = jax.tree_util.tree_map(lambda g: g / w, grads)  # the sum over ranks: the mean
        flat = layout.treedef.flatten_up_to(grads)
        split = [jnp.sum(jnp.square(g.astype(jnp.float32)))
                 for leaf, g in zip(layout.leaves, flat, strict=True) if leaf.sharded]
        whole = [jnp.sum(jnp.square(g.astype(jnp.float32)))
                 for leaf, g in zip(layout.leaves, flat, strict=True) if not leaf.sharded]
        sumsq = sum(split, jnp.float32(0))
        if w > 1 and split:
            sumsq = self.all_reduce(sumsq, rank)
        norm = jnp.sqrt(sumsq + sum(whole, jnp.float32(0)))
        if self.max_norm is not None:  # as optax.clip_by_global_norm, over the whole gradient
            scale = jnp.where(norm < self.max_norm, 1.0, self.max_norm / norm)
            grads = jax.tree_util.tree_map(lambda g: (g * scale).astype(g.dtype), grads)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        value = jnp.asarray(value, jnp.float32)
        metrics = {"loss": self.all_reduce(value, rank) / w if w > 1 else value,
                   "grad_norm": norm}
        if self.has_aux:  # averaged over the ranks, as zero3's
            metrics["aux"] = self._mean(aux, rank)
        return PureState(params, opt_state, state.step + 1, model_state), metrics

    # -- running it -------------------------------------------------------------
    def run(self, name: str, args: tuple, fn: Callable[..., object] | None = None) -> Any:
        """``step``, ``whole`` or ``evaluate`` (with its loss ``fn``) on ``args``:
        inside a trace (the user's ``jit`` or ``scan``) the jitted function, else
        the group's executable for these shapes, compiled once. Never the jitted
        function called directly by the ranks at once: its first call compiles
        and runs under jax's cache entry, and a rank waiting on that entry would
        never join the running rank's collectives."""
        import jax

        jitted = getattr(self, name)
        static = {} if fn is None else {"fn": fn}
        leaves, tree = jax.tree_util.tree_flatten(args)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return jitted(*args, **static)
        sig = (name, fn, tree, tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", type(x))),
                                      getattr(x, "weak_type", False)) for x in leaves),
               placement(leaves))
        compiled = self._compiled.get(sig)
        if compiled is None:
            with self._compiling:  # compiling runs no collective: the other ranks just wait
                compiled = self._compiled.get(sig)
                if compiled is None:
                    compiled = self._compiled[sig] = jitted.lower(*args, **static).compile()
        return compiled(*args)
