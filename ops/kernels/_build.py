"""Kernel sources and the CPU build cache.

A kernel family is one ``.cu`` file in ``ops/kernels``. :func:`source` turns it
into one self-contained string for a target: ``"cuda"`` (what NVRTC, nvcc and
CuPy's ``RawModule`` compile) or ``"cpu"`` (the same text behind the CPU shim,
plus one emulation entry per ``__global__`` kernel, see ``shim_cpu.h``).
Local ``#include "x.cuh"`` lines are inlined, because CuPy's cache key hashes the
source string and not the files it includes.

:func:`load_cpu` compiles the CPU source with the system C++ compiler into a
shared library cached under the user cache directory, keyed by a hash of the
source, the flags, the compiler's version and the CPU model (``-march=native``).
Concurrent builds from several processes are safe: one takes a file lock, the
others wait and reuse its result, and the library appears by atomic rename.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["KernelBuildError", "cache_dir", "load_cpu", "source"]

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
CPU_FLAGS = (
    "-std=c++20", "-O3", "-march=native", "-fopenmp", "-pthread", "-fPIC", "-shared",
    # IEEE arithmetic only, as the GPU build (--fmad=false): bit parity with torch.
    "-ffp-contract=off",
    # Lets g++ vectorise sqrtf; errno is never read.
    "-fno-math-errno",
)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


class KernelBuildError(RuntimeError):
    """A kernel source could not be compiled for the CPU."""


def _inline_includes(text: str, seen: set[str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _inline_includes((KERNEL_DIR / name).read_text(), seen)

    return _INCLUDE.sub(one, text).replace("#pragma once", "")


@functools.cache
def source(family: str, target: str) -> str:
    """The self-contained source of kernel family ``family`` for ``target``.

    Args:
      family: file stem in ``ops/kernels`` (``"adam"``, ``"reduce"``, ``"cast"``).
      target: ``"cuda"`` or ``"cpu"``.
    """
    path = KERNEL_DIR / f"{family}.cu"
    if not path.exists():
        raise ValueError(f"no kernel family {family!r} in {KERNEL_DIR}")
    if target == "cuda":
        return _inline_includes(path.read_text(), set())
    if target == "cpu":
        # a family with no barrier and no shuffle is emulated without fibers
        # (see shim_cpu.h's zs_emulate_launch)
        syncs = int(bool(re.search(r"__syncthreads|__shfl",
                                   _inline_includes(path.read_text(), set()))))
        body = _inline_includes(f"#define ZS_FAMILY_SYNCS {syncs}\n"
                                '#include "shim_cpu.h"\n' + path.read_text(), set())
        emulate = "".join(f"ZS_EMULATE({name})\n" for name in kernel_names(family))
        return body + "\n// Emulation entry points, one per __global__ kernel.\n" + emulate
    raise ValueError(f"target must be 'cuda' or 'cpu', got {target!r}")


def kernel_names(family: str) -> list[str]:
    """The ``__global__`` kernel names of a family, from the kernel table."""
    from ops.kernels._table import TABLE

    return [k.name for k in TABLE.values() if k.family == family]


def cache_dir() -> Path:
    """Where compiled kernels live: ``$ZEROSHARD_CACHE`` or the user cache."""
    root = os.environ.get("ZEROSHARD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zeroshard")
    return Path(root) / "kernels"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx or not shutil.which(cxx):
        raise KernelBuildError(
            "no C++ compiler found for the CPU kernels: install g++ "
            "(Debian/Ubuntu: apt-get install g++) or set CXX to one")
    return cxx


@functools.cache
def _machine_key(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return version + model


def _build(src: str, out: Path, cxx: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        cpp = Path(tmp) / "kernel.cpp"
        cpp.write_text(src)
        tmp_so = Path(tmp) / "kernel.so"
        proc = subprocess.run([cxx, *CPU_FLAGS, "-x", "c++", str(cpp), "-o", str(tmp_so)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelBuildError(f"{cxx} failed to build {out.name}:\n{proc.stderr[-4000:]}")
        os.replace(tmp_so, out)


@functools.cache
def load_cpu(family: str) -> ctypes.CDLL:
    """Compile (once, cached on disk) and load the CPU build of a kernel family."""
    return load_cpu_source(source(family, "cpu"), family)


def load_cpu_source(src: str, stem: str) -> ctypes.CDLL:
    """Compile a self-contained C++ source with the kernels' flags, cached by hash."""
    cxx = _compiler()
    key = hashlib.sha256("\0".join([src, *CPU_FLAGS, _machine_key(cxx)]).encode()).hexdigest()
    out = cache_dir() / f"{stem}-{key[:20]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not out.exists():
                log.info("building CPU kernels %s -> %s", stem, out)
                _build(src, out, cxx)
    return ctypes.CDLL(str(out))
