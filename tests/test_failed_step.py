"""Nothing lost on a failed step: an exception anywhere in a step (the loss, the
learning-rate schedule, a batch that does not fit) leaves the state passed in
valid and unchanged, and the next step equals one that never saw the failure."""

from __future__ import annotations

import copy
import math

import jax
import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard
from tests import test_interop_torch as T
from tests import zero_models as M

ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


def part(batch, comm):
    return shard.split_batch(batch, rank=comm.rank, world_size=comm.world_size)


def snapshot(state):
    return [np.array(x) for x in state.master + state.exp_avg + state.exp_avg_sq + state.compute]


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def train(comm, stage, loss_fn, batches, fail_at=None, failing=None, **kw):
    """Steps over ``batches``; before step ``fail_at``, one step that raises
    (``failing(step, state)``), after which the same state goes on."""
    step = ZERO[stage](loss_fn, comm=comm, **{"optimizer": ops.adamw(M.LR), **kw})
    state = step.init(M.init_params())
    errors = []
    for i, b in enumerate(batches):
        if i == fail_at:
            before = snapshot(state)
            try:
                failing(step, state)
            except Exception as e:  # every rank fails alike
                errors.append(type(e).__name__)
            assert_same(snapshot(state), before)
        state, _ = step(state, part(b, comm))
    return [np.array(x) for x in jax.tree_util.tree_leaves(shard.gather(state, comm))], errors


@pytest.mark.parametrize("loss_fn", [M.loss, M.LAYERED], ids=["jax", "layered"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_loss_that_raises_loses_nothing(stage, loss_fn):
    batches = M.batches(3)
    bad = {"x": np.ones((12, 4), np.float32), "y": np.ones((12, 3), np.float32)}  # 4 != 7

    def failing(step, state):
        step(state, bad)

    def run(comm):
        want, _ = train(comm, stage, loss_fn, batches)
        got, errors = train(comm, stage, loss_fn, batches, fail_at=1, failing=failing)
        assert errors == ["TypeError"], errors
        assert_same(got, want)

    ops.spawn(run, 2)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_schedule_that_gives_nan_is_refused_before_the_step(stage):
    batches = M.batches(3)

    def run(comm):
        broken = [False]

        def lr(count):
            return math.nan if broken[0] else M.LR

        def failing(step, state):
            broken[0] = True
            try:
                step(state, part(batches[1], comm))
            finally:
                broken[0] = False

        want, _ = train(comm, stage, M.loss, batches)
        got, errors = train(comm, stage, M.loss, batches, fail_at=1, failing=failing,
                            optimizer=ops.adamw(lr))
        assert errors == ["ValueError"]
        assert_same(got, want)

    ops.spawn(run, 2)


def test_the_schedule_error_names_the_step_and_the_value():
    comm = ops.spawn(lambda c: c, 1)[0]
    step = shard.zero2(M.loss, optimizer=ops.adamw(lambda c: -1.0 if c == 1 else M.LR),
                       comm=comm)
    state, _ = step(step.init(M.init_params()), M.batches(1)[0])
    with pytest.raises(ValueError, match=r"learning-rate schedule gave -1.0 at step 1"):
        step(state, M.batches(1)[0])
    state.check_live()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_torch_forward_that_raises_loses_nothing(stage):
    batches = T.data(3)
    model = T.built(T.MLP)

    def run(comm):
        def train_torch(fail):
            raising = [False]

            def loss(m, b):
                if raising[0]:
                    raise RuntimeError("planted")
                return T.mse(m, b)

            params, fn = it.functional(copy.deepcopy(model), loss=loss)
            step = ZERO[stage](fn, optimizer=ops.adamw(M.LR), comm=comm)
            state = step.init(params)
            n = batches[0][0].shape[0] // comm.world_size
            for i, b in enumerate(batches):
                mine = tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b)
                if fail and i == 1:
                    before = snapshot(state)
                    raising[0] = True
                    with pytest.raises(RuntimeError, match="planted"):
                        step(state, mine)
                    raising[0] = False
                    assert_same(snapshot(state), before)
                state, _ = step(state, mine)
            return {k: np.array(v) for k, v in shard.gather(state, comm).items()}

        want, got = train_torch(False), train_torch(True)
        assert want.keys() == got.keys()
        assert_same(list(got.values()), list(want.values()))

    torch.manual_seed(0)
    ops.spawn(run, 2)
