"""Adam, AdamW, Lion and LAMB shaped like optax's ``GradientTransformation``.

``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``
are pure, as in optax, so a ``FusedOptimizer`` can stand where an optax
optimizer does. ``apply(grads, state, params) -> (params, state)`` is the fast
path the ZeRO transforms use: it donates params and moments and updates them in
place, one fused kernel call over every leaf (every flat unit buffer, in
``shard``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ops._adam import fused_adam_multi, fused_adam_step
from ops._lamb import Reduce, fused_lamb
from ops._lion import fused_lion
from ops._types import Array, tree_util
from ops.device._arrays import xp_of

if TYPE_CHECKING:
    from jax.tree_util import PyTreeDef

__all__ = ["AdamState", "FusedAdam", "FusedOptimizer", "LionState", "adam", "adamw", "lamb", "lion"]

Schedule = Callable[[int], float]


class AdamState(NamedTuple):
    """Adam's state: ``count`` updates applied so far, moments ``mu`` and ``nu``."""

    count: np.ndarray  # type: ignore[assignment]  # optax's name; shadows tuple.count
    mu: Any
    nu: Any


class LionState(NamedTuple):
    """Lion's state: ``count`` updates applied so far and its moment ``mu``."""

    count: np.ndarray  # type: ignore[assignment]  # optax's name; shadows tuple.count
    mu: Any


class OneBit(NamedTuple):
    """What a ZeRO step needs of 1-bit Adam (``ops.onebit_adam``): the updates
    before its compressed phase, and the momentum's ``b1``."""

    freeze_step: int
    b1: float


class ZeroOne(NamedTuple):
    """What a ZeRO step needs of 0/1 Adam (``ops.zero_one_adam``): its schedule
    (see [Note: 0/1 Adam] in ``ops/_zeroone.py``) and the update's constants."""

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    b1: float
    eps: float
    weight_decay: float


class FusedOptimizer(NamedTuple):
    """An optax-shaped optimizer with a donating fused ``apply``.

    ``learning_rate(count)`` is the rate the update after ``count`` updates
    uses; ``moments`` names the param-shaped parts of its state (the ZeRO
    transforms keep each in flat unit buffers laid out like the masters), and
    ``state(count, *moments)`` builds its state from them. ``per_tensor``:
    the update reduces over each whole leaf (LAMB's trust ratio), so its
    ``apply`` takes each leaf as a tensor and a ``reduce=`` that sums the
    per-leaf sums of a leaf split over ranks. ``onebit``: 1-bit Adam's
    (``ops.onebit_adam``) :class:`OneBit`: after ``freeze_step`` updates the
    ZeRO step sends the momentum compressed instead of the gradients (see
    [Note: 1-bit Adam] in ``ops/_onebit.py``); or 0/1 Adam's
    (``ops.zero_one_adam``) :class:`ZeroOne` (see [Note: 0/1 Adam] in
    ``ops/_zeroone.py``); None for every other optimizer.
    """

    init: Callable[[Any], AdamState | LionState]
    update: Callable[..., tuple[Any, AdamState | LionState]]
    apply: Callable[..., tuple[Any, AdamState | LionState]]
    learning_rate: Callable[[int], float]
    moments: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    state: Callable[..., AdamState | LionState] = AdamState
    per_tensor: bool = False
    onebit: OneBit | ZeroOne | None = None


FusedAdam = FusedOptimizer  # what ops.adam and ops.adamw return, by its first name


def _number(fn: str, name: str, value: float, lo: float, hi: float, *, lo_open: bool = False,
            hi_open: bool = False) -> float:
    """``value`` as a float in the range, or a TypeError/ValueError naming it."""
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError
        x = float(value)  # numbers, and numpy, jax or torch scalars
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: {name} must be a number; got {type(value).__name__} "
                        f"{value!r}") from None
    below = x <= lo if lo_open else x < lo
    above = x >= hi if hi_open else x > hi
    if math.isnan(x) or below or above:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"{fn}: {name} must be in {interval}; got {value!r}")
    return x


def _adam_hyper(fn: str, b1: float, b2: float, eps: float,
                weight_decay: float) -> tuple[float, float, float, float]:
    """An Adam-shaped optimizer's ``b1`` and ``b2`` in [0, 1), ``eps`` and
    ``weight_decay`` >= 0, as floats (a TypeError or ValueError naming one)."""
    return (_number(fn, "b1", b1, 0.0, 1.0, hi_open=True),
            _number(fn, "b2", b2, 0.0, 1.0, hi_open=True),
            _number(fn, "eps", eps, 0.0, math.inf, hi_open=True),
            _number(fn, "weight_decay", weight_decay, 0.0, math.inf, hi_open=True))


def _rate(fn: str, learning_rate: float | Schedule) -> Callable[[int], float]:
    """``count -> lr`` for a float or a schedule, the float checked here."""
    if not callable(learning_rate):
        learning_rate = _number(fn, "learning_rate", learning_rate, 0.0, math.inf,
                                hi_open=True)

    def lr_at(count: int) -> float:
        return float(learning_rate(count) if callable(learning_rate) else learning_rate)

    return lr_at


def _zeros(params: object) -> object:
    """A float32 (float64 for float64 params) zero moment shaped like ``params``."""
    return tree_util().tree_map(lambda p: xp_of(p).zeros(
        p.shape, dtype=np.float64 if p.dtype == np.float64 else np.float32), params)


def _adam_init(params: object) -> AdamState:
    """Adam's (and LAMB's) fresh state: count 0, zero moments like ``params``."""
    zeros = _zeros(params)
    return AdamState(np.zeros((), np.int64), zeros, tree_util().tree_map(lambda z: z.copy(), zeros))


def _flat_update(grads: object, state: AdamState, params: object, copies: object,
                 grad_sumsq: Array | None,
                 finite: bool | None) -> tuple | None:
    """An Adam-shaped update's leaves, ``(leaves, treedef, grads, mu, nu,
    copies)`` flattened alike; None where ``grad_sumsq`` is not finite (read
    back to the host unless ``finite`` says), so nothing is updated."""
    if grad_sumsq is not None and finite is None:  # a host read of the device value
        finite = math.isfinite(float(grad_sumsq[0]))
    if finite is False:
        return None
    leaves, treedef = tree_util().tree_flatten(params)
    g, m, v = (treedef.flatten_up_to(t) for t in (grads, state.mu, state.nu))
    c = treedef.flatten_up_to(copies) if copies is not None else None
    return leaves, treedef, g, m, v, c


def _adam_out(treedef: PyTreeDef, out: tuple[list[Array], list[Array], list[Array]],
              count: int) -> tuple[object, AdamState]:
    """An Adam-shaped update's new params and state from ``fused_adam_multi``'s
    flat ``(params, exp_avgs, exp_avg_sqs)``."""
    new_p, new_m, new_v = (treedef.unflatten(x) for x in out)
    return new_p, AdamState(np.asarray(count + 1, np.int64), new_m, new_v)


def _optax_update(name: str, needs: str,
                  run: Callable[..., tuple[object, AdamState | LionState]]
                  ) -> Callable[..., tuple[object, AdamState | LionState]]:
    """optax's ``update(grads, state, params) -> (updates, state)``, out of place,
    from a fused optimizer's ``run(grads, state, params, donate, grad_scale,
    grad_sumsq, max_norm, copies)``; ``needs``: what it reads params for."""

    def update(grads: object, state: AdamState | LionState,
               params: object = None) -> tuple[object, AdamState | LionState]:
        if params is None:
            raise ValueError(f"{name}.update needs params ({needs} and the fused update): "
                             "update(grads, state, params)")
        new_params, new_state = run(grads, state, params, False, None, None, None, None)
        return tree_util().tree_map(lambda new, old: new - old, new_params, params), new_state

    return update


def _make(learning_rate: float | Schedule, b1: float, b2: float, eps: float,
          weight_decay: float, decoupled: bool) -> FusedOptimizer:
    fn = "adamw" if decoupled else "adam"
    lr_at = _rate(fn, learning_rate)
    b1, b2, eps, weight_decay = _adam_hyper(fn, b1, b2, eps, weight_decay)

    def run(grads: object, state: AdamState, params: object, donate: bool, grad_scale: float | None,
            grad_sumsq: Array | None, max_norm: float | None, copies: object,
            finite: bool | None = None, read_from: Any = None) -> tuple[object, AdamState]:
        count = int(state.count)
        flat = _flat_update(grads, state, params, copies, grad_sumsq, finite)
        if flat is None:
            return params, state  # overflow: nothing changes, the step is not counted
        leaves, treedef, g, m, v, c = flat
        if read_from is not None:  # out of place, leaf by leaf (host arrays)
            old = [treedef.flatten_up_to(t) for t in read_from]
            for i, leaf in enumerate(leaves):
                fused_adam_step(leaf, g[i], m[i], v[i], step=count + 1, lr=lr_at(count),
                                betas=(b1, b2), eps=eps, weight_decay=weight_decay,
                                decoupled=decoupled, grad_scale=grad_scale,
                                grad_sumsq=grad_sumsq, max_norm=max_norm,
                                param_copy=c[i] if c is not None else None,
                                read_from=(old[0][i], old[1][i], old[2][i]))
            return params, AdamState(np.asarray(count + 1, np.int64), state.mu, state.nu)
        return _adam_out(treedef, fused_adam_multi(
            leaves, g, m, v, step=count + 1, lr=lr_at(count), betas=(b1, b2), eps=eps,
            weight_decay=weight_decay, decoupled=decoupled, grad_scale=grad_scale,
            grad_sumsq=grad_sumsq, max_norm=max_norm, param_copies=c, donate=donate), count)

    update = _optax_update(fn, "for weight decay", run)

    def apply(grads: object, state: AdamState, params: object, *, grad_scale: float | None = None,
              grad_sumsq: Array | None = None, max_norm: float | None = None,
              param_copies: object = None, finite: bool | None = None,
              read_from: object = None) -> tuple[object, AdamState]:
        """Update params and moments in place (both donated); see fused_adam_step.

        With ``grad_sumsq``, a non-finite value skips the update (the count does
        not advance); it is read back to the host to decide unless the caller
        says it knows: ``finite=True`` (or False) saves that read on a GPU.
        ``read_from``: host arrays only, ``(params, mu, nu)`` trees like
        ``params`` to read the old values from; ``params`` and ``state``'s
        moments then only receive the new ones (out of place, one pass).
        """
        return run(grads, state, params, True, grad_scale, grad_sumsq, max_norm, param_copies,
                   finite, read_from)

    return FusedOptimizer(_adam_init, update, apply, lr_at)


def adamw(learning_rate: float | Schedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 1e-2) -> FusedOptimizer:
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW`` / ``optax.adamw``.

    Args:
      learning_rate: a float >= 0, or a schedule ``count -> lr`` (count from 0),
        such as an optax schedule.
      b1: in [0, 1), as ``torch.optim.AdamW``'s first beta.
      b2: in [0, 1), as its second.
      eps: >= 0.
      weight_decay: >= 0, decoupled.

    A TypeError or ValueError naming the argument is raised here, not at the
    first step.

    Examples:
      >>> import numpy as np, ops
      >>> opt = ops.adamw(1e-3)
      >>> params = {"w": np.ones(3, np.float32)}
      >>> state = opt.init(params)
      >>> params, state = opt.apply({"w": np.ones(3, np.float32)}, state, params)
      >>> int(state.count)
      1
    """
    return _make(learning_rate, b1, b2, eps, weight_decay, decoupled=True)


def adam(learning_rate: float | Schedule, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-8, weight_decay: float = 0.0) -> FusedOptimizer:
    """Adam with torch.optim.Adam's L2 weight decay (added to the gradient)."""
    return _make(learning_rate, b1, b2, eps, weight_decay, decoupled=False)




def lion(learning_rate: float | Schedule, b1: float = 0.9, b2: float = 0.99,
         weight_decay: float = 1e-3) -> FusedOptimizer:
    """Lion (Chen et al., 2023), as ``optax.lion``: the sign of an interpolated
    momentum, with decoupled weight decay, in one fused pass per call
    (:func:`ops.fused_lion`): one moment, 20 bytes per fp32 param against
    Adam's 28.

    Args:
      learning_rate: a float >= 0 or a schedule ``count -> lr``; Lion wants a
        rate 3-10x smaller than AdamW's.
      b1: the interpolation of the update's sign, b2: the moment's decay, both
        in [0, 1]; weight_decay >= 0 (multiplied by the rate, as optax's).

    Examples:
      >>> import numpy as np, ops
      >>> opt = ops.lion(0.1, weight_decay=0.0)
      >>> params = {"w": np.ones(2, np.float32)}
      >>> state = opt.init(params)
      >>> params, state = opt.apply({"w": np.array([2.0, -3.0], np.float32)}, state, params)
      >>> [round(float(x), 4) for x in params["w"]], int(state.count)
      ([0.9, 1.1], 1)
    """
    fn = "lion"
    lr_at = _rate(fn, learning_rate)
    b1 = _number(fn, "b1", b1, 0.0, 1.0)
    b2 = _number(fn, "b2", b2, 0.0, 1.0)
    weight_decay = _number(fn, "weight_decay", weight_decay, 0.0, math.inf, hi_open=True)

    def init(params: object) -> LionState:
        return LionState(np.zeros((), np.int64), _zeros(params))

    def run(grads: object, state: LionState, params: object, donate: bool, grad_scale: float | None,
            grad_sumsq: Array | None, max_norm: float | None, copies: object,
            finite: bool | None = None,
            read_from: object = None) -> tuple[object, LionState]:
        if read_from is not None:
            raise NotImplementedError("lion: read_from (the host tier's out-of-place "
                                      "update) is Adam's only")
        count = int(state.count)
        if grad_sumsq is not None and finite is None:  # a host read of the device value
            finite = math.isfinite(float(grad_sumsq[0]))
        if finite is False:
            return params, state
        leaves, treedef = tree_util().tree_flatten(params)
        g, m = treedef.flatten_up_to(grads), treedef.flatten_up_to(state.mu)
        if not donate:
            leaves, m = [x.copy() for x in leaves], [x.copy() for x in m]
        fused_lion(leaves, g, m, lr=lr_at(count), betas=(b1, b2), weight_decay=weight_decay,
                   grad_scale=grad_scale, grad_sumsq=grad_sumsq, max_norm=max_norm,
                   param_copies=treedef.flatten_up_to(copies) if copies is not None else None)
        return treedef.unflatten(leaves), LionState(np.asarray(count + 1, np.int64),
                                                    treedef.unflatten(m))

    update = _optax_update("lion", "for weight decay", run)

    def apply(grads: object, state: LionState, params: object, *, grad_scale: float | None = None,
              grad_sumsq: Array | None = None, max_norm: float | None = None,
              param_copies: object = None, finite: bool | None = None,
              read_from: object = None) -> tuple[object, LionState]:
        """Update params and the moment in place (donated), as Adam's ``apply``."""
        return run(grads, state, params, True, grad_scale, grad_sumsq, max_norm, param_copies,
                   finite, read_from)

    return FusedOptimizer(init, update, apply, lr_at, ("exp_avg",), LionState)


def lamb(learning_rate: float | Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         eps_root: float = 0.0, weight_decay: float = 0.0, *,
         trust_clip: tuple[float, float] | None = None,
         bias_correction: bool = True) -> FusedOptimizer:
    """LAMB (You et al., 2020), as ``optax.lamb``: Adam's direction plus
    decoupled weight decay, scaled per leaf by the trust ratio ``|p| / |u|``,
    in two fused passes per call (:func:`ops.fused_lamb`). Under ZeRO each
    leaf's norms are summed over the ranks that hold its rows, so the update
    is the single-process one.

    Args:
      learning_rate: a float >= 0 or a schedule ``count -> lr``.
      b1: in [0, 1); optax's default.
      b2: in [0, 1); optax's default.
      eps: >= 0; optax's default.
      eps_root: >= 0; optax's default.
      weight_decay: >= 0; optax's default.
      trust_clip: ``(min, max)`` bounds of the trust ratio (DeepSpeed's
        ``min_coeff`` / ``max_coeff``), or None for optax's unbounded ratio.
      bias_correction: False drops Adam's bias correction (DeepSpeed's flag).

    Examples:
      >>> import numpy as np, ops
      >>> opt = ops.lamb(0.1)
      >>> params = {"w": np.full(4, 2.0, np.float32)}
      >>> params, state = opt.apply({"w": np.ones(4, np.float32)}, opt.init(params), params)
      >>> [round(float(x), 4) for x in params["w"]], int(state.count)
      ([1.8, 1.8, 1.8, 1.8], 1)
    """
    fn = "lamb"
    lr_at = _rate(fn, learning_rate)
    b1, b2, eps, weight_decay = _adam_hyper(fn, b1, b2, eps, weight_decay)
    eps_root = _number(fn, "eps_root", eps_root, 0.0, math.inf, hi_open=True)
    if trust_clip is not None:
        lo = _number(fn, "trust_clip's min", trust_clip[0], 0.0, math.inf, hi_open=True)
        trust_clip = (lo, _number(fn, "trust_clip's max", trust_clip[1], lo, math.inf,
                                  lo_open=lo == 0.0, hi_open=True))

    def run(grads: object, state: AdamState, params: object, donate: bool, grad_scale: float | None,
            grad_sumsq: Array | None, max_norm: float | None, copies: object,
            finite: bool | None = None,
            read_from: object = None, reduce: Reduce | None = None) -> tuple[object, AdamState]:
        if read_from is not None:
            raise NotImplementedError("lamb: read_from (the host tier's out-of-place update) "
                                      "is Adam's only")
        count = int(state.count)
        if grad_sumsq is not None and finite is None:  # a host read of the device value
            finite = math.isfinite(float(grad_sumsq[0]))
        if finite is False:
            return params, state
        leaves, treedef = tree_util().tree_flatten(params)
        g, m, v = (treedef.flatten_up_to(t) for t in (grads, state.mu, state.nu))
        if not donate:
            leaves, m, v = ([x.copy() for x in xs] for xs in (leaves, m, v))
        fused_lamb(leaves, g, m, v, step=count + 1, lr=lr_at(count), betas=(b1, b2), eps=eps,
                   eps_root=eps_root, weight_decay=weight_decay, trust_clip=trust_clip,
                   bias_correction=bias_correction, grad_scale=grad_scale, grad_sumsq=grad_sumsq,
                   max_norm=max_norm, reduce=reduce,
                   param_copies=treedef.flatten_up_to(copies) if copies is not None else None)
        return treedef.unflatten(leaves), AdamState(np.asarray(count + 1, np.int64),
                                                    treedef.unflatten(m), treedef.unflatten(v))

    update = _optax_update("lamb", "for the trust ratio", run)

    def apply(grads: object, state: AdamState, params: object, *, grad_scale: float | None = None,
              grad_sumsq: Array | None = None, max_norm: float | None = None,
              param_copies: object = None, finite: bool | None = None, read_from: object = None,
              reduce: Reduce | None = None) -> tuple[object, AdamState]:
        """Update params and moments in place (donated), as Adam's ``apply``; each
        leaf is one tensor for the trust ratio, ``reduce`` as
        :func:`ops.fused_lamb`'s."""
        return run(grads, state, params, True, grad_scale, grad_sumsq, max_norm, param_copies,
                   finite, read_from, reduce)

    return FusedOptimizer(_adam_init, update, apply, lr_at, ("exp_avg", "exp_avg_sq"),
                          AdamState, per_tensor=True)
