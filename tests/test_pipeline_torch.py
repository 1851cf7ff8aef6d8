"""shard.pipeline over torch modules (interop.torch.layered) against one process
([Note: torch layers], [Note: pipeline])."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard
from tests import pipeline_models as PM

ZERO = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


@pytest.fixture(scope="module")
def want():
    return PM.torch_reference()


worst = PM.worst_difference


@pytest.mark.parametrize("data", [1, 2])
@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("stages", [2, 3])
def test_torch_pipeline_matches_one_process(want, stages, micro, data):
    schedule = "1f1b" if (stages + micro) % 2 else "gpipe"
    zero = ZERO[1 + (stages + micro + data) % 3]
    checkpointing = micro == 2  # graph and recompute both, at every ZeRO stage
    layers = PM.torch_layers()  # built once: thread ranks share torch's RNG
    results = ops.spawn(lambda c: PM.torch_run(c, stages=stages, microbatches=micro,
                                               schedule=schedule, zero=zero, layers=layers,
                                               checkpointing=checkpointing), stages * data)
    assert worst(results, want) < 1e-5
    covered = sorted(i for layers, _ in results for i in layers)
    assert covered == sorted(list(range(len(PM.TORCH_SIZES) - 1)) * data)
    assert len({tuple(round(x, 6) for x in r[1]) for r in results}) == 1


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 3])
def test_layered_modules_train_without_a_pipeline(want, stage, world):
    layers = PM.torch_layers()

    def run(comm):
        params, loss = it.layered(copy.deepcopy(layers), loss=PM.torch_mse)
        step = ZERO[stage](loss, optimizer=ops.adamw(PM.LR, weight_decay=PM.WD), comm=comm)
        state = step.init(params)
        for b in PM.torch_batches():
            n = b[0].shape[0] // comm.world_size
            state, _ = step(state, tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b))
        evaluated = step.evaluate(state, PM.torch_batches()[0])
        return shard.gather(state, comm), evaluated

    out = ops.spawn(run, world)
    got, evaluated = out[0]
    assert worst([(dict(enumerate(got)), None)], want) < 1e-5
    model = torch.nn.Sequential(*PM.torch_layers())
    for m, p in zip(model, want, strict=True):
        m.load_state_dict({k: torch.from_numpy(v) for k, v in p.items()})
    b = PM.torch_batches()[0]
    with torch.no_grad():
        assert evaluated == pytest.approx(float(PM.torch_mse(model(b[0]), b)), rel=1e-5)


def test_recomputing_draws_the_same_dropout_masks():
    """ZeRO-3 and activation checkpointing recompute each unit's forward in its
    backward: with the RNG state restored, dropout draws the masks the kept
    graph used, so the trajectories are bit for bit the same."""
    dropped = PM.torch_layers(dropout=0.3)

    def run(comm, zero, stages=None, layers=dropped):
        params, loss = it.layered(copy.deepcopy(layers), loss=PM.torch_mse)
        if stages:
            loss = shard.pipeline(loss, comm=comm, stages=stages, microbatches=1,
                                  activation_checkpointing=True)
            params = loss.params(params)
        step = zero(loss, optimizer=ops.adamw(PM.LR), comm=comm)
        state = step.init(params)
        torch.manual_seed(5)
        for b in PM.torch_batches():
            state, _ = step(state, b)
        return shard.gather(state, comm)

    graph = ops.spawn(lambda c: run(c, shard.zero2), 1)[0]
    recomputed = ops.spawn(lambda c: run(c, shard.zero3), 1)[0]
    piped = ops.spawn(lambda c: run(c, shard.zero2, stages=1), 1)[0]
    undropped = ops.spawn(lambda c: run(c, shard.zero2, layers=PM.torch_layers()), 1)[0]
    for i, layer in enumerate(graph):
        for k in layer:
            np.testing.assert_array_equal(recomputed[i][k], layer[k])
    assert np.abs(graph[0]["0.weight"] - undropped[0]["0.weight"]).max() > 1e-4  # it dropped
    for i in range(len(graph)):
        for k in graph[i]:
            np.testing.assert_array_equal(piped[i][k], graph[i][k])


def test_bf16_activations_cross_stages_as_they_flow_in_one_process():
    precision = shard.Precision(param_dtype="bfloat16")
    layers = PM.torch_layers()

    def run(comm, stages):
        params, loss = it.layered(copy.deepcopy(layers), loss=PM.torch_mse)
        if stages:
            loss = shard.pipeline(loss, comm=comm, stages=stages, microbatches=1)
            params = loss.params(params)
        step = shard.zero2(loss, optimizer=ops.adamw(PM.LR), comm=loss.data if stages
                           else comm, precision=precision)
        state = step.init(params)
        for b in PM.torch_batches():
            state, m = step(state, b)
        return shard.gather(state, loss.data if stages else comm), m["loss"]

    plain, plain_loss = ops.spawn(lambda c: run(c, None), 1)[0]
    out = ops.spawn(lambda c: run(c, 2), 2)
    assert out[0][1] == out[1][1] == plain_loss
    for layers, _ in out:
        for i, got in layers.items():
            for k in got:
                np.testing.assert_array_equal(got[k], plain[i][k])


def test_torch_stage_errors_are_named():
    with pytest.raises(TypeError, match=r"layers\[1\] is a str"):
        it.layered([torch.nn.Linear(2, 2), "relu"], loss=PM.torch_mse)
    shared = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"layers\[1\]\.0\.weight is also a parameter of "
                                         r"layers\[0\]"):
        it.layered([shared, torch.nn.Sequential(shared)], loss=PM.torch_mse)
    with pytest.raises(ValueError, match=r"layers\[0\] \(Tanh\) has no parameters"):
        it.layered([torch.nn.Tanh(), torch.nn.Linear(3, 3)], loss=PM.torch_mse)
    norm = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match=r"layers\[1\] has state in buffers \(1.running_mean"):
        it.layered([torch.nn.Linear(3, 3), norm], loss=PM.torch_mse)
    masked = torch.nn.Linear(3, 3)
    masked.register_buffer("mask", torch.ones(3), persistent=False)  # not state: taken
    assert len(it.layered([masked], loss=PM.torch_mse)[0]) == 1

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(5, 3)

        def forward(self, x):
            return self.lin(x), x

    def tuple_out(comm):
        params, loss = it.layered([Pair(), torch.nn.Linear(3, 3)],
                                  loss=lambda out, b: out.pow(2).mean())
        pipe = shard.pipeline(loss, comm=comm, stages=2)
        step = shard.zero1(pipe, optimizer=ops.adamw(1e-3), comm=pipe.data)
        step(step.init(pipe.params(params)), (torch.ones(2, 5),))

    with pytest.raises(TypeError, match="layer 0 returns tuple; a stage passes one floating"):
        ops.spawn(tuple_out, 2, timeout=30)

    class Shrinks(torch.nn.Linear):  # its second micro-batch's output loses a row
        calls = 0

        def forward(self, x):
            self.calls += 1
            y = super().forward(x)
            return y if self.calls % 2 else y[1:]

    def shape_changes(comm):
        torch.manual_seed(0)
        params, loss = it.layered([Shrinks(5, 3), torch.nn.Linear(3, 3)],
                                  loss=lambda out, b: out.pow(2).mean())
        pipe = shard.pipeline(loss, comm=comm, stages=2, microbatches=2)
        step = shard.zero1(pipe, optimizer=ops.adamw(1e-3), comm=pipe.data)
        step(step.init(pipe.params(params)), (torch.ones(4, 5),))

    with pytest.raises(ValueError, match=r"stage 0 sends stage 1 a float32\[1, 3\] after a "
                                         r"float32\[2, 3\] in the same step"):
        ops.spawn(shape_changes, 2, timeout=30)

    params, loss = it.layered(PM.torch_layers(), loss=PM.torch_mse)

    def share(comm):
        step = shard.zero1(loss, optimizer=ops.adamw(1e-3), comm=comm)
        step.init(params)

    with pytest.raises(ValueError, match="belongs to rank"):
        ops.spawn(share, 2)


@pytest.mark.multiprocess
def test_two_by_two_gloo_processes_train_torch_stages(gloo_shared):
    reports = gloo_shared("torch_pipeline", 4)
    for rep in reports:
        assert rep.get("ok"), rep
        assert rep["worst"] < 1e-5, rep


def test_zero3_binds_one_layer_at_a_time_and_releases_it():
    """At stage 3 a torch stage gathers a unit for its forward and again for its
    backward (recomputing the forward), and no other layer is whole meanwhile."""
    layers = PM.torch_layers()
    seen = []

    def run(comm):
        mods = copy.deepcopy(layers)
        params, loss = it.layered(mods, loss=PM.torch_mse)

        def record(module, args):
            if comm.rank == 0:
                seen.append([sum(p.numel() for p in m.parameters()) > 0 for m in mods])

        for m in mods:
            m.register_forward_pre_hook(record)
        step = shard.zero3(loss, optimizer=ops.adamw(PM.LR), comm=comm)
        step(step.init(params), PM.torch_batches(1)[0])
        return [sum(p.numel() for p in m.parameters()) for m in mods]

    after = ops.spawn(run, 2)
    n = len(layers)
    assert len(seen) == 2 * n  # each forward once, and once more in the backward
    order = [i for row in seen for i, whole in enumerate(row) if whole]
    assert order == [*range(n), *reversed(range(n))]  # exactly one whole layer each time
    assert after == [[0] * n] * 2  # released after the step


def test_tied_torch_weights_train_as_one_shared_parameter():
    """Layers 1 and 3 share one weight in the reference (one torch Parameter);
    the pipeline keeps a copy per stage, tied ([Note: tied weights])."""
    shared = PM.torch_layers()
    shared[3][0].weight = shared[1][0].weight
    model = torch.nn.Sequential(*copy.deepcopy(shared))
    opt = torch.optim.AdamW(model.parameters(), lr=PM.LR, weight_decay=PM.WD, fused=True)
    for b in PM.torch_batches():
        opt.zero_grad()
        PM.torch_mse(model(b[0]), b).backward()
        opt.step()
    want = [{k: v.detach().numpy().copy() for k, v in m.state_dict().items()} for m in model]
    copies = PM.torch_layers()
    copies[3][0].weight = torch.nn.Parameter(copies[1][0].weight.detach().clone())
    tied = [[(1, "0.weight"), (3, "0.weight")]]
    results = ops.spawn(lambda c: PM.torch_run(c, stages=2, microbatches=2, layers=copies,
                                               zero=shard.zero3, tied=tied), 4)
    assert 1 in results[0][0] and 3 not in results[0][0]  # the copies on different stages
    assert {i for layers, _ in results for i in layers} == set(range(5))
    assert worst(results, want) < 1e-5


def test_balance_by_time_times_torch_modules():
    class Slow(torch.nn.Module):  # the parameters of a small layer, 100 times its work
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):  # far enough from the others that a busy machine keeps the order
            for _ in range(100):
                x = torch.tanh(self.lin(x))
            return x

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64), Slow(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)]
    params, loss = it.layered(layers, loss=lambda out, b: out.mean())
    x = (torch.randn(256, 64),)
    assert shard.balance_by_time(loss, params, x, 3) == [1, 1, 2]
    assert all(p.grad is None for m in layers for p in m.parameters())


def test_evaluate_runs_the_stages_in_eval_mode():
    """A pipeline of torch stages evaluates forward only, without dropout, to
    the loss of the same modules in one process."""
    layers = PM.torch_layers(dropout=0.5)
    batch = PM.torch_batches(1)[0]

    def run(comm):
        params, loss = it.layered(copy.deepcopy(layers), loss=PM.torch_mse)
        pipe = shard.pipeline(loss, comm=comm, stages=2, microbatches=2)
        step = shard.zero3(pipe, optimizer=ops.adamw(PM.LR), comm=pipe.data)
        state = step.init(pipe.params(params))
        n, r = len(batch[0]) // pipe.data.world_size, pipe.data.rank
        return step.evaluate(state, tuple(t[r * n:(r + 1) * n] for t in batch)), \
            [m.training for m in loss.layers]

    out = ops.spawn(run, 4)
    model = torch.nn.Sequential(*copy.deepcopy(layers)).eval()
    with torch.no_grad():
        want = float(PM.torch_mse(model(batch[0]), batch))
    assert max(abs(got - want) for got, _ in out) < 1e-6
    assert all(all(modes) for _, modes in out)  # back in training mode


@pytest.mark.parametrize("micro", [1, 2])
def test_gpt_example_in_two_stages_follows_the_gpt(micro):
    """examples/gpt.py's GPT as a chain (its embedding tied to the head across
    the stages) against the GPT itself under torch's fused AdamW, one process,
    accumulating the same micro-batches."""
    from examples import gpt

    cfg = gpt.GPTConfig(seq=16, d=32, layers=2, heads=2)
    text = gpt.corpus()
    batches = [gpt.sample_batch(text, i, 8, cfg.seq) for i in range(4)]
    model = gpt.build(cfg)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=PM.LR, weight_decay=PM.WD, fused=True)
    for b in batches:  # the same micro-batches, accumulated
        opt.zero_grad()
        for part in zip(*(t.chunk(micro) for t in b), strict=True):
            (gpt.lm_loss(ref, part) / micro).backward()
        opt.step()
    want = [{k: v.detach().numpy() for k, v in m.named_parameters()}
            for m in gpt.chain(ref)]
    want[-1]["head.weight"] = ref.tok_emb.weight.detach().numpy()

    def run(comm):
        params, loss = it.layered(gpt.chain(copy.deepcopy(model)), loss=gpt.chain_loss)
        pipe = shard.pipeline(loss, comm=comm, stages=2, microbatches=micro,
                              tied=gpt.tied_weights(cfg))
        step = shard.zero2(pipe, optimizer=ops.adamw(PM.LR, weight_decay=PM.WD), comm=pipe.data)
        state = step.init(pipe.params(params))
        for b in batches:
            state, _ = step(state, b)
        return shard.gather(state, pipe.data), None

    results = ops.spawn(run, 2)
    assert sorted(i for layers, _ in results for i in layers) == list(range(cfg.layers + 2))
    # The key projection's bias has no true gradient (softmax ignores a constant
    # added to every key), so Adam turns its rounding noise into updates, and
    # any regrouping of a sum moves them: checked apart, more loosely.
    d = cfg.d
    keys = [(got.pop("block.qkv.bias")[d:2 * d], want[i]["block.qkv.bias"][d:2 * d])
            for layers, _ in results for i, got in layers.items() if "block.qkv.bias" in got]
    for layers, _ in results:
        for i in layers:
            want[i].pop("block.qkv.bias", None)
    assert len(keys) == cfg.layers
    assert worst(results, want) < 1e-5
    assert max(float(np.abs(a - b).max()) for a, b in keys) < 1e-4
