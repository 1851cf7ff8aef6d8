"""A torch module's buffers and tied names in a checkpoint (see [Note: torch
buffers] in ``interop/torch/_buffers.py`` and [Note: checkpoint format])."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from shard.checkpoint._files import CheckpointError, _sha256
from shard.core._state import TrainState

__all__ = ["read_module_file"]

log = logging.getLogger("shard.checkpoint._checkpoint")


def _write_module_file(state: TrainState, directory: Path) -> dict | None:
    """Rank 0's torch buffers and tied names (see [Note: torch buffers])."""
    if state.meta.module_state is None:
        return None
    from safetensors.numpy import save_file

    buffers, aliases = state.meta.module_state()
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


def _load_module(path: Path, manifest: dict, step: Any) -> None:
    """The checkpoint's buffers into the step's torch module, if both have them."""
    buffers, _ = read_module_file(path, manifest)
    target = getattr(step.loss_fn, "load_buffers", None)
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
