"""Reading checkpoints: manifests (checked as untrusted input), and ``load``,
which re-shards (see [Note: checkpoint format] in ``_checkpoint.py``)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ops import Communicator, Device
from ops.device._device import device_named
from shard.checkpoint._checkpoint import FORMAT, KINDS, TP_FORMAT, TP_INDEX, VERSION, every_rank
from shard.checkpoint._files import CheckpointError
from shard.checkpoint._module import _load_module, read_model_state
from shard.checkpoint._sources import Joined, Sliced, source_of, verify_files
from shard.checkpoint._validate import check_manifest, check_part_names, optimizer_of
from shard.core._layout import Layout, LeafLayout, alloc_units
from shard.core._paths import shapes_from_manifest
from shard.core._specs import Split
from shard.core._state import TrainState
from shard.step._plan import Plan, make_plan, new_state

if TYPE_CHECKING:
    from ops._types import Array
    from shard.step._step import ZeroStep

__all__ = ["load", "read_any_manifest", "read_manifest"]

log = logging.getLogger(__name__)


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
    old = path.with_name(path.name + ".old")
    if not (path / TP_INDEX).exists() and not (path / "manifest.json").exists() \
            and (old / TP_INDEX).exists():
        log.warning("%s is incomplete; reading the previous checkpoint %s", path, old)
        path = old
    if (path / TP_INDEX).exists():
        return path, _read_model_parts(path)
    index = path / "pipeline.json"
    if not index.exists():
        return read_manifest(path)
    try:
        info = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from None
    parts, leaves = {}, []
    for d in check_part_names(index, info):
        if (path / d / TP_INDEX).exists():  # a stage split over model ranks
            stage = _read_model_parts(path / d)
            parts.update({f"{d}/{k}": m for k, m in stage["parts"].items()})
            leaves += [dict(e, model_parts=[dict(x, part=f"{d}/{x['part']}")
                                            for x in e["model_parts"]])
                       for e in stage["leaves"]]
        else:
            _, stage = read_manifest(path / d)
            parts[d] = stage
            leaves += [dict(e, part=d) for e in stage["leaves"]]
        if stage["step"] != info["step"]:
            raise CheckpointError(f"{path / d}: step {stage['step']}, but the pipeline's "
                                  f"checkpoint is of step {info['step']} (a save that did not "
                                  "finish on every stage)")
    first = next(iter(parts.values()))
    return path, dict(first, parts=parts, leaves=leaves)


def _read_model_parts(path: Path) -> dict:
    """A tensor-parallel checkpoint (see [Note: tensor-parallel checkpoints]) as
    one manifest of whole leaves: each entry keeps its parts' entries
    (``model_parts``) and its split dimension (``model_dim``)."""
    index = path / TP_INDEX
    try:
        info = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from None
    names = check_part_names(index, info)
    split = info.get("split")
    if info.get("format") != TP_FORMAT or info.get("model_size") != len(names) \
            or not isinstance(split, dict):
        raise CheckpointError(f"{index}: not a tensor-parallel index (format {TP_FORMAT!r}, "
                              "model_size equal to the number of parts, a split per leaf)")
    parts = {}
    for d in names:
        _, parts[d] = read_manifest(path / d)
        if parts[d]["step"] != info["step"]:
            raise CheckpointError(f"{path / d}: step {parts[d]['step']}, but the checkpoint is "
                                  f"of step {info['step']} (a save that did not finish on every "
                                  "model rank)")
    first = parts[names[0]]
    leaves = []
    for entry in first["leaves"]:
        where = f"{index}: leaf {entry['path']}"
        pieces = [next((e for e in parts[d]["leaves"] if e["path"] == entry["path"]), None)
                  for d in names]
        found = [e for e in pieces if e is not None]
        if len(found) < len(pieces) or any(e["shape"] != entry["shape"] for e in found):
            raise CheckpointError(f"{where}: the model ranks' parts disagree on it")
        got = split.get(entry["path"], "missing")
        shape = list(entry["shape"])
        dim = _split_of(got, shape)
        if dim is False:
            raise CheckpointError(f"{where}: its split must be null, an index of its shape "
                                  f"{shape}, or [index, packed blocks dividing that dimension]; "
                                  f"got {got!r}")
        if dim is not None:
            shape[dim.dim] *= len(names)
        leaves.append(dict(entry, shape=shape, model_dim=dim,
                           model_parts=[dict(e, part=d) for e, d in zip(found, names,
                                                                        strict=True)]))
    merged = dict(first, parts=parts, leaves=leaves, model_size=len(names))
    if first.get("module"):  # a torch module's buffers and ties: the same on every model rank
        merged["module"] = dict(first["module"], file=f"{names[0]}/{first['module']['file']}")
    return merged


def _split_of(saved: Any, shape: list[int]) -> Split | Literal[False] | None:
    """A leaf's split as ``tensor_parallel.json`` records it (null, a dimension,
    or ``[dimension, packed blocks]``); False when it is none of these."""
    if saved is None:
        return None
    dim, blocks = saved if isinstance(saved, list) and len(saved) == 2 else (saved, 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (dim, blocks)) \
            or not 0 <= dim < len(shape) or blocks < 1 or shape[dim] % blocks:
        return False
    return Split(dim, blocks)


def load(path: str | os.PathLike, step: ZeroStep, *, comm: Communicator,
         like: object = None, device: str | Device | None = None) -> tuple[TrainState, object]:
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
    with every_rank("load", comm):
        return _load(path, manifest, step, comm, like, device)


# step: Any, as its plan (None before init) is read where a branch above made it
def _load(path: Path, manifest: dict, step: Any, comm: Communicator, like: object,
          device: str | Device | None) -> tuple[TrainState, object]:
    config = step.config
    plan, from_module = _plan_of(path, manifest, step, like, device)
    layout, rank = plan.layout, (comm.rank if config.stage > 0 else 0)
    sources = _sources(path, manifest, layout, config.tensor_parallel, from_module)
    wanted = [_rows_of(leaf, rank) for leaf in layout.leaves]
    handles = _open_files(sources, wanted, whole=config.stage in (0, 1, 2))
    moments = plan.optimizer.moments
    saved_rest = _check_optimizer(path, manifest, plan)
    host = {kind: alloc_units(layout, plan.master_dtype) for kind in ("master", *moments)}
    for kind, bufs in host.items():
        for leaf, src, (lo, hi), dst in zip(layout.leaves, sources, wanted,
                                            layout.local_views(list(bufs)), strict=True):
            _fill(leaf, dst, src.read(handles, kind, lo, hi))
    on_device = plan.device.asarray  # host buffers: an explicit copy to a GPU
    full_leaves = [on_device(src.read(handles, "master", 0, src.rows).reshape(leaf.shape))
                   if config.stage in (0, 1, 2) else None
                   for leaf, src in zip(layout.leaves, sources, strict=True)]
    copies = None
    offloader = plan.offloader()
    buffers: dict[str, list[Any]]  # each unit's buffer: on the device, or an offload tier's
    if offloader is not None:  # into host memory or the disk tier, unit by unit
        def fill(u: int, kind: str, buf: np.ndarray) -> None:
            buf[...] = host[kind][u]

        *tiers, copies = offloader.buffers(fill)
        buffers = dict(zip(KINDS, tiers, strict=True))
    else:
        buffers = {kind: [on_device(b) for b in bufs] for kind, bufs in host.items()}
    any_file = next(iter(handles.values()))  # every rank file holds the other leaves
    rest = tuple(np.array(any_file.get_tensor(f"opt_rest/{i}"))
                 for i in range(len(saved_rest)))
    state = new_state(plan, buffers["master"], plan.packed_moments([buffers[k] for k in moments]),
                      opt_rest=rest, full_leaves=full_leaves, step=manifest["step"],
                      loss_scale=manifest["loss_scale"], good_steps=manifest["good_steps"],
                      hysteresis=manifest.get("hysteresis"),
                      # written since shard.DataLoader; older ones: a batch per step
                      batches=manifest.get("batches", manifest["step"]),
                      skips=[manifest.get("skips", {}).get(leaf.path, 0)
                             for leaf in layout.leaves],
                      copies=copies)
    _load_module(path, manifest, step)
    step.use_plan(plan, offloader)
    model_state = read_model_state(path, manifest, getattr(step, "model_state_like", None))
    if model_state is not None and config.kind == "jax":  # see [Note: model state]
        state = state.replace(model_state=model_state)
    elif model_state is not None:
        log.warning("%s: the checkpoint holds a JAX model state, which this step's loss has "
                    "nowhere to put", path)
    comm.barrier()
    return state, manifest.get("extra")


def _plan_of(path: Path, manifest: dict, step: Any, like: object,
             device: str | Device | None) -> tuple[Plan, bool]:
    """The plan the state is loaded into: the step's own, or one made from
    ``like``, the step's torch module or the manifest's shapes; and whether it
    was made from the module (whose leaves the checkpoint must all hold)."""
    config, plan = step.config, step.plan  # the plan of the step's init, if any
    tp = config.tensor_parallel
    described = config.loss_fn.params_like  # a torch module's params
    # every leaf of the module (a module split by parallelize: this model rank's slices)
    from_module = like is None and plan is None and callable(described)
    if from_module:
        like = described()
    elif like is None and plan is None:
        try:
            like = shapes_from_manifest(manifest, f"{path}/manifest.json")
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    if like is not None and tp is not None and not from_module:  # this model rank's slices
        like = tp.shard(like)
    if like is not None:
        plan = make_plan(config, like, device=plan.device if plan else None)
    if device is not None:
        plan = plan.on(device_named(device) if isinstance(device, str) else device)
    return plan, from_module


def _sources(path: Path, manifest: dict, layout: Layout, tp: Any,
             from_module: bool) -> list[Any]:  # Any: a TensorParallel; each a Source
    """Where each leaf of ``layout`` is read from (this model rank's slice of
    it with tensor parallelism); a CheckpointError for a leaf missing, extra
    (``from_module``) or of another shape."""
    saved = {e["path"]: e for e in manifest["leaves"]}
    extra = sorted(set(saved) - {leaf.path for leaf in layout.leaves}) if from_module else []
    if extra:
        raise CheckpointError(f"{path}/manifest.json: leaves {extra[:5]}"
                              f"{f' and {len(extra) - 5} more' if len(extra) > 5 else ''} are "
                              "not in the model this step trains: a checkpoint of another "
                              "model?")
    sources = []
    for leaf, dim in zip(layout.leaves, _model_dims(layout, tp), strict=True):
        entry = saved.get(leaf.path)
        if entry is None:
            raise CheckpointError(f"{path}/manifest.json: no leaf {leaf.path} (the model has it; "
                                  f"the checkpoint has {sorted(saved)[:5]}...)")
        src = source_of(path, manifest, entry)
        if dim is not None:  # this model rank's slice (see [Note: tensor-parallel checkpoints])
            same = isinstance(src, Joined) and src.split == dim and len(src.parts) == tp.size
            if same:
                src = src.parts[tp.rank]
            elif src.shape[dim.dim] % (dim.blocks * tp.size) == 0:
                src = Sliced(src, dim, tp.rank, tp.size)
        if tuple(src.shape) != leaf.shape:
            split = f" (this model rank's slice of {tuple(entry['shape'])})" if dim is not None \
                else ""
            raise CheckpointError(f"{path}/manifest.json: leaf {leaf.path} has shape "
                                  f"{tuple(src.shape)}{split} in the checkpoint but {leaf.shape} "
                                  "in the model")
        sources.append(src)
    return sources


def _open_files(sources: list[Any], wanted: list[tuple[int, int]], *,
                whole: bool) -> dict[tuple[Path, int], Any]:
    """The rank files that hold the rows ``wanted`` of each source (every row
    with ``whole``: stages 0-2 keep whole params), verified and opened."""
    from safetensors import safe_open

    needed = set().union(*(s.needs(lo, hi) for s, (lo, hi) in zip(sources, wanted, strict=True)))
    if whole:
        needed |= set().union(*(s.needs(0, s.rows) for s in sources))
    handles = {}
    manifests = {k: v for s in sources for k, v in s.manifests().items()}
    for where, m in manifests.items():
        ranks = {r for p, r in needed if p == where}
        verify_files(where, m, ranks)
        files = m["files"]
        handles.update({(where, r): safe_open(str(where / (files[r] if m["stage"] else
                                                             files[0])["file"]),
                                              framework="numpy") for r in ranks})
    return handles


def _check_optimizer(path: Path, manifest: dict, plan: Plan) -> list:
    """The saved optimizer's other state leaves, once its moments and those
    leaves are this step's optimizer's."""
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
    return saved_rest


def _model_dims(layout: Layout, tp: Any) -> list[Split | None]:  # Any: a TensorParallel
    """Each leaf's split over the loading step's model ranks."""
    if tp is None:
        return [None] * len(layout.leaves)
    import jax

    return tp.splits(layout.treedef.unflatten([jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
                                             for leaf in layout.leaves]), whole=False)


def _rows_of(leaf: LeafLayout, rank: int) -> tuple[int, int]:
    if not leaf.sharded:
        return 0, leaf.rows
    lo = min(rank * leaf.rows_per_rank, leaf.rows)
    return lo, min(lo + leaf.rows_per_rank, leaf.rows)


def _fill(leaf: LeafLayout, dst: Array, rows: np.ndarray) -> None:
    flat = dst.reshape(-1, leaf.row_size) if leaf.sharded else dst.reshape(leaf.rows, -1)
    flat[:rows.shape[0]] = rows
    flat[rows.shape[0]:] = 0
