"""shard.Mesh: a named grid of ranks with a communicator per axis (see [Note:
named mesh]), on thread ranks here and on gloo processes in test_comm_gloo.py."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
import torch

import ops
import shard
from tests import pipeline_models as PM

SHAPE = {"data": 2, "pipe": 2, "model": 2}


def test_each_axis_groups_the_ranks_that_share_the_other_coordinates():
    def run(comm):
        mesh = shard.Mesh(comm, SHAPE)
        grid = mesh.ranks()
        assert grid.shape == (2, 2, 2)
        assert tuple(mesh.coords.values()) == np.unravel_index(comm.rank, (2, 2, 2))
        out = {}
        for k, name in enumerate(mesh.axis_names):
            at = list(mesh.coords.values())
            at[k] = slice(None)
            want = grid[tuple(at)].tolist()  # the ranks along this axis through mine
            got = ops.all_gather(mesh[name], np.array([comm.rank])).tolist()
            assert got == want, (name, got, want)
            assert mesh[name].rank == mesh.coords[name] and mesh.size(name) == 2
            out[name] = float(ops.all_reduce(mesh[name], np.array([comm.rank], np.float64))[0])
        return out

    sums = ops.spawn(run, 8)
    assert sums[0] == {"data": 0 + 4, "pipe": 0 + 2, "model": 0 + 1}
    assert sums[7] == {"data": 7 + 3, "pipe": 7 + 5, "model": 7 + 6}


def test_a_one_axis_mesh_and_pairs_in_order():
    def run(comm):
        mesh = shard.Mesh(comm, [("model", 3)])
        return mesh["model"].world_size, repr(mesh)

    size, text = ops.spawn(run, 3)[2]
    assert size == 3 and text == "Mesh(model=3; rank 2 at model=2)"


@pytest.mark.parametrize("shape,match", [
    ({"data": 2, "model": 3}, r"hold 6 ranks; comm has 4"),
    ({"data": 4, "2d": 1}, "identifiers"),
    ({"data": 0}, "int size >= 1"),
    ([("data", 2), ("data", 2)], "each axis once"),
])
def test_bad_shapes_are_named(shape, match):
    def run(comm):
        with pytest.raises(ValueError, match=match):
            shard.Mesh(comm, shape)

    ops.spawn(run, 4)


def test_ranks_that_disagree_on_the_shape_are_named_on_every_rank():
    def run(comm):
        shape = {"data": 2, "model": 2} if comm.rank != 3 else {"model": 2, "data": 2}
        with pytest.raises(ValueError, match="asked for other axes"):
            shard.Mesh(comm, shape)

    ops.spawn(run, 4)


def test_unknown_axis_is_named():
    def run(comm):
        with pytest.raises(KeyError, match=r"no axis 'tensor'.*\['data', 'model'\]"):
            shard.Mesh(comm, {"data": 2, "model": 1})["tensor"]

    ops.spawn(run, 2)


def test_to_and_from_jax_and_torch_shapes():
    def run(comm):
        mesh = shard.Mesh(comm, {"data": 2, "model": 2})
        cpus = jax.devices("cpu")  # the four of the tests' XLA_FLAGS, also beside a GPU
        jm = mesh.to_jax(cpus)
        assert jm.axis_names == ("data", "model") and jm.devices.shape == (2, 2)
        assert [d.id for d in jm.devices.flat] == [d.id for d in cpus[:4]]
        back = shard.Mesh.from_jax(jm, comm)
        assert back.shape == mesh.shape and back.coords == mesh.coords
        assert mesh.torch_shape() == ((2, 2), ("data", "model"))
        dm = types.SimpleNamespace(mesh=torch.arange(4).reshape(2, 2),
                                   mesh_dim_names=("dp", "tp"))  # a DeviceMesh's fields
        assert shard.Mesh.from_torch(dm, comm).shape == {"dp": 2, "tp": 2}
        with pytest.raises(ValueError, match="no mesh_dim_names"):
            shard.Mesh.from_torch(types.SimpleNamespace(mesh=dm.mesh, mesh_dim_names=None),
                                  comm)

    ops.spawn(run, 4)


@pytest.mark.parametrize("axes", [{"pipe": 2, "data": 2}, {"data": 2, "pipe": 2}])
def test_a_pipeline_on_a_mesh_trains_like_one_process(axes):
    """The mesh's pipe axis holds the stages and its data axis each stage's ZeRO
    ranks, in either order."""
    results = ops.spawn(lambda comm: PM.run(comm, stages=None, microbatches=2, mesh=axes), 4)
    assert PM.worst_difference(results, PM.reference()) < 1e-5


def test_a_pipeline_refuses_other_axes_and_double_arguments():
    def run(comm):
        mesh = shard.Mesh(comm, {"data": 2, "model": 2})
        with pytest.raises(ValueError, match="axes 'pipe' and 'data'"):
            shard.pipeline(PM.LAYERED, mesh=mesh)
        with pytest.raises(ValueError, match="not both"):
            shard.pipeline(PM.LAYERED, mesh=mesh, comm=comm, stages=2)
        with pytest.raises(TypeError, match="give comm= and stages=, or mesh="):
            shard.pipeline(PM.LAYERED, comm=comm)

    ops.spawn(run, 4)
