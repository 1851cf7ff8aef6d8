"""Sums of squares and global norms, for clipping and overflow detection."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ops._types import Array, tree_leaves
from ops.device._arrays import array_kind, check_array, driver_for, xp_of
from ops.device._device import device_of
from ops.kernels._table import EXACT_SLOTS

__all__ = ["exact_square_parts", "exact_square_total", "global_norm", "sum_of_squares"]


def sum_of_squares(x: object, *, out: Array | None = None) -> Any:
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


def global_norm(tree: object) -> float:
    """The L2 norm of all leaves of a pytree together (as ``optax.global_norm``).

    Examples:
      >>> import numpy as np, ops
      >>> ops.global_norm({"a": np.array([3.0], np.float32), "b": np.array([4.0], np.float32)})
      5.0
    """
    return math.sqrt(float(sum_of_squares(tree)[0]))


# [Note: exact sums of squares]
# A sum of squares whose bits do not depend on how the array is split (over
# ranks, chunks, blocks or threads): an element x = M * 2**(e - 150), e its
# biased float32 exponent (1 for zeros and subnormals) and M below 2**24, has
# x**2 = (H * 2**24 + L) * 2**(2e - 300), H and L the high and low 24 bits of
# M*M. The kernels (``ops/kernels/reduce.cu``) sum H and L for each e as
# integers, and count non-finite elements: the parts, EXACT_SLOTS int64s that
# add exactly and in any order (over ranks: an integer sum), from which
# ``exact_square_total`` makes one float64, the same bits for the same elements
# however they were split. bfloat16 and float16 widen to float32 exactly;
# float64 is not taken. A non-finite element makes the total inf.


def exact_square_parts(x: Array | list[Array] | tuple[Array, ...]) -> np.ndarray:
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
    leaves = list(x) if isinstance(x, (list, tuple)) else [x]
    out = np.zeros(EXACT_SLOTS, np.int64)
    if not leaves:
        return out
    kind = array_kind(leaves[0])
    groups: dict[str, list[Any]] = {}
    for leaf in leaves:
        code = check_array("exact_square_parts", "x", leaf, dtypes=("f32", "bf16", "f16"),
                           kind=kind)
        if leaf.size:
            groups.setdefault(code, []).append(leaf.reshape(-1))
    device = device_of(leaves[0])
    on = out if device.host else device.xp.zeros(EXACT_SLOTS, dtype=np.int64)
    for code, xs in groups.items():
        driver_for(kind).sum_of_squares(xs, code, on, exact=True)
    return out if device.host else device.to_host(on)


def exact_square_total(parts: np.ndarray) -> float:
    """The sum of squares whose parts (see :func:`exact_square_parts`) are
    ``parts``, as one float64: inf where an element was not finite."""
    parts = np.asarray(parts, np.int64)
    if parts[-1]:
        return math.inf
    total = 0
    for e in np.flatnonzero(parts[:256] | parts[256:512]):
        total += (int(parts[e]) << 24) + int(parts[256 + e]) << (2 * int(e))
    return math.ldexp(float(total), -300)  # x**2 of exponent e is M*M * 2**(2e - 300)
