"""Exports that agree: after bf16 training of a float32 torch module,
``interop.torch.state_dict``, ``load_state`` and ``consolidate`` all give the
float32 masters, in the dtype the module had."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import interop.torch as it
import ops
import shard
from shard.checkpoint import consolidate
from tests import test_interop_torch as T

ZERO = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_training_exports_the_float32_masters(stage, tmp_path):
    model = T.built(T.MLP)
    batches = T.data(3)

    def run(comm):
        m = copy.deepcopy(model)
        params, fn = it.functional(m, loss=T.mse)
        step = ZERO[stage](fn, optimizer=ops.adamw(1e-2), comm=comm,
                           precision=shard.Precision(param_dtype="bfloat16"))
        state = step.init(params)
        n = batches[0][0].shape[0] // comm.world_size
        for b in batches:
            state, _ = step(state, tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b))
        assert all(p.dtype == torch.float32 for p in m.parameters())  # its own dtype
        with pytest.raises(RuntimeError, match=r"in the step's compute dtype.*load_state"):
            m(batches[0][0])
        masters = shard.gather(state, comm)
        exported = it.state_dict(m, state, comm=comm)
        shard.save(state, tmp_path / "ckpt", comm=comm)
        fresh = it.load_state(copy.deepcopy(model), state, comm=comm)
        it.load_state(m, state, comm=comm)  # the module itself, usable again
        assert torch.equal(m(batches[0][0]), fresh(batches[0][0]))
        return masters, exported, dict(fresh.named_parameters())

    masters, exported, fresh = ops.spawn(run, 2)[0]
    consolidate(tmp_path / "ckpt", tmp_path / "full.safetensors")
    file = load_file(str(tmp_path / "full.safetensors"))
    for name, want in masters.items():
        assert exported[name].dtype == torch.float32 and fresh[name].dtype == torch.float32
        np.testing.assert_array_equal(exported[name].numpy(), want)
        np.testing.assert_array_equal(fresh[name].detach().numpy(), want)
        np.testing.assert_array_equal(file[name], want)
