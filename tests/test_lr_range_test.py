"""shard.lr_range_test: Smith's learning-rate range test on a ZeRO step (see
[Note: the learning-rate range test]), and DeepSpeed's LRRangeTest schedule."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ops
import shard
from tests import zero_models as M

rng = np.random.default_rng(0)
X = rng.standard_normal((64, 8)).astype(np.float32) * np.linspace(0.3, 2.0, 8, dtype=np.float32)
W_TRUE = rng.standard_normal((8, 1)).astype(np.float32)
DATA = {"x": X, "y": X @ W_TRUE}
# gradient descent on the mean squared error: Hessian 2 X'X / n, stable below 2 / its top
LAM = np.linalg.eigvalsh(2 * X.T.astype(np.float64) @ X / len(X))
STABLE = 2 / LAM.max()


def mse(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def sgd_step(comm):
    return lambda lr: shard.zero2(mse, optimizer=optax.sgd(lr), comm=comm)


def test_the_suggested_rate_is_one_gradient_descent_trains_fast_with():
    """Full-batch gradient descent on least squares (2 ranks, one global batch
    a step): the sweep diverges past 2 / the Hessian's top eigenvalue, and
    the suggested rate is below that bound and trains faster than a tenth of
    it."""
    params = {"w": np.zeros((8, 1), np.float32)}

    def run(comm):
        loader = shard.DataLoader(DATA, 64, comm=comm, shuffle=False)
        result = shard.lr_range_test(sgd_step(comm), params, loader, min_lr=1e-4,
                                     max_lr=100.0, steps=80)

        def final_loss(lr):
            step = shard.zero2(mse, optimizer=optax.sgd(lr), comm=comm)
            state = step.init(params)
            for batch in [next(iter(loader))] * 25:
                state, m = step(state, batch)
            return float(m["loss"])

        return result, final_loss(result.suggested), final_loss(result.suggested / 10)

    (result, fast, slow), other = ops.spawn(run, 2)
    assert result == other[0]  # every rank the same curve
    assert result.stopped == "diverged" and len(result.lrs) < 80
    np.testing.assert_allclose(np.diff(np.log(result.lrs)), math.log(1e6) / 79, rtol=1e-6)
    assert STABLE / 50 < result.suggested < STABLE
    assert fast < slow / 2  # the suggested rate learns fastest
    assert result.lrs[-1] > STABLE  # it stopped because the rate went past the bound


def test_the_callers_state_is_left_as_it_was():
    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(M.init_params())
        batches = [shard.split_batch(b, rank=comm.rank, world_size=2) for b in M.batches(3)]
        state, _ = step(state, batches[0])
        before = [x.copy() for x in (*state.master, *state.moments[0], *state.moments[1])]
        result = shard.lr_range_test(
            lambda lr: shard.zero3(M.loss, optimizer=ops.adamw(lr), comm=comm), state,
            batches, min_lr=1e-5, max_lr=1e-1, steps=12)
        after = (*state.master, *state.moments[0], *state.moments[1])
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(a, b)
        state, metrics = step(state, batches[1])  # and it still steps
        return len(result.lrs), int(state.step), math.isfinite(metrics["loss"])

    assert ops.spawn(run, 2) == [(12, 2, True)] * 2


def test_deepspeed_s_lr_range_test_schedule_maps_onto_the_optimizer_and_runs():
    params = {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 4,
              "lr_range_test_step_rate": 2.0}
    cfg = shard.from_deepspeed_config({
        "train_micro_batch_size_per_gpu": 32,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "LRRangeTest", "params": params}})
    lr = cfg.optimizer.learning_rate
    # DeepSpeed: min_lr at construction, then min_lr * (1 + rate * iterations / size)
    assert [lr(c) for c in (0, 1, 4, 8)] == pytest.approx([1e-3, 1.5e-3, 3e-3, 5e-3])
    stairs = shard.from_deepspeed_config({
        "train_micro_batch_size_per_gpu": 32,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "LRRangeTest",
                      "params": {**params, "lr_range_test_staircase": True}}})
    assert [stairs.optimizer.learning_rate(c) for c in (0, 3, 4, 7, 8)] == pytest.approx(
        [1e-3, 1e-3, 3e-3, 3e-3, 5e-3])

    def run(comm):
        return shard.lr_range_test(
            lambda sched: cfg.transform(mse, comm=comm, optimizer=ops.adamw(sched)),
            {"w": np.zeros((8, 1), np.float32)}, [DATA], schedule=lr, max_lr=1.0, steps=10)

    result = ops.spawn(run, 1)[0]
    assert result.lrs == pytest.approx([lr(c) for c in range(10)])
    with pytest.raises(ValueError, match="lr_range_test_step_size > 0"):
        shard.from_deepspeed_config({
            "train_micro_batch_size_per_gpu": 32,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}})


def test_the_curve_plots_with_the_suggested_rate_marked():
    import matplotlib

    matplotlib.use("Agg")
    result = shard.LRRangeTest(lrs=(1e-3, 1e-2, 1e-1), losses=(3.0, 2.0, 5.0),
                               smoothed=(3.0, 2.5, 3.2), suggested=1e-2, stopped="max_lr")
    ax = result.plot()
    assert ax.get_xscale() == "log" and len(ax.lines) == 3
    assert "suggested 1.00e-02" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_bad_arguments_are_refused_by_name():
    def run(comm):
        make, p = sgd_step(comm), {"w": np.zeros((8, 1), np.float32)}
        for kw, what in (({"min_lr": 1.0, "max_lr": 0.5}, "0 < min_lr < max_lr"),
                         ({"steps": 2}, "steps must be an int >= 4"),
                         ({"diverge": 1.0}, "diverge > 1")):
            with pytest.raises(ValueError, match=what):
                shard.lr_range_test(make, p, [DATA], **kw)
        with pytest.raises(ValueError, match="batches gave no batch"):
            shard.lr_range_test(make, p, [], steps=4)

    ops.spawn(run, 1)
