"""A step's device operations, counted on the stand-in (``ops.testing.DEVICE_OPS``).

On a GPU every allocation, copy, kernel launch, collective, host read and
DLPack exchange costs a call into the driver. A unit's path through the step
costs the same whatever the number of leaves in it: these tests fail when an
operation per leaf comes back, and they pin what one more unit costs.
"""

from __future__ import annotations

import copy

import pytest
import torch

import interop.torch as it
import ops
import shard
from ops.testing import DEVICE_OPS, STANDIN, to_device

WIDTH = 8


class Block(torch.nn.Module):
    """One unit of ``linears`` linear layers (two leaves each)."""

    def __init__(self, linears: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(linears))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def counted(step, state, x, steps: int) -> dict:
    """This thread's device operations per step, by kind, after two warm-up steps."""
    for _ in range(2):
        state, _ = step(state, x)
    DEVICE_OPS.reset()
    for _ in range(steps):
        state, _ = step(state, x)
    return {k: v / steps for k, v in DEVICE_OPS.snapshot().items()}


def per_step(stage: int, world: int, *, units: int, linears: int = 1, steps: int = 2) -> list:
    """Each rank's device operations per step, by kind, after two warm-up steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(linears) for _ in range(units)])
    zero = (shard.zero0, shard.zero1, shard.zero2, shard.zero3)[stage]

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=lambda m, b: m(b).pow(2).mean())
        step = zero(fn, optimizer=ops.adamw(1e-3), comm=comm)
        return counted(step, step.init(to_device(params, STANDIN)), torch.ones(2, WIDTH), steps)

    return ops.spawn(run, world)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_device_operations_do_not_grow_with_a_units_leaves(stage, world):
    """Units of 2 leaves or of 6: the same operations, on every rank."""
    assert per_step(stage, world, units=3, linears=1) == per_step(stage, world, units=3,
                                                                  linears=3)


# What one more unit adds to a step, by kind. One rank: the state's own buffers
# are the whole params, bound once, and autograd sums each unit's gradients into
# the optimizer's buffers; stages 1-2 copy the new params into their compute
# copy (one copy a unit). Two ranks, stage 0: one all-reduce a unit, on the
# buffers the gradients were summed into. Stages 1-2: the gradients enter the
# reduce layout in one launch (its run table one transfer; stage 1's full
# gradient buffer allocated and zeroed), a reduce-scatter, and after the update
# an all-gather into a fresh buffer and one launch copying it out. Stage 3: two
# gathers a unit (forward and backward), each an allocation and an all-gather
# into it, a flat buffer and one launch copying into it, one DLPack exchange
# binding it; then the gradients' buffer, their run table and launch, and the
# reduce-scatter.
PER_UNIT = {
    (1, 0): {},
    (1, 1): {"copy": 1},
    (1, 2): {"copy": 1},
    (1, 3): {},
    (2, 0): {"collective": 1},
    (2, 1): {"alloc": 2, "copy": 2, "kernel": 2, "collective": 2},
    (2, 2): {"alloc": 2, "copy": 1, "kernel": 2, "collective": 2},
    (2, 3): {"alloc": 5, "copy": 1, "kernel": 3, "dlpack": 2, "collective": 3},
}


@pytest.mark.parametrize(("world", "stage"), sorted(PER_UNIT))
def test_what_one_more_unit_costs(world, stage):
    small, big = (per_step(stage, world, units=n)[0] for n in (2, 4))
    added = {k: (big[k] - small[k]) / 2 for k in big if big[k] != small[k]}
    assert added == PER_UNIT[(world, stage)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_sends_nothing_and_reads_nothing_back(stage):
    (ops_,) = per_step(stage, 1, units=3)
    assert ops_["collective"] == 0
    assert ops_["host_read"] == 0


def layered_per_step(world: int, *, units: int, leaves: int, steps: int = 2) -> dict:
    """Rank 0's device operations per step for a shard.Layered chain at stage 3:
    ``units`` layers whose params are ``leaves`` matrices each."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    params = [[rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.3
               for _ in range(leaves)] for _ in range(units)]

    def layer(p, h, batch):
        h = batch if h is None else h
        return jnp.tanh(sum(h @ w for w in p))

    def last(p, h, batch):
        return jnp.mean(layer(p, h, batch) ** 2)

    loss = shard.Layered([layer] * (units - 1) + [last])
    x = np.ones((2, WIDTH), np.float32)

    def run(comm):
        step = shard.zero3(loss, optimizer=ops.adamw(1e-3), comm=comm)
        return counted(step, step.init(to_device(params, STANDIN)), x, steps)

    return ops.spawn(run, world)[0]


@pytest.mark.parametrize("world", [1, 2])
def test_a_layered_units_operations_do_not_grow_with_its_leaves(world):
    """A JAX layer takes its unit's params as one flat buffer (one DLPack exchange
    a pass, sliced inside the compiled layer) and returns their gradient as one."""
    assert layered_per_step(world, units=3, leaves=1) == layered_per_step(world, units=3,
                                                                         leaves=3)


def test_what_one_more_layered_unit_costs_on_two_ranks():
    """Two gathers a unit (forward and backward), each an allocation and an
    all-gather into it, a flat buffer and one launch copying into it, and one
    DLPack exchange binding it; then the gradient (one DLPack exchange back),
    its buffer, run table and launch, and the reduce-scatter. The last unit stays gathered from its
    forward to its backward: a step's all-gathers are one fewer than twice its
    units (and one all-reduce averages the loss over the ranks)."""
    small, big = (layered_per_step(2, units=n, leaves=2) for n in (2, 4))
    added = {k: (big[k] - small[k]) / 2 for k in big if big[k] != small[k]}
    assert added == {"alloc": 5, "copy": 1, "kernel": 3, "dlpack": 3, "collective": 3}
    assert small["collective"] == (2 * 2 - 1) + 2 + 1  # all-gathers, reduce-scatters, loss
