"""Loss scaling, memory accounting, ZeRO-3's live units, specs and bad input."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import ops
import shard
from tests import zero_models as M

ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


def test_injected_inf_skips_exactly_that_step_and_backs_off_the_scale():
    scaling = shard.LossScale(initial=2.0**10, growth_interval=3)
    policy = shard.Precision(param_dtype=np.float16, reduce_dtype=np.float32)

    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm, precision=policy,
                           options=shard.ZeroOptions(loss_scale=scaling))
        state = step.init(M.init_params())
        log = []
        for i, b in enumerate(M.batches(6)):
            b = shard.split_batch(b, rank=comm.rank, world_size=comm.world_size)
            if i == 3 and comm.rank == 1:
                b["x"] = b["x"].copy()
                b["x"][0, 0] = np.inf
            before = shard.gather(state, comm)
            state, metrics = step(state, b)
            after = shard.gather(state, comm)
            unchanged = all(np.array_equal(x, y) for x, y in zip(
                jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after), strict=True))
            log.append((metrics["skipped"], metrics["loss_scale"], int(state.step), unchanged))
        return log

    for log in ops.spawn(run, 2):
        skipped = [s for s, *_ in log]
        assert skipped == [False, False, False, True, False, False]
        assert [c for *_, c, _ in log] == [1, 2, 3, 3, 4, 5]
        assert log[3][3] and not log[2][3] and not log[4][3]  # only the skipped step is a no-op
        scales = [s for _, s, _, _ in log]  # the scale each step used
        assert scales == [2.0**10, 2.0**10, 2.0**10, 2.0**11, 2.0**10, 2.0**10]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("mixed", [False, True])
def test_state_bytes_equal_estimate_memory(stage, world, mixed):
    policy = shard.Precision(param_dtype=ops.BF16) if mixed else None
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    M.init_params())
    estimate = shard.estimate_memory(shapes, stage=stage, world_size=world, policy=policy)

    def run(comm):
        return ZERO[stage](M.loss, optimizer=ops.adamw(M.LR), comm=comm,
                           precision=policy).init(M.init_params()).nbytes()

    for held in ops.spawn(run, world):
        assert held == {k: estimate[k] for k in held}
    assert estimate["total"] == sum(v for k, v in estimate.items() if k != "total")


def test_estimate_memory_follows_the_zero_formulas():
    n, w = 1_000_000 * 12, 8  # divisible: no padding
    params = {"w": jax.ShapeDtypeStruct((n,), np.float32)}
    bf16 = shard.Precision(param_dtype=ops.BF16)
    per = {s: shard.estimate_memory(params, stage=s, world_size=w, policy=bf16)["total"]
           for s in range(4)}
    assert per[0] == (4 + 8 + 2 + 2) * n  # DDP: everything whole
    assert per[1] == 2 * n + 2 * n + 12 * n // w  # P_os
    assert per[2] == 2 * n + (2 + 12) * n // w  # P_os+g
    assert per[3] == 16 * n // w  # P_os+g+p


def test_zero3_keeps_at_most_two_units_of_full_params_alive():
    """Measured: bytes of gathered units alive at once, over a whole layered step."""
    depth, width = 6, 64
    rng = np.random.default_rng(0)
    params = [{"w": rng.standard_normal((width, width)).astype(np.float32) * 0.1}
              for _ in range(depth)]

    def hidden(p, h, b):
        return jax.numpy.tanh((b["x"] if h is None else h) @ p["w"])

    def head(p, h, b):
        return jax.numpy.mean((h @ p["w"] - b["y"]) ** 2)

    loss = shard.Layered([hidden] * (depth - 1) + [head])
    unit_bytes = width * width * 4

    def run(comm):
        step = shard.zero3(loss, optimizer=ops.adamw(1e-3), comm=comm,
                           options=shard.ZeroOptions(prefetch=1))
        state = step.init(params)
        b = {"x": rng.standard_normal((8, width)).astype(np.float32),
             "y": rng.standard_normal((8, width)).astype(np.float32)}
        for _ in range(2):
            state, _ = step(state, b)
        return step.tracker.peak, step.tracker.live

    for peak, live in ops.spawn(run, 4):
        assert unit_bytes <= peak <= 2 * unit_bytes, peak / unit_bytes
        assert live == 0


def test_specs_prefixes_and_partition_specs():
    params = M.init_params()
    specs = [shard.Shard(0), {"w": shard.Shard(0), "b": shard.Replicate(),
                              "gain": shard.Shard(0)}]
    full = shard.core._specs.resolve_specs(params, specs)
    assert full[1]["b"] == shard.Replicate()
    assert full[1]["gain"] == shard.Replicate()  # a scalar has nothing to split
    assert full[0]["b"] == shard.Shard(0)
    assert repr(full[0]["w"]) == "Shard(0)" and hash(shard.Shard(0)) == hash(shard.Shard())
    assert shard.to_partition_spec(shard.Shard(0)) == PartitionSpec("dp")
    assert shard.from_partition_spec(PartitionSpec("dp", None)) == shard.Shard(0)
    assert shard.from_partition_spec(PartitionSpec()) == shard.Replicate()
    with pytest.raises(NotImplementedError, match="only sharding dim 0"):
        shard.from_partition_spec(PartitionSpec(None, "dp"))

    def run(comm):
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm, specs=specs)
        state = step.init(params)
        state, _ = step(state, shard.split_batch(M.batches(1)[0], rank=comm.rank,
                                                 world_size=comm.world_size))
        assert state.params[1]["b"].shape == (3,)  # replicated: whole on every rank
        assert state.params[0]["w"].shape == (4, 5)  # ceil(7 / 2) rows
        return "TrainState(stage 2" in state.describe()

    assert ops.spawn(run, 2) == [True, True]


def test_bad_input_names_the_path_and_the_fix():
    params = M.init_params()

    def run(comm):
        opt = ops.adamw(M.LR)
        with pytest.raises(ValueError, match="spec tree does not match"):
            shard.zero3(M.loss, optimizer=opt, comm=comm,
                        specs=[shard.Shard(0), {"missing": shard.Shard(0)}]).init(params)
        with pytest.raises(ValueError, match=r"batch\['x'\] has leading dimension 5"):
            shard.split_batch({"x": np.ones((5, 2))}, rank=0, world_size=2)
        with pytest.raises(TypeError, match=r"optimizer must be ops\.adamw"):
            shard.zero1(M.loss, optimizer=object(), comm=comm)
        with pytest.raises(ValueError, match="Layered has 1 layers but the params form 2 units"):
            shard.zero3(shard.Layered([M.layer0]), optimizer=opt, comm=comm).init(params)
        step3 = shard.zero3(M.loss, optimizer=opt, comm=comm)
        step2 = shard.zero2(M.loss, optimizer=opt, comm=comm)
        state3 = step3.init(params)
        step2.init(params)
        batch = shard.split_batch(M.batches(1)[0], rank=comm.rank, world_size=comm.world_size)
        with pytest.raises(ValueError, match=r"made for stage 3.*this step is stage 2"):
            step2(state3, batch)
        new, _ = step3(state3, batch)
        with pytest.raises(shard.DonatedStateError, match="use the state that step returned"):
            step3(state3, batch)
        with pytest.raises(shard.DonatedStateError):
            _ = state3.params
        return new.step.item()

    assert ops.spawn(run, 2) == [1, 1]

    def other_world(comm):
        return shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm).init(params)

    s2 = ops.spawn(other_world, 2)[0]

    def wrong_world(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        step.init(params)
        with pytest.raises(ValueError, match=r"rank 0 of 2 ranks, but this step is stage 3 on "
                                             r"rank \d of 3"):
            step(s2, {})
        return True

    ops.spawn(wrong_world, 3)


def test_ranks_with_different_params_are_refused_at_init():
    def run(comm):
        params = M.init_params()
        if comm.rank == 1:
            params[0]["w"] = np.ones((8, 5), np.float32)
        shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm).init(params)

    with pytest.raises(ValueError, match="built a different layout"):
        ops.spawn(run, 2)


def test_partition_gather_and_unpartition_round_trip():
    params = M.init_params()
    specs = [shard.Shard(0), {"w": shard.Shard(0), "b": shard.Replicate(),
                              "gain": shard.Replicate()}]
    pieces = [shard.partition(params, specs, rank=r, world_size=3) for r in range(3)]
    assert pieces[2][0]["w"].shape == (3, 5) and not pieces[2][0]["w"][1:].any()  # padding
    whole = shard.unpartition(pieces, params, specs)
    gathered = ops.spawn(lambda c: shard.gather(pieces[c.rank], c, specs=specs, like=params), 3)
    for tree in (whole, *gathered):
        for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(params),
                        strict=True):
            np.testing.assert_array_equal(a, b)


def test_float64_state_bytes_equal_estimate_memory():
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), M.init_params())
    for stage in (0, 3):
        est = shard.estimate_memory(params, stage=stage, world_size=2)

        def run(comm, stage=stage):
            return ZERO[stage](M.loss, optimizer=ops.adamw(M.LR), comm=comm).init(
                params).nbytes()

        for held in ops.spawn(run, 2):
            assert held == {k: est[k] for k in held}
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert shard.estimate_memory(params, stage=0, world_size=2)["optimizer"] == 16 * n


@pytest.mark.parametrize("world", [1, 3])
def test_layered_keeps_residuals_and_follows_the_recomputing_step(world):
    """A Layered loss keeps each layer's VJP residuals, less its inputs: the
    backward traces no layer again, and the trajectory is the recomputing
    one's (activation_checkpointing=True) to float rounding."""
    rng = np.random.default_rng(0)
    width = 16
    params = [{"w": rng.standard_normal((width, width)).astype(np.float32) * 0.3,
               "b": rng.standard_normal(width).astype(np.float32) * 0.1} for _ in range(3)]
    b = {"x": rng.standard_normal((6, width)).astype(np.float32),
         "y": rng.standard_normal((6, width)).astype(np.float32)}
    traced = []

    def hidden(p, h, batch):
        traced.append("hidden")
        return jax.numpy.tanh((batch["x"] if h is None else h) @ p["w"] + p["b"])

    def head(p, h, batch):
        traced.append("head")
        return jax.numpy.mean((h @ p["w"] + p["b"] - batch["y"]) ** 2)

    def train(checkpointing):
        loss = shard.Layered([hidden, hidden, head], activation_checkpointing=checkpointing)

        def run(comm):
            step = shard.zero3(loss, optimizer=ops.adamw(1e-2), comm=comm)
            state = step.init(params)
            part = shard.split_batch(b, rank=comm.rank, world_size=comm.world_size)
            for _ in range(3):
                state, _ = step(state, part)
            return shard.gather(state, comm)

        traced.clear()
        out = ops.spawn(run, world)[0]
        return out, sorted(set(traced)), len(traced)

    kept, names, kept_traces = train(False)
    recomputed, _, recompute_traces = train(True)
    assert names == ["head", "hidden"]
    assert kept_traces < recompute_traces  # the backward traced no layer's forward again
    for a, r in zip(kept, recomputed, strict=True):
        for k in a:
            np.testing.assert_allclose(a[k], r[k], rtol=1e-5, atol=1e-6, err_msg=k)
