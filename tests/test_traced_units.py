"""ZeRO-3 for any JAX loss (see [Note: traced units] in shard/step/_traced.py):
the program is cut into one segment per unit, so a plain-dict, flax nnx or
equinox model as its authors wrote it holds about two units at a time, and
every rank's shards equal the single-process optax reference's slice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ops
import shard
from tests.harness import assert_rank_slices, run_steps

LR, WD = 1e-2, 0.01


def optax_reference(params, loss, batches, has_aux=False):
    tx = optax.adamw(LR, weight_decay=WD)

    @jax.jit  # one program a step (eager, each operation compiles on its own)
    def update(params, opt, b):
        value, grads = jax.value_and_grad(loss, has_aux=has_aux)(params, b)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value[0] if has_aux else value

    opt = tx.init(params)
    losses = []
    for b in batches:
        params, opt, value = update(params, opt, b)
        losses.append(float(value))
    return params, losses


def train(loss, params, batches, world, *, has_aux=False, units=None, check=None,
          min_num_params=0):
    """Each rank's shards, metrics and peak of full params after the batches."""

    def run(comm):
        step = shard.zero3(loss, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm,
                           has_aux=has_aux, options=shard.ZeroOptions(
                               units=units, min_num_params=min_num_params))
        state, metrics = run_steps(step, params, batches, comm)
        out = check(step, state, comm) if check else None
        return state, metrics, step.tracker, out

    return ops.spawn(run, world)


def assert_shards_equal(states, want, world, rtol=2e-5, atol=2e-6):
    for rank, state in enumerate(states):
        assert_rank_slices(state.params, want, rank, world, rtol=rtol, atol=atol)


# -- a plain-dict model with what real programs do -----------------------------------------

D, V = 10, 7  # rows of 10 and 7 do not divide 3 ranks


def plain_params():
    rng = np.random.default_rng(0)
    return {"embed": {"w": rng.standard_normal((V, D)).astype(np.float32) * 0.3},
            "block": {"w": rng.standard_normal((D, D)).astype(np.float32) * 0.3,
                      "b": np.zeros(D, np.float32)},
            "mix": {"w": rng.standard_normal((D, D)).astype(np.float32) * 0.3},
            "unused": {"w": np.ones(5, np.float32)}}


@jax.jit  # a jitted piece of the model: inlined, so its unit is cut out on its own
def block(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def plain_loss(p, b):
    h = p["embed"]["w"][b["ids"]]  # a gather of rows by integer ids
    labels = jnp.argmax(b["target"], axis=-1)  # an integer value carried to the end
    h = block(p["block"], h)
    h = jnp.tanh(h @ p["mix"]["w"])
    logits = h @ p["embed"]["w"].T  # the embedding again: tied weights
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels), "h": h.mean()}


def plain_batches(rows=6, steps=3):
    rng = np.random.default_rng(1)
    return [{"ids": rng.integers(0, V, rows).astype(np.int32),
             "target": rng.standard_normal((rows, V)).astype(np.float32)}
            for _ in range(steps)]


@pytest.mark.parametrize("world", [2, 3])
def test_a_plain_loss_at_stage_3_matches_single_process_optax(world):
    params, batches = plain_params(), plain_batches()
    want, losses = optax_reference(params, plain_loss, batches, has_aux=True)
    got = train(plain_loss, params, batches, world, has_aux=True)
    assert_shards_equal([s for s, *_ in got], want, world)
    for _, metrics, tracker, _ in got:
        np.testing.assert_allclose([m["loss"] for m in metrics], losses, rtol=1e-5)
        assert set(metrics[-1]["aux"]) == {"accuracy", "h"}
        assert tracker.live == 0


def test_segments_follow_first_use_and_carry_what_later_ones_read():
    from shard.core.losses._jax import JaxLoss

    params, batches = plain_params(), plain_batches()
    seen = {}

    def check(step, state, comm):
        traced = shard.step._traced.traced(step.config.loss_fn)
        (program,) = [p for (layout, (_, _, shapes)), (p, _) in traced._programs.items()
                      if layout == step.plan.full_layout and shapes[0][0] == (3,)]
        seen["order"] = [list(program.layout.units[u].leaves) for u in program.order]
        seen["unused"] = program.unused
        seen["same"] = traced is shard.step._traced.traced(JaxLoss.shared(plain_loss, True))
        return len(program.segments)

    got = train(plain_loss, params, batches, 2, has_aux=True, check=check)
    assert {out for *_, out in got} == {3}  # embed, block, mix; "unused" has none
    names = [k for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    order = [[jax.tree_util.keystr(names[i]) for i in leaves] for leaves in seen["order"]]
    assert order == [["['embed']['w']"], ["['block']['b']", "['block']['w']"], ["['mix']['w']"]]
    assert seen["unused"] == [3] and seen["same"]


def test_a_forward_keeps_its_matrix_products_and_convolutions_and_recomputes_the_rest():
    # [Note: what a forward keeps]: of a layer's residuals, the outputs of its matrix
    # products without batch dimensions and of its convolutions are kept, besides its
    # inputs; the elementwise work and a batched product are recomputed
    from shard.core.losses._layered import kept_vjp

    rng = np.random.default_rng(0)
    w, x = jnp.asarray(rng.standard_normal((5, 6)), jnp.float32), \
        jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 1, 3, 3)), jnp.float32)

    def f(w, x, k):
        h = x @ w
        scores = jnp.einsum("bi,bj->bij", h, h)  # batch dimension b: recomputed
        c = jax.lax.conv_general_dilated(h[:, None, None, :], k, (1, 1), "SAME")
        return jnp.sum(jnp.tanh(jnp.exp(0.1 * h)) ** 2) + jnp.sum(jnp.sin(scores)) + \
            jnp.sum(jax.nn.relu(c))

    out, vjp = kept_vjp(f, w, x, k)
    own = [r for r in jax.tree_util.tree_leaves(vjp) if not any(r is i for i in (w, x, k))]
    assert sorted(r.shape for r in own) == [(4, 2, 1, 6), (4, 6)]
    np.testing.assert_array_equal(next(r for r in own if r.shape == (4, 6)), x @ w)
    want_out, want_vjp = jax.vjp(f, w, x, k)
    assert len([r for r in jax.tree_util.tree_leaves(want_vjp)
                if not any(r is i for i in (w, x, k))]) > 6  # jax.vjp alone keeps them all
    assert out == want_out
    for got, want in zip(vjp(jnp.float32(1)), want_vjp(jnp.float32(1)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# in the leaves' order, block 110, embed 70, mix 100 and unused 5 elements: at
# 100 block stands alone, embed joins mix and unused (a short tail) joins them
# (the tied embedding's unit carried to its second use); 1000 makes one unit
@pytest.mark.parametrize("min_num_params,names", [
    (100, ["['block']", "['embed'] + ['mix'] + ['unused']"]),
    (1000, ["['block'] + ['embed'] + ['mix'] + ['unused']"])])
def test_small_units_join_until_each_holds_min_num_params(min_num_params, names):
    params, batches = plain_params(), plain_batches()
    want, losses = optax_reference(params, plain_loss, batches, has_aux=True)
    got = train(plain_loss, params, batches, 3, has_aux=True, min_num_params=min_num_params,
                check=lambda step, state, comm: [u.name for u in step.plan.full_layout.units])
    assert_shards_equal([s for s, *_ in got], want, 3)
    for _, metrics, tracker, found in got:
        assert found == names
        np.testing.assert_allclose([m["loss"] for m in metrics], losses, rtol=1e-5)
        assert tracker.live == 0
        split = metrics[-1]["time_ms"]
        if len(names) == 1:  # one segment: its value and gradient in one compiled call
            assert split["compute"] > 0 and split["forward"] == split["backward"] == 0, split
        else:
            assert split["forward"] > 0 and split["backward"] > 0, split


def test_min_num_params_keeps_dtypes_apart_and_is_checked():
    from shard.core._layout import make_layout

    params = {"a": np.zeros(3, np.float32), "b": np.zeros(4, jnp.bfloat16),
              "c": np.zeros(5, jnp.bfloat16), "d": np.zeros(100, np.float32)}
    layout = make_layout(params, world_size=2, min_num_params=50)
    assert [u.name for u in layout.units] == ["['a']", "['b'] + ['c']", "['d']"]
    assert [layout.leaves[i].unit for i in range(4)] == [0, 1, 1, 2]
    comm = ops.spawn(lambda c: c, 1)[0]
    for bad in (-1, 1.5, "100000", True):
        with pytest.raises(ValueError, match="min_num_params must be a whole number of elem"):
            shard.zero3(plain_loss, optimizer=ops.adamw(LR), comm=comm,
                        options=shard.ZeroOptions(min_num_params=bad))
    step = shard.zero3(plain_loss, optimizer=ops.adamw(LR), comm=comm,
                       options=shard.ZeroOptions(min_num_params=1e5))  # as FSDP's docs write it
    assert step.config.min_num_params == 100_000
    layered = shard.Layered([lambda p, x, b: x, lambda p, x, b: jnp.sum(x)])
    with pytest.raises(NotImplementedError, match="min_num_params joins the units of a JAX"):
        shard.zero3(layered, optimizer=ops.adamw(LR), comm=comm,
                    options=shard.ZeroOptions(min_num_params=10))


def test_the_loss_is_traced_once_for_all_thread_ranks_and_steps():
    traces = []

    def loss(p, b):
        traces.append(1)
        return plain_loss(p, b)[0]

    train(loss, plain_params(), plain_batches(rows=8, steps=2), 4)
    assert len(traces) == 1


def test_a_non_scalar_loss_is_named_at_every_stage():
    def per_row(p, b):
        return jnp.sum((b["x"] @ p["w"]) ** 2, axis=1)

    params = {"w": np.ones((3, 2), np.float32)}
    b = {"x": np.ones((4, 3), np.float32)}
    for stage in (2, 3):
        def run(comm, stage=stage):
            step = getattr(shard, f"zero{stage}")(per_row, optimizer=ops.adamw(LR), comm=comm)
            with pytest.raises(TypeError, match=r"scalar; it returned shape \(2,\)"):
                step(step.init(params), shard.split_batch(b, rank=comm.rank, world_size=2))
        ops.spawn(run, 2)


# -- models written with flax nnx and equinox ----------------------------------------------

flax = pytest.importorskip("flax")
eqx = pytest.importorskip("equinox")
from flax import nnx  # noqa: E402


class CNN(nnx.Module):
    """flax's MNIST tutorial CNN (smaller channels and images)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * 2 * 8, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


class Block(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, d, key):
        k1, k2 = jax.random.split(key)
        self.attention = eqx.nn.MultiheadAttention(2, d, key=k1)
        self.norm = eqx.nn.LayerNorm(d)
        self.mlp = eqx.nn.MLP(d, d, 2 * d, 1, key=k2)

    def __call__(self, x):
        x = x + self.attention(x, x, x)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm)(x))


class Encoder(eqx.Module):
    embed: eqx.nn.Embedding
    layers: list
    head: eqx.nn.Linear

    def __init__(self, key, d=12, vocab=11, depth=3):
        keys = jax.random.split(key, depth + 2)
        self.embed = eqx.nn.Embedding(vocab, d, key=keys[0])
        self.layers = [Block(d, k) for k in keys[1:-1]]
        self.head = eqx.nn.Linear(d, 2, key=keys[-1])

    def __call__(self, ids):
        x = jax.vmap(self.embed)(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(axis=0))


def cnn_case():
    graphdef, state = nnx.split(CNN(rngs=nnx.Rngs(0)))

    def loss(s, b):
        logits = nnx.merge(graphdef, s)(b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    rng = np.random.default_rng(2)
    batches = [{"x": rng.standard_normal((4, 8, 8, 1)).astype(np.float32),
                "y": rng.integers(0, 10, 4).astype(np.int32)} for _ in range(2)]
    return state, loss, batches, None


def encoder_case():
    params, static = eqx.partition(Encoder(jax.random.key(0)), eqx.is_array)

    def loss(p, b):
        model = eqx.combine(p, static)
        logits = jax.vmap(model)(b["ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    rng = np.random.default_rng(3)
    batches = [{"ids": rng.integers(0, 11, (4, 5)).astype(np.int32),
                "y": rng.integers(0, 2, 4).astype(np.int32)} for _ in range(2)]
    return params, loss, batches, 2  # a unit per field and per layer


def full_unit_bytes(params, units):
    layout = shard.core._layout.make_layout(params, world_size=1, units=units)
    return [u.local_size * 4 for u in layout.units]


@pytest.mark.slow
@pytest.mark.parametrize("case", [cnn_case, encoder_case], ids=["flax-nnx-cnn", "equinox"])
def test_library_models_hold_about_two_units_and_match_optax(case):
    params, loss, batches, units = case()
    want, losses = optax_reference(params, loss, batches)
    sizes = full_unit_bytes(params, units)
    got = train(loss, params, batches, 2, units=units,
                check=lambda step, state, comm: step.evaluate(state, batches[0]))
    assert_shards_equal([s for s, *_ in got], want, 2, rtol=1e-4, atol=1e-5)
    for _, metrics, tracker, evaluated in got:
        np.testing.assert_allclose([m["loss"] for m in metrics], losses, rtol=1e-5)
        # a unit's gather buffer and its copy-out, or two units; every unit
        # gathered at once holds them all plus the largest gather buffer
        assert tracker.peak <= 2 * max(sizes), (tracker.peak, sizes)
        assert tracker.peak < sum(sizes) + max(sizes), (tracker.peak, sizes)
        np.testing.assert_allclose(evaluated, float(loss(want, batches[0])), rtol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_evaluate_returns_aux_and_takes_an_eval_mode_loss(stage):
    import functools

    params, batches = plain_params(), plain_batches()

    def loss(p, b, train=True):
        value, aux = plain_loss(p, b)
        return (value * 1.5 if train else value), {**aux, "train": train}

    def run(comm):
        step = getattr(shard, f"zero{stage}")(loss, optimizer=ops.adamw(LR), comm=comm,
                                              has_aux=True)
        state = step.init(params)
        mine = shard.split_batch(batches[0], rank=comm.rank, world_size=2)
        with pytest.raises(TypeError, match="loss_fn must be a JAX function"):
            step.evaluate(state, mine, loss_fn=object())
        return (step.evaluate(state, mine),
                step.evaluate(state, mine, loss_fn=functools.partial(loss, train=False)))

    want_train, _ = loss(params, batches[0])
    want_eval, want_aux = loss(params, batches[0], train=False)
    for (train_value, train_aux), (eval_value, eval_aux) in ops.spawn(run, 2):
        np.testing.assert_allclose(train_value, float(want_train), rtol=1e-5)
        np.testing.assert_allclose(eval_value, float(want_eval), rtol=1e-5)
        assert train_aux["train"] == 1.0 and eval_aux["train"] == 0.0  # bools average as numbers
        np.testing.assert_allclose(eval_aux["accuracy"], float(want_aux["accuracy"]), rtol=1e-6)
