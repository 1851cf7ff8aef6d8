"""Every kernel family compiles for the GPU: nvcc to cubin (no register spills)
and NVRTC on the exact source string CuPy's RawModule is handed."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from ops.kernels._build import source
from ops.kernels._cuda import NVRTC_OPTIONS
from ops.kernels._table import TABLE

FAMILIES = sorted({k.family for k in TABLE.values()})
ARCHS = ["sm_80", "sm_90"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed on this machine")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_nvcc_compiles_without_spills(tmp_path, family, arch):
    src = tmp_path / f"{family}.cu"
    src.write_text(source(family, "cuda"))
    proc = subprocess.run(
        ["nvcc", "-std=c++17", "--fmad=false", f"-arch={arch}", "-cubin", "-Xptxas", "-v",
         "-o", str(tmp_path / f"{family}.cubin"), str(src)],
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = proc.stderr
    compiled = set(re.findall(r"Compiling entry function '(\w+)'", report))
    assert compiled == {k.name for k in TABLE.values() if k.family == family}
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), report


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        pytest.skip("cuda-bindings (NVRTC) is not installed")
    return nvrtc


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_nvrtc_compiles_the_string_cupy_gets(family, arch):
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source(family, "cuda").encode(), f"{family}.cu".encode(),
                                         0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = [o.encode() for o in (*NVRTC_OPTIONS, f"--gpu-architecture={arch}", "-ftz=true")]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        pytest.fail(log.decode(errors="replace"))
    err, size = nvrtc.nvrtcGetCUBINSize(prog)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS and size > 0
    nvrtc.nvrtcDestroyProgram(prog)
