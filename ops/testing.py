"""A strict stand-in for a GPU, so that device code paths run on machines without one.

:data:`STANDIN` is a :class:`ops.Device` (see [Note: devices]) whose arrays,
:class:`StandInArray`, keep their data in host memory but behave like CuPy's
where it matters for finding host-only code:

- implicit conversion to numpy fails, with CuPy's message: ``np.asarray(x)``,
  ``np.copyto(host, x)``, ``np.add(x, y)`` and ``host[...] = x`` all raise
  TypeError, so a library path that would hand device memory to numpy on a GPU
  fails the same way here;
- they have their own array module, :data:`xp` (``empty``, ``zeros``,
  ``asarray``, ``copyto``, ``add``, ... with CuPy's signatures), explicit host
  transfers (``x.get()``, ``xp.asnumpy``, ``xp.asarray(host)``) and no
  ``.ctypes``; ``x.data.ptr`` is the buffer's address, as on CuPy;
- kernels launch through the CUDA driver (:class:`ops.kernels._cuda.CudaDriver`) with
  the ``__global__`` kernels of ``ops/kernels`` emulated on the CPU, with the
  grid, block and arguments a GPU would get (see ``ops/kernels/_emulate.py``);
- every read back to the host (``get``, ``float``, ``int``, ``bool``,
  ``item``, ``tolist``) is counted in :data:`SYNCS`, so a test can say how
  many host synchronisations a step makes;
- every operation a GPU would pay for is counted in :data:`DEVICE_OPS`, by
  kind: allocations, copies (host-to-device ones included), kernel launches
  (elementwise arithmetic included), host reads and DLPack exchanges. A
  collective is one operation of the communicator (``Communicator.counts``):
  the copies a thread-rank backend makes inside it are not counted here.

DLPack exports them as CPU memory, so torch and JAX see host tensors over the
same buffers: "device" torch modules and JAX computations run on the CPU, and
the library's own code is what is under test.

Examples:
  >>> import numpy as np, ops
  >>> from ops.testing import xp
  >>> x = xp.asarray(np.arange(4, dtype=np.float32))
  >>> float(ops.sum_of_squares(x)[0])
  14.0
  >>> np.asarray(x)  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  TypeError: Implicit conversion to a NumPy array is not allowed. Please use `.get()` ...
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ops._counters import DEVICE_OPS, SYNCS
from ops._types import Array
from ops.device._device import Device, aligned_empty, register_device

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from ops.kernels._cuda import CudaDriver

__all__ = ["DEVICE_OPS", "STANDIN", "SYNCS", "StandInArray", "xp"]

_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
             "construct a NumPy array explicitly.")


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _Flags:
    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = a.flags.c_contiguous
        self.f_contiguous = a.flags.f_contiguous
        self.owndata = a.flags.owndata


def _unwrap(value: object, what: str) -> Any:  # Any: numpy data, or a Python or numpy scalar
    """The numpy data behind an operand; host arrays are refused (as CuPy does)."""
    if isinstance(value, StandInArray):
        return value._a
    if isinstance(value, np.ndarray):
        raise TypeError(f"{what}: a numpy array cannot be mixed with device arrays; copy it to "
                        "the device with xp.asarray first")
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return value
    raise TypeError(f"{what}: unsupported operand {type(value).__qualname__}")


def _key(key: object) -> Any:
    if isinstance(key, tuple):
        return tuple(_key(k) for k in key)
    if isinstance(key, StandInArray):
        return key._a
    return key


class StandInArray:
    """A device array of the stand-in (see the module docstring)."""

    __slots__ = ("__weakref__", "_a")
    __array_ufunc__ = None  # numpy ufuncs refuse it; binary operators defer to it

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    # -- what CuPy refuses ------------------------------------------------------
    def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
        raise TypeError(_IMPLICIT)

    def __array_function__(self, func: Callable[..., object], types: object, args: object,
                           kwargs: object) -> object:
        raise TypeError(f"numpy.{func.__name__} on a device array: {_IMPLICIT}")

    # -- attributes --------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: _Pointer(self._a.ctypes.data))
    T = property(lambda self: StandInArray(self._a.T))
    device = property(lambda self: "standin:0")

    def __repr__(self) -> str:
        return f"StandInArray(shape={self.shape}, dtype={self.dtype})"

    def __len__(self) -> int:
        return len(self._a)

    # -- explicit transfers and counted reads --------------------------------------
    def get(self) -> np.ndarray:
        """A copy in host memory (as ``cupy.ndarray.get``)."""
        SYNCS.add()
        return self._a.copy()

    def item(self) -> int | float | complex | bool:
        SYNCS.add()
        return self._a.item()

    def tolist(self) -> object:
        SYNCS.add()
        return self._a.tolist()

    def __float__(self) -> float:
        SYNCS.add()
        return float(self._a)

    def __int__(self) -> int:
        SYNCS.add()
        return int(self._a)

    def __index__(self) -> int:
        SYNCS.add()
        return self._a.__index__()

    def __bool__(self) -> bool:
        SYNCS.add()
        return bool(self._a)

    # -- DLPack (host memory, so torch and JAX see CPU tensors) -----------------------
    def __dlpack__(self, **kwargs: Any) -> object:
        DEVICE_OPS.add("dlpack")
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple:
        return self._a.__dlpack_device__()

    # -- views, copies, indexing ---------------------------------------------------------
    def __getitem__(self, key: Any) -> StandInArray:
        key = _key(key)
        out = self._a[key]
        if not isinstance(out, np.ndarray):  # an element: a 0-d view, as CuPy gives
            out = self._a[(*key, Ellipsis) if isinstance(key, tuple) else (key, Ellipsis)]
        return StandInArray(out)

    def __setitem__(self, key: object, value: object) -> None:
        DEVICE_OPS.add("copy")  # a copy, or a fill kernel
        self._a[_key(key)] = _unwrap(value, "setitem")

    def reshape(self, *shape: Any) -> StandInArray:
        return StandInArray(self._a.reshape(*shape))

    def ravel(self) -> StandInArray:
        return StandInArray(self._a.ravel())

    def view(self, dtype: DTypeLike) -> StandInArray:
        return StandInArray(self._a.view(dtype))

    def copy(self) -> StandInArray:
        return xp.copy(self)

    def astype(self, dtype: DTypeLike, copy: bool = True) -> StandInArray:
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        out = xp.empty(self.shape, dtype)
        DEVICE_OPS.add("kernel")
        out._a[...] = self._a.astype(dtype)
        return out

    def fill(self, value: object) -> None:
        DEVICE_OPS.add("copy")
        self._a.fill(_unwrap(value, "fill"))

    def sum(self, axis: int | tuple[int, ...] | None = None,
            dtype: DTypeLike | None = None) -> StandInArray:
        DEVICE_OPS.add("alloc")
        DEVICE_OPS.add("kernel")
        return StandInArray(np.asarray(self._a.sum(axis=axis, dtype=dtype)))

    # -- arithmetic -----------------------------------------------------------------
    def _binary(self, other: object, op: np.ufunc, reflected: bool = False) -> StandInArray:
        o = _unwrap(other, op.__name__)
        DEVICE_OPS.add("alloc")
        DEVICE_OPS.add("kernel")
        return StandInArray(np.asarray(op(o, self._a) if reflected else op(self._a, o)))

    def _inplace(self, other: object, op: np.ufunc) -> StandInArray:
        DEVICE_OPS.add("kernel")
        op(self._a, _unwrap(other, op.__name__), out=self._a)
        return self

    if TYPE_CHECKING:  # installed below by _install_operators, for the type checker
        def __add__(self, other: object, /) -> StandInArray: ...
        def __radd__(self, other: object, /) -> StandInArray: ...
        def __sub__(self, other: object, /) -> StandInArray: ...
        def __rsub__(self, other: object, /) -> StandInArray: ...
        def __mul__(self, other: object, /) -> StandInArray: ...
        def __rmul__(self, other: object, /) -> StandInArray: ...
        def __truediv__(self, other: object, /) -> StandInArray: ...
        def __rtruediv__(self, other: object, /) -> StandInArray: ...
        def __pow__(self, other: object, /) -> StandInArray: ...
        def __rpow__(self, other: object, /) -> StandInArray: ...
        def __iadd__(self, other: object, /) -> StandInArray: ...
        def __isub__(self, other: object, /) -> StandInArray: ...
        def __imul__(self, other: object, /) -> StandInArray: ...
        def __itruediv__(self, other: object, /) -> StandInArray: ...
        def __neg__(self) -> StandInArray: ...
        def __abs__(self) -> StandInArray: ...


def _result(a: np.ndarray) -> StandInArray:
    """A new device array computed by one kernel."""
    DEVICE_OPS.add("alloc")
    DEVICE_OPS.add("kernel")
    return StandInArray(a)


def _install_operators() -> None:
    binary = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.divide,
              "pow": np.power, "lt": np.less, "le": np.less_equal, "gt": np.greater,
              "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal}
    for name, op in binary.items():
        setattr(StandInArray, f"__{name}__",
                lambda self, other, op=op: self._binary(other, op))
        setattr(StandInArray, f"__r{name}__",
                lambda self, other, op=op: self._binary(other, op, reflected=True))
    for name in ("add", "sub", "mul", "truediv"):
        setattr(StandInArray, f"__i{name}__",
                lambda self, other, op=binary[name]: self._inplace(other, op))
    setattr(StandInArray, "__neg__", lambda self: _result(np.negative(self._a)))  # noqa: B010
    setattr(StandInArray, "__abs__", lambda self: _result(np.abs(self._a)))  # noqa: B010
    setattr(StandInArray, "__hash__", None)  # noqa: B010 (mutable, as CuPy's arrays)


_install_operators()


def _wrap_result(fn: Any) -> object:
    @functools.wraps(fn)
    def call(*args: object, out: object = None, **kwargs: object) -> object:
        raw = [_unwrap(a, fn.__name__) if isinstance(a, (StandInArray, np.ndarray)) else a
               for a in args]
        DEVICE_OPS.add("kernel")
        if out is not None:
            fn(*raw, out=_unwrap(out, fn.__name__), **kwargs)
            return out
        DEVICE_OPS.add("alloc")
        return StandInArray(np.asarray(fn(*raw, **kwargs)))

    return call


def _empty(shape: Any, dtype: DTypeLike = np.float32) -> StandInArray:  # Any: int or sequence
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    n = int(np.prod(shape, dtype=np.int64))
    DEVICE_OPS.add("alloc")
    return StandInArray(aligned_empty(n, dtype).reshape(shape))


def _zeros(shape: int | tuple[int, ...], dtype: DTypeLike = np.float32) -> StandInArray:
    out = _empty(shape, dtype)
    DEVICE_OPS.add("copy")  # a fill
    out._a[...] = 0
    return out


def _asarray(x: object, dtype: DTypeLike | None = None) -> StandInArray:
    """Host to device (an explicit copy), or a device array as it is."""
    if isinstance(x, StandInArray):
        return x if dtype is None or np.dtype(dtype) == x.dtype else x.astype(dtype)
    src = np.asarray(x, dtype=dtype)
    out = _empty(src.shape, src.dtype)
    DEVICE_OPS.add("copy")  # host to device
    out._a[...] = src
    return out


def _asnumpy(x: Array) -> np.ndarray:
    if not isinstance(x, StandInArray):
        raise TypeError(f"asnumpy: expected a device array; got {type(x).__qualname__}")
    return x.get()


def _from_dlpack(x: Any) -> StandInArray:
    """A zero-copy device view of a DLPack producer in (host) memory."""
    if isinstance(x, StandInArray):
        return x
    DEVICE_OPS.add("dlpack")
    return StandInArray(np.from_dlpack(x))


def _copy(x: StandInArray) -> StandInArray:
    out = _empty(x.shape, x.dtype)
    DEVICE_OPS.add("copy")
    out._a[...] = _unwrap(x, "copy")
    return out


def _copyto(dst: StandInArray, src: object) -> None:
    DEVICE_OPS.add("copy")
    np.copyto(_unwrap(dst, "copyto"), _unwrap(src, "copyto"))


def _concatenate(xs: Iterable[object], axis: int = 0) -> StandInArray:
    DEVICE_OPS.add("alloc")
    DEVICE_OPS.add("copy")
    return StandInArray(np.concatenate([_unwrap(x, "concatenate") for x in xs], axis=axis))


def _stack(xs: Iterable[object], axis: int = 0) -> StandInArray:
    DEVICE_OPS.add("alloc")
    DEVICE_OPS.add("copy")
    return StandInArray(np.stack([_unwrap(x, "stack") for x in xs], axis=axis))


xp = types.SimpleNamespace(
    __name__="ops.testing.xp", ndarray=StandInArray, float16=np.float16, float32=np.float32,
    float64=np.float64, int64=np.int64,
    empty=_empty, zeros=_zeros, asarray=_asarray, asnumpy=_asnumpy, from_dlpack=_from_dlpack,
    copy=_copy, copyto=_copyto, concatenate=_concatenate, stack=_stack,
    empty_like=lambda x, dtype=None: _empty(x.shape, dtype or x.dtype),
    zeros_like=lambda x, dtype=None: _zeros(x.shape, dtype or x.dtype),
    **{name: _wrap_result(getattr(np, name)) for name in (
        "add", "subtract", "multiply", "divide", "sqrt", "square", "sum", "isfinite", "any",
        "all", "abs", "maximum", "minimum")},
)


def _driver() -> CudaDriver:
    return _standin_driver()


@functools.cache
def _standin_driver() -> CudaDriver:
    from ops.kernels._cuda import CudaDriver
    from ops.kernels._emulate import EmulatedModule

    class CountedModule(EmulatedModule):
        """Kernels emulated on the CPU, each launch counted."""

        def get_function(self, name: str) -> Any:
            run = super().get_function(name)

            def launch(*args: Any, **kwargs: Any) -> Any:
                DEVICE_OPS.add("kernel")
                return run(*args, **kwargs)

            return launch

    return CudaDriver(xp, CountedModule, sm_count=1)


def _memory_owner(a: StandInArray) -> np.ndarray:
    """The numpy array that owns a stand-in array's memory: numpy views and DLPack
    exports keep it alive, as CuPy's views and exports keep their memory."""
    owner = a._a
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return owner


def _copy_to_host(x: Array, out: np.ndarray) -> None:
    SYNCS.add()
    out.view(np.uint8)[...] = _unwrap(x, "copy_to_host").view(np.uint8)


def _copy_from_host(dst: Array, src: np.ndarray) -> None:
    DEVICE_OPS.add("copy")  # host to device
    _unwrap(dst, "copy_from_host").view(np.uint8)[...] = src.view(np.uint8)


STANDIN = Device("standin", xp, False, driver=_driver, to_host=_asnumpy, from_host=_asarray,
                 from_dlpack=_from_dlpack, memory_owner=_memory_owner,
                 copy_to_host=_copy_to_host, copy_from_host=_copy_from_host)
register_device(StandInArray, STANDIN)


def to_device(tree: object, device: Device = STANDIN) -> Any:
    """Every array leaf of a pytree copied to ``device`` (explicitly)."""
    from ops._types import tree_map

    return tree_map(lambda a: device.asarray(a), tree)
