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


def per_step(stage: int, world: int, *, units: int, linears: int = 1, steps: int = 2) -> list:
    """Each rank's device operations per step, by kind, after two warm-up steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(linears) for _ in range(units)])
    zero = (shard.zero0, shard.zero1, shard.zero2, shard.zero3)[stage]

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=lambda m, b: m(b).pow(2).mean())
        step = zero(fn, optimizer=ops.adamw(1e-3), comm=comm)
        state = step.init(to_device(params, STANDIN))
        x = torch.ones(2, WIDTH)
        for _ in range(2):
            state, _ = step(state, x)
        DEVICE_OPS.reset()
        for _ in range(steps):
            state, _ = step(state, x)
        return {k: v / steps for k, v in DEVICE_OPS.snapshot().items()}

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
