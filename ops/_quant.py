"""Block-quantised int8 and int4 arrays (ZeRO++'s qwZ and qgZ):
:func:`quantize_blocks` and :func:`dequantize_blocks`, one kernel source for
the CPU and the GPU (``ops/kernels/quant.cu``), and
:func:`reduce_scatter_quantized`, a reduce-scatter whose sections cross the
wire quantized ([Note: quantized gradient reduction])."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ops._types import Array
from ops.comm._base import Communicator
from ops.device._arrays import array_kind, check_array, driver_for, dtype_code
from ops.device._device import device_of
from ops.kernels._table import QUANT_GROUP, TABLE

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = ["dequantize_blocks", "quantize_blocks", "reduce_scatter_quantized"]


def quantize_blocks(x: Array, *, bits: int = 8) -> tuple[Array, Array]:
    """``x`` (flat) as int8 values and one float32 scale per block of 256
    elements: ``scale = amax / 127`` for the block's
    largest ``|x|``, ``q = rint(x / scale)``. :func:`dequantize_blocks` reads
    each element back within ``scale / 2`` of it (plus the rounding of one
    float32 product). The same bits on the CPU and on a GPU.

    With ``bits=4``: ``scale = amax / 7`` and ``q`` in ``[-7, 7]``, two values
    a byte (``q + 8``, element ``2i`` in the low nibble of byte ``i``).

    Args:
      x: a finite float32, bfloat16 or float16 array (C-contiguous; read as
        flat), on any device.
      bits: 8 or 4.

    Returns:
      ``(q, scales)``: an int8 array of ``x.size`` (with ``bits=4`` a uint8
      array of ``ceil(x.size / 2)``) and a float32 array of
      ``ceil(x.size / 256)``, on ``x``'s device.

    Examples:
      >>> import numpy as np, ops
      >>> q, scales = ops.quantize_blocks(np.array([0.5, -1.0, 0.25], np.float32))
      >>> q.tolist(), scales.dtype, scales.size
      ([64, -127, 32], dtype('float32'), 1)
      >>> q, scales = ops.quantize_blocks(np.array([0.5, -1.0, 0.25], np.float32), bits=4)
      >>> [(b & 15) - 8 for b in q.tolist()], [(b >> 4) - 8 for b in q.tolist()]
      ([4, 2], [-7, 0])
    """
    code = check_array("quantize_blocks", "x", x, dtypes=("f32", "bf16", "f16"))
    _check_bits("quantize_blocks", bits)
    xp = device_of(x).xp
    q = (xp.empty(x.size, dtype=np.int8) if bits == 8 else
         xp.empty(-(-x.size // 2), dtype=np.uint8))
    scales = xp.empty(-(-x.size // QUANT_GROUP), dtype=np.float32)
    _quantize_into(code, x.reshape(-1), q, scales, bits)
    return q, scales


def _check_bits(fn: str, bits: object) -> None:
    if isinstance(bits, bool) or bits not in (8, 4):
        raise ValueError(f"{fn}: bits must be 8 or 4; got {bits!r}")


def _quantize_into(code: str, x: Array, q: Array, scales: Array, bits: int = 8) -> None:
    """:func:`quantize_blocks` of the checked flat ``x`` into ``q`` and
    ``scales`` (views of larger buffers, laid out as it returns them)."""
    if x.size:
        name = f"zs_quantize_{code}" if bits == 8 else f"zs_quantize4_{code}"
        driver_for(array_kind(x)).elementwise(TABLE[name], x.size, (x, q, scales, x.size))


def dequantize_blocks(q: Array, scales: Array, dtype: DTypeLike = np.float32, *,
                      out: Array | None = None, bits: int = 8,
                      size: int | None = None) -> Array:
    """The values :func:`quantize_blocks` kept: ``q * scale`` of each block, as
    ``dtype`` (float32, bfloat16 or float16; rounded to nearest even).

    Args:
      q: the int8 values (flat); with ``bits=4`` the uint8 pairs.
      scales: their float32 scales, one per block of 256.
      dtype: the output's dtype.
      out: optional flat output of ``q.size`` elements of ``dtype`` (with
        ``bits=4``: of the quantized array's size).
      bits: 8 or 4, as they were quantized.
      size: with ``bits=4`` and no ``out``: how many values (``2 * q.size``
        or one less).

    Examples:
      >>> import numpy as np, ops
      >>> x = np.array([0.5, -1.0, 0.25], np.float32)
      >>> q, scales = ops.quantize_blocks(x)
      >>> bool(np.abs(ops.dequantize_blocks(q, scales) - x).max() <= scales[0] / 2)
      True
    """
    kind = array_kind(q)
    _check_bits("dequantize_blocks", bits)
    want = np.int8 if bits == 8 else np.uint8
    if np.dtype(q.dtype) != want or np.dtype(scales.dtype) != np.float32:
        raise TypeError(f"dequantize_blocks: q must be {np.dtype(want)} and scales float32 "
                        f"(bits={bits}); got {q.dtype} and {scales.dtype}")
    given = q.size if bits == 8 else out.size if out is not None else size
    if given is None or (bits == 4 and -(-given // 2) != q.size):
        raise ValueError(f"dequantize_blocks: {q.size} bytes of 4-bit values hold "
                         f"{2 * q.size} or {2 * q.size - 1} values; pass size= (or out=) with "
                         f"one of them; got {given}")
    n = int(given)
    if scales.size != -(-n // QUANT_GROUP) or array_kind(scales) != kind:
        raise ValueError(f"dequantize_blocks: {n} values need "
                         f"{-(-n // QUANT_GROUP)} scales on their device; got "
                         f"{scales.size} on {array_kind(scales)}")
    code = dtype_code(dtype)
    if code not in ("f32", "bf16", "f16"):
        raise TypeError(f"dequantize_blocks: dtype must be float32, bfloat16 or float16; got "
                        f"{np.dtype(dtype)}")
    if out is None:
        out = device_of(q).xp.empty(n, dtype=np.dtype(dtype))
    else:
        check_array("dequantize_blocks", "out", out, dtypes=(code,), shape=(n,),
                    writeable=True, kind=kind)
    if n:
        name = f"zs_dequantize_{code}" if bits == 8 else f"zs_dequantize4_{code}"
        driver_for(kind).elementwise(TABLE[name], n, (q, scales, out, n))
    return out


def reduce_scatter_quantized(comm: Communicator, out: Array, x: Array, *,
                             hierarchy: tuple[Communicator, Communicator] | None = None,
                             bits: int = 8) -> _QuantizedReduction:
    """[Note: quantized gradient reduction]
    ``comm.reduce_scatter_into(out, x, "sum")`` with the sections that cross
    the wire as int8 (ZeRO++'s qgZ): each rank block-quantizes every other
    rank's section of ``x`` (:func:`quantize_blocks`, blocks from the
    section's start), an all-to-all sends each rank its sections' values and
    scales, and each rank dequantizes them and adds them to its own section,
    which never left it, in rank order in float32. Rank ``r``'s section
    arrives within half of each of its blocks' scales (``amax / 127``): the
    sum within the sum of those bounds. A rank sends ``(W - 1)(k + 4
    ceil(k / 256))`` bytes for sections of ``k`` elements, where the exact
    reduce-scatter sends ``(W - 1) k`` elements (4 bytes each in float32).
    With ``bits=4`` the values are int4 (a scale of ``amax / 7``, two a byte):
    ``(W - 1)(ceil(k / 2) + 4 ceil(k / 256))`` bytes, each section within half
    of its blocks' scales, 127 / 7 times int8's.

    With ``hierarchy=(local, node)`` (the W ranks as ``W / L`` nodes of ``L``
    consecutive ranks, as ``reshard_after_forward=L`` groups them; see [Note:
    secondary shards] in ``shard/step/_runtime.py``), the reduction runs in
    two hops, as ZeRO++'s hierarchical qgZ: first an exact reduce-scatter
    inside the node, which leaves place ``l`` of the node with the node's sum
    of the sections of place ``l`` on every node, and then the quantized
    all-to-all above across the nodes, among the ranks at place ``l``. A rank
    then sends ``(N - 1)(k + 4 ceil(k / 256))`` bytes across nodes for N
    nodes, ``1 / L`` of the flat form's.

    The inside hop (if any) and the quantization run now; the all-to-all
    runs asynchronously; ``wait()`` on the returned handle adds the sections
    and returns ``out``.

    Args:
      comm: this rank's communicator (W ranks).
      out: this rank's section of the sum: ``k`` elements of float32,
        bfloat16 or float16.
      x: the ``W k`` elements this rank adds, of ``out``'s dtype.
      hierarchy: ``(local, node)``: this node's ranks and this place's ranks
        on every node, or None for the flat form.
      bits: 8 or 4.
    """
    k, w = out.size, comm.world_size
    code = check_array("reduce_scatter_quantized", "x", x.reshape(-1),
                       dtypes=("f32", "bf16", "f16"))
    check_array("reduce_scatter_quantized", "out", out, dtypes=(code,), shape=(k,), writeable=True,
                kind=array_kind(x))
    if x.size != w * k:
        raise ValueError(f"reduce_scatter_quantized on rank {comm.rank}: with world_size={w}, "
                         f"input of {x.size} and output of {k} elements do not fit")
    _check_bits("reduce_scatter_quantized", bits)
    x = x.reshape(-1)
    if hierarchy is None or w == 1:
        return _QuantizedReduction(comm, out, x, code, bits)
    local, node = hierarchy
    per_node, nodes = local.world_size, node.world_size
    if per_node * nodes != w:
        raise ValueError(f"reduce_scatter_quantized: {nodes} nodes of {per_node} ranks are not "
                         f"the communicator's {w}")
    xp = device_of(x).xp
    by_place = xp.empty(w * k, dtype=x.dtype)  # (nodes, per_node, k) -> (per_node, nodes, k)
    for n in range(nodes):
        for p in range(per_node):
            xp.copyto(by_place[(p * nodes + n) * k:(p * nodes + n + 1) * k],
                      x[(n * per_node + p) * k:(n * per_node + p + 1) * k])
    node_sum = xp.empty(nodes * k, dtype=x.dtype)
    local.reduce_scatter_into(node_sum, by_place, "sum")
    return _QuantizedReduction(node, out, node_sum, code, bits)


class _QuantizedReduction:
    """A quantized reduce-scatter in flight (see [Note: quantized gradient
    reduction]): the sections quantized and their all-to-all started."""

    def __init__(self, comm: Communicator, out: Array, x: Array, code: str, bits: int) -> None:
        w, k, me = comm.world_size, out.size, comm.rank
        blocks, nq = -(-k // QUANT_GROUP), (k if bits == 8 else -(-k // 2))
        xp = device_of(x).xp
        dtype = np.int8 if bits == 8 else np.uint8
        self.comm, self.out, self.x, self.xp, self.bits = comm, out, x, xp, bits
        q, scales = xp.empty(w * nq, dtype=dtype), xp.empty(w * blocks, dtype=np.float32)
        for r in range(w):
            if r != me:
                _quantize_into(code, x[r * k:(r + 1) * k], q[r * nq:(r + 1) * nq],
                               scales[r * blocks:(r + 1) * blocks], bits)
        self.q, self.scales = xp.empty(w * nq, dtype=dtype), xp.empty(w * blocks, np.float32)
        self.works = ([comm.all_to_all_async(self.q, q), comm.all_to_all_async(self.scales, scales)]
                      if w > 1 else [])
        self.blocks, self.nq = blocks, nq

    def wait(self) -> Array:
        for work in self.works:
            work.wait()
        comm, out, xp, k, b, nq = self.comm, self.out, self.xp, self.out.size, self.blocks, self.nq
        f32 = np.dtype(out.dtype) == np.float32
        total = out if f32 else xp.empty(k, dtype=np.float32)
        part = xp.empty(k, dtype=np.float32)
        for r in range(comm.world_size):
            if r == comm.rank:
                mine = self.x[r * k:(r + 1) * k]
                xp.copyto(part, mine if f32 else mine.astype(np.float32))
            else:
                dequantize_blocks(self.q[r * nq:(r + 1) * nq], self.scales[r * b:(r + 1) * b],
                                  np.float32, out=part, bits=self.bits)
            if r == 0:
                xp.copyto(total, part)
            else:
                xp.add(total, part, out=total)
        if not f32:
            out[...] = total.astype(out.dtype)
        return out
