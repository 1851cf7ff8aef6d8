"""Tensor parallelism on torch modules (interop.torch.parallelize): a Hugging
Face Llama split by its own tp_plan and trained with ZeRO on the data axis
against torch.optim.AdamW on the whole model in one process, and the plan's
errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard

transformers = pytest.importorskip("transformers")
LR, WD, EPS, CLIP, STEPS, ROWS = 1e-2, 0.01, 1e-6, 0.5, 6, 4


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


def reference(model):
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


def train(comm, model, data, size, zero):
    mesh = shard.Mesh(comm, {"data": data, "model": size})
    model = copy.deepcopy(model)
    tp = it.parallelize(model, mesh)
    params, loss = it.functional(model, loss=loss_fn)
    step = zero(loss, optimizer=ops.adamw(LR, eps=EPS, weight_decay=WD), comm=mesh["data"],
                clip_norm=CLIP, tensor_parallel=tp)
    state = step.init(params)
    losses, norms = [], []
    for ids in batches():
        state, metrics = step(state, shard.split_batch(ids, rank=mesh.coords["data"],
                                                       world_size=data))
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    local = shard.gather(state, mesh["data"])
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
        assert shapes["model.embed_tokens.weight"] == (32, 16)  # half the vocabulary
        assert ("lm_head.weight" in shapes) == (not tied)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
        assert sorted(whole) == sorted(want)
        for k in want:
            np.testing.assert_allclose(whole[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


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
    assert "pass the TensorParallel it returned as tensor_parallel=" in errors[3]
    assert "split already" in errors[4]

    def three(comm):
        with pytest.raises(ValueError) as e:
            it.parallelize(llama(), comm)
        return str(e.value)

    assert "embed_tokens.weight has 64 along dimension 0, which does not divide over 3" in \
        shard.spawn(three, 3)[0]
