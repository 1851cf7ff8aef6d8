"""``key=``: a JAX loss's random key per data rank, step and micro-batch ([Note:
per-rank keys]), against one process that draws the same keys and averages
the ranks' gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import interop.torch as it
import ops
import shard

ZERO = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}
LR, WD, STEPS, KEEP = 1e-2, 0.1, 3, 0.7


def params():
    r = np.random.default_rng(0)
    return {"l1": {"w": r.normal(size=(7, 15)).astype(np.float32) * 0.4},
            "l2": {"w": r.normal(size=(15, 3)).astype(np.float32) * 0.4}}


seen_typed = []


def dropout_loss(p, b, *, key):
    seen_typed.append(jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key))
    h = jnp.tanh(b["x"] @ p["l1"]["w"])
    h = jnp.where(jax.random.bernoulli(key, KEEP, h.shape), h / KEEP, 0.0)
    return jnp.mean((h @ p["l2"]["w"] - b["y"]) ** 2)


def batches(rows=12):
    r = np.random.default_rng(1)
    return [{"x": r.normal(size=(rows, 7)).astype(np.float32),
             "y": r.normal(size=(rows, 3)).astype(np.float32)} for _ in range(STEPS)]


def reference(key, world, micro):
    """One process: rank r's micro-batch i of step t draws step_key(key, t, r, i);
    the update is optax.adamw on the mean of those gradients."""
    p = jax.tree_util.tree_map(jnp.asarray, params())
    tx = optax.adamw(LR, weight_decay=WD)
    opt = tx.init(p)
    for t, b in enumerate(batches()):
        grads = []
        for r in range(world):
            mine = shard.split_batch(b, rank=r, world_size=world)
            for i in range(micro):
                part = shard.split_batch(mine, rank=i, world_size=micro)
                k = shard.step_key(key, step=t, rank=r, micro_batch=i)
                grads.append(jax.grad(dropout_loss)(p, part, key=k))
        g = jax.tree_util.tree_map(lambda *x: sum(x) / len(x), *grads)
        u, opt = tx.update(g, opt, p)
        p = optax.apply_updates(p, u)
    return p


@pytest.mark.parametrize(("stage", "world", "micro", "typed"), [
    (1, 2, 2, True), (2, 3, 1, False), (3, 2, 1, True), (3, 3, 2, False)])
def test_each_rank_step_and_micro_batch_draws_its_own_key(stage, world, micro, typed):
    key = jax.random.key(5) if typed else jax.random.PRNGKey(5)
    want = reference(key, world, micro)
    seen_typed.clear()

    def run(comm):
        step = ZERO[stage](dropout_loss, optimizer=optax.adamw(LR, weight_decay=WD), comm=comm,
                           options=shard.ZeroOptions(key=key))
        state = step.init(params())
        for b in batches():
            mine = shard.split_batch(b, rank=comm.rank, world_size=world)
            parts = [shard.split_batch(mine, rank=i, world_size=micro) for i in range(micro)]
            state, _ = step(state, shard.MicroBatches(parts) if micro > 1 else parts[0])
        evaluated = float(step.evaluate(state, mine))
        return shard.gather(state, comm), evaluated

    got, evaluated = ops.spawn(run, world)[0]
    for path, w in jax.tree_util.tree_leaves_with_path(want):
        g = got[path[0].key][path[1].key]
        np.testing.assert_allclose(g, np.asarray(w), rtol=2e-5, atol=2e-6,
                                   err_msg=jax.tree_util.keystr(path))
    assert seen_typed and all(t == typed for t in seen_typed)
    assert np.isfinite(evaluated)


def test_ranks_and_steps_draw_different_masks_and_the_same_again():
    key = jax.random.key(0)
    masks = {(t, r): np.asarray(jax.random.bernoulli(
        shard.step_key(key, step=t, rank=r), KEEP, (64,))) for t in range(2) for r in range(2)}
    assert len({m.tobytes() for m in masks.values()}) == 4
    again = jax.random.bernoulli(shard.step_key(key, step=1, rank=1), KEEP, (64,))
    np.testing.assert_array_equal(np.asarray(again), masks[1, 1])
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        shard.step_key(key, step=-1, rank=0)


def test_a_key_with_a_model_state():
    """loss_fn(params, batch, model_state, *, key): both threaded."""
    key = jax.random.key(3)
    want = reference(key, 2, 1)

    def loss(p, b, ms, *, key):
        return dropout_loss(p, b, key=key), {"calls": ms["calls"] + 1.0}

    def run(comm):
        step = shard.zero3(loss, optimizer=optax.adamw(LR, weight_decay=WD), comm=comm,
                           options=shard.ZeroOptions(key=key))
        state = step.init(params(), model_state={"calls": np.zeros((), np.float32)})
        for b in batches():
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=2))
        return shard.gather(state, comm), float(state.model_state["calls"])

    got, calls = ops.spawn(run, 2)[0]
    assert calls == STEPS
    np.testing.assert_allclose(got["l2"]["w"], np.asarray(want["l2"]["w"]), rtol=2e-5,
                               atol=2e-6)


def test_what_key_refuses_is_named():
    def run(comm):
        with pytest.raises(TypeError, match=r"key= must be a JAX PRNG key"):
            shard.zero1(dropout_loss, optimizer=ops.adamw(LR), comm=comm,
                        options=shard.ZeroOptions(key=0))
        with pytest.raises(TypeError, match=r"key= must be one key"):
            shard.zero1(dropout_loss, optimizer=ops.adamw(LR), comm=comm,
                        options=shard.ZeroOptions(key=jax.random.split(jax.random.key(0), 2)))
        _, fn = it.functional(torch.nn.Linear(3, 2), loss=lambda m, b: m(b).sum())
        with pytest.raises(NotImplementedError, match=r"key= gives a JAX loss function"):
            shard.zero1(fn, optimizer=ops.adamw(LR), comm=comm,
                        options=shard.ZeroOptions(key=jax.random.key(0)))

    ops.spawn(run, 1)


def test_replicas_count_in_the_data_rank():
    """HSDP: replica r's rank k draws the key of data rank r * S + k, the mesh's
    own rank, as one process of 4 ranks does."""
    key = jax.random.key(7)
    want = reference(key, 4, 1)

    def run(comm):
        mesh = shard.Mesh(comm, {"replicate": 2, "shard": 2})
        step = shard.zero3(dropout_loss, optimizer=optax.adamw(LR, weight_decay=WD), mesh=mesh,
                           options=shard.ZeroOptions(key=key))
        state = step.init(params())
        for b in batches():
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=4))
        return shard.gather(state, mesh["shard"])

    got = ops.spawn(run, 4)[0]
    np.testing.assert_allclose(got["l1"]["w"], np.asarray(want["l1"]["w"]), rtol=2e-5,
                               atol=2e-6)
