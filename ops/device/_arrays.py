"""Array kinds, dtype codes and argument checks shared by the kernels' callers.

numpy arrays run the CPU build of a kernel, device arrays (cupy, or the stand-in
of :mod:`ops.testing`) the CUDA build (see [Note: devices]). bf16 is
``ml_dtypes.bfloat16`` (the dtype JAX uses for numpy arrays).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from ops.device._device import device_named, device_of
from ops.kernels._dtypes import BF16

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ops.kernels._cpu import CpuDriver
    from ops.kernels._cuda import CudaDriver

__all__ = ["BF16", "array_kind", "check_array", "dtype_code", "xp_of"]

_CODES = {np.dtype(np.float32): "f32", BF16: "bf16", np.dtype(np.float16): "f16",
          np.dtype(np.float64): "f64"}  # f64: exact numpy paths (the kernels are fp32)
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def array_kind(x: object) -> str:
    """The name of ``x``'s device (see [Note: devices]); a TypeError for non-arrays."""
    return device_of(x).name


def xp_of(x: object) -> types.ModuleType | types.SimpleNamespace:
    """The array module (numpy, cupy, or the device stand-in's) of ``x``."""
    return device_of(x).xp


def dtype_code(dtype: DTypeLike) -> str | None:
    """``"f32"``, ``"bf16"``, ``"f16"`` or ``"f64"`` for the supported dtypes, else None."""
    return _CODES.get(np.dtype(dtype))


def dtype_of_code(code: str) -> np.dtype:
    return _DTYPES[code]


def check_array(fn: str, name: str, x: Any, *, dtypes: tuple[str, ...], shape: tuple | None = None,
                writeable: bool = False, kind: str | None = None) -> str:
    """Validate one kernel argument; return its dtype code (``x`` is Any: any
    value is checked, and numpy's ``flags.writeable`` is read of numpy arrays).

    Raises TypeError for a wrong type or dtype, ValueError for a wrong shape or a
    non-contiguous or read-only buffer, each naming ``fn`` and ``name``.
    """
    got = array_kind(x)
    if kind is not None and got != kind:
        raise TypeError(f"{fn}: {name} is a {got} array but the others are {kind} arrays; "
                        "pass all arrays on one device")
    code = dtype_code(x.dtype)
    if code not in dtypes:
        allowed = ", ".join(str(dtype_of_code(c)) for c in dtypes)
        raise TypeError(f"{fn}: {name} must have dtype {allowed}; got {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} must have shape {tuple(shape)} like param; "
                         f"got {tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be C-contiguous (use np.ascontiguousarray); "
                         f"got strides {x.strides}")
    if writeable and got == "numpy" and not x.flags.writeable:
        raise ValueError(f"{fn}: {name} is read-only but is written in place; pass a writeable "
                         "array or donate=False")
    return code


@overload
def driver_for(kind: Literal["numpy"]) -> CpuDriver: ...


@overload
def driver_for(kind: str) -> CpuDriver | CudaDriver: ...


def driver_for(kind: str) -> CpuDriver | CudaDriver:
    """The kernel driver for a device name: the CPU build or the CUDA build."""
    return device_named(kind).driver()
