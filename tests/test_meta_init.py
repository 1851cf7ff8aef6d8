"""Models larger than one rank: ZeRO init from a torch module built on the meta
device, and from a JAX init function, one unit at a time (see [Note: meta-device
init]). Every rank's shards are checked against the reference slice, across world
sizes that do not divide the leaves, and each rank's peak memory is measured."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard
from tests.harness import assert_rank_slices

ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}
LR, WD, STEPS = 1e-2, 0.01, 3


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def mse(model, batch):
    return ((model(batch[0]) - batch[1]) ** 2).mean()


def data(n=12):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g))
            for _ in range(STEPS)]


def on_meta(make):
    with torch.device("meta"):
        return make()


def assert_shards(state, comm, want, err=""):
    """This rank's master shards equal the reference's slice for this rank."""
    assert_rank_slices(state.params, want, comm.rank, comm.world_size, what=err)


def initial_values(make, seed=3):
    """The values a meta init gives at world 1 (whole)."""
    def run(comm):
        params, fn = it.functional(on_meta(make), loss=mse, seed=seed)
        state = shard.zero3(fn, optimizer=ops.adamw(LR), comm=comm).init(params)
        return {k: np.array(v) for k, v in state.params.items()}

    return ops.spawn(run, 1)[0]


def torch_reference(make, init, batches):
    model = make()
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(torch.from_numpy(init[k]))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for b in batches:
        opt.zero_grad()
        mse(model, b).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_meta_module_inits_the_same_at_every_world_size_and_trains_like_torch(stage, world):
    batches = data()
    init = initial_values(mlp)
    want = torch_reference(mlp, init, batches)

    def run(comm):
        params, fn = it.functional(on_meta(mlp), loss=mse, seed=3)
        assert all(v.is_meta for v in params.values())
        step = ZERO[stage](fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state = step.init(params)
        assert_shards(state, comm, init, "init")
        n = batches[0][0].shape[0] // comm.world_size
        for b in batches:
            state, _ = step(state, tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b))
        assert_shards(state, comm, want, "trained")

    ops.spawn(run, world)


def test_meta_init_is_a_real_initialisation_seeded_per_unit():
    a, b = initial_values(mlp, seed=3), initial_values(mlp, seed=4)
    again = initial_values(mlp, seed=3)
    for k in a:
        np.testing.assert_array_equal(a[k], again[k])
        assert not np.array_equal(a[k], b[k]), k
    for k in ("0.weight", "2.weight", "4.weight"):  # Linear's reset_parameters bound
        bound = 1 / np.sqrt(a[k].shape[1])
        assert np.abs(a[k]).max() <= bound and np.abs(a[k]).max() > 0.8 * bound, k
    assert len({a[k].std().round(6) for k in a}) == len(a)  # no two leaves alike


def test_custom_modules_need_an_init_and_every_parameter_must_get_one():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.w

    with pytest.raises(TypeError, match=r"module '1' \(Scale\).*param_init_fn"):
        it.functional(on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), Scale())),
                      loss=mse)

    def only_linear(m):  # leaves Scale.w untouched
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()

    params, fn = it.functional(on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                                   Scale())),
                               loss=mse, param_init_fn=only_linear)
    with pytest.raises(ValueError, match=r"parameter '1.w' was not initialised by param_init_fn"):
        ops.spawn(lambda c: shard.zero3(fn, optimizer=ops.adam(LR), comm=c).init(params), 1)

    def ones(m):
        for p in m.parameters(recurse=False):
            torch.nn.init.ones_(p)

    params, fn = it.functional(on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                                   Scale())),
                               loss=mse, param_init_fn=ones)
    got = ops.spawn(lambda c: dict(shard.zero3(fn, optimizer=ops.adam(LR), comm=c)
                                   .init(params).params), 1)[0]
    assert all(np.all(v == 1) for v in got.values())


def test_a_buffer_nothing_initialises_is_named():
    class Masked(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.register_buffer("mask", torch.tril(torch.ones(4, 4)))

    params, fn = it.functional(on_meta(Masked), loss=mse)
    with pytest.raises(ValueError, match=r"buffer 'mask' was built on the meta device"):
        ops.spawn(lambda c: shard.zero3(fn, optimizer=ops.adam(LR), comm=c).init(params), 1)


def test_integer_and_boolean_buffers_built_on_meta_are_not_left_unset():
    class Positions(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.register_buffer("position_ids", torch.arange(4))

    params, fn = it.functional(on_meta(Positions), loss=mse)
    with pytest.raises(ValueError, match=r"buffer 'position_ids' was built on the meta device"):
        ops.spawn(lambda c: shard.zero3(fn, optimizer=ops.adam(LR), comm=c).init(params), 1)

    def positions(m):  # sets what the meta device dropped
        m.reset_parameters()
        m.position_ids.copy_(torch.arange(4))

    model = on_meta(Positions)
    params, fn = it.functional(model, loss=mse, param_init_fn=positions)
    ops.spawn(lambda c: shard.zero3(fn, optimizer=ops.adam(LR), comm=c).init(params), 1)
    assert model.position_ids.tolist() == [0, 1, 2, 3]

    class Mask(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.register_buffer("mask", torch.ones(4, dtype=torch.bool))

    with pytest.raises(TypeError, match=r"boolean buffer 'mask' was built on the meta device"):
        it.functional(on_meta(Mask), loss=mse)


def test_meta_options_are_refused_for_a_module_with_memory_and_shapes_for_a_jax_loss():
    with pytest.raises(ValueError, match="param_init_fn= and device= are for a module built"):
        it.functional(mlp(), loss=mse, param_init_fn=lambda m: None)
    shapes = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}

    def run(comm):
        step = shard.zero3(lambda p, x: jnp.sum(p["w"]), optimizer=ops.adam(LR), comm=comm)
        step.init(shapes)

    with pytest.raises(TypeError, match=r"shapes only.*zero3.init_from\(init_fn, key\)"):
        ops.spawn(run, 1)
    with pytest.raises(ValueError, match="device= is for params given as shapes"):
        ops.spawn(lambda c: shard.zero3(lambda p, x: jnp.sum(p["w"]), optimizer=ops.adam(LR),
                                        comm=c).init({"w": np.ones((4, 2), np.float32)},
                                                     device=ops.HOST), 1)


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_meta_init_into_offloaded_state(tmp_path, offload):
    init = initial_values(mlp)
    policy = shard.Offload(optimizer=offload, **({"path": str(tmp_path)}
                                                 if offload == "disk" else {}))

    def run(comm):
        params, fn = it.functional(on_meta(mlp), loss=mse, seed=3)
        state = shard.zero3(fn, optimizer=ops.adam(LR), comm=comm, offload=policy).init(params)
        assert_shards(state, comm, init)

    ops.spawn(run, 3)


def test_meta_init_onto_device_state(device):
    init = initial_values(mlp)

    def run(comm):
        params, fn = it.functional(on_meta(mlp), loss=mse, seed=3)
        state = shard.zero3(fn, optimizer=ops.adam(LR), comm=comm).init(params, device=device)
        assert state.meta.device == device.name
        ref = shard.partition(init, rank=comm.rank, world_size=comm.world_size)
        for k, v in state.params.items():
            np.testing.assert_array_equal(device.to_host(v), ref[k], err_msg=k)

    ops.spawn(run, 2)


def test_init_from_onto_device_state(device):
    key = jax.random.key(7)
    whole = jax.tree_util.tree_map(np.asarray, jax_init(key))

    def run(comm):
        step = shard.zero3(jax_loss, optimizer=ops.adam(LR), comm=comm,
                           options=shard.ZeroOptions(units=jax_units))
        state = step.init_from(jax_init, key, device=device)
        assert state.meta.device == device.name
        want = shard.partition(whole, rank=comm.rank, world_size=comm.world_size)
        jax.tree_util.tree_map(
            lambda g, w: np.testing.assert_allclose(device.to_host(g), w, rtol=1e-6),
            state.params, want)

    ops.spawn(run, 2)


def test_thread_ranks_seed_their_units_without_racing():
    """Thread ranks share torch's global RNG; each unit is drawn under a lock,
    so eight ranks all draw the world-1 values."""
    init = initial_values(mlp)

    def run(comm):
        params, fn = it.functional(on_meta(mlp), loss=mse, seed=3)
        state = shard.zero2(fn, optimizer=ops.adam(LR), comm=comm).init(params)
        assert_shards(state, comm, init)

    ops.spawn(run, 8)


# -- Hugging Face models -----------------------------------------------------------

transformers = pytest.importorskip("transformers")


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=36, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, initializer_range=0.05))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1))


def lm_loss(model, batch):
    return model(input_ids=batch[0], labels=batch[0]).loss


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_hf_model_on_meta_inits_like_its_own_init_weights_and_trains(make):
    eager = make()
    batch = (torch.randint(0, 64, (6, 10), generator=torch.Generator().manual_seed(2)),)

    def run(comm):
        model = on_meta(make)
        params, fn = it.functional(model, loss=lm_loss, seed=0)
        step = shard.zero3(fn, optimizer=ops.adamw(LR), comm=comm)
        state = step.init(params)
        whole = shard.gather(state, comm)
        buffers = {k: b.clone() for k, b in model.named_buffers()}
        losses = []
        n = 6 // comm.world_size
        for _ in range(4):
            state, m = step(state, (batch[0][comm.rank * n:(comm.rank + 1) * n],))
            losses.append(m["loss"])
        return whole, buffers, losses, state.meta.layout

    (w1, b1, l1, _), = ops.spawn(run, 1)
    w3, b3, l3, layout = ops.spawn(run, 3)[0]
    assert len(layout.units) >= 4  # one per decoder layer beside the rest
    for k in w1:
        np.testing.assert_array_equal(w1[k], w3[k], err_msg=k)
    np.testing.assert_allclose(l1, l3, rtol=1e-5)
    assert l3[-1] < l3[0]
    for k, b in eager.named_buffers():  # the rotary frequencies, GPT-2's masks...
        np.testing.assert_array_equal(b3[k].numpy(), b.numpy(), err_msg=k)
        np.testing.assert_array_equal(b1[k].numpy(), b.numpy(), err_msg=k)
    for k, p in eager.named_parameters():  # the model's own scheme, value by value
        want = p.detach().numpy()
        got = w3[k]
        assert got.shape == want.shape, k
        if np.all(want == want.flat[0]):  # norms' ones, biases' zeros
            np.testing.assert_array_equal(got, want, err_msg=k)
        else:  # normal draws of the config's std (GPT-2's c_proj scaled down)
            np.testing.assert_allclose(got.std(), want.std(), rtol=0.25, err_msg=k)


def test_a_meta_hf_model_exports_a_state_dict_that_from_pretrained_reads(tmp_path):
    def run(comm):
        model = on_meta(gpt2)
        params, fn = it.functional(model, loss=lm_loss)
        state = shard.zero3(fn, optimizer=ops.adamw(LR), comm=comm).init(params)
        return it.state_dict(model, state, comm=comm), shard.gather(state, comm)

    sd, whole = ops.spawn(run, 2)[0]
    fresh = gpt2()
    fresh.load_state_dict(sd, strict=True)
    for k, p in fresh.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), whole[k], err_msg=k)


# -- JAX init functions --------------------------------------------------------------

def jax_init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"embed": jax.random.normal(k1, (11, 5)) * 0.1,
            "layers": [{"w": jax.random.normal(k, (5, 5)) * 0.3, "b": jnp.zeros(5)}
                       for k in jax.random.split(k2, 3)],
            "head": jax.random.normal(k3, (5, 7)) * 0.2}


def jax_loss(p, batch):
    x = p["embed"][batch["ids"]]
    for layer in p["layers"]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean((x @ p["head"] - batch["y"]) ** 2)


def jax_units(path):
    return f"layer{path[1].idx}" if path[0].key == "layers" else path[0].key


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("stage", [1, 3])
def test_init_from_a_jax_init_function_equals_it_whole(stage, world):
    key = jax.random.key(7)
    whole = jax.tree_util.tree_map(np.asarray, jax_init(key))
    rng = np.random.default_rng(0)
    batches = [{"ids": rng.integers(0, 11, 6), "y": rng.standard_normal((6, 7), np.float32)}
               for _ in range(STEPS)]

    def train(comm, state, step):
        for b in batches:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank,
                                                     world_size=comm.world_size))
        return shard.gather(state, comm)

    def run(comm):
        step = ZERO[stage](jax_loss, optimizer=ops.adam(LR), comm=comm,
                           options=shard.ZeroOptions(units=jax_units))
        state = step.init_from(jax_init, key)
        assert len(state.meta.layout.units) == 5
        want = shard.partition(whole, rank=comm.rank, world_size=comm.world_size)
        jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6),
                               state.params, want)
        same = ZERO[stage](jax_loss, optimizer=ops.adam(LR), comm=comm,
                           options=shard.ZeroOptions(units=jax_units))
        return train(comm, state, step), train(comm, same.init(whole), same)

    got, want = ops.spawn(run, world)[0]  # a jitted draw may round its scaling apart
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7),
                           got, want)


def test_init_from_refuses_ranks_with_different_keys():
    def run(comm):
        step = shard.zero3(jax_loss, optimizer=ops.adam(LR), comm=comm,
                           options=shard.ZeroOptions(units=jax_units))
        step.init_from(jax_init, jax.random.key(comm.rank))

    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] differ.*the same key"):
        ops.spawn(run, 2)


# -- peak memory ----------------------------------------------------------------------

@pytest.mark.multiprocess
def test_peak_memory_of_an_init_is_the_state_plus_about_one_unit(tmp_path):
    """Two gloo processes each init a ZeRO-3 state of 8 units of 16 MiB, from a
    meta module and from a JAX init; a rank's resident memory grows by its state
    plus one unit (JAX's random draws keep one or two unit-sized temporaries), where
    building the module whole first grows it by the whole model on top (one
    launch, the three inits in turn: the eager one is the reference of both).
    Each is bounded by what it can have taken at most (its growth plus what the
    inits before it left resident), the eager one's growth by what it took at
    least."""
    from tests.multiproc import run_ranks

    reports = run_ranks("tests/meta_init_worker.py", 2, tmp_path,
                        {"ZS_SCENARIO": "meta+jax+eager"})
    assert all("eager" in rep for rep in reports), reports
    for scenario, slack in (("meta", 1), ("jax", 3)):  # slack: units of transient memory
        for rank in reports:
            rep, whole = rank[scenario], rank["eager"]
            bound = rep["state_bytes"] + (1 + slack) * rep["unit_bytes"]
            most = rep["grew"] + rep["held_before"]
            assert most <= bound, (scenario, most / 2**20, bound / 2**20)
            assert whole["grew"] >= whole["state_bytes"] + whole["model_bytes"], whole
            assert whole["grew"] > bound  # the measurement tells the two apart
        assert reports[0][scenario]["digest"] != reports[1][scenario]["digest"], scenario
