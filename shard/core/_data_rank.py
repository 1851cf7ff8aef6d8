"""What a JAX loss knows of its data rank: a random key per data rank, step
and micro-batch, and the data ranks as a named axis.

[Note: per-rank keys]
Dropout, stochastic depth and other randomness inside a JAX loss want a key
that differs on every data rank (ranks that drew the same masks over
different rows would not be the samples one process of the global batch
draws), on every step and every micro-batch, and that a run resumed from a
checkpoint draws again. ``zero3(loss_fn, ..., key=jax.random.key(0))`` gives
the loss a keyword argument ``key``:

    loss_fn(params, batch, *, key)                 # -> loss
    loss_fn(params, batch, model_state, *, key)    # with a model state

where ``key`` is :func:`step_key` of the given key, the state's step count,
the data rank and the micro-batch: ``fold_in(fold_in(fold_in(key, step),
rank), micro_batch)``. The data rank counts the replicas (HSDP: replica
``r``'s rank ``k`` is ``r * S + k`` for ``S`` ranks a replica); the model
ranks of one data rank see the same batch and get the same key. The key is
configuration, as the learning rate is: the step count is in the state and
its checkpoints, so a run resumed with the same ``key=`` draws the same keys.
A typed key (``jax.random.key``) reaches the loss typed, a raw one
(``jax.random.PRNGKey``) raw; inside the step it travels as its raw data,
beside the batch, so every path (one program, the traced units of stage 3,
micro-batches) carries it unchanged. ``evaluate`` hands the loss the key of
the step's first micro-batch (a loss in eval mode draws nothing).

[Note: the data axis in the loss]
Under ``shard_map`` or ``pmap`` a JAX function names its devices' axis and
reduces over it: ``jax.lax.pmean(x, "data")``, ``psum``, ``axis_index``.
Models are written so; flax's ``BatchNorm(axis_name="data")`` takes the
statistics of the global batch that way (torch's ``SyncBatchNorm``). A
step given ``axis_name`` runs such a loss on its data ranks unchanged:
:func:`bind_axis` traces the loss with the name bound to the ranks' count
(``jax.make_jaxpr`` under the axis environment that ``shard_map`` binds its
mesh axes with), then evaluates the traced program equation by equation,
binding each primitive again except the collectives over that name: a
``psum`` becomes the step's all-reduce over the data ranks and
``axis_index`` the rank, both given by the caller. ``pmean`` is traced as a
``psum`` and a division by the axis size, so it needs nothing of its own.
Nested ``jax.jit`` calls are evaluated in place, so a collective inside a
jitted model is found too.

The derivative of the all-reduce is the all-reduce of its cotangent: the
step averages the ranks' gradients of their own losses, and the global
loss's gradient through ``y = sum_r x_r`` reaches ``x_r`` from every rank's
loss. Collectives that are not built (``pmax``, ``all_gather``,
``ppermute``, ...), a ``psum`` over this axis and another together, axis
index groups, and collectives inside ``lax.scan``, ``lax.cond``,
``jax.checkpoint`` or a custom derivative are refused with a
NotImplementedError naming the primitive, before the step runs.
"""

from __future__ import annotations

import contextlib
import re
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax
    from jax.extend.core import Jaxpr, JaxprEqn, Literal, Var
    from jax.typing import ArrayLike

__all__ = ["bind_axis", "check_key", "derived_key", "evaluate", "keyed", "named_axes_refused",
           "step_key", "unbound_axis"]


def check_key(name: str, key: object) -> tuple[np.ndarray, str | None]:
    """``key=``'s raw data (uint32, on the host) and its implementation's name
    (None for a raw key); a TypeError naming ``key=`` for anything else."""
    import jax

    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise TypeError(f"{name}: key= must be one key; got an array of keys of shape "
                            f"{key.shape}")
        return np.asarray(jax.random.key_data(key)), str(jax.random.key_impl(key))
    data = np.asarray(key) if isinstance(key, (jax.Array, np.ndarray)) else None
    if data is None or data.dtype != np.uint32 or data.ndim != 1:
        raise TypeError(f"{name}: key= must be a JAX PRNG key (jax.random.key(0), or a raw "
                        f"jax.random.PRNGKey(0)); got {type(key).__name__}"
                        f"{'' if data is None else f' of dtype {data.dtype}, shape {data.shape}'}")
    return data, None


def step_key(key: jax.Array, *, step: int, rank: int, micro_batch: int = 0) -> jax.Array:
    """The key a step hands its loss (see [Note: per-rank keys]): ``key``
    folded with the step count, the data rank and the micro-batch.

    Examples:
      >>> import jax, shard
      >>> k = shard.step_key(jax.random.key(0), step=3, rank=1)
      >>> bool((jax.random.key_data(k) != jax.random.key_data(
      ...     shard.step_key(jax.random.key(0), step=3, rank=0))).any())
      True
    """
    for what, v in (("step", step), ("rank", rank), ("micro_batch", micro_batch)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"step_key: {what} must be an int >= 0; got {v!r}")
    return _fold(key, np.asarray([step, rank, micro_batch], np.uint32))


def derived_key(data: np.ndarray, impl: str | None, *, step: int, rank: int,
                micro_batch: int) -> np.ndarray:
    """:func:`step_key` on raw key data: the derived key's raw data (host)."""
    import jax

    key = data if impl is None else _wrap_key(data, impl)
    out = _fold(key, np.asarray([step, rank, micro_batch], np.uint32))
    return np.asarray(out if impl is None else jax.random.key_data(out))


def _fold(key: jax.Array | np.ndarray, values: np.ndarray) -> jax.Array:
    import jax

    global _FOLD
    if _FOLD is None:
        _FOLD = jax.jit(lambda k, v: jax.random.fold_in(jax.random.fold_in(
            jax.random.fold_in(k, v[0]), v[1]), v[2]))
    return _FOLD(key, values)


_FOLD: Callable[[jax.Array | np.ndarray, np.ndarray], jax.Array] | None = None


def keyed(fn: Callable[..., object], impl: str | None) -> Callable[..., Any]:
    """``fn(params, batch, *rest, key=key)`` as a loss of ``(batch, raw key
    data)`` (and ``*rest``: a model state), the key rewrapped as typed where
    ``impl`` names one. One wrapper per ``(fn, impl)``, so the compiled
    programs of the loss are shared (see ``JaxLoss.shared``)."""
    with _LOCK:
        try:
            by_impl = _KEYED.setdefault(fn, {})
        except TypeError:  # cannot be weakly referenced: its own wrapper
            return _wrap(fn, impl)
        if impl not in by_impl:
            by_impl[impl] = _wrap(fn, impl)
        return by_impl[impl]


def _wrap(fn: Callable[..., object], impl: str | None) -> Callable[..., object]:
    def loss(params: object, batch_and_key: tuple[object, jax.Array], *rest: object) -> object:

        batch, data = batch_and_key
        key = data if impl is None else _wrap_key(data, impl)
        return fn(params, batch, *rest, key=key)

    return loss


_KEYED: weakref.WeakKeyDictionary[object, dict[str | None, Callable[..., object]]] = \
    weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


# -- the data axis (see [Note: the data axis in the loss]) --------------------
_CALLS = ("jit", "pjit", "closed_call", "core_call")
_SUMS = ("psum", "psum2", "psum_invariant")


def evaluate(jaxpr: Jaxpr, consts: list[ArrayLike], args: list[ArrayLike],
             rule: Callable[[JaxprEqn, list[ArrayLike]], list[ArrayLike] | None] | None = None
             ) -> list[ArrayLike]:
    """Evaluate ``jaxpr``, binding every primitive again except nested jit
    calls, whose bodies are evaluated in place, and the equations for which
    ``rule(eqn, inputs)`` returns the outputs itself. Traced by
    ``jax.make_jaxpr``, the result is the same program with those calls
    inlined and those equations replaced."""
    from jax.extend.core import Literal

    env: dict[Var, ArrayLike] = {}

    def read(v: Var | Literal) -> ArrayLike:
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = rule(eqn, ins) if rule is not None else None
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in _CALLS else None
        if outs is not None:
            pass
        elif inner is not None and hasattr(inner, "consts"):
            outs = evaluate(inner.jaxpr, list(inner.consts), ins, rule)
        else:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _names(params: dict[str, object]) -> set[Hashable]:
    """The axis names an equation's parameters mention."""
    out: set[Hashable] = set()
    for key in ("axes", "axis_name"):
        v = params.get(key)
        out.update(v if isinstance(v, (tuple, list)) else () if v is None else (v,))
    return out


def _jaxprs(params: dict[str, object]) -> list[Any]:
    """The jaxprs inside an equation's parameters (bodies, branches)."""
    out = []
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            j = getattr(x, "jaxpr", x)
            if hasattr(j, "eqns"):
                out.append(j)
    return out


def _uses(jaxpr: Jaxpr, name: str) -> JaxprEqn | None:
    """The first equation of ``jaxpr`` (nested ones included) that names the axis."""
    for eqn in jaxpr.eqns:
        if name in _names(eqn.params):
            return eqn
        for inner in _jaxprs(eqn.params):
            found = _uses(inner, name)
            if found is not None:
                return found
    return None


def bind_axis(fn: Callable[..., object], name: str, size: int, *, psum: Callable[[Any], Any],
              index: Callable[[], jax.Array], where: str) -> Callable[..., Any]:
    """``fn`` with ``name`` bound as an axis of ``size`` ranks (see the Note):
    its ``psum`` over the axis is ``psum(x)``, its ``axis_index`` is
    ``index()``. ``where`` names the step in errors."""
    import jax
    from jax._src.core import extend_axis_env_nd  # how shard_map binds its mesh axes

    def rule(eqn: JaxprEqn, ins: list[ArrayLike]) -> list[ArrayLike] | None:
        names = _names(eqn.params)
        prim = eqn.primitive.name
        if name not in names:
            if prim not in _CALLS:
                inner = next((e for j in _jaxprs(eqn.params) if (e := _uses(j, name))), None)
                if inner is not None:
                    raise NotImplementedError(
                        f"{where}: the loss reduces over axis {name!r} ({inner.primitive.name}) "
                        f"inside {prim}; only outside lax.scan, lax.cond, jax.checkpoint and "
                        "custom derivatives, or inside jax.jit")
            return None
        if prim in _SUMS and eqn.params.get("axis_index_groups") is None and names == {name}:
            return [psum(x) for x in ins]
        if prim == "axis_index":
            return [index()]
        other = sorted(map(str, names - {name}))
        detail = (f" over {name!r} and {other} at once" if other else
                  " with axis_index_groups" if eqn.params.get("axis_index_groups") else "")
        raise NotImplementedError(f"{where}: the loss calls {prim} over axis {name!r}{detail}; "
                                  f"the data ranks take psum, pmean and axis_index")

    def bound(*args: object, **kw: object) -> object:
        flat, tree = jax.tree_util.tree_flatten((args, kw))

        def flat_fn(*xs: jax.Array) -> object:
            a, k = jax.tree_util.tree_unflatten(tree, list(xs))
            return fn(*a, **k)

        with extend_axis_env_nd([(name, size)]):
            closed, shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat)
        outs = evaluate(closed.jaxpr, list(closed.consts), flat, rule)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs)

    return bound


def unbound_axis(e: NameError, where: str) -> NotImplementedError | None:
    """JAX's NameError for a loss that reduces over an axis no one bound, as a
    NotImplementedError that names the argument binding the data ranks (None
    for another NameError)."""
    if "unbound axis name" not in str(e):
        return None
    found = re.search(r"unbound axis name: ([^\s.]+)", str(e))
    name = found.group(1) if found else "?"
    return NotImplementedError(
        f"{where}: the loss reduces over axis {name!r}, which this step does not bind; "
        f"give the step axis_name={name!r} (zero0-3: options=shard.ZeroOptions(axis_name="
        f"{name!r})) to bind the data ranks to it (see [Note: the data axis in the loss])")


@contextlib.contextmanager
def named_axes_refused(where: str) -> Iterator[None]:
    """:func:`unbound_axis` around a block (a trace, run once)."""
    try:
        yield
    except NameError as e:
        refused = unbound_axis(e, where)
        if refused is None:
            raise
        raise refused from e


def _wrap_key(data: Any, impl: str) -> jax.Array:  # Any: numpy data, which jax's stubs refuse
    """A typed JAX key from raw key data (numpy, as JAX takes it)."""
    import jax

    return jax.random.wrap_key_data(data, impl=impl)
