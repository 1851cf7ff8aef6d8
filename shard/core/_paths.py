"""Params shapes rebuilt from the leaf paths a checkpoint manifest records."""

from __future__ import annotations

import ast
import re
from typing import Any

import numpy as np

__all__ = ["shapes_from_manifest"]

_KEY = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\d+)\]")


def parse_path(path: str) -> list[str | int] | None:
    """A key path as JAX writes it (``"['a'][0]"``) -> ``['a', 0]``; None when it
    holds anything but dict keys (strings) and list indices."""
    keys: list[str | int] = []
    pos = 0
    while pos < len(path):
        m = _KEY.match(path, pos)
        if m is None:
            return None
        keys.append(ast.literal_eval(m.group(1)))
        pos = m.end()
    return keys or None


def shapes_from_manifest(manifest: dict, where: str = "the manifest") -> Any:
    """The params as ``jax.ShapeDtypeStruct`` leaves in nested dicts and lists,
    from a manifest's leaf paths, shapes and dtypes (a torch module's params,
    ``{name: array}``, are one such tree)."""
    import jax

    from ops.device._arrays import BF16

    root: dict = {}
    for entry in manifest["leaves"]:
        keys = parse_path(entry["path"])
        if keys is None:
            raise ValueError(f"load: {where} names leaf {entry['path']!r}, which is not a path of "
                             "dict keys and list indices; pass like=params (or their shapes)")
        dtype = BF16 if entry["dtype"] == "bfloat16" else np.dtype(entry["dtype"])
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"load: {where}: leaf paths overlap at {entry['path']!r}")
        node[keys[-1]] = jax.ShapeDtypeStruct(tuple(entry["shape"]), dtype)
    return _lists(root, where)


def _lists(node: Any, where: str) -> Any:
    """Dicts keyed 0..n-1 by ints become lists."""
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, int) for k in node):
        if sorted(node) != list(range(len(node))):
            raise ValueError(f"load: {where}: list indices {sorted(node)} have gaps")
        return [_lists(node[i], where) for i in range(len(node))]
    return {k: _lists(v, where) for k, v in node.items()}
