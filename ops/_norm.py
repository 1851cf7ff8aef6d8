"""Sums of squares and global norms, for clipping and overflow detection."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ops._arrays import array_kind, check_array, driver_for, xp_of
from ops._tree import tree_leaves

__all__ = ["global_norm", "sum_of_squares"]


def sum_of_squares(x: Any, *, out: Any = None) -> Any:
    """The sum of squares of ``x``, accumulated in float64, as a one-element array.

    The result stays on ``x``'s device (no host synchronisation on a GPU) and is
    what :func:`ops.fused_adam_step` takes as ``grad_sumsq``: add the results of
    every shard (an all-reduce) for the global value. An inf or nan anywhere in
    ``x`` makes the result non-finite: that is the overflow flag of dynamic loss
    scaling. The order of additions is fixed for a given size and device, so the
    result is reproducible.

    Args:
      x: a float32, bfloat16 or float16 array (any shape, C-contiguous).
      out: optional one-element float64 array to write into.

    Returns:
      ``out``, or a new one-element float64 array.

    Example:
      >>> import numpy as np, ops
      >>> float(ops.sum_of_squares(np.array([3.0, 4.0], np.float32))[0])
      25.0
    """
    kind = array_kind(x)
    code = check_array("sum_of_squares", "x", x, dtypes=("f32", "bf16", "f16"))
    if out is None:
        out = xp_of(x).zeros(1, dtype=np.float64)
    elif out.dtype != np.float64 or out.size != 1 or array_kind(out) != kind:
        raise TypeError(f"sum_of_squares: out must be a one-element float64 {kind} array; got "
                        f"{out.dtype} of shape {tuple(out.shape)}")
    driver_for(kind).sum_of_squares(x, code, out)
    return out


def global_norm(tree: Any) -> float:
    """The L2 norm of all leaves of a pytree together (as ``optax.global_norm``).

    Example:
      >>> import numpy as np, ops
      >>> ops.global_norm({"a": np.array([3.0], np.float32), "b": np.array([4.0], np.float32)})
      5.0
    """
    total = 0.0
    for leaf in tree_leaves(tree):
        total += float(sum_of_squares(leaf)[0])
    return math.sqrt(total)
