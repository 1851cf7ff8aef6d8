"""Observability: metrics["time_ms"], tokens_per_s, and the CSV and TensorBoard loggers."""

from __future__ import annotations

import csv
import time

import jax.numpy as jnp
import numpy as np
import pytest

import ops
import shard


def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


PARAMS = {"w": np.full((5, 3), 0.1, np.float32)}
BATCH = {"x": np.ones((4, 5), np.float32), "y": np.zeros((4, 3), np.float32)}


def test_metrics_carry_the_step_time_split_and_tokens_per_second():
    comm = ops.spawn(lambda c: c, 1)[0]
    step = shard.zero2(loss, optimizer=ops.adamw(1e-2), comm=comm)
    state = step.init(PARAMS)
    t0 = time.perf_counter()
    state, m = step(state, BATCH, tokens=4096)
    wall_ms = 1e3 * (time.perf_counter() - t0)
    t = m["time_ms"]
    assert set(t) == {"step", *shard.monitor._profile.CATEGORIES}
    assert t["step"] == pytest.approx(sum(v for k, v in t.items() if k != "step"))
    assert 0 < t["step"] <= wall_ms and t["compute"] > 0 and t["optimizer"] > 0
    assert m["tokens_per_s"] == pytest.approx(4096 / (t["step"] / 1e3))
    state, m = step(state, BATCH)
    assert "tokens_per_s" not in m and "time_ms" in m
    with shard.profile() as prof:  # the enclosing profile gets the same times
        state, m = step(state, BATCH)
    assert prof.steps == 1 and prof.total_ms() == pytest.approx(m["time_ms"]["step"])
    for bad in (-1, 2.5, "8", True):
        with pytest.raises(ValueError, match="tokens"):
            step(state, BATCH, tokens=bad)


def run_logged(comm, loggers, steps):
    step = shard.zero3(loss, optimizer=ops.adamw(1e-2), comm=comm,
                       options=shard.ZeroOptions(loggers=loggers))
    state = step.init(PARAMS)
    losses = []
    for _ in range(steps):
        state, m = step(state, BATCH, tokens=4)
        losses.append(m["loss"])
    return losses


def test_csv_logger_writes_rank_0s_rows_and_appends_on_resume(tmp_path):
    path = tmp_path / "logs" / "run.csv"
    with shard.CSVLogger(path) as log:
        losses = ops.spawn(lambda c: run_logged(c, [log], 3), 2)[0]
    rows = list(csv.DictReader(path.open()))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]  # rank 0 only, once per step
    np.testing.assert_allclose([float(r["loss"]) for r in rows], losses, rtol=1e-6)
    assert {"grad_norm", "lr", "skipped", "tokens_per_s", "time_ms/step",
            "time_ms/all_gather_wait", "time_ms/optimizer"} <= set(rows[0])
    assert float(rows[0]["time_ms/step"]) > 0
    with shard.CSVLogger(path, every=2) as log:  # a resumed run: appended, every 2nd step
        ops.spawn(lambda c: run_logged(c, log, 4), 1)
    assert [int(r["step"]) for r in csv.DictReader(path.open())] == [1, 2, 3, 2, 4]
    with shard.CSVLogger(path) as log, pytest.raises(ValueError, match="columns"):
        log(5, {"loss": 1.0})  # other metrics than the file's columns
    assert len(path.read_text().splitlines()) == 6  # nothing half-written


def test_tensorboard_logger_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = shard.TensorBoardLogger(tmp_path)
    losses = ops.spawn(lambda c: run_logged(c, [log], 2), 1)[0]
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"loss", "grad_norm", "time_ms/step", "tokens_per_s"} <= set(events.Tags()["scalars"])
    got = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in got] == [1, 2]
    np.testing.assert_allclose([v for _, v in got], losses, rtol=1e-6)


def test_loggers_and_every_are_checked():
    comm = ops.spawn(lambda c: c, 1)[0]
    with pytest.raises(TypeError, match="loggers"):
        shard.zero1(loss, optimizer=ops.adamw(1e-2), comm=comm,
                    options=shard.ZeroOptions(loggers=["run.csv"]))
    with pytest.raises(ValueError, match="every"):
        shard.CSVLogger("run.csv", every=0)
