"""A named grid of ranks: :class:`Mesh`, with a communicator per axis.

[Note: named mesh]
``shard.Mesh(comm, {"data": 2, "pipe": 2, "model": 2})`` lays the
communicator's ranks out row-major over the named axes, as
``jax.sharding.Mesh(np.arange(8).reshape(2, 2, 2), names)`` and torch's
``init_device_mesh(..., (2, 2, 2), mesh_dim_names=names)`` do: the last axis
varies fastest, so rank ``r``'s coordinates are ``np.unravel_index(r, shape)``.
For each axis, the ranks that share every other coordinate form one group, and
``mesh["data"]`` is this rank's communicator over its group (ranks ordered by
their coordinate on that axis). Every rank makes every axis's communicator when
the mesh is built, axis by axis in the same order (``comm.split`` is a
collective; NCCL's ``ncclCommSplit`` is made eagerly by every rank), so no
later call can hang on a group some rank never made.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ops import Communicator

if TYPE_CHECKING:
    import jax
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Mesh", "Topology"]


class Mesh:
    """This rank's place in a named grid of ranks, and a communicator per axis.

    Args:
      comm: the communicator of every rank in the grid (``ops.spawn``,
        ``ops.init_from_env``).
      shape: the axes in order, as a mapping ``{"data": 2, "model": 2}`` or
        ``(name, size)`` pairs; their product must be ``comm.world_size``.
        Every rank passes the same shape (checked).

    Attributes:
      comm: the whole grid's communicator.
      axis_names: the axes' names, in order.
      shape: ``{name: size}``, in order.
      coords: this rank's index on each axis, ``{name: index}``.

    Examples:
      >>> import ops, shard
      >>> def run(comm):
      ...     mesh = shard.Mesh(comm, {"data": 2, "model": 2})
      ...     return mesh.coords, mesh["model"].world_size
      >>> ops.spawn(run, 4)[3]
      ({'data': 1, 'model': 1}, 2)
    """

    def __init__(self, comm: Communicator, shape: Mapping[str, int] | Iterable) -> None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"Mesh: comm must be an ops.Communicator; got "
                            f"{type(comm).__name__}")
        axes = list(shape.items()) if isinstance(shape, Mapping) else [tuple(a) for a in shape]
        names = [a[0] for a in axes]
        for name, size in axes:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"Mesh: axis names must be identifiers; got {name!r}")
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
                raise ValueError(f"Mesh: axis {name!r} must have an int size >= 1; got "
                                 f"{size!r}")
        if len(set(names)) != len(names) or not 1 <= len(names) <= 16:
            raise ValueError(f"Mesh: give each axis once, 1 to 16 of them; got {names}")
        sizes = tuple(int(a[1]) for a in axes)
        if int(np.prod(sizes)) != comm.world_size:
            raise ValueError(f"Mesh: the axes {dict(zip(names, sizes, strict=True))} hold "
                             f"{int(np.prod(sizes))} ranks; comm has {comm.world_size}")
        self.comm = comm
        self.axis_names = tuple(names)
        self.shape = dict(zip(names, sizes, strict=True))
        self._check_same_shape(sizes)
        index = np.unravel_index(comm.rank, sizes)
        self.coords = {n: int(i) for n, i in zip(names, index, strict=True)}
        self._axes: dict[str, Communicator] = {}
        for k, name in enumerate(names):  # every rank, every axis, in order
            others = [int(i) for j, i in enumerate(index) if j != k]
            other_sizes = [s for j, s in enumerate(sizes) if j != k]
            color = int(np.ravel_multi_index(others, other_sizes)) if others else 0
            sub = comm.split(color)
            if sub.rank != self.coords[name]:  # split orders a group by the parent's ranks
                raise RuntimeError(f"Mesh: rank {comm.rank} is rank {sub.rank} of its "
                                   f"{name!r} group, not {self.coords[name]}")
            self._axes[name] = sub

    def _check_same_shape(self, sizes: tuple[int, ...]) -> None:
        """Every rank asked for the same axes (a collective)."""
        from ops.comm._collectives import all_gather_host

        mine = np.zeros(18, np.int64)  # axes, crc32 of the names, up to 16 sizes
        mine[:2] = len(sizes), zlib.crc32(",".join(self.axis_names).encode())
        mine[2:2 + len(sizes)] = sizes
        every = all_gather_host(self.comm, mine).reshape(self.comm.world_size, -1)
        bad = [r for r in range(self.comm.world_size) if not np.array_equal(every[r], mine)]
        if bad:
            raise ValueError(f"Mesh: rank {bad[0]} asked for other axes than rank "
                             f"{self.comm.rank}'s {self.shape}: every rank passes the same shape")

    def __getitem__(self, name: str) -> Communicator:
        """This rank's communicator over axis ``name``."""
        try:
            return self._axes[name]
        except KeyError:
            raise KeyError(f"Mesh: no axis {name!r}; the axes are {list(self.axis_names)}") \
                from None

    def size(self, name: str) -> int:
        return self[name].world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def data_ranks(self) -> tuple[int, int]:
        """``(this rank's data rank, the data ranks)``: the ``data`` axis's, or
        HSDP's ``replicate`` x ``shard`` (replica ``r``'s rank ``k`` is ``r * S +
        k``); a mesh without them is one data rank. Model and pipe ranks of one
        data rank share it: they see the same rows."""
        if "data" in self.shape:
            return self.coords["data"], self.shape["data"]
        if "replicate" in self.shape and "shard" in self.shape:
            s = self.shape["shard"]
            return (self.coords["replicate"] * s + self.coords["shard"],
                    self.shape["replicate"] * s)
        return 0, 1

    def ranks(self) -> np.ndarray:
        """The grid of global ranks, shaped like the mesh."""
        return np.arange(self.comm.world_size).reshape(tuple(self.shape.values()))

    def to_jax(self, devices: Iterable[jax.Device] | None = None) -> jax.sharding.Mesh:
        """A ``jax.sharding.Mesh`` of the same shape and axis names over
        ``devices`` (default: the first ``world_size`` of ``jax.devices()``)."""
        import jax

        devs = list(jax.devices() if devices is None else devices)
        n = self.comm.world_size
        if len(devs) < n:
            raise ValueError(f"Mesh.to_jax: {n} devices needed; JAX has {len(devs)} (on the "
                             "CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N)")
        grid = np.array(devs[:n], dtype=object).reshape(tuple(self.shape.values()))
        return jax.sharding.Mesh(grid, self.axis_names)

    @classmethod
    def from_jax(cls, mesh: jax.sharding.Mesh, comm: Communicator) -> Mesh:
        """The mesh of a ``jax.sharding.Mesh``'s shape and axis names over ``comm``."""
        return cls(comm, dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)))

    def torch_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``(mesh_shape, mesh_dim_names)`` for torch's ``init_device_mesh``."""
        return tuple(self.shape.values()), self.axis_names

    @classmethod
    def from_torch(cls, device_mesh: DeviceMesh, comm: Communicator) -> Mesh:
        """The mesh of a torch ``DeviceMesh``'s shape and dimension names over
        ``comm``."""
        names = device_mesh.mesh_dim_names
        if names is None:
            raise ValueError("Mesh.from_torch: the DeviceMesh has no mesh_dim_names; name "
                             "its dimensions (init_device_mesh(..., mesh_dim_names=...))")
        return cls(comm, dict(zip(names, tuple(device_mesh.mesh.shape), strict=True)))

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in self.shape.items())
        where = ", ".join(f"{n}={i}" for n, i in self.coords.items())
        return f"Mesh({axes}; rank {self.comm.rank} at {where})"


# [Note: topology]
# A ZeRO step's ranks come from one place: ``zero3(..., mesh=shard.Mesh(...))``
# (or ``comm=`` for one data axis), resolved once into a :class:`Topology` that
# every part of the step reads. The mesh's axes are named as FSDP2 and
# Megatron name them: ``data`` (ZeRO shards over it), or ``replicate`` and
# ``shard`` (HSDP: ZeRO within ``shard``, the reduced shards summed over
# ``replicate``), ``model`` (tensor parallelism: the params' split given as
# ``specs=shard.TensorParallel(mesh, ...)``), and ``pipe`` (pipeline stages,
# whose own mesh the ``shard.Pipeline`` loss holds). hpZ's secondary shards
# stay FSDP2's ``reshard_after_forward=L``: a node-by-local mesh over the
# data axis, made here too. Who logs, the groups the norm and the loss are
# summed over, the checkpoint's writers and the secondary shards are all
# read from the topology, never from the arguments again.

_AXES = ("data", "replicate", "shard", "model", "pipe")


@dataclass(frozen=True, eq=False)
class Topology:
    """A step's ranks, resolved once from ``mesh=`` or ``comm=`` (see
    [Note: topology]).

    Attributes:
      data: the ranks ZeRO shards over (the mesh's ``data`` or ``shard`` axis).
      replicate: HSDP's replicas (the ``replicate`` axis): the ranks that hold
        this rank's shards too; None without.
      model: the tensor-parallel ranks (the ``model`` axis); None without.
      whole: a pipeline's whole mesh, over which the gradient norm and the loss
        are summed; None when the data ranks (and replicas, model ranks) are all.
      secondary: hpZ's (this node's ranks, this place's ranks on every node),
        or None (see [Note: secondary shards]).
    """

    data: Communicator
    replicate: Communicator | None = None
    model: Communicator | None = None
    whole: Communicator | None = None
    secondary: tuple[Communicator, Communicator] | None = None

    @property
    def ranks(self) -> int:
        """Data-parallel ranks in all: the data axis's, times the replicas'."""
        return self.data.world_size * (self.replicate.world_size if self.replicate else 1)

    @property
    def data_rank(self) -> int:
        """This rank's index among all data ranks (replica ``r``'s rank ``k`` is
        ``r * S + k``, as for the per-rank keys)."""
        r = self.replicate.rank if self.replicate is not None else 0
        return r * self.data.world_size + self.data.rank

    @property
    def first(self) -> bool:
        """Whether this rank is the first of every axis (it logs)."""
        return all(c is None or c.rank == 0
                   for c in (self.whole or self.data, self.replicate, self.model))

    @classmethod
    def resolve(cls, where: str, *, mesh: Mesh | None, comm: Communicator | None,
                model: Communicator | None = None, whole: Communicator | None = None,
                data_axis: Communicator | None = None) -> Topology:
        """The topology of ``mesh=`` or ``comm=`` (exactly one); ``model``: the
        model ranks of a tensor-parallel split, ``whole`` and ``data_axis``: a
        pipeline's whole mesh and its stage's data ranks. A ValueError or
        TypeError naming the argument for anything else."""
        if (mesh is None) == (comm is None):
            raise TypeError(f"{where}: give the ranks as mesh=shard.Mesh(...) or comm= (one "
                            f"data axis), exactly one of them; got "
                            f"{'both' if mesh is not None else 'neither'}")
        if comm is not None:
            _check_comm(where, comm, model, data_axis)
            return cls(comm, whole=whole)
        if not isinstance(mesh, Mesh):
            raise TypeError(f"{where}: mesh must be a shard.Mesh; got {type(mesh).__name__}")
        names = _check_axes(where, mesh)
        data = mesh["data"] if "data" in names else mesh["shard"]
        replicate = mesh["replicate"] if "replicate" in names else None
        if "model" in names and model is None and mesh.shape["model"] > 1:
            raise ValueError(f"{where}: the mesh has a 'model' axis: give the params' split "
                             "over it as specs=shard.TensorParallel(mesh, {...}) (or the "
                             "TensorParallel interop.torch.parallelize returned)")
        if model is not None and ("model" not in names or model is not mesh["model"]):
            raise ValueError(f"{where}: the TensorParallel's ranks are not this mesh's "
                             f"'model' axis: build it on the same mesh "
                             f"(shard.TensorParallel(mesh, ...)); the axes are "
                             f"{list(mesh.axis_names)}")
        data = _stage_data(where, mesh, data, data_axis)
        if replicate is not None and whole is not None:
            raise ValueError(f"{where}: a pipeline's stages have their own data axis; HSDP's "
                             "'replicate' axis is for a step without pipeline stages")
        return cls(data, replicate=replicate, model=model, whole=whole)

    def with_secondary(self, where: str, stage: int, reshard: bool | int) -> Topology:
        """This topology with ``reshard_after_forward``'s communicators (see
        [Note: secondary shards]): none for True (or an int equal to the data
        ranks), else the mesh of ``nodes x reshard_after_forward`` ranks' two
        axes over the data axis, made here by every rank."""
        w = self.data.world_size
        if reshard is True:
            return self
        if not isinstance(reshard, (bool, int)):
            raise TypeError(f"{where}: reshard_after_forward must be True, False or an int (the "
                            f"ranks per node); got {type(reshard).__name__}")
        size = 1 if reshard is False else int(reshard)
        if stage != 3:
            raise ValueError(f"{where}: reshard_after_forward is stage 3's (zero3): stages 0-2 "
                             "keep the whole params between steps")
        if not 1 <= size <= w or w % size:
            raise ValueError(f"{where}: reshard_after_forward={reshard!r} must divide the data "
                             f"ranks {w} (the ranks per node, typically torchrun's "
                             "--nproc-per-node)")
        if size == w:
            return self
        for what, bad in (("a 'replicate' axis", self.replicate is not None),
                          ("a 'model' axis", self.model is not None),
                          ("a pipeline", self.whole is not None)):
            if bad:
                raise NotImplementedError(f"{where}: reshard_after_forward={reshard!r} does not "
                                          f"compose with {what}; keep the default True")
        grid = Mesh(self.data, {"node": w // size, "local": size})
        return replace(self, secondary=(grid["local"], grid["node"]))



def _check_comm(where: str, comm: object, model: Communicator | None,
                data_axis: Communicator | None) -> None:
    """``comm=``: one communicator, the data ranks (no model axis; a pipeline's
    data axis where the step is a pipeline's)."""
    if isinstance(comm, Mesh):
        raise TypeError(f"{where}: comm= takes one communicator; pass a shard.Mesh "
                        "as mesh=")
    if not isinstance(comm, Communicator):
        raise TypeError(f"{where}: comm must be an ops.Communicator (from ops.spawn or "
                        f"ops.init_from_env); got {type(comm).__name__}")
    if model is not None:
        raise ValueError(f"{where}: a tensor-parallel split needs its model axis: pass "
                         "mesh=shard.Mesh(comm, {'data': D, 'model': M}) rather than "
                         "comm=")
    if data_axis is not None and comm is not data_axis \
            and comm.world_size != data_axis.world_size:
        raise ValueError(f"{where}: a pipeline's step runs on its data axis: pass "
                         f"comm=pipe.data ({data_axis.world_size} rank(s)) or the "
                         f"pipeline's mesh as mesh=; got a communicator of "
                         f"{comm.world_size} ranks")


def _check_axes(where: str, mesh: Mesh) -> set[str]:
    """The mesh's axis names, once they are a ZeRO step's: a data axis
    ('data', or HSDP's 'replicate' and 'shard'), 'model', 'pipe'."""
    names = set(mesh.axis_names)
    odd = sorted(names - set(_AXES))
    if odd:
        raise ValueError(f"{where}: the mesh's axis {odd[0]!r} is not one a ZeRO step "
                         f"knows; name its axes from {list(_AXES)} (data, or replicate "
                         "and shard for HSDP; model; pipe)")
    if "data" in names and names & {"replicate", "shard"}:
        raise ValueError(f"{where}: the mesh has 'data' and "
                         f"{sorted(names & {'replicate', 'shard'})}: HSDP's data ranks are "
                         "'replicate' x 'shard'; flat ZeRO's are 'data'")
    if ("replicate" in names) != ("shard" in names):
        raise ValueError(f"{where}: HSDP's mesh names both 'replicate' and 'shard'; got "
                         f"{list(mesh.axis_names)}")
    if "data" not in names and "shard" not in names:
        raise ValueError(f"{where}: the mesh has no data axis ('data', or 'replicate' and "
                         f"'shard'); its axes are {list(mesh.axis_names)}")
    return names


def _stage_data(where: str, mesh: Mesh, data: Communicator,
                data_axis: Communicator | None) -> Communicator:
    """The data ranks a step on ``mesh`` reduces over: a pipeline stage's own
    data axis (``data_axis``) where the mesh has a 'pipe' axis."""
    if "pipe" in mesh.axis_names and (data_axis is not None or mesh.shape["pipe"] > 1):
        if data_axis is None:
            raise ValueError(f"{where}: the mesh has a 'pipe' axis: the loss must be a "
                             "shard.Pipeline over it (shard.pipeline(...))")
        if data_axis is not data and data_axis.world_size != data.world_size:
            raise ValueError(f"{where}: the pipeline's data axis has "
                             f"{data_axis.world_size} rank(s), the mesh's 'data' "
                             f"{data.world_size}: build the pipeline on this mesh")
        return data_axis  # the communicator the stage's own collectives use
    if data_axis is not None:
        raise ValueError(f"{where}: a pipeline's step needs its 'pipe' axis in mesh= (the "
                         "pipeline's own mesh), or comm=pipe.data")
    return data
