"""Fused Lion (``ops/kernels/lion.cu``): the CPU build against ``optax.lion`` and a
float64 reference, bit for bit against the emulated CUDA kernels it shares its
source with, on the strict device stand-in, and under ZeRO 1-3 against
single-process optax."""

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
from ops.kernels._table import TABLE, lion_kernel
from ops.testing import STANDIN, to_device
from tests.harness import assert_rank_slices, run_steps

DT = {"f32": np.float32, "bf16": BF16, "f16": np.float16}
SIZES = [0, 1, 300, 7, 1000, 257, 2049]  # an empty tensor, and none a multiple of a block
LR, B1, B2, WD = 1e-2, 0.9, 0.99, 0.1


def lion_float64(p, g, m, *, lr=LR, b1=B1, b2=B2, wd=WD, mul=1.0):
    p, g, m = (np.asarray(x, np.float64) for x in (p, g, m))
    g = g * mul
    p = p - lr * (np.sign(b1 * m + (1 - b1) * g) + wd * p)
    return p, b2 * m + (1 - b2) * g


def test_ten_steps_equal_optax_lion(rng):
    shapes = [(300,), (7, 13), (1,)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(10)]
    tx = optax.lion(LR, b1=B1, b2=B2, weight_decay=WD)
    want = [jnp.asarray(p) for p in params]
    state = tx.init(want)
    opt = ops.lion(LR, b1=B1, b2=B2, weight_decay=WD)
    ours = [p.copy() for p in params]
    ours_state = opt.init(ours)
    for g in grads:
        updates, state = jax.jit(tx.update)([jnp.asarray(x) for x in g], state, want)
        want = optax.apply_updates(want, updates)
        ours, ours_state = opt.apply(g, ours_state, ours)
    for a, b in zip(ours, want, strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=0, atol=2e-7)
    for a, b in zip(ours_state.mu, state[0].mu, strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-8)
    assert int(ours_state.count) == 10


@pytest.mark.parametrize("gcode", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("ccode", ["none", "bf16", "f16"])
def test_unscale_clip_and_copies_match_the_float64_reference(rng, gcode, ccode):
    n = 1001
    p = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * 8).astype(DT[gcode])
    m = (rng.standard_normal(n) * 0.1).astype(np.float32)
    c = None if ccode == "none" else np.zeros(n, DT[ccode])
    sumsq = np.array([np.sum(g.astype(np.float64) ** 2)])
    scale, max_norm = 0.5, 1.0
    norm = np.sqrt(sumsq[0]) * scale
    want_p, want_m = lion_float64(p, g, m, mul=scale * min(1.0, max_norm / (norm + 1e-6)))
    ops.fused_lion([p], [g], [m], lr=LR, betas=(B1, B2), weight_decay=WD, grad_scale=scale,
                   grad_sumsq=sumsq, max_norm=max_norm, param_copies=None if c is None else [c])
    np.testing.assert_allclose(p, want_p, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m, want_m, rtol=1e-5, atol=1e-7)
    if c is not None:
        np.testing.assert_array_equal(c, p.astype(DT[ccode]))


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_sumsq_skips_the_update(rng, bad):
    p, g, m = (rng.standard_normal(64).astype(np.float32) for _ in range(3))
    before = (p.copy(), m.copy())
    ops.fused_lion([p], [g], [m], lr=LR, grad_sumsq=np.array([bad]))
    np.testing.assert_array_equal(p, before[0])
    np.testing.assert_array_equal(m, before[1])
    opt = ops.lion(LR)
    state = opt.init({"w": p})
    _, state = opt.apply({"w": g}, state, {"w": p}, grad_sumsq=np.array([bad]))
    assert int(state.count) == 0


def test_float64_params_take_an_exact_path(rng):
    p, g, m = (rng.standard_normal(50) for _ in range(3))
    want_p, want_m = lion_float64(p, g, m)
    ops.fused_lion([p], [g], [m], lr=LR, betas=(B1, B2), weight_decay=WD)
    np.testing.assert_array_equal(p, want_p)
    np.testing.assert_array_equal(m, want_m)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="lion: b1 must be in"):
        ops.lion(1e-4, b1=1.5)
    with pytest.raises(ValueError, match="lion: weight_decay must be in"):
        ops.lion(1e-4, weight_decay=-1.0)
    with pytest.raises(TypeError, match="lion: learning_rate must be a number"):
        ops.lion("fast")
    with pytest.raises(ValueError, match="as many"):
        ops.fused_lion([np.zeros(3, np.float32)], [], [], lr=1e-3)
    with pytest.raises(TypeError, match="grad"):
        ops.fused_lion([np.zeros(3, np.float32)], [np.zeros(3, np.int32)],
                       [np.zeros(3, np.float32)], lr=1e-3)


def _tensors(rng, gcode, ccode):
    out = []
    for n in SIZES:
        out.append((rng.standard_normal(n).astype(np.float32),
                    rng.standard_normal(n).astype(DT[gcode]),
                    (rng.standard_normal(n) * 0.1).astype(np.float32), None,
                    None if ccode == "none" else np.zeros(n, DT[ccode])))
    return out


def _scalars(sumsq):
    return (sumsq, B1, B2, 1 - B1, 1 - B2, LR, 0.0, 0.0, WD, 0.0, 0.5, 1.0)


@pytest.mark.parametrize("gcode,ccode", [("f32", "none"), ("bf16", "bf16"), ("f16", "f16"),
                                         ("f32", "bf16")])
def test_cuda_kernels_equal_the_cpu_build_bit_for_bit(rng, emulated_cuda, gcode, ccode):
    """The multi-tensor launch (one launch for every tensor) and the single-tensor
    kernel, emulated as CUDA runs them, against the CPU host drivers."""
    tensors = _tensors(rng, gcode, ccode)
    sumsq = np.array([sum(float(np.sum(t[1].astype(np.float64) ** 2)) for t in tensors)])
    want = [tuple(None if a is None else a.copy() for a in t) for t in tensors]
    cpu_driver().adam_multi(lion_kernel(gcode, ccode), want, _scalars(sumsq))
    single = [tuple(None if a is None else a.copy() for a in t) for t in tensors]
    multi = TABLE[lion_kernel(gcode, ccode).multi]
    before = len(emulated_cuda._function(multi).launches)
    emulated_cuda.adam_multi(lion_kernel(gcode, ccode), tensors, _scalars(sumsq))
    assert len(emulated_cuda._function(multi).launches) == before + 1
    for t in single:
        emulated_cuda.elementwise(lion_kernel(gcode, ccode), t[0].size,
                                  (*t, t[0].size, *_scalars(sumsq)))
    for got, one, ref in zip(tensors, single, want, strict=True):
        for a, b, c in zip(got, one, ref, strict=True):
            if a is not None:
                np.testing.assert_array_equal(a.view(np.uint8), c.view(np.uint8))
                np.testing.assert_array_equal(b.view(np.uint8), c.view(np.uint8))
    assert any(t[0].size and not np.array_equal(t[0], r[0])
               for t, r in zip(tensors, _tensors(np.random.default_rng(0), gcode, ccode),
                               strict=True))  # something was updated


def test_lion_on_the_device_stand_in_equals_the_host(rng):
    params = {"a": rng.standard_normal((5, 3)).astype(np.float32),
              "b": rng.standard_normal(7).astype(np.float32)}
    grads = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), params)
    opt = ops.lion(LR, weight_decay=WD)
    host_p, host_s = opt.apply(grads, opt.init(params), jax.tree.map(np.copy, params))
    dev_p = to_device(params, STANDIN)
    dev_p, dev_s = opt.apply(to_device(grads, STANDIN), opt.init(dev_p), dev_p)
    for a, b in zip(jax.tree.leaves((dev_p, dev_s.mu)), jax.tree.leaves((host_p, host_s.mu)),
                    strict=True):
        np.testing.assert_array_equal(STANDIN.to_host(a), b)


def loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)


def init_params():
    rng = np.random.default_rng(0)
    return {"w1": (0.5 * rng.standard_normal((5, 7))).astype(np.float32),
            "w2": (0.5 * rng.standard_normal((7, 3))).astype(np.float32)}


def batches(n=4):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((6, 5)).astype(np.float32),
             "y": rng.standard_normal((6, 3)).astype(np.float32)} for _ in range(n)]


def optax_reference(data):
    tx = optax.lion(LR, weight_decay=WD)
    p = jax.tree.map(jnp.asarray, init_params())
    s = tx.init(p)
    for b in data:
        u, s = tx.update(jax.grad(loss)(p, b), s, p)
        p = optax.apply_updates(p, u)
    return p, s


@pytest.mark.parametrize("stage,world,device", [(1, 3, "numpy"), (2, 2, "numpy"),
                                                (3, 3, "numpy"), (3, 2, "standin")])
def test_zero_with_lion_matches_single_process_optax(stage, world, device):
    data = batches()
    want_p, want_s = optax_reference(data)
    zero = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}[stage]

    def run(comm):
        step = zero(loss, optimizer=ops.lion(LR, weight_decay=WD), comm=comm)
        params = init_params() if device == "numpy" else to_device(init_params(), STANDIN)
        state = step.init(params)
        assert state.meta.moment_names == ("exp_avg",)
        state, _ = run_steps(step, None, data, comm, state=state)
        host = (lambda x: x) if device == "numpy" else STANDIN.to_host
        opt = state.opt
        assert isinstance(opt, ops.LionState) and int(opt.count) == len(data)
        for got, want in ((state.params, want_p), (opt.mu, want_s[0].mu)):
            assert_rank_slices(jax.tree.map(host, got), want, comm.rank, world)

    ops.spawn(run, world)


def test_lion_checkpoints_reshard_and_refuse_offload(tmp_path):
    data = batches()
    want_p, _ = optax_reference(data)

    def first(comm):
        step = shard.zero2(loss, optimizer=ops.lion(LR, weight_decay=WD), comm=comm)
        state = step.init(init_params())
        state, _ = run_steps(step, None, data[:2], comm, state=state)
        shard.save(state, tmp_path / "ckpt", comm=comm)

    def resume(comm):
        step = shard.zero3(loss, optimizer=ops.lion(LR, weight_decay=WD), comm=comm)
        state, _ = shard.load(tmp_path / "ckpt", step, comm=comm, like=init_params())
        state, _ = run_steps(step, None, data[2:], comm, state=state)
        whole = shard.gather(state, comm)
        for g, w in zip(jax.tree.leaves(whole), jax.tree.leaves(want_p), strict=True):
            np.testing.assert_allclose(g, np.asarray(w), rtol=1e-5, atol=1e-6)
        with pytest.raises(TypeError, match=r"offload= keeps Adam's moments.*\['exp_avg'\]"):
            shard.zero3(loss, optimizer=ops.lion(LR), comm=comm,
                        offload=shard.Offload("host")).init(init_params())

    ops.spawn(first, 2)
    ops.spawn(resume, 3)
