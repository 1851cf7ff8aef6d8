"""Block-quantised int8 arrays (ZeRO++'s qwZ): :func:`quantize_blocks` and
:func:`dequantize_blocks`, one kernel source for the CPU and the GPU
(``ops/kernels/quant.cu``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ops.device._arrays import array_kind, check_array, driver_for, dtype_code
from ops.device._device import device_of
from ops.kernels._table import QUANT_GROUP, TABLE

__all__ = ["dequantize_blocks", "quantize_blocks"]


def quantize_blocks(x: Any) -> tuple[Any, Any]:
    """``x`` (flat) as int8 values and one float32 scale per block of 256
    elements: ``scale = amax / 127`` for the block's
    largest ``|x|``, ``q = rint(x / scale)``. :func:`dequantize_blocks` reads
    each element back within ``scale / 2`` of it (plus the rounding of one
    float32 product). The same bits on the CPU and on a GPU.

    Args:
      x: a finite float32, bfloat16 or float16 array (C-contiguous; read as
        flat), on any device.

    Returns:
      ``(q, scales)``: an int8 array of ``x.size`` and a float32 array of
      ``ceil(x.size / 256)``, on ``x``'s device.

    Examples:
      >>> import numpy as np, ops
      >>> q, scales = ops.quantize_blocks(np.array([0.5, -1.0, 0.25], np.float32))
      >>> q.tolist(), scales.dtype, scales.size
      ([64, -127, 32], dtype('float32'), 1)
    """
    code = check_array("quantize_blocks", "x", x, dtypes=("f32", "bf16", "f16"))
    xp = device_of(x).xp
    q = xp.empty(x.size, dtype=np.int8)
    scales = xp.empty(-(-x.size // QUANT_GROUP), dtype=np.float32)
    if x.size:
        driver_for(array_kind(x)).elementwise(TABLE[f"zs_quantize_{code}"], x.size,
                                              (x.reshape(-1), q, scales, x.size))
    return q, scales


def dequantize_blocks(q: Any, scales: Any, dtype: Any = np.float32, *, out: Any = None) -> Any:
    """The values :func:`quantize_blocks` kept: ``q * scale`` of each block, as
    ``dtype`` (float32, bfloat16 or float16; rounded to nearest even).

    Args:
      q: the int8 values (flat).
      scales: their float32 scales, one per block of 256.
      dtype: the output's dtype.
      out: optional flat output of ``q.size`` elements of ``dtype``.

    Examples:
      >>> import numpy as np, ops
      >>> x = np.array([0.5, -1.0, 0.25], np.float32)
      >>> q, scales = ops.quantize_blocks(x)
      >>> bool(np.abs(ops.dequantize_blocks(q, scales) - x).max() <= scales[0] / 2)
      True
    """
    kind = array_kind(q)
    if np.dtype(q.dtype) != np.int8 or np.dtype(scales.dtype) != np.float32:
        raise TypeError(f"dequantize_blocks: q must be int8 and scales float32; got {q.dtype} "
                        f"and {scales.dtype}")
    if scales.size != -(-q.size // QUANT_GROUP) or array_kind(scales) != kind:
        raise ValueError(f"dequantize_blocks: {q.size} values need "
                         f"{-(-q.size // QUANT_GROUP)} scales on their device; got "
                         f"{scales.size} on {array_kind(scales)}")
    code = dtype_code(dtype)
    if code not in ("f32", "bf16", "f16"):
        raise TypeError(f"dequantize_blocks: dtype must be float32, bfloat16 or float16; got "
                        f"{np.dtype(dtype)}")
    if out is None:
        out = device_of(q).xp.empty(q.size, dtype=np.dtype(dtype))
    else:
        check_array("dequantize_blocks", "out", out, dtypes=(code,), shape=(q.size,),
                    writeable=True, kind=kind)
    if q.size:
        driver_for(kind).elementwise(TABLE[f"zs_dequantize_{code}"], q.size,
                                     (q, scales, out, q.size))
    return out
