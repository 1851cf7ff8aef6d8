"""Losses with auxiliary outputs: ``zero*(loss, has_aux=True)`` for ``(loss, aux)``
losses, JAX's ``value_and_grad`` convention; aux in ``metrics["aux"]``."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import interop.torch as it
import ops
import shard
from tests import test_interop_torch as T
from tests import zero_models as M

ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


def with_aux(params, batch):
    loss = M.loss(params, batch)
    return loss, {"mse": loss, "rows": jnp.asarray(batch["x"].shape[0], jnp.float32)}


def part(batch, comm):
    return shard.split_batch(batch, rank=comm.rank, world_size=comm.world_size)


def test_a_tuple_loss_without_has_aux_is_named():
    comm = ops.spawn(lambda c: c, 1)[0]
    step = shard.zero2(with_aux, optimizer=ops.adamw(M.LR), comm=comm)
    state = step.init(M.init_params())
    with pytest.raises(TypeError, match=r"returns \(loss, aux\) needs has_aux=True"):
        step(state, M.batches(1)[0])
    step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm, has_aux=True)
    state = step.init(M.init_params())
    with pytest.raises(TypeError, match=r"has_aux=True: the loss must return \(loss, aux\)"):
        step(state, M.batches(1)[0])


def test_has_aux_is_refused_where_the_loss_cannot_return_it():
    comm = ops.spawn(lambda c: c, 1)[0]
    with pytest.raises(TypeError, match="has_aux=True is for a JAX loss function"):
        shard.zero3(M.LAYERED, optimizer=ops.adamw(M.LR), comm=comm, has_aux=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_aux_is_averaged_over_micro_batches_and_ranks_and_changes_no_update(stage):
    batches = M.batches(2, global_batch=24)

    def run(comm, has_aux):
        step = ZERO[stage](with_aux if has_aux else M.loss, optimizer=ops.adamw(M.LR),
                           comm=comm, has_aux=has_aux)
        state = step.init(M.init_params())
        out = []
        for b in batches:
            mine = part(b, comm)
            halves = shard.MicroBatches([jax.tree_util.tree_map(lambda x: x[:4], mine),
                                         jax.tree_util.tree_map(lambda x: x[4:], mine)])
            state, metrics = step(state, halves)
            out.append(metrics)
        return [np.array(x) for x in jax.tree_util.tree_leaves(shard.gather(state, comm))], out

    plain = ops.spawn(lambda c: run(c, False), 3)
    aux = ops.spawn(lambda c: run(c, True), 3)
    for (p0, m0), (p1, m1) in zip(plain, aux, strict=True):
        for a, b in zip(p0, p1, strict=True):
            np.testing.assert_array_equal(a, b)
        for before, after in zip(m0, m1, strict=True):
            assert after["aux"]["rows"] == 4.0  # 8 rows a rank, two micro-batches of 4
            np.testing.assert_allclose(after["aux"]["mse"], before["loss"], rtol=1e-6)
    assert "aux" not in plain[0][1][0]


@pytest.mark.parametrize("stage", [1, 3])
def test_torch_losses_return_aux_too(stage):
    batches = T.data(2)
    model = T.built(T.MLP)

    def loss(m, b):
        value = T.mse(m, b)
        return value, {"mse": value.detach() * 2, "tag": "train"}

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=loss)
        step = ZERO[stage](fn, optimizer=ops.adamw(M.LR), comm=comm, has_aux=True)
        state = step.init(params)
        n = batches[0][0].shape[0] // comm.world_size
        out = []
        for b in batches:
            state, metrics = step(state, tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b))
            assert metrics["aux"]["tag"] == "train"  # not a number: this rank's own
            out.append((metrics["aux"]["mse"], metrics["loss"]))
        evaluated = step.evaluate(state, tuple(t[:n] for t in batches[0]))
        return out, evaluated

    for out, evaluated in ops.spawn(run, 2):
        for mse, loss_value in out:
            np.testing.assert_allclose(mse, 2 * loss_value, rtol=1e-6)
        value, aux = evaluated  # has_aux: (loss, aux), as the step's metrics
        assert np.isfinite(value) and aux["tag"] == "train"
        np.testing.assert_allclose(aux["mse"], 2 * value, rtol=1e-5)


def test_two_steps_sharing_a_torch_loss_object_each_keep_their_own_has_aux():
    """The step hands the loss its options per call (``configured``): building a
    second step on the same object changes nothing of the first."""
    comm = ops.spawn(lambda c: c, 1)[0]

    def loss(model, batch):  # a Hugging Face style output: the loss and the rest
        x, y = batch
        err = ((model(x) - y) ** 2).mean()
        return {"loss": err, "mse": err.detach() * 2}

    params, fn = it.functional(copy.deepcopy(T.built(T.MLP)), loss=loss)
    with_aux = shard.zero1(fn, optimizer=ops.adamw(M.LR), comm=comm, has_aux=True)
    plain = shard.zero1(fn, optimizer=ops.adamw(M.LR), comm=comm)
    a, b = with_aux.init(params), plain.init(params)
    for batch in T.data(2):
        a, got = with_aux(a, batch)
        b, alone = plain(b, batch)
        np.testing.assert_allclose(got["aux"]["mse"], 2 * got["loss"], rtol=1e-5)
        assert "aux" not in alone and got["loss"] == alone["loss"]
    assert not fn.has_aux  # nothing of either step stays on the object
