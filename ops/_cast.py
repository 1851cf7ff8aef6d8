"""Casts between float32 and bfloat16/float16, round to nearest even."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ops._types import Array, tree_map
from ops.device._arrays import array_kind, check_array, driver_for, dtype_code, xp_of
from ops.kernels._table import cast_kernel

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = ["cast"]


def _cast_leaf(x: Array, dtype: np.dtype, out: Array | None) -> Array:
    kind = array_kind(x)
    src = check_array("cast", "x", x, dtypes=("f32", "bf16", "f16"))
    dst = dtype_code(dtype)
    if dst not in ("f32", "bf16", "f16") or (src == "f32") == (dst == "f32"):
        raise NotImplementedError(f"cast: converts float32 <-> bfloat16/float16; got {x.dtype} "
                                  f"-> {dtype}")
    if out is None:
        out = xp_of(x).empty(x.shape, dtype=dtype)
    else:
        check_array("cast", "out", out, dtypes=(dst,), shape=x.shape, writeable=True, kind=kind)
    driver_for(kind).elementwise(cast_kernel(src, dst), x.size, (x, out, x.size))
    return out


def cast(tree: object, dtype: DTypeLike, *, out: object = None) -> Any:
    """Cast every leaf of a pytree between float32 and bfloat16/float16.

    Rounds to nearest even (NaN stays NaN, overflow goes to inf), with the same
    kernel source on CPU and GPU. Leaves already of ``dtype`` are returned as
    they are.

    Args:
      tree: a pytree of float32, bfloat16 or float16 arrays.
      dtype: the target dtype (``np.float32``, ``ml_dtypes.bfloat16``, ``np.float16``).
      out: optional pytree of output arrays with the same structure.

    Examples:
      >>> import numpy as np, ml_dtypes, ops
      >>> ops.cast(np.array([1.0, 1.00390625], np.float32), ml_dtypes.bfloat16).tolist()
      [1.0, 1.0]
    """
    dtype = np.dtype(dtype)

    def one(x: Array, o: Array | None = None) -> Array:
        if np.dtype(x.dtype) == dtype and o is None:
            return x
        return _cast_leaf(x, dtype, o)

    if out is None:
        return tree_map(one, tree)
    return tree_map(one, tree, out)
