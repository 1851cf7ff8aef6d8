"""CUDA driver: launches the kernels with CuPy's ``RawModule`` on cupy arrays.

The driver is written against an array module (``xp``) and a module factory so
that, on a machine without a GPU, the very same code can run with numpy arrays
and :class:`ops.kernels._emulate.EmulatedModule`, which executes each ``__global__``
kernel on the CPU with the grid, block and arguments this driver passes.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ops.kernels._build import source
from ops.kernels._table import EXACT_SLOTS, LAMB_CHUNK, TABLE, Kernel, sumsq_kernels

if TYPE_CHECKING:
    from ops._types import Array

__all__ = ["NVRTC_OPTIONS", "CudaDriver", "cuda_driver"]

# --fmad=false: no contraction of a*b+c (the kernels write their fmas explicitly),
# the same IEEE arithmetic as the CPU build (-ffp-contract=off) and torch's
# fused Adam. CuPy adds -ftz=true itself.
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false")
# Blocks per SM for grid-stride kernels: enough to hide latency, few partials.
WAVES = 4
_SCALARS = {"f4": np.float32, "f8": np.float64, "i8": np.int64}
TABLE_CACHE = 64  # pointer tables kept on the device, by their contents


def _address(a: Any) -> int:  # Any: CuPy's .data.ptr is not in ops.Array
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


class CudaDriver:
    """Launches kernels from the kernel table.

    Args:
      xp: the array module (cupy on a GPU).
      module_factory: ``cupy.RawModule`` or a stand-in with its interface.
      sm_count: streaming multiprocessors of the device, for grid sizes.
    """

    kind = "cupy"

    def __init__(self, xp: types.ModuleType | types.SimpleNamespace,
                 module_factory: Callable[..., object], sm_count: int) -> None:
        self.xp = xp
        self._factory = module_factory
        self.sm_count = sm_count
        self._modules: dict[str, object] = {}
        self._tables: dict[tuple, tuple[Array, Array]] = {}
        self._chunks: dict[tuple, tuple[Array, int]] = {}

    def _module(self, family: str) -> Any:
        if family not in self._modules:
            self._modules[family] = self._factory(code=source(family, "cuda"),
                                                  options=NVRTC_OPTIONS)
        return self._modules[family]

    def _function(self, kernel: Kernel) -> Any:
        return self._module(kernel.family).get_function(kernel.name)

    def grid(self, kernel: Kernel, n: int) -> int:
        """Blocks for ``n`` elements: one element per thread, at most WAVES per SM."""
        return max(1, min(-(-n // kernel.block), self.sm_count * WAVES))

    def pack(self, kernel: Kernel, args: tuple) -> tuple:
        """Kernel arguments as CuPy passes them: arrays, or numpy scalars of the C type."""
        packed = []
        for value, (_, kind) in zip(args, kernel.params, strict=True):
            if kind == "ptr":
                packed.append(np.uint64(0) if value is None else value)  # NULL is 8 zero bytes
            else:
                packed.append(_SCALARS[kind](value))
        return tuple(packed)

    def launch(self, kernel: Kernel, grid: int, args: tuple) -> None:
        self._function(kernel)((grid,), (kernel.block,), self.pack(kernel, args))

    def elementwise(self, kernel: Kernel, n: int, args: tuple) -> None:
        """Run an elementwise kernel over ``n`` elements; args in ``kernel.params`` order."""
        if n == 0:
            return  # a zero-block grid is a launch error in CUDA
        self.launch(kernel, self.grid(kernel, n), args)

    def table(self, rows: list[tuple], sizes: list[int]) -> tuple[Array, Array, int]:
        """``(ptrs, starts, total)`` on the device for a multi-tensor launch.

        ``rows`` holds each tensor's arrays (None for a null pointer). A ZeRO
        step updates the same buffers every step, so tables are cached by their
        contents (addresses and sizes) and built, and copied to the device, once.
        """
        ptrs = tuple(0 if a is None else _address(a) for row in rows for a in row)
        starts = tuple(np.cumsum([0, *sizes]).tolist())
        key = (ptrs, starts)
        hit = self._tables.get(key)
        if hit is None:
            if len(self._tables) >= TABLE_CACHE:
                self._tables.pop(next(iter(self._tables)))
            hit = (self.xp.asarray(np.array(ptrs, np.int64)),
                   self.xp.asarray(np.array(starts, np.int64)))
            self._tables[key] = hit
        return hit[0], hit[1], starts[-1]

    def adam_multi(self, kernel: Kernel, tensors: list[tuple], scalars: tuple) -> None:
        """One launch of ``kernel``'s multi-tensor form over (p, g, m, v, copy) tuples;
        scalars from ``sumsq`` on."""
        multi = _multi(kernel)
        ptrs, starts, total = self.table(tensors, [t[0].size for t in tensors])
        if total:
            self.launch(multi, self.grid(multi, total), (ptrs, starts, len(tensors), *scalars))

    def lamb_stats(self, stats: Kernel, finish: Kernel, tensors: list[tuple], scalars: tuple,
                   sums: Array) -> None:
        """LAMB's first pass over (p, g, m, v, copy) tuples: one launch updating the
        moments and writing per-chunk partial sums, one adding each tensor's
        partials in order into ``sums`` ((n, 2) float64); see [Note: LAMB's
        sums, bit for bit] in ``lamb.cu``."""
        sizes = [t[0].size for t in tensors]
        ptrs, starts, _ = self.table(tensors, sizes)
        key = tuple(sizes)
        hit = self._chunks.get(key)
        if hit is None:
            if len(self._chunks) >= TABLE_CACHE:
                self._chunks.pop(next(iter(self._chunks)))
            counts = [-(-n // LAMB_CHUNK) for n in sizes]
            hit = self._chunks[key] = (self.xp.asarray(np.cumsum([0, *counts], dtype=np.int64)),
                                       sum(counts))
        chunks, nchunks = hit
        if nchunks == 0:
            sums[...] = 0.0
            return
        partials = self.xp.empty(2 * nchunks, dtype=np.float64)
        grid = max(1, min(nchunks, self.sm_count * WAVES))
        self.launch(stats, grid, (ptrs, starts, chunks, len(tensors), *scalars, partials))
        self.launch(finish, self.grid(finish, len(tensors)), (chunks, len(tensors), partials, sums))

    def lamb_apply(self, apply: Kernel, tensors: list[tuple], scalars: tuple,
                   sums: Array) -> None:
        """LAMB's second pass: params (and copies) from the moments and ``sums``."""
        ptrs, starts, total = self.table(tensors, [t[0].size for t in tensors])
        if total:
            self.launch(apply, self.grid(apply, total), (ptrs, starts, len(tensors), *scalars,
                                                         sums))

    def sum_of_squares(self, xs: list[Array], code: str, out: Array, *,
                       exact: bool = False) -> None:
        """Write the float64 sum of squares of all of ``xs`` into ``out[0]``: one
        launch for the per-block partials over every tensor, one to add them (no
        host synchronisation). With ``exact``, add its int64 slots into ``out``
        (see [Note: exact sums of squares]): two launches per tensor."""
        if exact:
            partial, finish = sumsq_kernels(code, exact=True)
            for x in xs:
                if x.size:
                    grid = self.grid(partial, x.size)
                    partials = self.xp.empty(grid * EXACT_SLOTS, dtype=np.int64)
                    self.launch(partial, grid, (x, x.size, partials))
                    self.launch(finish, 1, (partials, grid, out))
            return
        if len(xs) == 1:
            self._sum_of_squares(xs[0], code, out)
            return
        partial, finish = sumsq_kernels(code)
        multi = _multi(partial)
        ptrs, starts, total = self.table([(x,) for x in xs], [x.size for x in xs])
        if total == 0:
            out[0] = 0.0
            return
        grid = self.grid(multi, total)
        partials = self.xp.empty(grid, dtype=np.float64)
        self.launch(multi, grid, (ptrs, starts, len(xs), partials))
        self.launch(finish, 1, (partials, grid, out))

    def _sum_of_squares(self, x: Array, code: str, out: Array) -> None:
        partial, finish = sumsq_kernels(code)
        if x.size == 0:
            out[0] = 0.0
            return
        grid = self.grid(partial, x.size)
        partials = self.xp.empty(grid, dtype=np.float64)
        self.launch(partial, grid, (x, x.size, partials))
        self.launch(finish, 1, (partials, grid, out))


@functools.cache
def cuda_driver() -> CudaDriver:
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("cupy arrays need the 'cuda' extra: pip install 'zeroshard[cuda]'") from e
    sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    return CudaDriver(cupy, cupy.RawModule, sm)


def _multi(kernel: Kernel) -> Kernel:
    """The multi-tensor form of ``kernel``."""
    if kernel.multi is None:
        raise TypeError(f"the {kernel.name} kernel has no multi-tensor form")
    return TABLE[kernel.multi]
