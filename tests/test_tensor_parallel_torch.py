"""Tensor parallelism on torch modules (interop.torch.parallelize): a Hugging
Face Llama split by its own tp_plan and trained with ZeRO on the data axis
against torch.optim.AdamW on the whole model in one process, and the plan's
errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

import interop.torch as it
import ops
import shard

transformers = pytest.importorskip("transformers")
LR, WD, EPS, CLIP, STEPS, ROWS = 1e-2, 0.01, 1e-6, 0.5, 10, 4


def llama(tied=True):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1))


def batches():
    rng = np.random.default_rng(2)
    return [torch.from_numpy(rng.integers(0, 64, (ROWS, 12))) for _ in range(STEPS)]


def loss_fn(m, ids):
    return m(input_ids=ids, labels=ids).loss


def reference(model, loss_fn=loss_fn, batches=batches):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    losses, norms = [], []
    for ids in batches():
        opt.zero_grad()
        loss = loss_fn(model, ids)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().numpy().copy() for k, v in model.named_parameters()}, losses, norms


def train(comm, model, data, size, zero, loss_fn=loss_fn, batches=batches, device=None):
    mesh = shard.Mesh(comm, {"data": data, "model": size})
    model = copy.deepcopy(model)
    tp = it.parallelize(model, mesh)
    params, loss = it.functional(model, loss=loss_fn)
    step = zero(loss, optimizer=ops.adamw(LR, eps=EPS, weight_decay=WD), mesh=mesh,
                clip_norm=CLIP)
    if device is not None:
        params = {k: device.from_host(np.asarray(v)) for k, v in params.items()}
    state = step.init(params)
    losses, norms = [], []
    for ids in batches():
        state, metrics = step(state, shard.split_batch(ids, rank=mesh.coords["data"],
                                                       world_size=data))
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    local = shard.gather(state, mesh["data"])
    if device is not None:
        from ops.device._device import device_of

        assert {device_of(v) for v in local.values()} == {device}
    return tp.unshard(local), {k: v.shape for k, v in local.items()}, losses, norms


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("data,size,zero", [(1, 2, shard.zero3), (2, 2, shard.zero1),
                                            (2, 2, shard.zero3)])
def test_a_llama_split_by_its_tp_plan_trains_as_one_process(data, size, zero, tied):
    model = llama(tied)
    want, want_losses, want_norms = reference(model)
    assert min(want_norms) > CLIP
    got = shard.spawn(lambda c: train(c, model, data, size, zero), data * size)
    for whole, shapes, losses, norms in got:
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (8, 16)  # 2 of 4 heads
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (16, 16)
        # Hugging Face's plan splits the embedding by vocabulary rows in transformers
        # 5.24; 5.17's splits lm_head alone, whose cut a tied embedding shares
        halved = tied or "model.embed_tokens" in model._tp_plan
        assert shapes["model.embed_tokens.weight"] == ((32, 16) if halved else (64, 16))
        assert ("lm_head.weight" in shapes) == (not tied)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        assert sorted(whole) == sorted(want)
        for k in want:
            np.testing.assert_allclose(whole[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def gpt_model():
    from examples import gpt

    return gpt.build(gpt.GPTConfig(vocab=64, seq=12, d=16, layers=2, heads=4))


def gpt_batches():
    rng = np.random.default_rng(3)
    return [tuple(torch.from_numpy(rng.integers(0, 64, (ROWS, 12))) for _ in range(2))
            for _ in range(STEPS)]


def gpt_loss(m, batch):
    from examples import gpt

    return gpt.lm_loss(m, batch)


GRID = [(data, pipe, size, zero) for data, pipe, size in [(1, 1, 2), (2, 1, 2), (1, 2, 2),
                                                           (2, 2, 2)]
        for zero in (shard.zero1, shard.zero2, shard.zero3)] + [(1, 1, 4, shard.zero3)]


@pytest.mark.parametrize("data,pipe,size,zero", GRID)
def test_the_example_gpt_split_by_its_plan_trains_as_one_process(data, pipe, size, zero):
    """examples/gpt.py's GPT on a (data, pipe, model) mesh: its fused qkv split
    as three packed blocks (each rank its heads' q, k and v), the tied embedding
    and head over the vocabulary; pipelined as a chain of layers split by one
    parallelize call, its embedding tied to the head across the stages; against
    torch.optim.AdamW on the whole model, clipped at every step."""
    from examples import gpt

    model = gpt_model()
    want, want_losses, want_norms = reference(model, gpt_loss, gpt_batches)
    assert min(want_norms) > CLIP
    if pipe == 1:
        got = shard.spawn(lambda c: train(c, model, data, size, zero, gpt_loss, gpt_batches),
                          data * size)
        for whole, shapes, losses, norms in got:
            assert shapes["blocks.0.qkv.weight"] == (3 * 16 // size, 16)
            assert shapes["blocks.0.qkv.bias"] == (3 * 16 // size,)
            assert shapes["blocks.0.proj.weight"] == (16, 16 // size)
            assert shapes["tok_emb.weight"] == (64 // size, 16)
            assert shapes["pos_emb.weight"] == (12, 16)
            np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
            np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
            assert sorted(whole) == sorted(want)
            for k in want:
                np.testing.assert_allclose(whole[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
        return
    layered_want = [{n: want[_gpt_name(i, n)] for n, _ in m.named_parameters()}
                    for i, m in enumerate(gpt.chain(model))]

    def run(comm):
        mesh = shard.Mesh(comm, {"pipe": pipe, "data": data, "model": size})
        layers = gpt.chain(copy.deepcopy(model))
        tp = it.parallelize(layers, mesh, gpt.CHAIN_TP_PLAN)
        params, loss = it.layered(layers, loss=gpt.chain_loss)
        stages = shard.pipeline(loss, mesh=mesh, microbatches=2,
                                tied=gpt.tied_weights(model.cfg))
        step = zero(stages, optimizer=ops.adamw(LR, eps=EPS, weight_decay=WD), mesh=mesh,
                    clip_norm=CLIP)
        state = step.init(stages.params(params))
        losses, norms = [], []
        for b in gpt_batches():
            state, metrics = step(state, shard.split_batch(b, rank=mesh.coords["data"],
                                                           world_size=data))
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
        return tp.unshard(shard.gather(state, mesh["data"])), losses, norms

    seen = set()
    for layers, losses, norms in shard.spawn(run, pipe * data * size):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        for i, got in layers.items():
            seen.add(i)
            assert sorted(got) == sorted(layered_want[i])
            for k in got:
                np.testing.assert_allclose(got[k], layered_want[i][k], rtol=1e-5, atol=1e-5,
                                           err_msg=f"layer {i}: {k}")
    assert seen == set(range(len(layered_want)))


def test_a_packed_split_takes_every_blocks_part():
    """A rank's slice of a packed qkv is its part of q, of k and of v, in order;
    the output it computes is those parts of the whole layer's output."""
    torch.manual_seed(0)
    whole = torch.nn.Linear(4, 12)
    x = torch.randn(2, 4)
    want = whole(x).detach()

    def run(comm):
        layer = torch.nn.Sequential(copy.deepcopy(whole))
        tp = it.parallelize(layer, comm, {"0": ("packed_colwise", 3)})
        return layer(x).detach(), layer[0].weight.detach(), list(tp.specs.values())

    for r, (y, w, specs) in enumerate(shard.spawn(run, 2)):
        rows = [b * 4 + r * 2 + i for b in range(3) for i in range(2)]
        torch.testing.assert_close(w, whole.weight.detach()[rows])
        torch.testing.assert_close(y, want[:, rows])
        assert specs == [shard.Packed(P("model"), 3)] * 2  # weight and bias


def test_a_plan_that_does_not_fit_the_model_is_refused_by_name():
    def run(comm):
        errors = []
        for plan in ({"model.layers.*.self_attn.q_proj": "sequence_parallel"},
                     {"model.layers.*.nope": "colwise"},
                     {"model.norm": "colwise"}):
            with pytest.raises((ValueError, TypeError)) as e:
                it.parallelize(llama(), comm, plan)
            errors.append(str(e.value))
        model = llama()
        tp = it.parallelize(model, comm)
        _, loss = it.functional(model, loss=loss_fn)
        with pytest.raises(ValueError) as e:
            shard.zero2(loss, optimizer=ops.adamw(1e-3), comm=comm)
        errors.append(str(e.value))
        with pytest.raises(ValueError) as e:
            it.parallelize(model, tp.comm)
        errors.append(str(e.value))
        return errors

    errors = shard.spawn(run, 2)[0]
    assert "'sequence_parallel'; the styles are" in errors[0]
    assert "'model.layers.*.nope' matches no module" in errors[1]
    assert "model.norm is a LlamaRMSNorm" in errors[2]
    assert "a tensor-parallel split needs its model axis: pass mesh=" in errors[3]
    assert "split already" in errors[4]

    def three(comm):
        with pytest.raises(ValueError) as e:
            it.parallelize(llama(), comm)
        return str(e.value)

    assert "embed_tokens.weight has 64 along dimension 0, which does not divide over 3" in \
        shard.spawn(three, 3)[0]


def _gpt_run(comm, model, path, data, size, zero, first, save_at=None):
    """The GPT at (data, size) (size 0: no tensor parallelism), from
    ``path`` when ``first`` > 0, run to the last batch; saved before batch
    ``save_at``: (whole params, losses)."""
    mesh = shard.Mesh(comm, {"data": data, "model": max(size, 1)})
    model = copy.deepcopy(model)
    tp = it.parallelize(model, mesh) if size else None
    params, loss = it.functional(model, loss=gpt_loss)
    step = zero(loss, optimizer=ops.adamw(LR, eps=EPS, weight_decay=WD), mesh=mesh,
                clip_norm=CLIP)
    if first:
        state, _ = shard.load(path, step, comm=mesh["data"])
        assert int(state.step) == first
    else:
        state = step.init(params)
    losses = []
    for i, b in enumerate(gpt_batches()[first:], first):
        if i == save_at:
            shard.save(state, path, comm=mesh["data"])
        state, metrics = step(state, shard.split_batch(b, rank=mesh.coords["data"],
                                                       world_size=data))
        losses.append(metrics["loss"])
    mine = shard.gather(state, mesh["data"])
    return (tp.unshard(mine) if tp else mine), losses


def test_a_packed_gpt_checkpoint_resumes_at_other_shapes_on_the_same_trajectory(tmp_path):
    """Saved at (data 2, model 2), each rank's qkv a slice of every packed
    block: resumed at (1, 4) and on 4 data ranks without tensor parallelism, and
    consolidated into the whole GPT's qkv."""
    import json

    from safetensors.numpy import load_file

    from shard.checkpoint import consolidate

    path, first, model = tmp_path / "ckpt", 3, gpt_model()
    want, want_losses = shard.spawn(
        lambda c: _gpt_run(c, model, path, 2, 2, shard.zero3, 0, save_at=first), 4)[0]
    index = json.loads((path / "tensor_parallel.json").read_text())
    assert index["split"]["['blocks.0.qkv.weight']"] == [0, 3]
    assert index["split"]["['blocks.0.fc.weight']"] == 0
    for data, size, zero in [(1, 4, shard.zero3), (4, 0, shard.zero2)]:
        got = shard.spawn(lambda c, d=data, s=size, z=zero: _gpt_run(c, model, path, d, s, z,
                                                                      first),
                          data * max(size, 1))
        for params, losses in got:
            np.testing.assert_allclose(losses, want_losses[first:], rtol=1e-5)
            for k in want:
                np.testing.assert_allclose(params[k], want[k], rtol=1e-5, atol=1e-5,
                                           err_msg=k)
    saved, _, _ = reference(model, gpt_loss, lambda: gpt_batches()[:first])
    consolidate(path, tmp_path / "whole.safetensors")
    whole = load_file(str(tmp_path / "whole.safetensors"))
    for k in ("blocks.0.qkv.weight", "blocks.1.qkv.bias", "tok_emb.weight"):
        np.testing.assert_allclose(whole[k], saved[k], rtol=1e-5, atol=1e-5, err_msg=k)


def _gpt_name(layer, name):
    """The whole GPT's name of a chain layer's parameter (the head is the
    token embedding)."""
    if name.startswith("block."):
        return f"blocks.{layer - 1}.{name[len('block.'):]}"
    return "tok_emb.weight" if name == "head.weight" else name


def test_layers_split_apart_from_one_another_are_refused():
    """A whole GPT split and then cut into layers has an output head the plan
    never saw: layered refuses it rather than train a head on the wrong vocabulary."""
    from examples import gpt

    model = gpt_model()

    def run(comm):
        whole = copy.deepcopy(model)
        it.parallelize(whole, comm)
        with pytest.raises(ValueError) as e:
            it.layered(gpt.chain(whole), loss=gpt.chain_loss)
        with pytest.raises(ValueError) as list_plan:
            it.parallelize(gpt.chain(copy.deepcopy(model)), comm)
        return str(e.value), str(list_plan.value)

    split, no_plan = shard.spawn(run, 2)[0]
    assert "some layers are split by interop.torch.parallelize and others are not" in split
    assert "a list of layers; give plan=" in no_plan


@pytest.mark.slow
def test_the_example_gpt_split_on_the_nccl_backend_trains_device_state():
    """The GPT's state on the device stand-in, its model ranks' collectives on
    the NCCL backend (its stand-in; torch sees the stand-in's memory as CPU
    tensors, which the backend takes as device arrays through DLPack)."""
    from ops.testing import STANDIN
    from tests.nccl_standin import run_ranks

    nccl = pytest.importorskip("cupy.cuda.nccl")
    model = gpt_model()
    want, want_losses, want_norms = reference(model, gpt_loss, gpt_batches)
    got, comms = run_ranks(4, lambda c: train(c, model, 2, 2, shard.zero3, gpt_loss,
                                              gpt_batches, device=STANDIN), nccl,
                           rendezvous=True)
    assert ("commSplit", 0, 0) in comms[0].comm.calls  # the mesh's axes: NCCL splits
    for whole, shapes, losses, norms in got:
        assert shapes["blocks.0.qkv.weight"] == (24, 16)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        for k in want:
            np.testing.assert_allclose(whole[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
