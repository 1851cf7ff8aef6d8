"""The ZeRO step with its state on a device: the strict stand-in, and a GPU when present.

Every test here runs on :data:`ops.testing.STANDIN` (arrays that refuse
implicit conversion to numpy, kernels emulated from the CUDA source) and, on a
machine with a GPU, on CuPy. The references are the same single-process runs
the host tests use.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard
from ops._types import tree_map
from ops.device._device import HOST, device_of_or_none
from ops.testing import STANDIN, SYNCS, to_device
from tests import test_interop_torch as T
from tests import zero_models as M
from tests.harness import run_steps
from tests.test_zero import STEPS, ZERO

WORLDS = [1, 3]  # 3 divides none of the leaf sizes


def host(x):
    """An explicit copy to the host of a device array (numpy stays as it is)."""
    d = device_of_or_none(x)
    return x if d is None or d.host else d.to_host(x)


def train(comm, device, *, stage, loss_fn=M.loss, steps=STEPS, **kwargs):
    step = ZERO[stage](loss_fn, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm,
                       options=shard.ZeroOptions(**kwargs))
    state, metrics = run_steps(step, to_device(M.init_params(), device), M.batches(steps), comm)
    return step, state, [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]


def assert_on(device, state):
    for kind in ("master", "exp_avg", "exp_avg_sq", "compute"):
        for buf in getattr(state, kind):
            assert device_of_or_none(buf) is device, (kind, type(buf))


@pytest.fixture(scope="module")
def fp32_reference():
    return M.reference(STEPS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_jax_loss_on_device_matches_single_process_adamw(device, fp32_reference, stage, world):
    want, want_losses, want_norms = fp32_reference

    def run(comm):
        step, state, losses, norms = train(comm, device, stage=stage)
        assert step.device is device and state.meta.device == device.name
        assert_on(device, state)
        mine = shard.partition(want, rank=comm.rank if stage else 0,
                               world_size=comm.world_size if stage else 1)
        for got, exp in zip(jax.tree_util.tree_leaves(state.params),
                            jax.tree_util.tree_leaves(mine), strict=True):
            np.testing.assert_allclose(host(got), exp, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        return tree_map(host, shard.gather(state, comm))

    for full in ops.spawn(run, world):
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                                        atol=1e-6), full, want)


@pytest.mark.parametrize("stage", [0, 3])
def test_layered_loss_on_device(device, fp32_reference, stage):
    want, want_losses, _ = fp32_reference

    def run(comm):
        _, state, losses, _ = train(comm, device, stage=stage, loss_fn=M.LAYERED)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        return tree_map(host, shard.gather(state, comm))

    for full in ops.spawn(run, 3):
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                                        atol=1e-6), full, want)


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_clipping_and_loss_scaling_on_device_match_the_host(device, stage):
    """The same policies on host and device state give the same params (the kernels
    are one source; sums of squares may add in another order). On a GPU, JAX runs
    the bf16 forward and backward with the GPU's own matrix products, which round
    differently from the CPU's: there the two agree to bf16's precision."""
    kwargs = {"precision": shard.Precision(param_dtype=ops.BF16, reduce_dtype=np.float32),
              "clip_norm": 0.05, "loss_scale": shard.LossScale(initial=2.0 ** 10)}

    def run(comm, where):
        _, state, losses, _ = train(comm, where, stage=stage, steps=4, **kwargs)
        assert state.compute[0].dtype == ops.BF16
        return tree_map(host, shard.gather(state, comm)), losses

    (want, want_losses), (got, losses) = (ops.spawn(run, 2, d)[0] for d in (HOST, device))
    rtol, atol = (1e-6, 1e-7) if device.name == "standin" else (1e-2, 2 * M.LR)
    np.testing.assert_allclose(losses, want_losses, rtol=rtol)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol),
                           got, want)


def torch_run(comm, device, stage, model, batches, **kwargs):
    """interop.torch on a device: a CUDA module on a GPU; on the stand-in, a CPU
    module whose params are moved to stand-in memory (torch sees it as CPU)."""
    model = copy.deepcopy(model)
    if device.torch_device == "cuda":
        model = model.cuda()
        batches = [tuple(t.cuda() for t in b) for b in batches]
    params, fn = it.functional(model, loss=T.mse)
    step = ZERO[stage](fn, optimizer=ops.adamw(T.LR, weight_decay=T.WD), comm=comm,
                       options=shard.ZeroOptions(**kwargs))
    state = step.init(to_device(params, device))
    assert_on(device, state)
    for b in batches:
        n = b[0].shape[0] // comm.world_size
        state, _ = step(state, tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b))
    return tree_map(host, shard.gather(state, comm)), step


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torch_module_on_device_matches_torch_adamw(device, stage):
    batches = T.data()
    want = T.reference(lambda: T.MLP(tied=True), T.mse, batches)
    model = T.built(lambda: T.MLP(tied=True))
    got = ops.spawn(lambda c: torch_run(c, device, stage, model, batches)[0], 3)[0]
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_zero3_on_device_keeps_at_most_two_units_alive(device):
    if device.torch_device == "cuda":
        pytest.skip("thread ranks on a CUDA module gather every unit (see [Note: torch ZeRO-3])")
    depth, width = 6, 48
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    batches = [(torch.randn(8, width), torch.randn(8, width)) for _ in range(2)]
    unit = (width * width + width) * 4
    for step in ops.spawn(lambda c: torch_run(c, device, 3, model, batches)[1], 4):
        assert unit <= step.tracker.peak <= 2 * unit, step.tracker.peak / unit
        assert step.tracker.live == 0


@pytest.mark.parametrize(("saved_on", "loaded_on"), [("device", "numpy"), ("numpy", "device")])
def test_checkpoints_move_between_host_and_device(device, tmp_path, saved_on, loaded_on):
    """Save after 3 steps at stage 3 on 2 ranks, resume at stage 2 on 3 ranks on the
    other device: 3 more steps equal 6 uninterrupted ones."""
    where = {"device": device, "numpy": HOST}
    want = ops.spawn(lambda c: tree_map(host, shard.gather(
        train(c, HOST, stage=3, steps=6)[1], c)), 2)[0]
    batches = M.batches(6)

    def first(comm):
        _, state, _, _ = train(comm, where[saved_on], stage=3, steps=3)
        shard.save(state, tmp_path / "ckpt", comm=comm)

    def resume(comm):
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm)
        state, _ = shard.load(tmp_path / "ckpt", step, comm=comm,
                              like=to_device(M.init_params(), where[loaded_on]))
        assert_on(where[loaded_on], state)
        assert int(state.step) == 3
        for b in batches[3:]:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank,
                                                     world_size=comm.world_size))
        return tree_map(host, shard.gather(state, comm))

    ops.spawn(first, 2)
    got = ops.spawn(resume, 3)[0]
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           got, want)


def test_load_onto_a_device_by_name(tmp_path):
    def run(comm):
        _, state, _, _ = train(comm, HOST, stage=1, steps=2)
        shard.save(state, tmp_path / "ckpt", comm=comm)
        step = shard.zero1(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        loaded, _ = shard.load(tmp_path / "ckpt", step, comm=comm, like=M.init_params(),
                               device="standin")
        assert_on(STANDIN, loaded)
        for a, b in zip(loaded.master, state.master, strict=True):
            np.testing.assert_array_equal(host(a), b)

    ops.spawn(run, 2)


def test_a_step_without_clipping_or_loss_scaling_reads_nothing_back():
    """The loss and norm stay on the device; the one read happens when metrics are
    looked at. With clipping the step reads two numbers, once."""
    def run(comm, clip_norm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm, clip_norm=clip_norm)
        state = step.init(to_device(M.init_params(), STANDIN))
        reads = []
        for b in M.batches(3):
            SYNCS.reset()
            state, metrics = step(state, shard.split_batch(b, rank=comm.rank,
                                                           world_size=comm.world_size))
            reads.append(SYNCS.count)
        loss = metrics["loss"]
        reads.append(SYNCS.count)
        _ = metrics["grad_norm"], dict(metrics)
        reads.append(SYNCS.count)
        return reads, loss

    for reads, loss in ops.spawn(run, 2, None):
        assert reads == [0, 0, 0, 1, 1] and np.isfinite(loss)
    for reads, _ in ops.spawn(run, 2, 1.0):
        assert reads == [1, 1, 1, 1, 1]


def test_a_planted_host_conversion_in_the_step_fails_on_the_stand_in(monkeypatch):
    """What the stand-in is for: code that hands device memory to numpy (fine on
    the host, an error on a GPU) fails the device tests."""
    from shard.step import _update

    original = _update.norm_and_loss

    def planted(plan, shards, *rest):
        np.asarray(shards[0])  # a host-only habit
        return original(plan, shards, *rest)

    monkeypatch.setattr(_update, "norm_and_loss", planted)
    ops.spawn(lambda c: train(c, HOST, stage=3, steps=1), 2)  # the host does not mind
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
        ops.spawn(lambda c: train(c, STANDIN, stage=3, steps=1), 2)


@pytest.mark.parametrize("stage", [0, 3])
def test_invariant_shards_on_device_give_one_ranks_bits(device, stage):
    """The ordered collectives and the exact norm on device state (see [Note:
    the same bits at any world size])."""
    def run(comm):
        _, state, losses, norms = train(comm, device, stage=stage, steps=3, clip_norm=1.0,
                                        invariant_shards=4)
        return [host(x) for x in jax.tree_util.tree_leaves(shard.gather(state, comm))], \
            losses, norms

    want = ops.spawn(run, 1)[0]
    for world in (2, 4):
        got = ops.spawn(run, world)[0]
        assert got[1:] == want[1:]
        for a, b in zip(got[0], want[0], strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_step_refuses_state_and_params_of_other_devices():
    def run(comm):
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        host_state = step.init(M.init_params())
        device_step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        device_step.init(to_device(M.init_params(), STANDIN))
        with pytest.raises(ValueError, match="lives on numpy but the step was set up for "
                                             "standin"):
            device_step(host_state, M.batches(1)[0])
        mixed = M.init_params()
        mixed[1]["w"] = STANDIN.asarray(mixed[1]["w"])
        with pytest.raises(TypeError, match=r"is a (numpy|standin) array but leaf \d+ is a"):
            step.init(mixed)

    ops.spawn(run, 1)


def test_torch_gradients_of_another_device_are_refused():
    grads = torch.ones(3)
    assert host(STANDIN.asarray(grads)).tolist() == [1.0, 1.0, 1.0]  # CPU memory: a view
    gpu = dataclasses.replace(HOST, name="gpu", host=False, torch_device="cuda")
    with pytest.raises(TypeError, match="a torch tensor on cpu cannot be viewed as a gpu array"):
        gpu.asarray(grads, what="the gradient of w")


def test_jax_losses_over_host_state_stay_on_the_cpu(monkeypatch):
    """Even where JAX's default device is a GPU (it is on a GPU machine)."""
    from shard.step import _grads

    seen = []
    original = _grads.on_device

    def record(plan, x, what):
        seen.append({d.platform for d in x.devices()})
        return original(plan, x, what)

    monkeypatch.setattr(_grads, "on_device", record)

    def run(comm):
        step = shard.zero1(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        step(step.init(M.init_params()), M.batches(1)[0])

    pinned = jax.config.jax_default_device
    jax.config.update("jax_default_device", jax.devices()[0])  # global: thread ranks see it
    try:
        ops.spawn(run, 1)
    finally:
        jax.config.update("jax_default_device", pinned)
    assert seen == [{"cpu"}]


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_on_device_arrays(device, world):
    def run(comm):
        xp = device.xp
        mine = device.asarray(np.arange(5, dtype=np.float32) + 10 * comm.rank)
        gathered = ops.all_gather(comm, mine)
        out = device.empty(5, np.float32)
        comm.reduce_scatter_into(out, device.asarray(
            np.arange(5 * comm.world_size, dtype=np.float32)), "sum")
        total = device.asarray(np.full(4, comm.rank + 1, np.float32))
        comm.all_reduce_(total, "sum")
        assert device_of_or_none(gathered) is device and type(gathered) is xp.ndarray
        return host(gathered), host(out), host(total)

    results = ops.spawn(run, world)
    want = np.concatenate([np.arange(5, dtype=np.float32) + 10 * r for r in range(world)])
    for r, (gathered, out, total) in enumerate(results):
        np.testing.assert_array_equal(gathered, want)
        np.testing.assert_array_equal(out, world * np.arange(5 * r, 5 * r + 5, dtype=np.float32))
        np.testing.assert_array_equal(total, np.full(4, world * (world + 1) / 2, np.float32))


def test_jnp_results_are_viewed_not_copied_on_the_host():
    x = jnp.arange(4.0, dtype=jnp.float32)
    assert HOST.asarray(x).ctypes.data == x.unsafe_buffer_pointer()
    for dtype in (jnp.float32, jnp.bfloat16):  # a unit's gradient out of its segment
        g = jnp.arange(1000, dtype=dtype) / 8
        view = HOST.from_jax(g)
        assert view.ctypes.data == g.unsafe_buffer_pointer()
        assert view.dtype == (ops.BF16 if dtype == jnp.bfloat16 else np.float32)
        np.testing.assert_array_equal(view.astype(np.float32), np.asarray(g.astype(jnp.float32)))


@pytest.mark.parametrize("stage", [1, 3])
def test_evaluate_on_device_matches_the_host(device, stage):
    def run(comm, dev):
        step, state, _, _ = train(comm, dev, stage=stage, steps=2)
        b = shard.split_batch(M.batches(3)[-1], rank=comm.rank, world_size=comm.world_size)
        return step.evaluate(state, b)

    on_device = ops.spawn(lambda c: run(c, device), 3)
    on_host = ops.spawn(lambda c: run(c, HOST), 3)
    assert on_device == pytest.approx(on_host, rel=1e-6)
    assert len(set(on_device)) == 1


@pytest.mark.parametrize("stage", [2, 3])
def test_aux_unequal_micro_batches_and_a_failed_step_on_device(device, stage):
    """The step's newer paths on device state: ``has_aux`` (aux read to the host
    explicitly), micro-batches weighted by their rows (the loss total scaled on the
    device), and a failed step that waits out its collectives; the same numbers
    as host state."""
    def with_aux(p, b):
        loss = M.loss(p, b)
        return loss, {"mse": loss}

    bad = {"x": np.ones((3, 4), np.float32), "y": np.ones((3, 3), np.float32)}

    def run(comm, where):
        step = ZERO[stage](with_aux, optimizer=ops.adamw(M.LR), comm=comm, has_aux=True)
        state = step.init(to_device(M.init_params(), where))
        out = []
        for i, b in enumerate(M.batches(2)):
            mine = shard.split_batch(b, rank=comm.rank, world_size=comm.world_size)
            if i == 1:
                with pytest.raises(TypeError):
                    step(state, bad)
            parts = [tree_map(lambda x: x[:9], mine), tree_map(lambda x: x[9:], mine)]
            state, metrics = step(state, shard.MicroBatches(parts))
            out.append((float(metrics["loss"]), float(metrics["aux"]["mse"])))
        return [host(x) for x in state.master], out

    for (want, want_out), (got, got_out) in zip(ops.spawn(lambda c: run(c, HOST), 2),
                                                ops.spawn(lambda c: run(c, device), 2),
                                                strict=True):
        np.testing.assert_allclose(got_out, want_out, rtol=1e-6)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
