"""Micro-batches of unequal rows give the update of their concatenation (the
``MicroBatches`` docstring's promise), for JAX losses and torch modules."""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

import interop.torch as it
import ops
import shard
from tests import test_interop_torch as T
from tests import zero_models as M

ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


def rows(batch, lo, hi):
    return jax.tree_util.tree_map(lambda x: x[lo:hi], batch)


@pytest.mark.parametrize("loss_fn", [M.loss, M.LAYERED], ids=["jax", "layered"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_micro_batches_of_3_and_1_rows_step_as_their_4_rows(stage, loss_fn):
    batch = M.batches(1, global_batch=8)[0]

    def run(comm, split):
        step = ZERO[stage](loss_fn, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(M.init_params())
        mine = shard.split_batch(batch, rank=comm.rank, world_size=comm.world_size)  # 4 rows
        b = shard.MicroBatches([rows(mine, 0, 3), rows(mine, 3, 4)]) if split else mine
        state, metrics = step(state, b)
        return ([np.array(x) for x in jax.tree_util.tree_leaves(shard.gather(state, comm))],
                float(metrics["loss"]), float(metrics["grad_norm"]))

    for (want, loss, norm), (got, loss2, norm2) in zip(
            ops.spawn(lambda c: run(c, False), 2), ops.spawn(lambda c: run(c, True), 2),
            strict=True):
        np.testing.assert_allclose(loss2, loss, rtol=1e-6)
        np.testing.assert_allclose(norm2, norm, rtol=1e-5)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_torch_micro_batches_of_unequal_rows(stage):
    (x, y), = T.data(1, n=8)
    model = T.built(T.MLP)

    def run(comm, split):
        params, fn = it.functional(copy.deepcopy(model), loss=T.mse)
        step = ZERO[stage](fn, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(params)
        mx, my = x[comm.rank * 4:(comm.rank + 1) * 4], y[comm.rank * 4:(comm.rank + 1) * 4]
        b = shard.MicroBatches([(mx[:1], my[:1]), (mx[1:], my[1:])]) if split else (mx, my)
        state, metrics = step(state, b)
        return shard.gather(state, comm), float(metrics["loss"])

    (want, loss), (got, loss2) = ops.spawn(lambda c: run(c, False), 2)[0], ops.spawn(
        lambda c: run(c, True), 2)[0]
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_equal_micro_batches_are_unchanged():
    """Equal rows: no weights, the same arithmetic as before (bit for bit)."""
    from shard.step._checks import weights

    b = M.batches(1, global_batch=8)[0]
    assert weights([rows(b, 0, 4), rows(b, 4, 8)]) is None
    assert weights([rows(b, 0, 3), rows(b, 3, 4)]) == [1.5, 0.5]
    assert weights([{"x": np.ones((3, 2)), "y": np.ones((2, 2))}, {"x": np.ones(1)}]) is None
