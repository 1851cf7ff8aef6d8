"""Sharded, atomic, re-shardable checkpoints.

[Note: checkpoint format]
A checkpoint is a directory:

    manifest.json            format name and version, step, loss scale, stage,
                             world size, every leaf's name, shape, dtype, spec,
                             unit and place in the unit buffers, and each rank
                             file's size and SHA-256
    rank-00000.safetensors   that rank's unit buffers: master/<u> and each of
    ...                      the optimizer's moments, exp_avg/<u>,
                             exp_avg_sq/<u> for Adam (flat float32; see [Note:
                             unit buffers]), and an optax state's other leaves
                             (opt_rest/<i>, which the manifest's "optimizer"
                             lists with the moments' names); stage 0 writes
                             rank 0's only
    module.safetensors       a torch module's buffers (rank 0's) and, in the
                             manifest, its tied names ([Note: torch buffers])

A save writes everything into ``<path>.tmp``; once every rank's file is on
disk (fsync'd) and hashed, rank 0 writes the manifest and renames the
directory into place (a previous ``<path>`` is moved to ``<path>.old`` for the
instant between two renames, and :func:`load` falls back to it). A crash at
any point leaves the previous checkpoint loadable.

Before anything is read, the manifest is checked field by field and against
the rank files' headers ([Note: untrusted checkpoints] in ``_validate.py``).
Loading re-shards: each rank reads, for every leaf, only the rows its new
shard needs, from whichever old rank files hold them (safetensors slices,
memory-mapped), so N ranks' checkpoints load on any M ranks and any stage.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ops import CollectiveError, Communicator, Device
from ops._tree import tree_util
from ops.comm._collectives import all_gather_host
from ops.device._device import device_named
from shard.checkpoint._files import CheckpointError, _sha256
from shard.checkpoint._module import _load_module, _write_module_file, read_module_file
from shard.checkpoint._validate import REST_DTYPES, check_manifest, check_part_names, optimizer_of
from shard.core._layout import Layout, LeafLayout, alloc_units
from shard.core._paths import shapes_from_manifest
from shard.core._state import TrainState
from shard.step._plan import make_plan, new_state

__all__ = ["CheckpointError", "leaf_names", "load", "read_manifest", "read_module_file", "save"]

log = logging.getLogger(__name__)
FORMAT, VERSION = "zeroshard-checkpoint", 1
KINDS = ("master", "exp_avg", "exp_avg_sq")  # Adam's state (an optax state's: kinds(state))


def kinds(state: TrainState) -> dict[str, tuple]:
    """The unit buffers a rank file holds, by name: the masters and each moment."""
    return {"master": state.master, **dict(zip(state.meta.moment_names, state.moments,
                                                strict=True))}


def leaf_names(layout: Layout) -> list[str]:
    """Dotted names of the leaves (``blocks.0.w``; state_dict keys stay as they are)."""
    tu = tree_util()
    tree = layout.treedef.unflatten(list(range(len(layout.leaves))))
    names = []
    for path, _ in tu.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        names.append(".".join(parts) or "<root>")
    return names


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_rank_file(state: TrainState, path: Path) -> tuple[str, int]:
    if state.meta.offload == "disk":  # the tier's file is a rank file: a hard link
        source = next(Path(b.filename) for b in state.master if hasattr(b, "filename"))
        try:
            os.link(source, path)
        except OSError:  # another file system: a copy
            shutil.copyfile(source, path)
        return _sha256(path), path.stat().st_size
    from safetensors.numpy import save_file

    device = device_named(state.meta.device)  # device state: explicit copies to the host
    tensors = {f"{kind}/{u}": np.ascontiguousarray(
        buf if device.host or isinstance(buf, np.ndarray) else device.to_host(buf))
        for kind, bufs in kinds(state).items() for u, buf in enumerate(bufs)}
    tensors.update({f"opt_rest/{i}": np.array(x) for i, x in enumerate(state.opt_rest)})
    part = path.with_suffix(".part")
    save_file(tensors, str(part))
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(part, path)
    return _sha256(path), path.stat().st_size


def _manifest(state: TrainState, files: list[dict], extra: Any,
              module: dict | None = None) -> dict:
    m = state.meta
    names = leaf_names(m.layout)
    return {
        "format": FORMAT, "version": VERSION, "step": int(state.step),
        "loss_scale": float(state.loss_scale), "good_steps": int(state.good_steps),
        "stage": m.stage, "world_size": m.layout.world_size,
        "master_dtype": m.master_dtype, "compute_dtype": m.compute_dtype,
        "leaves": [{"name": n, "path": leaf.path, "shape": list(leaf.shape), "dtype": leaf.dtype,
                    "spec": "Shard(0)" if leaf.sharded else "Replicate()", "unit": leaf.unit,
                    "offset": leaf.offset, "rows_per_rank": leaf.rows_per_rank}
                   for n, leaf in zip(names, m.layout.leaves, strict=True)],
        "units": [{"name": u.name, "sharded_size": u.sharded_size,
                   "replicated_size": u.replicated_size} for u in m.layout.units],
        "optimizer": {"moments": list(m.moment_names),
                      "rest": [{"shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype)}
                               for x in state.opt_rest]},
        "files": files, "extra": extra, **({"module": module} if module else {}),
    }


@contextlib.contextmanager
def _every_rank(fn: str, comm: Communicator) -> Any:
    """A failed collective inside save or load says what the likely cause is."""
    try:
        yield
    except CollectiveError as e:
        raise type(e)(f"{fn}: {e}; {fn} is a collective: every rank must call it at the same "
                      f"point of its training loop (rank {comm.rank} was in {fn})") from e


def save(state: TrainState, path: str | os.PathLike, *, comm: Communicator,
         extra: Any = None) -> Path:
    """Write a checkpoint of ``state`` (a collective: every rank calls it).

    Args:
      state: this rank's TrainState.
      path: the checkpoint directory to create (or replace, atomically).
      comm: this rank's communicator.
      extra: JSON-serialisable user state (data-loader position, RNG state),
        as DeepSpeed's ``client_sd``; rank 0's is kept.

    Returns:
      The checkpoint's path. See [Note: checkpoint format].
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"save: state must be a TrainState (save(state, path, comm=comm)); got "
                        f"{type(state).__name__}")
    state.check_live()
    for i, x in enumerate(state.opt_rest):
        if str(np.asarray(x).dtype) not in REST_DTYPES.values():
            raise TypeError(f"save: the optimizer's state leaf opt_rest[{i}] is "
                            f"{np.asarray(x).dtype}; checkpoints keep "
                            f"{sorted(REST_DTYPES.values())}")
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if extra is not None:
        try:
            json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"save: extra must be JSON-serialisable ({e}); convert arrays with "
                            ".tolist()") from None
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        tmp.mkdir(parents=True)
    with _every_rank("save", comm):
        comm.barrier()
    writes = comm.rank == 0 or state.meta.stage > 0
    digest, size = (_write_rank_file(state, tmp / f"rank-{comm.rank:05d}.safetensors")
                    if writes else ("", 0))
    info = np.frombuffer(bytes.fromhex(digest or "00" * 32), np.uint8)
    digests = all_gather_host(comm, info.copy()).reshape(comm.world_size, 32)
    sizes = all_gather_host(comm, np.array([size], np.int64))
    if comm.rank == 0:
        files = [{"file": f"rank-{r:05d}.safetensors", "sha256": digests[r].tobytes().hex(),
                  "bytes": int(sizes[r])} for r in range(comm.world_size) if sizes[r] > 0]
        module = _write_module_file(state, tmp)
        manifest = tmp / "manifest.json"
        manifest.write_text(json.dumps(_manifest(state, files, extra, module), indent=1))
        with open(manifest, "rb+") as f:
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
        log.info("saved step %d to %s", int(state.step), path)
    comm.barrier()
    return path


def read_manifest(path: str | os.PathLike) -> tuple[Path, dict]:
    """The checkpoint directory actually to read (see the Note) and its manifest."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not (path / "manifest.json").exists() and (old / "manifest.json").exists():
        log.warning("%s is incomplete; reading the previous checkpoint %s", path, old)
        path = old
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise CheckpointError(f"{manifest_path}: no checkpoint here (no manifest.json)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: not a zeroshard checkpoint")
    version = manifest.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise CheckpointError(f"{manifest_path}: format version {version} is newer "
                              f"than this zeroshard reads ({VERSION}); upgrade zeroshard")
    check_manifest(path, manifest)  # see [Note: untrusted checkpoints]
    return path, manifest


def read_any_manifest(path: str | os.PathLike) -> tuple[Path, dict]:
    """A checkpoint's manifest; for a pipeline's checkpoint (one directory per
    stage, see ``shard.Pipeline.save``) one manifest of every stage's leaves,
    each naming its stage directory (``part``)."""
    path = Path(path)
    index = path / "pipeline.json"
    if not index.exists():
        return read_manifest(path)
    try:
        info = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from None
    parts = {}
    for d in check_part_names(index, info):
        _, parts[d] = read_manifest(path / d)
        if parts[d]["step"] != info["step"]:
            raise CheckpointError(f"{path / d}: step {parts[d]['step']}, but the pipeline's "
                                  f"checkpoint is of step {info['step']} (a save that did not "
                                  "finish on every stage)")
    merged = dict(parts[info["parts"][0]], parts=parts)
    merged["leaves"] = [dict(e, part=d) for d, m in parts.items() for e in m["leaves"]]
    return path, merged


def _verify_files(path: Path, manifest: dict, needed: set[int]) -> None:
    for r in sorted(needed):
        entry = manifest["files"][r] if manifest["stage"] else manifest["files"][0]
        f = path / entry["file"]
        if not f.exists():
            raise CheckpointError(f"{f}: missing shard file")
        if f.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{f}: truncated or altered ({f.stat().st_size} bytes, the "
                                  f"manifest says {entry['bytes']})")
        if _sha256(f) != entry["sha256"]:
            raise CheckpointError(f"{f}: checksum mismatch (SHA-256 differs from the manifest)")


class _Source:
    """Rows of one saved leaf, read from whichever old rank files hold them."""

    def __init__(self, path: Path, manifest: dict, entry: dict) -> None:
        self.path, self.manifest, self.entry = path, manifest, entry
        self.world = manifest["world_size"]
        shape = entry["shape"]
        self.rows = shape[0] if shape else 1
        self.row_size = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        self.sharded = entry["spec"] == "Shard(0)"
        self.rpr = entry["rows_per_rank"]

    def ranks_for(self, lo: int, hi: int) -> list[int]:
        if not self.sharded or hi <= lo:
            return [0]
        return list(range(lo // self.rpr, (hi - 1) // self.rpr + 1))

    def read(self, handles: dict, kind: str, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of this leaf, as a (hi - lo, row_size) float32 array."""
        out = np.zeros((max(hi - lo, 0), self.row_size), self.manifest["master_dtype"])
        unit, off = self.entry["unit"], self.entry["offset"]
        for r in self.ranks_for(lo, hi):
            first = r * self.rpr if self.sharded else 0
            a, b = max(lo, first), min(hi, first + self.rpr if self.sharded else self.rows)
            if b <= a:
                continue
            start = off + (a - first) * self.row_size
            sl = handles[self.path, r].get_slice(f"{kind}/{unit}")[
                start:start + (b - a) * self.row_size]
            out[a - lo:b - lo] = np.asarray(sl).reshape(b - a, self.row_size)
        return out


def load(path: str | os.PathLike, step: Any, *, comm: Communicator,
         like: Any = None, device: str | Device | None = None) -> tuple[TrainState, Any]:
    """Load a checkpoint into ``step``'s stage and world size (a collective).

    Args:
      path: a checkpoint directory written by :func:`save`, by any number of
        ranks at any stage.
      step: the ZeRO transform to load into (``shard.zero3(...)`` etc.).
      comm: this rank's communicator.
      like: the params tree or its shapes (``jax.ShapeDtypeStruct``). Without
        it: the layout of the step's ``init``, or, on a fresh step, the shapes
        the manifest records (for params that are dicts and lists).
      device: where the state goes (``"numpy"``, ``"cupy"`` or a
        :class:`ops.Device`); default: the device of ``like``'s arrays, else
        the step's (that of the params ``step.init`` was given).

    Returns:
      ``(state, extra)``.

    Raises:
      CheckpointError: a missing or truncated shard file, a checksum mismatch,
        a manifest from a newer format, shapes that do not fit the model, or
        any field or file header that does not hold together (a checkpoint is
        untrusted input: see [Note: untrusted checkpoints]); nothing is loaded
        in that case, and the step is left as it was.
    """
    path, manifest = read_any_manifest(path)
    with _every_rank("load", comm):
        return _load(path, manifest, step, comm, like, device)


def _load(path: Path, manifest: dict, step: Any, comm: Communicator, like: Any,
          device: Any) -> tuple[TrainState, Any]:
    from safetensors import safe_open

    config, plan = step.config, step.plan  # the plan of the step's init, if any
    if like is None and plan is None:
        try:
            like = shapes_from_manifest(manifest, f"{path}/manifest.json")
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    if like is not None:
        plan = make_plan(config, like, device=plan.device if plan else None)
    if device is not None:
        plan = plan.on(device_named(device) if isinstance(device, str) else device)
    layout, rank = plan.layout, (comm.rank if config.stage > 0 else 0)
    saved = {e["path"]: e for e in manifest["leaves"]}
    sources = []
    for leaf in layout.leaves:
        entry = saved.get(leaf.path)
        if entry is None:
            raise CheckpointError(f"{path}/manifest.json: no leaf {leaf.path} (the model has it; "
                                  f"the checkpoint has {sorted(saved)[:5]}...)")
        if tuple(entry["shape"]) != leaf.shape:
            raise CheckpointError(f"{path}/manifest.json: leaf {leaf.path} has shape "
                                  f"{tuple(entry['shape'])} in the checkpoint but {leaf.shape} "
                                  "in the model")
        part = entry.get("part")  # a pipelined checkpoint's stage directory
        sources.append(_Source(path / part, manifest["parts"][part], entry) if part else
                       _Source(path, manifest, entry))
    wanted = [_rows_of(leaf, rank) for leaf in layout.leaves]
    needed = {(s.path, r) for s, (lo, hi) in zip(sources, wanted, strict=True)
              for r in s.ranks_for(lo, hi)}
    needed |= {(s.path, r) for s in sources for r in s.ranks_for(0, s.rows)} \
        if config.stage in (0, 1, 2) else set()
    handles = {}
    for where, m in {s.path: s.manifest for s in sources}.items():
        ranks = {r for p, r in needed if p == where}
        _verify_files(where, m, ranks)
        files = m["files"]
        handles.update({(where, r): safe_open(str(where / (files[r] if m["stage"] else
                                                             files[0])["file"]),
                                              framework="numpy") for r in ranks})
    moments = plan.optimizer.moments
    saved_moments, saved_rest = optimizer_of(manifest, f"{path}/manifest.json")
    if tuple(saved_moments) != moments:
        raise CheckpointError(f"{path}: saved with an optimizer whose moments are "
                              f"{list(saved_moments)}; this step's optimizer keeps "
                              f"{list(moments)}: load with the optimizer it was saved with")
    if [tuple(r) for r in saved_rest] != list(plan.optimizer.rest):
        raise CheckpointError(f"{path}: the optimizer's other state leaves are "
                              f"{saved_rest} in the checkpoint and {list(plan.optimizer.rest)} "
                              "in this step's optimizer: load with the optimizer it was saved "
                              "with")
    buffers = {kind: alloc_units(layout, plan.master_dtype)
               for kind in ("master", *moments)}  # host
    for kind, bufs in buffers.items():
        for leaf, src, (lo, hi), dst in zip(layout.leaves, sources, wanted,
                                            layout.local_views(bufs), strict=True):
            _fill(leaf, dst, src.read(handles, kind, lo, hi))
    on_device = plan.device.asarray  # host buffers: an explicit copy to a GPU
    full_leaves = [on_device(src.read(handles, "master", 0, src.rows).reshape(leaf.shape))
                   if config.stage in (0, 1, 2) else None
                   for leaf, src in zip(layout.leaves, sources, strict=True)]
    copies = None
    offloader = plan.offloader()
    if offloader is not None:  # into host memory or the disk tier, unit by unit
        def fill(u: int, kind: str, buf: np.ndarray) -> None:
            buf[...] = buffers[kind][u]

        *bufs, copies = offloader.buffers(fill)
        buffers = dict(zip(KINDS, bufs, strict=True))
    else:
        buffers = {kind: [on_device(b) for b in bufs] for kind, bufs in buffers.items()}
    any_file = next(iter(handles.values()))  # every rank file holds the other leaves
    rest = tuple(np.array(any_file.get_tensor(f"opt_rest/{i}"))
                 for i in range(len(saved_rest)))
    state = new_state(plan, buffers["master"], [buffers[k] for k in moments],
                      opt_rest=rest, full_leaves=full_leaves, step=manifest["step"],
                      loss_scale=manifest["loss_scale"], good_steps=manifest["good_steps"],
                      copies=copies)
    _load_module(path, manifest, step)
    comm.barrier()
    return state, manifest.get("extra")


def _rows_of(leaf: LeafLayout, rank: int) -> tuple[int, int]:
    if not leaf.sharded:
        return 0, leaf.rows
    lo = min(rank * leaf.rows_per_rank, leaf.rows)
    return lo, min(lo + leaf.rows_per_rank, leaf.rows)


def _fill(leaf: LeafLayout, dst: np.ndarray, rows: np.ndarray) -> None:
    flat = dst.reshape(-1, leaf.row_size) if leaf.sharded else dst.reshape(leaf.rows, -1)
    flat[:rows.shape[0]] = rows
    flat[rows.shape[0]:] = 0
