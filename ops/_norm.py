"""Sums of squares and global norms, for clipping and overflow detection."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ops._tree import tree_leaves
from ops.device._arrays import array_kind, check_array, driver_for, xp_of
from ops.device._device import device_of

__all__ = ["exact_square_parts", "exact_square_total", "global_norm", "sum_of_squares"]


def sum_of_squares(x: Any, *, out: Any = None) -> Any:
    """The sum of squares of ``x``, accumulated in float64, as a one-element array.

    The result stays on ``x``'s device (no host synchronisation on a GPU) and is
    what :func:`ops.fused_adam_step` takes as ``grad_sumsq``: add the results of
    every shard (an all-reduce) for the global value. An inf or nan anywhere in
    ``x`` makes the result non-finite: that is the overflow flag of dynamic loss
    scaling. The order of additions is fixed for given sizes and device, so the
    result is reproducible.

    Args:
      x: a float32, bfloat16, float16 or float64 array (any shape,
        C-contiguous), or a pytree of them, summed together (one kernel call per
        dtype on the CPU; float64 by numpy).
      out: optional one-element float64 array to write into.

    Returns:
      ``out``, or a new one-element float64 array.

    Examples:
      >>> import numpy as np, ops
      >>> float(ops.sum_of_squares(np.array([3.0, 4.0], np.float32))[0])
      25.0
    """
    leaves = tree_leaves(x)
    if not leaves:
        raise ValueError("sum_of_squares: no arrays given")
    kind = array_kind(leaves[0])
    groups: dict[str, list[Any]] = {}
    for leaf in leaves:
        code = check_array("sum_of_squares", "x", leaf, dtypes=("f32", "bf16", "f16", "f64"),
                           kind=kind)
        groups.setdefault(code, []).append(leaf)
    xp = xp_of(leaves[0])
    if out is None:
        out = xp.zeros(1, dtype=np.float64)
    elif out.dtype != np.float64 or out.size != 1 or array_kind(out) != kind:
        raise TypeError(f"sum_of_squares: out must be a one-element float64 {kind} array; got "
                        f"{out.dtype} of shape {tuple(out.shape)}")
    driver = driver_for(kind)
    parts = [xp.zeros(1, dtype=np.float64) for _ in groups]
    for part, (code, xs) in zip(parts, groups.items(), strict=True):
        if code == "f64":  # exact, with the array module's pairwise summation
            for x in xs:
                part += xp.sum(xp.square(x))
        else:
            driver.sum_of_squares(xs, code, part)
    out[...] = sum(parts[1:], parts[0])
    return out


def global_norm(tree: Any) -> float:
    """The L2 norm of all leaves of a pytree together (as ``optax.global_norm``).

    Examples:
      >>> import numpy as np, ops
      >>> ops.global_norm({"a": np.array([3.0], np.float32), "b": np.array([4.0], np.float32)})
      5.0
    """
    return math.sqrt(float(sum_of_squares(tree)[0]))


# [Note: exact sums of squares]
# A sum of squares whose bits do not depend on how the array is split (over
# ranks, or into chunks): each float32 element x = m * 2**e (``frexp``, with
# M = m * 2**24 an integer below 2**24) has x**2 = M**2 * 2**(2e - 48), and
# M = H * 2**12 + L splits M**2 into H*H * 2**24 + 2*H*L * 2**12 + L*L, three
# integers below 2**25. Their sums per exponent e (``bincount``, exact in
# float64 while below 2**53: at most 2**27 elements a pass) are the parts, an
# int64 array; parts add exactly and in any order (over ranks: an integer
# all-reduce), and ``exact_square_total`` turns them into one float64, the
# same bits for the same elements however they were split. bfloat16 and
# float16 widen to float32 exactly; float64 is not taken. A non-finite element
# marks the last slot, and makes the total inf.

_EXPONENTS = 277  # frexp's exponents of float32: -148 (subnormals) to 128
_PASS = 1 << 27


def exact_square_parts(x: Any) -> np.ndarray:
    """The parts of ``x``'s sum of squares (see [Note: exact sums of squares]):
    an int64 host array that adds exactly with another array's parts.

    Args:
      x: a float32, bfloat16 or float16 array of any device, or a list of
        them (parts added together).

    Examples:
      >>> import numpy as np, ops
      >>> parts = ops.exact_square_parts([np.array([3.0], np.float32),
      ...                                 np.array([4.0], np.float32)])
      >>> ops.exact_square_total(parts)
      25.0
    """
    out = np.zeros(3 * _EXPONENTS + 1, np.int64)
    with np.errstate(invalid="ignore"):  # an inf element's parts are nan (marked below)
        _add_parts(x, out)
    return out


def _add_parts(x: Any, out: np.ndarray) -> None:
    for a in x if isinstance(x, (list, tuple)) else [x]:
        check_array("exact_square_parts", "x", a, dtypes=("f32", "bf16", "f16"))
        if not a.size:
            continue
        device = device_of(a)
        xp = device.xp
        flat = a.reshape(-1)
        for start in range(0, flat.size, _PASS):
            piece = flat[start:start + _PASS]
            piece = piece.astype(np.float32) if piece.dtype != np.float32 else piece
            m, e = xp.frexp(piece)
            big = m.astype(np.float64) * float(1 << 24)  # M, an integer below 2**24
            hi = xp.floor(big * (1.0 / 4096))
            lo = big - hi * 4096.0
            at = e.astype(np.int64) + 148
            for k, term in enumerate((hi * hi, 2.0 * hi * lo, lo * lo)):
                sums = xp.bincount(at, weights=term, minlength=_EXPONENTS)
                host = sums if device.host else device.to_host(sums)
                if not np.isfinite(host).all():  # an inf or nan element
                    out[-1] += 1
                    break
                out[k * _EXPONENTS:(k + 1) * _EXPONENTS] += host.astype(np.int64)


def exact_square_total(parts: np.ndarray) -> float:
    """The sum of squares whose parts (see :func:`exact_square_parts`) are
    ``parts``, as one float64: inf where an element was not finite."""
    parts = np.asarray(parts, np.int64)
    if parts[-1]:
        return math.inf
    total = 0
    for k, shift in enumerate((24, 12, 0)):
        for b in np.flatnonzero(parts[k * _EXPONENTS:(k + 1) * _EXPONENTS]):
            total += int(parts[k * _EXPONENTS + b]) << (shift + 2 * int(b))
    # x**2's exponent is 2 * (b - 148) - 48; the shifts above started at b = 0
    return math.ldexp(float(total), -2 * 148 - 48)
