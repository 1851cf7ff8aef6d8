"""Fused LAMB (``ops/kernels/lamb.cu``): the CPU build against ``optax.lamb`` and
a float64 reference, bit for bit against the emulated CUDA kernels it shares
its source with (the per-tensor sums included), on the strict device stand-in,
with tensors split over ranks, and under ZeRO 0-3 against single-process optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ops
import shard
from ops.device._arrays import BF16
from ops.kernels._cpu import cpu_driver
from ops.kernels._table import LAMB_CHUNK, lamb_kernels
from ops.testing import STANDIN, to_device
from tests.harness import assert_rank_slices, run_steps

DT = {"f32": np.float32, "bf16": BF16, "f16": np.float16}
LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-6, 0.1
# an empty tensor, tiny ones, one of several chunks that the emulated grid
# (8 blocks) walks twice, and none a multiple of a block or a chunk
SIZES = [0, 1, 300, 7, 2 * LAMB_CHUNK + 5, 257, 9 * LAMB_CHUNK + 3]


def lamb_float64(p, g, m, v, *, step, lr=LR, b1=B1, b2=B2, eps=EPS, wd=WD, mul=1.0,
                 clip=None, bias_correction=True):
    """One tensor's LAMB update in float64, written from the paper / optax."""
    p, g, m, v = (np.asarray(x, np.float64) for x in (p, g, m, v))
    g = g * mul
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1.0, 1.0)
    u = (m / bc1) / (np.sqrt(v / bc2) + eps) + wd * p
    pn, un = np.linalg.norm(p), np.linalg.norm(u)
    r = 1.0 if pn == 0 or un == 0 else pn / un
    if clip is not None:
        r = min(max(r, clip[0]), clip[1])
    return p - lr * r * u, m, v


def test_ten_steps_equal_optax_lamb(rng):
    shapes = [(300,), (70, 13), (1,), (3, 5000)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params.append(np.zeros(9, np.float32))  # a zero param: ratio 1
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in params]
             for _ in range(10)]
    tx = optax.lamb(LR, b1=B1, b2=B2, eps=EPS, eps_root=1e-8, weight_decay=WD)
    want = [jnp.asarray(p) for p in params]
    state = tx.init(want)
    opt = ops.lamb(LR, b1=B1, b2=B2, eps=EPS, eps_root=1e-8, weight_decay=WD)
    ours = [p.copy() for p in params]
    ours_state = opt.init(ours)
    for g in grads:
        updates, state = jax.jit(tx.update)([jnp.asarray(x) for x in g], state, want)
        want = optax.apply_updates(want, updates)
        ours, ours_state = opt.apply(g, ours_state, ours)
    for a, b in zip(ours, want, strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=2e-6)
    for a, b in zip(ours_state.nu, state[0].nu, strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-9)
    assert int(ours_state.count) == 10


@pytest.mark.parametrize("gcode", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("ccode", ["none", "bf16", "f16"])
def test_unscale_clip_and_copies_match_the_float64_reference(rng, gcode, ccode):
    n = 5003
    p = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * 8).astype(DT[gcode])
    m = (rng.standard_normal(n) * 0.1).astype(np.float32)
    v = np.abs(rng.standard_normal(n) * 0.01).astype(np.float32)
    c = None if ccode == "none" else np.zeros(n, DT[ccode])
    sumsq = np.array([np.sum(g.astype(np.float64) ** 2)])
    scale, max_norm = 0.5, 1.0
    norm = np.sqrt(sumsq[0]) * scale
    want = lamb_float64(p, g, m, v, step=3, mul=scale * min(1.0, max_norm / (norm + 1e-6)))
    ops.fused_lamb([p], [g], [m], [v], step=3, lr=LR, betas=(B1, B2), eps=EPS,
                   weight_decay=WD, grad_scale=scale, grad_sumsq=sumsq, max_norm=max_norm,
                   param_copies=None if c is None else [c])
    for got, w in zip((p, m, v), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-7)
    if c is not None:
        np.testing.assert_array_equal(c, p.astype(DT[ccode]))


def test_trust_clip_and_no_bias_correction_match_the_reference(rng):
    p = (rng.standard_normal(1000) * 50).astype(np.float32)  # |p| / |u| far above 10
    g, m, v = (rng.standard_normal(1000).astype(np.float32) for _ in range(3))
    v = np.abs(v)
    want = lamb_float64(p, g, m, v, step=2, clip=(0.01, 10.0), bias_correction=False)
    ops.fused_lamb([p], [g], [m], [v], step=2, lr=LR, eps=EPS, weight_decay=WD,
                   trust_clip=(0.01, 10.0), bias_correction=False)
    np.testing.assert_allclose(p, want[0], rtol=1e-5)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_sumsq_skips_the_update(rng, bad):
    p, g, m, v = (rng.standard_normal(64).astype(np.float32) for _ in range(4))
    before = (p.copy(), m.copy(), v.copy())
    ops.fused_lamb([p], [g], [m], [v], step=1, lr=LR, grad_sumsq=np.array([bad]))
    for got, old in zip((p, m, v), before, strict=True):
        np.testing.assert_array_equal(got, old)
    opt = ops.lamb(LR)
    state = opt.init({"w": p})
    _, state = opt.apply({"w": g}, state, {"w": p}, grad_sumsq=np.array([bad]))
    assert int(state.count) == 0


def test_float64_params_take_an_exact_path(rng):
    p, g, m = (rng.standard_normal(50) for _ in range(3))
    v = np.abs(rng.standard_normal(50))
    want = lamb_float64(p, g, m, v, step=4)
    ops.fused_lamb([p], [g], [m], [v], step=4, lr=LR, betas=(B1, B2), eps=EPS,
                   weight_decay=WD)
    for got, w in zip((p, m, v), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-14, atol=1e-15)


def test_a_tensor_split_over_ranks_gets_the_whole_tensors_ratio(rng):
    """Two thread ranks, each with half of every tensor, their sums all-reduced
    by ``reduce``, equal the whole tensors' update; without ``reduce`` a half's
    own ratio differs."""
    p, g, m = (rng.standard_normal(6000).astype(np.float32) for _ in range(3))
    v = np.abs(rng.standard_normal(6000)).astype(np.float32)
    p[:3000] *= 10  # the halves' own ratios differ
    whole = [x.copy() for x in (p, g, m, v)]
    ops.fused_lamb(*([x] for x in whole), step=2, lr=LR, weight_decay=WD)
    got = p.copy()

    def run(comm):
        half = slice(3000 * comm.rank, 3000 * (comm.rank + 1))
        bufs = [[got[half]], *([x[half].copy()] for x in (g, m, v))]
        ops.fused_lamb(*bufs, step=2, lr=LR, weight_decay=WD,
                       reduce=lambda s: comm.all_reduce_(s, "sum"))

    ops.spawn(run, 2)
    np.testing.assert_allclose(got, whole[0], rtol=1e-6, atol=1e-7)
    alone = [[x[:3000].copy()] for x in (p, g, m, v)]
    ops.fused_lamb(*alone, step=2, lr=LR, weight_decay=WD)
    assert not np.allclose(alone[0][0], whole[0][:3000], rtol=1e-6, atol=1e-7)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="lamb: b1 must be in"):
        ops.lamb(1e-3, b1=1.0)
    with pytest.raises(ValueError, match="lamb: eps_root must be in"):
        ops.lamb(1e-3, eps_root=-1.0)
    with pytest.raises(ValueError, match="trust_clip's max must be in"):
        ops.lamb(1e-3, trust_clip=(0.5, 0.1))
    with pytest.raises(ValueError, match="fused_lamb: step"):
        ops.fused_lamb([np.zeros(3, np.float32)] * 4, [], [], [], step=0, lr=1e-3)
    z = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="fused_lamb: params, grads, moments"):
        ops.fused_lamb([z], [], [z], [z], step=1, lr=1e-3)
    with pytest.raises(TypeError, match="fused_lamb: grad"):
        ops.fused_lamb([z], [np.zeros(3, np.int32)], [z.copy()], [z.copy()], step=1, lr=1e-3)
    with pytest.raises(TypeError, match="same grad and copy dtypes"):
        ops.fused_lamb([z, z.copy()], [z, z.astype(np.float16)], [z.copy(), z.copy()],
                       [z.copy(), z.copy()], step=1, lr=1e-3)
    with pytest.raises(TypeError, match=r"reduce must return the \(1, 2\) float64 sums"):
        ops.fused_lamb([z], [z.copy()], [z.copy()], [z.copy()], step=1, lr=1e-3,
                       reduce=lambda s: s[:, 0])


def _tensors(rng, gcode, ccode):
    return [(rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(DT[gcode]),
             (rng.standard_normal(n) * 0.1).astype(np.float32),
             np.abs(rng.standard_normal(n) * 0.01).astype(np.float32),
             None if ccode == "none" else np.zeros(n, DT[ccode])) for n in SIZES]


def _scalars(sumsq):
    return (sumsq, B1, B2, 1 - B1, 1 - B2, 1 / (1 - B1**3), 1 / (1 - B2**3), EPS, 0.0, WD, LR,
            0.0, 0.0, 0.5, 1.0)


@pytest.mark.parametrize("gcode,ccode", [("f32", "none"), ("bf16", "bf16"), ("f16", "f16"),
                                         ("f32", "bf16")])
def test_cuda_kernels_equal_the_cpu_build_bit_for_bit(rng, emulated_cuda, gcode, ccode):
    """Both passes emulated as CUDA launches them (stats over a grid smaller
    than the chunks, the in-order finish, apply), against the CPU host
    drivers: moments, per-tensor sums, params and copies bit for bit."""
    tensors = _tensors(rng, gcode, ccode)
    sumsq = np.array([sum(float(np.sum(t[1].astype(np.float64) ** 2)) for t in tensors)])
    stats, finish, apply = lamb_kernels(gcode, ccode)
    want = [tuple(None if a is None else a.copy() for a in t) for t in tensors]
    want_sums = np.zeros((len(SIZES), 2))
    cpu_driver().lamb_stats(stats, finish, want, _scalars(sumsq), want_sums)
    cpu_driver().lamb_apply(apply, want, _scalars(sumsq), want_sums)
    sums = np.zeros((len(SIZES), 2))
    launches = {k: len(emulated_cuda._function(k).launches) for k in (stats, finish, apply)}
    emulated_cuda.lamb_stats(stats, finish, tensors, _scalars(sumsq), sums)
    emulated_cuda.lamb_apply(apply, tensors, _scalars(sumsq), sums)
    assert all(len(emulated_cuda._function(k).launches) == launches[k] + 1 for k in launches)
    assert emulated_cuda.grid(stats, 10**9) < sum(-(-n // LAMB_CHUNK) for n in SIZES)
    np.testing.assert_array_equal(sums.view(np.uint64), want_sums.view(np.uint64))
    assert np.all(sums[1:] > 0) and np.all(sums[0] == 0)
    for got, ref in zip(tensors, want, strict=True):
        for a, c in zip(got, ref, strict=True):
            if a is not None:
                np.testing.assert_array_equal(a.view(np.uint8), c.view(np.uint8))
    fresh = _tensors(np.random.default_rng(0), gcode, ccode)
    assert any(t[0].size and not np.array_equal(t[0], f[0])
               for t, f in zip(tensors, fresh, strict=True))  # something was updated


@pytest.mark.skipif("not __import__('cupy').is_available()", reason="no CUDA device here")
def test_lamb_on_a_gpu_equals_the_cpu_build_bit_for_bit(rng):  # pragma: no cover - needs a GPU
    import cupy

    tensors = [t[:4] for t in _tensors(rng, "bf16", "none")]
    want = [[a.copy() for a in t] for t in tensors]
    ops.fused_lamb(*map(list, zip(*want, strict=True)), step=3, lr=LR, weight_decay=WD)
    dev = [[cupy.asarray(a) for a in t] for t in tensors]
    ops.fused_lamb(*map(list, zip(*dev, strict=True)), step=3, lr=LR, weight_decay=WD)
    for got, ref in zip(dev, want, strict=True):
        for a, b in zip(got, ref, strict=True):
            np.testing.assert_array_equal(cupy.asnumpy(a).view(np.uint8), b.view(np.uint8))


def test_lamb_on_the_device_stand_in_equals_the_host(rng):
    params = {"a": rng.standard_normal((5, 3)).astype(np.float32),
              "b": rng.standard_normal(7).astype(np.float32)}
    grads = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), params)
    opt = ops.lamb(LR, weight_decay=WD)
    host_p, host_s = opt.apply(grads, opt.init(params), jax.tree.map(np.copy, params))
    dev_p = to_device(params, STANDIN)
    dev_p, dev_s = opt.apply(to_device(grads, STANDIN), opt.init(dev_p), dev_p)
    for a, b in zip(jax.tree.leaves((dev_p, dev_s.mu, dev_s.nu)),
                    jax.tree.leaves((host_p, host_s.mu, host_s.nu)), strict=True):
        np.testing.assert_array_equal(STANDIN.to_host(a), b)


def loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] - b["y"]) ** 2)


def init_params():
    rng = np.random.default_rng(0)
    return {"w1": (0.5 * rng.standard_normal((5, 7))).astype(np.float32),
            "b1": (0.1 * rng.standard_normal(7)).astype(np.float32),
            "w2": (0.5 * rng.standard_normal((7, 3))).astype(np.float32)}


def batches(n=5):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((6, 5)).astype(np.float32),
             "y": rng.standard_normal((6, 3)).astype(np.float32)} for _ in range(n)]


def optax_reference(data, tx):
    p = jax.tree.map(jnp.asarray, init_params())
    s = tx.init(p)
    for b in data:
        u, s = tx.update(jax.grad(loss)(p, b), s, p)
        p = optax.apply_updates(p, u)
    return p, s


@pytest.mark.parametrize("stage,world,device", [(0, 2, "numpy"), (1, 3, "numpy"),
                                                (2, 2, "numpy"), (3, 3, "numpy"),
                                                (3, 1, "numpy"), (3, 2, "standin"),
                                                (1, 3, "standin")])
def test_zero_with_lamb_matches_single_process_optax(stage, world, device):
    """Leaves of 5, 7 and 7 rows over 2 and 3 ranks: every split leaf's ratio
    needs every rank's rows."""
    data = batches()
    want_p, want_s = optax_reference(data, optax.lamb(LR, weight_decay=WD))
    zero = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}[stage]

    def run(comm):
        step = zero(loss, optimizer=ops.lamb(LR, weight_decay=WD), comm=comm)
        params = init_params() if device == "numpy" else to_device(init_params(), STANDIN)
        state, _ = run_steps(step, params, data, comm)
        host = (lambda x: x) if device == "numpy" else STANDIN.to_host
        opt = state.opt
        assert isinstance(opt, ops.AdamState) and int(opt.count) == len(data)
        for got, want in ((state.params, want_p), (opt.nu, want_s[0].nu)):
            assert_rank_slices(jax.tree.map(host, got), want, comm.rank, world)

    ops.spawn(run, world)


def test_lamb_checkpoints_reshard_and_refuse_offload(tmp_path):
    data = batches(4)
    want_p, _ = optax_reference(data, optax.lamb(LR, weight_decay=WD))

    def first(comm):
        step = shard.zero2(loss, optimizer=ops.lamb(LR, weight_decay=WD), comm=comm)
        state = step.init(init_params())
        state, _ = run_steps(step, None, data[:2], comm, state=state)
        shard.save(state, tmp_path / "ckpt", comm=comm)

    def resume(comm):
        step = shard.zero3(loss, optimizer=ops.lamb(LR, weight_decay=WD), comm=comm)
        state, _ = shard.load(tmp_path / "ckpt", step, comm=comm, like=init_params())
        state, _ = run_steps(step, None, data[2:], comm, state=state)
        whole = shard.gather(state, comm)
        for g, w in zip(jax.tree.leaves(whole), jax.tree.leaves(want_p), strict=True):
            np.testing.assert_allclose(g, np.asarray(w), rtol=1e-5, atol=1e-6)
        with pytest.raises(TypeError, match=r"offload= .*trust ratio.*ops\.adamw"):
            shard.zero3(loss, optimizer=ops.lamb(LR), comm=comm,
                        offload=shard.Offload("host")).init(init_params())

    ops.spawn(first, 2)
    ops.spawn(resume, 3)


@pytest.mark.multiprocess
def test_the_optimizer_benchmark_prints_lamb_rows_against_their_floor(run_benchmark):
    out = run_benchmark("adam", "--sizes", "2e5", "--layouts", "list", "--impls", "lamb floor",
                        "ours lamb", "--steps", 2, "--rounds", 2)
    rows = {line.split("|")[3].strip(): line.split("|")[6].strip()
            for line in out.splitlines() if line.startswith("| 0M")}
    assert set(rows) == {"lamb floor", "ours lamb"} and rows["lamb floor"] == "1.00"
    assert float(rows["ours lamb"]) > 0
