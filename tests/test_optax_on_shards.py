"""optax transformations on ZeRO's shards (see [Note: optax on shards]).

Every rank's master shard and optimizer-state shard equals the slice of
single-process optax's over five steps, at stages 1-3 on 1-3 thread ranks with
leaves whose rows do not divide (LAMB's and Adafactor's per-leaf norms summed
over the ranks); what cannot act on shards is refused by name before any
state exists; the state checkpoints and reshards like Adam's.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ops
import shard
from ops.testing import STANDIN
from tests.harness import assert_rank_slices, run_steps

ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}
STEPS = 5


def loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2) + 0.1 * jnp.sum(p["scale"] ** 2)


def init_params():
    rng = np.random.default_rng(0)
    return {"w1": (0.5 * rng.standard_normal((5, 7))).astype(np.float32),
            "b1": (0.1 * rng.standard_normal(7)).astype(np.float32),
            "w2": (0.5 * rng.standard_normal((7, 3))).astype(np.float32),
            "scale": np.float32(0.5)}  # a scalar: replicated on every rank


def batches(n=STEPS):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((6, 5)).astype(np.float32),
             "y": rng.standard_normal((6, 3)).astype(np.float32)} for _ in range(n)]


ELEMENTWISE = {
    "sgd-momentum": lambda: optax.sgd(5e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-2, weight_decay=1e-2),
    "clip-adamw": lambda: optax.chain(optax.clip_by_global_norm(0.05),
                                      optax.adamw(1e-2, weight_decay=1e-2)),
    "adabelief-schedule": lambda: optax.adabelief(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, STEPS)),
    "rmsprop-masked-decay": lambda: optax.chain(
        optax.add_decayed_weights(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        optax.rmsprop(1e-2, momentum=0.5)),
    # per-leaf norms and RMS over every rank's rows (see shard/core/_parts.py)
    "lamb": lambda: optax.lamb(1e-2, weight_decay=1e-2),
    "clip-lamb": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.lamb(1e-2)),
    "adafactor": lambda: optax.adafactor(1e-2),  # no leaf big enough to factor
}


def reference(tx, params, data):
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)
    for b in data:
        updates, state = tx.update(jax.grad(loss)(p, b), state, p)
        p = optax.apply_updates(p, updates)
    return p, state


def train(comm, tx, stage, data, **kw):
    step = ZERO[stage](loss, optimizer=tx, comm=comm, **kw)
    return step, *run_steps(step, init_params(), data, comm)


CASES = [(name, stage, world) for name in sorted(ELEMENTWISE)
         for stage, world in ((1, 3), (2, 2), (3, 3))]
CASES += [("lion", 3, 1), ("clip-adamw", 1, 1), ("sgd-momentum", 3, 2), ("clip-adamw", 2, 3),
          ("lamb", 3, 1), ("lamb", 3, 2), ("adafactor", 1, 1)]


@pytest.mark.parametrize("name,stage,world", CASES)
def test_elementwise_transformations_match_single_process_optax(name, stage, world):
    data = batches()
    want_p, want_s = reference(ELEMENTWISE[name](), init_params(), data)

    def run(comm):
        _, state, metrics = train(comm, ELEMENTWISE[name](), stage, data)
        assert_rank_slices(state.params, want_p, comm.rank, world)
        opt = state.opt  # optax's own state structure, moments as this rank's views
        assert jax.tree.structure(opt) == jax.tree.structure(want_s)
        assert_rank_slices(opt, want_s, comm.rank, world, zero_padding=False)
        assert "lr" not in metrics[-1] and not metrics[-1]["skipped"]
        return float(metrics[0]["loss"])

    first = ops.spawn(run, world)
    np.testing.assert_allclose(first, float(loss(init_params(), data[0])), rtol=1e-5)


def test_moments_are_named_and_counted_like_adams():
    def run(comm):
        _, state, _ = train(comm, ELEMENTWISE["clip-adamw"](), 3, batches(1))
        assert state.meta.moment_names == ("1.0.mu", "1.0.nu")
        assert [np.shape(x) for x in state.opt_rest] == [()]  # scale_by_adam's count
        with pytest.raises(AttributeError, match=r"no 'exp_avg'.*1\.0\.mu"):
            _ = state.exp_avg
        assert state.nbytes()["optimizer"] == 2 * state.nbytes()["params"] + 4
        return state.meta.layout.local_size()

    local = ops.spawn(run, 2)[0]
    est = shard.estimate_memory(init_params(), stage=3, world_size=2,
                                optimizer=optax.lion(1e-3))
    assert est["optimizer"] == 4 * local and est["params"] == 4 * local  # Lion: one moment


def _factored():
    return optax.adafactor(1e-2, min_dim_size_to_factor=4)  # w1 and w2 keep row/col stats


@pytest.mark.parametrize("make,world,stage", [
    (lambda: optax.lars(1e-2), 1, 3), (lambda: optax.lars(1e-2), 2, 0),
    (_factored, 1, 2), (_factored, 3, 0),
], ids=["lars-one-rank", "lars-stage0", "factored-adafactor-one-rank",
        "factored-adafactor-stage0"])
def test_whole_leaf_reductions_run_where_every_leaf_is_whole(make, world, stage):
    data = batches()
    want_p, _ = reference(make(), init_params(), data)

    def run(comm):
        _, state, _ = train(comm, make(), stage, data)
        for g, w in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_p), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)

    ops.spawn(run, world)


def _leaf_normalize():
    """A transformation optax does not ship: each leaf scaled to unit mean |g|."""
    def update(g, state, params=None):
        return jax.tree.map(lambda x: x / (jnp.mean(jnp.abs(x)) + 1e-12), g), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


@pytest.mark.parametrize("make,named", [
    (lambda: optax.lars(1e-3), "scale_by_trust_ratio needs each whole leaf's norm"),
    (_factored, "scale_by_factored_rms needs each whole leaf's row and column means"),
    (lambda: optax.chain(optax.adam(1e-3), optax.clip_by_global_norm(1.0)),
     "clip_by_global_norm needs the whole tree's norm"),
    (lambda: optax.chain(optax.add_noise(0.1, 0.5, 0), optax.sgd(1e-3)), "add_noise"),
    (lambda: optax.chain(_leaf_normalize(), optax.sgd(1e-3)), "on a probe of the params"),
], ids=["lars-masked-trust-ratio", "factored-adafactor", "clip-after-adam", "noise",
        "unknown-leaf-reduction"])
def test_what_cannot_act_on_shards_is_refused_by_name_at_init(make, named):
    def run(comm):
        step = shard.zero2(loss, optimizer=make(), comm=comm)
        with pytest.raises(ValueError, match=named) as e:
            step.init(init_params())
        assert "does not act element by element" in str(e.value)
        assert "unknown" not in named or "_leaf_normalize" in str(e.value)
        assert step.plan is None  # nothing was made

    ops.spawn(run, 2)


def test_optax_needs_host_state_and_no_offload():
    def run(comm):
        with pytest.raises(TypeError, match=r"runs on host \(numpy\) state.*ops\.adamw"):
            shard.zero1(loss, optimizer=optax.lion(1e-3), comm=comm).init(
                ops.testing.to_device(init_params(), STANDIN))
        with pytest.raises(TypeError, match="offload= keeps Adam's moments"):
            shard.zero3(loss, optimizer=optax.lion(1e-3), comm=comm,
                        offload=shard.Offload("host")).init(init_params())
        with pytest.raises(TypeError, match=r"optimizer must be ops\.adamw.*ops\.lion.*optax"):
            shard.zero1(loss, optimizer="lion", comm=comm)

    ops.spawn(run, 2)


def test_non_finite_gradients_skip_the_transformation():
    bad = dict(batches(1)[0])
    bad["x"] = bad["x"].copy()
    bad["x"][0, 0] = np.nan

    def run(comm):
        step = shard.zero2(loss, optimizer=optax.adam(1e-2), comm=comm)
        state = step.init(init_params())
        before = [np.array(x) for x in jax.tree.leaves(state.params)]
        state, m = step(state, shard.split_batch(bad, rank=comm.rank, world_size=2))
        assert m["skipped"]
        assert int(state.opt[0].count) == 0  # optax's own count did not advance
        for a, b in zip(before, jax.tree.leaves(state.params), strict=True):
            np.testing.assert_array_equal(a, b)

    ops.spawn(run, 2)


def test_mixed_precision_compute_params_follow_the_masters():
    def run(comm):
        step, state, _ = train(comm, optax.lion(1e-2), 2, batches(2),
                               precision=shard.Precision(param_dtype=jnp.bfloat16))
        whole = shard.gather(state, comm)
        layout = step.plan.full_layout
        compute = jax.tree.unflatten(layout.treedef, layout.local_views(state.compute))
        for c, w in zip(jax.tree.leaves(compute), jax.tree.leaves(whole), strict=True):
            np.testing.assert_array_equal(np.asarray(c),
                                          np.asarray(w).astype(jnp.bfloat16))

    ops.spawn(run, 3)


def test_checkpoint_reshards_optax_state(tmp_path):
    make = ELEMENTWISE["clip-adamw"]
    data = batches()
    want_p, want_s = reference(make(), init_params(), data)

    def first(comm):
        _, state, _ = train(comm, make(), 3, data[:3])
        shard.save(state, tmp_path / "ckpt", comm=comm)

    def resume(comm):
        step = shard.zero1(loss, optimizer=make(), comm=comm)
        state, _ = shard.load(tmp_path / "ckpt", step, comm=comm, like=init_params())
        for b in data[3:]:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=3))
        assert_rank_slices(state.params, want_p, comm.rank, 3)
        assert_rank_slices(state.opt, want_s, comm.rank, 3, zero_padding=False)
        adam = shard.zero1(loss, optimizer=ops.adamw(1e-2), comm=comm)
        with pytest.raises(shard.CheckpointError, match=r"moments are \['1.0.mu', '1.0.nu'\]"):
            shard.load(tmp_path / "ckpt", adam, comm=comm, like=init_params())

    ops.spawn(first, 2)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["optimizer"] == {"moments": ["1.0.mu", "1.0.nu"],
                                     "rest": [{"shape": [], "dtype": "int32"}]}
    ops.spawn(resume, 3)
    manifest["optimizer"]["rest"][0]["dtype"] = "float64"  # the file holds an int32
    (tmp_path / "ckpt" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(shard.CheckpointError, match=r"opt_rest/0.*float64"):
        shard.checkpoint.inspect(tmp_path / "ckpt")
