"""``fused_adam_step``: one fused Adam/AdamW update of a flat buffer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ops._types import Array
from ops.device._arrays import array_kind, check_array, driver_for, xp_of
from ops.kernels._table import adam_kernel

__all__ = ["adam_scalars", "fused_adam_multi", "fused_adam_step", "grad_multiplier"]

_FN = "fused_adam_step"


def adam_scalars(*, step: int, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, decoupled: bool,
                 bias_correction: bool = True) -> dict[str, float]:
    """The kernel's host-side scalars, computed in float64 as torch does.

    Rounding ``1 - beta2`` in float32 instead moves every ``exp_avg_sq`` by 1e-5
    relative; so every derived constant is formed here and rounded once.
    """
    beta1, beta2 = betas
    bc1, bc2 = (1.0 - beta1**step, 1.0 - beta2**step) if bias_correction else (1.0, 1.0)
    return {
        "beta1": beta1, "beta2": beta2, "omb1": 1.0 - beta1, "omb2": 1.0 - beta2,
        "step_size": lr / bc1, "bc2_sqrt": math.sqrt(bc2),
        "eps": eps,
        "decay": 1.0 - lr * weight_decay if decoupled else 1.0,
        "l2": 0.0 if decoupled else weight_decay,
    }


def _check_hyper(step: object, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, fn: str = _FN, bias_correction: bool = True) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{fn}: step is the 1-based count of this update and must be an int "
                         f">= 1; got {step!r}")
    if not lr >= 0.0:
        raise ValueError(f"{fn}: lr must be >= 0; got {lr!r}")
    if bias_correction and (len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{fn}: betas must be two numbers in [0, 1); got {betas!r}")
    if len(betas) != 2 or not all(0.0 <= b <= 1.0 for b in betas):  # 1: a moment held
        raise ValueError(f"{fn}: betas must be two numbers in [0, 1]; got {betas!r}")
    if not eps >= 0.0 or not weight_decay >= 0.0:
        raise ValueError(f"{fn}: eps and weight_decay must be >= 0; got {eps!r}, {weight_decay!r}")


def fused_adam_step(param: Array, grad: Array, exp_avg: Array, exp_avg_sq: Array, *, step: int,
                    lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, decoupled: bool = True,
                    grad_scale: float | None = None, grad_sumsq: Array | None = None,
                    max_norm: float | None = None, param_copy: Array | None = None,
                    donate: bool = True,
                    read_from: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                    bias_correction: bool = True) -> tuple[Array, Array, Array]:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) update, fused.

    Reads param, grad and both moments once and writes param and moments once
    (28 bytes per fp32 parameter), with the mixed-precision chores folded into
    the same pass: unscaling by ``grad_scale``, global-norm clipping to
    ``max_norm``, skipping the whole update when ``grad_sumsq`` is not finite,
    and writing a bf16/fp16 copy of the new parameters into ``param_copy`` (the
    buffer the next all-gather sends). numpy arrays run the CPU build of
    ``ops/kernels/adam.cu``, cupy arrays the CUDA build of the same file.

    The math is torch.optim.Adam/AdamW's: ``g = grad * scale (+ wd * param)``,
    ``param *= 1 - lr * wd`` (AdamW), ``m = lerp(m, g, 1 - beta1)``,
    ``v = beta2 * v + (1 - beta2) * g * g``,
    ``param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.

    Args:
      param: float32 parameters (any shape, C-contiguous); float64 params (with
        float64 grads and moments) take an exact numpy path instead of a kernel.
      grad: gradients of param's shape, float32, bfloat16 or float16.
      exp_avg: the first moment, param's shape and dtype.
      exp_avg_sq: the second moment, param's shape and dtype.
      step: the 1-based index of this update (bias correction).
      lr: the learning rate, as torch.optim.AdamW's.
      betas: ``(beta1, beta2)``, as torch.optim.AdamW's.
      eps: as torch.optim.AdamW's.
      weight_decay: as torch.optim.AdamW's.
      decoupled: True for AdamW's decoupled decay, False for Adam's L2 term.
      grad_scale: multiplies the grads first, e.g. ``1 / loss_scale``.
      grad_sumsq: a one-element float64 array with the sum of squares of the
        grads as given (before ``grad_scale``), over every shard (see
        :func:`ops.sum_of_squares`). Non-finite means an overflow somewhere: the
        update is skipped and nothing is written. Read on the device, so a GPU
        step needs no host synchronisation.
      max_norm: clip the grads (after ``grad_scale``) to this global norm, as
        ``torch.nn.utils.clip_grad_norm_``; needs ``grad_sumsq``.
      param_copy: optional bfloat16/float16 array of param's shape that receives
        the new parameters, rounded to nearest even.
      donate: update param and the moments in place and return them (True), or
        leave the inputs untouched and return new arrays (False).
      read_from: host (numpy) arrays only: ``(param, exp_avg, exp_avg_sq)`` to
        read the old values from, while the new ones go to ``param``,
        ``exp_avg`` and ``exp_avg_sq``, whose contents are not read: an
        out-of-place update in the same single pass, equal bit for bit to the
        in-place one. A skipped update (``grad_sumsq`` not finite) writes
        nothing there either.
      bias_correction: False drops Adam's bias correction (DeepSpeed's
        ``FusedAdam(bias_correction=False)``, 1-bit Adam's update); a beta
        may then be 1, which keeps that moment as it is.

    Returns:
      ``(param, exp_avg, exp_avg_sq)`` after the update.

    Raises:
      TypeError: an argument of the wrong array type or dtype.
      ValueError: a shape mismatch, a non-contiguous or read-only buffer, or an
        invalid hyper-parameter.

    Examples:
      >>> import numpy as np, ops
      >>> p, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
      >>> m, v = np.zeros_like(p), np.zeros_like(p)
      >>> p, m, v = ops.fused_adam_step(p, g, m, v, step=1, lr=0.1)
      >>> [round(float(x), 4) for x in p]
      [0.9, 0.9, 0.9, 0.9]
    """
    _check_hyper(step, lr, betas, eps, weight_decay, bias_correction=bias_correction)
    _check_global(param, grad_sumsq, max_norm)
    codes, bufs = _check_tensor(param, grad, exp_avg, exp_avg_sq, param_copy, donate)
    if not donate:
        bufs = (bufs[0].copy(), bufs[1], bufs[2].copy(), bufs[3].copy(), bufs[4])
    scalars = _scalars(step, lr, betas, eps, weight_decay, decoupled, grad_scale, grad_sumsq,
                       max_norm, bias_correction)
    p, g, m, v, c = bufs
    if read_from is not None:
        src = _check_sources(read_from, p, "f64" if codes[0] == "f64" else "f32")
        if codes[0] == "f64":
            for dst, old in zip((p, m, v), src, strict=True):
                np.copyto(dst, old)
        else:
            driver_for("numpy").adam_from(adam_kernel(*codes), src,
                                          (p, g, m, v, c, p.size, *scalars))
            return p, m, v
    if codes[0] == "f64":
        _adam_float64(p, g, m, v, scalars)
    else:
        driver_for(array_kind(p)).elementwise(adam_kernel(*codes), p.size,
                                              (p, g, m, v, c, p.size, *scalars))
    return p, m, v


def fused_adam_multi(params: Sequence[Array], grads: Sequence[Array],
                     exp_avgs: Sequence[Array], exp_avg_sqs: Sequence[Array], *, step: int,
                     lr: float,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                     weight_decay: float = 0.0, decoupled: bool = True,
                     grad_scale: float | None = None, grad_sumsq: Array | None = None,
                     max_norm: float | None = None,
                     param_copies: Sequence[Array | None] | None = None,
                     donate: bool = True, bias_correction: bool = True
                     ) -> tuple[list[Array], list[Array], list[Array]]:
    """:func:`fused_adam_step` over many tensors at once.

    Tensors sharing grad and copy dtypes go through one call: on the CPU one
    thread team (the per-call start-up and per-tensor load imbalance of a loop
    of single calls cost 10% at ~100 tensors), on a GPU one launch over a device
    table of the tensors' pointers (as torch's ``multi_tensor_apply``), so the
    launch count does not grow with the number of tensors.
    Arguments are those of :func:`fused_adam_step`, as sequences.

    Returns:
      ``(params, exp_avgs, exp_avg_sqs)`` as lists.
    """
    _check_hyper(step, lr, betas, eps, weight_decay, bias_correction=bias_correction)
    n = len(params)
    copies = list(param_copies) if param_copies is not None else [None] * n
    if not len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(copies) == n:
        raise ValueError(f"{_FN}: params, grads, moments and copies must be as many; got "
                         f"{n}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}, {len(copies)}")
    if n == 0:
        return [], [], []
    _check_global(params[0], grad_sumsq, max_norm)
    groups: dict[tuple[str, str], list[tuple]] = {}
    out = []
    for p, g, m, v, c in zip(params, grads, exp_avgs, exp_avg_sqs, copies, strict=True):
        codes, bufs = _check_tensor(p, g, m, v, c, donate, kind=array_kind(params[0]))
        if not donate:
            bufs = (bufs[0].copy(), bufs[1], bufs[2].copy(), bufs[3].copy(), bufs[4])
        groups.setdefault(codes, []).append(bufs)
        out.append(bufs)
    scalars = _scalars(step, lr, betas, eps, weight_decay, decoupled, grad_scale, grad_sumsq,
                       max_norm, bias_correction)
    driver = driver_for(array_kind(params[0]))
    for codes, tensors in groups.items():
        if codes[0] == "f64":
            for p, g, m, v, _ in tensors:
                _adam_float64(p, g, m, v, scalars)
            continue
        driver.adam_multi(adam_kernel(*codes), tensors, scalars)
    return [t[0] for t in out], [t[2] for t in out], [t[3] for t in out]


def _check_sources(read_from: object, param: Array, pcode: str) -> tuple[Any, ...]:
    if array_kind(param) != "numpy":
        raise TypeError(f"{_FN}: read_from is for host (numpy) arrays; got "
                        f"{array_kind(param)} params")
    if not isinstance(read_from, (tuple, list)) or len(read_from) != 3:
        raise TypeError(f"{_FN}: read_from must be (param, exp_avg, exp_avg_sq)")
    for name, x in zip(("param", "exp_avg", "exp_avg_sq"), read_from, strict=True):
        check_array(_FN, f"read_from's {name}", x, dtypes=(pcode,), shape=tuple(param.shape),
                    kind="numpy")
    return tuple(read_from)


def _check_global(param: Array, grad_sumsq: Array | None, max_norm: float | None,
                  fn: str = _FN) -> None:
    kind = array_kind(param)
    if grad_sumsq is not None:
        if grad_sumsq.dtype != np.float64 or grad_sumsq.size != 1:
            raise TypeError(f"{fn}: grad_sumsq must be a one-element float64 array (from "
                            f"ops.sum_of_squares); got {grad_sumsq.dtype} of shape "
                            f"{tuple(grad_sumsq.shape)}")
        if array_kind(grad_sumsq) != kind:
            raise TypeError(f"{fn}: grad_sumsq must be a {kind} array like param")
    if max_norm is not None and (grad_sumsq is None or not max_norm > 0):
        raise ValueError(f"{fn}: max_norm={max_norm!r} needs max_norm > 0 and grad_sumsq, "
                         "the global sum of squares of the grads")


def _check_tensor(param: Array, grad: Array, exp_avg: Array, exp_avg_sq: Array,
                  param_copy: Array | None,
                  donate: bool, kind: str | None = None, fn: str = _FN
                  ) -> tuple[tuple[str, str], tuple]:
    kind = kind or array_kind(param)
    shape = tuple(param.shape)
    pcode = check_array(fn, "param", param, dtypes=("f32", "f64"), writeable=donate, kind=kind)
    gdtypes = ("f64",) if pcode == "f64" else ("f32", "bf16", "f16")
    gcode = check_array(fn, "grad", grad, dtypes=gdtypes, shape=shape, kind=kind)
    for name, x in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        check_array(fn, name, x, dtypes=(pcode,), shape=shape, writeable=donate, kind=kind)
    ccode = "none"
    if param_copy is not None and pcode == "f64":
        raise NotImplementedError(f"{fn}: param_copy needs float32 params (a 16-bit copy of "
                                  "float64 masters is not supported)")
    if param_copy is not None:
        ccode = check_array(fn, "param_copy", param_copy, dtypes=("bf16", "f16"), shape=shape,
                            writeable=True, kind=kind)
    return (gcode, ccode), (param, grad, exp_avg, exp_avg_sq, param_copy)


def grad_multiplier(sumsq: float | Array | None, grad_scale: float,
                    max_norm: float) -> float | None:
    """What the fused kernels multiply the grads by (``optim.cuh``'s prologue, on
    the host): ``grad_scale``, times torch's clip coefficient when ``max_norm``
    > 0; None where ``sumsq`` (a number, a one-element array or None) is not
    finite, and the update is skipped."""
    if sumsq is None:
        return grad_scale
    s = float(np.asarray(sumsq).reshape(-1)[0])
    if not math.isfinite(s):
        return None
    if max_norm > 0:
        return grad_scale * min(1.0, max_norm / (math.sqrt(s) * grad_scale + 1e-6))
    return grad_scale


def _adam_float64(p: Array, g: Array, m: Array, v: Array, scalars: tuple) -> None:
    """The kernel's arithmetic in float64 with numpy, for float64 params (exact
    references and tight tests; the CUDA/CPU kernels are float32)."""
    (sumsq, beta1, beta2, omb1, omb2, step_size, bc2_sqrt, eps, decay, l2, grad_scale,
     max_norm) = scalars
    xp = xp_of(p)
    mul = grad_multiplier(sumsq, grad_scale, max_norm)
    if mul is None:
        return
    gi = g * mul + l2 * p
    p *= decay
    d = gi - m
    m[...] = m + omb1 * d if omb1 < 0.5 else gi - d * beta1
    v[...] = v * beta2 + omb2 * gi * gi
    p -= step_size * (m / (xp.sqrt(v) / bc2_sqrt + eps))


def _scalars(step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
             decoupled: bool, grad_scale: float | None, grad_sumsq: Array | None,
             max_norm: float | None, bias_correction: bool = True) -> tuple:
    """The kernel's arguments from ``sumsq`` on (see ops/kernels/_table.py)."""
    s = adam_scalars(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                     decoupled=decoupled, bias_correction=bias_correction)  # float64, rounded
    # once by the kernels, to float32
    return (grad_sumsq, s["beta1"], s["beta2"], s["omb1"], s["omb2"], s["step_size"],
            s["bc2_sqrt"], s["eps"], s["decay"], s["l2"],
            1.0 if grad_scale is None else grad_scale, 0.0 if max_norm is None else max_norm)
