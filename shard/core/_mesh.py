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
from typing import Any

import numpy as np

from ops import Communicator

__all__ = ["Mesh"]


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

    def ranks(self) -> np.ndarray:
        """The grid of global ranks, shaped like the mesh."""
        return np.arange(self.comm.world_size).reshape(tuple(self.shape.values()))

    def to_jax(self, devices: Any = None) -> Any:
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
    def from_jax(cls, mesh: Any, comm: Communicator) -> Mesh:
        """The mesh of a ``jax.sharding.Mesh``'s shape and axis names over ``comm``."""
        return cls(comm, dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)))

    def torch_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``(mesh_shape, mesh_dim_names)`` for torch's ``init_device_mesh``."""
        return tuple(self.shape.values()), self.axis_names

    @classmethod
    def from_torch(cls, device_mesh: Any, comm: Communicator) -> Mesh:
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
