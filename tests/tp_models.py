"""A small JAX GPT written once for one process and for tensor parallelism:
``gpt_loss(p, batch)`` is the plain model; ``gpt_loss(p, batch, tp=tp)`` the
same model with Megatron's splits (heads, MLP columns and the vocabulary over
the model ranks), and ``sequence_parallel=True`` adds sequence parallelism
between the blocks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

VOCAB, D, HEADS, SEQ, BLOCKS = 32, 16, 4, 8, 2
LR, WD, CLIP = 1e-2, 0.01, 0.5  # clipping is on at every step of reference()
# Adam's eps: with optax's 1e-8 an element whose first gradient is ~1e-7 (there is
# one in block 0's w_up) takes a sign-like first step, and the float32 rounding of
# any other summation order (the model ranks' partial sums) moves it by ~1e-5.
EPS = 1e-6


def init_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def block():
        return {"ln1": {"g": 1 + w(D, scale=0.1), "b": w(D, scale=0.1)},
                "wq": w(D, D), "wk": w(D, D), "wv": w(D, D), "wo": w(D, D), "bo": w(D),
                "ln2": {"g": 1 + w(D, scale=0.1), "b": w(D, scale=0.1)},
                "w_up": w(D, 4 * D), "b_up": w(4 * D), "w_down": w(4 * D, D), "b_down": w(D)}

    return {"wte": w(VOCAB, D), "wpe": w(SEQ, D), "blocks": [block() for _ in range(BLOCKS)],
            "lnf": {"g": 1 + w(D, scale=0.1), "b": w(D, scale=0.1)}, "head": w(D, VOCAB)}


def specs(model: str = "model") -> dict:
    col, row = P(None, model), P(model, None)
    block = {"ln1": None, "wq": col, "wk": col, "wv": col, "wo": row, "bo": None, "ln2": None,
             "w_up": col, "b_up": P(model), "w_down": row, "b_down": None}
    return {"wte": row, "wpe": None, "blocks": [block] * BLOCKS, "lnf": None, "head": col}


def batches(steps: int, rows: int = 12, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"ids": rng.integers(0, VOCAB, (rows, SEQ), dtype=np.int32),
             "labels": rng.integers(0, VOCAB, (rows, SEQ), dtype=np.int32)}
            for _ in range(steps)]


def _norm(x, p, tp, sp):
    g, b = (tp.copy(p["g"]), tp.copy(p["b"])) if sp else (p["g"], p["b"])
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b


def _linear(x, w, b=None):
    y = x @ w
    return y if b is None else y + b


def _embed(p, batch, tp, sp):
    ids = jnp.asarray(batch["ids"])
    if tp is None:
        return jnp.take(p["wte"], ids, axis=0) + p["wpe"]
    x = tp.embedding(ids, p["wte"], sequence_parallel=sp)
    return x + (tp.scatter(p["wpe"], 0) if sp else p["wpe"])


def _block(blk, x, tp, sp):
    if tp is None:
        col = row = _linear
    else:
        def col(x, w, b=None):
            return tp.column_linear(x, w, b, sequence_parallel=sp)

        def row(x, w, b=None):
            return tp.row_linear(x, w, b, sequence_parallel=sp)
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    h = _norm(x, blk["ln1"], tp, sp)
    q, k, v = col(h, blk["wq"]), col(h, blk["wk"]), col(h, blk["wv"])
    heads = q.shape[-1] // (D // HEADS)  # this rank's heads

    def split(t):
        return t.reshape(*t.shape[:2], heads, D // HEADS).transpose(0, 2, 1, 3)
    q, k, v = split(q), split(k), split(v)
    a = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D // HEADS)
    a = jax.nn.softmax(jnp.where(causal, a, -1e9), axis=-1)
    o = (a @ v).transpose(0, 2, 1, 3).reshape(*q.shape[:1], SEQ, -1)
    x = x + row(o, blk["wo"], blk["bo"])
    h = _norm(x, blk["ln2"], tp, sp)
    return x + row(jax.nn.gelu(col(h, blk["w_up"], blk["b_up"])), blk["w_down"], blk["b_down"])


def _head(p, x, batch, tp, sp):
    labels = jnp.asarray(batch["labels"])
    h = _norm(x, p["lnf"], tp, sp)
    if tp is None:
        logits = h @ p["head"]
        return jnp.mean(jax.nn.logsumexp(logits, -1)
                        - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0])
    logits = tp.column_linear(h, p["head"], sequence_parallel=sp)  # this rank's vocabulary
    return jnp.mean(tp.cross_entropy(logits, labels))


def gpt_loss(p, batch, *, tp=None, sequence_parallel=False):
    sp = tp is not None and sequence_parallel
    x = _embed(p, batch, tp, sp)
    for blk in p["blocks"]:
        x = _block(blk, x, tp, sp)
    return _head(p, x, batch, tp, sp)


def layers(p):
    """The params as a list, one entry per layer of :func:`layered`."""
    return [{"wte": p["wte"], "wpe": p["wpe"]}, *p["blocks"],
            {"lnf": p["lnf"], "head": p["head"]}]


def layered(tp=None, sequence_parallel=False):
    """The same model as a ``shard.Layered``: the embeddings, each block, the head."""
    import shard

    sp = tp is not None and sequence_parallel
    return shard.Layered([lambda p, _, b: _embed(p, b, tp, sp)]
                         + [lambda p, x, b: _block(p, x, tp, sp)] * BLOCKS
                         + [lambda p, x, b: _head(p, x, b, tp, sp)])


def reference(steps):
    """optax.adamw with clipping on the whole batch in one process: (params,
    losses, norms)."""
    opt, step = _reference_step()
    params = init_params()
    state, losses, norms = opt.init(params), [], []
    for b in batches(steps):
        params, state, loss, norm = step(params, state, b)
        losses.append(float(loss))
        norms.append(float(norm))
    return jax.tree.map(np.asarray, params), losses, norms


@functools.cache
def _reference_step():
    """The optimizer and one step of the reference as one program, compiled once
    per process (run eagerly, each of the optimizer's operations would be a
    program of its own)."""
    import optax

    opt = optax.chain(optax.clip_by_global_norm(CLIP),
                      optax.adamw(LR, eps=EPS, weight_decay=WD))

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(gpt_loss)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, optax.tree.norm(grads)

    return opt, step


def train(comm, data, model, zero, steps, sequence_parallel=False, device=None):
    """ZeRO on the data axis, tensor parallelism on the model axis (the state on
    ``device``, default the host): (coords, whole params, this model rank's
    params, losses, norms)."""
    import ops
    import shard

    mesh = shard.Mesh(comm, {"data": data, "model": model})
    tp = shard.TensorParallel(mesh, specs())
    step = zero(lambda p, b: gpt_loss(p, b, tp=tp, sequence_parallel=sequence_parallel),
                optimizer=ops.adamw(LR, eps=EPS, weight_decay=WD), mesh=mesh, clip_norm=CLIP,
                specs=tp)
    params = init_params()
    if device is not None:
        params = jax.tree.map(lambda x: device.from_host(np.asarray(x)), params)
    state = step.init(params)
    losses, norms = [], []
    for b in batches(steps):
        part = shard.split_batch(b, rank=mesh.coords["data"], world_size=data)
        state, metrics = step(state, part)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    mine = shard.gather(state, mesh["data"])  # this model rank's slices, whole over data
    return mesh.coords, tp.unshard(mine), mine, losses, norms


def train_pipeline(comm, pipe, data, model, zero, steps, microbatches=2, device=None):
    """Pipeline stages on the pipe axis, ZeRO on the data axis, tensor parallelism
    on the model axis (the state on ``device``, default the host): (this stage's
    {layer: whole params}, losses, norms)."""
    import ops
    import shard

    mesh = shard.Mesh(comm, {"pipe": pipe, "data": data, "model": model})
    tp = shard.TensorParallel(mesh, layers(specs()))
    stages = shard.pipeline(layered(tp), mesh=mesh, microbatches=microbatches)
    step = zero(stages, optimizer=ops.adamw(LR, eps=EPS, weight_decay=WD), mesh=mesh,
                clip_norm=CLIP, specs=tp)
    params = layers(init_params())
    if device is not None:
        params = jax.tree.map(lambda x: device.from_host(np.asarray(x)), params)
    state = step.init(stages.params(params))
    losses, norms = [], []
    for b in batches(steps):
        state, metrics = step(state, shard.split_batch(b, rank=mesh.coords["data"],
                                                       world_size=data))
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    return tp.unshard(shard.gather(state, mesh["data"])), losses, norms
