"""Run CUDA kernels on the CPU, exactly as launched.

:class:`EmulatedModule` has the interface of ``cupy.RawModule`` that the CUDA
driver uses (``get_function(name)(grid, block, args)``). It accepts only source
strings that are one of this package's kernel families for the ``"cuda"``
target, builds that family for the CPU, and runs the ``__global__`` kernel
itself: every block of the grid in turn, its CUDA threads as fibers on the
calling thread, with ``__syncthreads`` and warp shuffles emulated
(``kernels/shim_cpu.h``). Arguments
are passed as ``cuLaunchKernel`` would: one pointer to each argument's value,
typed by the numpy scalar or array CuPy would be handed. It runs at tens of
millions of elements per second: a test oracle for the CUDA driver and the
kernels' GPU form, not a backend. Arrays are numpy arrays or device arrays
with CuPy's ``.data.ptr`` (the stand-in of :mod:`ops.testing`). Launches run
one at a time in a process: ``__shared__`` memory is emulated with statics.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from ops.kernels._build import load_cpu, source
from ops.kernels._table import TABLE

__all__ = ["EmulatedModule", "EmulationError"]

_SCALAR_CTYPES: dict[np.dtype, type[ctypes._SimpleCData]] = {
    np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
    np.dtype(np.int64): ctypes.c_int64, np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.uint64): ctypes.c_uint64}


class EmulationError(RuntimeError):
    """A launch that would fail on a GPU, or a construct the emulation cannot run."""


def _family_of(code: str) -> str:
    for family in sorted({k.family for k in TABLE.values()}):
        if source(family, "cuda") == code:
            return family
    raise EmulationError("EmulatedModule runs only this package's kernel sources")


_LAUNCH = threading.Lock()


def _is_array(value: object) -> bool:
    return isinstance(value, np.ndarray) or hasattr(getattr(value, "data", None), "ptr")


def _c_arg(value: Any) -> ctypes._SimpleCData:
    """The C value of an argument that passed :func:`_check_kind`."""
    if isinstance(value, np.ndarray):
        return ctypes.c_void_p(value.ctypes.data)
    if _is_array(value):
        return ctypes.c_void_p(value.data.ptr)
    return _SCALAR_CTYPES[value.dtype](value.item())


_KIND_DTYPES = {"f4": np.float32, "f8": np.float64, "i8": np.int64}


def _check_kind(kernel: str, name: str, kind: str, value: object) -> None:
    """The C ABI check a GPU cannot do for us: each argument's size and meaning."""
    if kind == "ptr":
        ok = _is_array(value) or (isinstance(value, np.uint64) and value == 0)
    else:
        ok = isinstance(value, np.generic) and value.dtype == _KIND_DTYPES[kind]
    if not ok:
        want = "an array (or uint64 0 for NULL)" if kind == "ptr" else np.dtype(_KIND_DTYPES[kind])
        raise EmulationError(f"{kernel}: argument {name} must be {want}; got "
                             f"{type(value).__name__}")


class _EmulatedFunction:
    def __init__(self, lib: ctypes.CDLL, name: str) -> None:
        self.name = name
        self._fn = getattr(lib, f"zs_emu_{name}")
        self._fn.restype = ctypes.c_int
        self.launches: list[tuple[tuple, tuple, int]] = []

    def __call__(self, grid: tuple, block: tuple, args: tuple, *, shared_mem: int = 0) -> None:
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        block3 = tuple(block) + (1,) * (3 - len(block))
        kernel = TABLE[self.name]
        if min(grid3) < 1 or min(block3) < 1:
            raise EmulationError(f"{self.name}: invalid launch grid={grid} block={block}")
        if np.prod(block3) > kernel.block:
            raise EmulationError(f"{self.name}: block {block} exceeds __launch_bounds__"
                                 f"({kernel.block})")
        if len(args) != len(kernel.params):
            raise EmulationError(f"{self.name}: {len(args)} arguments, the kernel takes "
                                 f"{len(kernel.params)}")
        for value, (pname, kind) in zip(args, kernel.params, strict=True):
            _check_kind(self.name, pname, kind, value)
        self.launches.append((grid3, block3, len(args)))
        values = [_c_arg(a) for a in args]
        argv = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        with _LAUNCH:
            status = self._fn((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3), argv)
        if status != 0:
            raise EmulationError(f"{self.name}: " + {
                1: "used a partial-mask warp intrinsic, which the CPU emulation does not run",
                2: "a block's threads wait at a barrier that not all of them reach (a hang "
                   "on a GPU)",
                3: "its family's source has no barrier or shuffle, yet one ran (emulated "
                   "without fibers)"}.get(status, f"emulation status {status}"))


class EmulatedModule:
    """A ``cupy.RawModule`` stand-in that runs kernels on the CPU (see module doc)."""

    def __init__(self, code: str, options: tuple = ()) -> None:
        self.family = _family_of(code)
        self.options = tuple(options)
        self._lib = load_cpu(self.family)
        self._functions: dict[str, _EmulatedFunction] = {}

    def get_function(self, name: str) -> _EmulatedFunction:
        if name not in self._functions:
            if name not in TABLE or TABLE[name].family != self.family:
                raise EmulationError(f"no __global__ kernel {name!r} in family {self.family!r}")
            self._functions[name] = _EmulatedFunction(self._lib, name)
        return self._functions[name]
