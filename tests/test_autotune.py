"""shard.autotune: the fastest trial of the ZeRO configurations that fit a
memory budget (see [Note: autotuning])."""

from __future__ import annotations

import numpy as np
import pytest

import ops
import shard
from tests import zero_models as M

rng = np.random.default_rng(0)
DATA = {"x": rng.standard_normal((96, 7)).astype(np.float32),
        "y": rng.standard_normal((96, 3)).astype(np.float32)}


def need(stage, offload=None):
    est = shard.estimate_memory(M.init_params(), stage=stage, world_size=2,
                                offload=shard.Offload(offload) if offload else None)
    return est.get("on_device", est["total"])


def whole_model(path):
    return "all"  # one unit: the whole model gathered at once


def test_the_choice_fits_the_budget_and_is_the_fastest_trial(caplog):
    budget = need(2) - 1  # stage 1, and stage 2 without offload, do not fit

    def run(comm):
        return shard.autotune(M.loss, M.init_params(), DATA, optimizer=ops.adamw(M.LR),
                              batch_size=24, budget=budget, comm=comm, micro_batches=(1, 2, 5),
                              prefetch=(1, 2), units=(None, whole_model), steps=2)

    with caplog.at_level("INFO", logger="shard.tuning._autotune"):
        first, second = ops.spawn(run, 2)
    assert first == second  # every rank the same trials (its slowest rank's times), one choice
    chosen = [t for t in first.trials if t["status"] == "chosen"]
    assert len(chosen) == 1
    [c] = chosen
    ran = [t for t in first.trials if t["ms"] is not None]
    assert c["ms"] == min(t["ms"] for t in ran if t["status"] in ("ok", "chosen"))
    assert c["measured"] <= budget and c["estimated"] <= budget
    assert (first.stage, first.options.gradient_accumulation_steps,
            first.options.prefetch) == (c["stage"], c["micro_batches"], c["prefetch"])
    assert (first.options.offload is not None) == (c["offload"] == "host")
    statuses = {(t["stage"], t["offload"]): t["status"] for t in first.trials
                if t["micro_batches"] == 1}
    assert statuses[(1, None)] == statuses[(2, None)] == "over budget (estimated)"
    assert all(t["ms"] is None for t in first.trials if t["status"].startswith("over budget (e"))
    assert {t["status"] for t in first.trials if t["micro_batches"] == 5} == {
        "batch does not divide"}  # 24 rows do not cut into 5 x 2 ranks
    assert not any(t["prefetch"] == 2 or t["units"] != "-" for t in first.trials
                   if t["stage"] < 3)  # prefetch and units are stage 3's
    assert {t["units"] for t in first.trials if t["stage"] == 3} == {"-", "whole_model"}
    assert first.options.units is (whole_model if c["units"] == "whole_model" else None)
    [logged] = [r.getMessage() for r in caplog.records if "autotune: the trials" in r.message]
    table = logged.split("\n", 1)[1]  # the first rank's log: the table after its heading
    assert table.count("\n| ") == len(first.trials) and "| chosen |" in table


def test_the_chosen_options_build_a_step_that_trains():
    def run(comm):
        result = shard.autotune(M.loss, M.init_params(), DATA, optimizer=ops.adamw(M.LR),
                                batch_size=24, budget=10**9, comm=comm, stages=(2, 3),
                                micro_batches=(1, 2), offload=(None,), prefetch=(1,),
                                steps=1)
        step = (shard.zero2, shard.zero3)[result.stage - 2](
            M.loss, optimizer=ops.adamw(M.LR), comm=comm, options=result.options)
        loader = shard.DataLoader(DATA, 24, comm=comm,
                                  gradient_accumulation_steps=result.options.
                                  gradient_accumulation_steps)
        state, losses = step.init(M.init_params()), []
        for b in loader:
            state, metrics = step(state, b)
            losses.append(metrics["loss"])
        return len(result.trials), len(losses), bool(np.isfinite(losses).all())

    assert ops.spawn(run, 2) == [(4, 4, True)] * 2


def test_a_budget_nothing_fits_is_refused_with_the_table():
    def run(comm):
        with pytest.raises(ValueError, match=r"no candidate fits 8 bytes per rank:\n\| stage"):
            shard.autotune(M.loss, M.init_params(), DATA, optimizer=ops.adamw(M.LR),
                           batch_size=24, budget=8, comm=comm)
        with pytest.raises(TypeError, match="give the ranks as mesh= or comm="):
            shard.autotune(M.loss, M.init_params(), DATA, optimizer=ops.adamw(M.LR),
                           batch_size=24, budget=10**6)
        with pytest.raises(ValueError, match="budget must be bytes > 0"):
            shard.autotune(M.loss, M.init_params(), DATA, optimizer=ops.adamw(M.LR),
                           batch_size=24, budget=0, comm=comm)

    ops.spawn(run, 1)


def test_autotune_runs_over_an_nccl_communicator_on_device_state():
    """On a GPU machine ``ops.init_from_env()`` gives an NCCL communicator: the
    trials' times and bytes go between the ranks through the device (the NCCL
    stand-in over the device stand-in here), as every other host value does."""
    from ops.testing import STANDIN, to_device
    from tests.nccl_standin import run_ranks

    nccl = pytest.importorskip("cupy.cuda.nccl")

    def run(comm):
        return shard.autotune(M.loss, to_device(M.init_params(), STANDIN), DATA,
                              optimizer=ops.adamw(M.LR), batch_size=24, budget=1 << 30,
                              comm=comm, stages=(1, 3), micro_batches=(1,), offload=(None,),
                              steps=1, warmup=0)

    (first, second), _ = run_ranks(2, run, nccl)
    assert first == second and first.stage in (1, 3)
    assert [t["status"] for t in first.trials].count("chosen") == 1
    assert all(t["ms"] > 0 and t["measured"] > 0 for t in first.trials)
