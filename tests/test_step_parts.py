"""The ZeRO step's parts, each alone: its frozen configuration, the plan a state
carries (its key), the checks, the update's norm and the offloaded buffers; and that
``shard.load`` reads nothing from a step but its configuration."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import pickle
import types

import jax
import numpy as np
import pytest
import torch

import interop.torch as it
import ops
import shard
from shard.core._mesh import Topology
from shard.step import _checks, _update
from shard.step._config import StepConfig
from shard.step._plan import Plan, make_plan, plan_of
from tests import zero_models as M


def one_comm():
    return ops.spawn(lambda c: c, 1)[0]


def test_the_configuration_is_frozen_and_checked_once():
    step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=one_comm(), clip_norm=1.0)
    assert isinstance(step.config, StepConfig)
    assert (step.stage, step.name, step.config.clip_norm) == (2, "zero2", 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.config.clip_norm = 2.0
    with pytest.raises(AttributeError):
        step.optimizer = ops.adam(1e-3)
    with pytest.raises(ValueError, match="clip_norm must be > 0"):
        StepConfig.make(M.loss, stage=2, optimizer=ops.adamw(M.LR),
                        topology=Topology(one_comm()), options=shard.ZeroOptions(clip_norm=0.0))


def test_no_class_of_the_step_is_assembled_from_mixins():
    import shard.offload._offloader
    import shard.step._step

    for module in (shard.step._step, shard.offload._offloader):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                assert cls.__bases__ == (object,), cls


def test_a_state_carries_its_plans_key_and_the_step_holds_the_plan():
    step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=one_comm())
    assert step.plan is None and step.layout is None
    state = step.init(M.init_params())
    plan = step.plan
    assert state.meta.origin == plan.key and plan_of(state) is plan
    assert plan.config is step.config
    assert plan.layout is state.meta.layout and plan.device is ops.HOST
    new, _ = step(state, M.batches(1)[0])
    assert new.meta.origin == plan.key and step.plan is plan
    assert not any(isinstance(v, (StepConfig, Plan, ops.Communicator))
                   for v in vars(state.meta).values())


def test_load_reads_only_the_configuration_and_gives_the_step_the_plan_of_its_state(
        tmp_path):
    comm = one_comm()
    first = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
    state, _ = first(first.init(M.init_params()), M.batches(1)[0])
    shard.save(state, tmp_path / "ckpt", comm=comm)

    step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
    loaded, _ = shard.load(tmp_path / "ckpt", step, comm=comm, like=M.init_params())
    assert step.plan is plan_of(loaded) and step.plan.config is step.config  # as init's
    after, _ = step(loaded, M.batches(2)[1])
    assert step.plan is plan_of(loaded)
    want, _ = first(state, M.batches(2)[1])
    for a, b in zip(after.master, want.master, strict=True):
        np.testing.assert_array_equal(a, b)


def _reaches(root, target):
    """Whether ``target`` is reachable from ``root`` through the objects' references
    (not through classes, modules or functions, which reach every module's globals)."""
    seen, todo = set(), [root]
    while todo:
        x = todo.pop()
        if x is target:
            return True
        if id(x) in seen or isinstance(x, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(x))
        todo.extend(gc.get_referents(x))
    return False


def _torch_step(comm, trainable=None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.Linear(8, 3))
    if trainable == "head":
        net[0].weight.requires_grad_(False)
    params, fn = it.functional(net, loss=lambda m, b: m(b).pow(2).mean())
    return net, shard.zero2(fn, optimizer=ops.adamw(1e-2), comm=comm), params


def test_a_state_pickles_compares_and_prints_without_its_step_module_or_communicator():
    comm = one_comm()
    net, step, params = _torch_step(comm, trainable="head")
    state, _ = step(step.init(params), torch.randn(4, 5))
    text = repr(state)
    copy = pickle.loads(pickle.dumps(state))
    assert copy.meta == state.meta and repr(copy) == text and "Sequential" not in text
    for a, b in zip(jax.tree.leaves(copy.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, b)  # frozen leaves' masters cast from the compute params
    for a, b in zip(jax.tree.leaves(copy.opt), jax.tree.leaves(state.opt), strict=True):
        np.testing.assert_array_equal(a, b)
    want, _ = step(state, torch.ones(4, 5))
    got, _ = step(copy, torch.ones(4, 5))  # the copy is this step's state: it steps on
    for a, b in zip(got.master, want.master, strict=True):
        np.testing.assert_array_equal(a, b)
    for held in (net, step.config, comm, step.config.loss_fn):
        assert not _reaches(got, held) and not _reaches(copy, held), type(held)
    assert _reaches(got, got.master[0])  # the walk finds what a state holds
    del step, _  # the metrics hold their step
    gc.collect()
    with pytest.raises(RuntimeError, match=r"save: the step that made this state is gone.*"
                       r"torch module's buffers"):
        shard.save(got, "unused", comm=comm)


def test_a_state_from_elsewhere_is_checked_against_the_steps_own_plan():
    """A state whose plan no step here holds (unpickled from another process: its key
    names no live plan) steps on where it fits the step's plan, bit for bit, and is
    refused by name where its frozen leaves or its params differ."""
    comm = one_comm()
    _, step, params = _torch_step(comm, trainable="head")
    state, _ = step(step.init(params), torch.randn(4, 5))
    stranger = pickle.loads(pickle.dumps(state))
    stranger = stranger.replace(meta=dataclasses.replace(stranger.meta, origin=(0, 1)))
    assert plan_of(stranger) is None and stranger.meta == state.meta
    got, _ = step(stranger, torch.ones(4, 5))
    want, _ = step(state, torch.ones(4, 5))
    for a, b in zip(got.master, want.master, strict=True):
        np.testing.assert_array_equal(a, b)
    _, all_trainable, params = _torch_step(comm)
    all_trainable.init(params)
    with pytest.raises(ValueError, match="made with other leaves frozen"):
        all_trainable(pickle.loads(pickle.dumps(got)), torch.ones(4, 5))
    other = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
    other.init(M.init_params())
    with pytest.raises(ValueError, match="does not fit the params"):
        other(pickle.loads(pickle.dumps(got)), M.batches(1)[0])


def test_a_state_of_another_step_must_fit_this_steps_plan():
    comm = one_comm()
    zero3 = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
    state = zero3.init(M.init_params())
    twin = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
    with pytest.raises(RuntimeError, match="call init"):
        twin(state, M.batches(1)[0])
    twin.init(M.init_params())
    twin(state, M.batches(1)[0])  # the same layout and device: it fits
    zero2 = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
    zero2.init(M.init_params())
    with pytest.raises(ValueError, match="made for stage 3"):
        _checks.check_fits(zero2.plan, state)


def test_the_norm_and_loss_part_alone():
    """Sum of squares of the shards and the loss total, with one all-reduce."""
    config = StepConfig.make(M.loss, stage=3, optimizer=ops.adamw(M.LR),
                             topology=Topology(one_comm()))
    plan = make_plan(config, M.init_params())
    rng = np.random.default_rng(0)
    shards = [rng.standard_normal(u.local_size).astype(np.float32) for u in plan.layout.units]
    totals = np.array([0.0, 2.5])
    _update.norm_and_loss(plan, shards, totals, [])
    want = sum(float(np.sum(g.astype(np.float64) ** 2)) for g in shards)
    np.testing.assert_allclose(totals, [want, 2.5], rtol=1e-6)


def test_the_offloaded_buffers_part_alone(tmp_path):
    config = StepConfig.make(M.loss, stage=3, optimizer=ops.adamw(M.LR),
                             topology=Topology(one_comm()),
                             options=shard.ZeroOptions(offload=shard.Offload("disk",
                                                                              path=tmp_path)))
    plan = make_plan(config, M.init_params())
    offloader = plan.offloader()

    def fill(u, kind, buf):
        buf[...] = {"master": 1.0, "exp_avg": 2.0, "exp_avg_sq": 0.0}[kind] * (u + 1)

    master, exp_avg, exp_avg_sq, copies = offloader.buffers(fill)
    for u, unit in enumerate(plan.layout.units):
        assert master[u].shape == (unit.local_size,) and isinstance(master[u], np.memmap)
        assert np.all(master[u] == u + 1) and np.all(exp_avg[u] == 2 * (u + 1))
        assert not exp_avg_sq[u].any() and np.all(copies[u] == u + 1)
