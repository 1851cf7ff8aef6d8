"""A torch module's buffers and tied names: synced across ranks, saved, loaded and
consolidated ([Note: torch buffers])."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard
from shard.checkpoint import consolidate


class Net(torch.nn.Module):
    """BatchNorm statistics (float and int64 buffers) and a weight tied across units."""

    def __init__(self, track: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(5, 7, bias=False)
        self.norm = torch.nn.BatchNorm1d(7, track_running_stats=track)
        self.head = torch.nn.Linear(7, 5, bias=False)
        self.back = torch.nn.Linear(5, 7, bias=False)
        self.back.weight = self.emb.weight  # tied: the root unit holds it

    def forward(self, x):
        return self.back(self.head(self.norm(self.emb(x))))


def built(**kw):
    torch.manual_seed(0)
    return Net(**kw)


def batch(rank, i):
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(100 * i + rank))


def train(comm, model, stage, steps, broadcast=True, seen=None):
    net = copy.deepcopy(model)
    if seen is not None:  # the running mean each forward normalises towards
        net.norm.register_forward_pre_hook(
            lambda m, a: seen.append(m.running_mean.clone()))
    params, fn = it.functional(net, loss=lambda m, b: m(b).pow(2).mean(),
                               broadcast_buffers=broadcast)
    step = shard.zero0(fn, optimizer=ops.adamw(1e-2), comm=comm) if stage == 0 else \
        (shard.zero1, shard.zero2, shard.zero3)[stage - 1](fn, optimizer=ops.adamw(1e-2),
                                                           comm=comm)
    state = step.init(params)
    for i in range(steps):
        state, _ = step(state, batch(comm.rank, i))
    return net, step, state


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_every_rank_forwards_with_rank_0s_statistics(stage):
    model = built()

    def run(comm, broadcast):
        seen = []
        net, _, _ = train(comm, model, stage, 3, broadcast, seen)
        return seen, net.norm.running_mean.clone()

    synced = ops.spawn(lambda c: run(c, True), 2)
    for a, b in zip(synced[0][0], synced[1][0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(synced[0][1], synced[1][1])  # each rank's last update is its own
    apart = ops.spawn(lambda c: run(c, False), 2)
    assert not torch.equal(apart[0][0][-1], apart[1][0][-1])


def test_checkpoints_keep_rank_0s_buffers_and_load_them_into_the_module(tmp_path):
    model = built()

    def save(comm):
        net, _, state = train(comm, model, 3, 2)
        shard.save(state, tmp_path / "ck", comm=comm)
        return {k: v.clone() for k, v in it.state_dict(net, state, comm=comm).items()}

    before = ops.spawn(save, 2)[0]

    def load(comm):
        net = copy.deepcopy(model)
        params, fn = it.functional(net, loss=lambda m, b: m(b).pow(2).mean())
        step = shard.zero1(fn, optimizer=ops.adamw(1e-2), comm=comm)
        step.init(params)
        state, _ = shard.load(tmp_path / "ck", step, comm=comm)
        return {k: v.clone() for k, v in it.state_dict(net, state, comm=comm).items()}

    after = ops.spawn(load, 1)[0]
    assert set(after) == set(before)
    for k in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
        assert torch.equal(after[k], before[k]), k
    assert int(after["norm.num_batches_tracked"]) == 2


def test_consolidated_file_loads_strictly_with_tied_names_and_buffers(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = built()

    def run(comm):
        net, _, state = train(comm, model, 2, 2)
        shard.save(state, tmp_path / "ck", comm=comm)
        return it.state_dict(net, state, comm=comm)

    want = ops.spawn(run, 3)[0]
    consolidate(tmp_path / "ck", tmp_path / "model.safetensors")
    fresh = Net()
    fresh.load_state_dict(safetensors_torch.load_file(tmp_path / "model.safetensors"),
                          strict=True)
    got = fresh.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert torch.equal(got["back.weight"], got["emb.weight"])


def test_buffers_that_do_not_fit_are_refused_and_the_step_is_unchanged(tmp_path, caplog):
    model = built()
    def save(comm):
        _, _step, state = train(comm, model, 1, 1)  # _step holds the module's buffers
        shard.save(state, tmp_path / "ck", comm=comm)

    ops.spawn(save, 1)

    def load(comm):
        net = built(track=False)  # the same params, no running statistics
        params, fn = it.functional(net, loss=lambda m, b: m(b).pow(2).mean())
        step = shard.zero2(fn, optimizer=ops.adamw(1e-2), comm=comm)
        state = step.init(params)
        with pytest.raises(shard.CheckpointError, match=r"norm\.running_mean"):
            shard.load(tmp_path / "ck", step, comm=comm)
        state, m = step(state, batch(0, 0))  # the step still takes its own state
        return m["loss"]

    assert np.isfinite(ops.spawn(load, 1)[0])
    with caplog.at_level(logging.WARNING):  # a loss with nowhere to put them: said so
        import jax.numpy as jnp

        comm = ops.spawn(lambda c: c, 1)[0]
        step = shard.zero2(lambda p, b: jnp.sum(p["emb.weight"] ** 2),
                           optimizer=ops.adamw(1e-2), comm=comm)
        like = {k: v.detach().numpy() for k, v in Net().named_parameters()}
        step.init(like)
        shard.load(tmp_path / "ck", step, comm=comm)
    assert "module buffers" in caplog.text
