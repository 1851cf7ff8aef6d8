"""Arrays of other frameworks at the edge of ``ops``, through DLPack.

torch tensors and jax arrays become arrays of the device they live on (numpy
on the CPU, cupy on a GPU; see [Note: devices]), zero-copy, and results go
back to the caller's framework the same way. bfloat16 has no numpy DLPack
code, so it crosses as 16-bit integers and is re-viewed on the other side:
:func:`torch_view` and :func:`jax_view` are the one place that does it.
"""

from __future__ import annotations

import functools
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

    if isinstance(a, np.ndarray):
        load = _host_import()
    else:
        load = jnp.from_dlpack
        if a.data.ptr % 64:
            a = a.copy()  # XLA on GPUs takes only aligned device buffers (a leaf's view may not be)
    if a.dtype == BF16:
        return jax.lax.bitcast_convert_type(load(a.view(np.uint16)), jnp.bfloat16)
    return load(a)


@functools.cache
def _host_import() -> Callable[[np.ndarray], jax.Array]:
    """How :func:`jax_view` imports a numpy array: JAX's own DLPack import
    onto the CPU device, without what ``jnp.from_dlpack`` asks on each call
    (the CPU device's stream, which it answers with an exception, and the
    dtype's canonical form; 9 against 62 us for a small array). Where this
    JAX has no such import, or it fails on a probe, ``jnp.from_dlpack``."""
    import jax
    import jax.numpy as jnp

    try:
        from jax._src.lib import _jax, jaxlib_extension_version

        to_buffer = _jax.dlpack_managed_tensor_to_buffer
    except (ImportError, AttributeError):
        return jnp.from_dlpack
    cpu = jax.local_devices(backend="cpu")[0]
    # types JAX keeps as they are with or without x64 (64-bit ones take
    # jnp.from_dlpack, which converts them where x64 is off)
    kept = {np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16,
                                  np.uint32, np.float16, np.float32, np.complex64)}
    extra = (1,) if jaxlib_extension_version >= 467 else ()  # DLPack's code for the CPU

    def load(a: np.ndarray) -> jax.Array:
        if a.dtype not in kept:
            return jnp.from_dlpack(a)
        return to_buffer(a.__dlpack__(), cpu, None, None, *extra)

    probe = np.arange(3, dtype=np.float32)
    try:  # the signature this JAX was seen with, and its answer
        same = np.array_equal(np.asarray(load(probe)), probe)
    except Exception:  # any failure of a private call: take the public one
        same = False
    return load if same else jnp.from_dlpack


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
