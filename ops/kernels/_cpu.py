"""CPU driver: calls a kernel family's host entry points through ctypes.

The host entry points are compiled from the same ``.cu`` source as the CUDA
kernels (see ``[Note: one source, two targets]`` in ``kernels/shim_cpu.h``).

[Note: kernel threads of thread ranks]
A host kernel over a large buffer runs on a team of OpenMP threads, as many
as the process's OpenMP default (``OMP_NUM_THREADS``, else one a core). Thread
ranks (:func:`ops.spawn`) launch kernels at the same time, each its own team,
so W ranks would ask for W teams of the whole machine while XLA's threads run
their programs too. Each rank thread therefore takes ``1/W`` of the default
(:func:`share_cores`, at least one thread), set on its first launch: OpenMP
keeps the team size per calling thread, so the ranks' settings are their own
and the rest of the process keeps its default. Processes launched one a rank
(``torchrun``) get ``OMP_NUM_THREADS=1`` from the launcher already. Measured
with the encoder of ``benchmarks/jax_models.py`` at 2 thread ranks on 2
cores: a unit's copy-out ran at 1.7-2.5 GB/s with two-thread teams and at
3.7-6.2 GB/s with one thread a rank.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

import numpy as np

from ops.kernels._build import load_cpu
from ops.kernels._table import ADAM_MULTI_PARAMS, Kernel, sumsq_kernels

__all__ = ["CpuDriver", "cpu_driver", "host_threads", "share_cores"]

_RANKS = threading.local()  # .ranks: the thread ranks sharing the cores; .applied


def share_cores(ranks: int) -> None:
    """The calling thread's kernels use ``1/ranks`` of the OpenMP default's
    threads (see [Note: kernel threads of thread ranks]); :func:`ops.spawn`
    calls it in each rank's thread."""
    _RANKS.ranks, _RANKS.applied = max(1, int(ranks)), False


def _apply(lib: ctypes.CDLL) -> None:
    """Set this thread's OpenMP team size once, as :func:`share_cores` asked."""
    _RANKS.applied = True
    ranks = getattr(_RANKS, "ranks", 1)
    if ranks > 1:
        lib.omp_set_num_threads(max(1, lib.omp_get_max_threads() // ranks))


def host_threads() -> int:
    """The OpenMP threads a host kernel launched from this thread runs on."""
    lib = load_cpu("copy")
    if not getattr(_RANKS, "applied", True):
        _apply(lib)
    return int(lib.omp_get_max_threads())

_CTYPES = {"ptr": ctypes.c_void_p, "f4": ctypes.c_float, "f8": ctypes.c_double,
           "i8": ctypes.c_int64}


def _arg(value: Any, kind: str) -> object:
    if kind == "ptr":
        return None if value is None else value.ctypes.data
    return float(value) if kind in ("f4", "f8") else int(value)


class CpuDriver:
    """Runs kernels on numpy arrays with the CPU build (OpenMP + SIMD)."""

    kind = "numpy"

    def __init__(self) -> None:
        self._functions: dict[str, object] = {}

    def _function(self, family: str, cname: str | None, signature: tuple) -> Any:
        if cname is None:
            raise TypeError(f"the {family} kernel has no host driver of this form")
        if not getattr(_RANKS, "applied", True):  # a thread rank's first launch
            _apply(load_cpu(family))
        fn = self._functions.get(cname)
        if fn is None:
            fn = getattr(load_cpu(family), cname)
            fn.argtypes = [_CTYPES[kind] for _, kind in signature]
            fn.restype = None
            self._functions[cname] = fn
        return fn

    def elementwise(self, kernel: Kernel, n: int, args: tuple) -> None:
        """Run an elementwise kernel over ``n`` elements; args in ``kernel.params`` order."""
        if kernel.host is None:
            raise NotImplementedError(f"kernel {kernel.name} has no CPU host driver")
        sig = kernel.host_signature
        fn = self._function(kernel.family, kernel.host, sig)
        fn(*[None if a is None else a.ctypes.data if kind == "ptr" else
             float(a) if kind in ("f4", "f8") else int(a)
             for a, (_, kind) in zip(args, sig, strict=True)])  # as _arg, one call a launch

    def adam_from(self, kernel: Kernel, sources: tuple, args: tuple) -> None:
        """The out-of-place Adam update: old (param, exp_avg, exp_avg_sq) read from
        ``sources``, new ones written to the buffers in ``args``."""
        sig = (("p0", "ptr"), ("m0", "ptr"), ("v0", "ptr"), *kernel.host_signature)
        fn = self._function(kernel.family, kernel.from_host, sig)
        fn(*(_arg(a, kind) for a, (_, kind) in zip((*sources, *args), sig, strict=True)))

    def adam_multi(self, kernel: Kernel, tensors: list[tuple], scalars: tuple) -> None:
        """One fused Adam call over many (p, g, m, v, copy) tuples; scalars from ``sumsq`` on."""
        ptrs = np.array([0 if a is None else a.ctypes.data for t in tensors for a in t],
                        np.int64)
        sizes = np.array([t[0].size for t in tensors], np.int64)
        fn = self._function(kernel.family, kernel.multi_host, ADAM_MULTI_PARAMS)
        args = (ptrs, sizes, len(tensors), *scalars)
        fn(*(_arg(a, kind) for a, (_, kind) in zip(args, ADAM_MULTI_PARAMS, strict=True)))

    def lamb_stats(self, stats: Kernel, finish: Kernel, tensors: list[tuple], scalars: tuple,
                   sums: np.ndarray) -> None:
        """LAMB's first pass over (p, g, m, v, copy) tuples: moments updated, each
        tensor's sums of squares of the update and the param into ``sums``
        ((n, 2) float64); ``finish`` is the GPU's second launch, done here in
        the same call."""
        self._lamb(stats, tensors, scalars, sums)

    def lamb_apply(self, apply: Kernel, tensors: list[tuple], scalars: tuple,
                   sums: np.ndarray) -> None:
        """LAMB's second pass: params (and copies) from the moments and ``sums``."""
        self._lamb(apply, tensors, scalars, sums)

    def _lamb(self, kernel: Kernel, tensors: list[tuple], scalars: tuple, sums: np.ndarray) -> None:
        ptrs = np.array([0 if a is None else a.ctypes.data for t in tensors for a in t],
                        np.int64)
        sizes = np.array([t[0].size for t in tensors], np.int64)
        sig = kernel.host_signature
        fn = self._function(kernel.family, kernel.host, sig)
        args = (ptrs, sizes, len(tensors), *scalars, sums)
        fn(*(_arg(a, kind) for a, (_, kind) in zip(args, sig, strict=True)))

    def sum_of_squares(self, xs: list[np.ndarray], code: str, out: np.ndarray, *,
                       exact: bool = False) -> None:
        """Write the float64 sum of squares of all of ``xs`` into ``out[0]`` (with
        ``exact``, add its int64 slots into ``out``: see [Note: exact sums of
        squares])."""
        partial, _ = sumsq_kernels(code, exact=exact)
        ptrs = np.array([x.ctypes.data for x in xs], np.int64)
        sizes = np.array([x.size for x in xs], np.int64)
        fn = self._function(partial.family, partial.host, partial.host_signature)
        fn(ptrs.ctypes.data, sizes.ctypes.data, len(xs), out.ctypes.data)


@functools.cache
def cpu_driver() -> CpuDriver:
    return CpuDriver()
