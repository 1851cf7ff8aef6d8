"""Params known by their shapes: rebuilt from the leaf paths a checkpoint manifest
records, or read from torch tensors on the meta device."""

from __future__ import annotations

import ast
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Shape", "is_shape", "meta_shape", "shapes_from_manifest", "tree_from_manifest"]

_KEY = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\d+)\]")
_ATTR = re.compile(r"\.([A-Za-z_]\w*)")
# CPython 3.11's parser keeps a process-wide recursion counter that threads
# parsing at once corrupt ("AST constructor recursion depth mismatch"), as
# thread ranks loading a checkpoint together do: one parse at a time.
_PARSE = threading.Lock()


def parse_path(path: str, *, attributes: bool = False) -> list[str | int] | None:
    """A key path as JAX writes it (``"['a'][0]"``) -> ``['a', 0]``; None when it
    holds anything but dict keys (strings) and list indices. With
    ``attributes``, an attribute (``.value``, as flax nnx's and equinox's
    paths hold) is a key too: ``"['bn']['mean'].value"`` -> ``['bn', 'mean',
    'value']``."""
    keys: list[str | int] = []
    pos = 0
    while pos < len(path):
        m = _KEY.match(path, pos)
        if m is None:
            a = _ATTR.match(path, pos) if attributes else None
            if a is None:
                return None
            keys.append(a.group(1))
            pos = a.end()
            continue
        token = m.group(1)
        if token.isdigit():
            keys.append(int(token))
        else:
            with _PARSE:
                keys.append(ast.literal_eval(token))
        pos = m.end()
    return keys or None


def shapes_from_manifest(manifest: dict, where: str = "the manifest") -> Any:
    """The params as ``jax.ShapeDtypeStruct`` leaves in nested dicts and lists,
    from a manifest's leaf paths, shapes and dtypes (a torch module's params,
    ``{name: array}``, are one such tree)."""
    import jax

    from ops.device._arrays import BF16

    return tree_from_manifest(manifest, lambda entry: jax.ShapeDtypeStruct(
        tuple(entry["shape"]), BF16 if entry["dtype"] == "bfloat16" else np.dtype(entry["dtype"])),
        f"load: {where}")


def tree_from_manifest(manifest: dict, leaf: Callable[..., object],
                       where: str = "the manifest", *, attributes: bool = False) -> Any:
    """``leaf(entry)`` for each of a manifest's leaf entries, in the nested dicts
    and lists their paths name (with ``attributes``, an attribute is a dict
    key: see :func:`parse_path`)."""
    root: dict = {}
    for entry in manifest["leaves"]:
        keys = parse_path(entry["path"], attributes=attributes)
        if keys is None:
            raise ValueError(f"{where} names leaf {entry['path']!r}, which is not a path of "
                             "dict keys and list indices; pass like=params (or their shapes) "
                             "to load")
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"{where}: leaf paths overlap at {entry['path']!r}")
        node[keys[-1]] = leaf(entry)
    return _lists(root, where)


def _lists(node: object, where: str) -> object:
    """Dicts keyed 0..n-1 by ints become lists."""
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, int) for k in node):
        if sorted(node) != list(range(len(node))):
            raise ValueError(f"{where}: list indices {sorted(node)} have gaps")
        return [_lists(node[i], where) for i in range(len(node))]
    return {k: _lists(v, where) for k, v in node.items()}


@dataclass(frozen=True)
class Shape:
    """A leaf known only by its shape and dtype (``jax.ShapeDtypeStruct``'s
    two fields): what a torch tensor on the meta device reads as."""

    shape: tuple[int, ...]
    dtype: np.dtype


def is_shape(x: object) -> bool:
    """Whether a native leaf is a shape with no values (a :class:`Shape` or a
    ``jax.ShapeDtypeStruct``)."""
    from ops.device._device import device_of_or_none

    return (device_of_or_none(x) is None and hasattr(x, "shape") and hasattr(x, "dtype")
            and not hasattr(x, "__array__") and not hasattr(x, "__dlpack__"))


def meta_shape(t: Any) -> Shape:
    """A torch tensor on the meta device as a :class:`Shape` (bfloat16 as
    ml_dtypes')."""
    from ops.kernels._dtypes import BF16

    name = str(t.dtype).removeprefix("torch.")
    return Shape(tuple(t.shape), BF16 if name == "bfloat16" else np.dtype(name))
