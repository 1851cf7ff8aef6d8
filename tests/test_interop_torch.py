"""interop.torch: ZeRO on torch modules against plain torch.optim.AdamW."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard
from examples import gpt

ZERO = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}
LR, WD, STEPS = 1e-2, 0.01, 10


class MLP(torch.nn.Module):
    """Odd sizes (none divides 2-4 ranks), a buffer, and a weight tied across units."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(7, 13)
        self.hidden = torch.nn.Sequential(torch.nn.Linear(13, 13), torch.nn.Tanh())
        self.out = torch.nn.Linear(13, 7)
        if tied:
            self.out.weight = torch.nn.Parameter(self.inp.weight.detach().T.contiguous())
            self.back = torch.nn.Linear(7, 13, bias=False)
            self.back.weight = self.inp.weight  # used by two units: the root unit holds it
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))
        self.tied = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.hidden(h)
        y = self.out(h) * self.scale
        if self.tied:
            y = y + 0.1 * self.back(y).sum(dim=1, keepdim=True)
        return y


def mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def data(steps=STEPS, n=24):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 7, generator=g), torch.randn(n, 7, generator=g)) for _ in range(steps)]


def reference(make, loss, batches):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    for b in batches:
        opt.zero_grad()
        loss(model, b).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.named_parameters()}


def built(make):
    """One model, built once (thread ranks share torch's RNG); each rank deepcopies it."""
    torch.manual_seed(0)
    return make()


def zero_run(comm, stage, make, loss, batches, model=None):
    model = copy.deepcopy(model if model is not None else built(make))
    params, fn = it.functional(model, loss=loss)
    step = ZERO[stage](fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
    state = step.init(params)
    for b in batches:
        n = b[0].shape[0] // comm.world_size
        state, _ = step(state, tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b))
    return shard.gather(state, comm), step


@pytest.mark.parametrize("tied", [False, True], ids=["plain", "tied"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mlp_matches_torch_adamw(world, stage, tied):
    batches = data()
    want = reference(lambda: MLP(tied), mse, batches)
    model = built(lambda: MLP(tied))
    got = ops.spawn(lambda c: zero_run(c, stage, None, mse, batches, model)[0], world)[0]
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


SMALL = gpt.GPTConfig(seq=16, d=32, layers=2, heads=2)


def reference_dp(model, loss, batches, world):
    """torch AdamW (fused) on the gradient data parallelism computes: each rank's
    local gradient, summed in rank order, times 1/world."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    for b in batches:
        n = b[0].shape[0] // world
        total = None
        for r in range(world):
            model.zero_grad()
            loss(model, tuple(t[r * n:(r + 1) * n] for t in b)).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            total = grads if total is None else [a + g for a, g in zip(total, grads, strict=True)]
        for p, g in zip(model.parameters(), total, strict=True):
            p.grad = g * np.float32(1.0 / world)
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gpt_is_bit_identical_to_torch_adamw_on_the_same_gradients(world, stage):
    """Tied embedding and head, a causal-mask buffer, ZeRO-3 through hooks.

    Against the full batch in one process the result differs exactly as much as
    torch differs from itself when the batch's gradient sum is regrouped (a
    different floating-point order, amplified by Adam where gradients are
    tiny); the test against the MLP above covers full-batch parity."""
    text = gpt.corpus()
    batches = [gpt.sample_batch(text, i, 12, SMALL.seq) for i in range(STEPS)]
    model = built(lambda: gpt.GPT(SMALL))
    want = reference_dp(model, gpt.lm_loss, batches, world)
    got = ops.spawn(lambda c: zero_run(c, stage, None, gpt.lm_loss, batches, model)[0],
                    world)[0]
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_zero3_on_a_module_keeps_at_most_two_units_alive():
    depth, width = 6, 48

    def make():
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])

    def loss(m, b):
        return m(b[0]).pow(2).mean()

    batches = [(torch.randn(8, width),) for _ in range(3)]
    unit = (width * width + width) * 4
    model = built(make)
    for peak in ops.spawn(lambda c: zero_run(c, 3, None, loss, batches, model)[1].tracker.peak,
                          4):
        assert unit <= peak <= 2 * unit, peak / unit


class CountingLinear(torch.nn.Linear):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


def test_extra_prefetches_leave_room_for_the_unit_being_copied_out(caplog):
    """A small unit (the final norm) after a large one (the block) is prefetched
    only if the block's copy-out, which briefly holds it twice, still fits."""
    cfg = gpt.GPTConfig(seq=16, d=32, layers=1, heads=2)
    model = built(lambda: gpt.GPT(cfg))
    text = gpt.corpus()
    batches = [gpt.sample_batch(text, i, 4, cfg.seq) for i in range(2)]
    runs = ops.spawn(lambda c: zero_run(c, 3, None, gpt.lm_loss, batches, model)[1], 2)
    assert "memory bound" not in caplog.text
    for step in runs:
        units = step.layout.units
        root = [u.name for u in units].index("<root>")
        largest = max(u.sharded_size for u in units) * 2 * 4
        assert step.tracker.peak <= units[root].sharded_size * 2 * 4 + 2 * largest


@pytest.mark.parametrize("checkpointing", [False, True], ids=["saved", "recomputed"])
def test_zero3_runs_each_unit_forward_once_unless_checkpointing(checkpointing):
    """By default a unit's forward runs once per step, its gathered params saved
    for the backward as references (re-gathered there); with activation
    checkpointing it runs again in the backward. Both match torch's AdamW, and
    both keep at most two units' full params alive."""
    depth, width = 5, 37

    def make():
        return torch.nn.Sequential(*[torch.nn.Sequential(CountingLinear(width, width),
                                                         torch.nn.GELU())
                                     for _ in range(depth)])

    def loss(m, b):
        return m(b[0]).pow(2).mean()

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(12, width, generator=g),) for _ in range(4)]
    want = reference(make, loss, batches)
    model = built(make)

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=loss,
                                   activation_checkpointing=checkpointing)
        step = shard.zero3(fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state = step.init(params)
        for b in batches:
            n = b[0].shape[0] // comm.world_size
            state, _ = step(state, tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b))
        return shard.gather(state, comm), step.tracker.peak

    CountingLinear.calls = 0
    results = ops.spawn(run, 3)
    assert CountingLinear.calls == 3 * len(batches) * depth * (2 if checkpointing else 1)
    unit = (width * width + width) * 4
    padded = -(-width // 3) * 3 * (width + 1) * 4  # a unit's all-gathered rows, 3 ranks
    for got, peak in results:
        assert unit <= peak <= 2 * padded, peak / unit
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_zero3_saves_param_views_as_references_not_tensors():
    """Autograd saves ``weight.t()`` (a view) for a linear layer's backward: at the
    end of the forward only the last unit's full params may still be alive."""
    depth, width = 6, 32
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    unit = (width * width + width) * 4

    def run(comm):  # two ranks: one rank's shards are its whole params, never gathered
        seen = []

        def loss(m, b):
            out = m(b[0]).pow(2).mean()
            seen.append(step.tracker.live)  # every unit's forward has run; no backward yet
            return out

        params, fn = it.functional(copy.deepcopy(model), loss=loss)
        step = shard.zero3(fn, optimizer=ops.adamw(LR), comm=comm)
        state = step.init(params)
        step(state, (torch.ones(3, width),))
        return seen

    assert ops.spawn(run, 2) == [[unit], [unit]]


def test_gpt_state_per_rank_falls_as_the_zero_formula_says():
    cfg = gpt.GPTConfig(seq=16, d=64, layers=2, heads=2)

    model = built(lambda: gpt.GPT(cfg))

    def held(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=gpt.lm_loss)
        state = shard.zero3(fn, optimizer=ops.adamw(LR), comm=comm).init(params)
        est = shard.estimate_memory(params, stage=3, world_size=comm.world_size,
                                    units=fn.units)
        return sum(state.nbytes().values()), est

    totals = {}
    for w in (1, 2, 4):
        total, est = ops.spawn(held, w)[0]
        assert total == est["params"] + est["optimizer"] + est["compute_params"]
        totals[w] = total
    n = sum(p.numel() for p in model.parameters())
    assert totals[1] == 12 * n  # fp32 masters + two moments
    for w in (2, 4):  # 12 bytes per param / W, plus each leaf's padding rows
        assert 12 * n / w <= totals[w] <= 12 * n / w * 1.02


def test_load_state_and_functional_share_memory():
    model = MLP()
    params, _ = it.functional(model, loss=mse)
    assert all(params[k].ctypes.data == p.data_ptr() for k, p in model.named_parameters())
    fresh = MLP()
    it.load_state(fresh, {k: np.asarray(v) for k, v in params.items()})
    for (k, a), b in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), k
    with pytest.raises(KeyError, match="no values for"):
        it.load_state(fresh, {})
    with pytest.raises(TypeError, match=r"expected a torch\.nn\.Module"):
        it.functional(copy.deepcopy, loss=mse)


@pytest.mark.multiprocess
def test_two_gloo_processes_train_torch_modules(gloo_shared):
    reports = gloo_shared("torch", 2)
    for r, rep in enumerate(reports):
        assert rep.get("ok"), (r, rep)
        assert rep["failures"] == [], (r, rep["failures"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_reductions_start_inside_the_backward(stage):
    """Each unit's reduction is launched from the gradient hooks while autograd
    still runs the earlier units' backward: communication overlaps compute."""
    model = built(lambda: torch.nn.Sequential(*[torch.nn.Linear(9, 9) for _ in range(4)]))
    zero = (shard.zero0, shard.zero1, shard.zero2, shard.zero3)[stage]

    def run(comm):
        launched = []
        for name in ("all_reduce_async", "reduce_scatter_async"):
            original = getattr(type(comm), name)

            def spy(self, *a, _original=original, **kw):
                launched.append(torch._C._current_graph_task_id())
                return _original(self, *a, **kw)

            setattr(comm, name, spy.__get__(comm))
        params, fn = it.functional(copy.deepcopy(model), loss=lambda m, b: m(b).pow(2).mean())
        step = zero(fn, optimizer=ops.adamw(LR), comm=comm)
        state = step.init(params)
        step(state, torch.ones(3, 9))
        return launched

    for launched in ops.spawn(run, 2):
        inside = [t for t in launched if t != -1]
        assert len(inside) >= 3, launched  # the last unit's may come after the backward


def test_a_module_trained_at_stage_3_says_how_to_get_its_params_back():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))

    def run(comm):
        mine = copy.deepcopy(model)
        params, fn = it.functional(mine, loss=lambda m, b: m(b).sum())
        step = shard.zero3(fn, optimizer=ops.adamw(LR), comm=comm)
        state, _ = step(step.init(params), torch.ones(1, 4))
        with pytest.raises(RuntimeError, match=r"load_state\(module, state, comm=comm\)"):
            mine(torch.ones(1, 4))
        it.load_state(mine, state, comm=comm)
        return mine(torch.ones(1, 4)).shape

    assert ops.spawn(run, 2) == [(1, 2), (1, 2)]


def test_one_rank_at_stage_3_leaves_the_module_bound_to_its_state():
    """One rank's shards are its whole params: the module computes with them
    after the step, as at stages 0-2."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    loaded = copy.deepcopy(model)
    params, fn = it.functional(model, loss=lambda m, b: m(b).sum())
    comm = ops.spawn(lambda c: c, 1)[0]
    step = shard.zero3(fn, optimizer=ops.adamw(LR), comm=comm)
    state, _ = step(step.init(params), torch.ones(2, 4))
    whole = shard.gather(state, comm)
    for name, p in model.named_parameters():
        assert (p.detach().numpy() == whole[name]).all(), name
    x = torch.ones(1, 4)
    assert torch.equal(model(x), it.load_state(loaded, state, comm=comm)(x))


def test_state_dict_has_tied_names_and_rank_0s_buffers_for_a_strict_load():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Linear(5, 6, bias=False)
            self.norm = torch.nn.BatchNorm1d(6)
            self.head = torch.nn.Linear(6, 5, bias=False)
            self.back = torch.nn.Linear(5, 6, bias=False)
            self.back.weight = self.emb.weight  # tied across units

        def forward(self, x):
            return self.back(self.head(self.norm(self.emb(x))))

    model = built(Net)

    def run(comm):
        net = copy.deepcopy(model)
        params, fn = it.functional(net, loss=lambda m, b: m(b).pow(2).mean())
        step = shard.zero3(fn, optimizer=ops.adamw(LR), comm=comm)
        state = step.init(params)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(comm.rank))
        state, _ = step(state, x)  # each rank's BatchNorm sees its own batch
        local_mean = net.norm.running_mean.clone()
        return it.state_dict(net, state, comm=comm), local_mean, shard.gather(state, comm)

    results = ops.spawn(run, 2)
    (sd0, mean0, whole), (sd1, mean1, _) = results
    assert not torch.equal(mean0, mean1)  # the ranks' statistics differ ...
    for k in sd0:  # ... and both dicts hold rank 0's
        assert torch.equal(sd0[k], sd1[k]), k
    assert torch.equal(sd0["norm.running_mean"], mean0)
    assert "back.weight" in sd0 and torch.equal(sd0["back.weight"], sd0["emb.weight"])
    np.testing.assert_array_equal(sd0["head.weight"].numpy(), whole["head.weight"])
    fresh = Net()
    fresh.load_state_dict(sd0, strict=True)
