"""Sums of squares and global norms, for clipping and overflow detection."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ops._tree import tree_leaves
from ops.device._arrays import array_kind, check_array, driver_for, xp_of

__all__ = ["global_norm", "sum_of_squares"]


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
