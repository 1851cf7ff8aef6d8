"""Hugging Face models, first try: tiny ``LlamaForCausalLM`` and ``GPT2LMHeadModel``
built from configs (no download), sharded per decoder layer by default, trained
by zero1-zero3 on thread ranks against torch's AdamW on the whole batch."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard

transformers = pytest.importorskip("transformers")
ZERO = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}
LR, WD, STEPS = 1e-2, 0.01, 3


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=36, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1))


MODELS = {"llama": llama, "gpt2": gpt2}
UNITS = {
    "llama": {"<root>", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm"},
    "gpt2": {"<root>", "transformer.wpe", "transformer.h.0", "transformer.h.1",
             "transformer.ln_f"},
}


def lm_loss(model, batch):
    return model(input_ids=batch[0], labels=batch[0]).loss


def data(n=8, seq=12):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (n, seq), generator=g),) for _ in range(STEPS)]


def built(name):
    torch.manual_seed(0)
    return MODELS[name]()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_units_follow_the_decoder_layers(name):
    _, loss = it.functional(built(name), loss=lm_loss)
    assert set(loss.unit_of.values()) == UNITS[name]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_models_match_torch_adamw(name, stage):
    batches = data()
    model = built(name)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for b in batches:
        opt.zero_grad()
        lm_loss(ref, b).backward()
        opt.step()
    want = {k: v.detach().numpy() for k, v in ref.named_parameters()}

    def run(comm):
        params, loss = it.functional(copy.deepcopy(model), loss=lm_loss)
        step = ZERO[stage](loss, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state = step.init(params)
        n = batches[0][0].shape[0] // comm.world_size
        for b in batches:
            state, _ = step(state, (b[0][comm.rank * n:(comm.rank + 1) * n],))
        return shard.gather(state, comm), state.meta.layout

    got, layout = ops.spawn(run, 2)[0]
    assert {u.name for u in layout.units} == UNITS[name]
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_a_unit_holding_most_of_a_large_model_is_warned_about(caplog):
    params = {"big": np.ones((1100, 1000), np.float32), "small": np.ones(10, np.float32)}

    def run(comm):
        shard.zero3(lambda p, b: 0.0, optimizer=ops.adamw(LR), comm=comm).init(params)

    with caplog.at_level(logging.WARNING, logger="shard.step"):
        ops.spawn(run, 2)
    assert caplog.text.count("holds 100% of the 1100010 params") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shard.step"):
        ops.spawn(lambda c: shard.zero3(lambda p, b: 0.0, optimizer=ops.adamw(LR), comm=c).init(
            {"a": params["big"][:550], "b": params["big"][550:]}), 2)
    assert "holds" not in caplog.text
