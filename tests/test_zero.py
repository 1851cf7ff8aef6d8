"""ZeRO stages 0-3 against a single-process optax.adamw run on the full batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import shard
from tests import zero_models as M
from tests.harness import assert_rank_slices, run_steps

STEPS = 10
STAGES = [0, 1, 2, 3]
WORLDS = [1, 2, 3, 4]
ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


def train(comm, *, stage, loss_fn=M.loss, precision=None, clip_norm=None, accumulate=1,
          steps=STEPS, data=None):
    step = ZERO[stage](loss_fn, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm,
                       precision=precision, clip_norm=clip_norm)
    state, metrics = run_steps(step, M.init_params(), data or M.batches(steps), comm,
                               micro=accumulate)
    return state, [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


def assert_shards_match(state, comm, want_params, rtol, atol=1e-6):
    assert_rank_slices(state.params, want_params, comm.rank, comm.world_size, rtol=rtol,
                       atol=atol)


@pytest.fixture(scope="module")
def fp32_reference():
    return M.reference(STEPS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_fp32_matches_single_process_adamw(fp32_reference, stage, world):
    want, want_losses, want_norms = fp32_reference

    def run(comm):
        state, losses, norms = train(comm, stage=stage)
        assert_shards_match(state, comm, want, rtol=1e-5)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        return shard.gather(state, comm)

    for full in ops.spawn(run, world):
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                                        atol=1e-6), full, want)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [0, 3])
def test_layered_loss_matches_monolithic(fp32_reference, stage, world):
    want, want_losses, _ = fp32_reference

    def run(comm):
        state, losses, _ = train(comm, stage=stage, loss_fn=M.LAYERED)
        assert_shards_match(state, comm, want, rtol=1e-5)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)

    ops.spawn(run, world)


@pytest.fixture(scope="module")
def bf16_reference():
    return M.reference(STEPS, param_dtype=jnp.bfloat16)


@pytest.mark.parametrize("world", WORLDS)
def test_bf16_mixed_precision_stages_agree_and_track_reference(bf16_reference, world):
    """bf16 compute params and gradients, fp32 masters and reduction."""
    want, _, _ = bf16_reference
    policy = shard.Precision(param_dtype=ops.BF16, reduce_dtype=np.float32)
    finals = {}
    for stage in STAGES:
        def run(comm, stage=stage):
            state, _, _ = train(comm, stage=stage, precision=policy)
            assert state.compute[0].dtype == ops.BF16
            assert_shards_match(state, comm, want, rtol=2e-2, atol=2e-2)
            return shard.gather(state, comm)

        finals[stage] = ops.spawn(run, world)[0]
    for stage in STAGES[1:]:  # every stage computes the same sums in the same order
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                                        atol=1e-7),
                               finals[stage], finals[0])


@pytest.mark.parametrize("stage", STAGES)
def test_gradient_accumulation_equals_one_big_batch(fp32_reference, stage):
    want, want_losses, want_norms = fp32_reference

    def run(comm):
        state, losses, norms = train(comm, stage=stage, accumulate=3)
        assert_shards_match(state, comm, want, rtol=1e-5)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)

    ops.spawn(run, 2)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_clipping_uses_the_global_norm_across_shards(stage):
    want, _, _ = M.reference(STEPS, clip_norm=0.05)

    def run(comm):
        state, _, _ = train(comm, stage=stage, clip_norm=0.05)
        assert_shards_match(state, comm, want, rtol=1e-5)

    ops.spawn(run, 3)


@pytest.mark.multiprocess
def test_two_gloo_processes_match_the_reference(gloo_shared):
    reports = gloo_shared("zero", 2)
    for r, rep in enumerate(reports):
        assert rep.get("ok"), (r, rep)
        assert rep["failures"] == [], (r, rep["failures"])


@pytest.mark.parametrize("stage", STAGES)
def test_float64_matches_the_reference_tightly(stage):
    """float64 params keep float64 masters and moments (numpy's exact path)."""
    jax.config.update("jax_enable_x64", True)
    try:
        def f64(tree):
            return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), tree)

        data = [f64(b) for b in M.batches(STEPS)]
        params = f64(M.init_params())
        ref = {"p": params, "s": None}
        import optax

        opt = optax.adamw(M.LR, weight_decay=M.WD)
        ref["s"] = opt.init(params)
        grad = jax.jit(jax.grad(M.loss))
        for b in data:
            updates, ref["s"] = opt.update(grad(ref["p"], b), ref["s"], ref["p"])
            ref["p"] = optax.apply_updates(ref["p"], updates)
        want = jax.tree_util.tree_map(np.asarray, ref["p"])

        def run(comm):
            step = ZERO[stage](M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm)
            assert step.init(params).master[0].dtype == np.float64
            state, _ = run_steps(step, params, data, comm)
            # 1000x tighter than fp32 (other world sizes sum gradients in another order)
            assert_shards_match(state, comm, want, rtol=1e-8, atol=1e-9)

        ops.spawn(run, 3)
    finally:
        jax.config.update("jax_enable_x64", False)
