"""What a step reads from a loss goes through one protocol
(``shard.core._protocol.LossProvider``, [Note: the loss protocol])."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import shard
from shard.core._protocol import LossProvider, Provided

ROOT = Path(__file__).resolve().parent.parent


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)


class BareLoss:
    """A user's loss object: value_and_grad and nothing else."""

    def __init__(self):
        self.calls = 0

    def value_and_grad(self, params, batch, loss_scale=1.0):
        self.calls += 1
        value, grads = jax.value_and_grad(lambda p: loss_scale * loss_fn(p, batch))(params)
        return value / loss_scale, grads


def _data():
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((5, 7)).astype(np.float32),
              "v": rng.standard_normal((7, 2)).astype(np.float32)}
    batches = [(rng.standard_normal((6, 5)).astype(np.float32),
                rng.standard_normal((6, 2)).astype(np.float32)) for _ in range(3)]
    return params, batches


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_bare_loss_object_trains_as_its_jax_function(stage):
    params, batches = _data()
    zero = [None, shard.zero1, shard.zero2, shard.zero3][stage]

    def run(comm, loss):
        step = zero(loss, optimizer=ops.adamw(1e-2), comm=comm)
        state = step.init(params)
        for b in batches:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank,
                                                     world_size=comm.world_size))
        return shard.gather(state, comm), step.config.loss_fn

    bare = BareLoss()
    got = ops.spawn(lambda c: run(c, bare), 3)  # 3 ranks: neither 5, 7 nor 2 divides
    want = ops.spawn(lambda c: run(c, loss_fn), 3)
    for (g, wrapped), (w, _) in zip(got, want, strict=True):
        assert isinstance(wrapped, Provided) and wrapped.obj is bare
        for k in params:
            np.testing.assert_allclose(g[k], w[k], rtol=1e-6, atol=1e-7)
    assert bare.calls == 3 * len(batches)


def test_defaults_are_those_of_a_plain_function():
    p = LossProvider()
    assert (p.norm_comm, p.data_axis, p.units, p.frozen, p.tensor_parallel) == (None,) * 5
    assert (p.run_units, p.loss_units, p.materialize, p.module_state) == (None,) * 4
    assert p.hooks_usable(None) and not p.reports_missing and p.norm_skip == ()
    with pytest.raises(NotImplementedError, match="LossProvider runs unit by unit"):
        p.value_and_grad({}, None)


def _probes(path: Path) -> list[str]:
    """``hasattr(x, ...)`` / ``getattr(x, ...)`` calls whose object is a loss."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr") and node.args):
            target = ast.unparse(node.args[0])
            if "loss" in target and not target.startswith(("x", "leaf")):
                found.append(f"{path.relative_to(ROOT)}: {ast.unparse(node)}")
    return found


def test_the_step_reads_a_loss_through_the_protocol_alone():
    """No capability probing of a loss object in ``shard/`` but at the door:
    ``classify`` decides what kind of loss it is."""
    probes = [p for path in sorted((ROOT / "shard").rglob("*.py")) for p in _probes(path)]
    assert probes == ["shard/core/losses/_jax.py: getattr(loss_fn, 'value_and_grad', None)"]
