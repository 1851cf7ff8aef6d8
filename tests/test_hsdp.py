"""Hierarchical ZeRO (``replicate=``, FSDP2's HSDP; see [Note: replicas]): ZeRO
inside each group of ``comm``, replicas across, equal to single-process AdamW
over every rank's batch, with every replica bit-identical."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ops
import shard
from tests.harness import assert_rank_slices
from tests.test_optax_on_shards import init_params, loss

ZERO = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}
LR, WD = 1e-2, 1e-2


def batches(n=5):
    """12 rows a step: 4 or 6 ranks take equal parts."""
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((12, 5)).astype(np.float32),
             "y": rng.standard_normal((12, 3)).astype(np.float32)} for _ in range(n)]


def reference(data, clip=None):
    tx = optax.adamw(LR, weight_decay=WD)
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    p = jax.tree.map(jnp.asarray, init_params())
    s = tx.init(p)
    for b in data:
        u, s = tx.update(jax.grad(loss)(p, b), s, p)
        p = optax.apply_updates(p, u)
    return p


def hsdp_step(comm, stage, replicas, **kw):
    mesh = shard.Mesh(comm, {"replicate": replicas, "shard": comm.world_size // replicas})
    step = ZERO[stage](loss, optimizer=ops.adamw(LR, weight_decay=WD), mesh=mesh,
                       options=shard.ZeroOptions(**kw))
    return mesh, step


@pytest.mark.parametrize("stage,world,replicas,clip", [
    (3, 4, 2, None), (2, 6, 2, None), (1, 6, 3, None), (3, 6, 3, 0.05)])
def test_replicas_train_like_one_process_and_stay_identical(stage, world, replicas, clip):
    data = batches()
    want = reference(data, clip)

    def run(comm):
        mesh, step = hsdp_step(comm, stage, replicas, clip_norm=clip)
        state = step.init(init_params())
        losses = []
        for b in data:  # each of the world's ranks its own rows, as in flat ZeRO
            state, m = step(state, shard.split_batch(b, rank=comm.rank, world_size=world))
            losses.append(m["loss"])
        shards = mesh["shard"].world_size
        assert_rank_slices(state.params, want, mesh["shard"].rank, shards)
        every = ops.all_gather(mesh["replicate"], np.concatenate(state.master))
        copies = np.split(every, replicas)  # each replica's masters, bit for bit
        assert all(np.array_equal(x, copies[0]) for x in copies)
        evaluated = step.evaluate(state, shard.split_batch(data[0], rank=comm.rank,
                                                            world_size=world))
        return losses[0], evaluated

    first, evaluated = ops.spawn(run, world)[0]
    np.testing.assert_allclose(first, float(loss(init_params(), data[0])), rtol=1e-5)
    np.testing.assert_allclose(evaluated, float(loss(want, data[0])), rtol=1e-5)


@pytest.mark.parametrize("save", ["save", "async_save"])
def test_a_checkpoint_is_written_once_and_resumes_as_flat_zero(tmp_path, save):
    data = batches()
    want = reference(data)

    def first(comm):
        mesh, step = hsdp_step(comm, 3, 2)
        state = step.init(init_params())
        for b in data[:3]:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=4))
        with pytest.raises(ValueError, match="pass comm= that communicator"):
            getattr(shard, save)(state, tmp_path / "ckpt", comm=comm)
        if save == "save":
            shard.save(state, tmp_path / "ckpt", comm=mesh["shard"])
            return
        pending = shard.async_save(state, tmp_path / "ckpt", comm=mesh["shard"])
        state, _ = step(state, shard.split_batch(data[3], rank=comm.rank, world_size=4))
        pending.wait()  # on every replica: the first one's checkpoint is in place
        assert (tmp_path / "ckpt" / "manifest.json").exists()

    def resume(comm):
        step = shard.zero3(loss, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state, _ = shard.load(tmp_path / "ckpt", step, comm=comm, like=init_params())
        for b in data[3:]:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=4))
        assert_rank_slices(state.params, want, comm.rank, 4)

    ops.spawn(first, 4)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("rank-*")) == [
        "rank-00000.safetensors", "rank-00001.safetensors"]  # one replica's shards
    ops.spawn(resume, 4)


def test_bad_replicas_are_refused_by_name():
    def run(comm):
        mesh = shard.Mesh(comm, {"replicate": 2, "shard": 2})
        with pytest.raises(ValueError, match="zero0 keeps everything whole"):
            shard.zero0(loss, optimizer=ops.adamw(LR), mesh=mesh)
        with pytest.raises(TypeError, match=r"give the ranks as mesh=shard.Mesh\(...\) or comm="):
            shard.zero3(loss, optimizer=ops.adamw(LR), mesh=mesh, comm=mesh["shard"])
        with pytest.raises(ValueError, match=r"the mesh has 'data' and \['replicate'\]"):
            shard.zero3(loss, optimizer=ops.adamw(LR), mesh=shard.Mesh(comm, {"replicate": 2,
                                                                               "data": 2}))
        with pytest.raises(ValueError, match=r"the mesh's axis 'dp' is not one a ZeRO step"):
            shard.zero3(loss, optimizer=ops.adamw(LR), mesh=shard.Mesh(comm, {"dp": 4}))
        with pytest.raises(ValueError, match=r"Offload\(overlap=True\)"):
            shard.zero3(loss, optimizer=ops.adamw(LR), mesh=mesh,
                        offload=shard.Offload("host", overlap=True))
        params = init_params()
        if mesh.coords["replicate"] == 1:  # the replicas must start from the same params
            params["w1"] = params["w1"] + 1
        step = shard.zero2(loss, optimizer=ops.adamw(LR), mesh=mesh)
        with pytest.raises(ValueError, match="differ"):
            step.init(params)

    ops.spawn(run, 4)
