"""quantized_weights= (ZeRO++'s qwZ): stage 3 all-gathers int8 values and a scale
per block, the loss sees each value within half its block's scale, and the
master shards stay exact (see [Note: quantized gathers] in shard/step/_runtime.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import ops
import shard
from shard.step._grads import unit_params
from shard.step._runtime import LiveBytes
from tests.harness import run_steps


def _params():
    rng = np.random.default_rng(0)  # unit 0: 1073 values, 2 blocks a section at 3 ranks
    return [{"w": rng.standard_normal((37, 29)).astype(np.float32) * 0.3},
            {"w": rng.standard_normal((29, 3)).astype(np.float32) * 0.3,
             "b": rng.standard_normal(3).astype(np.float32) * 0.1}]


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p[0]["w"])
    return jnp.mean((h @ p[1]["w"] + p[1]["b"] - b["y"]) ** 2)


def _batch(k, rows=12):
    rng = np.random.default_rng(100 + k)
    return {"x": rng.standard_normal((rows, 37)).astype(np.float32),
            "y": rng.standard_normal((rows, 3)).astype(np.float32)}


class _Recorder:
    """A communicator that records what each all-gather moves."""

    def __init__(self, comm):
        self.comm, self.moved = comm, []

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def all_gather_async(self, out, x):
        self.moved.append((np.dtype(x.dtype).name, x.size, x.nbytes))
        return self.comm.all_gather_async(out, x)


@pytest.mark.parametrize("world", [2, 3])
def test_a_gathered_unit_is_within_half_a_block_scale_and_moves_a_quarter_of_the_bytes(world):
    def run(comm):
        got = {}
        for quantized in (False, True):
            step = shard.zero3(_loss, optimizer=ops.adamw(1e-2), comm=comm,
                               options=shard.ZeroOptions(quantized_weights=quantized))
            state = step.init(_params())
            units = unit_params(step.plan, state, LiveBytes())
            recorder = units.comm = _Recorder(units.comm)
            got[quantized] = ([np.array(units.flat(u)) for u in range(2)], recorder.moved)
        return got

    for got in shard.spawn(run, world):
        (exact, exact_moved), (seen, moved) = got[False], got[True]
        for u in range(2):
            whole = exact[u]
            bound = np.abs(whole).max() / 127 / 2 * (1 + 1e-6)  # a block's amax <= the unit's
            err = np.abs(seen[u] - whole)
            assert err.max() <= bound and err.max() > 0, (u, err.max(), bound)
        floats = sum(n for _, _, n in exact_moved)
        assert {d for d, _, _ in moved} == {"int8", "float32"}
        values = sum(n for d, n, _ in moved if d == "int8")
        scales = sum(n for d, n, _ in moved if d == "float32")
        assert scales == sum(-(-n // 256) for d, n, _ in moved if d == "int8")
        assert values + 4 * scales == sum(b for _, _, b in moved) < floats / 3, (moved, floats)


def _train(comm, zero, steps=6, **options):
    step = zero(_loss, optimizer=ops.adamw(1e-2), comm=comm,
                options=shard.ZeroOptions(**options))
    state, metrics = run_steps(step, _params(), [_batch(k) for k in range(steps)], comm)
    return [m["loss"] for m in metrics], shard.gather(state, comm)


def test_with_secondary_shards_the_quantized_hop_is_the_one_across_nodes():
    """hpZ (groups of 2 of 4 ranks) with qwZ: the gathers across groups move the
    int8 values and scales, the ones inside move the dequantized secondary
    shard, so the run is flat qwZ's bit for bit."""
    flat = shard.spawn(lambda c: _train(c, shard.zero3, steps=3, quantized_weights=True), 4)
    both = shard.spawn(lambda c: _train(c, shard.zero3, steps=3, quantized_weights=True,
                                        reshard_after_forward=2), 4)
    for (losses, params), (want_losses, want) in zip(both, flat, strict=True):
        assert losses == want_losses
        for a, b in zip(params, want, strict=True):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])


def test_training_with_quantized_gathers_keeps_exact_masters_and_follows_the_exact_run():
    def run(comm, quantized):
        step = shard.zero3(_loss, optimizer=ops.adamw(1e-2), comm=comm,
                           options=shard.ZeroOptions(quantized_weights=quantized))
        state, metrics = run_steps(step, _params(), [_batch(k) for k in range(6)], comm)
        return [m["loss"] for m in metrics], shard.gather(state, comm)

    exact = shard.spawn(lambda c: run(c, False), 3)
    quantized = shard.spawn(lambda c: run(c, True), 3)
    for (losses, params), (want_losses, want) in zip(quantized, exact, strict=True):
        assert params[0]["w"].dtype == np.float32  # the masters stay float32
        np.testing.assert_allclose(losses, want_losses, rtol=2e-2)
        assert losses != want_losses  # the forward saw quantized params
        np.testing.assert_allclose(params[1]["w"], want[1]["w"], atol=5e-3)
    assert all(q[0] == quantized[0][0] for q in quantized)  # every rank, the same losses


def test_what_quantized_gathers_do_not_compose_with_is_refused_by_name():
    def run(comm):
        errors = []
        for zero, kw in ((shard.zero1, {}), (shard.zero3, {"invariant_shards": 4}),
                         (shard.zero3, {})):
            quantized = "yes" if not kw and zero is shard.zero3 else True
            try:
                zero(_loss, optimizer=ops.adamw(1e-2), comm=comm,
                     options=shard.ZeroOptions(quantized_weights=quantized, **kw))
            except (TypeError, ValueError, NotImplementedError) as e:
                errors.append((type(e).__name__, str(e)))
        return errors

    errors = shard.spawn(run, 4)[0]
    assert [t for t, _ in errors] == ["ValueError", "NotImplementedError", "TypeError"]
    assert all("quantized_weights" in m for _, m in errors)
    assert "invariant_shards" in errors[1][1]


def test_quantized_gathers_of_device_state_equal_the_host_s(device):
    """On the device stand-in (CuPy's rules: no implicit copy to the host) the
    quantization runs the emulated CUDA kernels: the same losses as the host's."""
    import jax

    def run(comm, on_device):
        params = _params()
        if on_device:
            params = jax.tree.map(device.from_host, params)
        step = shard.zero3(_loss, optimizer=ops.adamw(1e-2), comm=comm,
                           options=shard.ZeroOptions(quantized_weights=True))
        _, metrics = run_steps(step, params, [_batch(k) for k in range(3)], comm)
        return [m["loss"] for m in metrics]

    host = shard.spawn(lambda c: run(c, False), 3)
    there = shard.spawn(lambda c: run(c, True), 3)
    np.testing.assert_allclose(there, host, rtol=1e-6)


def test_deepspeed_s_zero_quantized_weights_is_quantized_weights():
    config = {"train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    assert shard.from_deepspeed_config(config).quantized_weights is True
    config["zero_optimization"]["stage"] = 2
    with pytest.raises(ValueError, match="zero_quantized_weights=true below stage 3"):
        shard.from_deepspeed_config(config)
