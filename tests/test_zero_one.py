"""0/1 Adam (ops/_zeroone.py, [Note: 0/1 Adam]): its schedule, the optimizer on
its own, and zero1/zero2 against a numpy model of the algorithm on 2-4 ranks
(variance updates, compressed gradients, local steps and synchronisations)."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest

import ops
import shard
from ops._zeroone import local_interval, synchronises, updates_variance
from tests.test_onebit import CLIP, _all_reduce_model, _clipped, _loss, _problem

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.99, 1e-8, 0.01
# variance updates at 1, 2 and 4, compressed gradients at 3 and 5; then local
# steps whose interval is 1 at 6-7, 2 at 8-9 and 4 from 10: synchronised at 6,
# 7, 8 and 12, local alone at 9, 10 and 11
SCHEDULE = {"var_freeze_step": 5, "var_update_scaler": 2, "local_step_scaler": 2,
            "local_step_clipper": 4}
STEPS = 12


def _opt(**kw):
    return ops.zero_one_adam(LR, **{**SCHEDULE, **kw}, b1=B1, b2=B2, eps=EPS, weight_decay=WD)


def test_the_schedule_is_deepspeeds():
    spec = ops.zero_one_adam(1.0, var_freeze_step=100, var_update_scaler=4).onebit
    assert [n for n in range(1, 101) if updates_variance(spec, n)] == [
        1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96]
    spec = _opt().onebit
    assert [n for n in range(1, 6) if updates_variance(spec, n)] == [1, 2, 4]
    assert [local_interval(spec, n) for n in range(6, 14)] == [1, 1, 2, 2, 4, 4, 4, 4]
    assert [n for n in range(6, STEPS + 1) if synchronises(spec, n)] == [6, 7, 8, 12]
    spec = ops.zero_one_adam(1.0, var_freeze_step=1, local_step_scaler=1,
                             local_step_clipper=5).onebit
    assert [local_interval(spec, n) for n in range(2, 8)] == [1, 2, 4, 5, 5, 5]
    for bad in ({"var_freeze_step": 0}, {"var_update_scaler": 1.5},
                {"local_step_clipper": True}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an int >= 1"):
            ops.zero_one_adam(1.0, **bad)


def test_on_its_own_it_is_adam_without_bias_correction_on_the_schedules_variance():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(5).astype(np.float32) for _ in range(8)]
    opt = _opt()
    params = {"w": np.ones(5, np.float32)}
    state = opt.init(params)
    p, m, v = np.ones(5), np.zeros(5), np.zeros(5)
    for n, g in enumerate(grads, start=1):
        params, state = opt.apply({"w": g}, state, params)
        m = B1 * m + (1 - B1) * g
        if n in (1, 2, 4):
            v = B2 * v + (1 - B2) * g.astype(np.float64) ** 2
        p = p - LR * (m / (np.sqrt(v) + EPS) + WD * p)
        np.testing.assert_allclose(params["w"], p, rtol=2e-6)
        np.testing.assert_allclose(state.nu["w"], v, rtol=2e-6)


def _model(world, params, batches, clip=None):
    """0/1 Adam on ``world`` ranks in numpy (float32), as [Note: 0/1 Adam] says:
    per step the params every rank's state holds (the last synchronisation's)
    and the mean of the ranks' losses. With ``clip``, the exact mean gradient
    is clipped, and each rank's own where it is compressed or taken locally."""
    spec = _opt().onebit
    f = np.float32
    p = params["w"].copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    k = p.size // world
    worker = [np.zeros(p.size, f) for _ in range(world)]
    server = [np.zeros(k, f) for _ in range(world)]

    def update(p, m, v):
        return (p * f(1 - LR * WD) - f(LR) * m / (np.sqrt(v) + f(EPS))).astype(f)

    def grads_and_losses(ps, b):
        out = []
        for r in range(world):
            part = shard.split_batch(b, rank=r, world_size=world)
            loss, g = jax.value_and_grad(_loss)({"w": ps[r]}, part)
            out.append((np.asarray(g["w"], f), float(loss)))
        return [g for g, _ in out], float(np.mean([x for _, x in out]))

    seen, local = [], None
    for n, b in enumerate(batches, start=1):
        if n <= spec.var_freeze_step:
            grads, loss = grads_and_losses([p] * world, b)
            if updates_variance(spec, n):
                g = _clipped(sum(grads[1:], grads[0].copy()) * f(1 / world), clip)
                v = (v * f(B2) + g * g * f(1 - B2)).astype(f)
            else:
                g = _all_reduce_model([_clipped(g, clip) for g in grads], worker, server)
            m = (m * f(B1) + g * f(1 - B1)).astype(f)
            p = update(p, m, v)
        else:
            if local is None:  # the freeze: every rank from the state, errors from zero
                local = {"p": [p.copy() for _ in range(world)],
                         "m": [m.copy() for _ in range(world)], "rates": 0.0}
                worker = [np.zeros(p.size, f) for _ in range(world)]
                server = [np.zeros(k, f) for _ in range(world)]
            grads, loss = grads_and_losses(local["p"], b)
            for r in range(world):
                g = _clipped(grads[r], clip)
                local["m"][r] = (local["m"][r] * f(B1) + g * f(1 - B1)).astype(f)
                local["p"][r] = update(local["p"][r], local["m"][r], v)
            local["rates"] += LR
            if synchronises(spec, n):
                root = np.sqrt(v) + f(EPS)
                d = _all_reduce_model([(q - p) * root for q in local["p"]], worker, server)
                m = (d * f(-1.0 / local["rates"])).astype(f)
                p = (d / root + p).astype(f)
                local = {"p": [p.copy() for _ in range(world)],
                         "m": [m.copy() for _ in range(world)], "rates": 0.0}
        seen.append((p.copy(), loss))
    return seen


@pytest.mark.parametrize(("stage", "world", "clip"),
                         [(1, 2, None), (2, 3, None), (2, 4, None), (2, 3, CLIP)])
def test_zero1_and_zero2_follow_a_numpy_model_of_zero_one_adam(stage, world, clip):
    params, batches = _problem(world)
    batches = (batches * 2)[:STEPS]
    zero = shard.zero1 if stage == 1 else shard.zero2

    def run(comm):
        step = zero(_loss, optimizer=_opt(), comm=comm, clip_norm=clip)
        state, seen = step.init(params), []
        for b in batches:
            state, metrics = step(state, shard.split_batch(b, rank=comm.rank,
                                                           world_size=comm.world_size))
            seen.append((np.asarray(shard.gather(state, comm)["w"]), metrics["loss"]))
        return seen

    got = ops.spawn(run, world)
    want = _model(world, params, batches, clip)
    for r in range(world):
        for t in range(STEPS):
            np.testing.assert_allclose(got[r][t][0], want[t][0], rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {r}, update {t + 1}")
            assert got[r][t][1] == pytest.approx(want[t][1], rel=1e-5), (r, t)
    # the local steps moved each rank's own params: their losses differ from the synchronised
    assert abs(want[9][1] - want[8][1]) > 1e-4
    assert np.abs(want[-1][0] - want[7][0]).mean() > 1e-4  # and the synchronisation kept it
    if clip is not None:  # and the clip bit
        assert np.abs(_model(world, params, batches)[-1][0] - want[-1][0]).max() > 1e-3


def test_what_crosses_the_wire_by_phase(monkeypatch):
    """0/1 Adam: exact reductions on the variance's updates alone, the
    gradients compressed on the others; after the freeze no gradient and no
    params: one compressed all-reduce per synchronisation and nothing between.
    1-bit Adam: after its warm-up one compressed all-reduce a step."""
    world = 2
    params, batches = _problem(world, k=100)
    batches = (batches * 2)[:STEPS]
    now, calls = {}, []

    def counted(name, real):
        def call(self, *args, **kw):
            if self.rank == 0:
                calls.append((now.get(0, 0), name))
            return real(self, *args, **kw)
        return call

    for name in ("all_to_all_into", "all_gather_into", "reduce_scatter_async"):
        monkeypatch.setattr(ops.ThreadCommunicator, name,
                            counted(name, getattr(ops.ThreadCommunicator, name)))

    def run(comm, optimizer=None):
        step = shard.zero2(_loss, optimizer=optimizer or _opt(), comm=comm)
        state = step.init(params)
        for n, b in enumerate(batches, start=1):
            now[comm.rank] = n
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=world))
        return int(state.step)

    assert ops.spawn(run, world) == [STEPS] * world

    def at(name):
        return {n: c for n in range(1, STEPS + 1)
                if (c := calls.count((n, name)))}

    assert at("reduce_scatter_async") == {1: 1, 2: 1, 4: 1}
    # bits and scales: the gradients at 3 and 5, the synchronisations at 6, 7, 8, 12
    assert at("all_to_all_into") == {n: 2 for n in (3, 5, 6, 7, 8, 12)}
    # the params after each update of the first phase (and the compressions' bits
    # and scales); at the freeze the whole params and moments once; then the
    # synchronisations' bits and scales alone
    assert at("all_gather_into") == {1: 1, 2: 1, 3: 3, 4: 1, 5: 3, 6: 5, 7: 2, 8: 2, 12: 2}

    calls.clear()  # 1-bit Adam, freeze_step=2: no params gathered after its warm-up either
    now.clear()
    assert ops.spawn(lambda comm: run(comm, ops.onebit_adam(LR, freeze_step=2)),
                     world) == [STEPS] * world
    assert at("reduce_scatter_async") == {1: 1, 2: 1}
    assert at("all_to_all_into") == {n: 2 for n in range(3, STEPS + 1)}
    # the params after each warm-up update; at the freeze the whole momentum, params
    # and variance once, with the bits and scales; then the bits and scales alone
    assert at("all_gather_into") == {1: 1, 2: 1, 3: 5} | {n: 2 for n in range(4, STEPS + 1)}


def test_a_resume_between_synchronisations_starts_from_the_last_one(tmp_path):
    """A checkpoint written after a local step holds the last synchronisation's
    params and momentum (the state's), as shard.gather does; a run resumed
    from it is the uninterrupted run whose local steps start again from that
    synchronisation there (errors from zero), bit for bit."""
    world = 2
    params, batches = _problem(world, k=100)
    batches = (batches * 2)[:STEPS]

    def run(comm, resume=False, drop=False):
        step = shard.zero2(_loss, optimizer=_opt(), comm=comm)
        state = step.init(params)
        if resume:
            state, _ = shard.load(tmp_path / "ckpt", step, comm=comm)
        seen = {}
        for n in range(int(state.step) + 1, STEPS + 1):
            state, _ = step(state, shard.split_batch(batches[n - 1], rank=comm.rank,
                                                     world_size=world))
            seen[n] = np.asarray(shard.gather(state, comm)["w"])
            if n == 9 and not resume:
                shard.save(state, tmp_path / "ckpt", comm=comm)
            if n == 9 and drop:
                step._zero_one_local.key = None  # as a resume: from the state
        return seen

    whole = ops.spawn(run, world)[0]
    np.testing.assert_array_equal(whole[9], whole[8])  # a local step: the state's params stay
    resumed = ops.spawn(lambda c: run(c, resume=True), world)[0]
    dropped = ops.spawn(lambda c: run(c, drop=True), world)[0]
    assert sorted(resumed) == [10, 11, 12]
    for n in (10, 11, 12):
        np.testing.assert_array_equal(resumed[n], dropped[n])
    np.testing.assert_array_equal(resumed[10], whole[8])
    assert np.abs(resumed[12] - whole[12]).max() > 0  # update 9's local step is not redone


def test_a_skipped_local_step_changes_nothing():
    world = 2
    params, batches = _problem(world, k=100)
    batches = (batches * 2)[:STEPS]
    bad = dict(batches[8])
    bad["x"] = bad["x"].copy()
    bad["x"][-1, 0] = np.inf  # on rank 1's part only

    def run(comm, poisoned):
        step = shard.zero2(_loss, optimizer=_opt(), comm=comm)
        state, seen = step.init(params), []
        for t, b in enumerate(batches):
            if t == 8 and poisoned:
                state, metrics = step(state, shard.split_batch(bad, rank=comm.rank,
                                                               world_size=world))
                assert metrics["skipped"]
            state, metrics = step(state, shard.split_batch(b, rank=comm.rank, world_size=world))
            seen.append(metrics["loss"])
        return seen, np.asarray(shard.gather(state, comm)["w"])

    clean = ops.spawn(lambda c: run(c, False), world)
    poisoned = ops.spawn(lambda c: run(c, True), world)
    assert poisoned[0][0] == clean[0][0]
    np.testing.assert_array_equal(poisoned[0][1], clean[0][1])


def test_what_zero_one_adam_does_not_run_with_is_refused_by_name():
    def run(comm):
        errors = []
        for zero, kw in ((shard.zero3, {}), (shard.zero0, {}),
                         (shard.zero2, {"offload": shard.Offload()}),
                         (shard.zero1, {"invariant_shards": 2})):
            with pytest.raises(NotImplementedError) as e:
                zero(_loss, optimizer=_opt(), comm=comm, options=shard.ZeroOptions(**kw))
            errors.append(str(e.value))
        return errors

    for word, e in zip(("zero1 and zero2", "zero1 and zero2", "offload", "invariant_shards"),
                       ops.spawn(run, 2)[0], strict=True):
        assert "ops.zero_one_adam" in e and word in e, e


def test_deepspeeds_zerooneadam_config_maps_onto_zero_one_adam():
    """The tutorial's config (deepspeed.ai/tutorials/zero-one-adam), under ZeRO-2."""
    cfg = shard.from_deepspeed_config({
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "ZeroOneAdam", "params": {
            "lr": 1e-3, "weight_decay": 0.01, "bias_correction": False,
            "var_freeze_step": 1000, "var_update_scaler": 16, "local_step_scaler": 1000,
            "local_step_clipper": 16, "cuda_aware": False, "comm_backend_name": "nccl"}},
        "zero_optimization": {"stage": 2}})
    spec = cfg.optimizer.onebit
    assert (spec.var_freeze_step, spec.var_update_scaler, spec.local_step_scaler,
            spec.local_step_clipper, spec.weight_decay) == (1000, 16, 1000, 16, 0.01)
    with pytest.raises(ValueError, match=r"optimizer\.params\.amsgrad"):
        shard.from_deepspeed_config({"optimizer": {"type": "ZeroOneAdam",
                                                   "params": {"amsgrad": True}}})


@pytest.mark.parametrize("make", [_opt, lambda: ops.onebit_adam(LR, freeze_step=2)],
                         ids=["zero_one_adam", "onebit_adam"])
def test_device_state_takes_the_same_steps_as_the_host_s(device, make):
    """On the device stand-in (CuPy's rules: no implicit copy to the host) every
    phase runs the emulated CUDA kernels, each rank's clip too: the losses are
    the host's."""
    world = 2
    params, batches = _problem(world, k=100)
    batches = (batches * 2)[:STEPS]

    def run(comm, on_device):
        p = jax.tree.map(device.from_host, params) if on_device else params
        step = shard.zero2(_loss, optimizer=make(), comm=comm, clip_norm=CLIP)
        state, losses = step.init(p), []
        for b in batches:
            state, metrics = step(state, shard.split_batch(b, rank=comm.rank,
                                                           world_size=world))
            losses.append(metrics["loss"])
        return losses

    host = ops.spawn(lambda c: run(c, False), world)
    there = ops.spawn(lambda c: run(c, True), world)
    np.testing.assert_allclose(there, host, rtol=1e-6)


DS_CONFIGS = json.loads((Path(__file__).parent / "data" / "deepspeed_unit_configs.json")
                        .read_text())


@pytest.mark.parametrize("name", ["onebitadam_fp16_clip", "zerooneadam_fp16_clip"])
def test_deepspeeds_own_onebit_tests_train_as_they_are(name, caplog):
    """DeepSpeed's 1-bit and 0/1 Adam tests, config as written (no ZeRO, fp16
    with a dynamic loss scale from 2^16, gradients clipped at 1) and model as
    theirs (SimpleModel: a Linear of 10, cross-entropy; 2 ranks, a row each):
    under zero1, every phase runs, the ranks agree and the loss goes down."""
    import torch

    from interop import torch as it

    config = DS_CONFIGS[name]["config"]
    with caplog.at_level(logging.INFO, logger="shard._deepspeed"):
        cfg = shard.from_deepspeed_config(config)
    assert cfg.stage == 1 and "runs under zero1 here" in caplog.text
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 10)).astype(np.float16)  # 4 batches of 2, seen 6 times
    y = rng.integers(0, 10, 8)

    def loss(module, b):
        return torch.nn.functional.cross_entropy(module(b["x"]).float(), b["y"])

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=loss)
        step = cfg.transform(fn, comm=comm)
        state, seen = step.init(params), []
        for t in range(24):
            lo = 2 * (t % 4) + comm.rank
            state, metrics = step(state, {"x": torch.from_numpy(x[lo:lo + 1]),
                                          "y": torch.from_numpy(y[lo:lo + 1])})
            seen.append((metrics["loss"], metrics["skipped"], float(state.loss_scale)))
        return seen, int(state.step), shard.gather(state, comm)

    out = ops.spawn(run, 2)
    (seen, updates, params), other = out[0], out[1][2]
    assert all(np.array_equal(np.asarray(params[k]), np.asarray(other[k])) for k in params)
    assert updates >= 12  # far past freeze_step 2 / var_freeze_step 4
    assert seen[0][2] == 2.0 ** 16 and all(np.isfinite(lo) for lo, _, _ in seen)
    first, last = np.mean([lo for lo, _, _ in seen[:4]]), np.mean([lo for lo, _, _ in seen[-4:]])
    assert last < first, seen


@pytest.mark.parametrize("make", [_opt, lambda: ops.onebit_adam(LR, freeze_step=2)],
                         ids=["zero_one_adam", "onebit_adam"])
def test_a_loss_scale_changes_nothing_but_the_backwards_scale(make):
    """A static loss scale of 2^10 on float32: every phase divides it out, the
    same updates as unscaled."""
    world = 2
    params, batches = _problem(world, k=100)
    batches = (batches * 2)[:STEPS]

    def run(comm, scale):
        step = shard.zero2(_loss, optimizer=make(), comm=comm, options=shard.ZeroOptions(
            loss_scale=shard.LossScale.static(scale) if scale else None))
        state = step.init(params)
        for b in batches:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=world))
        return np.asarray(shard.gather(state, comm)["w"])

    plain = ops.spawn(lambda c: run(c, None), world)[0]
    scaled = ops.spawn(lambda c: run(c, 1024.0), world)[0]
    np.testing.assert_allclose(scaled, plain, rtol=1e-6, atol=1e-7)
