"""The checkpoint tools behind ``python -m shard.checkpoint {inspect,consolidate} ...``.

    python -m shard.checkpoint inspect CKPT
    python -m shard.checkpoint consolidate CKPT OUT.safetensors [--optimizer]

``consolidate`` writes the full fp32 parameters (and with ``--optimizer`` the
optimizer's moments, as ``<name>.exp_avg`` / ``<name>.exp_avg_sq`` for Adam) into
one safetensors file, named by the leaves' dotted names. For a torch module's
params these are its state_dict keys, and the file also holds its buffers and
every tied name (see [Note: torch buffers]), so
``module.load_state_dict(safetensors.torch.load_file(OUT), strict=True)``
loads it; numpy and JAX read it with ``safetensors.numpy.load_file``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from shard.checkpoint._files import CheckpointError
from shard.checkpoint._load import read_any_manifest, read_manifest
from shard.checkpoint._module import read_module_file
from shard.checkpoint._sources import source_of, verify_files
from shard.checkpoint._validate import optimizer_of

__all__ = ["consolidate", "inspect", "run"]


def consolidate(path: str | os.PathLike, out: str | os.PathLike, *,
                optimizer: bool = False) -> dict[str, tuple[int, ...]]:
    """Write a checkpoint's full params (optionally moments) to one safetensors file.

    Returns the names and shapes written.
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file

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
    buffers, aliases = read_module_file(path, manifest)
    tensors.update(buffers)
    for alias, name in aliases.items():  # safetensors keeps no shared tensors: a copy each
        tensors[alias] = tensors[name].copy()
    save_file(tensors, str(out), metadata={"step": str(manifest["step"])})
    return {k: tuple(v.shape) for k, v in tensors.items()}


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
    args = ap.parse_args(argv)
    try:
        if args.cmd == "inspect":
            return 0, inspect(args.ckpt)
        written = consolidate(args.ckpt, args.out, optimizer=args.optimizer)
        return 0, f"wrote {len(written)} tensors to {Path(args.out)}"
    except CheckpointError as e:
        return 1, f"error: {e}"

