"""shard.pipeline: stages x micro-batches x data parallelism against one process
([Note: pipeline])."""

from __future__ import annotations

import time

import pytest

import ops
import shard
from tests import pipeline_models as PM

ZERO = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


@pytest.fixture(scope="module")
def want():
    return PM.reference()


@pytest.mark.parametrize("data", [1, 2])
@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_matches_one_process(want, stages, micro, data):
    schedule = "1f1b" if (stages + micro) % 2 else "gpipe"
    zero = ZERO[1 + (stages + micro + data) % 3]
    results = ops.spawn(lambda c: PM.run(c, stages=stages, microbatches=micro,
                                         schedule=schedule, zero=zero), stages * data)
    assert PM.worst_difference(results, want) < 1e-5
    covered = sorted(i for layers, _ in results for i in layers)
    assert covered == sorted(list(range(PM.LAYERS)) * data)  # every layer, once per data rank
    losses = {tuple(round(x, 6) for x in r[1]) for r in results}
    assert len(losses) == 1  # every rank reports the same loss


def test_clipping_uses_the_norm_over_every_stage():
    want = PM.reference(clip_norm=0.05)
    results = ops.spawn(lambda c: PM.run(c, stages=3, microbatches=2, clip_norm=0.05), 6)
    assert PM.worst_difference(results, want) < 1e-5
    unclipped = PM.reference()
    assert PM.worst_difference(results, unclipped) > 1e-3  # the clip did act


def test_a_failing_stage_ends_every_rank_with_its_error():
    def boom(p, h, b):
        raise FloatingPointError("stage 1 blew up")

    layered = shard.Layered([PM.hidden, boom, PM.last])

    def run(comm):
        pipe = shard.pipeline(layered, comm=comm, stages=3, microbatches=2)
        step = shard.zero1(pipe, optimizer=ops.adamw(1e-3), comm=pipe.data)
        state = step.init(pipe.params(PM.init_params()[:3]))
        step(state, PM.batches(1)[0])

    t0 = time.monotonic()
    with pytest.raises(FloatingPointError, match="stage 1 blew up"):
        ops.spawn(run, 3, timeout=60)
    assert time.monotonic() - t0 < 20


def test_bad_pipeline_arguments_are_refused():
    comm = ops.spawn(lambda c: c, 1)[0]
    with pytest.raises(TypeError, match="Layered"):
        shard.pipeline(PM.last, comm=comm, stages=1)
    with pytest.raises(ValueError, match="divide the world size"):
        shard.pipeline(PM.LAYERED, comm=comm, stages=2)
    with pytest.raises(ValueError, match="schedule"):
        shard.pipeline(PM.LAYERED, comm=comm, stages=1, schedule="interleaved")
    with pytest.raises(ValueError, match="balance"):
        shard.pipeline(PM.LAYERED, comm=comm, stages=1, balance=[2, 3])


@pytest.mark.multiprocess
@pytest.mark.parametrize("routed", [False, True])
def test_two_by_two_gloo_processes(gloo_shared, routed):
    """routed: behind the communicator init_from_env makes on a GPU machine (host
    buffers to gloo), as there."""
    reports = gloo_shared("pipeline_routed" if routed else "pipeline", 4)
    for rep in reports:
        assert rep.get("ok"), rep
        assert rep["worst"] < 1e-5, rep


def test_a_stage_checkpoint_names_its_layers_and_loads_back(tmp_path):
    def save(comm):
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=2, microbatches=2)
        step = shard.zero2(pipe, optimizer=ops.adamw(PM.LR), comm=pipe.data)
        state, _ = step(step.init(pipe.params(PM.init_params())), PM.batches(1)[0])
        shard.save(state, tmp_path / f"stage{pipe.stage}", comm=pipe.data)
        return sorted(pipe.params(PM.init_params())), shard.gather(state, pipe.data)

    (layers0, _), (layers1, whole1) = ops.spawn(save, 2)
    assert layers0 == [0, 1, 2] and layers1 == [3, 4]  # balanced by parameter count

    def load_plain(comm):  # the whole model from one stage's checkpoint: refused
        step = shard.zero2(PM.LAYERED, optimizer=ops.adamw(PM.LR), comm=comm)
        step.init(PM.init_params())
        shard.load(tmp_path / "stage1", step, comm=comm)

    with pytest.raises(shard.CheckpointError, match="no leaf"):
        ops.spawn(load_plain, 1)

    def load_stage(comm):  # the same stage, on its own
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=2, microbatches=2)
        step = shard.zero2(pipe, optimizer=ops.adamw(PM.LR), comm=pipe.data)
        step.init(pipe.params(PM.init_params()))
        state, _ = shard.load(tmp_path / f"stage{pipe.stage}", step, comm=pipe.data)
        return shard.gather(state, pipe.data)

    again = ops.spawn(load_stage, 2)[1]
    for i in (3, 4):
        for k in ("w", "b"):
            assert (again[i][k] == whole1[i][k]).all()


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_pipeline_benchmark_prints_its_table(model, run_benchmark):
    out = run_benchmark("pipeline", "--stages", 2, "--micro", 2, "--layers", 2, "--width", 64,
                        "--batch", 8, "--steps", 1, "--model", model, "--seq", 8)
    rows = [line for line in out.splitlines() if line.startswith("| 2 | 2 |")]
    ds = "DeepSpeed is not installed" not in out  # its three columns, when it is
    jax_row = model == "mlp"  # ours over JAX layers: three more columns
    assert len(rows) == 1 and len(rows[0].split("|")) == 11 + 3 * jax_row + 3 * ds, out


def test_loggers_write_once_per_step_for_the_whole_mesh(tmp_path):
    import csv

    log = shard.CSVLogger(tmp_path / "m.csv")

    def run(comm):
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=2, microbatches=2)
        step = shard.zero1(pipe, optimizer=ops.adamw(PM.LR), comm=pipe.data,
                           options=shard.ZeroOptions(loggers=[log]))
        state = step.init(pipe.params(PM.init_params()))
        for b in PM.batches(3):
            state, _ = step(state, shard.split_batch(b, rank=pipe.data.rank, world_size=2))

    ops.spawn(run, 4)
    log.close()
    assert [r["step"] for r in csv.DictReader((tmp_path / "m.csv").open())] == ["1", "2", "3"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_activation_checkpointing_recomputes_and_changes_nothing(schedule):
    def run(comm, checkpointing):
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=2, microbatches=4,
                              schedule=schedule, activation_checkpointing=checkpointing)
        step = shard.zero2(pipe, optimizer=ops.adamw(PM.LR), comm=pipe.data)
        state = step.init(pipe.params(PM.init_params()))
        for b in PM.batches(2):
            state, _ = step(state, b)
        return shard.gather(state, pipe.data), pipe.forward_passes, len(pipe._layers)

    plain = ops.spawn(lambda c: run(c, False), 2)
    saved = ops.spawn(lambda c: run(c, True), 2)
    for (a, fa, n), (b, fb, _) in zip(plain, saved, strict=True):
        for i in a:
            for k in a[i]:
                assert (a[i][k] == b[i][k]).all()  # recomputation gives the same bits
        assert fa == 2 * 4 * n and fb == 2 * 4 * (2 * n - 1)  # steps x micro x layers


def test_pipelined_checkpoints_load_into_plain_steps_and_back(tmp_path):
    import numpy as np

    batches = PM.batches(4)

    def pipelined(comm):  # 3 stages x 2 data ranks, 2 steps, saved
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=3, microbatches=2)
        step = shard.zero3(pipe, optimizer=ops.adamw(PM.LR, weight_decay=PM.WD),
                           comm=pipe.data)
        state = step.init(pipe.params(PM.init_params()))
        for b in batches[:2]:
            state, _ = step(state, shard.split_batch(b, rank=pipe.data.rank, world_size=2))
        pipe.save(state, tmp_path / "pipe", extra={"seen": 2})

    ops.spawn(pipelined, 6)

    def plain(comm):  # ...resumed unpipelined on 4 ranks, then saved plainly
        step = shard.zero2(PM.LAYERED, optimizer=ops.adamw(PM.LR, weight_decay=PM.WD),
                           comm=comm)
        state, extra = shard.load(tmp_path / "pipe", step, comm=comm)
        assert extra == {"seen": 2}
        b = batches[2]
        state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=4))
        shard.save(state, tmp_path / "plain", comm=comm)
        return shard.gather(state, comm)

    after3 = ops.spawn(plain, 4)[0]

    def back(comm):  # ...and into a 2-stage pipeline again for the last step
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=2, microbatches=4)
        step = shard.zero1(pipe, optimizer=ops.adamw(PM.LR, weight_decay=PM.WD),
                           comm=pipe.data)
        step.init(pipe.params(PM.init_params()))
        state, _ = pipe.load(tmp_path / "plain", step)
        state, _ = step(state, batches[3])
        return shard.gather(state, pipe.data)

    final = ops.spawn(back, 2)
    want = PM.reference(steps=4)
    for got in final:
        for i, layer in got.items():
            for k in layer:
                np.testing.assert_allclose(layer[k], want[i][k], rtol=1e-5, atol=1e-6)
    for i in range(PM.LAYERS):
        assert set(after3[i]) == {"w", "b"}

    from safetensors.numpy import load_file

    from shard.checkpoint import consolidate

    consolidate(tmp_path / "pipe", tmp_path / "pipe.safetensors")  # every stage's layers
    assert sorted(load_file(tmp_path / "pipe.safetensors")) == sorted(
        f"{i}.{k}" for i in range(PM.LAYERS) for k in ("b", "w"))

    import json  # a stage left at another step (a save that did not finish): refused
    manifest = tmp_path / "pipe" / "stage-001" / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(dict(m, step=1)))
    with pytest.raises(shard.CheckpointError, match="did not finish on every stage"):
        ops.spawn(lambda c: shard.load(tmp_path / "pipe", shard.zero2(
            PM.LAYERED, optimizer=ops.adamw(PM.LR), comm=c), comm=c), 1)


def test_balance_by_time_gives_the_slow_layers_a_stage_of_their_own():
    import jax.numpy as jnp
    import numpy as np

    def small(p, h, b):
        return jnp.tanh((b if h is None else h)[:, :8] @ p["w"])

    def big(p, h, b):
        for _ in range(30):  # about 30 times the work of a small layer
            h = jnp.tanh(h @ p["w"])
        return h

    def last(p, h, b):
        return jnp.mean(h @ p["w"])

    layered = shard.Layered([small, big, small, last])
    rng = np.random.default_rng(0)
    params = [{"w": rng.standard_normal((8, 256)).astype(np.float32)},
              {"w": rng.standard_normal((256, 256)).astype(np.float32) / 16},
              {"w": rng.standard_normal((8, 256)).astype(np.float32)},
              {"w": rng.standard_normal((256, 1)).astype(np.float32)}]
    x = rng.standard_normal((64, 256)).astype(np.float32)
    # three stages: only the big layer (index 1) alone keeps the slowest stage at its time
    assert shard.balance_by_time(layered, params, x, 3) == [1, 1, 2]
    by_count = shard.pipeline(layered, comm=ops.spawn(lambda c: c, 1)[0], stages=1)
    assert list(by_count.layers_of(params)) == [0, 1, 2, 3]


@pytest.mark.parametrize("zero", [shard.zero1, shard.zero2, shard.zero3])
def test_pipelines_on_the_device_stand_in_match_the_reference(device, zero):
    from ops.testing import to_device

    def run(comm, zero):
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=2, microbatches=2)
        step = zero(pipe, optimizer=ops.adamw(PM.LR, weight_decay=PM.WD), comm=pipe.data)
        state = step.init(to_device(pipe.params(PM.init_params()), device))
        for b in PM.batches(4):
            state, m = step(state, b)
        whole = shard.gather(state, pipe.data)
        return {i: {k: device.to_host(v) for k, v in layer.items()}
                for i, layer in whole.items()}, [m["loss"]]

    results = ops.spawn(lambda c: run(c, zero), 2)
    assert PM.worst_difference(results, PM.reference()) < 1e-5


@pytest.mark.parametrize(("stages", "data", "zero"), [(1, 2, 3), (2, 2, 2), (3, 1, 1)])
def test_tied_weights_train_as_one_weight(stages, data, zero):
    """The first and last layers share a weight ([Note: tied weights]): on one
    stage or on two, the copies stay equal and follow the model with one shared
    weight, clipped by a norm that counts it once."""
    want = PM.tied_reference(clip_norm=0.05)
    results = ops.spawn(lambda c: PM.run(c, stages=stages, microbatches=2, tied=PM.TIED,
                                         zero=ZERO[zero], clip_norm=0.05), stages * data)
    assert PM.worst_difference(results, want) < 1e-5
    copies = [layers[i]["w"] for layers, _ in results for i in (0, PM.LAYERS - 1) if i in layers]
    assert len(copies) == 2 * data and all((c == copies[0]).all() for c in copies)
    untied = ops.spawn(lambda c: PM.run(c, stages=stages, microbatches=2, zero=ZERO[zero],
                                        clip_norm=0.05), stages * data)
    assert PM.worst_difference(untied, want) > 1e-3  # the tie did act


def test_bad_ties_are_refused_by_name():
    comm = ops.spawn(lambda c: c, 1)[0]
    with pytest.raises(ValueError, match="two or more"):
        shard.pipeline(PM.LAYERED, comm=comm, stages=1, tied=[[(0, "w")]])
    with pytest.raises(ValueError, match="two tied groups"):
        shard.pipeline(PM.LAYERED, comm=comm, stages=1, tied=[[(0, "w"), (1, "w")],
                                                               [(1, "w"), (2, "w")]])
    pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=1, tied=[[(0, "w"), (4, "w")]])
    with pytest.raises(ValueError, match=r"must start equal: \(layer 4, 'w'\).*other values"):
        pipe.params(PM.init_params())
    pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=1, tied=[[(0, "w"), (4, "x")]])
    with pytest.raises(ValueError, match=r"\(layer 4, 'x'\) is not one array"):
        pipe.params(PM.init_params())


def test_evaluate_runs_the_batch_through_the_stages(want):
    """step.evaluate on a pipeline: forward only, stage to stage; every rank gets
    the loss averaged over the data ranks, as the unpipelined model's."""
    batch = PM.batches(1, rows=8)[0]

    def run(comm):
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=3, microbatches=2)
        step = shard.zero3(pipe, optimizer=ops.adamw(PM.LR, weight_decay=PM.WD), comm=pipe.data)
        state = step.init(pipe.params(PM.init_params()))
        for b in PM.batches():
            state, _ = step(state, shard.split_batch(b, rank=pipe.data.rank,
                                                     world_size=pipe.data.world_size))
        return step.evaluate(state, shard.split_batch(batch, rank=pipe.data.rank,
                                                      world_size=pipe.data.world_size))

    got = ops.spawn(run, 6)
    h = None
    for f, p in zip(PM.LAYERED.layers, want, strict=True):
        h = f(p, h, batch)
    assert max(abs(g - float(h)) for g in got) < 1e-5


def test_bf16_pipeline_casts_the_batch_as_the_unpipelined_step_does():
    precision = shard.Precision(param_dtype="bfloat16")

    def run(comm, stages):
        loss = PM.LAYERED
        params = PM.init_params()
        if stages:
            loss = shard.pipeline(loss, comm=comm, stages=stages, microbatches=1)
            params = loss.params(params)
        step = shard.zero2(loss, optimizer=ops.adamw(PM.LR), precision=precision,
                           comm=loss.data if stages else comm)
        state = step.init(params)
        for b in PM.batches(2):
            state, _ = step(state, b)
        return shard.gather(state, loss.data if stages else comm)

    plain = ops.spawn(lambda c: run(c, None), 1)[0]
    for layers in ops.spawn(lambda c: run(c, 2), 2):
        for i, got in layers.items():
            for k in got:
                assert (got[k] == plain[i][k]).all(), (i, k)


def test_tied_weights_on_the_device_stand_in(device):
    """Tied gradients of device state are summed through explicit host copies."""
    from ops.testing import to_device

    def run(comm):
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=2, microbatches=2, tied=PM.TIED)
        step = shard.zero3(pipe, optimizer=ops.adamw(PM.LR, weight_decay=PM.WD), comm=pipe.data)
        state = step.init(to_device(pipe.params(PM.tied_params()), device))
        for b in PM.batches(4):
            state, m = step(state, b)
        whole = shard.gather(state, pipe.data)
        return {i: {k: device.to_host(v) for k, v in layer.items()}
                for i, layer in whole.items()}, [m["loss"]]

    assert PM.worst_difference(ops.spawn(run, 2), PM.tied_reference()) < 1e-5


def test_the_world_communicator_where_pipe_data_belongs_is_named():
    def run(comm):
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=2, microbatches=2)
        with pytest.raises(ValueError, match=r"comm=pipe.data \(1 rank\(s\)\) or the pipeline's "
                                             r"mesh as mesh=; got a communicator of 2 ranks"):
            shard.zero2(pipe, optimizer=ops.adamw(1e-3), comm=comm)
        step = shard.zero2(pipe, optimizer=ops.adamw(1e-3), comm=pipe.data)
        state = step.init(pipe.params(PM.init_params()))
        with pytest.raises(ValueError, match=r"gather: this state is rank 0's of 1 but comm is "
                                             r"rank \d of 2.*pipe.data"):
            shard.gather(state, comm)
        return sorted(shard.gather(state, pipe.data))

    assert all(ops.spawn(run, 2))


def test_stages_given_different_rows_are_refused():
    """Every stage of a data rank must see the same batch: the last stage's loss
    would otherwise broadcast labels of other rows against the activations."""
    def run(comm):
        pipe = shard.pipeline(PM.LAYERED, comm=comm, stages=2, microbatches=2)
        step = shard.zero2(pipe, optimizer=ops.adamw(1e-3), comm=pipe.data)
        state = step.init(pipe.params(PM.init_params()))
        step(state, PM.batches(1, rows=8 if pipe.stage == 0 else 4)[0])

    with pytest.raises(ValueError, match=r"stage 1's micro-batches have 2 rows but stage 0's "
                                         r"have 4: every stage of a data rank must be given"):
        ops.spawn(run, 2, timeout=60)
