"""ThreadSanitizer on the CPU emulation of the GPU reduction kernels (the sum
of squares, LAMB's per-chunk sums).

Built with ``ZS_EMULATE_OS_THREADS`` the emulation runs every CUDA thread of a
block as an OS thread (its default is fibers), so a missing ``__syncthreads()``
is a real data race that ThreadSanitizer can see even when the result happens
to come out right. The kernel as written must be race-free,
and the same kernel with its barrier removed must be caught."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from ops.kernels._build import source

DRIVER = r"""
#include <cstdio>
#include <vector>
int main() {
  const long long n = 5000;
  std::vector<float> x(n);
  double want = 0;
  for (long long i = 0; i < n; ++i) { x[i] = (float)((i % 7) - 3); want += (double)x[i] * x[i]; }
  std::vector<double> partials(2), out(1);
  const float* px = x.data(); double* pp = partials.data(); double* po = out.data();
  long long nparts = 2;
  void* a1[] = {&px, (void*)&n, &pp};
  void* a2[] = {&pp, &nparts, &po};
  unsigned grid[3] = {2, 1, 1}, one[3] = {1, 1, 1}, block[3] = {256, 1, 1};
  zs_emu_zs_sumsq_partial_f32(grid, block, a1);
  zs_emu_zs_sumsq_finish(one, block, a2);
  std::printf("%.1f %.1f\n", out[0], want);
  return 0;
}
"""


# Each barrier call becomes ZS_BARRIER(k), k its place in the source; the one
# that ZS_REMOVED_BARRIER names is skipped, so one build of a kernel family
# serves the run as written and every run with a barrier taken out.
PRELUDE = r"""
#include <cstdlib>
static const int zs_removed_barrier = [] {
  const char* k = std::getenv("ZS_REMOVED_BARRIER");
  return k ? std::atoi(k) : -1;
}();
#define ZS_BARRIER(k) do { if ((k) != zs_removed_barrier) __syncthreads(); } while (0)
"""
BARRIER = "__syncthreads();"


def _numbered(src: str) -> str:
    parts = src.split(BARRIER)
    return PRELUDE + parts[0] + "".join(f"ZS_BARRIER({k});{part}"
                                        for k, part in enumerate(parts[1:]))


@pytest.fixture(scope="session")
def build(shared_tmp):
    """``build(src, name, driver)``: the path of ``src`` with ``driver`` built
    under ThreadSanitizer, once per test session (the pytest-xdist workers
    share the builds through a file lock, as ``gloo_shared`` shares launches)."""
    import os

    from filelock import FileLock

    where = shared_tmp / "kernel-races"
    where.mkdir(exist_ok=True)

    def get(src: str, name: str, driver: str):
        exe = where / name
        with FileLock(f"{exe}.lock"):
            if not exe.exists():
                cpp = where / f"{name}.cpp"
                cpp.write_text(_numbered(src) + driver)
                done = subprocess.run(["g++", "-std=c++20", "-O1", "-g", "-fsanitize=thread",
                                       "-fopenmp", "-DZS_EMULATE_OS_THREADS", "-pthread",
                                       str(cpp), "-o", f"{exe}.part"],
                                      capture_output=True, text=True)
                if done.returncode != 0:
                    pytest.skip("g++ -fsanitize=thread is not available here: "
                                f"{done.stderr[-300:]}")
                os.replace(f"{exe}.part", exe)
        return exe

    return get


def _run(exe, removed: int = -1) -> subprocess.CompletedProcess:
    """The built driver run with barrier ``removed`` (-1: none) taken out."""
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                          env={"TSAN_OPTIONS": "halt_on_error=0 exitcode=66",
                               "ZS_REMOVED_BARRIER": str(removed)})


# ThreadSanitizer keeps a few recent accesses per memory word, so whether it
# sees a race depends on how the OS threads interleaved: under load one run in
# dozens of a racy build printed nothing. A racy build must show its race in
# one of these runs (a race-free one must show none in its one run).
RACE_TRIES = 5


def _race_run(build, src: str, name: str, driver: str, removed: int | None,
              start: int = 0) -> subprocess.CompletedProcess:
    """``src`` run under ThreadSanitizer with its ``removed``-th barrier at or after
    ``start`` taken out (None: as written); a run as written must be race-free,
    one with a barrier removed must show a data race (asserted here)."""
    if removed is None:
        run = _run(build(src, name, driver))
        assert run.returncode == 0 and "ThreadSanitizer" not in run.stderr, run.stderr[-2000:]
        return run
    before = src[:start].count(BARRIER)
    assert src[start:].count(BARRIER) > removed
    exe = build(src, name, driver)
    for _ in range(RACE_TRIES):
        run = _run(exe, before + removed)
        if "ThreadSanitizer: data race" in run.stderr:
            return run
    raise AssertionError(f"barrier {removed} of {name} taken out: no data race seen in "
                         f"{RACE_TRIES} runs; the last one's stderr: {run.stderr[-2000:]}")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
def test_reduction_kernels_are_race_free_and_a_missing_barrier_is_caught(build):
    src = source("reduce", "cpu")
    clean = _race_run(build, src, "reduce", DRIVER, None)
    got, want = (float(v) for v in clean.stdout.split())
    assert got == want == float(np.sum((np.arange(5000) % 7 - 3) ** 2))
    _race_run(build, src, "reduce", DRIVER, 0)  # the first barrier taken out


LAMB_DRIVER = r"""
#include <cstdio>
#include <vector>
int main() {
  // one tensor of four chunks and one block: the block reduces four times,
  // reusing its shared memory
  const long long size = 3 * 4096 + 5, nchunks = 4, n = 1;
  std::vector<float> p(size), g(size), m(size, 0.0f), v(size, 0.0f);
  for (long long i = 0; i < size; ++i) { p[i] = (float)((i % 5) - 2); g[i] = (float)((i % 3) - 1); }
  std::vector<long long> ptrs = {(long long)p.data(), (long long)g.data(), (long long)m.data(),
                                 (long long)v.data(), 0};
  std::vector<long long> starts = {0, size}, chunks = {0, nchunks};
  std::vector<double> partials(2 * nchunks);
  const long long *pp = ptrs.data(), *ps = starts.data(), *pc = chunks.data();
  const double* sumsq = nullptr;
  double* out = partials.data();
  float b1 = 0.9f, b2 = 0.999f, omb1 = 0.1f, omb2 = 0.001f, bc1 = 10.0f, bc2 = 1000.0f,
        eps = 1e-6f, eps_root = 0.0f, wd = 0.0f, lr = 0.01f, lo = 0.0f, hi = 0.0f,
        scale = 1.0f, max_norm = 0.0f;
  void* args[] = {&pp, &ps, &pc, (void*)&n, &sumsq, &b1, &b2, &omb1, &omb2, &bc1, &bc2, &eps,
                  &eps_root, &wd, &lr, &lo, &hi, &scale, &max_norm, &out};
  unsigned grid[3] = {1, 1, 1}, block[3] = {256, 1, 1};
  zs_emu_zs_lamb_stats_f32(grid, block, args);
  double sp = 0;
  for (long long c = 0; c < nchunks; ++c) sp += partials[2 * c + 1];
  double want = 0;
  for (long long i = 0; i < size; ++i) want += (double)p[i] * p[i];
  std::printf("%.1f %.1f\n", sp, want);
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
@pytest.mark.parametrize("removed", [None, 0, 1])
def test_lamb_stats_kernel_is_race_free_and_each_missing_barrier_is_caught(build, removed):
    """LAMB's two-value block reduction runs once per chunk in the same block:
    its first barrier keeps a chunk's writes to shared memory from racing the
    previous chunk's reads, its second orders the writes before the reads."""
    src = source("lamb", "cpu")
    assert src.count("__syncthreads();") == 2
    run = _race_run(build, src, "lamb", LAMB_DRIVER, removed)
    if removed is None:
        got, want = (float(x) for x in run.stdout.split())
        assert got == want > 0


QUANT_DRIVER = r"""
#include <cstdio>
#include <vector>
int main() {
  // four groups and one block: the block's shared maxima are reused for each
  const long long n = 3 * 256 + 5;
  std::vector<float> x(n);
  for (long long i = 0; i < n; ++i) x[i] = (float)((i * 37) % 101 - 50) * (1.0f + (i / 256));
  std::vector<signed char> q(n), q2(n);
  std::vector<float> s(4), s2(4);
  const float* px = x.data(); signed char* pq = q.data(); float* ps = s.data();
  void* args[] = {&px, &pq, &ps, (void*)&n};
  unsigned grid[3] = {1, 1, 1}, block[3] = {256, 1, 1};
  zs_emu_zs_quantize_f32(grid, block, args);
  zs_quantize_f32_host(px, q2.data(), s2.data(), n);
  // and the int4 form, whose pairs also meet through a warp shuffle
  std::vector<unsigned char> h(n / 2 + 1), h2(n / 2 + 1);
  std::vector<float> t(4), t2(4);
  unsigned char* ph = h.data(); float* pt = t.data();
  void* args4[] = {&px, &ph, &pt, (void*)&n};
  zs_emu_zs_quantize4_f32(grid, block, args4);
  zs_quantize4_f32_host(px, h2.data(), t2.data(), n);
  // and the 1-bit compression, whose groups' sums share the block's memory too
  std::vector<float> e(n, 0.25f), e2(n, 0.25f), r(4), r2(4);
  std::vector<unsigned char> b(n / 8 + 1), b2(n / 8 + 1);
  float* pe = e.data(); unsigned char* pb = b.data(); float* pr = r.data();
  void* args1[] = {&px, &pe, &pb, &pr, (void*)&n};
  zs_emu_zs_sign_compress(grid, block, args1);
  zs_sign_compress_host(px, e2.data(), b2.data(), r2.data(), n);
  std::printf("%d\n", (int)(q == q2 && s == s2 && h == h2 && t == t2 && e == e2 && b == b2 &&
                            r == r2));
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
@pytest.mark.parametrize("removed", [None, 0, 1, 2, 3])
def test_quantize_kernel_is_race_free_and_each_missing_barrier_is_caught(build, removed):
    """The int8 (and int4) quantisation's block maximum and the 1-bit
    compression's block sum run once per group in the same block: each first
    barrier orders the warps' values before warp 0 reads them, each second
    orders the block's value before every thread reads it (and those reads
    before the next group's writes)."""
    src = source("quant", "cpu")
    assert src.count("__syncthreads();") == 4
    run = _race_run(build, src, "quant", QUANT_DRIVER, removed)
    if removed is None:
        assert run.stdout.strip() == "1"  # the emulated kernel equals the host build


EXACT_DRIVER = r"""
#include <cstdio>
#include <vector>
int main() {
  // two blocks striding over the elements, then the one-block finish
  const long long n = 5000, nparts = 2;
  std::vector<float> x(n);
  for (long long i = 0; i < n; ++i) x[i] = (float)((i % 7) - 3) * (1.0f + (float)(i % 3));
  std::vector<long long> partials(nparts * 513), out(513, 0), host(513, 0);
  const float* px = x.data(); long long* pp = partials.data(); long long* po = out.data();
  void* a1[] = {&px, (void*)&n, &pp};
  void* a2[] = {&pp, (void*)&nparts, &po};
  unsigned grid[3] = {2, 1, 1}, one[3] = {1, 1, 1}, block[3] = {256, 1, 1};
  zs_emu_zs_exact_sumsq_partial_f32(grid, block, a1);
  zs_emu_zs_exact_sumsq_finish(one, block, a2);
  long long ptr = (long long)px, size = n;
  zs_exact_sumsq_f32_host(&ptr, &size, 1, host.data());
  std::printf("%d\n", (int)(out == host));
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
@pytest.mark.parametrize("removed", [None, 0, 1])
def test_exact_sum_of_squares_kernel_is_race_free_and_each_missing_barrier_is_caught(build,
                                                                                      removed):
    """The exact kernel's shared slots: the first barrier orders their zeroing
    before any thread adds to them, the second the adds before the slots are
    written out."""
    src = source("reduce", "cpu")
    start = src.index("zs_exact_block(")  # the exact kernel's own barriers
    run = _race_run(build, src, "exact", EXACT_DRIVER, removed, start)
    if removed is None:
        assert run.stdout.strip() == "1"  # the emulated kernel equals the host build
