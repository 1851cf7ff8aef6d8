"""invariant_shards=: the same bits at every world size dividing it, compared with ==.

See [Note: the same bits at any world size] (shard/step/_ordered.py), [Note:
ordered sums] (ops/comm/_ordered.py) and [Note: exact sums of squares]
(ops/_norm.py).
"""

from __future__ import annotations

import copy
import fractions

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import ops
import shard
from examples import gpt
from ops.comm._ordered import TreeSum, tree_all_reduce, tree_reduce_scatter
from tests import zero_models as M

V = 8
ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


def tree_sum(xs: list[np.ndarray]) -> np.ndarray:
    """The perfect binary tree over ``xs`` in order, written out."""
    while len(xs) > 1:
        xs = [a + b for a, b in zip(xs[0::2], xs[1::2], strict=True)]
    return xs[0]


# -- the ordered collectives and the exact norm -------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_ordered_collectives_sum_every_element_in_one_tree(world):
    rng = np.random.default_rng(world)
    xs = [(rng.standard_normal(world * 5) * 10.0 ** rng.integers(-6, 6, world * 5))
          .astype(np.float32) for _ in range(world)]
    want = tree_sum([x.copy() for x in xs])

    def run(comm):
        out = np.empty(5, np.float32)
        tree_reduce_scatter(comm, out, xs[comm.rank].copy())
        whole = tree_all_reduce(comm, xs[comm.rank].copy())
        return out, whole

    for r, (out, whole) in enumerate(ops.spawn(run, world)):
        np.testing.assert_array_equal(out, want[r * 5:(r + 1) * 5])
        np.testing.assert_array_equal(whole, want)
    if world >= 4:  # the data is such that another order shows in the bits
        assert not np.array_equal(want, np.sum(np.stack(xs), axis=0))


def test_ordered_collectives_on_the_nccl_backend_and_device_memory():
    """NCCL's point-to-point (sends queued and issued with the next receive, in
    one group), over the stand-in that waits for each send's receive."""
    nccl = pytest.importorskip("cupy.cuda.nccl")
    from ops.testing import STANDIN
    from tests.nccl_standin import run_ranks

    rng = np.random.default_rng(9)
    xs = [(rng.standard_normal(12) * 10.0 ** rng.integers(-6, 6, 12)).astype(np.float32)
          for _ in range(4)]
    want = tree_sum([x.copy() for x in xs])

    def run(comm):
        out = STANDIN.empty(3, np.float32)
        tree_reduce_scatter(comm, out, STANDIN.from_host(xs[comm.rank].copy()))
        whole = tree_all_reduce(comm, STANDIN.from_host(xs[comm.rank].copy()))
        return STANDIN.to_host(out), STANDIN.to_host(whole)

    results, _ = run_ranks(4, run, nccl, rendezvous=True)
    for r, (out, whole) in enumerate(results):
        np.testing.assert_array_equal(out, want[r * 3:(r + 1) * 3])
        np.testing.assert_array_equal(whole, want)


def test_a_tree_sum_of_terms_as_they_come_is_the_written_tree():
    rng = np.random.default_rng(0)
    terms = [rng.standard_normal(64).astype(np.float32) * 10.0 ** k for k in range(-4, 4)]
    tree = TreeSum()
    for t in terms:
        tree.add(t.copy())
    np.testing.assert_array_equal(tree.total(), tree_sum(terms))
    tree.add(terms[0].copy())
    with pytest.raises(ValueError, match="9 terms"):
        tree.total()
    with pytest.raises(ValueError, match="power of two"):
        ops.spawn(lambda c: tree_all_reduce(c, np.ones(3, np.float32)), 3)


def test_exact_sums_of_squares_are_correctly_rounded_however_split():
    from ops.testing import xp

    rng = np.random.default_rng(3)
    x = (rng.standard_normal(20_011) * np.exp(rng.uniform(-40, 40, 20_011))).astype(np.float32)
    x[:3] = [0.0, -0.0, np.float32(1e-45)]  # zeros and a subnormal
    exact = float(sum(fractions.Fraction(float(v)) ** 2 for v in x))
    total = ops.exact_square_total(ops.exact_square_parts(x))
    assert total == exact
    for pieces in (2, 3, 7, 64):
        parts = sum(ops.exact_square_parts(p) for p in np.array_split(x, pieces))
        assert ops.exact_square_total(parts) == exact
    assert ops.exact_square_total(ops.exact_square_parts(xp.asarray(x))) == exact
    half = (rng.standard_normal(100) * 100).astype(np.float16)
    assert ops.exact_square_total(ops.exact_square_parts(half)) == float(
        sum(fractions.Fraction(float(v)) ** 2 for v in half))
    x[7] = np.inf
    assert ops.exact_square_total(ops.exact_square_parts(x)) == np.inf
    with pytest.raises(TypeError):
        ops.exact_square_parts(np.ones(3))


@pytest.mark.parametrize("dtype", [np.float32, ops.BF16, np.float16])
def test_the_exact_slots_of_the_cpu_build_and_the_emulated_cuda_kernel_agree(dtype):
    from ops.testing import xp

    rng = np.random.default_rng(4)
    for n in (1, 255, 70_001):  # one block, a part of one, several
        x = (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 10, n)).astype(dtype)
        host = ops.exact_square_parts(x)
        np.testing.assert_array_equal(ops.exact_square_parts(xp.asarray(x)), host)
        want = sum(fractions.Fraction(float(v)) ** 2 for v in x.astype(np.float64))
        assert ops.exact_square_total(host) == float(want)
    x[3] = np.nan
    assert ops.exact_square_parts(xp.asarray(x))[-1] == 1 == ops.exact_square_parts(x)[-1]


# -- a JAX loss and Layered: worlds 1-8 x ZeRO 0-3 ------------------------------------

DATA = M.batches(10, global_batch=32)


def jax_run(comm, *, stage, loss_fn=M.loss, micro=1, optimizer=None, clip_norm=1.0,
            invariant=V, steps=10, replicas=1, **options):
    where = {"mesh": shard.Mesh(comm, {"replicate": replicas, "shard": comm.world_size //
                                       replicas})} if replicas > 1 else {"comm": comm}
    step = ZERO[stage](loss_fn, optimizer=optimizer or ops.adamw(M.LR, weight_decay=M.WD),
                       clip_norm=clip_norm, **where,
                       options=shard.ZeroOptions(invariant_shards=invariant, **options))
    state = step.init(M.init_params())
    losses, norms = [], []
    for b in DATA[:steps]:
        # the loader's order: micro-batches of the global batch, each cut over the ranks
        parts = [shard.split_batch(shard.split_batch(b, rank=i, world_size=micro),
                                   rank=comm.rank, world_size=comm.world_size)
                 for i in range(micro)]
        state, metrics = step(state, shard.MicroBatches(parts) if micro > 1 else parts[0])
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    full = shard.gather(state, step.config.comm)
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(full)], losses, norms


def assert_same_bits(got, want, what):
    for a, b in zip(got[0], want[0], strict=True):
        np.testing.assert_array_equal(a, b, err_msg=what)
    assert got[1] == want[1] and got[2] == want[2], what  # losses and norms, as floats


@pytest.mark.parametrize("loss_fn", [M.loss, M.LAYERED], ids=["jax", "layered"])
def test_a_jax_model_trains_to_the_same_bits_at_worlds_1_to_8_and_zero_0_to_3(loss_fn):
    # each loss against itself at one rank: a Layered model's programs are its layers', so
    # XLA's code (and its roundings) for it may differ from the whole loss's
    want = ops.spawn(lambda c: jax_run(c, stage=0, loss_fn=loss_fn), 1)[0]
    for stage in (0, 1, 2, 3):
        for world in (1, 2, 4, 8):
            got = ops.spawn(lambda c, s=stage: jax_run(c, stage=s, loss_fn=loss_fn), world)
            for r, g in enumerate(got):
                assert_same_bits(g, want, f"zero{stage} at world {world}, rank {r}")
    for world, kw in ((4, {"replicas": 2}), (8, {"replicas": 4}),  # HSDP, hpZ
                      (4, {"reshard_after_forward": 2}), (8, {"reshard_after_forward": 4})):
        got = ops.spawn(lambda c, kw=kw: jax_run(c, stage=3, loss_fn=loss_fn, **kw), world)[0]
        assert_same_bits(got, want, f"zero3 at world {world} {kw}")


def test_without_the_option_the_world_size_shows_in_the_bits():
    one = ops.spawn(lambda c: jax_run(c, stage=1, invariant=None), 1)[0]
    two = ops.spawn(lambda c: jax_run(c, stage=1, invariant=None), 2)[0]
    assert any(not np.array_equal(a, b) for a, b in zip(one[0], two[0], strict=True))


VARIANTS = {
    "micro-batches": {"micro": 2},
    "host offload": {"offload": shard.Offload("host")},
    "optax chain": {"optimizer": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
                    "clip_norm": None},
    "bf16 params": {"precision": shard.Precision(param_dtype=jnp.bfloat16,
                                                 reduce_dtype=jnp.float32)},
    "bf16 reduction": {"precision": shard.Precision(param_dtype=jnp.bfloat16,
                                                    reduce_dtype=jnp.bfloat16)},
    "dropout keys": {"loss_fn": lambda p, b, *, key: M.loss(p, {**b, "x": jnp.where(
        jax.random.bernoulli(key, 0.8, b["x"].shape), b["x"] / 0.8, 0.0)}),
        "key": jax.random.key(0)},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_micro_batches_offload_optax_bf16_and_keys_keep_the_bits(variant):
    kw = VARIANTS[variant]
    want = ops.spawn(lambda c: jax_run(c, stage=1, steps=4, **kw), 1)[0]
    for stage, world in ((1, 8), (3, 2), (3, 8)):
        got = ops.spawn(lambda c, s=stage: jax_run(c, stage=s, steps=4, **kw), world)[0]
        assert_same_bits(got, want, f"{variant}: zero{stage} at world {world}")


def test_hsdp_sums_the_replicas_of_each_micro_batch_in_the_tree():
    """Replica r's rank k is data rank r * S + k: each micro-batch's sum over the
    shard group, then over the replicas, before the micro-batches are added."""
    want = ops.spawn(lambda c: jax_run(c, stage=1, micro=2, steps=4), 1)[0]
    for stage, world, replicas in ((1, 4, 2), (3, 4, 2), (2, 8, 4), (3, 8, 2)):
        got = ops.spawn(lambda c, s=stage, r=replicas: jax_run(
            c, stage=s, micro=2, steps=4, replicas=r), world)
        for rank, g in enumerate(got):
            assert_same_bits(g, want, f"zero{stage}, {replicas} replicas of {world // replicas}, "
                                      f"rank {rank}")


# -- the GPT example (a torch module): ZeRO 0-3, HSDP, hpZ; resumed across worlds ------

CFG = gpt.GPTConfig(seq=16, d=32, layers=2, heads=2)


def gpt_run(world, *, stage=3, steps=10, save=None, resume=False, model=None, **kw):
    torch.set_num_threads(1)

    def run(comm):
        out = gpt.train(comm, stage=stage, steps=steps, batch=16, cfg=CFG, model=model,
                        progress=False, invariant_shards=V, save=save, save_every=5,
                        resume=resume, **kw)
        full = shard.gather(out["state"], out["step"].config.comm)
        return full, out["losses"]

    return ops.spawn(run, world)[0]


def assert_same_state(got, want, what):
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")


def test_the_gpt_example_trains_to_the_same_bits_across_layouts():
    model = gpt.build(CFG)
    want, want_losses = gpt_run(1, model=model, steps=4)
    layouts = [(w, s, {}) for w in (2, 4, 8) for s in (0, 1, 2, 3)] + [
        (4, 3, {"replicas": 2}), (8, 2, {"replicas": 4}), (8, 3, {"replicas": 2}),
        (4, 3, {"reshard_after_forward": 2}), (8, 3, {"reshard_after_forward": 4})]
    for world, stage, kw in layouts:
        got, losses = gpt_run(world, stage=stage, model=model, steps=4, **kw)
        assert_same_state(got, want, f"zero{stage} at world {world} {kw}")
        assert losses == want_losses


def test_a_checkpoint_resumes_on_another_world_size_on_the_same_trajectory(tmp_path):
    model = gpt.build(CFG)
    straight, _ = gpt_run(8, model=model)
    gpt_run(8, steps=5, save=tmp_path / "a", model=model)  # saved at step 5
    resumed, _ = gpt_run(2, save=tmp_path / "a", resume=True, stage=1, model=model)
    assert_same_state(resumed, straight, "8 ranks, then 2")
    gpt_run(2, steps=5, save=tmp_path / "b", model=model)
    resumed, _ = gpt_run(8, save=tmp_path / "b", resume=True, stage=2, model=model)
    assert_same_state(resumed, straight, "2 ranks, then 8")


# -- what it refuses ------------------------------------------------------------------


def test_what_invariance_cannot_keep_is_refused_by_name():
    comm = ops.spawn(lambda c: c, 1)[0]
    opt = ops.adamw(1e-2)

    def make(stage=1, optimizer=opt, **kw):
        return ZERO[stage](M.loss, optimizer=optimizer, comm=comm,
                           options=shard.ZeroOptions(**kw))

    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match="power of two"):
            make(invariant_shards=bad)
    for kw, match in (({"weight_by_rows": True}, "weight_by_rows"),
                      ({"gradient_divide_factor": 1.0}, "gradient_divide_factor"),
                      ({"axis_name": "data"}, "axis_name"),
                      ({"offload": shard.Offload("host", overlap=True)}, "overlap")):
        with pytest.raises(NotImplementedError, match=match):
            make(invariant_shards=4, **kw)
    with pytest.raises(NotImplementedError, match="LAMB"):
        make(invariant_shards=4, optimizer=ops.lamb(1e-2))

    def lamb(comm):  # its trust ratio sums over whole leaves split over the ranks
        step = shard.zero1(M.loss, optimizer=optax.lamb(1e-2), comm=comm,
                           options=shard.ZeroOptions(invariant_shards=4))
        with pytest.raises(NotImplementedError, match="whole leaves"):
            step.init(M.init_params())

    ops.spawn(lamb, 2)


def test_batches_and_states_it_cannot_cut_are_refused_before_anything_changes():
    def run(comm):
        step = shard.zero1(M.loss, optimizer=ops.adamw(1e-2), comm=comm,
                           options=shard.ZeroOptions(invariant_shards=4))
        state = step.init(M.init_params())
        before = [np.array(x) for x in jax.tree_util.tree_leaves(state.params)]
        b = DATA[0]
        with pytest.raises(ValueError, match=r"2 virtual shards a rank.*\[\[5\], \[5\]\]"):
            step(state, {k: v[:5] for k, v in b.items()})  # 5 rows into 2 shards a rank
        rows = 8 if comm.rank == 0 else 4  # every rank refuses, naming every rank's rows
        with pytest.raises(ValueError, match=r"\[\[8\], \[4\]\]"):
            step(state, {k: v[:rows] for k, v in b.items()})
        bad = {"x": b["x"][:4], "y": b["y"][:3 if comm.rank else 4]}  # rank 1's leaves disagree
        with pytest.raises(ValueError, match=r"rank 1 batch\['x'\] has 4 rows" if comm.rank
                           else r"\[\[4\], \[-1\]\]"):  # no rank waits for the other
            step(state, bad)
        with pytest.raises(ValueError, match="equal rows"):
            step(state, shard.MicroBatches([{k: v[:8] for k, v in b.items()},
                                            {k: v[:4] for k, v in b.items()}]))
        for a, x in zip(before, jax.tree_util.tree_leaves(state.params), strict=True):
            np.testing.assert_array_equal(a, x)
        with pytest.raises(ValueError, match="multiple of the 2 data ranks"):
            shard.zero1(M.loss, optimizer=ops.adamw(1e-2), comm=comm,
                        options=shard.ZeroOptions(invariant_shards=1))

    ops.spawn(run, 2)

    def float64(comm):
        step = shard.zero1(M.loss, optimizer=ops.adamw(1e-2), comm=comm,
                           options=shard.ZeroOptions(invariant_shards=2))
        state = step.init(jax.tree_util.tree_map(lambda x: x.astype(np.float64),
                                                 M.init_params()))
        with pytest.raises(NotImplementedError, match="float64"):
            step(state, {k: v.astype(np.float64) for k, v in DATA[0].items()})

    ops.spawn(float64, 1)


@pytest.mark.parametrize("layer", ["batch norm", "dropout"])
def test_torch_modules_whose_results_depend_on_the_split_are_refused(layer):
    import interop.torch as it

    extra = torch.nn.BatchNorm1d(8) if layer == "batch norm" else torch.nn.Dropout(0.1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), extra, torch.nn.Linear(8, 1))

    def loss(module, batch):
        x, y = batch
        return ((module(x) - y) ** 2).mean()

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=loss)
        step = shard.zero1(fn, optimizer=ops.adamw(1e-2), comm=comm,
                           options=shard.ZeroOptions(invariant_shards=2))
        state = step.init(params)
        batch = (torch.randn(4, 4), torch.randn(4, 1))
        with pytest.raises(NotImplementedError, match=f"invariant_shards.*{type(extra).__name__}"):
            step(state, batch)
        fn.module.eval()  # statistics frozen, no dropout: nothing depends on the split
        state, metrics = step(state, batch)
        assert np.isfinite(metrics["loss"])

    ops.spawn(run, 2)
