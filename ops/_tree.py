"""Pytree helpers: jax.tree_util, imported when first needed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def tree_util() -> Any:
    try:
        import jax.tree_util as tu
    except ImportError as e:  # pragma: no cover - jax is a core dependency
        raise ImportError("pytrees need jax: pip install jax") from e
    return tu


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    return tree_util().tree_map(fn, tree, *rest)


def tree_leaves(tree: Any) -> list[Any]:
    return tree_util().tree_leaves(tree)
