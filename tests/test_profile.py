"""shard.profile: the per-step time breakdown ([Note: step profile])."""

from __future__ import annotations

import copy
import time

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard


def torch_run(comm, model, steps, profiled):
    params, fn = it.functional(copy.deepcopy(model), loss=lambda m, b: m(b).pow(2).mean())
    step = shard.zero3(fn, optimizer=ops.adamw(1e-3), comm=comm)
    state = step.init(params)
    x = torch.ones(4, 16)
    walls = []
    with shard.profile() as prof:
        if not profiled:
            prof = None
        for _ in range(steps):
            t0 = time.perf_counter()
            state, _ = step(state, x)
            walls.append(time.perf_counter() - t0)
    return prof, sum(walls)


def test_categories_add_up_to_the_step_time_and_name_the_phases():
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    prof, wall = ops.spawn(lambda c: torch_run(c, model, 3, True), 2)[0]
    assert prof.steps == 3
    ms = prof.ms_per_step()
    for k in ("forward", "backward", "optimizer", "library"):
        assert ms[k] > 0, (k, ms)
    assert ms["compute"] == 0  # a torch module's forward and backward are told apart
    total = prof.total_ms() * prof.steps / 1e3
    assert total == pytest.approx(wall, rel=0.02, abs=1e-3)
    assert "forward" in prof.table() and "step" in prof.table()


def test_profiles_are_per_thread_and_off_outside_the_block():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    profs = ops.spawn(lambda c: torch_run(c, model, 2, c.rank == 0)[0], 2)
    assert profs[0].steps == 2 and profs[1] is None
    with shard.profile() as outer:
        pass
    ops.spawn(lambda c: torch_run(c, model, 1, False), 1)
    assert outer.steps == 0 and outer.total_ms() == 0


def test_jax_losses_report_compute_or_forward_and_backward():
    comm = ops.spawn(lambda c: c, 1)[0]
    params = [{"w": np.full((3, 3), 0.5, np.float32)} for _ in range(2)]
    layered = shard.Layered([lambda p, _, b: jnp.tanh(b @ p["w"]),
                             lambda p, h, b: jnp.mean((h @ p["w"]) ** 2)])
    batch = np.ones((2, 3), np.float32)
    for loss, phases in ((layered, ("forward", "backward")),
                         (lambda p, b: jnp.sum((b @ p[0]["w"]) ** 2), ("compute",))):
        step = shard.zero3(loss, optimizer=ops.adamw(1e-3), comm=comm)
        state = step.init(params)
        with shard.profile() as prof:
            state, _ = step(state, batch)
        ms = prof.ms_per_step()
        assert all(ms[k] > 0 for k in phases), ms
        assert all(ms[k] == 0 for k in ("forward", "backward", "compute") if k not in phases)
