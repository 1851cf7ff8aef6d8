"""ZeroStep.evaluate: the loss at a state's params, averaged over ranks, with no update."""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard

ZERO = (shard.zero0, shard.zero1, shard.zero2, shard.zero3)


def mlp_loss(p, b):
    h = jnp.tanh(b["x"] @ p["a"]["w"])
    return jnp.mean((h @ p["b"]["w"] - b["y"]) ** 2)


LAYERED = shard.Layered([lambda p, _, b: jnp.tanh(b["x"] @ p["w"]),
                         lambda p, h, b: jnp.mean((h @ p["w"] - b["y"]) ** 2)])


def params():
    g = np.random.default_rng(0)
    return {"a": {"w": g.normal(size=(5, 7)).astype(np.float32)},
            "b": {"w": g.normal(size=(7, 3)).astype(np.float32)}}


def batch(rank):
    g = np.random.default_rng(10 + rank)
    return {"x": g.normal(size=(4, 5)).astype(np.float32),
            "y": g.normal(size=(4, 3)).astype(np.float32)}


@pytest.mark.parametrize("layered", [False, True], ids=["jax", "layered"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_evaluate_is_the_mean_loss_over_ranks_and_changes_nothing(world, stage, layered):
    loss = LAYERED if layered else mlp_loss

    def run(comm, evaluate):
        step = ZERO[stage](loss, optimizer=ops.adamw(1e-2), comm=comm)
        state = step.init(params())
        evals = []
        for _ in range(3):
            state, _ = step(state, batch(comm.rank))
            if evaluate:
                evals.append(step.evaluate(state, batch(comm.rank)))
        return evals, shard.gather(state, comm)

    with_eval = ops.spawn(lambda c: run(c, True), world)
    without = ops.spawn(lambda c: run(c, False), world)
    whole = with_eval[0][1]
    want = np.mean([float(mlp_loss(whole, batch(r))) for r in range(world)])
    for evals, _ in with_eval:
        assert evals[-1] == pytest.approx(want, rel=1e-5)
        assert evals[0] != evals[-1]
    for k in ("a", "b"):  # evaluating left the trajectory as it was
        np.testing.assert_array_equal(whole[k]["w"], without[0][1][k]["w"])


def test_a_torch_module_evaluates_in_eval_mode_and_stays_sharded():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))

    def loss(m, b):
        return m(b).pow(2).mean()

    def run(comm):
        net = copy.deepcopy(model)
        p, fn = it.functional(net, loss=loss)
        step = shard.zero3(fn, optimizer=ops.adamw(1e-2), comm=comm)
        state = step.init(p)
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(comm.rank))
        state, _ = step(state, x)
        first = step.evaluate(state, x)
        at_first = it.state_dict(net, state, comm=comm)
        assert step.evaluate(state, x) == first  # eval mode: no dropout, no stat update
        assert all(q.numel() == 0 for q in net.parameters())  # still sharded
        assert net.training
        state, m = step(state, x)  # and trains on
        return first, at_first, x, m["loss"]

    (first, at_first, x0, loss0), (_, _, x1, _) = ops.spawn(run, 2)
    assert np.isfinite(loss0)
    ref = copy.deepcopy(model)
    ref.load_state_dict(at_first)
    ref.eval()
    with torch.no_grad():
        # every rank evaluates with rank 0's BatchNorm statistics (state_dict's)
        want = (float(loss(ref, x0)) + float(loss(ref, x1))) / 2
    assert first == pytest.approx(want, rel=1e-5)
