"""A JAX model's non-trainable state (see [Note: model state] in
shard/core/losses/_jax.py): flax nnx BatchNorm statistics live in the train state,
thread through micro-batches, are averaged over the data ranks after each
step, and match a per-rank reference of the same algorithm with optax; with
the data ranks bound to BatchNorm's axis_name, they are the global batch's,
as flax's own train_step on the whole batch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ops
import shard

nnx = pytest.importorskip("flax.nnx")

LR, WD = 1e-2, 0.01


class CNN(nnx.Module):
    """flax's MNIST CNN with BatchNorm (small channels and images; no bias before
    a BatchNorm, which removes it: its gradient is rounding noise that Adam
    would scale up)."""

    def __init__(self, *, rngs, axis_name=None):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(4, axis_name=axis_name, rngs=rngs)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(8, axis_name=axis_name, rngs=rngs)
        self.linear = nnx.Linear(4 * 4 * 8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.bn1(self.conv1(x))), window_shape=(2, 2), strides=(2, 2))
        x = nnx.relu(self.bn2(self.conv2(x)))
        return self.linear(x.reshape(x.shape[0], -1))


GRAPHDEF, PARAMS, STATS = nnx.split(CNN(rngs=nnx.Rngs(0)), nnx.Param, nnx.BatchStat)


def loss(params, batch, stats, train=True):
    model = nnx.merge(GRAPHDEF, params, stats)
    model.train() if train else model.eval()
    logits = model(batch["x"])
    value = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return value, nnx.state(model, nnx.BatchStat)


def aux_loss(params, batch, stats):
    value, new = loss(params, batch, stats)
    return value, (new, {"doubled": 2 * value})


def data(steps=3, rows=8):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((rows, 8, 8, 1)).astype(np.float32),
             "y": rng.integers(0, 10, rows).astype(np.int32)} for _ in range(steps)]


# the statistics rebuilt inside the differentiated function (nnx Variables made
# outside it refuse the update), as the step does
GRAD = jax.jit(jax.value_and_grad(
    lambda p, b, s: loss(p, b, jax.tree_util.tree_map(lambda x: x, s)), has_aux=True))


def reference(batches, world, micro):
    """The algorithm in one process: each rank's micro-batches in turn from its
    statistics, gradients averaged, statistics averaged over the ranks."""
    tx = optax.adamw(LR, weight_decay=WD)
    params, stats = PARAMS, STATS
    opt = tx.init(params)
    for b in batches:
        grads, news = [], []
        for r in range(world):
            mine = shard.split_batch(b, rank=r, world_size=world)
            own = stats
            for m in range(micro):
                part = shard.split_batch(mine, rank=m, world_size=micro)
                (_, own), g = GRAD(params, part, own)
                grads.append(g)
            news.append(own)
        grads = jax.tree_util.tree_map(lambda *g: sum(g) / len(g), *grads)
        stats = jax.tree_util.tree_map(lambda *s: sum(s) / len(s), *news)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    return params, stats


def train(fn, batches, world, stage, micro=1, has_aux=False, check=None):
    def run(comm):
        step = getattr(shard, f"zero{stage}")(fn, optimizer=ops.adamw(LR, weight_decay=WD),
                                              comm=comm, has_aux=has_aux)
        state = step.init(PARAMS, model_state=STATS)
        metrics = []
        for b in batches:
            mine = shard.split_batch(b, rank=comm.rank, world_size=world)
            if micro > 1:
                mine = shard.MicroBatches([shard.split_batch(mine, rank=m, world_size=micro)
                                           for m in range(micro)])
            state, m = step(state, mine)
            metrics.append(m)
        return state, metrics, check(step, state, comm) if check else None

    return ops.spawn(run, world)


def assert_tree_close(got, want, rtol=1e-4, atol=1e-5):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("stage, micro", [(1, 2), (3, 1)])
def test_batch_norm_statistics_train_with_the_params(stage, micro):
    batches = data()
    want_params, want_stats = reference(batches, 2, micro)
    for rank, (state, _, _) in enumerate(train(loss, batches, 2, stage, micro)):
        assert_tree_close(state.model_state, want_stats)  # the same on every rank
        assert_tree_close(state.params, shard.partition(want_params, rank=rank, world_size=2))


def test_the_model_state_changes_every_step_and_the_old_state_keeps_its_own():
    batches = data(steps=1)

    def run(comm):
        step = shard.zero2(loss, optimizer=ops.adamw(LR), comm=comm)
        first = step.init(PARAMS, model_state=STATS)
        before = jax.tree_util.tree_map(np.copy, first.model_state)
        second, _ = step(first, shard.split_batch(batches[0], rank=comm.rank, world_size=2))
        for a, b in zip(jax.tree_util.tree_leaves(before),
                        jax.tree_util.tree_leaves(first.model_state), strict=True):
            np.testing.assert_array_equal(a, b)
        moved = [not np.allclose(a, b) for a, b in zip(
            jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(second.model_state),
            strict=True)]
        return all(moved)

    assert all(ops.spawn(run, 2))


def test_aux_and_evaluation_in_eval_mode_with_the_running_statistics():
    batches = data(steps=2)
    want_params, want_stats = reference(batches, 2, 1)
    want_eval = float(jax.jit(functools.partial(loss, train=False))(want_params, batches[0],
                                                                     want_stats)[0])

    def check(step, state, comm):
        mine = shard.split_batch(batches[0], rank=comm.rank, world_size=2)
        def eval_loss(p, b, s):
            value, new = loss(p, b, s, train=False)
            return value, (new, {"doubled": 0.0})

        return step.evaluate(state, mine, loss_fn=eval_loss)

    for _, metrics, (value, aux) in train(aux_loss, batches, 2, 3, has_aux=True, check=check):
        np.testing.assert_allclose(metrics[-1]["aux"]["doubled"], 2 * metrics[-1]["loss"],
                                   rtol=1e-5)
        np.testing.assert_allclose(value, want_eval, rtol=1e-4)
        assert aux == {"doubled": 0.0}


def test_what_is_refused_is_named():
    def run(comm):
        step = shard.zero2(loss, optimizer=ops.adamw(LR), comm=comm)
        with pytest.raises(TypeError, match=r"model_state.*PRNG key"):
            step.init(PARAMS, model_state={"key": jax.random.key(0)})

        def wrong(p, b, s):
            return loss(p, b, s)[0]

        bad = shard.zero2(wrong, optimizer=ops.adamw(LR), comm=comm)
        state = bad.init(PARAMS, model_state=STATS)
        mine = shard.split_batch(data(1)[0], rank=comm.rank, world_size=2)
        with pytest.raises(TypeError, match=r"must return \(loss, new_model_state\)"):
            bad(state, mine)

        def reshaped(p, b, s):
            value, new = loss(p, b, s)
            return value, jax.tree_util.tree_map(lambda x: x[:1], new)

        odd = shard.zero2(reshaped, optimizer=ops.adamw(LR), comm=comm)
        state = odd.init(PARAMS, model_state=STATS)
        with pytest.raises(TypeError, match=r"model_state.*came back as float32\[1\]"):
            odd(state, mine)
        state.check_live()  # refused before anything changed

    ops.spawn(run, 2)


def test_the_model_state_is_checkpointed_and_resumes_at_another_world_size(tmp_path):
    batches = data(steps=2)
    saved = train(loss, batches[:1], 2, 3, check=lambda step, state, comm: shard.save(
        state, tmp_path / "ck", comm=comm))
    want = saved[0][0].model_state

    def resume(comm):
        step = shard.zero1(loss, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        step.init(PARAMS, model_state=STATS)
        state, _ = shard.load(tmp_path / "ck", step, comm=comm)
        assert_tree_close(state.model_state, want, rtol=0, atol=0)
        assert jax.tree_util.tree_structure(state.model_state) == \
            jax.tree_util.tree_structure(STATS)
        state, _ = step(state, batches[1])
        return state

    ops.spawn(resume, 1)
    ocp = pytest.importorskip("orbax.checkpoint")
    shard.checkpoint.to_orbax(tmp_path / "ck", tmp_path / "orbax")
    restored = ocp.StandardCheckpointer().restore((tmp_path / "orbax").absolute())
    for path, x in jax.tree_util.tree_leaves_with_path(want):  # nested dicts, as saved
        have = restored["model_state"]
        for key in path:
            have = have[getattr(key, "key", getattr(key, "idx", getattr(key, "name", None)))]
        np.testing.assert_array_equal(np.asarray(have), np.asarray(x))
    bad = {"other": np.zeros(3, np.float32)}

    def mismatched(comm):
        step = shard.zero1(loss, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        step.init(PARAMS, model_state=bad)
        with pytest.raises(shard.CheckpointError, match=r"model state has leaves"):
            shard.load(tmp_path / "ck", step, comm=comm)

    ops.spawn(mismatched, 1)


def test_every_floating_leaf_is_averaged_bfloat16_too():
    from types import SimpleNamespace

    from shard.step._grads import mean_model_state

    def run(comm):
        plan = SimpleNamespace(config=SimpleNamespace(comm=comm, replicate=None, ranks=2))
        tree = {"mean": np.full(3, 1.0 + comm.rank, jnp.bfloat16),
                "var": np.full(2, 2.0 * comm.rank, np.float32),
                "count": np.asarray(10 + comm.rank, np.int32)}
        return mean_model_state(plan, tree)

    for out in ops.spawn(run, 2):
        assert out["mean"].dtype == jnp.bfloat16
        np.testing.assert_array_equal(out["mean"].astype(np.float32), [1.5] * 3)
        np.testing.assert_array_equal(out["var"], [1.0, 1.0])
        assert int(out["count"]) == 10  # rank 0's


def test_flax_batch_norm_trains_in_a_pure_step_inside_scan():
    """flax nnx's BatchNorm as flax writes it, its statistics the model state of
    shard.pure_zero3, three steps in one jax.lax.scan: the one-process
    algorithm's params and statistics."""
    batches = data()
    want_params, want_stats = reference(batches, 2, 1)

    def run(comm):
        step = shard.pure_zero3(loss, optimizer=optax.adamw(LR, weight_decay=WD), comm=comm)
        mine = [shard.split_batch(b, rank=comm.rank, world_size=2) for b in batches]
        stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *mine)
        state, _ = jax.jit(lambda s, b: jax.lax.scan(step, s, b))(
            step.init(PARAMS, model_state=STATS), stacked)
        return jax.device_get(step.whole(state.params)), jax.device_get(state.model_state)

    for params, stats in ops.spawn(run, 2):
        assert_tree_close(stats, want_stats)
        assert_tree_close(params, want_params)


def flax_train_steps(batches):
    """flax's own training loop in one process on the whole batch: nnx.Optimizer
    and nnx.value_and_grad inside nnx.jit, as flax's MNIST example writes it."""
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(LR, weight_decay=WD), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        def loss_fn(model):
            logits = model(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        value, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return value

    losses = [float(train_step(model, optimizer, b)) for b in batches]
    _, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    return params, stats, losses


@pytest.mark.parametrize("kind, world", [("pure_zero3", 2), ("pure_zero3", 3), ("zero3", 2),
                                         ("zero1", 3), ("hsdp", 4), ("zero3-standin", 2)])
def test_synchronised_statistics_match_flax_s_own_train_step_on_the_whole_batch(kind, world):
    """BatchNorm(axis_name="data"), as flax writes it for data parallelism, under a
    step given axis_name="data" (pure_zero3; zero3, whose traced units carry the
    collectives; zero1's one program): each forward normalises with the global
    batch's statistics (under HSDP, 2 replicas of 2 shards, over all 4 data
    ranks; with the params and statistics given on the device stand-in, which
    refuses implicit copies to the host, as CuPy does), so the ranks train as
    flax's own train_step on the whole batch in one process; the same model
    without the axis (each rank's own statistics, as torch's BatchNorm under
    DDP) ends elsewhere."""
    batches = data(rows=12)
    want_params, want_stats, want_losses = flax_train_steps(batches)
    graphdef, params, stats = nnx.split(CNN(rngs=nnx.Rngs(0), axis_name="data"), nnx.Param,
                                        nnx.BatchStat)

    def synced(p, b, s):
        model = nnx.merge(graphdef, p, s)
        logits = model(b["x"])
        value = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
        return value, nnx.state(model, nnx.BatchStat)

    def run(comm, fn, axis_name):
        if kind == "pure_zero3":
            step = shard.pure_zero3(fn, optimizer=optax.adamw(LR, weight_decay=WD), comm=comm,
                                    axis_name=axis_name)
            call, whole = jax.jit(step), lambda s: step.whole(s.params)
        elif kind == "zero3-standin":
            from ops.testing import STANDIN, to_device

            step = shard.zero3(fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm,
                               options=shard.ZeroOptions(axis_name=axis_name))
            state, losses = step.init(to_device(params, STANDIN),
                                      model_state=to_device(stats, STANDIN)), []
            for b in batches:
                state, m = step(state, shard.split_batch(b, rank=comm.rank, world_size=world))
                losses.append(float(m["loss"]))
            whole = jax.tree_util.tree_map(STANDIN.to_host, shard.gather(state, comm))
            return whole, state.model_state, losses
        elif kind == "hsdp":
            mesh = shard.Mesh(comm, {"replicate": 2, "shard": 2})
            step = shard.zero3(fn, optimizer=ops.adamw(LR, weight_decay=WD), mesh=mesh,
                               options=shard.ZeroOptions(axis_name=axis_name))
            call, whole = step, lambda s: shard.gather(s, mesh["shard"])
        else:
            step = getattr(shard, kind)(fn, optimizer=ops.adamw(LR, weight_decay=WD),
                                        comm=comm, options=shard.ZeroOptions(axis_name=axis_name))
            call, whole = step, lambda s: shard.gather(s, comm)
        state, losses = step.init(params, model_state=stats), []
        for b in batches:
            state, m = call(state, shard.split_batch(b, rank=comm.rank, world_size=world))
            losses.append(float(m["loss"]))
        return jax.device_get(whole(state)), jax.device_get(state.model_state), losses

    for got_params, got_stats, losses in ops.spawn(run, world, synced, "data"):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        assert_tree_close(got_stats, want_stats)
        assert_tree_close(got_params, want_params)
    _, own_stats, own_losses = ops.spawn(run, world, loss, None)[0]
    assert abs(own_losses[-1] - want_losses[-1]) > 1e-3
    with pytest.raises(AssertionError):
        assert_tree_close(own_stats, want_stats)
