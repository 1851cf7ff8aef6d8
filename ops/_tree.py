"""Pytree helpers: jax.tree_util, imported when first needed."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


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
