"""The kernel table: every ``__global__`` entry point, its parameters, and its
host driver, shared by the CPU driver (ctypes) and the CUDA driver (CuPy).

One table means one place where argument order and types are written down: a
mistake here shows on the CPU, where the CUDA driver's marshalling is run
through the emulation of the very kernel it would launch on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ops.kernels._dtypes import BF16

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = ["ADAM_MULTI_PARAMS", "EXACT_SLOTS", "LAMB_CHUNK", "QUANT_GROUP", "TABLE", "Kernel",
           "adam_kernel", "cast_kernel", "lamb_kernels", "lion_kernel", "runs_kernel",
           "sumsq_kernels"]

# Parameter kinds: "ptr" (an array, or None for a null pointer), "f4", "f8", "i8".
_ADAM_PARAMS = (
    ("p", "ptr"), ("g", "ptr"), ("m", "ptr"), ("v", "ptr"), ("copy", "ptr"), ("n", "i8"),
    ("sumsq", "ptr"), ("beta1", "f4"), ("beta2", "f4"), ("omb1", "f4"), ("omb2", "f4"),
    ("step_size", "f4"), ("bc2_sqrt", "f4"), ("eps", "f4"), ("decay", "f4"), ("l2", "f4"),
    ("grad_scale", "f4"), ("max_norm", "f4"),
)
_CAST_PARAMS = (("x", "ptr"), ("y", "ptr"), ("n", "i8"))
_QUANT_PARAMS = (("x", "ptr"), ("q", "ptr"), ("scales", "ptr"), ("n", "i8"))
_DEQUANT_PARAMS = (("q", "ptr"), ("scales", "ptr"), ("y", "ptr"), ("n", "i8"))
# qwZ's fused copy-out: the runs of _RUNS_PARAMS read from int8 sections
_DEQUANT_RUNS_PARAMS = (("q", "ptr"), ("scales", "ptr"), ("dst", "ptr"), ("runs", "ptr"),
                        ("starts", "ptr"), ("nruns", "i8"), ("section", "i8"), ("blocks", "i8"))
# the int4 forms take the same (q: ceil(n / 2) bytes, two values each)
_SIGN_PARAMS = (("x", "ptr"), ("e", "ptr"), ("bits", "ptr"), ("scales", "ptr"), ("n", "i8"))
_SIGN_ADD_PARAMS = (("bits", "ptr"), ("scales", "ptr"), ("y", "ptr"), ("n", "i8"),
                    ("weight", "f4"))
_SUMSQ_PARAMS = (("x", "ptr"), ("n", "i8"), ("partials", "ptr"))
_SUMSQ_HOST_PARAMS = (("ptrs", "ptr"), ("sizes", "ptr"), ("n", "i8"), ("out", "ptr"))
_ADAM_MULTI_PARAMS = (("ptrs", "ptr"), ("sizes", "ptr"), ("n", "i8"), *_ADAM_PARAMS[6:])
_FINISH_PARAMS = (("partials", "ptr"), ("nparts", "i8"), ("out", "ptr"))
# Runs of elements (see ops/kernels/copy.cu): runs holds (source, destination
# offset) pairs, starts each run's first index (nruns + 1 entries).
_RUNS_PARAMS = (("src", "ptr"), ("dst", "ptr"), ("runs", "ptr"), ("starts", "ptr"),
                ("nruns", "i8"))
# Multi-tensor launches: a device table of pointers and the tensors' starts.
_ADAM_TABLE_PARAMS = (("ptrs", "ptr"), ("starts", "ptr"), ("n", "i8"), *_ADAM_PARAMS[6:])
_SUMSQ_TABLE_PARAMS = (("ptrs", "ptr"), ("starts", "ptr"), ("n", "i8"), ("partials", "ptr"))
# LAMB's two passes (ops/kernels/lamb.cu) over a table of (p, g, m, v, copy)
# per tensor; the stats pass also takes each tensor's first chunk (``chunks``).
_LAMB_SCALARS = (("sumsq", "ptr"), *((name, "f4") for name in (
    "beta1", "beta2", "omb1", "omb2", "inv_bc1", "inv_bc2", "eps", "eps_root", "wd", "lr",
    "trust_min", "trust_max", "grad_scale", "max_norm")))
_LAMB_STATS_PARAMS = (("ptrs", "ptr"), ("starts", "ptr"), ("chunks", "ptr"), ("n", "i8"),
                      *_LAMB_SCALARS, ("partials", "ptr"))
_LAMB_APPLY_PARAMS = (("ptrs", "ptr"), ("starts", "ptr"), ("n", "i8"), *_LAMB_SCALARS,
                      ("sums", "ptr"))
_LAMB_HOST_PARAMS = (("ptrs", "ptr"), ("sizes", "ptr"), ("n", "i8"), *_LAMB_SCALARS,
                     ("sums", "ptr"))
_LAMB_FINISH_PARAMS = (("chunks", "ptr"), ("n", "i8"), ("partials", "ptr"), ("sums", "ptr"))
LAMB_CHUNK = 4096  # ZS_LAMB_CHUNK: elements per chunk of the stats pass
EXACT_SLOTS = 513  # ZS_EXACT_SLOTS: an exact sum of squares' int64 slots
QUANT_GROUP = 256  # ZS_QUANT_GROUP: elements per int8 group and its scale

ADAM_MULTI_PARAMS = _ADAM_MULTI_PARAMS
DTYPE_CODES = ("f32", "bf16", "f16")
COPY_CODES = ("none", "bf16", "f16")


@dataclass(frozen=True)
class Kernel:
    """One ``extern "C" __global__`` kernel and its CPU host driver.

    Attributes:
      name: the kernel's C name (``RawModule.get_function`` and ``zs_emu_<name>``).
      family: the ``ops/kernels/<family>.cu`` file that defines it.
      params: ``(name, kind)`` pairs in C order.
      block: the block size every launch uses (``__launch_bounds__``).
      host: the host driver's C name, or None when the kernel has none.
      host_params: the host driver's parameters when they differ from ``params``.
      multi_host: a host driver over many tensors in one call (``ptrs``: an int64
        array of each tensor's pointers, ``sizes``: their lengths), or None.
      multi: the ``__global__`` kernel that does this kernel's work over many
        tensors in one launch (a device table of pointers and starts), or None.
    """

    name: str
    family: str
    params: tuple[tuple[str, str], ...]
    block: int = 256
    host: str | None = None
    host_params: tuple[tuple[str, str], ...] | None = None
    multi_host: str | None = None
    multi: str | None = None

    @property
    def host_signature(self) -> tuple[tuple[str, str], ...]:
        return self.host_params if self.host_params is not None else self.params

    @property
    def from_host(self) -> str | None:
        """The out-of-place host driver of an Adam kernel (its old param and
        moments read from three more leading pointers), or None."""
        return self.host[:-len("_host")] + "_from_host" if self.family == "adam" and \
            self.host else None


def _entries() -> dict[str, Kernel]:
    table: dict[str, Kernel] = {}
    for g in DTYPE_CODES:
        for c in COPY_CODES:
            name = f"zs_adam_{g}_{c}"
            multi = f"zs_adam_multi_{g}_{c}"
            table[name] = Kernel(name, "adam", _ADAM_PARAMS, host=name + "_host",
                                 multi_host=name + "_multi_host", multi=multi)
            table[multi] = Kernel(multi, "adam", _ADAM_TABLE_PARAMS)
            # Lion (lion.cu) takes Adam's parameters (see ops/kernels/optim.cuh)
            name, multi = f"zs_lion_{g}_{c}", f"zs_lion_multi_{g}_{c}"
            table[name] = Kernel(name, "lion", _ADAM_PARAMS, host=name + "_host",
                                 multi_host=name + "_multi_host", multi=multi)
            table[multi] = Kernel(multi, "lion", _ADAM_TABLE_PARAMS)
    for code in DTYPE_CODES:
        name = f"zs_lamb_stats_{code}"
        table[name] = Kernel(name, "lamb", _LAMB_STATS_PARAMS, host=name + "_host",
                             host_params=_LAMB_HOST_PARAMS)
    for code in COPY_CODES:
        name = f"zs_lamb_apply_{code}"
        table[name] = Kernel(name, "lamb", _LAMB_APPLY_PARAMS, host=name + "_host",
                             host_params=_LAMB_HOST_PARAMS)
    table["zs_lamb_finish"] = Kernel("zs_lamb_finish", "lamb", _LAMB_FINISH_PARAMS)
    for x, y in (("f32", "bf16"), ("f32", "f16"), ("bf16", "f32"), ("f16", "f32")):
        name = f"zs_cast_{x}_{y}"
        table[name] = Kernel(name, "cast", _CAST_PARAMS, host=name + "_host")
    for x in DTYPE_CODES:
        name = f"zs_sumsq_partial_{x}"
        multi = f"zs_sumsq_multi_partial_{x}"
        table[name] = Kernel(name, "reduce", _SUMSQ_PARAMS, host=f"zs_sumsq_{x}_host",
                             host_params=_SUMSQ_HOST_PARAMS, multi=multi)
        table[multi] = Kernel(multi, "reduce", _SUMSQ_TABLE_PARAMS)
    table["zs_sumsq_finish"] = Kernel("zs_sumsq_finish", "reduce", _FINISH_PARAMS)
    for x in DTYPE_CODES:  # block-quantised int8 and int4 (see quant.cu)
        table[f"zs_quantize_{x}"] = Kernel(f"zs_quantize_{x}", "quant", _QUANT_PARAMS,
                                           host=f"zs_quantize_{x}_host")
        table[f"zs_dequantize_{x}"] = Kernel(f"zs_dequantize_{x}", "quant", _DEQUANT_PARAMS,
                                             host=f"zs_dequantize_{x}_host")
        table[f"zs_quantize4_{x}"] = Kernel(f"zs_quantize4_{x}", "quant", _QUANT_PARAMS,
                                            host=f"zs_quantize4_{x}_host")
        table[f"zs_dequantize4_{x}"] = Kernel(f"zs_dequantize4_{x}", "quant", _DEQUANT_PARAMS,
                                              host=f"zs_dequantize4_{x}_host")
        name = f"zs_dequantize_runs_{x}"
        table[name] = Kernel(name, "quant", _DEQUANT_RUNS_PARAMS, host=name + "_host")
    # 1-bit compression with error feedback (see quant.cu), float32 only
    table["zs_sign_compress"] = Kernel("zs_sign_compress", "quant", _SIGN_PARAMS,
                                       host="zs_sign_compress_host")
    table["zs_sign_add"] = Kernel("zs_sign_add", "quant", _SIGN_ADD_PARAMS,
                                  host="zs_sign_add_host")
    for x in DTYPE_CODES:  # exact sums of squares: integer slots (see reduce.cu)
        name = f"zs_exact_sumsq_partial_{x}"
        table[name] = Kernel(name, "reduce", _SUMSQ_PARAMS, host=f"zs_exact_sumsq_{x}_host",
                             host_params=_SUMSQ_HOST_PARAMS)
    table["zs_exact_sumsq_finish"] = Kernel("zs_exact_sumsq_finish", "reduce", _FINISH_PARAMS)
    for name in ("zs_copy_runs_b2", "zs_copy_runs_b4", "zs_copy_runs_b8", "zs_widen_runs_bf16",
                 "zs_widen_runs_f16"):
        table[name] = Kernel(name, "copy", _RUNS_PARAMS, host=name + "_host")
    return table


TABLE: dict[str, Kernel] = _entries()


def adam_kernel(grad_code: str, copy_code: str) -> Kernel:
    return TABLE[f"zs_adam_{grad_code}_{copy_code}"]


def lion_kernel(grad_code: str, copy_code: str) -> Kernel:
    return TABLE[f"zs_lion_{grad_code}_{copy_code}"]


def lamb_kernels(grad_code: str, copy_code: str) -> tuple[Kernel, Kernel, Kernel]:
    """LAMB's (stats, finish, apply) kernels for these grads and param copies."""
    return (TABLE[f"zs_lamb_stats_{grad_code}"], TABLE["zs_lamb_finish"],
            TABLE[f"zs_lamb_apply_{copy_code}"])


def cast_kernel(src_code: str, dst_code: str) -> Kernel:
    return TABLE[f"zs_cast_{src_code}_{dst_code}"]


def runs_kernel(src_dtype: DTypeLike | None, dst_dtype: DTypeLike) -> Kernel | None:
    """The kernel copying runs of ``src_dtype`` elements into ``dst_dtype`` ones:
    raw copies between equal dtypes, widening of 16-bit floats into float32;
    None for any other pair."""
    src, dst = np.dtype(src_dtype), np.dtype(dst_dtype)
    if src == dst:
        return TABLE.get(f"zs_copy_runs_b{src.itemsize}")
    widen = {BF16: "zs_widen_runs_bf16", np.dtype(np.float16): "zs_widen_runs_f16"}
    return TABLE[widen[src]] if dst == np.float32 and src in widen else None


def sumsq_kernels(code: str, *, exact: bool = False) -> tuple[Kernel, Kernel]:
    """The (per-block partial, one-block finish) pair for a sum of squares (with
    ``exact``, its integer slots: see [Note: exact sums of squares])."""
    prefix = "zs_exact_sumsq" if exact else "zs_sumsq"
    return TABLE[f"{prefix}_partial_{code}"], TABLE[f"{prefix}_finish"]
