"""Devices: where an array lives, and what serves arrays there.

[Note: devices]
Every buffer the library allocates or updates belongs to a :class:`Device`:

- ``HOST`` (name ``"numpy"``): numpy arrays in host memory, the CPU build of
  the kernels, gloo or thread-rank collectives;
- ``"cupy"``: CuPy arrays on a GPU, the CUDA build of the same kernel source
  launched through ``cupy.RawModule``, NCCL or thread-rank collectives;
- ``"standin"``: :mod:`ops.testing`'s strict stand-in for a GPU, whose arrays
  refuse implicit conversion to numpy as CuPy's do and whose kernels are the
  CUDA kernels themselves, emulated on the CPU.

The data decides: :func:`device_of` reads an array's device from its type, and
code that allocates does so through that device (``device.empty``,
``device.zeros``), never through ``np.`` directly. Crossing between host and
device memory is explicit and named (``to_host``, ``from_host``); arrays of
other frameworks on the same device arrive zero-copy through DLPack
(``from_dlpack``). A step on device state therefore reads nothing back to the
host unless it says so.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ops._types import Array

if TYPE_CHECKING:
    import jax
    import torch
    from numpy.typing import DTypeLike

    from ops.kernels._cpu import CpuDriver
    from ops.kernels._cuda import CudaDriver

__all__ = ["HOST", "Device", "aligned_empty", "cupy_device", "device_named", "device_of",
           "register_device"]


def aligned_empty(n: int, dtype: DTypeLike, align: int = 64) -> np.ndarray:
    """An uninitialised 1-D numpy array whose data is ``align``-byte aligned.

    JAX copies any host buffer that is not 64-byte aligned when it is handed
    one through DLPack; buffers from here are shared zero-copy.
    """
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset:offset + n * dtype.itemsize].view(dtype)


@dataclass(frozen=True, eq=False)
class Device:
    """An array module and what the library needs from it.

    Attributes:
      name: ``"numpy"``, ``"cupy"`` or ``"standin"``.
      xp: the array module (numpy, cupy, or the stand-in's).
      host: True when the CPU reads the memory directly (numpy only).
      driver: a function returning the kernel driver (CPU or CUDA build).
      to_host: an explicit device-to-host copy, returning a numpy array.
      from_host: an explicit host-to-device copy of a numpy array.
      from_dlpack: a zero-copy view of a DLPack producer on this device.
      synchronize: waits for the device's queued work (a no-op on the host).
      torch_device: the torch device type whose tensors share this memory.
      memory_owner: the object whose lifetime is an array's memory's (views and
        DLPack exports keep it alive); the array itself where views keep their
        base alive, as numpy's and CuPy's do.
    """

    name: str
    xp: types.ModuleType | types.SimpleNamespace  # the stand-in's is a namespace
    host: bool
    driver: Callable[[], CpuDriver | CudaDriver] = field(repr=False)
    to_host: Callable[[Array], np.ndarray] = field(repr=False)
    # Any: the device's own array type (the stand-in's StandInArray is an Array
    # at run time only, and CuPy's arrays are untyped); memory_owner likewise
    from_host: Callable[[np.ndarray], Any] = field(repr=False)
    from_dlpack: Callable[[torch.Tensor | jax.Array], Any] = field(repr=False)
    synchronize: Callable[[], None] = field(repr=False, default=lambda: None)
    torch_device: str = "cpu"
    memory_owner: Callable[[Any], object] = field(repr=False, default=lambda a: a)
    pinned: Callable[[int, DTypeLike], np.ndarray] | None = field(repr=False, default=None)
    copy_to_host: Callable[[Array, np.ndarray], None] | None = field(repr=False, default=None)
    copy_from_host: Callable[[Array, np.ndarray], None] | None = field(repr=False, default=None)
    # Any: CuPy's array, whose .device (a context manager) is not in ops.Array
    current: Callable[[Any], contextlib.AbstractContextManager[object]] = field(
        repr=False, default=lambda a: contextlib.nullcontext())

    def using(self, x: Array) -> contextlib.AbstractContextManager[object]:
        """A context in which this thread's work runs where ``x`` lives (the GPU
        holding it, for a thread other than the one that made it)."""
        return self.current(x)

    def pinned_empty(self, n: int, dtype: DTypeLike) -> np.ndarray:
        """A flat host buffer for copies to and from this device: page-locked on
        a GPU (so copies run at the bus's rate, with no staging copy), a
        64-byte aligned numpy array elsewhere."""
        if self.pinned is None:
            return aligned_empty(n, dtype)
        return self.pinned(n, dtype)

    # x, dst: Any, as numpy's np.copyto takes them on the host (an ops.Array is not
    # numpy's ArrayLike)
    def to_host_into(self, x: Any, out: np.ndarray) -> np.ndarray:
        """An explicit device-to-host copy of the flat array ``x`` into ``out``."""
        if self.host:
            np.copyto(out, x)
        elif self.copy_to_host is not None:
            self.copy_to_host(x, out)
        else:
            out[...] = self.to_host(x)
        return out

    def from_host_into(self, dst: Any, src: np.ndarray) -> None:
        """An explicit host-to-device copy of the flat host array ``src`` into
        ``dst`` (same size and dtype)."""
        if self.host:
            np.copyto(dst, src)
        elif self.copy_from_host is not None:
            self.copy_from_host(dst, src)
        else:
            dst[...] = self.from_host(src)

    def empty(self, n: int, dtype: DTypeLike) -> Array:
        """An uninitialised flat buffer of the device's own arrays (64-byte
        aligned on the host)."""
        if self.host:
            return aligned_empty(n, dtype)
        return self.xp.empty(n, dtype=np.dtype(dtype))

    def zeros(self, n: int, dtype: DTypeLike) -> Array:
        buf = self.empty(n, dtype)
        buf[...] = 0
        return buf

    def asarray(self, x: Any, *, what: str = "array") -> Array:
        """``x`` on this device: itself if it is already here, a zero-copy view
        of a torch tensor or jax array that lives here, or an explicit copy of a
        host (numpy) array. ``what`` names ``x`` in errors."""
        if device_of_or_none(x) is self:
            return x
        if isinstance(x, np.ndarray):
            return x if self.host else self.from_host(np.require(x, requirements="C"))
        module = type(x).__module__.split(".")[0]
        if module == "torch":
            return self.from_torch(x)
        if module in ("jax", "jaxlib"):
            return self.from_jax(x)
        if np.isscalar(x) or isinstance(x, (list, tuple)):
            return np.asarray(x) if self.host else self.from_host(np.asarray(x))
        other = device_of_or_none(x)
        raise TypeError(f"{what}: a {other.name if other else type(x).__qualname__} array cannot "
                        f"be used where {self.name} arrays are expected; move it explicitly")

    def from_torch(self, t: torch.Tensor) -> Any:  # Any: np.ndarray on the host
        """A view of a torch tensor on this device (bfloat16 included)."""
        import torch

        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.device.type != self.torch_device:
            raise TypeError(f"a torch tensor on {t.device} cannot be viewed as a {self.name} "
                            "array; move the module or the data to one device")
        if t.dtype == torch.bfloat16:
            from ops.device._arrays import BF16

            return self.from_dlpack(t.view(torch.int16)).view(BF16)
        return self.from_dlpack(t)

    def from_jax(self, x: jax.Array) -> Array:
        """A view of a jax array on this device (bfloat16 and read-only included)."""
        import jax
        import jax.numpy as jnp

        from ops.device._arrays import BF16

        if self.host:
            return np.asarray(x)  # zero-copy on the CPU (read-only), bfloat16 included
        if x.dtype == jnp.bfloat16:  # DLPack's bfloat16, through a bit cast (a copy)
            return self.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.int16)).view(BF16)
        return self.from_dlpack(x)


def _numpy_from_dlpack(x: Any) -> np.ndarray:  # torch or jax: numpy's stubs refuse torch
    return np.from_dlpack(x)


HOST = Device("numpy", np, True, driver=lambda: _cpu_driver(), to_host=lambda a: np.array(a),
              from_host=lambda a: np.array(a), from_dlpack=_numpy_from_dlpack)


def _cpu_driver() -> CpuDriver:
    from ops.kernels._cpu import cpu_driver

    return cpu_driver()


@functools.cache
def cupy_device() -> Device:
    """The CuPy device (imports cupy; its kernels need a GPU at run time)."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("cupy arrays need the 'cuda' extra: pip install 'zeroshard[cuda]'") from e

    def driver() -> CudaDriver:
        from ops.kernels._cuda import cuda_driver

        return cuda_driver()

    def view(x: Any) -> object:  # a torch tensor or jax array in, a CuPy array out
        if type(x).__module__.split(".")[0] in ("jax", "jaxlib") and hasattr(
                x, "__cuda_array_interface__"):
            # JAX's DLPack export from thread ranks is not reliable on GPUs; its
            # CUDA array interface is, once the array is computed.
            x.block_until_ready()
            return cupy.asarray(x)
        return cupy.from_dlpack(x)

    def pinned(n: int, dtype: DTypeLike) -> np.ndarray:
        dtype = np.dtype(dtype)
        mem = cupy.cuda.alloc_pinned_memory(max(1, n * dtype.itemsize))
        return np.frombuffer(mem, dtype, n)  # the array keeps the pinned block alive

    def copy_to_host(x: Any, out: np.ndarray) -> None:  # a CuPy array (.get)
        # bytes either way: CuPy knows bfloat16 only as a view
        x.view(np.uint8).get(out=out.view(np.uint8))

    def copy_from_host(dst: Any, src: np.ndarray) -> None:  # a CuPy array (.set)
        dst.view(np.uint8).set(src.view(np.uint8))

    return Device("cupy", cupy, False, driver=driver, to_host=cupy.asnumpy,
                  from_host=cupy.asarray, from_dlpack=view,
                  synchronize=lambda: cupy.cuda.get_current_stream().synchronize(),
                  torch_device="cuda", pinned=pinned, copy_to_host=copy_to_host,
                  copy_from_host=copy_from_host, current=lambda a: a.device)


_BY_TYPE: dict[type, Device] = {np.ndarray: HOST}
_BY_NAME: dict[str, Callable[[], Device]] = {"numpy": lambda: HOST, "cupy": cupy_device}


def register_device(array_type: type, device: Device) -> None:
    """Make arrays of ``array_type`` belong to ``device`` (used by ops.testing)."""
    _BY_TYPE[array_type] = device
    _BY_NAME[device.name] = lambda: device


def device_of_or_none(x: object) -> Device | None:
    device = _BY_TYPE.get(type(x))
    if device is not None:
        return device
    if isinstance(x, np.ndarray):
        return HOST
    if type(x).__module__.split(".")[0] == "cupy":
        device = cupy_device()
        _BY_TYPE[type(x)] = device
        return device
    return None


def device_of(x: object) -> Device:
    """The device an array lives on; a TypeError naming the type for anything else."""
    device = device_of_or_none(x)
    if device is None:
        raise TypeError(
            f"expected a numpy or cupy array, got {type(x).__module__}.{type(x).__qualname__}; "
            "convert torch or jax arrays with interop.to_numpy / interop.to_cupy (zero-copy)")
    return device


def device_named(name: str) -> Device:
    try:
        return _BY_NAME[name]()
    except KeyError:
        raise ValueError(f"no device {name!r}; known: {sorted(_BY_NAME)}") from None
