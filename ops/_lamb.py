"""``fused_lamb``: the LAMB update of many tensors in two fused passes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ops._adam import _check_global, _check_hyper, _check_tensor, grad_multiplier
from ops._types import Array
from ops.device._arrays import array_kind, driver_for, xp_of
from ops.kernels._table import lamb_kernels

__all__ = ["fused_lamb"]

_FN = "fused_lamb"
Reduce = Callable[[Array], Array | None]


def fused_lamb(params: Sequence[Array], grads: Sequence[Array], exp_avgs: Sequence[Array],
               exp_avg_sqs: Sequence[Array], *, step: int, lr: float,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
               eps_root: float = 0.0, weight_decay: float = 0.0,
               trust_clip: tuple[float, float] | None = None, bias_correction: bool = True,
               grad_scale: float | None = None, grad_sumsq: Array | None = None,
               max_norm: float | None = None,
               param_copies: Sequence[Array | None] | None = None,
               reduce: Reduce | None = None) -> tuple[list[Array], list[Array], list[Array]]:
    """One LAMB update of each ``(param, grad, exp_avg, exp_avg_sq)``, in place,
    as ``optax.lamb`` computes it: Adam's moments and bias-corrected direction
    ``u = m_hat / (sqrt(v_hat + eps_root) + eps) + weight_decay * p``, scaled per
    tensor by the trust ratio ``|p| / |u|`` (1 where either norm is 0), so
    ``p -= lr * ratio * u``. Two passes (``ops/kernels/lamb.cu``): the moments
    and each tensor's sums of squares of ``u`` and ``p`` (24 bytes per fp32
    param), then the params (16 bytes), with :func:`ops.fused_adam_step`'s
    chores folded in: unscaling by ``grad_scale``, global-norm clipping to
    ``max_norm``, the skip when ``grad_sumsq`` is not finite, and the 16-bit
    ``param_copies``. numpy arrays run the CPU build, cupy arrays the CUDA
    build, all tensors in one call or launch per pass; float64 params take an
    exact numpy path.

    Each ``params[k]`` is one tensor for the trust ratio. Where a tensor is
    split over ranks (ZeRO), ``reduce`` makes the ratio the whole tensor's:
    it is called between the passes with the ``(len(params), 2)`` float64
    array of each tensor's local sums (``u``, ``p``) on the params' device and
    returns (or fills in) the whole tensors' sums.

    Args:
      params: sequences of buffers as :func:`ops.fused_adam_multi`'s, one
        grad dtype and one copy dtype in a call.
      grads: as params.
      exp_avgs: as params.
      exp_avg_sqs: as params.
      step: the 1-based count of this update (bias correction).
      lr: the learning rate; betas, eps, eps_root, weight_decay: optax.lamb's
        (its defaults: eps 1e-6, no weight decay).
      trust_clip: ``(min, max)`` bounds of the ratio, as DeepSpeed's FusedLamb
        ``min_coeff`` / ``max_coeff``; None (optax) leaves it unbounded.
      bias_correction: False drops Adam's bias correction (DeepSpeed's option).
      grad_scale: as :func:`ops.fused_adam_multi`'s.
      grad_sumsq: as :func:`ops.fused_adam_multi`'s.
      max_norm: as :func:`ops.fused_adam_multi`'s.
      param_copies: as :func:`ops.fused_adam_multi`'s.
      reduce: the sums over ranks of split tensors, or None.

    Examples:
      >>> import numpy as np, ops
      >>> p, g = np.full(4, 2.0, np.float32), np.ones(4, np.float32)
      >>> m, v = np.zeros(4, np.float32), np.zeros(4, np.float32)
      >>> _ = ops.fused_lamb([p], [g], [m], [v], step=1, lr=0.1)
      >>> [round(float(x), 4) for x in p]  # |p| / |u| = 2: a step of 0.1 * 2
      [1.8, 1.8, 1.8, 1.8]

    Returns:
      ``(params, exp_avgs, exp_avg_sqs)`` as lists.
    """
    _check_hyper(step, lr, betas, eps, weight_decay, _FN)
    if not eps_root >= 0.0:
        raise ValueError(f"{_FN}: eps_root must be >= 0; got {eps_root!r}")
    if trust_clip is not None and not (len(trust_clip) == 2
                                       and 0.0 <= trust_clip[0] <= trust_clip[1]
                                       and trust_clip[1] > 0.0):
        raise ValueError(f"{_FN}: trust_clip must be (min, max) with 0 <= min <= max and "
                         f"max > 0; got {trust_clip!r}")
    n = len(params)
    copies = list(param_copies) if param_copies is not None else [None] * n
    if not len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(copies) == n:
        raise ValueError(f"{_FN}: params, grads, moments and copies must be as many; got {n}, "
                         f"{len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}, {len(copies)}")
    if n == 0:
        return [], [], []
    _check_global(params[0], grad_sumsq, max_norm, _FN)
    kind = array_kind(params[0])
    tensors, codes = [], set()
    for p, g, m, v, c in zip(params, grads, exp_avgs, exp_avg_sqs, copies, strict=True):
        code, bufs = _check_tensor(p, g, m, v, c, True, kind=kind, fn=_FN)
        codes.add(code)
        tensors.append(bufs)
    if len(codes) > 1:
        raise TypeError(f"{_FN}: every tensor of a call needs the same grad and copy dtypes; got "
                        f"{sorted(codes)}")
    b1, b2 = betas
    bc1, bc2 = (1.0 - b1**step, 1.0 - b2**step) if bias_correction else (1.0, 1.0)
    lo, hi = trust_clip if trust_clip is not None else (0.0, 0.0)
    scalars = (grad_sumsq, b1, b2, 1.0 - b1, 1.0 - b2, 1.0 / bc1, 1.0 / bc2, eps, eps_root,
               weight_decay, lr, lo, hi, 1.0 if grad_scale is None else grad_scale,
               0.0 if max_norm is None else max_norm)
    sums = xp_of(params[0]).zeros((n, 2), dtype=np.float64)
    (gcode, ccode), = codes
    if gcode == "f64":
        _lamb_float64(tensors, scalars, sums, reduce)
    else:
        stats, finish, apply = lamb_kernels(gcode, ccode)
        driver = driver_for(kind)
        driver.lamb_stats(stats, finish, tensors, scalars, sums)
        if reduce is not None:
            sums = _reduced(reduce, sums)
        driver.lamb_apply(apply, tensors, scalars, sums)
    return list(params), list(exp_avgs), list(exp_avg_sqs)


def _reduced(reduce: Reduce, sums: Array) -> Array:
    out = reduce(sums)
    out = sums if out is None else out
    if tuple(out.shape) != tuple(sums.shape) or out.dtype != np.float64:
        raise TypeError(f"{_FN}: reduce must return the {tuple(sums.shape)} float64 sums; got "
                        f"{out.dtype} of shape {tuple(out.shape)}")
    return out


def _lamb_float64(tensors: list[tuple], scalars: tuple, sums: Array,
                  reduce: Reduce | None) -> None:
    """The kernels' arithmetic in float64 with numpy, for float64 params."""
    (sumsq, b1, b2, omb1, omb2, inv_bc1, inv_bc2, eps, eps_root, wd, lr, lo, hi, grad_scale,
     max_norm) = scalars
    mul = grad_multiplier(sumsq, grad_scale, max_norm)
    if mul is None:
        return

    def direction(p: np.ndarray, m: np.ndarray, v: np.ndarray) -> np.ndarray:
        return (m * inv_bc1) / (np.sqrt(v * inv_bc2 + eps_root) + eps) + wd * p

    for k, (p, g, m, v, _) in enumerate(tensors):
        gi = g * mul
        m[...] = omb1 * gi + b1 * m
        v[...] = omb2 * (gi * gi) + b2 * v
        u = direction(p, m, v)
        sums[k] = (np.sum(u * u), np.sum(p * p))
    if reduce is not None:
        sums = _reduced(reduce, sums)
    for k, (p, _, m, v, _) in enumerate(tensors):
        p += -lr * (direction(p, m, v) * _ratio(sums[k], lo, hi))


def _ratio(sums: Array, lo: float, hi: float) -> float:
    un, pn = math.sqrt(sums[0]), math.sqrt(sums[1])
    if pn == 0.0 or un == 0.0:
        return 1.0
    r = pn / un
    return min(max(r, lo), hi) if hi > 0.0 else r
