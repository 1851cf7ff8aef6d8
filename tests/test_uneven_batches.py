"""Micro-batches of unequal rows give the update of their concatenation (the
``MicroBatches`` docstring's promise), for JAX losses and torch modules."""

from __future__ import annotations

import copy

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


def rows(batch, lo, hi):
    return jax.tree_util.tree_map(lambda x: x[lo:hi], batch)


@pytest.mark.parametrize("loss_fn", [M.loss, M.LAYERED], ids=["jax", "layered"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_micro_batches_of_3_and_1_rows_step_as_their_4_rows(stage, loss_fn):
    batch = M.batches(1, global_batch=8)[0]

    def run(comm, split):
        step = ZERO[stage](loss_fn, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(M.init_params())
        mine = shard.split_batch(batch, rank=comm.rank, world_size=comm.world_size)  # 4 rows
        b = shard.MicroBatches([rows(mine, 0, 3), rows(mine, 3, 4)]) if split else mine
        state, metrics = step(state, b)
        return ([np.array(x) for x in jax.tree_util.tree_leaves(shard.gather(state, comm))],
                float(metrics["loss"]), float(metrics["grad_norm"]))

    for (want, loss, norm), (got, loss2, norm2) in zip(
            ops.spawn(lambda c: run(c, False), 2), ops.spawn(lambda c: run(c, True), 2),
            strict=True):
        np.testing.assert_allclose(loss2, loss, rtol=1e-6)
        np.testing.assert_allclose(norm2, norm, rtol=1e-5)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 3])
def test_torch_micro_batches_of_unequal_rows(stage):
    (x, y), = T.data(1, n=8)
    model = T.built(T.MLP)

    def run(comm, split):
        params, fn = it.functional(copy.deepcopy(model), loss=T.mse)
        step = ZERO[stage](fn, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(params)
        mx, my = x[comm.rank * 4:(comm.rank + 1) * 4], y[comm.rank * 4:(comm.rank + 1) * 4]
        b = shard.MicroBatches([(mx[:1], my[:1]), (mx[1:], my[1:])]) if split else (mx, my)
        state, metrics = step(state, b)
        return shard.gather(state, comm), float(metrics["loss"])

    (want, loss), (got, loss2) = ops.spawn(lambda c: run(c, False), 2)[0], ops.spawn(
        lambda c: run(c, True), 2)[0]
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_equal_micro_batches_are_unchanged():
    """Equal rows: no weights, the same arithmetic as before (bit for bit)."""
    from shard.step._checks import weights

    b = M.batches(1, global_batch=8)[0]
    assert weights([rows(b, 0, 4), rows(b, 4, 8)]) is None
    assert weights([rows(b, 0, 3), rows(b, 3, 4)]) == [1.5, 0.5]
    assert weights([{"x": np.ones((3, 2)), "y": np.ones((2, 2))}, {"x": np.ones(1)}]) is None


# -- ranks with unequal rows ----------------------------------------------------------

CUTS = {2: [0, 6, 8], 3: [0, 5, 7, 8]}


def whole_batch_reference(batches, **kwargs):
    """One rank stepping on each whole batch: the update the ranks' parts should give."""
    def run(comm):
        step = shard.zero0(M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm,
                           options=shard.ZeroOptions(**kwargs))
        state = step.init(M.init_params())
        losses = []
        for b in batches:
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        return shard.gather(state, comm), losses

    return ops.spawn(run, 1)[0]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ranks_with_unequal_rows_weighted_by_rows_step_as_the_whole_batch(stage, world):
    batches = M.batches(3, global_batch=8)
    want, want_losses = whole_batch_reference(batches)
    cut = CUTS[world]

    def run(comm):
        step = ZERO[stage](M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm,
                           options=shard.ZeroOptions(weight_by_rows=True))
        state = step.init(M.init_params())
        losses = []
        for b in batches:
            state, metrics = step(state, rows(b, cut[comm.rank], cut[comm.rank + 1]))
            losses.append(float(metrics["loss"]))
        want_shards = shard.partition(want, rank=comm.rank if stage else 0,
                                      world_size=world if stage else 1)
        for got, ref in zip(jax.tree_util.tree_leaves(state.params),
                            jax.tree_util.tree_leaves(want_shards), strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        return losses

    for losses in ops.spawn(run, world):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def test_unequal_ranks_and_micro_batches_with_clipping_and_loss_scaling():
    """Rank 0 gives micro-batches of 4 and 2 rows, rank 1 two of 1: the whole
    batch's update, through the step's host read (clipping, a loss scale)."""
    kwargs = {"clip_norm": 0.05, "loss_scale": shard.LossScale(initial=2.0 ** 8)}
    batches = M.batches(3, global_batch=8)
    want, want_losses = whole_batch_reference(batches, **kwargs)

    def run(comm):
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm,
                           options=shard.ZeroOptions(weight_by_rows=True, **kwargs))
        state = step.init(M.init_params())
        losses = []
        for b in batches:
            mine = shard.MicroBatches([rows(b, 0, 4), rows(b, 4, 6)] if comm.rank == 0
                                      else [rows(b, 6, 7), rows(b, 7, 8)])
            state, metrics = step(state, mine)
            losses.append(float(metrics["loss"]))
        return shard.gather(state, comm), losses

    got, losses = ops.spawn(run, 2)[0]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_torch_ranks_with_unequal_rows_weighted_by_rows():
    (x, y), = T.data(1, n=8)
    model = T.built(T.MLP)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=M.LR, weight_decay=0.0)
    opt.zero_grad()
    T.mse(ref, (x, y)).backward()
    opt.step()
    want = {k: v.detach().numpy() for k, v in ref.named_parameters()}

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=T.mse)
        step = shard.zero3(fn, optimizer=ops.adamw(M.LR, weight_decay=0.0), comm=comm,
                           options=shard.ZeroOptions(weight_by_rows=True))
        state = step.init(params)
        lo, hi = [0, 7, 8][comm.rank], [0, 7, 8][comm.rank + 1]
        state, _ = step(state, (x[lo:hi], y[lo:hi]))
        return shard.gather(state, comm)

    got = ops.spawn(run, 2)[0]
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_weighted_ranks_on_device_state(device):
    batches = M.batches(2, global_batch=8)
    want, _ = whole_batch_reference(batches)

    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm,
                           options=shard.ZeroOptions(weight_by_rows=True))
        state = step.init(jax.tree_util.tree_map(device.asarray, M.init_params()))
        for b in batches:
            state, _ = step(state, rows(b, [0, 6, 8][comm.rank], [0, 6, 8][comm.rank + 1]))
        return jax.tree_util.tree_map(device.to_host, shard.gather(state, comm))

    got = ops.spawn(run, 2)[0]
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_unequal_ranks_without_weighting_are_warned_about_once(caplog):
    batches = M.batches(3, global_batch=8)

    def run(comm, cut):
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(M.init_params())
        for b in batches:
            state, metrics = step(state, rows(b, cut[comm.rank], cut[comm.rank + 1]))
            float(metrics["loss"])

    with caplog.at_level("WARNING", logger="shard.step"):
        ops.spawn(lambda c: run(c, [0, 4, 8]), 2)
    assert "different numbers of rows" not in caplog.text
    with caplog.at_level("WARNING", logger="shard.step"):
        ops.spawn(lambda c: run(c, [0, 6, 8]), 2)
    warned = [r for r in caplog.records if "different numbers of rows" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]  # rank 0, once
    assert "8 rows over 2 ranks" in warned[0].getMessage()
    assert "weight_by_rows=True" in warned[0].getMessage()


def test_weight_by_rows_misuse_is_named():
    with pytest.raises(TypeError, match="weight_by_rows must be True or False"):
        shard.zero2(M.loss, optimizer=ops.adam(M.LR), comm=ops.spawn(lambda c: c, 1)[0],
                    options=shard.ZeroOptions(weight_by_rows="yes"))

    def uncountable(comm):
        step = shard.zero2(M.loss, optimizer=ops.adam(M.LR), comm=comm,
                           options=shard.ZeroOptions(weight_by_rows=True))
        state = step.init(M.init_params())
        b = M.batches(1, global_batch=8)[0]
        step(state, {"x": b["x"], "y": b["y"][:4]})

    with pytest.raises(ValueError, match=r"weight_by_rows.*batch\['x'\] has 8 rows but "
                                         r"batch\['y'\] 4"):
        ops.spawn(uncountable, 1)


def test_weighted_ranks_with_16_bit_gradients():
    """bf16 gradients are multiplied by the rows' correction in float32 and
    rounded once: the whole batch's update to bf16's precision (a mean of
    the ranks' means is 30 times further off here)."""
    prec = shard.Precision(param_dtype=ops.BF16, reduce_dtype=ops.BF16)
    batches = M.batches(3, global_batch=8)

    def reference(comm):
        step = shard.zero0(M.loss, optimizer=ops.adamw(M.LR), comm=comm, precision=prec)
        state = step.init(M.init_params())
        for b in batches:
            state, _ = step(state, b)
        return shard.gather(state, comm)

    def run(comm):
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm, precision=prec,
                           options=shard.ZeroOptions(weight_by_rows=True))
        state = step.init(M.init_params())
        for b in batches:
            state, _ = step(state, rows(b, [0, 6, 8][comm.rank], [0, 6, 8][comm.rank + 1]))
        assert state.meta.compute_dtype == "bfloat16"
        return shard.gather(state, comm)

    want, got = ops.spawn(reference, 1)[0], ops.spawn(run, 2)[0]
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   atol=2e-3)
