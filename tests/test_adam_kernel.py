"""ops.fused_adam_step against float64 references and torch.optim trajectories."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ops
from ops.device._arrays import BF16
from tests.reference import adam_reference

SIZES = [0, 1, 7, 1_000_003]
GRAD_DTYPES = [np.float32, BF16, np.float16]
HYPER = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=1e-2, betas=(0.3, 0.9), eps=1e-8, weight_decay=0.01),  # lerp's other formula
]


def _state(rng, n, gdtype=np.float32):
    p = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * 0.1).astype(gdtype)
    m = (rng.standard_normal(n) * 0.01).astype(np.float32)
    v = np.abs(rng.standard_normal(n) * 1e-3).astype(np.float32)
    return p, g, m, v


def _spy_kernels(monkeypatch):
    """Record the name of every kernel the CPU driver runs."""
    from ops.kernels._cpu import cpu_driver

    names: list[str] = []
    driver = cpu_driver()
    real = driver.elementwise
    monkeypatch.setattr(driver, "elementwise",
                        lambda k, n, args: (names.append(k.name), real(k, n, args)))
    return names


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_matches_float64_reference(rng, monkeypatch, n, gdtype, decoupled):
    p, g, m, v = _state(rng, n, gdtype)
    names = _spy_kernels(monkeypatch)
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, decoupled=decoupled)
    want = adam_reference(p, g.astype(np.float64), m, v, step=3, **hp)
    got = ops.fused_adam_step(p, g, m, v, step=3, **hp)
    code = {np.dtype(np.float32): "f32", BF16: "bf16", np.dtype(np.float16): "f16"}
    assert names == [f"zs_adam_{code[np.dtype(gdtype)]}_none"]
    for x, w in zip(got, want, strict=True):
        np.testing.assert_allclose(x, w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("copy_dtype", [BF16, np.float16], ids=["bf16", "f16"])
def test_param_copy_is_the_rounded_new_param(rng, copy_dtype):
    p, g, m, v = _state(rng, 100_003)
    copy = np.empty(p.shape, copy_dtype)
    p, _, _ = ops.fused_adam_step(p, g, m, v, step=1, lr=1e-3, param_copy=copy)
    np.testing.assert_array_equal(copy.view(np.uint16), p.astype(copy_dtype).view(np.uint16))


@pytest.mark.parametrize("hp", HYPER)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_ten_steps_match_torch(rng, hp, decoupled, impl):
    n = 10_007
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) * 0.1 for _ in range(10)]
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([tp], lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
              weight_decay=hp["weight_decay"], **{impl: True})
    p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    for step, g in enumerate(grads, start=1):
        tp.grad = torch.from_numpy(g.copy())
        opt.step()
        p, m, v = ops.fused_adam_step(p, g, m, v, step=step, decoupled=decoupled, **hp)
    st = opt.state[tp]
    for ours, theirs in ((p, tp.detach()), (m, st["exp_avg"]), (v, st["exp_avg_sq"])):
        theirs = theirs.numpy()
        if impl == "fused":
            # Same operations in the same order: bit for bit, except the last n % 16
            # elements, which torch's fused CPU kernel runs through a scalar tail
            # loop that rounds differently from its own vector body.
            body = n - n % 16
            np.testing.assert_array_equal(ours[:body], theirs[:body])
        # 1e-6 relative, with an absolute floor for entries that cancelled to near 0
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6 * np.abs(theirs).max())


def test_unscale_clip_and_adamw_match_torch_sequence(rng):
    """Ours in one pass == GradScaler unscale, clip_grad_norm_, AdamW in torch."""
    n, scale, max_norm = 50_001, 1024.0, 0.5
    p0 = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * 0.1 * scale).astype(np.float32)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    tp.grad = torch.from_numpy(g.copy()) / scale
    torch.nn.utils.clip_grad_norm_([tp], max_norm)
    torch.optim.AdamW([tp], lr=1e-2, fused=True).step()
    sumsq = ops.sum_of_squares(g)
    p, _, _ = ops.fused_adam_step(p0.copy(), g, np.zeros(n, np.float32), np.zeros(n, np.float32),
                                  step=1, lr=1e-2, weight_decay=0.01, grad_scale=1 / scale,
                                  grad_sumsq=sumsq, max_norm=max_norm)
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_sumsq_skips_the_update(rng, bad):
    p, g, m, v = _state(rng, 1001)
    g[17] = bad
    before = [x.copy() for x in (p, m, v)]
    copy = np.zeros(p.shape, BF16)
    sumsq = ops.sum_of_squares(g)
    assert not np.isfinite(sumsq[0])
    out = ops.fused_adam_step(p, g, m, v, step=1, lr=1e-3, grad_sumsq=sumsq, param_copy=copy)
    for x, b in zip(out, before, strict=True):
        np.testing.assert_array_equal(x, b)
    assert not copy.view(np.uint16).any()


def test_donate_false_leaves_inputs_untouched(rng):
    p, g, m, v = _state(rng, 99)
    before = [x.copy() for x in (p, g, m, v)]
    out = ops.fused_adam_step(p, g, m, v, step=1, lr=1e-3, donate=False)
    for x, b in zip((p, g, m, v), before, strict=True):
        np.testing.assert_array_equal(x, b)
    assert not np.array_equal(out[0], p)
    donated = ops.fused_adam_step(p, g, m, v, step=1, lr=1e-3)
    assert all(a is b for a, b in zip(donated, (p, m, v), strict=True))
    np.testing.assert_array_equal(donated[0], out[0])


def test_bad_input_raises_precise_errors(rng):
    p, g, m, v = _state(rng, 8)
    step = ops.fused_adam_step
    with pytest.raises(TypeError, match="param must have dtype float32, float64; got int32"):
        step(p.astype(np.int32), g, m, v, step=1, lr=1e-3)
    with pytest.raises(TypeError, match="grad must have dtype float64; got float32"):
        step(p.astype(np.float64), g, m.astype(np.float64), v.astype(np.float64), step=1,
             lr=1e-3)
    with pytest.raises(ValueError, match=r"grad must have shape \(8,\)"):
        step(p, g[:7], m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg must be C-contiguous"):
        step(p, g, np.zeros(16, np.float32)[::2], v, step=1, lr=1e-3)
    ro = m.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="exp_avg is read-only"):
        step(p, g, ro, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="step is the 1-based count"):
        step(p, g, m, v, step=0, lr=1e-3)
    with pytest.raises(ValueError, match="betas"):
        step(p, g, m, v, step=1, lr=1e-3, betas=(0.9, 1.0))
    with pytest.raises(TypeError, match=r"got torch.Tensor"):
        step(torch.from_numpy(p), g, m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="needs max_norm > 0 and grad_sumsq"):
        step(p, g, m, v, step=1, lr=1e-3, max_norm=1.0)
    with pytest.raises(TypeError, match="grad_sumsq must be a one-element float64"):
        step(p, g, m, v, step=1, lr=1e-3, grad_sumsq=np.zeros(1, np.float32))
    with pytest.raises(TypeError, match="param_copy must have dtype"):
        step(p, g, m, v, step=1, lr=1e-3, param_copy=np.zeros(8, np.float32))


def test_multi_tensor_call_equals_one_call_per_tensor(rng):
    sizes = [1, 7, 65_537, 3, 200_003, 0, 70_000]
    gdtypes = [np.float32, BF16, np.float32, np.float16, np.float32, np.float32, BF16]
    singles = [_state(rng, n, d) for n, d in zip(sizes, gdtypes, strict=True)]
    multi = [tuple(x.copy() for x in s) for s in singles]
    copies = [np.zeros(n, BF16) for n in sizes]
    copies_multi = [c.copy() for c in copies]
    sumsq = np.array([12.5])
    hp = dict(step=4, lr=1e-2, weight_decay=0.1, grad_scale=0.5, grad_sumsq=sumsq, max_norm=1.0)
    for (p, g, m, v), c in zip(singles, copies, strict=True):
        ops.fused_adam_step(p, g, m, v, param_copy=c, **hp)
    ps, ms, vs = ops.fused_adam_multi(*zip(*multi, strict=True), param_copies=copies_multi, **hp)
    for a, b in zip(singles, zip(ps, [t[1] for t in multi], ms, vs, strict=True), strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
    for c, cm in zip(copies, copies_multi, strict=True):
        np.testing.assert_array_equal(c.view(np.uint16), cm.view(np.uint16))
    with pytest.raises(ValueError, match="must be as many"):
        ops.fused_adam_multi(ps, ps[:2], ms, vs, step=1, lr=1e-3)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_float64_params_take_an_exact_path(rng, decoupled):
    p, g, m, v = (x.astype(np.float64) for x in _state(rng, 1001))
    g[0] = 3.0
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, decoupled=decoupled)
    sumsq = np.array([float(np.sum(g * g))])
    want = adam_reference(p, g, m, v, step=2, grad_scale=0.5, max_norm=0.1, grad_sumsq=sumsq[0],
                          **hp)
    got = ops.fused_adam_step(p, g, m, v, step=2, grad_scale=0.5, max_norm=0.1,
                              grad_sumsq=sumsq, **hp)
    for x, w in zip(got, want, strict=True):
        assert x.dtype == np.float64
        np.testing.assert_allclose(x, w, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("n", [1, 7, 1_000_003])
@pytest.mark.parametrize("gdtype", GRAD_DTYPES)
@pytest.mark.parametrize("copy", [None, BF16])
def test_out_of_place_update_equals_the_in_place_one(n, gdtype, copy):
    """read_from: the old values come from three other arrays, which stay as they
    were, and the new ones are the in-place kernel's, bit for bit (also for
    outputs at an offset that changes the SIMD loop's alignment)."""
    rng = np.random.default_rng(n)
    p, g, m, v = _state(rng, n, gdtype)
    kw = dict(step=3, grad_scale=0.5, **HYPER[1])
    want = [x.copy() for x in (p, m, v)]
    want_copy = None if copy is None else np.empty(n, copy)
    ops.fused_adam_step(*want[:1], g, *want[1:], param_copy=want_copy, **kw)
    old = [x.copy() for x in (p, m, v)]
    out = [np.full(n + 1, np.nan, np.float32)[1:] for _ in range(3)]
    got_copy = None if copy is None else np.empty(n, copy)
    ops.fused_adam_step(out[0], g, out[1], out[2], param_copy=got_copy, read_from=(p, m, v),
                        **kw)
    for a, b in zip(out, want, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip((p, m, v), old, strict=True):
        np.testing.assert_array_equal(a, b)
    if copy is not None:
        np.testing.assert_array_equal(got_copy.view(np.uint16), want_copy.view(np.uint16))


def test_out_of_place_update_checks_its_sources():
    from ops.testing import STANDIN, to_device

    p, g, m, v = _state(np.random.default_rng(0), 5)
    with pytest.raises(ValueError, match="read_from's exp_avg"):
        ops.fused_adam_step(p, g, m, v, step=1, lr=1e-3, read_from=(p, m[:4], v))
    with pytest.raises(TypeError, match="read_from must be"):
        ops.fused_adam_step(p, g, m, v, step=1, lr=1e-3, read_from=(p, m))
    dev = [to_device(x, STANDIN) for x in (p, g, m, v)]
    with pytest.raises(TypeError, match="read_from is for host"):
        ops.fused_adam_step(*dev, step=1, lr=1e-3, read_from=tuple(dev[:1] + dev[2:]))
