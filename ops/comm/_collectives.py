"""Functional collectives: arrays in, new arrays out.

Each call takes any array a communicator's backend can move (numpy, cupy or the
device stand-in, and
torch tensors or jax arrays through DLPack, zero-copy where possible) and
returns the same kind it was given. See [Note: collective semantics] in
``ops/comm/_base.py`` for what each collective means.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ops._types import Array
from ops.comm._base import Communicator
from ops.device._device import device_of
from ops.device._dlpack import to_native

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = ["all_gather", "all_gather_host", "all_reduce", "all_to_all", "broadcast", "from_comm",
           "reduce_scatter", "to_comm"]


def _flat(name: str, x: Array) -> Array:
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: the input must be C-contiguous; got strides {x.strides}")
    return x.reshape(-1)


def all_gather(comm: Communicator, x: object, *, out: object = None) -> Any:
    """Every rank's ``x``, concatenated in rank order along the first axis.

    Args:
      comm: this rank's communicator.
      x: this rank's array; every rank must pass the same shape and dtype.
      out: optional output, ``world_size * x.size`` elements.

    Returns:
      An array of shape ``(world_size * x.shape[0], *x.shape[1:])`` (for a scalar
      ``x``, ``(world_size,)``), of ``x``'s kind.
    """
    native, back = to_native(x)
    flat = _flat("all_gather", native)
    shape = (comm.world_size * native.shape[0], *native.shape[1:]) if native.ndim else \
        (comm.world_size,)
    buf = comm.allocate(flat.size * comm.world_size, flat.dtype, device=device_of(flat)) \
        if out is None else \
        to_native(out)[0].reshape(-1)
    comm.all_gather_into(buf, flat)
    return back(buf.reshape(shape)) if out is None else out


def to_comm(comm: Communicator, a: np.ndarray) -> Array:
    """The host array ``a`` where ``comm`` moves it: ``a`` itself, or on a backend
    that moves device memory only (NCCL) an explicit copy on its device."""
    return a if comm.host_memory is not False else comm.device.from_host(a)


def from_comm(comm: Communicator, x: Any) -> np.ndarray:
    """What :func:`to_comm` gave, or a collective of ``comm`` filled, on the host
    (an explicit copy from the device on NCCL)."""
    return x if comm.host_memory is not False else comm.device.to_host(x)


def all_gather_host(comm: Communicator, x: np.ndarray) -> np.ndarray:
    """:func:`all_gather` of a small host array (checksums, sizes) over any
    backend (see :func:`to_comm`)."""
    return from_comm(comm, all_gather(comm, to_comm(comm, x)))


def reduce_scatter(comm: Communicator, x: object, *, op: str = "sum",
                   dtype: DTypeLike | None = None, out: object = None) -> Any:
    """This rank's slice of the elementwise sum (or mean) of every rank's ``x``.

    ``x`` is split along its first axis into ``world_size`` equal chunks; rank r
    receives the reduction of chunk r. With ``dtype`` (e.g. ``np.float32`` for
    bfloat16 inputs) the inputs are widened first and the sum is carried out
    and returned in that dtype.

    Args:
      comm: this rank's communicator.
      x: an array whose first dimension (or size, for 1-D) divides by world_size.
      op: ``"sum"`` or ``"mean"``.
      dtype: optional wider dtype to reduce in.
      out: optional output with ``x.size // world_size`` elements.
    """
    native, back = to_native(x)
    flat = _flat("reduce_scatter", native)
    lead = native.shape[0] if native.ndim else 1
    if lead % comm.world_size:
        raise ValueError(f"reduce_scatter: the first dimension ({lead}) must divide by "
                         f"world_size={comm.world_size}; pad it (shard.partition does)")
    if dtype is not None and np.dtype(dtype) != flat.dtype:
        flat = flat.astype(dtype)
    k = flat.size // comm.world_size
    buf = comm.allocate(k, flat.dtype, device=device_of(flat)) if out is None else \
        to_native(out)[0].reshape(-1)
    comm.reduce_scatter_into(buf, flat, op)
    shape = (lead // comm.world_size, *native.shape[1:])
    return back(buf.reshape(shape)) if out is None else out


def all_to_all(comm: Communicator, x: object) -> Any:
    """Each rank's ``x`` split along its first axis into ``world_size`` equal
    chunks, chunk r sent to rank r: the result's chunk s is rank s's chunk
    for this rank (``torch.distributed.all_to_all_single``'s equal split).

    Args:
      comm: this rank's communicator.
      x: an array whose first dimension divides by world_size; every rank
        passes the same shape and dtype.

    Returns:
      An array of ``x``'s shape and kind.
    """
    native, back = to_native(x)
    flat = _flat("all_to_all", native)
    lead = native.shape[0] if native.ndim else 1
    if lead % comm.world_size:
        raise ValueError(f"all_to_all: the first dimension ({lead}) must divide by "
                         f"world_size={comm.world_size}")
    buf = comm.allocate(flat.size, flat.dtype, device=device_of(flat))
    comm.all_to_all_into(buf, flat)
    return back(buf.reshape(native.shape))


def all_reduce(comm: Communicator, x: object, *, op: str = "sum") -> Any:
    """The elementwise sum (or mean) of every rank's ``x``, as a new array."""
    native, back = to_native(x)
    buf = comm.allocate(native.size, native.dtype, device=device_of(native))
    buf[...] = _flat("all_reduce", native)
    comm.all_reduce_(buf, op)
    return back(buf.reshape(native.shape))


def broadcast(comm: Communicator, x: object, *, src: int = 0) -> Any:
    """Rank ``src``'s ``x`` on every rank, as a new array."""
    native, back = to_native(x)
    buf = comm.allocate(native.size, native.dtype, device=device_of(native))
    buf[...] = _flat("broadcast", native)
    comm.broadcast_(buf, src)
    return back(buf.reshape(native.shape))

