"""1-bit Adam (ops/_onebit.py, [Note: 1-bit Adam]): the sign kernels (the CPU
build against the emulated CUDA kernels), the compressed all-reduce against a
numpy model of DeepSpeed's algorithm, bit for bit, and the optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import shard
from ops._onebit import compressed_all_reduce, sign_add, sign_compress
from shard.step.reduction._reduce import GradReducer

GROUP = 256
SIZES = [1, 7, 8, 255, 256, 257, 70_001]


def _tree_sum(squares):
    """The kernel's fixed tree over one group's squares (zero past its end)."""
    a = np.zeros(GROUP, np.float32)
    a[:squares.size] = squares
    a = a.reshape(8, 32)
    for off in (16, 8, 4, 2, 1):
        a[:, :off] += a[:, off:2 * off]
    b = np.zeros(32, np.float32)
    b[:8] = a[:, 0]
    for off in (16, 8, 4, 2, 1):
        b[:off] += b[off:2 * off]
    return b[0]


def _compress(x, error):
    """numpy's model of sign_compress then sign_add: the values read back, and
    the new error."""
    y = (x + error).astype(np.float32)
    back = np.empty_like(y)
    for lo in range(0, y.size, GROUP):
        g = y[lo:lo + GROUP]
        scale = np.sqrt(_tree_sum(g * g) / np.float32(g.size), dtype=np.float32)
        back[lo:lo + GROUP] = np.where(g < 0, -scale, scale)
    return back, (y - back).astype(np.float32)


def _all_reduce_model(xs, worker, server):
    """DeepSpeed's compressed all-reduce (block scales), every rank at once;
    updates the errors in place."""
    w = len(xs)
    k = xs[0].size // w
    sent = []
    for r in range(w):  # each rank's sections compressed one by one (groups from their starts)
        parts = [_compress(xs[r][s * k:(s + 1) * k], worker[r][s * k:(s + 1) * k])
                 for s in range(w)]
        sent.append(np.concatenate([b for b, _ in parts]))
        worker[r] = np.concatenate([e for _, e in parts])
    sections = []
    for me in range(w):
        mean = np.zeros(k, np.float32)
        for r in range(w):
            mean += sent[r][me * k:(me + 1) * k] * np.float32(1.0 / w)  # +-scale * (1 / w)
        back, server[me] = _compress(mean, server[me])
        sections.append(back)
    return np.concatenate(sections)


@pytest.mark.parametrize("n", SIZES)
def test_the_cpu_build_and_the_emulated_cuda_kernels_give_the_same_bits(n, device_xp):
    xp = device_xp
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-8, 8, n)).astype(np.float32)
    e = (rng.standard_normal(n) * 0.1).astype(np.float32)
    e_host, e_dev = e.copy(), xp.asarray(e)
    bits, scales = sign_compress(x, e_host)
    bits_dev, scales_dev = sign_compress(xp.asarray(x), e_dev)
    np.testing.assert_array_equal(bits_dev.get(), bits)
    np.testing.assert_array_equal(scales_dev.get(), scales)
    np.testing.assert_array_equal(e_dev.get(), e_host)
    y, y_dev = np.ones(n, np.float32), xp.asarray(np.ones(n, np.float32))
    sign_add(bits, scales, y, 0.25)
    sign_add(bits_dev, scales_dev, y_dev, 0.25)
    np.testing.assert_array_equal(y_dev.get(), y)
    back, err = _compress(x, e)  # and both are the numpy model's
    np.testing.assert_array_equal(e_host, err)
    np.testing.assert_array_equal(sign_add(bits, scales, np.zeros(n, np.float32)), back)
    assert bits.size == -(-n // 8) and scales.size == -(-n // GROUP)


def test_the_bits_are_one_for_values_at_or_above_zero_eight_a_byte():
    x = np.array([3.0, -4.0, 0.0, -0.0, 1e-30, -1e-30, 2.0, 2.0, -1.0], np.float32)
    bits, scales = sign_compress(x, np.zeros(9, np.float32))
    assert bits.tolist() == [0b11011101, 0]
    np.testing.assert_allclose(scales, np.sqrt(np.mean(x.astype(np.float64) ** 2)), rtol=1e-6)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_compressed_all_reduce_is_the_numpy_model_bit_for_bit(world):
    k, rounds = 300, 3  # sections of one group and a part; the errors carry over
    rng = np.random.default_rng(world)
    inputs = [[rng.standard_normal(world * k).astype(np.float32) for _ in range(world)]
              for _ in range(rounds)]

    def rank(comm):
        worker = np.zeros(world * k, np.float32)
        server = np.zeros(k, np.float32)
        outs = []
        for xs in inputs:
            x = xs[comm.rank].copy()
            outs.append(compressed_all_reduce(comm, x, worker, server).copy())
        return outs

    got = ops.spawn(rank, world)
    worker = [np.zeros(world * k, np.float32) for _ in range(world)]
    server = [np.zeros(k, np.float32) for _ in range(world)]
    for t, xs in enumerate(inputs):
        want = _all_reduce_model([x.copy() for x in xs], worker, server)
        for r in range(world):
            np.testing.assert_array_equal(got[r][t], want)  # every rank the same


def test_on_the_device_the_same_bits_as_on_the_host(device):
    world, k = 3, 260
    xs = [np.random.default_rng(r).standard_normal(world * k).astype(np.float32)
          for r in range(world)]

    def rank(comm, device):
        put = (lambda a: a) if device is None else device.from_host
        x, worker, server = put(xs[comm.rank].copy()), put(np.zeros(world * k, np.float32)), \
            put(np.zeros(k, np.float32))
        for _ in range(2):
            compressed_all_reduce(comm, x, worker, server)
        return x if device is None else device.to_host(x)



    host = ops.spawn(lambda c: rank(c, None), world)
    on_device = ops.spawn(lambda c: rank(c, device), world)
    for h, d in zip(host, on_device, strict=True):
        np.testing.assert_array_equal(h, d)


def test_error_feedback_makes_the_average_of_many_rounds_the_mean():
    """The same inputs every round: what the compression loses in one round is
    sent in the next, so the rounds' average approaches the exact mean (where
    one round alone is far from it)."""
    world, k, rounds = 4, 256, 200
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(world * k).astype(np.float32) for _ in range(world)]
    exact = np.mean(xs, axis=0)

    def rank(comm):
        worker, server = np.zeros(world * k, np.float32), np.zeros(k, np.float32)
        total = np.zeros(world * k)
        first = None
        for _ in range(rounds):
            out = compressed_all_reduce(comm, xs[comm.rank].copy(), worker, server)
            first = out.copy() if first is None else first
            total += out
        return first, total / rounds

    first, average = ops.spawn(rank, world)[0]
    assert np.abs(first - exact).mean() > 0.3
    assert np.abs(average - exact).mean() < 0.02


def test_what_crosses_the_wire_is_a_bit_an_element_and_a_scale_per_group():
    world, k, sent = 4, 1024, []

    class Counting:
        def __init__(self, comm):
            self._comm, self.world_size, self.rank = comm, comm.world_size, comm.rank

        def all_to_all_into(self, out, x):
            sent.append((self.rank, x.nbytes * (self.world_size - 1) // self.world_size))
            return self._comm.all_to_all_into(out, x)

        def all_gather_into(self, out, x):
            sent.append((self.rank, x.nbytes * (self.world_size - 1)))
            return self._comm.all_gather_into(out, x)

    ops.spawn(lambda comm: compressed_all_reduce(
        Counting(comm), np.ones(world * k, np.float32), np.zeros(world * k, np.float32),
        np.zeros(k, np.float32)), world)
    mine = sum(n for r, n in sent if r == 0)
    assert mine == 2 * (world - 1) * (k // 8 + 4 * k // GROUP)
    exact = 2 * (world - 1) * k * 4  # a ring all-reduce of float32
    assert mine / exact < 1 / 28


def test_the_optimizer_is_adam_without_bias_correction_then_holds_the_variance():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(5).astype(np.float32) for _ in range(5)]
    opt = ops.onebit_adam(0.1, freeze_step=3, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.01)
    params = {"w": np.ones(5, np.float32)}
    state = opt.init(params)
    p, m, v = np.ones(5), np.zeros(5), np.zeros(5)
    for t, g in enumerate(grads):
        params, state = opt.apply({"w": g}, state, params)
        m = 0.9 * m + 0.1 * g
        if t < 3:  # DeepSpeed's OnebitAdam: no bias correction; v held after freeze_step
            v = 0.99 * v + 0.01 * g.astype(np.float64) ** 2
        p = p - 0.1 * (m / (np.sqrt(v) + 1e-8) + 0.01 * p)
        np.testing.assert_allclose(params["w"], p, rtol=2e-6)
        np.testing.assert_allclose(state.nu["w"], v, rtol=2e-6)
    with pytest.raises(ValueError, match="freeze_step must be an int >= 1"):
        ops.onebit_adam(0.1, freeze_step=0)
    fresh = opt.init({"w": np.ones(5, np.float32)})
    with pytest.raises(ValueError, match="momentum=True is for the updates after freeze_step"):
        opt.apply({"w": grads[0]}, fresh, {"w": np.ones(5, np.float32)}, momentum=True)


# -- inside ZeRO 1-2: the step against a numpy model of DeepSpeed's OnebitAdam ---------------

LR, B1, B2, EPS, WD, FREEZE, STEPS = 1e-2, 0.9, 0.99, 1e-8, 0.01, 2, 6
CLIP = 0.02  # below the mean gradient's norm (about 0.025) and each rank's (about 0.04)


def _loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] * p["w"]) - b["y"]) ** 2)


def _problem(world, k=300):
    rng = np.random.default_rng(world)
    params = {"w": (rng.standard_normal(world * k) * 0.5).astype(np.float32)}
    batches = [{"x": rng.standard_normal((2 * world, world * k)).astype(np.float32),
                "y": rng.standard_normal((2 * world, world * k)).astype(np.float32)}
               for _ in range(STEPS)]
    return params, batches


def _clipped(g, clip):
    """``g`` scaled as ``clip_grad_norm_(max_norm=clip)`` would (None: as it is)."""
    if clip is None:
        return g
    coef = min(1.0, clip / (float(np.sqrt(np.sum(g.astype(np.float64) ** 2))) + 1e-6))
    return (g * np.float32(coef)).astype(np.float32)


def _model(world, params, batches, clip=None):
    """DeepSpeed's OnebitAdam on ``world`` ranks in numpy (float32): Adam without
    bias correction on the mean gradient for FREEZE steps, then each rank's
    momentum through the compressed all-reduce and the variance held. With
    ``clip``, the mean gradient is clipped in the warm-up, each rank's own
    after it (as DeepSpeed's engine does)."""
    p = params["w"].copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    k = p.size // world
    worker = [np.zeros(p.size, np.float32) for _ in range(world)]
    server = [np.zeros(k, np.float32) for _ in range(world)]
    out = []
    for t, b in enumerate(batches):
        grads = [np.asarray(jax.grad(_loss)({"w": p}, shard.split_batch(
            b, rank=r, world_size=world))["w"], np.float32) for r in range(world)]
        if t < FREEZE:
            g = _clipped(sum(grads[1:], grads[0].copy()) * np.float32(1 / world), clip)
            m = (m * np.float32(B1) + g * np.float32(1 - B1)).astype(np.float32)
            v = (v * np.float32(B2) + g * g * np.float32(1 - B2)).astype(np.float32)
        else:
            local = [m * np.float32(B1) + _clipped(g, clip) * np.float32(1 - B1) for g in grads]
            m = _all_reduce_model(local, worker, server)
        p = (p * np.float32(1 - LR * WD) - np.float32(LR) * m / (np.sqrt(v) + np.float32(EPS))
             ).astype(np.float32)
        out.append(p.copy())
    return out


@pytest.mark.parametrize(("stage", "world", "clip"),
                         [(1, 2, None), (2, 3, None), (2, 4, None), (2, 3, CLIP)])
def test_zero1_and_zero2_follow_a_numpy_model_of_deepspeeds_onebit_adam(stage, world, clip):
    params, batches = _problem(world)
    zero = shard.zero1 if stage == 1 else shard.zero2

    def run(comm):
        step = zero(_loss, optimizer=ops.onebit_adam(LR, freeze_step=FREEZE, b1=B1, b2=B2,
                                                      eps=EPS, weight_decay=WD), comm=comm,
                    clip_norm=clip)
        state, seen = step.init(params), []
        for b in batches:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank,
                                                     world_size=comm.world_size))
            seen.append(np.asarray(shard.gather(state, comm)["w"]))
        return seen

    got = ops.spawn(run, world)
    want = _model(world, params, batches, clip)
    for r in range(world):
        for t in range(STEPS):
            np.testing.assert_allclose(got[r][t], want[t], rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {r}, step {t + 1}")
    moved = np.abs(want[-1] - want[FREEZE - 1]).mean()
    assert moved > 1e-3  # the compressed steps moved the params
    if clip is not None:  # and the clip bit, in both phases
        assert np.abs(_model(world, params, batches)[-1] - want[-1]).max() > 1e-3


def test_after_freeze_step_no_gradient_is_reduced_and_a_resume_goes_on(tmp_path):
    """The compressed steps send no gradients (no reduce-scatter at all), every
    rank holds the same params, and a checkpoint written in the compressed
    phase resumes there: the momentum is the optimizer's exp_avg, the errors
    start again from zero (as DeepSpeed's do), so the resumed run is the
    uninterrupted one with its errors zeroed at that step, bit for bit."""
    world = 3
    params, batches = _problem(world, k=100)
    calls = []
    real = GradReducer._reduce_scatter

    def counting(self, out, x):
        calls.append(type(self).__name__)
        return real(self, out, x)

    def run(comm, steps, resume=False):
        step = shard.zero2(_loss, optimizer=ops.onebit_adam(LR, freeze_step=FREEZE), comm=comm)
        state = step.init(params)
        if resume:
            state, _ = shard.load(tmp_path / "ckpt", step, comm=comm)
        losses = []
        for b in batches[int(state.step):steps]:
            state, metrics = step(state, shard.split_batch(b, rank=comm.rank,
                                                           world_size=comm.world_size))
            losses.append(metrics["loss"])
            if int(state.step) == FREEZE + 1 and not resume:
                shard.save(state, tmp_path / "ckpt", comm=comm)
                step._onebit_momentum.key = None  # as a resume: from exp_avg, zero errors
        return losses, np.asarray(shard.gather(state, comm)["w"])

    GradReducer._reduce_scatter = counting
    try:
        whole = ops.spawn(lambda c: run(c, STEPS), world)
    finally:
        GradReducer._reduce_scatter = real
    assert len(calls) == world * FREEZE  # one unit, one reduce-scatter a warm-up step
    assert all(np.array_equal(w[1], whole[0][1]) for w in whole)
    resumed = ops.spawn(lambda c: run(c, STEPS, resume=True), world)
    after = whole[0][0][FREEZE + 1:]
    assert len(resumed[0][0]) == len(after) == STEPS - FREEZE - 1
    assert resumed[0][0] == after
    np.testing.assert_array_equal(resumed[0][1], whole[0][1])


def test_one_rank_runs_the_optimizer_alone():
    params, batches = _problem(1)

    def run(comm):
        step = shard.zero1(_loss, optimizer=ops.onebit_adam(LR, freeze_step=FREEZE), comm=comm)
        state = step.init(params)
        for b in batches:
            state, _ = step(state, b)
        return np.asarray(shard.gather(state, comm)["w"])

    got = ops.spawn(run, 1)[0]
    opt = ops.onebit_adam(LR, freeze_step=FREEZE)
    p, s = {"w": params["w"].copy()}, opt.init(params)
    for b in batches:
        p, s = opt.apply({"w": np.asarray(jax.grad(_loss)(p, b)["w"])}, s, p)
    np.testing.assert_allclose(got, p["w"], rtol=1e-5, atol=1e-6)


def test_what_onebit_adam_does_not_run_with_is_refused_by_name():
    opt = ops.onebit_adam(LR, freeze_step=FREEZE)

    def run(comm):
        errors = []
        for zero, kw in ((shard.zero3, {}), (shard.zero0, {}),
                         (shard.zero1, {"quantized_gradients": True}),
                         (shard.zero2, {"trainable": {"w": False}}),
                         (shard.zero2, {"weight_by_rows": True})):
            try:
                zero(_loss, optimizer=opt, comm=comm, options=shard.ZeroOptions(**kw))
            except NotImplementedError as e:
                errors.append(str(e))
        return errors

    errors = ops.spawn(run, 2)[0]
    assert len(errors) == 5 and all("onebit_adam" in e for e in errors)
    for word, e in zip(("zero1 and zero2", "zero1 and zero2", "quantized_gradients",
                        "trainable", "weight_by_rows"), errors, strict=True):
        assert word in e, e


def test_deepspeeds_onebitadam_config_maps_onto_onebit_adam():
    cfg = shard.from_deepspeed_config({
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "OneBitAdam", "params": {
            "lr": 4e-4, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01,
            "freeze_step": 23000, "cuda_aware": False, "comm_backend_name": "nccl"}},
        "zero_optimization": {"stage": 2}})
    assert cfg.optimizer.onebit == (23000, 0.9)
    assert cfg.optimizer.learning_rate(0) == 4e-4
    with pytest.raises(ValueError, match=r"OneBitLamb.*OneBitAdam and ZeroOneAdam are"):
        shard.from_deepspeed_config({"optimizer": {"type": "OneBitLamb", "params": {}}})


def test_a_skipped_update_remakes_the_momentum_from_the_state():
    """A step whose gradients are not finite updates nothing; the agreed
    momentum it computed is dropped, and the next step starts again from the
    state's exp_avg with zero errors: the run is the clean one with its errors
    zeroed at that step, bit for bit."""
    world = 2
    params, batches = _problem(world, k=100)
    bad = dict(batches[FREEZE + 1])
    bad["x"] = bad["x"].copy()
    bad["x"][0, 0] = np.inf

    def run(comm, poisoned):
        step = shard.zero2(_loss, optimizer=ops.onebit_adam(LR, freeze_step=FREEZE), comm=comm)
        state = step.init(params)
        seen = []
        for t, b in enumerate(batches):
            if t == FREEZE + 1 and poisoned:
                state, metrics = step(state, shard.split_batch(bad, rank=comm.rank,
                                                               world_size=world))
                assert metrics["skipped"]
            elif t == FREEZE + 1:
                step._onebit_momentum.key = None  # the errors from zero here too
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=world))
            seen.append(int(state.step))
        return seen, np.asarray(shard.gather(state, comm)["w"])

    clean = ops.spawn(lambda c: run(c, False), world)
    poisoned = ops.spawn(lambda c: run(c, True), world)
    assert poisoned[0][0] == clean[0][0]  # the skipped step counted nothing
    np.testing.assert_array_equal(poisoned[0][1], clean[0][1])
