"""shard.pure_zero3: ZeRO-3 as one JAX function, inside the user's jax.jit and
jax.lax.scan, against optax in one process (each rank's shard equal to the
reference's rows), at world sizes that divide no leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ops
import shard

STEPS, ROWS = 4, 12


def params():
    r = np.random.default_rng(0)
    return {"embed": r.normal(size=(7, 5)).astype(np.float32),
            "mlp": {"w": r.normal(size=(5, 11)).astype(np.float32) * 0.3,
                    "b": np.zeros(11, np.float32)},
            "head": r.normal(size=(11, 3)).astype(np.float32) * 0.3,
            "scale": np.float32(1.5)}


def loss(p, b):
    h = jnp.tanh(b["x"] @ p["embed"])
    h = jnp.tanh(h @ p["mlp"]["w"] + p["mlp"]["b"])
    return jnp.mean((p["scale"] * h @ p["head"] - b["y"]) ** 2)


def data():
    r = np.random.default_rng(1)
    return {"x": r.normal(size=(STEPS, ROWS, 7)).astype(np.float32),
            "y": r.normal(size=(STEPS, ROWS, 3)).astype(np.float32)}


def tx():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def reference():
    """optax in one process on the whole batch, one step per batch."""
    p, d, opt = jax.tree_util.tree_map(jnp.asarray, params()), data(), tx()
    state, losses = opt.init(p), []
    for i in range(STEPS):
        value, g = jax.value_and_grad(loss)(p, {k: v[i] for k, v in d.items()})
        updates, state = opt.update(g, state, p)
        p = optax.apply_updates(p, updates)
        losses.append(float(value))
    return p, losses


def mine(d, comm):
    n = ROWS // comm.world_size
    return {k: v[:, comm.rank * n:(comm.rank + 1) * n] for k, v in d.items()}


# joined: in the leaves' order embed 35 and head 33 elements make one unit of
# at least 60, mlp's 66 another, which the scalar (a short tail) joins
JOINED = ["['embed'] + ['head']", "['mlp'] + ['scale']"]


@pytest.mark.parametrize("units", ["top-level", "one", "joined"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_steps_inside_jit_and_scan_match_optax_in_one_process(world, units):
    """Each unit's split leaves go as one gathered buffer, its replicated ones
    as another: top-level subtrees, every leaf (the scalar too) in one, or
    small units joined by min_num_params."""
    want, want_losses = reference()

    def run(comm):
        step = shard.pure_zero3(loss, optimizer=tx(), comm=comm,
                                units=(lambda path: 0) if units == "one" else None,
                                min_num_params=60 if units == "joined" else 0)
        state = step.init(params())
        if units == "joined":
            assert [u.name for u in step.program.layout.units] == JOINED
        scan = jax.jit(lambda s, b: jax.lax.scan(step, s, b))
        state, metrics = scan(state, mine(data(), comm))
        return jax.device_get(state), np.asarray(metrics["loss"]), np.asarray(
            metrics["grad_norm"]), jax.device_get(step.whole(state.params))

    for rank, (state, losses, norms, whole) in enumerate(ops.spawn(run, world)):
        assert int(state.step) == STEPS
        np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
        assert norms.shape == (STEPS,) and np.all(norms > 0.5)  # the clip acted
        for path, got in jax.tree_util.tree_leaves_with_path(state.params):
            ref = np.asarray(dict(jax.tree_util.tree_leaves_with_path(want))[path])
            if ref.ndim:  # this rank's rows, padded with zero rows
                rows = -(-ref.shape[0] // world)
                part = ref[rank * rows:(rank + 1) * rows]
                assert got.shape == (rows, *ref.shape[1:])
                np.testing.assert_allclose(got[:len(part)], part, rtol=2e-5, atol=2e-6,
                                           err_msg=jax.tree_util.keystr(path))
                np.testing.assert_array_equal(got[len(part):], 0)
            else:
                np.testing.assert_allclose(got, ref, rtol=2e-5)
        for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_a_jitted_step_at_a_time_is_the_scan_and_aux_comes_back():
    def run(comm):
        step = shard.pure_zero3(lambda p, b: (loss(p, b), b["x"].shape[0]), optimizer=tx(),
                                comm=comm, has_aux=True)
        d = mine(data(), comm)
        state = step.init(params())
        one = jax.jit(step)
        for i in range(STEPS):
            state, metrics = one(state, {k: v[i] for k, v in d.items()})
        again, _ = jax.jit(lambda s, b: jax.lax.scan(step, s, b))(step.init(params()), d)
        return jax.device_get(state), jax.device_get(again), int(metrics["aux"])

    for state, again, aux in ops.spawn(run, 2):
        assert aux == ROWS // 2
        for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(again),
                        strict=True):
            np.testing.assert_array_equal(a, b)


def test_refusals_name_the_problem():
    with pytest.raises(TypeError, match=r"optax GradientTransformation.*zero3's kernels"):
        shard.pure_zero3(loss, optimizer=ops.adamw(1e-3), comm=None)
    with pytest.raises(TypeError, match=r"comm must be this rank's ops\.Communicator"):
        shard.pure_zero3(loss, optimizer=tx(), comm=None)

    def lamb(comm):
        shard.pure_zero3(loss, optimizer=optax.lamb(1e-3), comm=comm).init(params())

    with pytest.raises(TypeError, match=r"scale_by_trust_ratio.*shard.zero3"):
        ops.spawn(lamb, 2)

    def clip_last(comm):
        opt = optax.chain(optax.adam(1e-3), optax.clip_by_global_norm(1.0))
        shard.pure_zero3(loss, optimizer=opt, comm=comm).init(params())

    with pytest.raises(ValueError, match=r"clip_by_global_norm needs the whole tree's norm"):
        ops.spawn(clip_last, 2)

    def vector(comm):
        step = shard.pure_zero3(lambda p, b: b["x"] @ p["embed"][:, 0], optimizer=tx(),
                                comm=comm)
        step(step.init(params()), {k: v[0] for k, v in data().items()})

    with pytest.raises(TypeError, match=r"must return a scalar; it returned shape \(12,\)"):
        ops.spawn(vector, 1)

    with pytest.raises(ValueError, match=r"min_num_params must be a whole number of elements"):
        shard.pure_zero3(loss, optimizer=tx(), comm=ops.spawn(lambda c: c, 1)[0],
                         min_num_params=-1)

    def early(comm):
        shard.pure_zero3(loss, optimizer=tx(), comm=comm)(None, None)

    with pytest.raises(RuntimeError, match="call init"):
        ops.spawn(early, 1)


def test_whole_gives_back_every_leaf_exactly_whatever_its_dtype_and_unit():
    import ml_dtypes

    r = np.random.default_rng(2)
    mixed = {"a": r.normal(size=(7, 5)).astype(np.float32),
             "b": {"w": r.normal(size=(5, 3)).astype(ml_dtypes.bfloat16),
                   "v": r.normal(size=(4,)).astype(np.float32),
                   "s": np.asarray(2.0, ml_dtypes.bfloat16)},
             "c": r.normal(size=(1, 2)).astype(ml_dtypes.bfloat16)}

    def run(comm, units):
        step = shard.pure_zero3(lambda p, b: jnp.sum(p["a"]) * b, optimizer=optax.sgd(0.1),
                                comm=comm, units=units)
        state = step.init(mixed)
        return jax.device_get(jax.jit(step.whole)(state.params)), jax.device_get(state.params)

    for units in (None, lambda path: 0):
        for rank, (whole, mine) in enumerate(ops.spawn(lambda c, u=units: run(c, u), 3)):
            for path, want in jax.tree_util.tree_leaves_with_path(mixed):
                got = dict(jax.tree_util.tree_leaves_with_path(whole))[path]
                assert got.dtype == want.dtype and got.shape == want.shape
                np.testing.assert_array_equal(np.asarray(got, np.float32),
                                              np.asarray(want, np.float32))
            assert mine["c"].shape == (1, 2)  # a row a rank: rank 0's the leaf, the rest padding
            np.testing.assert_array_equal(np.asarray(mine["c"], np.float32),
                                          np.asarray(mixed["c"], np.float32) if rank == 0
                                          else 0)


def stateful_loss(p, b, stats, *, key):
    """A running mean of the hidden features (batch-norm's statistics) and
    dropout on them: the model state and the key as zero3 hands them over."""
    h = jnp.tanh(b["x"] @ p["embed"])
    keep = jax.random.bernoulli(key, 0.8, h.shape)
    h = jnp.where(keep, h / 0.8, 0.0) - stats["mean"]
    h = jnp.tanh(h @ p["mlp"]["w"] + p["mlp"]["b"])
    value = jnp.mean((p["scale"] * h @ p["head"] - b["y"]) ** 2)
    new = {"mean": 0.9 * stats["mean"] + 0.1 * jnp.mean(h[:, :5], axis=0),
           "seen": stats["seen"] + b["x"].shape[0]}
    return value, (new, jnp.sum(keep))


def test_model_state_keys_aux_and_evaluate_are_zero3_s():
    """A loss with a model state, dropout from key= and an aux output: the pure
    step's losses, aux, statistics and params are zero3's on the same optax
    transformation (its keys are shard.step_key's), and evaluate agrees."""
    stats = {"mean": np.zeros(5, np.float32), "seen": np.int32(0)}
    key = jax.random.key(7)

    def run(comm, pure):
        d = mine(data(), comm)
        batches = [{k: v[i] for k, v in d.items()} for i in range(STEPS)]
        if pure:
            step = shard.pure_zero3(stateful_loss, optimizer=tx(), comm=comm, has_aux=True,
                                    key=key)
            state, metrics = jax.jit(lambda s, b: jax.lax.scan(step, s, b))(
                step.init(params(), model_state=stats), d)
            ev = step.evaluate(state, batches[0])
            return (np.asarray(metrics["loss"]), np.asarray(metrics["aux"]),
                    jax.device_get(state.model_state), jax.device_get(step.whole(state.params)),
                    float(ev[0]))
        step = shard.zero3(stateful_loss, optimizer=tx(), comm=comm, has_aux=True,
                           options=shard.ZeroOptions(key=key))
        state, losses, aux = step.init(params(), model_state=stats), [], []
        for b in batches:
            state, m = step(state, b)
            losses.append(m["loss"])
            aux.append(m["aux"])
        return (np.asarray(losses), np.asarray(aux), state.model_state,
                shard.gather(state, comm), float(step.evaluate(state, batches[0])[0]))

    for (l1, a1, s1, p1, e1), (l2, a2, s2, p2, e2) in zip(
            ops.spawn(lambda c: run(c, True), 2), ops.spawn(lambda c: run(c, False), 2),
            strict=True):
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        np.testing.assert_allclose(a1, a2)  # the same masks: the same keys
        np.testing.assert_allclose(s1["mean"], s2["mean"], rtol=1e-5, atol=1e-7)
        assert int(s1["seen"]) == int(s2["seen"]) == STEPS * ROWS // 2
        for x, y in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2),
                        strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(e1, e2, rtol=1e-5)


def test_a_model_state_loss_that_returns_no_state_is_refused_naming_the_form():
    def run(comm):
        step = shard.pure_zero3(lambda p, b, s: loss(p, b), optimizer=tx(), comm=comm)
        state = step.init(params(), model_state={"m": np.zeros(3, np.float32)})
        step(state, {k: v[0] for k, v in data().items()})

    with pytest.raises(TypeError, match=r"returns \(loss, new_model_state\); got"):
        ops.spawn(run, 1)


def test_the_ranks_share_one_compiled_program():
    """Thread ranks that share the loss and the optax transformation object
    share one program, compiled once for the shapes of its calls; its
    collectives find each rank's communicator from the rank it is given."""
    want, want_losses = reference()
    opt = tx()  # one transformation object for every rank

    def run(comm):
        step = shard.pure_zero3(loss, optimizer=opt, comm=comm)
        state, d, losses = step.init(params()), mine(data(), comm), []
        for i in range(STEPS):
            state, m = step(state, {k: v[i] for k, v in d.items()})
            losses.append(float(m["loss"]))
        return step.program, losses, np.asarray(state.params["embed"])

    out = ops.spawn(run, 3)
    assert out[0][0] is out[1][0] is out[2][0] and len(out[0][0]._compiled) == 1
    for rank, (_, losses, embed) in enumerate(out):
        np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
        rows = np.asarray(want["embed"])[rank * 3:(rank + 1) * 3]
        np.testing.assert_allclose(embed[:len(rows)], rows, rtol=2e-5, atol=2e-6)


def test_frozen_leaves_are_zero3_s_and_their_gradients_are_never_reduced(monkeypatch):
    """trainable= as zero3 takes it: the frozen leaves stay as given, keep no
    optax state, and no reduce-scatter carries them; the trainable ones train
    as under zero3 with the same mask and transformation."""
    from shard.tensor_parallel._megatron import Collectives

    mask = {"embed": False, "mlp": {"w": True, "b": False}, "head": True, "scale": True}
    opt = tx()
    scattered = []
    host = Collectives.host

    def spy(self, name, x):
        if name == "reduce_scatter" and self.comm.rank == 0:
            scattered.append(np.asarray(x).size)
        return host(self, name, x)

    monkeypatch.setattr(Collectives, "host", spy)

    def run(comm, pure):
        d = mine(data(), comm)
        if pure:
            step = shard.pure_zero3(loss, optimizer=opt, comm=comm, trainable=mask)
            state, _ = jax.jit(lambda s, b: jax.lax.scan(step, s, b))(step.init(params()), d)
            return (jax.device_get(step.whole(state.params)),
                    len(jax.tree_util.tree_leaves(state.opt_state)))
        step = shard.zero3(loss, optimizer=opt, comm=comm, trainable=mask)
        state = step.init(params())
        for i in range(STEPS):
            state, _ = step(state, {k: v[i] for k, v in d.items()})
        return shard.gather(state, comm), None

    got, states = ops.spawn(lambda c: run(c, True), 2)[0]
    want, _ = ops.spawn(lambda c: run(c, False), 2)[0]
    for path, w in jax.tree_util.tree_leaves_with_path(want):
        g = dict(jax.tree_util.tree_leaves_with_path(got))[path]
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    start = params()
    np.testing.assert_array_equal(got["embed"], start["embed"])
    np.testing.assert_array_equal(got["mlp"]["b"], start["mlp"]["b"])
    assert states == 1 + 2 * 3  # Adam's count and two moments of the 3 trainable leaves (of 5)
    # each step reduce-scatters mlp.w's and head's rows alone: 3 x 11 and 6 x 3 on each of 2
    # ranks
    assert scattered == [2 * 6 * 3, 2 * 3 * 11] * STEPS or \
        scattered == [2 * 3 * 11, 2 * 6 * 3] * STEPS


OUTSIDE_PYTEST = """
import jax, numpy as np, optax, ops, shard
import jax.numpy as jnp

def loss(p, b):
    return jnp.mean((b @ p["w"]) ** 2)

opt = optax.adam(1e-2)

def run(comm):
    step = shard.pure_zero3(loss, optimizer=opt, comm=comm)
    state = step.init({"w": np.ones((5, 3), np.float32)})
    for _ in range(2):
        state, _ = step(state, jnp.ones((4, 5)))
    return float(step.evaluate(state, jnp.ones((4, 5)))), np.asarray(step.whole(state.params)["w"])

(a, wa), (b, wb) = ops.spawn(run, 2, timeout=60)
assert a == b and (wa == wb).all()
print("OK")
"""


@pytest.mark.multiprocess
def test_steps_whole_and_evaluate_called_as_they_are_by_every_rank_at_once():
    """In a fresh interpreter with JAX's defaults (one CPU device, no test
    configuration), every rank calling the step, whole and evaluate at once
    runs them to the end: none waits on another rank's first call."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", OUTSIDE_PYTEST], env=env, timeout=300,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_a_step_outlives_its_group_leaving_the_registry(monkeypatch):
    """The registry of ranks' communicators is bounded: a step whose group was
    dropped from it (many groups later) registers again and steps on."""
    import shard._pure_program as program

    opt = tx()

    def run(comm):
        step = shard.pure_zero3(loss, optimizer=opt, comm=comm)
        state, d = step.init(params()), mine(data(), comm)
        state, _ = step(state, {k: v[0] for k, v in d.items()})
        comm.barrier()
        if comm.rank == 0:
            program._GROUPS.clear()
        comm.barrier()
        state, m = step(state, {k: v[1] for k, v in d.items()})
        return float(m["loss"])

    want = reference()[1][1]
    for got in ops.spawn(run, 2):
        np.testing.assert_allclose(got, want, rtol=2e-6)


def test_the_loss_reduces_over_the_data_axis_by_name():
    """With axis_name, the loss's jax.lax collectives over that name span the data
    ranks, as under shard_map: psum and pmean of the ranks' values, axis_index
    the rank, and the gradient through pmean the one-process gradient of the
    global mean (three sgd steps inside jax.jit and scan, at 3 ranks)."""
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal((4, 2)).astype(np.float32)
    xs = rng.standard_normal((3, 6, 4)).astype(np.float32)  # 3 steps of 6 rows

    def coupled(p, x):  # every rank's loss is the square of the global batch's mean output
        return jnp.sum(jax.lax.pmean(jnp.mean(x @ p["w"], axis=0), "batch") ** 2)

    def whole_batch(p, x):  # one process
        return jnp.sum(jnp.mean(x @ p["w"], axis=0) ** 2)

    want = {"w": jnp.asarray(w0)}
    for x in xs:
        g = jax.grad(whole_batch)(want, x)
        want = jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, want, g)

    def probe(p, x):
        value = jnp.mean((x @ p["w"]) ** 2)
        return value, {"rank": jax.lax.axis_index("batch"),
                       "ranks": jax.lax.psum(1.0, "batch"),
                       "global mean": jax.lax.pmean(jnp.mean(x), "batch")}

    def run(comm):
        step = shard.pure_zero3(coupled, optimizer=optax.sgd(0.1), comm=comm, axis_name="batch")
        mine = np.stack([shard.split_batch(x, rank=comm.rank, world_size=3) for x in xs])
        state, _ = jax.jit(lambda s, b: jax.lax.scan(step, s, b))(step.init({"w": w0}), mine)
        seen = shard.pure_zero3(probe, optimizer=optax.sgd(0.1), comm=comm, has_aux=True,
                                axis_name="batch")
        _, aux = seen.evaluate(seen.init({"w": w0}), mine[0])
        return jax.device_get(step.whole(state.params)), jax.device_get(aux)

    for got, aux in ops.spawn(run, 3):
        np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-6)
        assert float(aux["rank"]) == 1.0  # ranks 0, 1 and 2, averaged over the ranks
        assert float(aux["ranks"]) == 3.0
        np.testing.assert_allclose(float(aux["global mean"]), xs[0].mean(), rtol=1e-5)


def test_collectives_over_the_data_axis_that_are_not_built_are_refused_by_name():
    def pmax(p, x):
        return jnp.sum(jax.lax.pmax(x @ p["w"], "data"))

    def in_scan(p, x):
        def body(c, row):
            return c + jax.lax.psum(jnp.sum(row @ p["w"]), "data"), None
        return jax.lax.scan(body, 0.0, x)[0]

    def try_(fn, **kw):
        def run(comm):
            step = shard.pure_zero3(fn, optimizer=optax.sgd(0.1), comm=comm, **kw)
            step(step.init({"w": np.ones((4, 2), np.float32)}), np.ones((3, 4), np.float32))
        ops.spawn(run, 2)

    with pytest.raises(NotImplementedError, match=r"pure_zero3: the loss calls pmax over axis "
                                                  r"'data'; the data ranks take psum, pmean"):
        try_(pmax, axis_name="data")
    with pytest.raises(NotImplementedError, match=r"reduces over axis 'data' \(psum\) inside "
                                                  r"scan"):
        try_(in_scan, axis_name="data")
    with pytest.raises(TypeError, match="axis_name must be a string"):
        ops.spawn(lambda comm: shard.pure_zero3(pmax, optimizer=optax.sgd(0.1), comm=comm,
                                                axis_name=0), 1)

    def zero(comm, make):  # the ZeRO steps bind no axis: named, pointing to the one that does
        step = make(in_scan, optimizer=ops.adamw(1e-3), comm=comm)
        step(step.init({"w": np.ones((4, 2), np.float32)}), np.ones((3, 4), np.float32))

    for make, where in ((shard.zero1, "the ZeRO step"), (shard.zero3, "zero3")):
        with pytest.raises(NotImplementedError, match=f"{where}: the loss reduces over axis "
                                                      r"'data', which this step does not bind; "
                                                      r"give the step axis_name='data'"):
            ops.spawn(zero, 2, make)

    def zero_bound(comm, model=False):
        where = {"comm": comm}
        if model:
            mesh = shard.Mesh(comm, {"data": 1, "model": 1})
            where = {"mesh": mesh, "specs": shard.TensorParallel(mesh)}
        step = shard.zero3(pmax, optimizer=ops.adamw(1e-3), **where,
                           options=shard.ZeroOptions(axis_name="data"))
        step(step.init({"w": np.ones((4, 2), np.float32)}), np.ones((3, 4), np.float32))

    with pytest.raises(NotImplementedError, match=r"zero3: the loss calls pmax over axis 'data'"):
        ops.spawn(zero_bound, 2)
    with pytest.raises(NotImplementedError, match=r"axis_name= with a 'model' axis \(tensor "
                                                  r"parallelism\) is not built"):
        ops.spawn(lambda c: zero_bound(c, model=True), 1)
    with pytest.raises(TypeError, match=r"axis_name= binds the data ranks in a JAX function"):
        ops.spawn(lambda c: shard.zero3(shard.Layered([pmax]), optimizer=ops.adamw(1e-3), comm=c,
                                        options=shard.ZeroOptions(axis_name="data")), 1)


def test_init_takes_params_on_a_device(device):
    """Params on the device (CuPy's, or the stand-in's, which refuses np.asarray
    as CuPy does) are copied to the host explicitly: the state is the host
    params' state."""
    from ops.testing import to_device

    def run(comm):
        step = shard.pure_zero3(loss, optimizer=tx(), comm=comm)
        return step.init(params()), step.init(to_device(params(), device))

    for want, got in ops.spawn(run, 3):  # 3 ranks: rows that do not divide, padding
        for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
