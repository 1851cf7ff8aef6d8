"""The types the library's signatures share, and the pytree helpers.

``Array`` is what a unit buffer, a shard, a moment or a kernel's argument is: an
array of one device's array module (numpy, CuPy, or the stand-in of
:mod:`ops.testing`; see [Note: devices]). It is a protocol of the attributes and
methods the three share, so numpy's arrays satisfy it for the type checker and
CuPy's (which ship no annotations) and the stand-in's at run time, arithmetic
included (each operator an array of the same device).

A pytree (params, gradients, a batch, an optax state) that a function only hands
on (to JAX's tree functions, a loss, an optimizer) is annotated ``object``, so the
type checker refuses any other use of it inside; one that a function reads into
(``batch["x"]``, a leaf's ``.shape``), and a pytree the public API returns to the
caller, is ``Any``, as JAX's own signatures take it. ``tree_util`` is
``jax.tree_util``, imported when first needed.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Array", "tree_leaves", "tree_map", "tree_util"]


class ArrayFlags(Protocol):
    """The flag the library reads of numpy's, CuPy's and the stand-in's ``flags``."""

    @property
    def c_contiguous(self) -> bool: ...


class Array(Protocol):
    """An array of numpy, CuPy or the device stand-in."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> Any: ...

    @property
    def size(self) -> int: ...

    @property
    def ndim(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def strides(self) -> tuple[int, ...]: ...

    @property
    def flags(self) -> ArrayFlags: ...

    def __len__(self) -> int: ...

    def __getitem__(self, key: Any, /) -> Any: ...

    def __setitem__(self, key: Any, value: Any, /) -> None: ...

    def reshape(self, *args: Any, **kwargs: Any) -> Array: ...

    def ravel(self, *args: Any, **kwargs: Any) -> Array: ...

    def view(self, *args: Any, **kwargs: Any) -> Array: ...

    def astype(self, *args: Any, **kwargs: Any) -> Array: ...

    def copy(self, *args: Any, **kwargs: Any) -> Array: ...

    def fill(self, value: object, /) -> None: ...

    def sum(self, *args: Any, **kwargs: Any) -> Array: ...

    def __float__(self) -> float: ...

    # Element-wise arithmetic (one kernel each on a GPU): an array of the same
    # device; the operand an array or a scalar.
    def __add__(self, other: Any, /) -> Array: ...

    def __radd__(self, other: Any, /) -> Array: ...

    def __sub__(self, other: Any, /) -> Array: ...

    def __rsub__(self, other: Any, /) -> Array: ...

    def __mul__(self, other: Any, /) -> Array: ...

    def __rmul__(self, other: Any, /) -> Array: ...

    def __truediv__(self, other: Any, /) -> Array: ...

    def __rtruediv__(self, other: Any, /) -> Array: ...

    def __pow__(self, other: Any, /) -> Array: ...

    def __neg__(self) -> Array: ...

    def __abs__(self) -> Array: ...

    def __iadd__(self, other: Any, /) -> Array: ...

    def __isub__(self, other: Any, /) -> Array: ...

    def __imul__(self, other: Any, /) -> Array: ...

    def __itruediv__(self, other: Any, /) -> Array: ...


def tree_util() -> types.ModuleType:
    try:
        import jax.tree_util as tu
    except ImportError as e:  # pragma: no cover - jax is a core dependency
        raise ImportError("pytrees need jax: pip install jax") from e
    return tu


def tree_map(fn: Callable[..., object], tree: object, *rest: object) -> Any:
    return tree_util().tree_map(fn, tree, *rest)


def tree_leaves(tree: object) -> list[Any]:
    return tree_util().tree_leaves(tree)
