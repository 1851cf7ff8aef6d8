"""``fused_lion``: the Lion update of many flat buffers in one fused pass."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ops._adam import _check_global, _check_tensor, grad_multiplier
from ops._types import Array
from ops.device._arrays import array_kind, driver_for
from ops.kernels._table import lion_kernel

__all__ = ["fused_lion"]

_FN = "fused_lion"


def fused_lion(params: Sequence[Array], grads: Sequence[Array], exp_avgs: Sequence[Array], *,
                     lr: float, betas: tuple[float, float] = (0.9, 0.99),
                     weight_decay: float = 0.0, grad_scale: float | None = None,
                     grad_sumsq: Array | None = None, max_norm: float | None = None,
                     param_copies: Sequence[Array | None] | None = None
                     ) -> tuple[list[Array], list[Array]]:
    """One Lion update of each ``(param, grad, exp_avg)``, in place: ``optax.lion``'s
    ``p -= lr * (sign(b1 * m + (1 - b1) * g) + wd * p)``, ``m = b2 * m + (1 - b2) * g``,
    in one pass (20 bytes per fp32 parameter) with :func:`ops.fused_adam_step`'s
    chores folded in: unscaling by ``grad_scale``, global-norm clipping to
    ``max_norm``, the skip when ``grad_sumsq`` is not finite, and the 16-bit
    ``param_copies``. numpy arrays run the CPU build of ``ops/kernels/lion.cu``,
    cupy arrays its CUDA build, all tensors in one call or launch; float64
    params (with float64 grads and moment) take an exact numpy path.

    Args:
      params: sequences of flat or shaped buffers, as
        :func:`ops.fused_adam_multi`'s.
      grads: as params.
      exp_avgs: as params (the moment is param's dtype).
      lr: the learning rate; betas: ``(b1, b2)``, optax's defaults (0.9, 0.99);
        weight_decay: decoupled, as ``optax.lion``'s (scaled by lr).
      grad_scale: as :func:`ops.fused_adam_multi`'s.
      grad_sumsq: as :func:`ops.fused_adam_multi`'s.
      max_norm: as :func:`ops.fused_adam_multi`'s.
      param_copies: as :func:`ops.fused_adam_multi`'s.

    Examples:
      >>> import numpy as np, ops
      >>> p, m = np.ones(3, np.float32), np.zeros(3, np.float32)
      >>> g = np.array([1, -1, 0], np.float32)
      >>> _ = ops.fused_lion([p], [g], [m], lr=0.1)
      >>> [round(float(x), 2) for x in p]
      [0.9, 1.1, 1.0]

    Returns:
      ``(params, exp_avgs)`` as lists.
    """
    if not lr >= 0.0:
        raise ValueError(f"{_FN}: lr must be >= 0; got {lr!r}")
    if len(betas) != 2 or not all(0.0 <= b <= 1.0 for b in betas):
        raise ValueError(f"{_FN}: betas must be two numbers in [0, 1]; got {betas!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"{_FN}: weight_decay must be >= 0; got {weight_decay!r}")
    n = len(params)
    copies = list(param_copies) if param_copies is not None else [None] * n
    if not len(grads) == len(exp_avgs) == len(copies) == n:
        raise ValueError(f"{_FN}: params, grads, moments and copies must be as many; got "
                         f"{n}, {len(grads)}, {len(exp_avgs)}, {len(copies)}")
    if n == 0:
        return [], []
    _check_global(params[0], grad_sumsq, max_norm, _FN)
    groups: dict[tuple[str, str], list[tuple]] = {}
    for p, g, m, c in zip(params, grads, exp_avgs, copies, strict=True):
        codes, (p, g, m, _, c) = _check_tensor(p, g, m, m, c, True, kind=array_kind(params[0]),
                                               fn=_FN)
        groups.setdefault(codes, []).append((p, g, m, None, c))
    b1, b2 = betas
    scalars = (grad_sumsq, b1, b2, 1.0 - b1, 1.0 - b2, lr, 0.0, 0.0, weight_decay, 0.0,
               1.0 if grad_scale is None else grad_scale, 0.0 if max_norm is None else max_norm)
    driver = driver_for(array_kind(params[0]))
    for codes, tensors in groups.items():
        if codes[0] == "f64":
            for p, g, m, _, _ in tensors:
                _lion_float64(p, g, m, scalars)
            continue
        driver.adam_multi(lion_kernel(*codes), tensors, scalars)
    return list(params), list(exp_avgs)


def _lion_float64(p: Array, g: Array, m: Array, scalars: tuple) -> None:
    """The kernel's arithmetic in float64 with numpy, for float64 params."""
    sumsq, b1, b2, omb1, omb2, lr, _, _, wd, _, grad_scale, max_norm = scalars
    mul = grad_multiplier(sumsq, grad_scale, max_norm)
    if mul is None:
        return
    gi = g * mul
    c = b1 * m + omb1 * gi
    p += -lr * (np.sign(c) + wd * p)
    m[...] = b2 * m + omb2 * gi
