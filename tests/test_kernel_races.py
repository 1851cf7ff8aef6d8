"""ThreadSanitizer on the CPU emulation of the GPU reduction kernels.

The emulation runs every CUDA thread of a block as an OS thread, so a missing
``__syncthreads()`` is a real data race that ThreadSanitizer can see even when
the result happens to come out right. The kernel as written must be race-free,
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


def _run(tmp_path, src: str, name: str) -> subprocess.CompletedProcess:
    cpp = tmp_path / f"{name}.cpp"
    cpp.write_text(src + DRIVER)
    exe = tmp_path / name
    build = subprocess.run(["g++", "-std=c++20", "-O1", "-g", "-fsanitize=thread", "-fopenmp",
                            "-pthread", str(cpp), "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"g++ -fsanitize=thread is not available here: {build.stderr[-300:]}")
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                          env={"TSAN_OPTIONS": "halt_on_error=0 exitcode=66"})


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
def test_reduction_kernels_are_race_free_and_a_missing_barrier_is_caught(tmp_path):
    src = source("reduce", "cpu")
    clean = _run(tmp_path, src, "clean")
    assert clean.returncode == 0 and "ThreadSanitizer" not in clean.stderr, clean.stderr[-2000:]
    got, want = (float(v) for v in clean.stdout.split())
    assert got == want == float(np.sum((np.arange(5000) % 7 - 3) ** 2))

    broken_src = src.replace("__syncthreads();", "", 1)
    assert broken_src != src
    broken = _run(tmp_path, broken_src, "broken")
    assert "ThreadSanitizer: data race" in broken.stderr
