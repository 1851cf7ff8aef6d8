"""Model FLOPs and utilisation in a step's metrics (see [Note: model FLOPs]),
against a count by hand: a two-layer perceptron's matrix products, ``2 m k n``
each, forward and backward (no gradient for the input)."""

from __future__ import annotations

import csv

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard
from tests import zero_models as M

D, H, OUT = 64, 96, 32


def by_hand(rows):
    """x @ w1 (forward, and w1's gradient), tanh, @ w2 (forward, w2's gradient
    and the hidden layer's)."""
    return 4 * rows * D * H + 6 * rows * H * OUT


rng = np.random.default_rng(0)
PARAMS = {"w1": rng.standard_normal((D, H)).astype(np.float32) * 0.1,
          "w2": rng.standard_normal((H, OUT)).astype(np.float32) * 0.1}


def mlp(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)


def batch(rows, seed=1):
    r = np.random.default_rng(seed)
    return {"x": r.standard_normal((rows, D)).astype(np.float32),
            "y": r.standard_normal((rows, OUT)).astype(np.float32)}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_jax_loss_s_flops_and_mfu_match_a_count_by_hand(stage, tmp_path):
    """2 ranks, 2 micro-batches of 12 rows each per rank: XLA's count of the
    program is the matrix products' and a little elementwise work."""
    peak = 1e9

    def run(comm):
        log = shard.CSVLogger(tmp_path / "m.csv")
        step = (shard.zero1, shard.zero3)[stage // 3](
            mlp, optimizer=ops.adamw(1e-3), comm=comm,
            options=shard.ZeroOptions(peak_flops=peak, loggers=[log]))
        state = step.init(PARAMS)
        out = []
        for i in range(2):
            micro = shard.MicroBatches([batch(12, seed=10 * i + j) for j in range(2)])
            state, m = step(state, micro)
            out.append((m["flops"], m["flops_per_s"], m["mfu"], m["time_ms"]["step"]))
        log.close()
        return out

    for flops, per_s, mfu, ms in ops.spawn(run, 2)[0]:
        assert 1.0 <= flops / (2 * by_hand(12)) < 1.02
        assert per_s == pytest.approx(flops / (ms / 1e3), rel=1e-9)
        assert mfu == pytest.approx(per_s / peak, rel=1e-12)
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert [float(r["flops"]) for r in rows] == [flops] * 2
    assert {"flops_per_s", "mfu"} <= set(rows[0])


def test_a_torch_module_s_flops_are_torch_s_count_of_its_products():
    model = torch.nn.Sequential(torch.nn.Linear(D, H, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(H, OUT, bias=False))

    def run(comm):
        import copy

        params, loss = it.functional(copy.deepcopy(model),
                                     loss=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        step = shard.zero3(loss, optimizer=ops.adamw(1e-3), comm=comm,
                           options=shard.ZeroOptions(count_flops=True))
        state = step.init(params)
        got = []
        for rows in (8, 8, 16):  # counted for 8 rows, then kept; again for 16
            b = batch(rows)
            state, m = step(state, (torch.from_numpy(b["x"]), torch.from_numpy(b["y"])))
            got.append(m["flops"])
            assert "mfu" not in m
        return got

    for got in ops.spawn(run, 2):
        assert got == [by_hand(8), by_hand(8), by_hand(16)]


def test_what_cannot_be_counted_is_refused_by_name():
    def run(comm):
        with pytest.raises(NotImplementedError, match=r"counting FLOPs is built for a JAX loss "
                                                      r"function and interop\.torch"):
            shard.zero3(M.LAYERED, optimizer=ops.adamw(1e-3), comm=comm,
                        options=shard.ZeroOptions(count_flops=True))
        with pytest.raises(ValueError, match="peak_flops must be a FLOP/s > 0"):
            shard.zero3(mlp, optimizer=ops.adamw(1e-3), comm=comm,
                        options=shard.ZeroOptions(peak_flops=0.0))
        step = shard.zero3(mlp, optimizer=ops.adamw(1e-3), comm=comm)
        _, m = step(step.init(PARAMS), batch(4))
        assert "flops" not in m  # off unless asked for

    ops.spawn(run, 1)
