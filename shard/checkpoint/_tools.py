"""The checkpoint tools behind ``python -m shard.checkpoint {inspect,consolidate,orbax} ...``.

    python -m shard.checkpoint inspect CKPT
    python -m shard.checkpoint consolidate CKPT OUT.safetensors [--optimizer]
    python -m shard.checkpoint orbax CKPT OUT [--optimizer]

``consolidate`` writes the full fp32 parameters (and with ``--optimizer`` the
optimizer's moments, as ``<name>.exp_avg`` / ``<name>.exp_avg_sq`` for Adam) into
one safetensors file, named by the leaves' dotted names. For a torch module's
params these are its state_dict keys, and the file also holds its buffers and
every tied name (see [Note: torch buffers]), so
``module.load_state_dict(safetensors.torch.load_file(OUT), strict=True)``
loads it; numpy and JAX read it with ``safetensors.numpy.load_file``.

``orbax`` writes the same full params as an orbax checkpoint
(``orbax.checkpoint.StandardCheckpointer``), for JAX code that reads its
checkpoints with orbax: the pytree ``{"params": ..., "step": ...}``, the
params as the nested dicts and lists their key paths name (an attribute, as
in an equinox module's or flax nnx's paths, a dict key; a torch module's
params as ``{state_dict key: array}``), with ``"model_state"`` where the state kept
one (see [Note: model state]) and with ``--optimizer`` ``"opt"``, a pytree of
the params' shape per moment (``{"exp_avg": ..., "exp_avg_sq": ...}`` for
Adam).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np

from shard.checkpoint._files import CheckpointError
from shard.checkpoint._load import read_any_manifest, read_manifest
from shard.checkpoint._module import read_model_state, read_module_file
from shard.checkpoint._sources import source_of, verify_files
from shard.checkpoint._validate import optimizer_of
from shard.core._paths import tree_from_manifest

__all__ = ["consolidate", "inspect", "run", "to_orbax"]


def consolidate(path: str | os.PathLike, out: str | os.PathLike, *,
                optimizer: bool = False) -> dict[str, tuple[int, ...]]:
    """Write a checkpoint's full params (optionally moments) to one safetensors file.

    Returns the names and shapes written.
    """
    from safetensors.numpy import save_file

    path, manifest, tensors = _full_leaves(path, optimizer)
    buffers, aliases = read_module_file(path, manifest)
    tensors.update(buffers)
    for alias, name in aliases.items():  # safetensors keeps no shared tensors: a copy each
        tensors[alias] = tensors[name].copy()
    save_file(tensors, str(out), metadata={"step": str(manifest["step"])})
    return {k: tuple(v.shape) for k, v in tensors.items()}


def to_orbax(path: str | os.PathLike, out: str | os.PathLike, *,
             optimizer: bool = False) -> Any:
    """Write a checkpoint's full params as an orbax checkpoint at ``out``.

    The pytree written is ``{"params": ..., "step": ...}`` (and
    ``"model_state"``, and with ``optimizer`` the moments under ``"opt"``);
    see the module's docstring. The params are the fp32 masters, whole.

    Args:
      path: a checkpoint :func:`shard.save` wrote (a pipeline's or a
        tensor-parallel one's too).
      out: the orbax checkpoint's directory (it must not exist).
      optimizer: also write the optimizer's moments.

    Returns:
      The tree written, as ``jax.ShapeDtypeStruct`` leaves.

    Examples:
      >>> import orbax.checkpoint as ocp  # doctest: +SKIP
      >>> shard.checkpoint.to_orbax("ckpt", "/abs/out")  # doctest: +SKIP
      >>> params = ocp.StandardCheckpointer().restore("/abs/out")["params"]  # doctest: +SKIP
    """
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ImportError("to_orbax needs orbax: pip install orbax-checkpoint") from None
    import jax

    path, manifest, tensors = _full_leaves(path, optimizer)
    out = Path(out).absolute()
    if out.exists():
        raise CheckpointError(f"to_orbax: {out} exists; give a new directory")
    where = f"to_orbax: {path / 'manifest.json'}"
    tree: dict[str, object] = {
        "params": tree_from_manifest(manifest, lambda e: tensors[e["name"]], where,
                                     attributes=True),
        "step": np.asarray(manifest["step"], np.int64)}
    if optimizer:
        tree["opt"] = {kind: tree_from_manifest(
            manifest, lambda e, kind=kind: tensors[f"{e['name']}.{kind}"], where,
            attributes=True)
            for kind in optimizer_of(manifest, str(path))[0]}
    model_state = read_model_state(path, manifest, None, attributes=True)
    if model_state is not None:
        tree["model_state"] = model_state
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out, tree)
    checkpointer.wait_until_finished()
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _full_leaves(path: str | os.PathLike, optimizer: bool) -> tuple[Path, dict, dict]:
    """A checkpoint's directory, manifest, and every leaf's full masters by its
    dotted name (with ``optimizer``, each moment as ``<name>.<moment>``)."""
    from safetensors import safe_open

    path, manifest = read_any_manifest(path)  # a pipeline's and a tensor-parallel one's too
    parts = {path / d: m for d, m in manifest.get("parts", {}).items()} or {path: manifest}
    handles = {}
    for where, m in parts.items():
        ranks = set(range(len(m["files"])))
        verify_files(where, m, ranks)
        handles.update({(where, r): safe_open(str(where / m["files"][r]["file"]),
                                              framework="numpy") for r in ranks})
    tensors = {}
    for entry in manifest["leaves"]:
        src = source_of(path, manifest, entry)
        moments = optimizer_of(manifest, str(path))[0] if optimizer else ()
        for kind in ("master", *moments):
            name = entry["name"] if kind == "master" else f"{entry['name']}.{kind}"
            tensors[name] = src.read(handles, kind, 0, src.rows).reshape(entry["shape"])
    return path, manifest, tensors


def inspect(path: str | os.PathLike) -> str:
    """A readable summary of a checkpoint."""
    path, m = read_manifest(path)
    n = sum(int(np.prod(e["shape"], dtype=np.int64)) for e in m["leaves"])
    lines = [f"{path}: step {m['step']}, stage {m['stage']}, {m['world_size']} rank layout, "
             f"{n:,} params, loss scale {m['loss_scale']:g}",
             f"  files: {len(m['files'])}, {sum(f['bytes'] for f in m['files']) / 2**20:.1f} MiB"]
    for e in m["leaves"]:
        lines.append(f"  {e['name']:<40} {tuple(e['shape'])!s:<18} {e['dtype']:<9} "
                     f"{e['spec']:<12} unit {e['unit']}")
    if m.get("extra") is not None:
        lines.append(f"  extra: {str(m['extra'])[:200]}")
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> tuple[int, str]:
    """The command line's exit code and text (printed by ``python -m``)."""
    ap = argparse.ArgumentParser(prog="python -m shard.checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inspect", help="print what a checkpoint holds").add_argument("ckpt")
    c = sub.add_parser("consolidate", help="write the full params to one safetensors file")
    c.add_argument("ckpt")
    c.add_argument("out")
    c.add_argument("--optimizer", action="store_true", help="also write the Adam moments")
    o = sub.add_parser("orbax", help="write the full params as an orbax checkpoint")
    o.add_argument("ckpt")
    o.add_argument("out")
    o.add_argument("--optimizer", action="store_true", help="also write the moments")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "inspect":
            return 0, inspect(args.ckpt)
        if args.cmd == "orbax":
            import jax

            written = to_orbax(args.ckpt, args.out, optimizer=args.optimizer)
            n = len(jax.tree_util.tree_leaves(written))
            return 0, f"wrote {n} arrays to the orbax checkpoint {Path(args.out).absolute()}"
        written = consolidate(args.ckpt, args.out, optimizer=args.optimizer)
        return 0, f"wrote {len(written)} tensors to {Path(args.out)}"
    except CheckpointError as e:
        return 1, f"error: {e}"

