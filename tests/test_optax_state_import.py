"""Continuing from an optax optimizer's state: ``step.init(params,
opt_state=...)`` takes this rank's part of its moments and its count as the
state's step, so a run moved from ``optax`` in one process onto ZeRO shards
goes on as the optax run does (Adam's bias correction included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ops
import shard

LR, WD = 1e-2, 0.01


def params0():
    rng = np.random.default_rng(0)
    return {"w1": rng.standard_normal((7, 5)).astype(np.float32) * 0.5,
            "b1": np.zeros(5, np.float32),
            "w2": rng.standard_normal((5, 2)).astype(np.float32) * 0.5}


def loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] - b["y"]) ** 2)


def batches(n):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((6, 7)).astype(np.float32),
             "y": rng.standard_normal((6, 2)).astype(np.float32)} for _ in range(n)]


def optax_run(tx, params, data, opt=None):
    opt = tx.init(params) if opt is None else opt
    for b in data:
        grads = jax.grad(loss)(params, b)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    return params, opt


@pytest.mark.parametrize("optimizer", ["ops.adamw", "optax.adamw"])
@pytest.mark.parametrize("stage", [1, 3])
def test_a_run_continues_from_an_optax_state(stage, optimizer):
    tx = optax.adamw(LR, weight_decay=WD)
    data = batches(5)
    middle, opt = optax_run(tx, params0(), data[:3])  # three steps in one process
    want, _ = optax_run(tx, middle, data[3:], opt)  # and two more

    def run(comm, with_state=True):
        step = getattr(shard, f"zero{stage}")(
            loss, optimizer=ops.adamw(LR, weight_decay=WD) if optimizer == "ops.adamw" else tx,
            comm=comm)
        state = step.init(middle, opt_state=opt if with_state else None)
        assert int(state.step) == (3 if with_state else 0)
        for b in data[3:]:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=3))
        return shard.gather(state, comm)

    for got in ops.spawn(run, 3):
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    restarted = ops.spawn(lambda c: run(c, False), 3)[0]  # what forgetting it costs
    gap = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) for g, w in zip(
        jax.tree_util.tree_leaves(restarted), jax.tree_util.tree_leaves(want), strict=True))
    assert gap > 1e-3


def test_an_opt_state_that_does_not_fit_is_named():
    def run(comm):
        step = shard.zero2(loss, optimizer=ops.adamw(LR), comm=comm)
        with pytest.raises(TypeError, match="no optax state with mu, nu and count"):
            step.init(params0(), opt_state=optax.sgd(LR).init(params0()))
        other = {"w1": np.zeros((7, 5), np.float32), "b1": np.zeros(5, np.float32)}
        with pytest.raises(TypeError, match="not shaped like the params"):
            step.init(params0(), opt_state=optax.adam(LR).init(other))
        tx = optax.sgd(LR, momentum=0.9)
        step = shard.zero2(loss, optimizer=tx, comm=comm)
        with pytest.raises(TypeError, match="structure of the optimizer's init"):
            step.init(params0(), opt_state=optax.adam(LR).init(params0()))

    ops.spawn(run, 2)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_run_continues_from_an_optax_state_on_the_device(stage, device):
    """Params and optax state on the device (CuPy's, or the stand-in's, which
    refuses np.asarray as CuPy does) are read explicitly, count included."""
    from ops.testing import to_device

    tx = optax.adamw(LR, weight_decay=WD)
    data = batches(5)
    middle, opt = optax_run(tx, params0(), data[:3])
    want, _ = optax_run(tx, middle, data[3:], opt)

    def run(comm):
        step = getattr(shard, f"zero{stage}")(loss, optimizer=ops.adamw(LR, weight_decay=WD),
                                              comm=comm)
        state = step.init(to_device(middle, device), opt_state=to_device(opt, device))
        assert int(state.step) == 3
        for b in data[3:]:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=2))
        return jax.tree_util.tree_map(device.to_host, shard.gather(state, comm))

    for got in ops.spawn(run, 2):
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_allclose(g, np.asarray(w), rtol=1e-5, atol=1e-6)
