"""Copies of many runs of elements in one kernel launch (``ops/kernels/copy.cu``).

A ZeRO-3 unit's leaves leave its all-gathered (W, S) sections, and its
gradients enter that layout for the reduce-scatter, as many short runs: a leaf's
rows on each rank. One launch moves all of a unit's runs, where a copy per
leaf and rank would be a launch each (FSDP2 does the same with
``split_with_sizes_copy`` and ``_chunk_cat``). A :class:`Runs` table is built
once on the host; a table whose runs read from one source buffer is copied to
the device once and reused, and one that reads from separate tensors (a
unit's gradients, new every step) is filled with their addresses and copied
over per call, in one transfer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ops._types import Array
from ops.device._arrays import BF16
from ops.device._device import Device, device_of_or_none
from ops.kernels._table import QUANT_GROUP, TABLE, runs_kernel

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, DTypeLike

__all__ = ["Runs", "contiguous_on", "copy_runs", "dequantize_runs"]


class Runs:
    """Runs of elements: ``lengths[k]`` elements from ``src + src[k]`` to
    ``dst + dst[k]`` (element offsets; see ``ops/kernels/copy.cu``).

    Empty runs are dropped. For a table over separate tensors, ``src`` holds
    byte offsets into the tensor numbered ``tensor[k]`` (-1: a run of zeros),
    and :meth:`with_addresses` gives the table for one call's tensors.
    """

    def __init__(self, src: ArrayLike, dst: ArrayLike, lengths: ArrayLike, *,
                 tensor: ArrayLike | None = None) -> None:
        lengths = np.asarray(lengths, np.int64)
        keep = lengths > 0
        self.src = np.asarray(src, np.int64)[keep]
        self.dst = np.asarray(dst, np.int64)[keep]
        self.tensor = None if tensor is None else np.asarray(tensor, np.int64)[keep]
        self.nruns = int(keep.sum())
        self.starts = np.concatenate([[0], np.cumsum(lengths[keep])]).astype(np.int64)
        self.total = int(self.starts[-1])
        self._tables: dict[str, tuple[Array, Array]] = {}  # by device: constant tables
        self._buffers: dict[str, Array] = {}  # by device: the buffer per-call tables go to

    def table(self, device: Device) -> tuple[Array, Array]:
        """``(runs, starts)`` on ``device``: copied there once."""
        hit = self._tables.get(device.name)
        if hit is None:
            hit = self._tables[device.name] = _upload(self._pairs(self.src), self.starts, device)
        return hit

    def with_addresses(self, addresses: np.ndarray, device: Device) -> tuple[Array, Array]:
        """``(runs, starts)`` on ``device`` for tensors at ``addresses`` (int64, one
        per tensor; 0 for a tensor that is absent: its runs write zeros). The
        table is written into one device buffer kept for this (one transfer,
        stream-ordered after the launch that read it last)."""
        base = np.append(addresses, 0)[self.tensor]  # tensor -1: the appended 0
        src = np.where(base != 0, base + self.src, 0)
        host = np.concatenate([self._pairs(src), self.starts])
        if device.host:
            table: Array = host
        else:
            cached = self._buffers.get(device.name)
            if cached is None:
                cached = self._buffers[device.name] = device.empty(host.size, np.int64)
            table = cached
            device.from_host_into(table, host)
        return table[:2 * self.nruns], table[2 * self.nruns:]

    def _pairs(self, src: np.ndarray) -> np.ndarray:
        return np.stack([src, self.dst], axis=1).reshape(-1)


def _upload(runs: np.ndarray, starts: np.ndarray, device: Device) -> tuple[Array, Array]:
    host = np.concatenate([runs, starts])  # one transfer for both
    table = host if device.host else device.from_host(host)
    return table[:runs.size], table[runs.size:]


def contiguous_on(x: Any, device: Device) -> tuple[int, np.dtype, int] | None:
    """``(address, dtype, size)`` of ``x`` where a kernel on ``device`` may read it
    in place: a C-contiguous array of that device, or a contiguous torch tensor
    sharing its memory; None for anything else (the caller converts it)."""
    # x: Any: a torch tensor, or an array whose address (.ctypes, CuPy's .data.ptr)
    # ops.Array leaves out
    if type(x).__module__.split(".")[0] == "torch":
        if x.device.type != device.torch_device or not x.is_contiguous():
            return None
        dtype = _TORCH_DTYPES.get(str(x.dtype))
        return None if dtype is None else (x.data_ptr(), dtype, x.numel())
    if device_of_or_none(x) is not device or not x.flags.c_contiguous:
        return None
    return (x.ctypes.data if device.host else x.data.ptr), x.dtype, x.size


_TORCH_DTYPES = {"torch.float32": np.dtype(np.float32), "torch.float64": np.dtype(np.float64),
                 "torch.float16": np.dtype(np.float16), "torch.bfloat16": BF16}


def copy_runs(dst: Array, runs: Runs, table: tuple[Array, Array], *, device: Device,
              src: Any = None, src_dtype: DTypeLike | None = None) -> None:
    """Copy every run into ``dst`` in one launch: from ``src`` where given, else
    from the addresses in ``table`` (made by :meth:`Runs.with_addresses`), whose
    elements are ``src_dtype``. 16-bit floats widen to a float32 ``dst``."""
    if runs.total == 0:
        return
    kernel = runs_kernel(src.dtype if src is not None else src_dtype, dst.dtype)
    if kernel is None:
        raise TypeError(f"copy_runs: no kernel copies {src_dtype or src.dtype} into "
                        f"{dst.dtype}")
    device.driver().elementwise(kernel, runs.total, (src, dst, *table, runs.nruns))


def dequantize_runs(dst: Array, runs: Runs, table: tuple[Array, Array], *, q: Array,
                    scales: Array,
                    section: int, device: Device) -> None:
    """:func:`copy_runs` from block-quantized int8 sections (qwZ's all-gather:
    ``section`` elements a rank, each section's float32 scales, one per 256,
    from its start; see ``ops.quantize_blocks``), each element dequantized
    into ``dst``'s dtype (float32, bfloat16 or float16) as it is copied: the
    bits of ``ops.dequantize_blocks`` then a copy, in one launch."""
    if runs.total == 0:
        return
    code = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(np.dtype(dst.dtype).name)
    if code is None or np.dtype(q.dtype) != np.int8 or np.dtype(scales.dtype) != np.float32:
        raise TypeError(f"dequantize_runs: int8 values and float32 scales into float32, "
                        f"bfloat16 or float16; got {q.dtype}, {scales.dtype} into {dst.dtype}")
    blocks = -(-section // QUANT_GROUP)
    device.driver().elementwise(TABLE[f"zs_dequantize_runs_{code}"], runs.total,
                                (q, scales, dst, *table, runs.nruns, section, blocks))
