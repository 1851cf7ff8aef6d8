"""Fine-tuning: frozen params (torch's requires_grad=False, trainable= for JAX
losses) against one process of torch.optim.AdamW and of optax with the frozen
leaves' updates set to zero."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import interop.torch as it
import ops
import shard
import shard.checkpoint

ZERO = {0: shard.zero0, 1: shard.zero1, 2: shard.zero2, 3: shard.zero3}
LR, WD, STEPS = 1e-2, 0.1, 6


class Adapted(torch.nn.Module):
    """A frozen embedding and a frozen base Linear with a low-rank adapter beside
    it (LoRA's shape), a frozen unit of its own, and a trainable head; sizes that
    no world size here divides."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(7, 13)
        self.block = torch.nn.ModuleDict(dict(base=torch.nn.Linear(13, 13),
                                              a=torch.nn.Linear(13, 3, bias=False),
                                              b=torch.nn.Linear(3, 13, bias=False)))
        self.frozen_mid = torch.nn.Linear(13, 13)
        self.head = torch.nn.Linear(13, 5)
        for p in [*self.embed.parameters(), *self.block["base"].parameters(),
                  *self.frozen_mid.parameters()]:
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.block["base"](h) + self.block["b"](self.block["a"](h)))
        h = torch.tanh(self.frozen_mid(h))
        return self.head(h)


def mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def batches(n=STEPS, rows=12):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(rows, 7, generator=g), torch.randn(rows, 5, generator=g))
            for _ in range(n)]


def adamw_reference(model, data, loss):
    """A copy of ``model`` trained in one process by torch.optim.AdamW on its
    trainable parameters, one step per batch of ``data``."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WD)
    for b in data:
        opt.zero_grad()
        loss(model, b).backward()
        opt.step()
    return model


def torch_reference(model, data):
    trained = adamw_reference(model, data, mse)
    return {k: v.detach().numpy().copy() for k, v in trained.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_requires_grad_false_params_stay_and_the_rest_match_torch_adamw(stage, world):
    torch.manual_seed(0)
    model = Adapted()
    data = batches()
    want = torch_reference(model, data)
    before = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=mse)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm,
                           clip_norm=1e3)
        state = step.init(params)
        n = data[0][0].shape[0] // comm.world_size
        for b in data:
            state, _ = step(state, tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b))
        return shard.gather(state, comm), state

    (got, state), *_ = ops.spawn(run, world)
    for k, p in model.named_parameters():
        if p.requires_grad:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=k)
        else:  # bit for bit what it was given, and its moments untouched
            np.testing.assert_array_equal(got[k], before[k], err_msg=k)
    moments = state.opt.mu
    assert not np.any(moments["embed.weight"]) and not np.any(moments["frozen_mid.bias"])
    assert np.any(moments["head.weight"])


def jax_loss(p, b):
    h = jnp.tanh(b["x"] @ p["base"]["w"] + b["x"] @ p["lora"]["a"] @ p["lora"]["b"])
    return jnp.mean((h @ p["head"] - b["y"]) ** 2)


def jax_params():
    r = np.random.default_rng(0)
    return {"base": {"w": r.normal(size=(7, 11)).astype(np.float32)},
            "lora": {"a": r.normal(size=(7, 3)).astype(np.float32) * 0.1,
                     "b": r.normal(size=(3, 11)).astype(np.float32) * 0.1},
            "head": r.normal(size=(11, 5)).astype(np.float32)}


@pytest.mark.parametrize("optimizer", ["fused", "optax"])
@pytest.mark.parametrize("trainable", ["tree", "prefix", "function"])
@pytest.mark.parametrize("stage", [1, 3])
def test_trainable_mask_matches_optax_set_to_zero_on_one_process(stage, trainable, optimizer):
    mask = {"base": {"w": False}, "lora": {"a": True, "b": True}, "head": True}
    given = {"tree": mask, "prefix": {"base": False, "lora": True, "head": True},
             "function": lambda p: jax.tree_util.tree_map(lambda _: True, p) | {
                 "base": {"w": False}}}[trainable]
    r = np.random.default_rng(1)
    data = [{"x": r.normal(size=(10, 7)).astype(np.float32),
             "y": r.normal(size=(10, 5)).astype(np.float32)} for _ in range(STEPS)]
    labels = jax.tree_util.tree_map(lambda t: "train" if t else "freeze", mask)
    tx = optax.multi_transform({"train": optax.adamw(LR, weight_decay=WD),
                                "freeze": optax.set_to_zero()}, labels)
    p = jax_params()
    opt = tx.init(p)
    for b in data:
        g = jax.grad(jax_loss)(p, b)
        u, opt = tx.update(g, opt, p)
        p = optax.apply_updates(p, u)

    def run(comm):
        opt = (ops.adamw(LR, weight_decay=WD) if optimizer == "fused" else
               optax.adamw(LR, weight_decay=WD))
        step = ZERO[stage](jax_loss, optimizer=opt, comm=comm, trainable=given)
        state = step.init(jax_params())
        n = 10 // comm.world_size
        for b in data:
            state, _ = step(state, {k: v[comm.rank * n:(comm.rank + 1) * n] for k, v in b.items()})
        return shard.gather(state, comm)

    got = ops.spawn(run, 2)[0]
    np.testing.assert_array_equal(got["base"]["w"], jax_params()["base"]["w"])
    for path, want in jax.tree_util.tree_leaves_with_path(p):
        have = got
        for key in path:
            have = have[key.key]
        np.testing.assert_allclose(have, np.asarray(want), rtol=2e-5, atol=2e-6,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("stage", [1, 2])
def test_frozen_params_in_mixed_precision_keep_their_compute_copies(stage):
    """bfloat16 compute params over float32 masters: stages 1-2 write each
    step's compute params afresh, the frozen leaves' included (cast from their
    masters), so the trajectory is stage 3's, whose compute shards persist."""
    r = np.random.default_rng(4)
    data = [{"x": r.normal(size=(10, 7)).astype(np.float32),
             "y": r.normal(size=(10, 5)).astype(np.float32)} for _ in range(4)]
    mask = {"base": {"w": False}, "lora": True, "head": True}

    def run(comm, stage):
        step = ZERO[stage](jax_loss, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm,
                           trainable=mask, precision=shard.Precision(param_dtype="bf16"))
        state, losses = step.init(jax_params()), []
        n = 10 // comm.world_size
        for b in data:
            state, m = step(state, {k: v[comm.rank * n:(comm.rank + 1) * n]
                                    for k, v in b.items()})
            losses.append(m["loss"])
        return losses, shard.gather(state, comm)

    want, want_params = ops.spawn(lambda c: run(c, 3), 2)[0]
    got, got_params = ops.spawn(lambda c: run(c, stage), 2)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(got_params), jax.tree_util.tree_leaves(want_params),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got_params["base"]["w"], jax_params()["base"]["w"])


def bf16_params():
    """:func:`jax_params` in bfloat16: a step computes in their dtype over
    float32 masters, and the frozen base weight has the compute dtype."""
    import ml_dtypes

    return jax.tree_util.tree_map(lambda x: x.astype(ml_dtypes.bfloat16), jax_params())


def bf16_run(comm, stage, data, *, steps=None, load=None, save=None, offload=None):
    """:func:`jax_loss` on :func:`bf16_params`, ``base.w`` frozen, one step per
    batch of ``data`` (this rank's rows); with ``load`` a checkpoint starts it
    and with ``save`` it ends in one; with ``offload`` (which keeps every
    master) the masters and moments in host tiers. Returns the losses, the
    gathered params at the end and at the start, and the state."""
    step = ZERO[stage](jax_loss, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm,
                       trainable={"base": False, "lora": True, "head": True}, offload=offload,
                       # frozen and trainable leaves in one unit
                       options=shard.ZeroOptions(units=lambda path: "one"))
    state = shard.load(load, step, comm=comm)[0] if load else step.init(bf16_params())
    start = shard.gather(state, comm)
    losses, n = [], 12 // comm.world_size
    for b in data[:steps]:
        state, m = step(state, {k: v[comm.rank * n:(comm.rank + 1) * n] for k, v in b.items()})
        losses.append(m["loss"])
    if save:
        shard.save(state, save, comm=comm)
    return losses, shard.gather(state, comm), state, start


def bf16_data():
    r = np.random.default_rng(4)
    return [{"x": r.normal(size=(12, 7)).astype(np.float32),
             "y": r.normal(size=(12, 5)).astype(np.float32)} for _ in range(4)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_16_bit_leaves_keep_no_masters_and_train_as_with_them(stage, world):
    """A bfloat16 model's frozen leaves live in their compute params alone (no
    float32 master beside them): the per-rank masters are the trainable
    leaves', as estimate_memory says, and the run is the one whose offloaded
    state keeps every master (stage 1's for stage 0, which has no offload)."""
    data = bf16_data()
    mask = {"base": {"w": False}, "lora": True, "head": True}
    want, want_params, _, _ = ops.spawn(lambda c: bf16_run(c, stage or 1, data,  # no offload
                                                           offload=shard.Offload()), world)[0]

    def run(comm):
        losses, params, state, _ = bf16_run(comm, stage, data)
        est = shard.estimate_memory(bf16_params(), stage=stage, world_size=world,
                                    trainable=mask)
        local = state.params["base"]["w"]  # cast from the compute params
        return losses, params, state.nbytes(), est, local, comm.rank

    ranks = world if stage else 1  # stage 0 keeps whole params
    shard_rows = {"base": -(-7 // ranks), "a": -(-7 // ranks), "b": -(-3 // ranks),
                  "head": -(-11 // ranks)}
    trainable = shard_rows["a"] * 3 + shard_rows["b"] * 11 + shard_rows["head"] * 5
    base = bf16_params()["base"]["w"].astype(np.float32)
    for got, got_params, have, est, local, rank in ops.spawn(run, world):
        np.testing.assert_allclose(got, want, rtol=1e-6)
        for a, b in zip(jax.tree_util.tree_leaves(got_params),
                        jax.tree_util.tree_leaves(want_params), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(got_params["base"]["w"], base)
        assert have == {k: est[k] for k in have}
        assert have["params"] == 4 * trainable  # float32 masters of the trainable rows alone
        whole = 2 * (7 * 11 + 7 * 3 + 3 * 11 + 11 * 5)  # stages 0-2 keep them whole
        assert have["compute_params"] == (2 * (trainable + shard_rows["base"] * 11)
                                          if stage == 3 else whole)
        mine = base[rank * shard_rows["base"]:][:shard_rows["base"]] if stage else base
        assert local.dtype == np.float32
        np.testing.assert_array_equal(local[:len(mine)], mine)


def test_frozen_16_bit_leaves_checkpoint_and_resume_elsewhere(tmp_path):
    """A state whose frozen leaves keep no masters saves them (cast from the
    compute params) and loads at other world sizes and stages, and into an
    offloaded state that keeps their masters, with every value as saved; on
    two ranks the resumed run is the uninterrupted one."""
    data = bf16_data()
    want, want_params, _, _ = ops.spawn(lambda c: bf16_run(c, 3, data), 2)[0]
    first, saved, _, _ = ops.spawn(lambda c: bf16_run(c, 3, data, steps=2,
                                                         save=tmp_path / "ck"), 2)[0]
    for world, stage, offload in [(2, 3, None), (2, 1, None), (2, 3, shard.Offload()),
                                  (3, 3, None), (3, 2, None), (1, 0, None)]:
        rest, got, state, loaded = ops.spawn(lambda c, s=stage, o=offload: bf16_run(
            c, s, data[2:], load=tmp_path / "ck", offload=o), world)[0]
        for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(saved),
                        strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{world} ranks, stage {stage}")
        assert (state.meta.master_packing is None) == (offload is not None)
        if world == 2:  # bfloat16 losses and gradients round by the ranks' rows
            np.testing.assert_allclose(first + rest, want, rtol=1e-6)
            for a, b in zip(jax.tree_util.tree_leaves(got),
                            jax.tree_util.tree_leaves(want_params), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_state_with_other_leaves_frozen_is_refused_naming_them():
    def run(comm):
        made = shard.zero3(jax_loss, optimizer=ops.adamw(LR), comm=comm,
                           trainable={"base": False, "lora": True, "head": True})
        other = shard.zero3(jax_loss, optimizer=ops.adamw(LR), comm=comm,
                            trainable={"base": False, "lora": True, "head": False})
        batch = {"x": np.ones((2, 7), np.float32), "y": np.ones((2, 5), np.float32)}
        other.init(jax_params())
        other(made.init(jax_params()), batch)

    with pytest.raises(ValueError, match=r"other leaves frozen \(differing: \['head'\]\)"):
        ops.spawn(run, 1)

    def masters(comm):
        bf16 = shard.Precision(param_dtype="bfloat16")
        made = shard.zero3(jax_loss, optimizer=ops.adamw(LR), comm=comm,
                           trainable={"base": False, "lora": True, "head": True})
        other = shard.zero3(jax_loss, optimizer=ops.adamw(LR), comm=comm, precision=bf16,
                            trainable={"base": False, "lora": True, "head": True},
                            offload=shard.Offload())
        batch = {"x": np.ones((2, 7), np.float32), "y": np.ones((2, 5), np.float32)}
        other.init(bf16_params())
        other(made.init(bf16_params()), batch)

    with pytest.raises(ValueError, match="keeps no masters for its frozen leaves"):
        ops.spawn(masters, 1)


def test_trainable_refusals_name_the_problem():
    def run(comm, trainable):
        step = shard.zero3(jax_loss, optimizer=ops.adamw(LR), comm=comm, trainable=trainable)
        return step.init(jax_params())

    with pytest.raises(ValueError, match="freezes every leaf"):
        ops.spawn(lambda c: run(c, False), 1)
    with pytest.raises(TypeError, match=r"trainable\['head'\] must be True or False"):
        ops.spawn(lambda c: run(c, {"base": False, "lora": True, "head": "yes"}), 1)
    with pytest.raises(ValueError, match="pytree of bools shaped like the params"):
        ops.spawn(lambda c: run(c, {"base": False}), 1)


def _outputs():
    from transformers.modeling_outputs import CausalLMOutput

    return {
        "dict": (lambda m, b: {"loss": mse(m, b), "logits": m(b[0])}, True),
        "ModelOutput": (lambda m, b: CausalLMOutput(loss=mse(m, b), logits=m(b[0])), True),
        "None": (lambda m, b: None, TypeError),
        "float": (lambda m, b: float(mse(m, b)), TypeError),
        "dict without loss": (lambda m, b: {"logits": m(b[0])}, TypeError),
        "vector": (lambda m, b: (m(b[0]) - b[1]).pow(2).mean(0), ValueError),
    }


@pytest.mark.parametrize("kind", list(_outputs()))
@pytest.mark.parametrize("stage", [1, 3])
def test_torch_loss_outputs_train_or_are_refused_naming_the_type(kind, stage):
    loss, expect = _outputs()[kind]
    torch.manual_seed(0)
    model = Adapted()
    data = batches(2)

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=loss)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR), comm=comm)
        state = step.init(params)
        before = shard.gather(state, comm)
        try:
            state, metrics = step(state, data[0])
        except Exception:
            after = shard.gather(state, comm)  # the refused step changed nothing
            for k in before:
                np.testing.assert_array_equal(after[k], before[k])
            raise
        return metrics["loss"]

    if expect is True:
        with torch.no_grad():
            want = float(mse(model, data[0]))
        assert ops.spawn(run, 2)[0] == pytest.approx(want, rel=1e-5)
    else:
        with pytest.raises(expect, match=kind.split()[0] if kind != "vector" else "scalar"):
            ops.spawn(run, 2)


@pytest.mark.parametrize("stage, precision", [(3, None), (1, "bfloat16")])
def test_module_state_dict_after_training_refuses_instead_of_empty_tensors(stage, precision):
    torch.manual_seed(0)
    model = Adapted()
    data = batches(2)

    def run(comm):
        module = copy.deepcopy(model)
        params, fn = it.functional(module, loss=mse)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR), comm=comm,
                           precision=precision and shard.Precision(param_dtype=precision))
        state = step.init(params)
        state, _ = step(state, data[0])
        with pytest.raises(RuntimeError, match=r"interop\.torch\.state_dict"):
            module.state_dict()
        full = it.state_dict(module, state, comm=comm)
        assert all(v.numel() for v in full.values())
        it.load_state(module, state, comm=comm)
        return {k: v.clone() for k, v in module.state_dict().items()}, full

    got, full = ops.spawn(run, 2)[0]
    assert set(got) == set(full)
    for k in got:
        np.testing.assert_array_equal(got[k].numpy(), full[k].float().numpy(), err_msg=k)


def tiny_llama():
    """The Hugging Face tests' tiny LlamaForCausalLM, seeded."""
    from tests.test_hf_models import built

    return built("llama")


def lora_llama():
    """PEFT's LoRA on :func:`tiny_llama`."""
    import peft

    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    torch.manual_seed(1)  # LoRA's B starts at zero: give it values, so every path is tested
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def lm_loss(model, batch):
    return model(input_ids=batch[0], labels=batch[0])  # a ModelOutput with its loss


def tokens(steps=4, n=6, seq=10):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 64, (n, seq), generator=g),) for _ in range(steps)]


def lora_reference(model, data):
    return adamw_reference(model, data, lambda m, b: lm_loss(m, b).loss)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_peft_lora_llama_matches_one_process_and_exports_adapters_peft_loads(stage, tmp_path,
                                                                          caplog):
    peft = pytest.importorskip("peft")
    model = lora_llama()
    data = tokens()
    want = lora_reference(model, data)
    frozen = {k: v.detach().clone() for k, v in model.named_parameters() if not v.requires_grad}

    def run(comm):
        module = copy.deepcopy(model)
        params, fn = it.functional(module, loss=lm_loss)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state = step.init(params)
        n = data[0][0].shape[0] // comm.world_size
        for (b,) in data:
            state, _ = step(state, (b[comm.rank * n:(comm.rank + 1) * n],))
        it.load_state(module, state, comm=comm)
        if comm.rank == 0:
            module.save_pretrained(tmp_path / "adapter")
        return module

    module = ops.spawn(run, 2)[0]
    for name, p in want.named_parameters():
        got = dict(module.named_parameters())[name].detach()
        if p.requires_grad:
            np.testing.assert_allclose(got.numpy(), p.detach().numpy(), rtol=2e-4, atol=2e-6,
                                       err_msg=name)
        else:
            assert torch.equal(got, frozen[name]), name
    assert "memory bound" not in caplog.text  # no unit gathered again for its frozen weights
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter")
    for name, p in loaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(p.detach(), dict(module.named_parameters())[name].detach()), name


def deep(n):
    return torch.nn.Sequential(*[torch.nn.Linear(5, 5) for _ in range(n)])


def test_a_state_or_checkpoint_of_another_model_is_refused_naming_the_leaves(tmp_path):
    """A 2-layer model's state in a 3-layer model's step, and its checkpoint
    loaded into a fresh step: refused before anything runs, naming the leaves."""
    def sq(m, b):
        return m(b).pow(2).mean()

    x = torch.ones(4, 5)
    torch.manual_seed(0)
    two, three = deep(2), deep(3)

    def run(comm):
        small, fn2 = it.functional(copy.deepcopy(two), loss=sq)
        step2 = shard.zero3(fn2, optimizer=ops.adamw(LR), comm=comm)
        state2 = step2.init(small)
        shard.save(state2, tmp_path / "ckpt", comm=comm)
        big, fn3 = it.functional(copy.deepcopy(three), loss=sq)
        step3 = shard.zero3(fn3, optimizer=ops.adamw(LR), comm=comm)
        fresh = shard.zero3(it.functional(copy.deepcopy(three), loss=sq)[1],
                            optimizer=ops.adamw(LR), comm=comm)
        step3.init(big)
        errors = []
        for attempt in (lambda: step3(state2, x), lambda: shard.load(tmp_path / "ckpt", fresh,
                                                                      comm=comm)):
            try:
                attempt()
            except Exception as e:
                errors.append(e)
        return errors

    (state_error, load_error), _ = ops.spawn(run, 2)
    assert isinstance(state_error, ValueError)
    assert "leaves only the step has: ['2.bias'], ['2.weight']" in str(state_error)
    assert isinstance(load_error, shard.CheckpointError)
    assert "no leaf ['2.bias'] (the model has it" in str(load_error)


class Branchy(torch.nn.Module):
    """A Linear never used, a head used every other step, and a per-rank branch
    (as mixture-of-experts routing): registered in another order than they run."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(7, 9)
        self.never = torch.nn.Linear(9, 9)
        self.head = torch.nn.Linear(9, 5)
        self.expert = torch.nn.ModuleList([torch.nn.Linear(9, 9) for _ in range(2)])
        self.out = torch.nn.Linear(9, 5)

    def forward(self, x: torch.Tensor, k: int, route: int | None = None) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if route is not None:
            h = torch.tanh(self.expert[route](h))
        y = self.out(h)
        return y + self.head(h) if k % 2 else y


def branchy_loss(model, batch):
    x, y, k, route = batch
    return ((model(x, k, route) - y) ** 2).mean()


def branchy_data(n=6, rows=12):
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(rows, 7, generator=g), torch.randn(rows, 5, generator=g), k)
            for k in range(n)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_params_without_a_gradient_are_left_as_torch_adamw_leaves_them(stage, world, caplog):
    """A parameter whose .grad stays None in a step keeps its value, its moments
    and its own step count, as torch.optim.AdamW does; the others match it."""
    torch.manual_seed(0)
    model = Branchy()
    data = branchy_data()
    ref = adamw_reference(model, [(*b, None) for b in data], branchy_loss)

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=branchy_loss)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state = step.init(params)
        n = data[0][0].shape[0] // comm.world_size
        for x, y, k in data:
            part = slice(comm.rank * n, (comm.rank + 1) * n)
            state, _ = step(state, (x[part], y[part], k, None))
        return shard.gather(state, comm), state

    got, state = ops.spawn(run, world)[0]
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(got[name], p.detach().numpy(), rtol=2e-5, atol=1e-6,
                                   err_msg=name)
    skips = dict(zip([leaf.path for leaf in state.meta.layout.leaves], state.skips.tolist(),
                     strict=True))
    assert skips["['never.weight']"] == 6 and skips["['head.bias']"] == 3
    assert skips["['out.weight']"] == 0 and skips["['expert.0.weight']"] == 6
    assert "memory bound" not in caplog.text


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_params_without_a_gradient_keep_their_compute_copies_in_mixed_precision(stage, frozen):
    """bfloat16 compute params at stages 1-2 are written afresh each step: a
    head left out of a step keeps its compute copy (cast from its master) for
    the next step that uses it, so the run is stage 3's; also in a bfloat16
    model whose frozen weight keeps no master."""
    torch.manual_seed(0)
    model, data = Branchy(), branchy_data()
    if frozen:
        model = model.to(torch.bfloat16)
        model.inp.weight.requires_grad_(False)
        data = [(x.to(torch.bfloat16), y.to(torch.bfloat16), k) for x, y, k in data]

    def run(comm, stage):
        params, fn = it.functional(copy.deepcopy(model), loss=branchy_loss)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm,
                           precision=shard.Precision(param_dtype="bf16"))
        state, losses = step.init(params), []
        n = data[0][0].shape[0] // comm.world_size
        for x, y, k in data:
            part = slice(comm.rank * n, (comm.rank + 1) * n)
            state, m = step(state, (x[part], y[part], k, None))
            losses.append(m["loss"])
        return losses, shard.gather(state, comm)

    want, want_params = ops.spawn(lambda c: run(c, 3), 2)[0]
    got, got_params = ops.spawn(lambda c: run(c, stage), 2)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name in want_params:
        np.testing.assert_allclose(got_params[name], want_params[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ranks_taking_different_branches_reduce_in_one_order(stage):
    """Rank r runs expert r (mixture-of-experts routing): every rank still starts
    the same reductions in the same order, and each expert gets the gradient
    of the ranks that used it, the others' part zero, as DDP does."""
    torch.manual_seed(0)
    model = Branchy()
    data = branchy_data(3)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for x, y, k in data:  # the mean over ranks of each rank's loss on its rows and route
        opt.zero_grad()
        (sum(branchy_loss(ref, (x[r * 6:(r + 1) * 6], y[r * 6:(r + 1) * 6], k, r))
             for r in range(2)) / 2).backward()
        opt.step()

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=branchy_loss)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state = step.init(params)
        part = slice(comm.rank * 6, (comm.rank + 1) * 6)
        for x, y, k in data:
            state, _ = step(state, (x[part], y[part], k, comm.rank))
        return shard.gather(state, comm)

    got = ops.spawn(run, 2)[0]
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(got[name], p.detach().numpy(), rtol=2e-5, atol=1e-6,
                                   err_msg=name)


def test_skipped_steps_survive_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = Branchy()
    data = branchy_data(5)

    def run(comm, stop):
        params, fn = it.functional(copy.deepcopy(model), loss=branchy_loss)
        step = shard.zero3(fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        if stop is None:
            state, _ = shard.load(tmp_path / "ckpt", step, comm=comm)
            start = int(state.step)
        else:
            state, start = step.init(params), 0
        n = 6
        for x, y, k in data[start:stop]:
            state, _ = step(state, (x[comm.rank * n:(comm.rank + 1) * n],
                                    y[comm.rank * n:(comm.rank + 1) * n], k, None))
        if stop is not None and stop < len(data):
            shard.save(state, tmp_path / "ckpt", comm=comm)
        return shard.gather(state, comm), state.skips.copy()

    whole, skips = ops.spawn(lambda c: run(c, len(data)), 2)[0]
    ops.spawn(lambda c: run(c, 2), 2)
    resumed, again = ops.spawn(lambda c: run(c, None), 2)[0]
    np.testing.assert_array_equal(again, skips)
    for k in whole:
        np.testing.assert_array_equal(resumed[k], whole[k], err_msg=k)


@pytest.mark.parametrize(("stage", "world", "dtype"), [
    (1, 1, "float32"), (1, 2, "float32"), (1, 3, "float32"), (3, 1, "float32"),
    (3, 2, "float32"), (3, 3, "float32"), (0, 2, "bfloat16"), (1, 2, "bfloat16"),
    (3, 2, "bfloat16"), (3, 3, "bfloat16")])
def test_lora_state_per_rank_equals_estimate_memory_and_keeps_no_frozen_moments(stage, world,
                                                                                 dtype):
    """Frozen leaves keep no moments: a LoRA Llama's per-rank state is its
    masters over W plus two moments of the adapters alone, as estimated; the
    frozen base weights keep no masters where the compute params hold them
    (at stages 1-2, which keep them whole, and in bfloat16 at stages 0 and 3),
    and a step leaves them as they were."""
    pytest.importorskip("peft")
    model = lora_llama().to(getattr(torch, dtype))
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    frozen = {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()
              if not p.requires_grad}

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=lm_loss)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR), comm=comm)
        state = step.init(params)
        est = shard.estimate_memory(params, stage=stage, world_size=comm.world_size,
                                    trainable=trainable)
        full = shard.estimate_memory(params, stage=stage, world_size=comm.world_size)
        have = state.nbytes()
        n = 6 // comm.world_size
        state, _ = step(state, (tokens(1)[0][0][comm.rank * n:(comm.rank + 1) * n],))
        return have, est, full, shard.gather(state, comm)

    for have, est, full, got in ops.spawn(run, world):
        assert have == {k: est[k] for k in have}
        assert est["optimizer"] < full["optimizer"] / 10  # the adapters' moments alone
        if dtype == "bfloat16" or stage == 1:  # the adapters' masters alone
            assert est["params"] < full["params"] / 10
        else:
            assert est["params"] == full["params"]
        for name, value in frozen.items():
            np.testing.assert_array_equal(np.asarray(got[name], np.float32), value,
                                          err_msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_only_the_trainable_leaves_gradients_are_reduced(stage, monkeypatch):
    """A LoRA Llama's gradient reductions carry its adapters alone: the
    elements reduce-scattered (stages 1-3) or all-reduced (stage 0) are the
    trainable params' rows padded to the world size, not the frozen base's, and
    the gradient buffer ``estimate_memory`` counts is that size; so does
    stages 1-2's all-gather of the updated params (the base never changes)."""
    pytest.importorskip("peft")
    from ops.comm._threads import ThreadCommunicator

    model, world = lora_llama(), 2
    data = tokens(steps=1)
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    padded = sum(-(-p.shape[0] // world) * world * p[0].numel() if p.dim() else p.numel()
                 for p in model.parameters() if p.requires_grad)
    moved = {"reduce_scatter": [], "all_reduce": [], "all_gather": []}
    start = ThreadCommunicator._start

    def spy(self, name, out, x, arg=None):  # every thread-rank collective enters here
        if name in moved:
            moved[name].append(x.size)
        return start(self, name, out, x, arg)

    monkeypatch.setattr(ThreadCommunicator, "_start", spy)

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=lm_loss)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR), comm=comm)
        state = step.init(params)
        for sizes in moved.values():
            sizes.clear()
        comm.barrier()
        n = data[0][0].shape[0] // world
        step(state, (data[0][0][comm.rank * n:(comm.rank + 1) * n],))
        comm.barrier()
        return shard.estimate_memory(params, stage=stage, world_size=world,
                                     trainable=trainable)["grads"]

    grads_bytes = ops.spawn(run, world)[0]
    totals = 5 + len(trainable)  # the step's one all-reduce of its numbers
    gradients = [n for n in moved["all_reduce"] if n != totals]
    if stage == 0:  # each rank all-reduces the whole trainable gradient
        assert sum(gradients) == world * sum(p.numel() for p in model.parameters()
                                             if p.requires_grad)
        assert not moved["reduce_scatter"]
    else:
        assert sum(moved["reduce_scatter"]) == world * padded  # each rank's input
        assert not gradients
    if stage in (1, 2):
        assert sum(moved["all_gather"]) == padded  # each rank's shard of the adapters
    whole = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert grads_bytes == 4 * (whole if stage <= 1 else padded // world)


def test_frozen_params_checkpoint_and_resume_at_another_world_size(tmp_path):
    """Frozen leaves are saved, resharded and consolidated like the rest; the
    resumed run continues the one-process trajectory."""
    torch.manual_seed(0)
    model = Adapted()
    data = batches()
    want = torch_reference(model, data)
    before = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}

    def run(comm, start, stop):
        params, fn = it.functional(copy.deepcopy(model), loss=mse)
        step = shard.zero3(fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state = step.init(params) if start == 0 else shard.load(tmp_path / "ck", step,
                                                                 comm=comm)[0]
        n = data[0][0].shape[0] // comm.world_size
        for b in data[start:stop]:
            state, _ = step(state, tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b))
        if start == 0:
            shard.save(state, tmp_path / "ck", comm=comm)
        return shard.gather(state, comm)

    ops.spawn(lambda c: run(c, 0, 3), 2)
    got = ops.spawn(lambda c: run(c, 3, STEPS), 3)[0]
    shard.checkpoint.consolidate(tmp_path / "ck", tmp_path / "model.safetensors")
    from safetensors.numpy import load_file

    whole = load_file(tmp_path / "model.safetensors")
    for k, p in model.named_parameters():
        if p.requires_grad:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], before[k], err_msg=k)
            np.testing.assert_array_equal(whole[k], before[k], err_msg=k)


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_and_missing_gradients_on_the_device_stand_in(stage):
    """Frozen leaves, a never-used Linear and a head used every other step, on
    device state: torch's AdamW's result, and no host read in a step where every
    trainable parameter got its gradient."""
    from ops.testing import STANDIN, SYNCS, to_device

    torch.manual_seed(0)
    model = Branchy()
    model.inp.weight.requires_grad_(False)
    data = branchy_data(4)
    ref = adamw_reference(model, [(*b, None) for b in data], branchy_loss)

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=branchy_loss)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state = step.init(to_device(params, STANDIN))
        reads = []
        for x, y, k in data:
            part = slice(comm.rank * 6, (comm.rank + 1) * 6)
            SYNCS.reset()
            state, _ = step(state, (x[part], y[part], k, None))
            reads.append(SYNCS.count)
        got = {k: STANDIN.to_host(v) for k, v in shard.gather(state, comm).items()}
        return got, reads

    for got, reads in ops.spawn(run, 2):
        for name, p in ref.named_parameters():
            np.testing.assert_allclose(got[name], p.detach().numpy(), rtol=2e-5, atol=1e-6,
                                       err_msg=name)
        assert reads == [1, 1, 1, 1]  # `never` misses every step: the counts are read


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_frozen_16_bit_leaves_without_masters_on_the_device_stand_in(stage):
    """A bfloat16 module with frozen parameters on device state: no masters for
    them, and every value the host run gives."""
    from ops.testing import STANDIN, to_device

    torch.manual_seed(0)
    model = Adapted().to(torch.bfloat16)
    data = [tuple(t.to(torch.bfloat16) for t in b) for b in batches(3)]

    def run(comm, device):
        params, fn = it.functional(copy.deepcopy(model), loss=mse)
        step = ZERO[stage](fn, optimizer=ops.adamw(LR, weight_decay=WD), comm=comm)
        state = step.init(params if device is None else to_device(params, device))
        n = data[0][0].shape[0] // comm.world_size
        for b in data:
            state, _ = step(state, tuple(t[comm.rank * n:(comm.rank + 1) * n] for t in b))
        got = shard.gather(state, comm)
        if device is not None:
            got = {k: device.to_host(v) for k, v in got.items()}
        return got, state.nbytes(), state.meta.master_packing is not None

    for (want, want_bytes, _), (got, have, packed) in zip(
            ops.spawn(lambda c: run(c, None), 2), ops.spawn(lambda c: run(c, STANDIN), 2),
            strict=True):
        assert packed and have == want_bytes
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        for k, p in model.named_parameters():
            if not p.requires_grad:
                np.testing.assert_array_equal(got[k], p.detach().float().numpy(), err_msg=k)


def test_a_torch_step_with_every_gradient_reads_nothing_back():
    from ops.testing import STANDIN, SYNCS, to_device

    torch.manual_seed(0)
    model = Adapted()  # frozen params get no gradient and ask for no read
    data = batches(3)

    def run(comm):
        params, fn = it.functional(copy.deepcopy(model), loss=mse)
        step = shard.zero3(fn, optimizer=ops.adamw(LR), comm=comm)
        state = step.init(to_device(params, STANDIN))
        reads = []
        for b in data:
            SYNCS.reset()
            state, _ = step(state, tuple(t[comm.rank * 6:(comm.rank + 1) * 6] for t in b))
            reads.append(SYNCS.count)
        return reads

    assert ops.spawn(run, 2) == [[0, 0, 0]] * 2
