"""CPU driver: calls a kernel family's host entry points through ctypes.

The host entry points are compiled from the same ``.cu`` source as the CUDA
kernels (see ``[Note: one source, two targets]`` in ``kernels/shim_cpu.h``).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from ops._build import load_cpu
from ops._kernels import Kernel, sumsq_kernels

__all__ = ["CpuDriver", "cpu_driver"]

_CTYPES = {"ptr": ctypes.c_void_p, "f4": ctypes.c_float, "f8": ctypes.c_double,
           "i8": ctypes.c_int64}


def _arg(value: Any, kind: str) -> Any:
    if kind == "ptr":
        return None if value is None else value.ctypes.data
    return float(value) if kind in ("f4", "f8") else int(value)


class CpuDriver:
    """Runs kernels on numpy arrays with the CPU build (OpenMP + SIMD)."""

    kind = "numpy"

    def __init__(self) -> None:
        self._functions: dict[str, Any] = {}

    def _function(self, kernel: Kernel) -> Any:
        fn = self._functions.get(kernel.name)
        if fn is None:
            if kernel.host is None:
                raise NotImplementedError(f"kernel {kernel.name} has no CPU host driver")
            fn = getattr(load_cpu(kernel.family), kernel.host)
            fn.argtypes = [_CTYPES[kind] for _, kind in kernel.host_signature]
            fn.restype = None
            self._functions[kernel.name] = fn
        return fn

    def elementwise(self, kernel: Kernel, n: int, args: tuple) -> None:
        """Run an elementwise kernel over ``n`` elements; args in ``kernel.params`` order."""
        sig = kernel.host_signature
        self._function(kernel)(*(_arg(a, kind) for a, (_, kind) in zip(args, sig, strict=True)))

    def sum_of_squares(self, x: np.ndarray, code: str, out: np.ndarray) -> None:
        """Write the float64 sum of squares of ``x`` into ``out[0]``."""
        partial, _ = sumsq_kernels(code)
        self._function(partial)(x.ctypes.data, x.size, out.ctypes.data)


@functools.cache
def cpu_driver() -> CpuDriver:
    return CpuDriver()
