"""Zero-copy bridges between numpy, torch, jax and cupy arrays (DLPack).

Every bridge shares memory when the memory allows it and says so when it does
not, instead of copying behind the caller's back:

- non-contiguous input raises unless ``copy=True`` (DLPack consumers such as
  JAX refuse strides they cannot express);
- read-only numpy memory raises when the target would be writable (torch
  wraps read-only memory as writable without a word: a write through it would
  change memory the owner believes constant);
- bfloat16 crosses as 16-bit integers and is re-viewed on the other side
  (numpy's DLPack has no bf16 code); unsupported dtypes raise TypeError.
- JAX copies any host buffer that is not 64-byte aligned: ``to_jax`` reports
  whether it could share (``shares_memory``), and ``ops.aligned_empty`` makes
  buffers it can.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ops import BF16, HOST, device_of
from ops.device._device import device_of_or_none
from ops.device._dlpack import jax_view, to_native, torch_view

if TYPE_CHECKING:
    import jax
    import torch

__all__ = ["data_ptr", "shares_memory", "to_cupy", "to_jax", "to_numpy", "to_torch"]

_SUPPORTED = {np.dtype(d) for d in (np.float64, np.float32, np.float16, np.int64, np.int32,
                                    np.int16, np.int8, np.uint8, np.bool_)} | {BF16}


def _kind(x: object) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__.split(".")[0]
    if module in ("torch", "cupy"):
        return module
    device = device_of_or_none(x)
    if device is not None and not device.host:  # a device's array that is not CuPy's:
        return "cupy"  # the strict stand-in (ops.testing), read as CuPy's
    if module in ("jax", "jaxlib"):
        return "jax"
    raise TypeError(f"expected a numpy, torch, jax or cupy array; got {type(x).__qualname__}")


def data_ptr(x: Any) -> int:
    """The address of ``x``'s first element, whatever its framework."""
    kind = _kind(x)
    if kind == "numpy":
        return x.ctypes.data
    if kind == "torch":
        return x.data_ptr()
    if kind == "jax":
        return x.unsafe_buffer_pointer()
    return x.data.ptr


def shares_memory(a: object, b: object) -> bool:
    """Whether two arrays (of any frameworks) start at the same address."""
    return data_ptr(a) == data_ptr(b)


def _contiguous(name: str, x: np.ndarray, copy: bool) -> np.ndarray:
    if x.flags.c_contiguous:
        return x
    if not copy:
        raise ValueError(f"{name}: the array is not C-contiguous (strides {x.strides}); pass "
                         "copy=True to copy it, or np.ascontiguousarray first")
    return np.ascontiguousarray(x)


def to_numpy(x: Any, *, copy: bool = False) -> np.ndarray:
    """A numpy array over ``x``'s memory (CPU torch tensors and jax arrays)."""
    kind = _kind(x)
    if kind == "numpy":
        return _contiguous("to_numpy", x, copy)
    if kind == "torch":

        if x.device.type != "cpu":
            raise ValueError(f"to_numpy: the tensor is on {x.device}; use to_cupy for GPU memory")
        if not x.is_contiguous() and not copy:
            raise ValueError("to_numpy: the tensor is not contiguous; pass copy=True")
        return HOST.from_torch(x)
    if kind == "jax":
        platforms = {d.platform for d in x.devices()}
        if platforms != {"cpu"}:  # np.asarray would copy it to the host without a word
            raise ValueError(f"to_numpy: the jax array is on {', '.join(sorted(platforms))}; "
                             "use to_cupy for GPU memory, or jax.device_get to copy it")
        return np.asarray(x)  # zero-copy on the CPU; read-only, as jax arrays are immutable
    raise TypeError("to_numpy: a cupy array lives on the GPU; use cupy.asnumpy to copy it")


def to_torch(x: Any, *, copy: bool = False) -> torch.Tensor:
    """A torch tensor over ``x``'s memory (numpy, jax or cupy)."""
    import torch

    kind = _kind(x)
    if kind == "torch":
        return x
    if kind == "jax":
        return torch.from_dlpack(x)
    if kind == "cupy":  # pragma: no cover - needs a GPU
        return torch.from_dlpack(x)
    a = _contiguous("to_torch", x, copy)
    if a.dtype not in _SUPPORTED:
        raise TypeError(f"to_torch: dtype {a.dtype} has no torch equivalent")
    if not a.flags.writeable:
        if not copy:
            raise ValueError("to_torch: the numpy array is read-only, and torch would wrap it as "
                             "writable; pass copy=True (or make it writeable)")
        a = a.copy()
    return torch_view(a)


def to_jax(x: Any, *, copy: bool = False) -> jax.Array:
    """A jax array over ``x``'s memory where JAX accepts it (64-byte aligned)."""
    import jax.numpy as jnp

    kind = _kind(x)
    if kind == "jax":
        return x
    if kind == "cupy":  # DLPack on the GPU (bfloat16 too; unaligned views copied there)
        return jax_view(x)
    if kind == "torch":
        x = to_numpy(x, copy=copy)
    a = _contiguous("to_jax", x, copy) if isinstance(x, np.ndarray) else x
    if isinstance(a, np.ndarray):
        if a.dtype not in _SUPPORTED:
            raise TypeError(f"to_jax: dtype {a.dtype} has no jax equivalent")
        import jax

        if a.dtype.itemsize == 8 and not jax.config.read("jax_enable_x64"):
            if not copy:
                raise TypeError(f"to_jax: JAX would narrow {a.dtype} to 32 bits (a copy) "
                                "because jax_enable_x64 is off; enable it, or pass copy=True")
            return jnp.asarray(a)
        if a.dtype == BF16:  # through torch, whose DLPack has bf16 (zero-copy both hops)
            return jnp.from_dlpack(to_torch(a))
    return jnp.from_dlpack(a)


def to_cupy(x: object) -> Any:  # pragma: no cover - needs a GPU
    """A cupy array over a GPU tensor's memory (bfloat16 included)."""
    native, _ = to_native(x)
    if device_of(native).name != "cupy":
        raise TypeError(f"to_cupy: the {_kind(x)} array is in host memory; copy it with "
                        "cupy.asarray")
    return native
