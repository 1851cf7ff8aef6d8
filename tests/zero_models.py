"""Small JAX models and a single-process reference trainer for the ZeRO tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shard

LR, WD = 1e-2, 0.01


def init_params(seed: int = 0) -> list:
    """Two layers whose leaf shapes divide no world size from 2 to 4 (but 1)."""
    rng = np.random.default_rng(seed)
    return [
        {"w": rng.standard_normal((7, 5)).astype(np.float32) * 0.5,
         "b": rng.standard_normal(5).astype(np.float32) * 0.1},
        {"w": rng.standard_normal((5, 3)).astype(np.float32) * 0.5,
         "b": rng.standard_normal(3).astype(np.float32) * 0.1,
         "gain": np.asarray(1.5, np.float32)},
    ]


def layer0(p, _, batch):
    return jnp.tanh(batch["x"] @ p["w"].astype(batch["x"].dtype) + p["b"])


def layer1(p, h, batch):
    out = (h @ p["w"] + p["b"]) * p["gain"]
    return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


def loss(params, batch):
    return layer1(params[1], layer0(params[0], None, batch), batch)


LAYERED = shard.Layered([layer0, layer1])


def batches(steps: int, global_batch: int = 24, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((global_batch, 7)).astype(np.float32),
             "y": rng.standard_normal((global_batch, 3)).astype(np.float32)}
            for _ in range(steps)]


def reference(steps: int, *, param_dtype=None, clip_norm=None, batch_list=None) -> tuple:
    """optax.adamw on the full batch in one process; returns (params, losses, norms)."""
    params = init_params()
    opt = optax.adamw(LR, weight_decay=WD)
    if clip_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(clip_norm), opt)
    state = opt.init(params)
    losses, norms = [], []
    cast = (lambda p: jax.tree_util.tree_map(lambda x: x.astype(param_dtype), p)) \
        if param_dtype is not None else (lambda p: p)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss(cast(p), b)))
    for b in batch_list or batches(steps):
        value, grads = grad_fn(params, b)
        grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
        norms.append(float(optax.tree.norm(grads)))
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    return jax.tree_util.tree_map(np.asarray, params), losses, norms
