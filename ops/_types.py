"""The types the library's signatures share, and the pytree helpers.

``Array`` is what a unit buffer, a shard, a moment or a kernel's argument is: an
array of one device's array module (numpy, CuPy, or the stand-in of
:mod:`ops.testing`; see [Note: devices]). It is a protocol of the attributes and
methods the three share, so numpy's arrays satisfy it for the type checker and
CuPy's (which ship no annotations) and the stand-in's at run time. Arithmetic is
left out: where code computes on arrays it names ``np.ndarray`` (host arrays) or
goes through the device's ``xp`` module.

A pytree (params, gradients, a batch, an optax state) is annotated ``Any``: any
nesting of containers and leaves, as JAX's own signatures take it. ``tree_util``
is ``jax.tree_util``, imported when first needed.
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

    def fill(self, value: Any, /) -> None: ...


def tree_util() -> types.ModuleType:
    try:
        import jax.tree_util as tu
    except ImportError as e:  # pragma: no cover - jax is a core dependency
        raise ImportError("pytrees need jax: pip install jax") from e
    return tu


def tree_map(fn: Callable[..., object], tree: Any, *rest: Any) -> Any:
    return tree_util().tree_map(fn, tree, *rest)


def tree_leaves(tree: Any) -> list[Any]:
    return tree_util().tree_leaves(tree)
