"""JAX model libraries as they are used: flax linen params, flax nnx state
(``nnx.split`` / ``nnx.merge``), and equinox modules (``eqx.partition`` /
``eqx.combine`` with a static field, or a whole module as the params). The loss
receives exactly the pytree structure given to ``init``, and every rank's shards
equal the single-process optax reference's slice, at world sizes that do not
divide the leaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ops
import shard

flax = pytest.importorskip("flax")
eqx = pytest.importorskip("equinox")
from flax import linen, nnx  # noqa: E402

ZERO = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}
LR, WD, STEPS = 1e-2, 0.01, 3


def data():
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((6, 5), np.float32),
             "y": rng.standard_normal((6, 2), np.float32)} for _ in range(STEPS)]


def mse(out, b):
    return jnp.mean((out - b["y"]) ** 2)


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(2)(jnp.tanh(linen.Dense(7)(x)))


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(5, 7, rngs=rngs)
        self.l2 = nnx.Linear(7, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


class EqxMLP(eqx.Module):
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear
    activation: str = eqx.field(static=True)

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(5, 7, key=k1)
        self.l2 = eqx.nn.Linear(7, 2, key=k2)
        self.activation = "tanh"

    def __call__(self, x):
        return self.l2(getattr(jnp, self.activation)(self.l1(x)))


def linen_case():
    model = LinenMLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 5)))["params"]
    return params, lambda p, b: mse(model.apply({"params": p}, b["x"]), b)


def nnx_case():
    graphdef, state = nnx.split(NnxMLP(nnx.Rngs(0)))
    return state, lambda s, b: mse(nnx.merge(graphdef, s)(b["x"]), b)


def eqx_partition_case():
    params, static = eqx.partition(EqxMLP(jax.random.key(0)), eqx.is_array)
    return params, lambda p, b: mse(jax.vmap(eqx.combine(p, static))(b["x"]), b)


def eqx_module_case():
    return EqxMLP(jax.random.key(0)), lambda m, b: mse(jax.vmap(m)(b["x"]), b)


CASES = {"flax-linen": linen_case, "flax-nnx": nnx_case, "equinox-partition": eqx_partition_case,
         "equinox-module": eqx_module_case}


def optax_reference(params, loss, batches):
    tx = optax.adamw(LR, weight_decay=WD)
    opt = tx.init(params)
    for b in batches:
        grads = jax.grad(loss)(params, b)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_jax_model_libraries_train_like_single_process_optax(case, stage):
    params, loss = CASES[case]()
    batches = data()
    want = optax_reference(params, loss, batches)
    structure = jax.tree_util.tree_structure(params)
    seen = []

    def checked(p, b):  # the structure given to init, static fields and all
        seen.append(jax.tree_util.tree_structure(p) == structure)
        return loss(p, b)

    def run(comm):
        step = ZERO[stage](checked, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state = step.init(params)
        for b in batches:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=3))
        ref = shard.partition(want, rank=comm.rank, world_size=3)
        got = state.params
        assert jax.tree_util.tree_structure(got) == structure
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref),
                        strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)
        whole = shard.gather(state, comm)
        assert jax.tree_util.tree_structure(whole) == structure
        return float(step.evaluate(state, batches[0]))

    evals = ops.spawn(run, 3)
    assert seen and all(seen)
    np.testing.assert_allclose(evals[0], float(loss(want, batches[0])), rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_of_each_library_s_params_is_one_orbax_restores(case, tmp_path):
    """``shard.checkpoint.to_orbax`` names each leaf by its key path, attributes
    (an equinox module's fields, flax nnx's ``.value``) as dict keys, so orbax
    restores every library's params as nested dicts and lists."""
    ocp = pytest.importorskip("orbax.checkpoint")
    params, loss = CASES[case]()

    def run(comm):
        step = shard.zero3(loss, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state, _ = step(step.init(params), shard.split_batch(data()[0], rank=comm.rank,
                                                              world_size=2))
        shard.save(state, tmp_path / "ckpt", comm=comm)
        return shard.gather(state, comm)

    whole = ops.spawn(run, 2)[0]
    shard.checkpoint.to_orbax(tmp_path / "ckpt", tmp_path / "orbax")
    restored = ocp.StandardCheckpointer().restore((tmp_path / "orbax").absolute())["params"]
    leaves = jax.tree_util.tree_leaves_with_path(whole)
    assert len(jax.tree_util.tree_leaves(restored)) == len(leaves) > 0
    for path, x in leaves:
        have = restored
        for key in path:
            have = have[getattr(key, "key", getattr(key, "idx", getattr(key, "name", None)))]
        np.testing.assert_array_equal(np.asarray(have), np.asarray(x))


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_library_s_model_trains_in_a_pure_step_inside_jit_and_scan(case):
    """``shard.pure_zero3`` takes each library's params as they come and runs
    its steps inside ``jax.jit(jax.lax.scan(...))``: each rank's shards are
    its rows of single-process optax's result."""
    params, loss = CASES[case]()
    batches = data()
    want = optax_reference(params, loss, batches)
    structure = jax.tree_util.tree_structure(params)

    def run(comm):
        step = shard.pure_zero3(loss, optimizer=optax.adamw(LR, weight_decay=WD), comm=comm)
        mine = [shard.split_batch(b, rank=comm.rank, world_size=3) for b in batches]
        stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *mine)
        state, metrics = jax.jit(lambda s, b: jax.lax.scan(step, s, b))(step.init(params),
                                                                        stacked)
        assert jax.tree_util.tree_structure(state.params) == structure
        ref = shard.partition(want, rank=comm.rank, world_size=3)
        for g, w in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(ref),
                        strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)
        return np.asarray(metrics["loss"])

    losses = ops.spawn(run, 3)
    np.testing.assert_allclose(losses[0], losses[2])
    assert losses[0].shape == (STEPS,)
