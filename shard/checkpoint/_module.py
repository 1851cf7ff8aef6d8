"""A torch module's buffers and tied names in a checkpoint (see [Note: torch
buffers] in ``interop/torch/_buffers.py`` and [Note: checkpoint format]), and a
JAX model's state (see [Note: model state] in ``shard/core/losses/_jax.py``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shard.checkpoint._files import CheckpointError, _sha256
from shard.core._state import TrainState
from shard.step._plan import Plan

if TYPE_CHECKING:
    from shard.step._step import ZeroStep

__all__ = ["read_model_state", "read_module_file"]

log = logging.getLogger("shard.checkpoint._checkpoint")


def _write_module_file(plan: Plan | None, directory: Path) -> dict | None:
    """Rank 0's torch buffers and tied names (see [Note: torch buffers]), from
    the step's loss (``plan``, the state's step's plan, where it has one)."""
    module_state = plan.config.loss_fn.module_state if plan is not None else None
    if module_state is None:
        return None
    from safetensors.numpy import save_file

    buffers, aliases = module_state()
    path = directory / "module.safetensors"
    save_file({k: np.array(v, order="C") for k, v in buffers.items()}, str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return {"file": path.name, "sha256": _sha256(path), "bytes": path.stat().st_size,
            "buffers": sorted(buffers), "aliases": aliases}


def read_module_file(path: Path, manifest: dict) -> tuple[dict[str, np.ndarray], dict]:
    """A checkpoint's module buffers and tied names (empty when it has none)."""
    entry = manifest.get("module")
    if not entry:
        return {}, {}
    from safetensors.numpy import load_file

    f = path / entry["file"]
    if not f.exists() or f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
        raise CheckpointError(f"{f}: missing, truncated or altered (size or SHA-256 differs "
                              "from the manifest)")
    return load_file(str(f)), dict(entry["aliases"])


def _load_module(path: Path, manifest: dict, step: ZeroStep) -> None:
    """The checkpoint's buffers into the step's torch module, if both have them."""
    buffers, _ = read_module_file(path, manifest)
    target = step.loss_fn.load_buffers
    if target is None:
        if buffers:
            log.warning("%s: the checkpoint holds module buffers %s, which this step's loss "
                        "has nowhere to put", path, sorted(buffers)[:5])
        return
    if "module" not in manifest:
        if step.loss_fn.buffers():
            log.warning("%s: the checkpoint holds no module buffers; the module keeps its own",
                        path)
        return
    try:
        target(buffers, f"{path}/module.safetensors")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _write_model_state_file(state: TrainState, directory: Path) -> dict | None:
    """Rank 0's model state (the same on every rank), each leaf under its key
    path, in ``model_state.safetensors``."""
    if state.model_state is None:
        return None
    import jax
    from safetensors.numpy import save_file

    leaves = jax.tree_util.tree_leaves_with_path(state.model_state)
    tensors = {jax.tree_util.keystr(p): np.array(x, order="C") for p, x in leaves}
    path = directory / "model_state.safetensors"
    save_file(tensors, str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return {"file": path.name, "sha256": _sha256(path), "bytes": path.stat().st_size,
            "leaves": [jax.tree_util.keystr(p) for p, _ in leaves]}


def read_model_state(path: Path, manifest: dict, like: object, *, attributes: bool = False) -> Any:
    """A checkpoint's model state (None without one): in the structure of
    ``like`` (the model state the step's ``init`` was given) where there is
    one, else as the nested dicts and lists its paths name (with
    ``attributes``, an attribute such as flax nnx's ``.value`` is a dict key)."""
    entry = manifest.get("model_state")
    if not entry:
        return None
    import jax
    from safetensors.numpy import load_file

    from shard.core._paths import parse_path

    f = path / entry["file"]
    if not f.exists() or f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
        raise CheckpointError(f"{f}: missing, truncated or altered (size or SHA-256 differs "
                              "from the manifest)")
    saved = load_file(str(f))
    if sorted(saved) != sorted(entry["leaves"]):
        raise CheckpointError(f"{f}: holds {sorted(saved)[:5]}, the manifest lists "
                              f"{sorted(entry['leaves'])[:5]}")
    if like is not None:
        paths, tree = jax.tree_util.tree_flatten_with_path(like)
        names = [jax.tree_util.keystr(p) for p, _ in paths]
        if sorted(names) != sorted(saved):
            raise CheckpointError(f"{f}: the checkpoint's model state has leaves "
                                  f"{sorted(set(saved) - set(names))[:5]} that the step's has "
                                  f"not, and lacks {sorted(set(names) - set(saved))[:5]}")
        for name, (_, x) in zip(names, paths, strict=True):
            if saved[name].shape != np.shape(x):
                raise CheckpointError(f"{f}: model_state{name} has shape "
                                      f"{list(saved[name].shape)}; the step's has "
                                      f"{list(np.shape(x))}")
        return jax.tree_util.tree_unflatten(tree, [saved[n] for n in names])
    root: dict = {}
    for name in entry["leaves"]:
        keys = parse_path(name, attributes=attributes)
        if not keys:
            raise CheckpointError(f"{f}: model state leaf {name!r} is not a path of dict keys "
                                  "and list indices; init the step with its model_state first")
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = saved[name]
    return root

