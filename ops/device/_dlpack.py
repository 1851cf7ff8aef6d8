"""Arrays of other frameworks at the edge of ``ops``, through DLPack.

torch tensors and jax arrays become arrays of the device they live on (numpy
on the CPU, cupy on a GPU; see [Note: devices]), zero-copy, and results go
back to the caller's framework the same way. bfloat16 has no numpy DLPack
code, so it crosses as 16-bit integers and is re-viewed on the other side:
:func:`torch_view` and :func:`jax_view` are the one place that does it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ops._types import Array
from ops.device._arrays import BF16
from ops.device._device import HOST, Device, cupy_device, device_of_or_none

if TYPE_CHECKING:
    import jax
    import torch

__all__ = ["host_copy", "jax_view", "to_native", "torch_view"]

_T = TypeVar("_T")


def torch_view(a: Array) -> torch.Tensor:
    """A torch tensor over a numpy, cupy or stand-in array's memory."""
    import torch

    bf16 = a.dtype == BF16
    if bf16:
        a = a.view(np.int16)
    # numpy through from_numpy: DLPack refuses read-only numpy memory.
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
    return t.view(torch.bfloat16) if bf16 else t


def jax_view(a: Any) -> jax.Array:  # Any: reads a CuPy array's .data.ptr
    """A jax array over a numpy, cupy or stand-in array's memory (JAX copies
    host buffers that are not 64-byte aligned; device buffers that are not are
    copied here, as XLA refuses them)."""
    import jax
    import jax.numpy as jnp

    if not isinstance(a, np.ndarray) and a.data.ptr % 64:
        a = a.copy()  # XLA on GPUs takes only aligned device buffers (a leaf's view may not be)
    if a.dtype == BF16:
        return jax.lax.bitcast_convert_type(jnp.from_dlpack(a.view(np.uint16)), jnp.bfloat16)
    return jnp.from_dlpack(a)


def _identity(x: _T) -> _T:
    return x


def _torch_device(t: torch.Tensor) -> Device:
    return cupy_device() if t.device.type == "cuda" else HOST


def _jax_device(x: jax.Array) -> Device:
    platforms = {d.platform for d in x.devices()}
    return HOST if platforms == {"cpu"} else cupy_device()


def to_native(x: Any) -> tuple[Array, Callable[[Array], Array | torch.Tensor | jax.Array]]:
    """``(native array, back)``: x as an array of its device, and a function
    returning an array of that device as x's kind."""
    if device_of_or_none(x) is not None:
        return x, _identity
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return _torch_device(x).from_torch(x), torch_view
    if module in ("jax", "jaxlib"):
        return _jax_device(x).from_jax(x), jax_view
    raise TypeError(f"expected a numpy, cupy, torch or jax array; got {type(x).__qualname__}")


def host_copy(x: object) -> np.ndarray:
    """A numpy copy of ``x`` (a number, or an array of numpy, a device, torch or
    jax), copied explicitly where it lives on a device."""
    if isinstance(x, (np.ndarray, np.generic, int, float, bool)):
        return np.array(x)
    native = to_native(x)[0]
    device = device_of_or_none(native) or HOST
    return np.array(native) if device.host else device.to_host(native)
