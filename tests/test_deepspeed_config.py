"""shard.from_deepspeed_config: each supported key, and unsupported ones named."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import ops
import shard
from ops import BF16


def cfg(**kw):
    """A config with an AdamW(1e-3) optimizer block unless it gives its own."""
    kw.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
    return shard.from_deepspeed_config(kw)


def one_step(opt):
    params = {"w": np.full(4, 2.0, np.float32)}
    state = opt.init(params)
    new, _ = opt.update({"w": np.full(4, 0.5, np.float32)}, state, params)
    return new["w"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_picks_the_transform(stage):
    c = cfg(zero_optimization={"stage": stage, "overlap_comm": True})
    step = c.transform(lambda p, b: 0.0, comm=ops.spawn(lambda x: x, 1)[0])
    assert c.stage == stage and step.stage == stage and step.name == f"zero{stage}"


def test_fp16_maps_to_float16_and_a_loss_scale():
    c = cfg(fp16={"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500,
                  "hysteresis": 1})
    assert c.precision.param_dtype == np.float16 and c.precision.reduce_dtype == np.float32
    assert c.loss_scale == shard.LossScale(initial=2.0**12, growth_interval=500, minimum=1.0,
                                           rule="deepspeed")


def test_bf16_and_clipping():
    c = cfg(bf16={"enabled": True}, gradient_clipping=0.5)
    assert c.precision.param_dtype == BF16 and c.loss_scale is None and c.clip_norm == 0.5
    assert cfg(gradient_clipping=0.0).clip_norm is None


def test_batch_sizes_are_checked_against_the_world_size():
    c = cfg(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4)
    assert c.gradient_accumulation_steps == 4
    c.transform(lambda p, b: 0.0, comm=ops.spawn(lambda x: x, 2)[0])  # 4 x 4 x 2 = 32
    with pytest.raises(ValueError, match=r"train_batch_size 32 != .* x data ranks 1"):
        c.transform(lambda p, b: 0.0, comm=ops.spawn(lambda x: x, 1)[0])


@pytest.mark.parametrize("kind, mode, want", [
    ("AdamW", None, ops.adamw), ("Adam", None, ops.adamw), ("Adam", False, ops.adam)])
def test_optimizer_types_and_params(kind, mode, want):
    params = {"lr": 0.1, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.2}
    if mode is not None:
        params["adam_w_mode"] = mode
    c = cfg(optimizer={"type": kind, "params": params})
    np.testing.assert_array_equal(one_step(c.optimizer),
                                  one_step(want(0.1, 0.8, 0.99, 1e-6, 0.2)))


def test_lion_type_maps_to_ops_lion():
    c = cfg(optimizer={"type": "Lion", "params": {"lr": 0.1, "betas": [0.8, 0.9],
                                                  "weight_decay": 0.2}})
    assert c.optimizer.moments == ("exp_avg",)
    np.testing.assert_array_equal(one_step(c.optimizer), one_step(ops.lion(0.1, 0.8, 0.9, 0.2)))
    with pytest.raises(ValueError, match=r"optimizer\.params\.eps"):
        cfg(optimizer={"type": "Lion", "params": {"lr": 0.1, "eps": 1e-8}})


def test_lamb_type_maps_to_ops_lamb_with_deepspeeds_trust_bounds():
    c = cfg(optimizer={"type": "Lamb", "params": {"lr": 0.1, "betas": [0.8, 0.9], "eps": 1e-6,
                                                  "weight_decay": 0.2, "max_coeff": 0.5}})
    assert c.optimizer.per_tensor and c.optimizer.moments == ("exp_avg", "exp_avg_sq")
    want = ops.lamb(0.1, 0.8, 0.9, 1e-6, weight_decay=0.2, trust_clip=(0.01, 0.5))
    np.testing.assert_array_equal(one_step(c.optimizer), one_step(want))
    assert not np.array_equal(one_step(want), one_step(ops.lamb(0.1, 0.8, 0.9, 1e-6,
                                                                weight_decay=0.2)))
    with pytest.raises(ValueError, match=r"optimizer\.params\.max_grad_norm \(use gradient_"):
        cfg(optimizer={"type": "Lamb", "params": {"max_grad_norm": 1.0}})


def ds_warmup(it, lo, hi, warmup, linear):
    if it < 0:
        return lo
    warmup = max(2, warmup)
    if it < warmup:
        return lo + (hi - lo) * (it / warmup if linear else math.log(it + 1) / math.log(warmup))
    return hi


@pytest.mark.parametrize("linear", [False, True])
def test_warmup_lr_follows_deepspeeds_iterations(linear):
    c = cfg(optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
            scheduler={"type": "WarmupLR", "params": {
                "warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                "warmup_type": "linear" if linear else "log"}})
    got = [c.optimizer.learning_rate(n) for n in range(15)]
    want = [ds_warmup(n - 1, 1e-5, 1e-3, 10, linear) for n in range(15)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[0] == 1e-5 and got[-1] == 1e-3


def test_warmup_decay_and_cosine_schedules():
    decay = cfg(scheduler={"type": "WarmupDecayLR", "params": {
        "total_num_steps": 20, "warmup_max_lr": 0.1, "warmup_num_steps": 5,
        "warmup_type": "linear"}})
    lr = decay.optimizer.learning_rate
    assert lr(0) == 0.0 and lr(3) == pytest.approx(0.1 * 2 / 5)
    assert lr(6) == pytest.approx(0.1 * (20 - 5) / 15) and lr(21) == 0.0
    cosine = cfg(optimizer={"type": "AdamW", "params": {"lr": 0.2}},
                 scheduler={"type": "WarmupCosineLR", "params": {
                     "total_num_steps": 12, "warmup_num_steps": 2, "cos_min_ratio": 0.1}})
    lr = cosine.optimizer.learning_rate
    assert lr(0) == 0.0 and lr(1) == 0.0  # log warm-up: log(1) = 0
    assert lr(3) == pytest.approx(0.2 * (0.1 + 0.9 * (1 + math.cos(math.pi * 0.1)) / 2))
    assert lr(100) == pytest.approx(0.2 * 0.1)


def test_schedules_match_deepspeed_itself():
    deepspeed = pytest.importorskip("deepspeed.runtime.lr_schedules")
    torch = pytest.importorskip("torch")
    for sched in ({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2,
                                                  "warmup_num_steps": 7}},
                  {"type": "WarmupDecayLR", "params": {"total_num_steps": 30,
                                                       "warmup_num_steps": 7,
                                                       "warmup_type": "linear"}},
                  {"type": "WarmupCosineLR", "params": {"total_num_steps": 30,
                                                        "warmup_num_steps": 7}},
                  {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2,
                                                  "cycle_first_step_size": 6,
                                                  "cycle_second_step_size": 9,
                                                  "decay_lr_rate": 0.5, "decay_step_size": 4,
                                                  "cycle_momentum": False}},
                  {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2,
                                                  "cycle_first_step_size": 8,
                                                  "cycle_first_stair_count": 4,
                                                  "cycle_second_stair_count": 2,
                                                  "cycle_momentum": False}}):
        c = cfg(optimizer={"type": "AdamW", "params": {"lr": 3e-3}}, scheduler=json.loads(
            json.dumps(sched)))
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
        ds = getattr(deepspeed, sched["type"])(opt, **sched["params"])
        want = []
        for _ in range(35):
            want.append(opt.param_groups[0]["lr"])
            ds.step()
        got = [c.optimizer.learning_rate(n) for n in range(35)]
        np.testing.assert_allclose(got, want, rtol=1e-9, err_msg=sched["type"])


def test_one_cycle_lr_and_its_momentum_cycling():
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
              "decay_lr_rate": 1.0, "decay_step_size": 2, "cycle_momentum": False}
    lr = cfg(scheduler={"type": "OneCycle", "params": params}).optimizer.learning_rate
    assert lr(0) == 0.01 and lr(1) == pytest.approx(0.01 + 0.09 / 4)
    assert lr(4) == pytest.approx(0.1) and lr(8) == pytest.approx(0.01)
    assert lr(9) == pytest.approx(0.01 / 1.5) and lr(11) == pytest.approx(0.01 / 2.5)
    with pytest.raises(ValueError, match="cycle_momentum"):  # DeepSpeed's default: true
        cfg(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.01,
                                                      "cycle_max_lr": 0.1}})
    with pytest.raises(ValueError, match="cycle_min_lr and cycle_max_lr"):
        cfg(scheduler={"type": "OneCycle", "params": {"cycle_momentum": False}})


def test_offload_optimizer_maps_to_shard_offload(tmp_path):
    host = cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                  "pin_memory": True}})
    assert host.offload == shard.Offload("host")
    disk = cfg(zero_optimization={"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path)}})
    assert disk.offload == shard.Offload("disk", path=str(tmp_path))
    step = disk.transform(lambda p, b: 0.0, comm=ops.spawn(lambda x: x, 1)[0])
    assert step.offload.optimizer == "disk"
    with pytest.raises(ValueError, match=r"offload_optimizer\.device='nvme'"):
        cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme"}})
    with pytest.raises(ValueError, match=r"offload_optimizer\.ratio"):
        cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                 "ratio": 0.3}})


def test_hpz_partition_size_maps_to_reshard_after_forward():
    """ZeRO++'s hpZ: the ranks per node that keep each unit's secondary shard."""
    assert cfg(zero_optimization={"stage": 3}).reshard_after_forward is True
    assert cfg(zero_optimization={"stage": 3,
                                  "zero_hpz_partition_size": 1}).reshard_after_forward is True
    c = cfg(zero_optimization={"stage": 3, "zero_hpz_partition_size": 2})
    assert c.reshard_after_forward == 2

    def run(comm):
        step = c.transform(lambda p, b: 0.0, comm=comm)
        return step.reshard_after_forward, step.config.topology.secondary[0].world_size

    assert ops.spawn(run, 4) == [(2, 2)] * 4
    with pytest.raises(ValueError, match="zero_hpz_partition_size=2 below stage 3"):
        cfg(zero_optimization={"stage": 2, "zero_hpz_partition_size": 2})
    with pytest.raises(ValueError, match=r"zero_hpz_partition_size=0 \(an int >= 1\)"):
        cfg(zero_optimization={"stage": 3, "zero_hpz_partition_size": 0})


def test_unsupported_keys_are_named_or_warned(tmp_path, caplog):
    bad = {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
           "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
           "amp": {"enabled": True},
           "optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3}},
           "scheduler": {"type": "CyclicLR", "params": {}}}
    with pytest.raises(ValueError) as e:
        shard.from_deepspeed_config(bad)
    for name in ("zero_optimization.offload_param below stage 3",
                 "fp16.fp16_master_weights_and_grads", "amp",
                 "optimizer.type='OneBitLamb'", "scheduler.type='CyclicLR'"):
        assert name in str(e.value), name
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(bad))
    c = shard.from_deepspeed_config(path, unsupported="warn")
    assert c.stage == 2 and "amp" in caplog.text


# Hugging Face's ZeRO-2 and ZeRO-3 templates (transformers' DeepSpeed guide), as written.
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "steps_per_print": 2000, "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    **{k: v for k, v in HF_ZERO2.items() if k != "zero_optimization"},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True},
}
TRAINER_ARGS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, warmup_steps=10,
                    micro_batch_size=4, gradient_accumulation_steps=2, clip_norm=1.0,
                    fp16=False, bf16=True)


def trajectory(opt, steps=4):
    params = {"w": np.full(4, 2.0, np.float32)}
    state = opt.init(params)
    for i in range(steps):
        params, state = opt.update({"w": np.full(4, 0.5 + i, np.float32)}, state, params)
    return params["w"]


@pytest.mark.parametrize("template", [HF_ZERO2, HF_ZERO3], ids=["zero2", "zero3"])
def test_hugging_face_templates_import_as_written(template, caplog):
    caplog.set_level("INFO", logger="shard._deepspeed")
    c = shard.from_deepspeed_config(template, **TRAINER_ARGS)
    stage = template["zero_optimization"]["stage"]
    assert c.stage == stage and c.precision.param_dtype == BF16 and c.loss_scale is None
    assert c.offload == shard.Offload("host", params="host" if stage == 3 else None)
    assert (c.clip_norm, c.gradient_accumulation_steps, c.micro_batch_size) == (1.0, 2, 4)
    assert c.train_batch_size is None  # "auto": micro x accumulation x world
    assert c.optimizer.learning_rate(0) == 0.0  # warmup_min_lr "auto" is 0, as the Trainer's
    assert c.optimizer.learning_rate(10) == pytest.approx(3e-4)
    want = ops.adamw(c.optimizer.learning_rate, 0.9, 0.95, 1e-8, 0.1)
    np.testing.assert_array_equal(trajectory(c.optimizer), trajectory(want))
    assert not np.array_equal(trajectory(c.optimizer), trajectory(ops.adamw(
        c.optimizer.learning_rate, 0.9, 0.999, 1e-8, 0.1)))
    assert "reduce_bucket_size" in caplog.text and "steps_per_print" in caplog.text
    assert caplog.text.count("accepted with no effect") == 1


def test_auto_values_without_arguments_are_named_together():
    with pytest.raises(ValueError) as e:
        shard.from_deepspeed_config(HF_ZERO3, lr=1e-3)
    text = str(e.value)
    for name in ("optimizer.params.betas (betas=...)", "gradient_clipping (clip_norm=...)",
                 "scheduler.params.warmup_num_steps (warmup_steps=...)", "fp16.enabled (fp16",
                 "bf16.enabled (bf16", "train_micro_batch_size_per_gpu (micro_batch_size"):
        assert name in text, name
    assert "optimizer.params.lr" not in text and "reduce_bucket_size" not in text
    with pytest.raises(ValueError, match=r"optimizer.params.foo \(no argument resolves it"):
        cfg(optimizer={"type": "AdamW", "params": {"foo": "auto"}})


def test_the_step_takes_the_configs_micro_batch_count():
    import jax.numpy as jnp

    c = cfg(gradient_accumulation_steps=2, optimizer={"params": {"lr": 1e-2}})
    comm = ops.spawn(lambda x: x, 1)[0]
    step = c.transform(lambda p, b: jnp.sum((p["w"] * b) ** 2), comm=comm)
    state = step.init({"w": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps is 2.*got 1"):
        step(state, np.ones(3, np.float32))
    state, _ = step(state, shard.MicroBatches([np.ones(3, np.float32)] * 2))
    assert int(state.step) == 1


def test_transform_overrides_and_monitors_and_communication_dtype(tmp_path):
    c = cfg(zero_optimization={"stage": 2}, gradient_clipping=1.0,
            tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
            csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
            communication_data_type="fp32", bf16={"enabled": True})
    assert [type(lg).__name__ for lg in c.loggers] == ["TensorBoardLogger", "CSVLogger"]
    assert c.precision == shard.Precision(param_dtype="bfloat16", reduce_dtype="float32")
    step = c.transform(lambda p, b: 0.0, comm=ops.spawn(lambda x: x, 1)[0], clip_norm=0.5)
    assert step.clip_norm == 0.5 and step.stage == 2


def test_the_loss_scale_backs_off_no_lower_than_min_loss_scale():
    c = cfg(fp16={"enabled": True, "initial_scale_power": 2, "min_loss_scale": 2})
    scale, good, left = 4.0, 0, None
    for _ in range(3):  # three overflows in a row (DeepSpeed's default hysteresis: 2)
        scale, good, left = c.loss_scale.update(scale, good, False, left)
    assert scale == 2.0
    with pytest.raises(ValueError, match="minimum <= initial"):
        shard.LossScale(initial=1.0, minimum=2.0)
