"""Arrays of other frameworks at the edge of ``ops``: torch tensors and jax
arrays become numpy (CPU) or cupy (CUDA) arrays through DLPack, zero-copy, and
results go back to the caller's framework the same way.

bfloat16 has no numpy DLPack code, so it crosses as 16-bit integers and is
re-viewed as ``ml_dtypes.bfloat16`` on the numpy side (still zero-copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ops._arrays import BF16

__all__ = ["to_native"]


def _identity(x: Any) -> Any:
    return x


def _from_torch(t: Any) -> tuple[Any, Callable[[Any], Any]]:
    import torch

    bf16 = t.dtype == torch.bfloat16
    src = t.detach().view(torch.int16) if bf16 else t.detach()
    if t.device.type == "cuda":  # pragma: no cover - needs a GPU
        import cupy

        native = cupy.from_dlpack(src)
    else:
        native = np.from_dlpack(src)
    if bf16:
        native = native.view(BF16)

    def back(a: Any) -> Any:
        if a.dtype == BF16:
            return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(a)

    return native, back


def _from_jax(x: Any) -> tuple[Any, Callable[[Any], Any]]:
    import jax
    import jax.numpy as jnp

    native = np.asarray(x)  # zero-copy for CPU arrays; bf16 arrives as ml_dtypes

    def back(a: Any) -> Any:
        if a.dtype == BF16:
            return jax.lax.bitcast_convert_type(jnp.from_dlpack(a.view(np.uint16)), jnp.bfloat16)
        return jnp.from_dlpack(a)

    return native, back


def to_native(x: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``(native array, back)``: x as numpy/cupy, and a function returning x's kind."""
    if isinstance(x, np.ndarray) or type(x).__module__.split(".")[0] == "cupy":
        return x, _identity
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return _from_torch(x)
    if module in ("jax", "jaxlib"):
        return _from_jax(x)
    raise TypeError(f"expected a numpy, cupy, torch or jax array; got {type(x).__qualname__}")
