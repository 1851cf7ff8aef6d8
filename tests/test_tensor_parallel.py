"""Tensor parallelism (shard.TensorParallel): each collective's forward and
backward against the unsplit computation, Megatron's layers, the
vocabulary-parallel loss against the gathered one, a GPT's loss and gradients
at 2 and 4 model ranks (with and without sequence parallelism) against one
process, and the specs' errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shard
from tests import tp_models as gpt


def _close(got, want, tol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _inputs(size):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((size, 4, 8)).astype(np.float32)  # x[r]: rank r's
    tall = rng.standard_normal((size, 4 * size, 8)).astype(np.float32)
    whole = np.concatenate(list(x), -1)  # (4, 8 * size), the same on every rank
    return {"copy": (x, None), "reduce": (x, None), "gather": (x, -1),
            "scatter": ([whole] * size, -1), "gather_sequence": (x, 0),
            "reduce_scatter": (tall, 0)}


def _cotangent(name, rank, shape):
    seed = 1000 + 10 * rank + list(_inputs(1)).index(name)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("size,backend", [(2, "threads"), (3, "threads"), (4, "threads"),
                                          (3, "nccl")])
def test_each_collective_and_its_conjugate_match_the_unsplit_computation(size, backend):
    """Forward and backward of each collective against numpy; on the NCCL
    backend (its stand-in) the host arrays of JAX's callbacks move through the
    device, as NCCL takes GPU memory only."""
    cases = _inputs(size)

    def run(comm):
        tp = shard.TensorParallel(comm)
        out = {}
        for name, (inputs, axis) in cases.items():
            fn = getattr(tp, name)
            args = () if axis is None else (axis,)
            y, vjp = jax.vjp(lambda a, fn=fn, args=args: fn(a, *args),
                             jnp.asarray(inputs[comm.rank]))
            (g,) = vjp(jnp.asarray(_cotangent(name, comm.rank, y.shape)))
            out[name] = (np.asarray(y), np.asarray(g))
        return out

    if backend == "threads":
        got = shard.spawn(run, size)
    else:
        from tests.nccl_standin import run_ranks

        got, _ = run_ranks(size, run, pytest.importorskip("cupy.cuda.nccl"))
    x, tall = cases["copy"][0], cases["reduce_scatter"][0]
    whole = cases["scatter"][0][0]

    def ct(name):
        return [_cotangent(name, q, got[q][name][0].shape) for q in range(size)]

    for r in range(size):
        rows, cols = slice(4 * r, 4 * r + 4), slice(8 * r, 8 * r + 8)
        want = {  # (forward, backward) of each, on rank r
            "copy": (x[r], sum(ct("copy"))),
            "reduce": (x.sum(0), ct("reduce")[r]),
            "gather": (whole, ct("gather")[r][:, cols]),
            "scatter": (whole[:, cols], np.concatenate(ct("scatter"), -1)),
            "gather_sequence": (np.concatenate(list(x), 0), sum(ct("gather_sequence"))[rows]),
            "reduce_scatter": (tall.sum(0)[rows], np.concatenate(ct("reduce_scatter"), 0)),
        }
        for name, (fwd, bwd) in want.items():
            _close(got[r][name][0], fwd)
            _close(got[r][name][1], bwd)


def test_one_model_rank_is_the_identity_and_traces_no_callback():
    def run(comm):
        tp = shard.TensorParallel(comm)

        def f(x):
            return tp.row_linear(tp.column_linear(x, jnp.ones((3, 4))), jnp.ones((4, 2)))
        return str(jax.make_jaxpr(f)(jnp.ones((2, 3))))

    assert "callback" not in shard.spawn(run, 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("size,sequence_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_a_gpt_split_over_model_ranks_has_the_loss_and_gradients_of_one_process(
        size, sequence_parallel):
    params, batch = gpt.init_params(), gpt.batches(1)[0]
    want_loss, want_grads = jax.value_and_grad(gpt.gpt_loss)(params, batch)

    def run(comm):
        tp = shard.TensorParallel(comm, gpt.specs())
        local = tp.shard(params)
        vg = jax.jit(jax.value_and_grad(
            lambda p, b: gpt.gpt_loss(p, b, tp=tp, sequence_parallel=sequence_parallel)))
        loss, grads = vg(local, batch)
        return float(loss), tp.unshard(grads), jax.tree.map(np.shape, local)

    got = shard.spawn(run, size)
    assert got[0][2]["blocks"][0]["wq"] == (gpt.D, gpt.D // size)
    assert got[0][2]["wte"] == (gpt.VOCAB // size, gpt.D)
    for loss, grads, _ in got:
        assert abs(loss - float(want_loss)) < 1e-5
        jax.tree.map(lambda g, w: _close(g, w, 1e-5), grads, want_grads)


def test_the_vocabulary_parallel_loss_equals_the_loss_of_the_gathered_logits():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((3, 5, 24)) * 4).astype(np.float32)
    labels = rng.integers(0, 24, (3, 5))
    want = jax.nn.logsumexp(logits, -1) - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    want_grad = jax.grad(lambda z: jnp.sum(
        jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, labels[..., None], -1)[..., 0]))(logits)

    def run(comm):
        tp = shard.TensorParallel(comm)
        mine = jnp.asarray(np.split(logits, comm.world_size, -1)[comm.rank])
        loss, vjp = jax.vjp(lambda z: tp.cross_entropy(z, jnp.asarray(labels)), mine)
        return np.asarray(loss), np.asarray(vjp(jnp.ones_like(loss))[0])

    for size in (1, 2, 3, 4):
        got = shard.spawn(run, size)
        for r, (loss, grad) in enumerate(got):
            _close(loss, want)
            _close(grad, np.split(np.asarray(want_grad), size, -1)[r])


def test_specs_that_do_not_fit_are_refused_naming_the_leaf():
    def run(comm):
        errors = []
        for specs, params in [
            ({"w": P(None, "model")}, {"w": np.ones((4, 3))}),  # 3 columns over 2 ranks
            ({"w": P("data", None)}, {"w": np.ones((4, 4))}),  # another axis
            ({"w": P(None, None, "model")}, {"w": np.ones((4, 4))}),  # past the last dim
            ({"w": P("model", "model")}, {"w": np.ones((4, 4))}),
            ({"v": P("model")}, {"w": np.ones((4, 4))}),  # not the params' tree
        ]:
            with pytest.raises((ValueError, TypeError)) as e:
                shard.TensorParallel(comm, specs).shard(params)
            errors.append(str(e.value))
        return errors

    errors = shard.spawn(run, 2)[0]
    assert "['w']" in errors[0] and "does not divide over 2 model ranks" in errors[0]
    assert "'data'" in errors[1] and "name only 'model'" in errors[1]
    assert "does not fit its shape (4, 4)" in errors[2]
    assert "does not fit" in errors[3]
    assert "does not match the params tree" in errors[4]
    with pytest.raises(ValueError, match="no axis 'model'"):
        shard.spawn(lambda c: shard.TensorParallel(shard.Mesh(c, {"data": 2})), 2)


def test_unshard_takes_the_torch_leaves_that_shard_takes():
    """Torch parameters (requiring grad) split and joined back, read explicitly."""
    import torch

    w = torch.arange(24.0).reshape(4, 6).requires_grad_()

    def run(comm):
        tp = shard.TensorParallel(comm, {"w": P(None, "model")})
        return tp.unshard(tp.shard({"w": w}))["w"]

    for whole in shard.spawn(run, 2):
        np.testing.assert_array_equal(whole, w.detach().numpy())


def test_a_packed_leaf_splits_each_block_and_joins_back():
    """A fused qkv ``(d, 3 d)`` as ``Packed(P(None, "model"), 3)``: each model
    rank holds its columns of q, of k and of v, and its column-parallel output
    is those columns of the whole layer's; unshard gives the whole leaf back."""
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(4, 24)).astype(np.float32), rng.normal(size=(2, 4)).astype(
        np.float32)
    want = x @ w

    def run(comm):
        tp = shard.TensorParallel(comm, {"qkv": shard.Packed(P(None, "model"), 3)})
        mine = tp.shard({"qkv": w})
        y = tp.column_linear(jnp.asarray(x), jnp.asarray(mine["qkv"]))
        return mine["qkv"], np.asarray(y), tp.unshard(mine)["qkv"]

    for size in (1, 2, 4):
        n = 8 // size
        for r, (mine, y, whole) in enumerate(shard.spawn(run, size)):
            cols = [b * 8 + r * n + i for b in range(3) for i in range(n)]
            np.testing.assert_array_equal(mine, w[:, cols])
            np.testing.assert_allclose(y, want[:, cols], rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(whole, w)

    def bad(comm):
        errors = []
        for blocks, shape in [(3, (4, 8)), (3, (4, 9))]:  # 8 not 3 blocks; 3 over 2 ranks
            with pytest.raises(ValueError) as e:
                shard.TensorParallel(comm, {"w": shard.Packed(P(None, "model"), blocks)}).shard(
                    {"w": np.ones(shape)})
            errors.append(str(e.value))
        for args in [(P(None, "model"), 0), ("model", 2)]:
            with pytest.raises((ValueError, TypeError)) as e:
                shard.Packed(*args)
            errors.append(str(e.value))
        return errors

    errors = shard.spawn(bad, 2)[0]
    assert "['w'] has 8 along dimension 1, which is not 3 equal packed blocks" in errors[0]
    assert "3 along dimension 1 in each packed block, which does not divide over 2" in errors[1]
    assert "blocks must be an int >= 1" in errors[2]
    assert "spec must be a jax.sharding.PartitionSpec" in errors[3]


LR, WD, CLIP = gpt.LR, gpt.WD, gpt.CLIP


@pytest.mark.slow
@pytest.mark.parametrize("data,model,zero", [  # each stage at data 2 (zero3 on the device too)
    (1, 2, shard.zero1), (2, 2, shard.zero1), (2, 2, shard.zero2), (2, 2, shard.zero3),
    (3, 2, shard.zero3), (1, 4, shard.zero3), (3, 1, shard.zero2)])
def test_zero_on_the_data_axis_with_tensor_parallelism_matches_one_process(data, model, zero):
    steps = 10
    want, want_losses, want_norms = gpt.reference(steps)
    got = shard.spawn(lambda c: gpt.train(c, data, model, zero, steps), data * model)
    for coords, whole, mine, losses, norms in got:
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        assert min(want_norms) > CLIP  # clipping was on at every step
        jax.tree.map(lambda g, w: _close(g, w, 1e-5), whole, want)
        tp_slice = shard.spawn(lambda c: shard.TensorParallel(c, gpt.specs()).shard(want),
                               model)[coords["model"]]
        jax.tree.map(lambda g, w: _close(g, w, 1e-5), mine, tp_slice)


def _resume(comm, path, data, model, zero, first, steps):
    """Load ``path`` at (data, model) (model 0: no tensor parallelism) and run
    batches [first, steps)."""
    import ops

    mesh = shard.Mesh(comm, {"data": data, "model": max(model, 1)})
    tp = shard.TensorParallel(mesh, gpt.specs()) if model else None
    step = zero(lambda p, b: gpt.gpt_loss(p, b, tp=tp),
                optimizer=ops.adamw(LR, eps=gpt.EPS, weight_decay=WD), mesh=mesh, clip_norm=CLIP,
                specs=tp)
    state, _ = shard.load(path, step, comm=mesh["data"])
    assert int(state.step) == first
    losses = []
    for b in gpt.batches(steps)[first:]:
        state, metrics = step(state, shard.split_batch(b, rank=mesh.coords["data"],
                                                       world_size=data))
        losses.append(metrics["loss"])
    mine = shard.gather(state, mesh["data"])
    return (tp.unshard(mine) if tp else mine), losses


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["threads", "nccl"])
def test_tensor_parallelism_trains_device_state_as_one_process(backend):
    """ZeRO-3 state on the device stand-in at (data 2, model 2), on thread ranks
    and on the NCCL backend (against the NCCL stand-in: every collective, the
    loss's own included, moves device memory, as on GPUs)."""
    from ops.device._device import device_of
    from ops.testing import STANDIN

    steps = 4
    want, want_losses, want_norms = gpt.reference(steps)

    def run(comm):
        return gpt.train(comm, 2, 2, shard.zero3, steps, device=STANDIN)

    if backend == "threads":
        got = shard.spawn(run, 4)
    else:
        from tests.nccl_standin import run_ranks

        got, _ = run_ranks(4, run, pytest.importorskip("cupy.cuda.nccl"))
    for _, whole, mine, losses, norms in got:
        assert {device_of(x) for x in jax.tree.leaves(mine)} == {STANDIN}
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        jax.tree.map(lambda g, w: _close(g, w, 1e-5), whole, want)


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_at_other_shapes_on_the_same_trajectory(tmp_path):
    import ops

    steps, first, path = 8, 4, tmp_path / "ckpt"

    def train(comm):
        mesh = shard.Mesh(comm, {"data": 2, "model": 2})
        tp = shard.TensorParallel(mesh, gpt.specs())
        step = shard.zero3(lambda p, b: gpt.gpt_loss(p, b, tp=tp),
                           optimizer=ops.adamw(LR, eps=gpt.EPS, weight_decay=WD), mesh=mesh,
                           clip_norm=CLIP, specs=tp)
        state = step.init(gpt.init_params())
        losses = []
        for i, b in enumerate(gpt.batches(steps)):
            if i == first:
                shard.save(state, path, comm=mesh["data"])
            state, metrics = step(state, shard.split_batch(b, rank=mesh.coords["data"],
                                                           world_size=2))
            losses.append(metrics["loss"])
        return tp.unshard(shard.gather(state, mesh["data"])), losses

    want, want_losses = shard.spawn(train, 4)[0]
    assert sorted(p.name for p in path.iterdir()) == ["model-000", "model-001",
                                                      "tensor_parallel.json"]
    for data, model, zero in [(2, 2, shard.zero3), (1, 4, shard.zero1), (4, 0, shard.zero2)]:
        got = shard.spawn(lambda c, d=data, m=model, z=zero: _resume(c, path, d, m, z, first,
                                                                    steps), data * max(model, 1))
        for params, losses in got:
            np.testing.assert_allclose(losses, want_losses[first:], rtol=1e-5, atol=1e-6)
            jax.tree.map(lambda g, w: _close(g, w, 1e-5), params, want)

    # the whole params of the saved step, consolidated from the two model ranks' parts
    out = tmp_path / "whole.safetensors"
    from safetensors.numpy import load_file

    from shard.checkpoint import consolidate
    consolidate(path, out)
    whole = load_file(str(out))
    saved = shard.spawn(lambda c: _resume(c, path, 1, 0, shard.zero1, first, first), 1)[0][0]
    assert whole["wte"].shape == (gpt.VOCAB, gpt.D)
    assert whole["blocks.0.w_up"].shape == (gpt.D, 4 * gpt.D)
    _close(whole["blocks.1.w_down"], saved["blocks"][1]["w_down"], 0)
    _close(whole["head"], saved["head"], 0)


@pytest.mark.slow
def test_a_device_state_tensor_parallel_checkpoint_resumes_on_the_host(tmp_path):
    import ops
    from ops.testing import STANDIN

    steps, first, path = 4, 2, tmp_path / "ckpt"

    def train(comm):  # (data 2, model 2) on the device stand-in, saved after 2 steps
        mesh = shard.Mesh(comm, {"data": 2, "model": 2})
        tp = shard.TensorParallel(mesh, gpt.specs())
        step = shard.zero2(lambda p, b: gpt.gpt_loss(p, b, tp=tp),
                           optimizer=ops.adamw(LR, eps=gpt.EPS, weight_decay=WD), mesh=mesh,
                           clip_norm=CLIP, specs=tp)
        state = step.init(jax.tree.map(lambda x: STANDIN.from_host(np.asarray(x)),
                                       gpt.init_params()))
        for b in gpt.batches(first):
            state, _ = step(state, shard.split_batch(b, rank=mesh.coords["data"],
                                                     world_size=2))
        shard.save(state, path, comm=mesh["data"])

    shard.spawn(train, 4)
    want, want_losses, _ = gpt.reference(steps)
    for params, losses in shard.spawn(lambda c: _resume(c, path, 1, 4, shard.zero3, first,
                                                        steps), 4):
        np.testing.assert_allclose(losses, want_losses[first:], rtol=1e-5, atol=1e-6)
        jax.tree.map(lambda g, w: _close(g, w, 1e-5), params, want)


def test_a_plain_checkpoint_loads_into_a_tensor_parallel_step(tmp_path):
    import ops

    path = tmp_path / "plain"

    def save(comm):
        step = shard.zero2(gpt.gpt_loss, optimizer=ops.adamw(LR, eps=gpt.EPS, weight_decay=WD),
                           comm=comm, clip_norm=CLIP)
        state = step.init(gpt.init_params())
        for b in gpt.batches(2):
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=3))
        shard.save(state, path, comm=comm)
        for b in gpt.batches(4)[2:]:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=3))
        return shard.gather(state, comm)

    want = shard.spawn(save, 3)[0]
    for params, _ in shard.spawn(lambda c: _resume(c, path, 1, 2, shard.zero3, 2, 4), 2):
        jax.tree.map(lambda g, w: _close(g, w, 1e-5), params, want)


@pytest.mark.multiprocess
def test_four_gloo_processes_train_a_sequence_parallel_gpt_as_one_process(gloo_shared):
    import ops
    from tests import test_invariance as inv

    reports = gloo_shared("tensor_parallel", 4)
    want, want_losses, want_norms = gpt.reference(5)
    bits = ops.spawn(lambda c: inv.jax_run(c, stage=3, steps=4), 1)[0]
    for rank, rep in enumerate(reports):
        assert rep.get("ok"), rep
        got = [np.asarray(x, np.float32) for x in rep["whole"]]
        jax.tree.map(_close, jax.tree.unflatten(jax.tree.structure(want), got), want)
        np.testing.assert_allclose(rep["losses"], want_losses, rtol=0, atol=1e-5)
        np.testing.assert_allclose(rep["norms"], want_norms, rtol=0, atol=1e-5)
        # invariant_shards=8 at 4 processes: one thread rank's bits
        inv.assert_same_bits(([np.asarray(x, d) for x, d in zip(
            rep["invariant"]["params"], rep["invariant"]["dtypes"], strict=True)],
            rep["invariant"]["losses"], rep["invariant"]["norms"]), bits,
            f"rank {rank} of 4 gloo processes")


def test_what_tensor_parallelism_does_not_compose_with_is_refused_by_name(tmp_path):
    import json

    import ops

    def run(comm):
        mesh = shard.Mesh(comm, {"data": 1, "model": 2})
        tp = shard.TensorParallel(mesh, {"w": P(None, "model")})

        def loss(p, b):
            return jnp.sum(tp.column_linear(jnp.ones((2, 4)), p["w"]) ** 2)

        errors = []
        hsdp = shard.Mesh(comm, {"replicate": 1, "shard": 1, "model": 2})
        for where, kw in ((hsdp, {"specs": shard.TensorParallel(hsdp, tp.specs)}),
                          (mesh, {"specs": tp, "offload": shard.Offload("host")}),
                          (mesh, {}), (mesh, {"specs": shard.TensorParallel(hsdp, tp.specs)}),
                          (None, {"specs": tp, "comm": mesh["data"]})):
            with pytest.raises((NotImplementedError, ValueError)) as e:
                shard.zero2(loss, optimizer=ops.adamw(1e-2), mesh=where, **kw)
            errors.append(str(e.value))
        step = shard.zero2(loss, optimizer=ops.adamw(1e-2), mesh=mesh, specs=tp)
        with pytest.raises(NotImplementedError) as e:
            step.init_from(lambda: {"w": jnp.ones((4, 4))})
        errors.append(str(e.value))
        state = step.init({"w": np.ones((4, 4), np.float32)})
        assert state.master[0].size == 8  # this model rank's 4 x 2 slice
        with pytest.raises(NotImplementedError) as e:
            shard.async_save(state, tmp_path / "a", comm=mesh["data"])
        errors.append(str(e.value))
        shard.save(state, tmp_path / "ck", comm=mesh["data"])
        return errors

    errors = shard.spawn(run, 2)[0]
    assert "a 'model' axis (tensor parallelism) does not compose with a 'replicate'" in errors[0]
    assert "a 'model' axis (tensor parallelism) does not compose with offload=" in errors[1]
    assert "the mesh has a 'model' axis: give the params' split over it as specs=" in errors[2]
    assert "the TensorParallel's ranks are not this mesh's 'model' axis" in errors[3]
    assert "a tensor-parallel split needs its model axis: pass mesh=" in errors[4]
    assert "give the whole params to zero2.init" in errors[5]
    assert "saved by shard.save" in errors[6]
    # a tampered index is refused before anything is read
    index = tmp_path / "ck" / "tensor_parallel.json"
    good = json.loads(index.read_text())
    for bad, match in [({"split": {"['w']": 5}}, "split must be null, an index"),
                       ({"split": {"['w']": [1, 3]}}, "packed blocks dividing"),
                       ({"split": {"['w']": [1]}}, "split must be null"),
                       ({"parts": ["../../etc"]}, "parts"),
                       ({"model_size": 3}, "not a tensor-parallel index"),
                       ({"step": 7}, "a save that did not finish on every model rank")]:
        index.write_text(json.dumps({**good, **bad}))
        with pytest.raises(shard.CheckpointError, match=match):
            shard.checkpoint.consolidate(tmp_path / "ck", tmp_path / "out.safetensors")


def _match_stages(got, want, want_losses, want_norms):
    """Every stage's losses, norms and layers against one process's, every layer
    held by some stage."""
    seen = set()
    for stage, losses, norms in got:
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        for i, params in stage.items():
            seen.add(i)
            jax.tree.map(lambda g, w: _close(g, w, 1e-5), params, want[i])
    assert seen == set(range(len(want)))


@pytest.mark.slow
@pytest.mark.parametrize("pipe,data,model,zero", [  # (2, 2, 2) at stage 3: on the device below
    (2, 1, 2, shard.zero3), (2, 2, 2, shard.zero1), (2, 2, 2, shard.zero2)])
def test_pipelines_zero_and_tensor_parallelism_together_match_one_process(pipe, data, model,
                                                                          zero):
    steps = 10
    want, want_losses, want_norms = gpt.reference(steps)
    want = gpt.layers(want)
    got = shard.spawn(lambda c: gpt.train_pipeline(c, pipe, data, model, zero, steps),
                      pipe * data * model)
    _match_stages(got, want, want_losses, want_norms)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["threads", "nccl"])
def test_pipelines_and_tensor_parallelism_train_device_state_as_one_process(backend):
    """(pipe 2, data 2, model 2), ZeRO-3 state on the device stand-in: on the NCCL
    backend the stages' messages and the loss's collectives move device memory,
    and every send waits for its receive, as a GPU's may: the backend's grouped
    sends keep 1F1B's steady state (an activation one way, a gradient the other
    at once) from waiting on itself."""
    from ops.testing import STANDIN

    steps = 4
    want, want_losses, want_norms = gpt.reference(steps)
    want = gpt.layers(want)

    def run(comm):
        return gpt.train_pipeline(comm, 2, 2, 2, shard.zero3, steps, device=STANDIN)

    if backend == "threads":
        got = shard.spawn(run, 8)
    else:
        from tests.nccl_standin import run_ranks

        got, _ = run_ranks(8, run, pytest.importorskip("cupy.cuda.nccl"), rendezvous=True)
    _match_stages(got, want, want_losses, want_norms)


@pytest.mark.slow
def test_checkpoints_move_between_pipelined_tensor_parallel_and_plain_layouts(tmp_path):
    import ops

    steps, opt = 5, dict(optimizer=ops.adamw(LR, eps=gpt.EPS, weight_decay=WD), clip_norm=CLIP)
    batches = gpt.batches(steps)
    want = gpt.layers(gpt.reference(steps)[0])

    def mesh_step(comm, pipe, data, model, zero):
        axes = {"pipe": pipe, "data": data, **({"model": model} if model else {})}
        mesh = shard.Mesh(comm, axes)
        tp = shard.TensorParallel(mesh, gpt.layers(gpt.specs())) if model else None
        stages = shard.pipeline(gpt.layered(tp), mesh=mesh, microbatches=2)
        step = zero(stages, mesh=mesh, specs=tp, **opt)
        step.init(stages.params(gpt.layers(gpt.init_params())))
        return mesh, tp, stages, step

    def run(steps_range, mesh, step, state):
        for b in (batches[i] for i in steps_range):
            state, _ = step(state, shard.split_batch(b, rank=mesh.coords["data"],
                                                     world_size=mesh.shape["data"]))
        return state

    def tp_only(comm):  # (data 2, model 2), no pipeline: 2 steps, saved
        mesh = shard.Mesh(comm, {"data": 2, "model": 2})
        tp = shard.TensorParallel(mesh, gpt.layers(gpt.specs()))
        step = shard.zero3(gpt.layered(tp), mesh=mesh, specs=tp, **opt)
        state = run(range(2), mesh, step, step.init(gpt.layers(gpt.init_params())))
        shard.save(state, tmp_path / "tp", comm=mesh["data"])

    def pipelined(comm):  # ...resumed at (pipe 2, data 2, model 2) for a step, saved
        mesh, _, stages, step = mesh_step(comm, 2, 2, 2, shard.zero2)
        state, _ = stages.load(tmp_path / "tp", step)
        stages.save(run(range(2, 3), mesh, step, state), tmp_path / "pipe_tp")

    def pipe_only(comm):  # ...then at (pipe 2, data 1), no tensor parallelism, saved
        mesh, _, stages, step = mesh_step(comm, 2, 1, 0, shard.zero1)
        state, _ = shard.load(tmp_path / "pipe_tp", step, comm=mesh["data"])
        stages.save(run(range(3, 4), mesh, step, state), tmp_path / "pipe")

    def plain(comm, source="pipe", first=4):  # ...and the last step on 4 data ranks
        step = shard.zero3(gpt.layered(), comm=comm, **opt)
        step.init(gpt.layers(gpt.init_params()))
        state, _ = shard.load(tmp_path / source, step, comm=comm)
        state = run(range(first, steps), shard.Mesh(comm, {"data": 4}), step, state)
        return shard.gather(state, comm)

    def pipe_from_tp(comm):  # (data 2, pipe 1, model 2) straight to (data 1, pipe 2, model 1)
        mesh, _, _, step = mesh_step(comm, 2, 1, 0, shard.zero2)
        state, _ = shard.load(tmp_path / "tp", step, comm=mesh["data"])
        return shard.gather(run(range(2, steps), mesh, step, state), mesh["data"])

    shard.spawn(tp_only, 4)
    for got in shard.spawn(lambda c: plain(c, "tp", 2), 4):  # and to (4, 1, 1)
        jax.tree.map(lambda g, w: _close(g, w, 1e-5), got, want)
    stages = shard.spawn(pipe_from_tp, 2)
    assert sorted(i for stage in stages for i in stage) == list(range(len(want)))
    for stage in stages:
        for i, params in stage.items():
            jax.tree.map(lambda g, w: _close(g, w, 1e-5), params, want[i])
    shard.spawn(pipelined, 8)
    assert sorted(p.name for p in (tmp_path / "pipe_tp").iterdir()) == [
        "pipeline.json", "stage-000", "stage-001"]
    assert (tmp_path / "pipe_tp" / "stage-001" / "model-001" / "manifest.json").exists()
    shard.spawn(pipe_only, 2)
    for got in shard.spawn(plain, 4):
        jax.tree.map(lambda g, w: _close(g, w, 1e-5), got, want)


def test_estimate_memory_of_a_model_rank_is_megatrons_split_and_what_a_rank_holds():
    import ops

    params, dims = gpt.init_params(), None
    tp2 = shard.TensorParallel(2, gpt.specs())  # a split without ranks
    dims = tp2.dims(params)
    split = sum(x.size for x, d in zip(jax.tree.leaves(params), dims, strict=True) if d is not None)
    whole = sum(x.size for x, d in zip(jax.tree.leaves(params), dims, strict=True) if d is None)
    est = shard.estimate_memory(params, stage=1, world_size=1, tensor_parallel=tp2)
    assert est["params"] == 4 * (split // 2 + whole)  # Megatron: split leaves / T
    assert est["optimizer"] == 2 * est["params"]
    with pytest.raises(RuntimeError, match="describes a split without ranks"):
        tp2.copy(jnp.ones(3))

    def held(comm):
        mesh = shard.Mesh(comm, {"data": 2, "model": 2})
        tp = shard.TensorParallel(mesh, gpt.specs())
        step = shard.zero3(lambda p, b: gpt.gpt_loss(p, b, tp=tp), optimizer=ops.adamw(1e-3),
                           mesh=mesh, specs=tp)
        state = step.init(params)
        return (sum(x.nbytes for x in state.master),
                sum(x.nbytes for ms in state.moments for x in ms))

    want = shard.estimate_memory(params, stage=3, world_size=2, tensor_parallel=tp2)
    for master, moments in shard.spawn(held, 4):
        assert (master, moments) == (want["params"], want["optimizer"])
    assert want["params"] < est["params"] / 2 + 4 * 64  # ZeRO halves it again (row padding)
