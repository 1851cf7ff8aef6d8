"""The step's arguments: the ranks from one place (``mesh=`` or ``comm=``,
resolved into a topology; see [Note: topology]) and every other option a field
of ``shard.ZeroOptions``, written once (its docstring is zero0-3's)."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import numpy as np
import pytest

import ops
import shard
from tests import zero_models as M

ZERO = (shard.zero0, shard.zero1, shard.zero2, shard.zero3)


@pytest.mark.parametrize("zero", ZERO, ids=lambda z: z.__name__)
def test_the_transforms_take_at_most_ten_keywords_and_return_a_zero_step(zero):
    sig = inspect.signature(zero)
    keywords = [p for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert len(keywords) <= 10
    assert {"optimizer", "mesh", "comm", "options"} <= {p.name for p in keywords}
    assert typing.get_type_hints(zero)["return"] is shard.ZeroStep
    fields = {f.name: f.default for f in dataclasses.fields(shard.ZeroOptions)}
    for p in keywords:  # the others are options, with the options' defaults
        if p.name not in ("optimizer", "mesh", "comm", "options"):
            assert p.default == fields[p.name], p.name
    doc = zero.__doc__
    documented = shard.ZeroOptions.__doc__.split("Attributes:")[1]
    for name in fields:  # every option documented once, and in the transform's Args
        assert f"\n      {name}: " in documented, name
        assert f"\n  {name}: " in doc or f"\n    {name}: " in doc, name


def run_steps(comm_or_mesh, steps=3, **kw):
    where = ({"mesh": comm_or_mesh} if isinstance(comm_or_mesh, shard.Mesh)
             else {"comm": comm_or_mesh})
    step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), **where, **kw)
    state = step.init(M.init_params())
    data = step.config.topology.data
    losses = []
    for b in M.batches(steps):
        state, metrics = step(state, shard.split_batch(b, rank=data.rank,
                                                       world_size=data.world_size))
        losses.append(metrics["loss"])
    return [np.asarray(x) for x in state.master], losses


def test_an_option_as_a_keyword_or_in_options_and_a_mesh_or_its_communicator_are_one_step():
    """3 ranks (dividing no leaf of the model): the same bits whichever way the
    options and the ranks are given."""
    def run(comm):
        ways = [run_steps(comm, clip_norm=0.05, options=shard.ZeroOptions(prefetch=2)),
                run_steps(comm, options=shard.ZeroOptions(clip_norm=0.05, prefetch=2)),
                run_steps(shard.Mesh(comm, {"data": 3}), clip_norm=0.05,
                          options=shard.ZeroOptions(prefetch=2))]
        for masters, losses in ways[1:]:
            assert losses == ways[0][1]
            for a, b in zip(masters, ways[0][0], strict=True):
                np.testing.assert_array_equal(a, b)
        return ways[0][1]

    losses = ops.spawn(run, 3)
    assert losses[0] == losses[1] == losses[2] and len(set(losses[0])) == 3


def test_an_option_given_twice_or_options_not_zero_options_are_refused_by_name():
    def run(comm):
        with pytest.raises(ValueError, match=r"zero3: clip_norm is given as clip_norm= and in "
                                             r"options=; give it once"):
            shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm, clip_norm=1.0,
                        options=shard.ZeroOptions(clip_norm=2.0))
        with pytest.raises(TypeError, match=r"zero2: options must be a shard.ZeroOptions"):
            shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm, options={"prefetch": 2})
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'prefetch'"):
            shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm, prefetch=2)

    ops.spawn(run, 1)


def test_the_ranks_are_given_once_and_a_mesh_s_axes_are_named_as_a_step_knows_them():
    def run(comm):
        adamw = ops.adamw(M.LR)
        errors = []
        for kw in ({}, {"comm": comm, "mesh": shard.Mesh(comm, {"data": 2})},
                   {"comm": shard.Mesh(comm, {"data": 2})},
                   {"mesh": comm},
                   {"mesh": shard.Mesh(comm, {"data": 1, "pipe": 2})},
                   {"mesh": shard.Mesh(comm, {"model": 2})},
                   {"mesh": shard.Mesh(comm, {"shard": 2})}):
            with pytest.raises((TypeError, ValueError)) as e:
                shard.zero1(M.loss, optimizer=adamw, **kw)
            errors.append(str(e.value))
        # axes of one rank need nothing: a model axis of 1 without a split, a pipe of 1
        step = shard.zero1(M.loss, optimizer=adamw,
                           mesh=shard.Mesh(comm, {"pipe": 1, "data": 2, "model": 1}))
        assert step.config.topology.data.world_size == 2
        return errors

    errors = ops.spawn(run, 2)[0]
    assert "give the ranks as mesh=shard.Mesh(...) or comm= (one data axis), exactly one of " \
           "them; got neither" in errors[0]
    assert "exactly one of them; got both" in errors[1]
    assert "comm= takes one communicator; pass a shard.Mesh as mesh=" in errors[2]
    assert "mesh must be a shard.Mesh; got ThreadCommunicator" in errors[3]
    assert "the mesh has a 'pipe' axis: the loss must be a shard.Pipeline" in errors[4]
    assert "the mesh has no data axis" in errors[5]
    assert "HSDP's mesh names both 'replicate' and 'shard'" in errors[6]


def test_the_first_rank_of_the_whole_mesh_logs_once_a_step():
    """HSDP over 2 x 2 ranks: one logger call per step, from the rank that is
    first on every axis."""
    calls = []

    def run(comm):
        mesh = shard.Mesh(comm, {"replicate": 2, "shard": 2})
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), mesh=mesh, options=shard.ZeroOptions(
            loggers=[lambda i, m, r=comm.rank: calls.append((r, i))]))
        state = step.init(M.init_params())
        for b in M.batches(2):
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=4))
        return step.config.topology.first, step.config.topology.data_rank

    firsts = ops.spawn(run, 4)
    assert firsts == [(True, 0), (False, 1), (False, 2), (False, 3)]
    assert sorted(calls) == [(0, 1), (0, 2)]


def test_a_deepspeed_config_builds_its_step_on_a_mesh_and_counts_its_data_ranks():
    cfg = shard.from_deepspeed_config({
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})

    def run(comm):
        mesh = shard.Mesh(comm, {"replicate": 2, "shard": 2})
        step = cfg.transform(M.loss, mesh=mesh, prefetch=2)
        with pytest.raises(TypeError, match=r"'replicate' is not an option of a ZeRO step"):
            cfg.transform(M.loss, mesh=mesh, replicate=mesh["replicate"])
        return (step.config.topology.ranks, step.config.replicate is mesh["replicate"],
                step.clip_norm, step.prefetch)

    assert ops.spawn(run, 4) == [(4, True, 1.0, 2)] * 4
    with pytest.raises(ValueError, match=r"train_batch_size 16 != .* x data ranks 2"):
        cfg.transform(M.loss, comm=ops.spawn(lambda c: c, 2)[0])

