"""DeepSpeed's own unit-test configs, as DeepSpeed's tests write them
(tests/data/deepspeed_unit_configs.json names each one's source), and the
rules of DeepSpeed's loss scaler."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import optax
import pytest

import ops
import shard

CONFIGS = json.loads((Path(__file__).parent / "data" / "deepspeed_unit_configs.json").read_text())
REFUSED = {"zero3_mics_shard_size_refused": "zero_optimization.mics_shard_size"}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_deepspeed_unit_test_configs_import_as_they_are(name, caplog):
    config = CONFIGS[name]["config"]
    if name in REFUSED:  # MiCS is not built here
        with pytest.raises(ValueError, match=REFUSED[name]):
            shard.from_deepspeed_config(config)
        return
    with caplog.at_level(logging.INFO, logger="shard._deepspeed"):
        c = shard.from_deepspeed_config(config)
    zero = config.get("zero_optimization", {})
    onebit = config.get("optimizer", {}).get("type") in ("OneBitAdam", "ZeroOneAdam")
    assert c.stage == zero.get("stage", 0) or (onebit and c.stage == 1)  # ZeRO-1, not none
    if zero.get("cpu_offload") or "offload_optimizer" in zero:
        assert c.offload is not None and c.offload.optimizer == "host"
    fp16 = config.get("fp16", {})
    if fp16.get("enabled"):
        assert str(c.precision.param_dtype) == "float16"
        assert c.loss_scale.dynamic == (not fp16.get("loss_scale"))
    for key in ("overlap_comm", "contiguous_gradients", "reduce_scatter"):
        if zero.get(key) is False:
            assert f"zero_optimization.{key}=false" in caplog.text
    if config.get("gradient_allreduce_op") == "sum":
        assert c.gradient_divide_factor == 1.0
    if "optimizer" not in config:
        assert c.optimizer is None
        with pytest.raises(ValueError, match='no "optimizer" block'):
            c.transform(lambda p, b: 0.0, comm=ops.spawn(lambda x: x, 1)[0])


@pytest.mark.parametrize("op, expected_scale", [("mean", 1.0), ("sum", 2.0)])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradient_allreduce_op_as_deepspeeds_own_test(stage, op, expected_scale):
    """DeepSpeed's TestGradientAllreduceOp: w = 0, loss (w * x).sum() on both of 2
    ranks, SGD with lr 1: one step gives -x for a mean and -2x for a sum."""
    c = shard.from_deepspeed_config({
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True, "gradient_allreduce_op": op,
        "prescale_gradients": False, "gradient_predivide_factor": 1.0,
        "zero_optimization": {"stage": stage, "reduce_scatter": True}})
    x = np.array([1.0, 2.0], np.float32)

    def run(comm):
        step = c.transform(lambda p, b: (p["w"] * b).sum(), comm=comm, optimizer=optax.sgd(1.0))
        state, _ = step(step.init({"w": np.zeros(2, np.float32)}), x)
        return shard.gather(state, comm)["w"]

    np.testing.assert_array_equal(ops.spawn(run, 2)[0], -x * expected_scale)


def test_gradient_allreduce_op_sum_is_refused_at_stage_3_as_deepspeed_does():
    with pytest.raises(ValueError, match="gradient_allreduce_op='sum' at stage 3"):
        shard.from_deepspeed_config({"gradient_allreduce_op": "sum",
                                     "zero_optimization": {"stage": 3}})


class DeepSpeedScaler:
    """DeepSpeed 0.19's DynamicLossScaler.update_scale, transcribed (its iteration
    counters), as the reference for LossScale(rule="deepspeed")."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_window, self.min_scale = scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("window", [1, 3, 7])
def test_loss_scale_follows_deepspeeds_dynamic_loss_scaler(hysteresis, consecutive, window):
    c = shard.from_deepspeed_config({
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True, "initial_scale_power": 10, "loss_scale_window": window,
                 "hysteresis": hysteresis, "consecutive_hysteresis": consecutive,
                 "min_loss_scale": 4}})
    ref = DeepSpeedScaler(2.0**10, window, 4, hysteresis, consecutive)
    rng = np.random.default_rng(hysteresis * 10 + window + consecutive)
    scale, good, left = c.loss_scale.initial, 0, None
    for i, overflow in enumerate(rng.random(300) < 0.25):
        ref.update_scale(bool(overflow))
        scale, good, left = c.loss_scale.update(scale, good, not overflow, left)
        assert scale == ref.cur_scale, i


def test_hysteresis_and_a_static_scale_in_a_float16_step():
    """fp16 with DeepSpeed's default hysteresis 2: overflows at steps 1 and 2 keep
    the scale, then halve it; a static scale never moves but skips overflows."""
    def losses(config, overflows):
        c = shard.from_deepspeed_config(config)

        def loss(p, b):
            return (p["w"] * b).sum()

        def run(comm):
            step = c.transform(loss, comm=comm)
            state = step.init({"w": np.ones(3, np.float16)})
            seen = []
            for i in range(4):
                b = np.full(3, np.inf if i in overflows else 1.0, np.float16)
                state, m = step(state, b)
                seen.append((m["loss_scale"], m["skipped"]))
            return seen

        return ops.spawn(run, 2)[0]

    fp16 = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "fp16": {"enabled": True, "initial_scale_power": 10}}
    assert losses(fp16, {1, 2}) == [(1024, False), (1024, True), (1024, True), (512, False)]
    static = {**fp16, "fp16": {"enabled": True, "loss_scale": 1024}}
    assert losses(static, {1}) == [(1024, False), (1024, True), (1024, False), (1024, False)]
