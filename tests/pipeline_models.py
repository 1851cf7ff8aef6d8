"""A small Layered model and its single-process reference, for the pipeline tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ops
import shard

LAYERS, WIDTH, LR, WD = 5, 6, 1e-2, 0.01


def hidden(p, h, b):
    return jnp.tanh((b["x"] if h is None else h) @ p["w"] + p["b"])


def last(p, h, b):
    return jnp.mean((h @ p["w"] + p["b"] - b["y"]) ** 2)


LAYERED = shard.Layered([hidden] * (LAYERS - 1) + [last])


def init_params():
    rng = np.random.default_rng(0)
    return [{"w": (rng.standard_normal((WIDTH, WIDTH)) * 0.5).astype(np.float32),
             "b": (rng.standard_normal(WIDTH) * 0.1).astype(np.float32)}
            for _ in range(LAYERS)]


def batches(steps=4, rows=8):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((rows, WIDTH)).astype(np.float32),
             "y": rng.standard_normal((rows, WIDTH)).astype(np.float32)} for _ in range(steps)]


def reference(steps=4, clip_norm=None):
    def loss(p, b):
        h = None
        for f, q in zip(LAYERED.layers, p, strict=True):
            h = f(q, h, b)
        return h

    opt = optax.adamw(LR, weight_decay=WD)
    if clip_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(clip_norm), opt)
    params = init_params()
    state = opt.init(params)
    for b in batches(steps):
        grads = jax.grad(loss)(params, b)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


TIED = [[(0, "w"), (LAYERS - 1, "w")]]  # the first layer's weight is the last one's


def tied_params():
    params = init_params()
    params[-1]["w"] = params[0]["w"].copy()
    return params


def tied_reference(steps=4, clip_norm=None):
    """The model with one weight shared by its first and last layers."""
    def loss(p, b):
        h = None
        for i, f in enumerate(LAYERED.layers):
            h = f(p[i] if i < LAYERS - 1 else {"w": p[0]["w"], "b": p[i]["b"]}, h, b)
        return h

    opt = optax.adamw(LR, weight_decay=WD)
    if clip_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(clip_norm), opt)
    params = tied_params()
    params[-1] = {"b": params[-1]["b"]}
    state = opt.init(params)
    for b in batches(steps):
        grads = jax.grad(loss)(params, b)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    params[-1] = {"w": params[0]["w"], "b": params[-1]["b"]}
    return params


def run(comm, *, stages, microbatches, schedule="1f1b", zero=shard.zero2, steps=4, tied=None,
        mesh=None, **kw):
    """Train the pipelined model (over ``shard.Mesh(comm, mesh)`` when ``mesh`` gives
    its axes); returns this stage's {layer index: whole params} and the losses."""
    where = dict(mesh=shard.Mesh(comm, mesh)) if mesh else dict(comm=comm, stages=stages)
    pipe = shard.pipeline(LAYERED, microbatches=microbatches, schedule=schedule, tied=tied,
                          **where)
    step = zero(pipe, optimizer=ops.adamw(LR, weight_decay=WD), comm=pipe.data, **kw)
    state = step.init(pipe.params(tied_params() if tied else init_params()))
    losses = []
    for b in batches(steps):
        state, m = step(state, shard.split_batch(b, rank=pipe.data.rank,
                                                 world_size=pipe.data.world_size))
        losses.append(m["loss"])
    return shard.gather(state, pipe.data), losses


def worst_difference(results, want):
    worst = 0.0
    for layers, _ in results:
        for i, got in layers.items():
            for k in got:
                worst = max(worst, float(np.abs(np.asarray(got[k]) - want[i][k]).max()))
    return worst


# -- the torch form: interop.torch.layered over a chain of modules --------------------

TORCH_SIZES = (5, 7, 7, 7, 7, 3)  # odd sizes: none divides 2 or 3 data ranks


def torch_layers(dropout=0.0):
    """Five modules (one unit each), built from one seed."""
    import torch

    torch.manual_seed(0)
    s = TORCH_SIZES
    hidden = [torch.nn.Sequential(torch.nn.Linear(s[i], s[i + 1]), torch.nn.Tanh(),
                                  torch.nn.Dropout(dropout)) for i in range(len(s) - 2)]
    return [*hidden, torch.nn.Linear(s[-2], s[-1])]


def torch_mse(out, batch):
    return ((out - batch[1]) ** 2).mean()


def torch_batches(steps=4, rows=24):
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, TORCH_SIZES[0], generator=g),
             torch.randn(rows, TORCH_SIZES[-1], generator=g)) for _ in range(steps)]


def torch_reference(steps=4):
    """torch's fused AdamW on the whole chain and the whole batch, in one process."""
    import torch

    layers = torch_layers()
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    for b in torch_batches(steps):
        opt.zero_grad()
        torch_mse(model(b[0]), b).backward()
        opt.step()
    return [{k: v.detach().numpy().copy() for k, v in m.named_parameters()} for m in layers]


def torch_run(comm, *, stages, microbatches, zero=shard.zero2, schedule="1f1b",
              checkpointing=False, layers=None, steps=4, tied=None, **kw):
    """Train the pipelined chain (each rank its own copy of the modules); returns
    this stage's {layer index: whole params} and the losses."""
    import copy

    import interop.torch as it

    params, loss = it.layered(copy.deepcopy(layers or torch_layers()), loss=torch_mse)
    pipe = shard.pipeline(loss, comm=comm, stages=stages, microbatches=microbatches,
                          schedule=schedule, activation_checkpointing=checkpointing,
                          tied=tied)
    step = zero(pipe, optimizer=ops.adamw(LR, weight_decay=WD), comm=pipe.data, **kw)
    state = step.init(pipe.params(params))
    losses = []
    for b in torch_batches(steps):
        n, r = b[0].shape[0] // pipe.data.world_size, pipe.data.rank
        state, m = step(state, tuple(t[r * n:(r + 1) * n] for t in b))
        losses.append(m["loss"])
    return shard.gather(state, pipe.data), losses
