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


def run(comm, *, stages, microbatches, schedule="1f1b", zero=shard.zero2, steps=4, **kw):
    """Train the pipelined model; returns this stage's {layer index: whole params} and
    the losses."""
    pipe = shard.pipeline(LAYERED, comm=comm, stages=stages, microbatches=microbatches,
                          schedule=schedule)
    step = zero(pipe, optimizer=ops.adamw(LR, weight_decay=WD), comm=pipe.data, **kw)
    state = step.init(pipe.params(init_params()))
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
