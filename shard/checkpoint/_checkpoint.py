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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ops import CollectiveError, Communicator
from ops._types import tree_util
from ops.comm._collectives import all_gather_host
from ops.device._device import device_named
from shard.checkpoint._files import CheckpointError, _sha256
from shard.checkpoint._module import _write_model_state_file as write_model_state_file
from shard.checkpoint._module import _write_module_file as write_module_file
from shard.checkpoint._module import read_module_file
from shard.checkpoint._validate import REST_DTYPES
from shard.core._layout import Layout
from shard.core._specs import Split
from shard.core._state import TrainState, full_masters, full_moments
from shard.step._plan import Plan, plan_of

__all__ = ["CheckpointError", "check_savable", "commit", "every_rank", "kinds", "leaf_names",
           "manifest", "rank_tensors", "read_module_file", "save", "step_plan",
           "write_model_state_file", "write_module_file", "write_tensors"]

log = logging.getLogger(__name__)
FORMAT, VERSION = "zeroshard-checkpoint", 1
TP_FORMAT, TP_INDEX = "zeroshard-tensor-parallel", "tensor_parallel.json"
KINDS = ("master", "exp_avg", "exp_avg_sq")  # Adam's state (an optax state's: kinds(state))


def kinds(state: TrainState) -> dict[str, tuple]:
    """The unit buffers a rank file holds, by name: the masters and each moment,
    in the params' layout (frozen leaves' moments zero, their masters cast from
    the compute params where they keep none: see [Note: frozen leaves])."""
    return {"master": full_masters(state), **dict(zip(state.meta.moment_names,
                                                       full_moments(state), strict=True))}


def step_plan(state: TrainState, fn: str) -> Plan | None:
    """The plan of the step that made ``state``, where a checkpoint needs it:
    a torch module's buffers, HSDP's replicas, the tensor-parallel ranks. A
    state whose step is gone (collected, or in another process) and that
    needs it is refused by name; for one that needs nothing of it, None
    where the step is gone."""
    plan = plan_of(state)
    m = state.meta
    needs = [what for what, yes in (("its torch module's buffers", m.module_buffers),
                                    (f"its {m.replicas} replicas' communicator", m.replicas > 1),
                                    (f"its {m.model_size} model ranks' communicator",
                                     m.model_size > 1)) if yes]
    if plan is None and needs:
        raise RuntimeError(f"{fn}: the step that made this state is gone (collected, or in "
                           f"another process), and the checkpoint needs {' and '.join(needs)} "
                           "from it; save while that step lives")
    return plan


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
    return write_tensors(rank_tensors(state), path)


def rank_tensors(state: TrainState, *, copy: bool = False) -> dict[str, np.ndarray]:
    """What this rank's file holds, as host arrays: its unit buffers of every
    kind and the optimizer's other leaves (device state copied to the host;
    host buffers themselves, or copies with ``copy=True``)."""
    device = device_named(state.meta.device)  # device state: explicit copies to the host
    tensors = {f"{kind}/{u}": np.array(buf, copy=copy, order="C")
               if device.host or isinstance(buf, np.ndarray) else device.to_host(buf)
               for kind, bufs in kinds(state).items() for u, buf in enumerate(bufs)}
    tensors.update({f"opt_rest/{i}": np.array(x) for i, x in enumerate(state.opt_rest)})
    return tensors


def write_tensors(tensors: dict[str, np.ndarray], path: Path) -> tuple[str, int]:
    """``tensors`` as a safetensors file at ``path``, on disk (fsync'd) before it
    takes its name; its SHA-256 and size."""
    from safetensors.numpy import save_file

    part = path.with_suffix(".part")
    save_file(tensors, str(part))
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(part, path)
    return _sha256(path), path.stat().st_size


def manifest(state: TrainState, files: list[dict], extra: object,
             module: dict | None = None, model_state: dict | None = None) -> dict:
    m = state.meta
    names = leaf_names(m.layout)
    return {
        "format": FORMAT, "version": VERSION, "step": int(state.step),
        "loss_scale": float(state.loss_scale), "good_steps": int(state.good_steps),
        "hysteresis": int(state.hysteresis), "batches": int(state.batches),
        "skips": {leaf.path: int(n) for leaf, n in zip(state.meta.layout.leaves, state.skips,
                                                       strict=True) if n},
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
        **({"model_state": model_state} if model_state else {}),
    }


@contextlib.contextmanager
def every_rank(fn: str, comm: Communicator) -> Iterator[None]:
    """A failed collective inside save or load says what the likely cause is."""
    try:
        yield
    except CollectiveError as e:
        raise type(e)(f"{fn}: {e}; {fn} is a collective: every rank must call it at the same "
                      f"point of its training loop (rank {comm.rank} was in {fn})") from e


def save(state: TrainState, path: str | os.PathLike, *, comm: Communicator,
         extra: object = None) -> Path:
    """Write a checkpoint of ``state`` (a collective: every rank calls it).

    Args:
      state: this rank's TrainState.
      path: the checkpoint directory to create (or replace, atomically).
      comm: this rank's communicator.
      extra: JSON-serialisable user state (data-loader position, RNG state),
        as DeepSpeed's ``client_sd``; rank 0's is kept.

    With replicas (a mesh's ``replicate`` axis, see [Note: replicas]) every
    rank calls it with the step's data axis (``mesh["shard"]``): the first
    replica writes, the others wait. With tensor parallelism (a ``model``
    axis) every rank of the mesh calls it with the step's data axis (see
    [Note: tensor-parallel checkpoints]).

    Returns:
      The checkpoint's path. See [Note: checkpoint format].
    """
    from shard.checkpoint._async import wait_pending

    check_savable(state, extra, "save")
    plan = step_plan(state, "save")
    path = Path(path)
    # After an async_save of this path (every rank called it, so every rank has
    # one), no rank starts this save until every rank has seen that one
    # committed: a rank that looked late would take this save's fresh
    # <path>.tmp for the old one's and wait for it forever.
    if wait_pending(path, comm):
        with every_rank("save", comm):
            comm.barrier()
    c = plan.config if plan is not None else None
    replicas = c.replicate if c is not None else None
    tp = c.tensor_parallel if c is not None else None
    if c is not None and (replicas is not None or tp is not None) and \
            comm.world_size != c.comm.world_size:
        raise ValueError(f"save: this state's step shards over {c.comm.world_size} ranks"
                         f"{' with replicas' if replicas is not None else ''}: pass comm= that "
                         f"communicator (the step's comm), not one of {comm.world_size}")
    if tp is not None:
        return _save_model_parts(state, path, comm, extra, tp, plan)
    if replicas is not None:  # one replica writes; the others wait for it
        if replicas.rank != 0:
            with every_rank("save", replicas):
                replicas.barrier()
            return path
    written = _save(state, path, comm, extra, plan)
    if replicas is not None:
        with every_rank("save", replicas):
            replicas.barrier()
    return written


def check_savable(state: object, extra: object, fn: str) -> None:
    """A TypeError naming what of ``state`` or ``extra`` a checkpoint cannot keep."""
    if not isinstance(state, TrainState):
        raise TypeError(f"{fn}: state must be a TrainState ({fn}(state, path, comm=comm)); got "
                        f"{type(state).__name__}")
    state.check_live()
    for i, x in enumerate(state.opt_rest):
        if str(np.asarray(x).dtype) not in REST_DTYPES.values():
            raise TypeError(f"{fn}: the optimizer's state leaf opt_rest[{i}] is "
                            f"{np.asarray(x).dtype}; checkpoints keep "
                            f"{sorted(REST_DTYPES.values())}")
    if extra is not None:
        try:
            json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"{fn}: extra must be JSON-serialisable ({e}); convert arrays with "
                            ".tolist()") from None


def _save(state: TrainState, path: Path, comm: Communicator, extra: object,
          plan: Plan | None) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        tmp.mkdir(parents=True)
    with every_rank("save", comm):
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
        module = write_module_file(plan, tmp)
        commit(path, tmp, manifest(state, files, extra, module,
                                   write_model_state_file(state, tmp)))
    comm.barrier()
    return path


def _save_model_parts(state: TrainState, path: Path, comm: Communicator, extra: object,
                      tp: Any, plan: Plan | None) -> Path:  # Any: a TensorParallel (layer above)
    """[Note: tensor-parallel checkpoints]
    With tensor parallelism each model rank's state is a checkpoint of its own,
    written by its data ranks as :func:`save` writes one, in
    ``<path>.tmp/model-<m>/``; once every part is on disk (a barrier over the
    whole mesh: the model ranks', then the data ranks'), the first rank writes
    ``tensor_parallel.json`` (the step, the parts, and each leaf's split
    dimension, or ``[dimension, blocks]`` for a packed leaf: see [Note: packed
    splits] in ``shard/core/_specs.py``) and renames ``<path>.tmp`` into place,
    so a crash leaves the previous checkpoint whole. ``shard.load`` joins the
    parts along each leaf's split and cuts the loading step's slices, so a
    checkpoint resumes at any (data, model) shape, and without tensor
    parallelism."""
    tmp = path.with_name(path.name + ".tmp")
    first = comm.rank == 0 and tp.rank == 0

    def mesh_barrier() -> None:
        with every_rank("save", tp.comm):
            tp.comm.barrier()
        with every_rank("save", comm):
            comm.barrier()

    if first:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        tmp.mkdir(parents=True)
    mesh_barrier()
    _save(state, tmp / f"model-{tp.rank:03d}", comm, extra, plan)
    mesh_barrier()
    if first:
        import jax

        layout = state.meta.layout
        splits = tp.splits(layout.treedef.unflatten(
            [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in layout.leaves]),
            whole=False)
        commit(path, tmp, {"format": TP_FORMAT, "step": int(state.step), "model_size": tp.size,
                           "parts": [f"model-{m:03d}" for m in range(tp.size)],
                           "split": {leaf.path: _recorded(s)
                                     for leaf, s in zip(layout.leaves, splits, strict=True)}},
               name=TP_INDEX)
    mesh_barrier()
    return path


def _recorded(split: Split | None) -> int | list[int] | None:
    """A leaf's split in ``tensor_parallel.json``: null, its dimension, or
    ``[dimension, packed blocks]``."""
    if split is None or split.blocks == 1:
        return None if split is None else split.dim
    return [split.dim, split.blocks]


def commit(path: Path, tmp: Path, fields: dict, *, name: str = "manifest.json") -> None:
    """Rank 0's end of a save: the manifest (``name``) written and fsync'd in
    ``tmp``, then ``tmp`` renamed to ``path`` (a previous ``path`` moved aside
    meanwhile)."""
    old = path.with_name(path.name + ".old")
    target = tmp / name
    target.write_text(json.dumps(fields, indent=1))
    with open(target, "rb+") as f:
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    log.info("saved step %d to %s", fields["step"], path)
