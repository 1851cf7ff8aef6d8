"""One compiled program for a group's ranks (see [Note: one program for a group's
ranks] in ops/comm/_xla.py): equal programs share a compile, different ones never
do, and thread ranks of a tensor-parallel or axis-bound loss compile each program
once, not once a rank."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import shard
from ops.comm import _programs, _xla


class _Compiles:
    """XLA backend compiles while the block runs (jax's own monitoring events);
    ``programs``: those of a loss's programs (its value and gradient, a
    segment's forward and backward), not the eager operations around them."""

    count = 0
    programs = 0

    def __enter__(self):
        self.start = (_Compiles.count, _Compiles.programs)
        return self

    def __exit__(self, *exc):
        self.n = _Compiles.count - self.start[0]
        self.loss = _Compiles.programs - self.start[1]


_LOSS_PROGRAMS = ("jit(_ranked)", "jit(scaled)", "jit(fwd)", "jit(bwd)")


def _on_compile(event, duration, fun_name="", **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        _Compiles.count += 1
        _Compiles.programs += fun_name in _LOSS_PROGRAMS


jax.monitoring.register_event_duration_secs_listener(_on_compile)


def test_equal_programs_of_different_functions_compile_once():
    def make():
        return _programs.SharedJit(lambda x, y: jnp.sin(x) @ y + 1.25)

    x, y = jnp.ones((3, 5)), jnp.full((5, 2), 0.5)
    first, second = make(), make()
    with _Compiles() as c:
        a, b = first(x, y), second(x, y)
    assert c.n == 1
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    taller = jnp.ones((4, 5))
    with _Compiles() as c:  # a new shape is a new program
        first(taller, y)
    assert c.n == 1


def test_one_program_on_inputs_that_live_elsewhere_is_compiled_for_them():
    # A loss on the CPU and the same loss on a GPU trace one jaxpr; an
    # executable compiled for one device refuses inputs on another.
    cpu0, cpu1 = jax.devices("cpu")[:2]

    def make():
        return _programs.SharedJit(lambda x: jnp.cos(x) * 3.0 - 0.5)

    x = np.arange(6, dtype=np.float32)
    on0, on1 = jax.device_put(x, cpu0), jax.device_put(x, cpu1)
    with _Compiles() as c:
        a, b, h = make()(on0), make()(on1), make()(x)
    assert c.n == 2  # the host array goes where the default device is: cpu0's program
    assert a.devices() == {cpu0} and b.devices() == {cpu1}
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(h))


def test_programs_that_differ_only_where_the_text_does_not_show_never_share():
    """A jaxpr prints every callback's function as 0xXXXX and no constant's
    value: two programs equal in print but calling different functions, or
    closing over different arrays, each compile and give their own results."""
    def host_plus(k):
        return lambda x: np.asarray(x) + np.float32(k)

    def calling(fn):
        return _programs.SharedJit(lambda x: jax.pure_callback(
            fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2)

    one, two = calling(host_plus(1)), calling(host_plus(2))
    x = jnp.zeros(3)
    assert str(jax.make_jaxpr(one.fn)(x)) == str(jax.make_jaxpr(two.fn)(x))
    with _Compiles() as c:
        got = (np.asarray(one(x)), np.asarray(two(x)))
    assert c.n == 2 and got[0].tolist() == [2.0] * 3 and got[1].tolist() == [4.0] * 3

    def closing(table):
        return _programs.SharedJit(lambda i: jnp.take(table, i))

    t1, t2 = np.arange(6.0, dtype=np.float32), np.arange(6.0, dtype=np.float32) * 10
    i = jnp.int32(4)
    with _Compiles() as c:
        got = (float(closing(t1)(i)), float(closing(t2)(i)))
    assert c.n == 2 and got == (4.0, 40.0)


def test_a_rank_read_as_a_number_gets_its_own_program_and_the_operand_shares_one():
    x = jnp.zeros(2, jnp.int32)

    def run(comm):
        place = _xla.register(comm, comm)
        as_number = _programs.SharedJit(lambda x: x + comm.rank)
        as_operand = _programs.SharedJit(lambda x: x + _xla.ranks_operand(place)[0])
        return np.asarray(as_number(x)).tolist(), np.asarray(as_operand(x)).tolist()

    with _Compiles() as c:
        got = shard.spawn(run, 3)
    assert [g[0] for g in got] == [[r, r] for r in range(3)]
    assert [g[1] for g in got] == [[r, r] for r in range(3)]
    assert c.n == 3 + 1


def _forget_programs():
    """Every compiled program dropped, so that a run compiles all of its own."""
    jax.clear_caches()
    _programs._PROGRAMS.clear()
    shard.step._traced._SHARED.clear()


def _mlp(comm, zero, steps):
    """A plain loss made inside each rank (a closure of its own, as a notebook
    writes it), trained for ``steps``: (losses, this rank's shards)."""
    scale = np.float32(0.5)

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"]) * scale
        return jnp.mean((h @ p["w2"] - b["y"]) ** 2)

    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((5, 7)).astype(np.float32),
              "w2": rng.standard_normal((7, 3)).astype(np.float32)}
    step = zero(loss, optimizer=ops.adamw(1e-2), comm=comm)
    state, losses = step.init(params), []
    for k in range(steps):
        r = np.random.default_rng(k)
        batch = {"x": r.standard_normal((8, 5)).astype(np.float32),
                 "y": r.standard_normal((8, 3)).astype(np.float32)}
        state, metrics = step(state, shard.split_batch(batch, rank=comm.rank,
                                                       world_size=comm.world_size))
        losses.append(metrics["loss"])
    return losses


@pytest.mark.parametrize("zero", [shard.zero1, shard.zero3])
def test_ranks_with_losses_of_their_own_compile_each_program_once(zero):
    """Four ranks, each with its own closure of one loss, compile as many
    programs as two: one each, whatever the number of ranks that run it."""
    _forget_programs()
    with _Compiles() as two:
        two_losses = shard.spawn(lambda c: _mlp(c, zero, 2), 2)
    _forget_programs()
    with _Compiles() as four:
        four_losses = shard.spawn(lambda c: _mlp(c, zero, 2), 4)
    assert four.loss == two.loss > 0, (two.loss, four.loss)
    np.testing.assert_allclose(four_losses[0], two_losses[0], rtol=1e-5)


def test_thread_ranks_run_one_executable_of_a_program_with_collectives():
    """Four thread ranks, each with its own program object over its own
    TensorParallel: the program has effects (its collective's callback) and
    compiles once, and each rank's callback reaches its own communicator."""

    def run(comm):
        tp = shard.TensorParallel(comm)
        f = _programs.SharedJit(lambda v: jnp.tanh(tp.reduce(v * 0.125)))
        return np.asarray(f(jnp.full(3, float(comm.rank + 1)))).tolist()

    _forget_programs()
    with _Compiles() as c:
        got = shard.spawn(run, 4)
    assert c.loss == 1, c.loss
    want = np.tanh(np.float32(0.125 * (1 + 2 + 3 + 4)))
    for row in got:
        np.testing.assert_allclose(row, [want] * 3, rtol=1e-6)


def test_thread_ranks_compile_each_unit_of_an_init_function_once():
    """``step.init_from`` at three thread ranks compiles its units' programs
    as one rank does: one per unit for the group, not one a rank (the eager
    operations around them are left out of the count: thread ranks that miss
    JAX's cache at once may each compile one); each rank keeps its own rows of
    the same draws."""

    def init(key):
        k1, k2 = jax.random.split(key)
        return {"a": jax.random.normal(k1, (13, 3)), "b": jax.random.normal(k2, (17,))}

    def run(comm):
        step = shard.zero3(lambda p, b: jnp.sum(p["a"]) + jnp.sum(p["b"]),
                           optimizer=ops.adamw(1e-2), comm=comm)
        return shard.gather(step.init_from(init, jax.random.key(5)), comm)

    counts, want = [], init(jax.random.key(5))
    for world in (1, 3):
        _forget_programs()
        with _Compiles() as c:
            got = shard.spawn(run, world)
        counts.append(c.loss)
        for whole in got:
            for k in want:
                np.testing.assert_array_equal(whole[k], np.asarray(want[k]))
    assert counts == [2, 2], counts  # units "a" and "b", at one rank and at three


def test_a_rank_s_collectives_outlive_another_object_over_its_group():
    """Two TensorParallel objects over one group: the one made later and
    dropped leaves the first one's collectives running."""
    import gc

    def run(comm):
        tp = shard.TensorParallel(comm)
        shard.TensorParallel(comm).shard({"w": np.ones(4)})  # made, used, dropped
        gc.collect()
        x = jnp.full(3, float(comm.rank + 1))
        eager = np.asarray(tp.reduce(x))
        traced = np.asarray(_programs.SharedJit(lambda v: tp.reduce(v))(x))
        return eager.tolist(), traced.tolist()

    for eager, traced in shard.spawn(run, 2):
        assert eager == traced == [3.0, 3.0, 3.0]
