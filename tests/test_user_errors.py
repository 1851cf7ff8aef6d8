"""What a new user tries first: each either does what they meant or raises a
typed error naming the argument, leaf or rank, before any state changes."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard


def one_comm():
    return ops.spawn(lambda c: c, 1)[0]


def torch_train(batches, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params, fn = it.functional(copy.deepcopy(model), loss=lambda m, b: ((m(b[0]) - b[1]) ** 2)
                               .mean())
    step = shard.zero2(fn, optimizer=ops.adamw(1e-2), comm=one_comm())
    state = step.init(params)
    for _ in range(steps):
        state, metrics = step(state, batches)
    return shard.gather(state, step.comm), metrics


def test_a_list_batch_is_one_micro_batch_and_accumulation_is_explicit():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)
    as_tuple, m1 = torch_train((x, y))
    as_list, m2 = torch_train([x, y])  # a DataLoader's batch
    for k in as_tuple:
        np.testing.assert_array_equal(as_list[k], as_tuple[k])
    assert m1["loss"] == m2["loss"]
    halves = shard.MicroBatches([(x[:2], y[:2]), (x[2:], y[2:])])
    accumulated, m3 = torch_train(halves)
    for k in as_tuple:
        np.testing.assert_allclose(accumulated[k], as_tuple[k], rtol=1e-6, atol=1e-7)
    assert m3["loss"] == pytest.approx(m1["loss"], rel=1e-6)
    with pytest.raises(ValueError, match="no micro-batches"):
        shard.MicroBatches([])
    with pytest.raises(TypeError, match="iterable of batches"):
        shard.MicroBatches({"x": x})


def test_split_batch_keeps_torch_tensors():
    batch = {"x": torch.arange(12.0).reshape(6, 2), "n": np.arange(6)}
    part = shard.split_batch(batch, rank=1, world_size=3)
    assert isinstance(part["x"], torch.Tensor) and part["x"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert isinstance(part["n"], np.ndarray) and part["n"].tolist() == [2, 3]


@pytest.mark.multiprocess
def test_interop_submodules_after_a_bare_import():
    code = "import interop; print(interop.torch.functional.__name__, interop.jax.mesh.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["functional", "mesh"]


@pytest.mark.parametrize("kwargs, error, name", [
    ({"learning_rate": "1e-3"}, TypeError, "learning_rate"),
    ({"learning_rate": None}, TypeError, "learning_rate"),
    ({"learning_rate": -1.0}, ValueError, "learning_rate"),
    ({"learning_rate": 1e-3, "b1": 2.0}, ValueError, "b1"),
    ({"learning_rate": 1e-3, "b2": 1.0}, ValueError, "b2"),
    ({"learning_rate": 1e-3, "eps": float("nan")}, ValueError, "eps"),
    ({"learning_rate": 1e-3, "weight_decay": -0.1}, ValueError, "weight_decay"),
])
def test_optimizer_arguments_are_checked_at_construction(kwargs, error, name):
    for make in (ops.adamw, ops.adam):
        with pytest.raises(error, match=name):
            make(**kwargs)


def test_optimizer_accepts_numpy_scalars_and_schedules():
    assert ops.adamw(np.float32(1e-3)).learning_rate(0) == pytest.approx(1e-3)
    assert ops.adamw(lambda count: 0.1 / (1 + count)).learning_rate(1) == pytest.approx(0.05)


def test_gather_of_bare_shards_needs_the_full_shapes():
    params = {"w": np.arange(14.0, dtype=np.float32).reshape(7, 2)}

    def run(comm, stage):
        step = (shard.zero0, shard.zero3)[stage // 3](
            lambda p, b: (p["w"] ** 2).sum(), optimizer=ops.adamw(1e-3), comm=comm)
        state = step.init(params)
        with pytest.raises(TypeError, match="gather\\(state, comm\\)"):
            shard.gather(state.params, comm)
        if stage == 0:  # whole params are not shards of a (7, 2) leaf on 2 ranks
            with pytest.raises(ValueError, match=r"shard \['w'\] has shape \(7, 2\)"):
                shard.gather(state.params, comm, like=params)
        else:
            np.testing.assert_array_equal(shard.gather(state.params, comm, like=params)["w"],
                                          params["w"])
        return shard.gather(state, comm)["w"].shape

    for stage in (0, 3):
        assert ops.spawn(lambda c, s=stage: run(c, s), 2) == [(7, 2), (7, 2)]


def test_load_on_a_fresh_step_takes_shapes_from_the_manifest(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    loss = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    x = torch.randn(6, 5)

    def train(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=loss)
        step = shard.zero3(fn, optimizer=ops.adamw(1e-2), comm=comm)
        state = step.init(params)
        state, _ = step(state, x)
        shard.save(state, tmp_path / "ckpt", comm=comm)
        return shard.gather(state, comm)

    want = ops.spawn(train, 2)[0]

    def resume(comm):
        _, fn = it.functional(copy.deepcopy(model), loss=loss)
        step = shard.zero2(fn, optimizer=ops.adamw(1e-2), comm=comm)
        state, _ = shard.load(tmp_path / "ckpt", step, comm=comm)
        got = shard.gather(state, comm)
        state, metrics = step(state, x)  # and it trains on
        return got, metrics["skipped"]

    for got, skipped in ops.spawn(resume, 3):
        assert set(got) == set(want) and not skipped
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_a_failed_load_leaves_the_step_and_its_state_usable(tmp_path):
    params = {"w": np.ones((5, 3), np.float32)}
    loss = lambda p, b: (p["w"] ** 2).sum()  # noqa: E731
    comm = one_comm()
    step = shard.zero3(loss, optimizer=ops.adamw(1e-2), comm=comm)
    state = step.init(params)
    shard.save(state, tmp_path / "ckpt", comm=comm)
    layout = step.layout
    with pytest.raises(shard.CheckpointError, match="shape"):
        shard.load(tmp_path / "ckpt", step, comm=comm, like={"w": np.ones((4, 3), np.float32)})
    assert step.layout is layout
    state, metrics = step(state, None)
    assert metrics["loss"] == 15.0


@pytest.mark.parametrize("bad, error, match", [
    ({"w": np.ones(3, np.int64)}, TypeError, r"params\['w'\] is int64"),
    ({"w": np.ones(3, bool)}, TypeError, r"params\['w'\] is bool"),
    ({"w": np.ones(3, np.complex64)}, TypeError, r"params\['w'\] is complex64"),
    ({}, ValueError, "no leaves"),
])
def test_non_float_and_empty_params_are_refused_at_init(bad, error, match):
    step = shard.zero3(lambda p, b: 0.0, optimizer=ops.adamw(1e-3), comm=one_comm())
    with pytest.raises(error, match=match):
        step.init(bad)
    assert step.layout is None


def test_an_empty_batch_is_refused_before_the_state_changes():
    step = shard.zero2(lambda p, b: ((b @ p["w"]) ** 2).mean(), optimizer=ops.adamw(1e-3),
                       comm=one_comm())
    state = step.init({"w": np.ones((3, 2), np.float32)})
    with pytest.raises(ValueError, match=r"batch has no rows \(shape \(0, 3\)\) on rank 0"):
        step(state, np.ones((0, 3), np.float32))
    state, metrics = step(state, np.ones((2, 3), np.float32))  # not donated by the failure
    assert metrics["loss"] == 9.0


@pytest.mark.parametrize("clip", [None, 1.0], ids=["plain", "clipped"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_non_finite_gradients_skip_the_step_the_same_way(stage, clip, caplog):
    import jax.numpy as jnp

    zero = (shard.zero0, shard.zero1, shard.zero2, shard.zero3)[stage]

    def loss(p, b):
        return jnp.sum(p["w"] * b)

    def run(comm):
        step = zero(loss, optimizer=ops.adamw(1e-1), comm=comm, clip_norm=clip)
        state = step.init({"w": np.ones(5, np.float32)})
        bad = np.full(5, np.nan if comm.rank == 1 else 1.0, np.float32)  # one rank only
        state, metrics = step(state, bad)
        return shard.gather(state, comm)["w"], metrics["skipped"]

    for w, skipped in ops.spawn(run, 2):
        assert skipped is True
        np.testing.assert_array_equal(w, np.ones(5, np.float32))
    assert "non-finite gradients" in caplog.text


def test_one_torch_loss_object_shared_by_thread_ranks_is_refused():
    model = torch.nn.Linear(3, 2)
    params, fn = it.functional(model, loss=lambda m, b: m(b).sum())

    def run(comm):
        step = shard.zero3(fn, optimizer=ops.adamw(1e-3), comm=comm)
        step.init(params)

    with pytest.raises(ValueError, match=r"belongs to rank \d, and rank \d uses it too"):
        ops.spawn(run, 2, timeout=30)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_precision_casts_a_torch_modules_inputs(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(5, 6)
    zero = (shard.zero2, shard.zero3)[stage - 2]

    def run(comm, precision):
        params, fn = it.functional(copy.deepcopy(model), loss=lambda m, b: m(b).pow(2).mean())
        step = zero(fn, optimizer=ops.adamw(1e-2), comm=comm, precision=precision)
        state = step.init(params)
        losses = []
        for _ in range(3):
            state, metrics = step(state, x)  # float32 input, bf16 params
            losses.append(metrics["loss"])
        return losses

    want = ops.spawn(lambda c: run(c, None), 2)[0]
    for precision in (shard.Precision(param_dtype=torch.bfloat16), shard.Precision("bf16")):
        got = ops.spawn(lambda c, p=precision: run(c, p), 2)[0]
        np.testing.assert_allclose(got, want, rtol=3e-2)
    with pytest.raises(TypeError, match="param_dtype must be"):
        shard.Precision(param_dtype=torch.int32)


def test_16_bit_params_compute_in_their_dtype_with_fp32_masters():
    import jax.numpy as jnp

    from ops import BF16

    seen = []

    def loss(p, b):
        seen.append(p["w"].dtype)
        return jnp.sum(p["w"].astype(jnp.float32) ** 2)

    step = shard.zero2(loss, optimizer=ops.adamw(1e-2), comm=one_comm())
    state = step.init({"w": np.ones((4, 2), BF16)})
    state, metrics = step(state, None)
    assert seen == [jnp.bfloat16] and metrics["loss"] == 8.0
    assert state.meta.compute_dtype == "bfloat16" and state.meta.master_dtype == "float32"
    with pytest.raises(ValueError, match=r"mix dtypes \['bfloat16', 'float32'\]"):
        step.init({"w": np.ones(2, BF16), "b": np.ones(2, np.float32)})
    state = step.init({"w": np.ones(3, np.float32)})  # fp32 params again: fp32 compute
    assert state.meta.compute_dtype == "float32"


def test_train_state_repr_is_short_and_describe_shows_padding():
    import jax.numpy as jnp

    def run(comm):
        step = shard.zero3(lambda p, b: jnp.sum(p["w"] ** 2), optimizer=ops.adamw(1e-3),
                           comm=comm)
        state = step.init({"w": np.ones((7, 300), np.float32), "b": np.ones(5, np.float32)})
        text = (repr(state), state.describe(), state.padding())
        step(state, None)
        return (*text, repr(state))

    short, table, padding, donated = ops.spawn(run, 2)[1]
    assert len(short) < 200 and "rank 1 of 2" in short and "14.1 KiB" in short
    assert padding == [1, 300]  # rank 1 holds rows 4-6 of w's 7 (and 1 padding row) and of b
    assert "padding" in table and table.splitlines()[3].split()[-1] == "300"
    assert donated.startswith("TrainState(donated")


def test_a_save_only_rank_0_calls_fails_at_once_and_says_why(tmp_path):
    import jax.numpy as jnp

    def run(comm):
        step = shard.zero2(lambda p, b: jnp.sum(p["w"] ** 2), optimizer=ops.adamw(1e-2),
                           comm=comm)
        state, _ = step(step.init({"w": np.ones(9, np.float32)}), None)
        if comm.rank == 0:
            shard.save(state, tmp_path / "ck", comm=comm)
        step(state, None)

    with pytest.raises(ops.CollectiveError) as e:
        ops.spawn(run, 2, timeout=60)
    assert "rank 0: barrier; rank 1: reduce_scatter" in str(e.value)
    assert "(save and load included)" in str(e.value)


@pytest.mark.parametrize("cast", [True, False])
def test_mixed_precision_casts_a_jax_losss_float_inputs(cast):
    import jax.numpy as jnp

    from ops import BF16

    seen = []

    def loss(p, b):
        seen.append((b["x"].dtype, b["ids"].dtype))
        return jnp.mean((b["x"] @ p["w"]).astype(jnp.float32) ** 2)

    step = shard.zero3(loss, optimizer=ops.adamw(1e-2), comm=one_comm(),
                       precision=shard.Precision(param_dtype="bf16", cast_forward_inputs=cast))
    state = step.init({"w": np.ones((3, 2), np.float32)})
    batch = {"x": np.ones((4, 3), np.float32), "ids": np.arange(4)}
    state, metrics = step(state, batch)
    x_dtype, ids_dtype = seen[-1]
    assert x_dtype == (BF16 if cast else np.float32)
    assert jnp.issubdtype(ids_dtype, jnp.integer)  # only floating arrays are cast
    assert batch["x"].dtype == np.float32  # the caller's arrays are not touched
    assert np.isfinite(metrics["loss"])
