"""The CUDA driver, run without a GPU: its launches go through the CPU emulation
of the very ``__global__`` kernels (same source string, same grid, block and
argument marshalling as with CuPy), and must agree with the CPU host drivers."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

import ops
from ops._adam import adam_scalars
from ops.device._arrays import BF16
from ops.kernels._build import load_cpu
from ops.kernels._cpu import cpu_driver
from ops.kernels._emulate import EmulatedModule, EmulationError
from ops.kernels._table import TABLE, adam_kernel, cast_kernel

DT = {"f32": np.float32, "bf16": BF16, "f16": np.float16}


def _adam_args(rng, n, gcode, ccode):
    p = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * 0.1).astype(DT[gcode])
    m = (rng.standard_normal(n) * 0.01).astype(np.float32)
    v = np.abs(rng.standard_normal(n) * 1e-3).astype(np.float32)
    c = None if ccode == "none" else np.zeros(n, DT[ccode])
    sumsq = np.array([np.sum(g.astype(np.float64) ** 2)])
    s = adam_scalars(step=2, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                     decoupled=True)
    scalars = [s[k] for k in ("beta1", "beta2", "omb1", "omb2", "step_size", "bc2_sqrt", "eps",
                              "decay", "l2")]
    return [p, g, m, v, c, n, sumsq, *scalars, 0.5, 1.0]


@pytest.mark.parametrize("n", [1, 7, 1000, 100_003])
@pytest.mark.parametrize("gcode", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("ccode", ["none", "bf16", "f16"])
def test_adam_launch_matches_host_driver(rng, emulated_cuda, n, gcode, ccode):
    kernel = adam_kernel(gcode, ccode)
    host = _adam_args(rng, n, gcode, ccode)
    dev = [a.copy() if isinstance(a, np.ndarray) else a for a in host]
    cpu_driver().elementwise(kernel, n, tuple(host))
    emulated_cuda.elementwise(kernel, n, tuple(dev))
    for a, b in zip(host, dev, strict=True):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    launches = emulated_cuda._function(kernel).launches
    grid, block, _ = launches[-1]
    assert block == (256, 1, 1)
    assert grid == (min(-(-n // 256), 2 * 4), 1, 1)


@pytest.mark.parametrize("src,dst", [("f32", "bf16"), ("f32", "f16"), ("bf16", "f32"),
                                     ("f16", "f32")])
def test_cast_launch_matches_host_driver(rng, emulated_cuda, src, dst):
    n = 70_001
    x = rng.standard_normal(n).astype(DT[src])
    y_host, y_dev = np.zeros(n, DT[dst]), np.zeros(n, DT[dst])
    cpu_driver().elementwise(cast_kernel(src, dst), n, (x, y_host, n))
    emulated_cuda.elementwise(cast_kernel(src, dst), n, (x, y_dev, n))
    np.testing.assert_array_equal(y_host.view(np.uint8), y_dev.view(np.uint8))


@pytest.mark.parametrize("n", [0, 1, 31, 257, 100_003])
@pytest.mark.parametrize("code", ["f32", "bf16", "f16"])
def test_two_pass_sum_of_squares_uses_shuffles_and_barriers_faithfully(rng, emulated_cuda, n,
                                                                       code):
    """Warp shuffles, shared memory and __syncthreads in the emulated kernel."""
    x = rng.standard_normal(n).astype(DT[code])
    out = np.full(1, np.nan)
    emulated_cuda.sum_of_squares([x], code, out)
    np.testing.assert_allclose(out[0], np.sum(x.astype(np.float64) ** 2), rtol=1e-12)


SIZES = [0, 1, 300, 7, 1000, 257, 2049]  # an empty tensor, and none a multiple of a block


def _scalars():
    s = adam_scalars(step=3, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                     decoupled=True)
    return [s[k] for k in ("beta1", "beta2", "omb1", "omb2", "step_size", "bc2_sqrt", "eps",
                           "decay", "l2")] + [0.5, 1.0]


@pytest.mark.parametrize("gcode,ccode", [("f32", "none"), ("bf16", "bf16"), ("f16", "f16"),
                                         ("f32", "bf16")])
def test_multi_tensor_adam_is_one_launch_and_matches_per_tensor(rng, emulated_cuda, gcode,
                                                                ccode):
    tensors = [_adam_args(rng, n, gcode, ccode)[:5] for n in SIZES]
    sumsq = np.array([sum(float(np.sum(t[1].astype(np.float64) ** 2)) for t in tensors)])
    want = [[a.copy() if a is not None else None for a in t] for t in tensors]
    for p, g, m, v, c in want:
        cpu_driver().elementwise(adam_kernel(gcode, ccode), p.size,
                                 (p, g, m, v, c, p.size, sumsq, *_scalars()))
    multi = TABLE[adam_kernel(gcode, ccode).multi]
    before = len(emulated_cuda._function(multi).launches)
    emulated_cuda.adam_multi(adam_kernel(gcode, ccode), [tuple(t) for t in tensors],
                             (sumsq, *_scalars()))
    launches = emulated_cuda._function(multi).launches[before:]
    assert len(launches) == 1
    assert launches[0][0] == (min(-(-sum(SIZES) // 256), 2 * 4), 1, 1)
    for got_t, want_t in zip(tensors, want, strict=True):
        for a, b in zip(got_t, want_t, strict=True):
            if a is not None:
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("code", ["f32", "bf16", "f16"])
def test_multi_tensor_sum_of_squares_is_one_partial_launch(rng, emulated_cuda, code):
    xs = [rng.standard_normal(n).astype(DT[code]) for n in SIZES]
    multi = TABLE[f"zs_sumsq_multi_partial_{code}"]
    before = len(emulated_cuda._function(multi).launches)
    out = np.full(1, np.nan)
    emulated_cuda.sum_of_squares(xs, code, out)
    assert len(emulated_cuda._function(multi).launches) == before + 1
    want = sum(float(np.sum(x.astype(np.float64) ** 2)) for x in xs)
    np.testing.assert_allclose(out[0], want, rtol=1e-12)


def test_pointer_tables_are_built_once_per_set_of_buffers(rng, emulated_cuda):
    xs = [rng.standard_normal(n).astype(np.float32) for n in (3, 5)]
    out = np.zeros(1)
    emulated_cuda.sum_of_squares(xs, "f32", out)
    first = dict(emulated_cuda._tables)
    emulated_cuda.sum_of_squares(xs, "f32", out)
    assert emulated_cuda._tables == first
    emulated_cuda.sum_of_squares([xs[1], xs[0]], "f32", out)  # another order: another table
    assert len(emulated_cuda._tables) == len(first) + 1


def test_zero_elements_launch_nothing(emulated_cuda):
    kernel = adam_kernel("f32", "none")
    before = len(emulated_cuda._function(kernel).launches)
    empty = np.zeros(0, np.float32)
    args = (empty, empty, empty, empty, None, 0, None, *[0.5] * 11)
    emulated_cuda.elementwise(kernel, 0, args)
    assert len(emulated_cuda._function(kernel).launches) == before


def test_emulation_rejects_what_a_gpu_would(emulated_cuda):
    fn = emulated_cuda._function(cast_kernel("f32", "bf16"))
    x, y = np.zeros(4, np.float32), np.zeros(4, BF16)
    with pytest.raises(EmulationError, match="invalid launch"):
        fn((0,), (256,), (x, y, np.int64(4)))
    with pytest.raises(EmulationError, match="exceeds __launch_bounds__"):
        fn((1,), (512,), (x, y, np.int64(4)))
    with pytest.raises(EmulationError, match="argument n must be int64; got int"):
        fn((1,), (256,), (x, y, 4))  # a bare Python int has no C type
    with pytest.raises(EmulationError, match="argument n must be int64; got ndarray"):
        fn((1,), (256,), (x, y, y))
    with pytest.raises(EmulationError, match="argument y must be an array"):
        fn((1,), (256,), (x, np.float32(0), np.int64(4)))
    with pytest.raises(EmulationError, match="4 arguments, the kernel takes 3"):
        fn((1,), (256,), (x, y, np.int64(4), np.int64(4)))
    with pytest.raises(EmulationError, match="only this package's kernel sources"):
        EmulatedModule("extern \"C\" __global__ void k() {}")


_PROBES = r"""
__global__ void half_wait(float* x) {  // half the block never reaches the barrier
  if (threadIdx.x < 16) __syncthreads();
  x[threadIdx.x] = 1.0f;
}
__global__ void warp_sum(float* x) {  // lane 0 gets the warp's sum, through shuffles
  __shared__ float seen[64];
  float v = x[threadIdx.x];
  seen[threadIdx.x] = v;
  __syncthreads();
  for (int o = 16; o; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) x[threadIdx.x] = v + seen[(threadIdx.x + 32) % 64] * 0.0f;
}
ZS_EMULATE(half_wait)
ZS_EMULATE(warp_sum)
"""


def _probe(syncs: int):
    import ctypes

    from ops.kernels._build import _inline_includes, load_cpu_source

    src = _inline_includes(f"#define ZS_FAMILY_SYNCS {syncs}\n#include \"shim_cpu.h\"\n"
                           + _PROBES, set())
    lib = load_cpu_source(src, f"probes{syncs}")

    def launch(name, x, threads):
        fn = getattr(lib, f"zs_emu_{name}")
        fn.restype = ctypes.c_int
        ptr = ctypes.c_void_p(x.ctypes.data)
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(ptr))
        return fn((ctypes.c_uint * 3)(1, 1, 1), (ctypes.c_uint * 3)(threads, 1, 1), argv)

    return launch


def test_the_emulated_threads_meet_at_barriers_and_shuffles_and_a_hang_is_reported():
    """CUDA threads run as fibers that wait for each other at barriers and
    shuffles; a barrier that some threads never reach returns status 2 (the
    launch would hang on a GPU) rather than hanging, and a family counted as
    free of barriers that runs one returns 3 (see shim_cpu.h)."""
    launch = _probe(1)
    x = np.arange(64, dtype=np.float32)
    assert launch("warp_sum", x, 64) == 0
    assert x[0] == sum(range(32)) and x[32] == sum(range(32, 64))
    assert x[1] == 1 and x[33] == 33  # the other lanes keep their values
    y = np.zeros(32, np.float32)
    assert launch("half_wait", y, 32) == 2
    assert launch("warp_sum", np.arange(64, dtype=np.float32), 64) == 0  # and goes on
    assert _probe(0)("warp_sum", np.arange(64, dtype=np.float32), 64) == 3


def test_table_lists_every_exported_kernel():
    """Every extern "C" entry in the CPU builds is a table kernel, its host or emulation."""
    known = set()
    for k in TABLE.values():
        known |= {k.name, f"zs_emu_{k.name}"} | {h for h in (k.host, k.multi_host, k.from_host)
                                                  if h}
    for family in sorted({k.family for k in TABLE.values()}):
        lib = load_cpu(family)
        nm = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True,
                            text=True, check=True).stdout
        exported = {line.split()[-1] for line in nm.splitlines() if " T zs_" in line}
        assert exported, family
        assert exported <= known, exported - known
        assert {k.name for k in TABLE.values() if k.family == family} <= exported


@pytest.mark.skipif("not __import__('cupy').is_available()", reason="no CUDA device here")
def test_cupy_driver_on_a_gpu_matches_cpu(rng):  # pragma: no cover - needs a GPU
    import cupy

    n = 1_000_003
    host = _adam_args(rng, n, "bf16", "bf16")
    p, g, m, v, c = host[:5]
    want = ops.fused_adam_step(p.copy(), g, m.copy(), v.copy(), step=2, lr=1e-2,
                               weight_decay=0.1, param_copy=c)
    dev = [cupy.asarray(a) for a in (p, g, m, v)]
    got = ops.fused_adam_step(*dev, step=2, lr=1e-2, weight_decay=0.1)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(a), b)
