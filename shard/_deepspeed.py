"""DeepSpeed JSON configs as the ZeRO transforms' options: :func:`from_deepspeed_config`.

The keys below map onto ``shard.zero0``-``zero3``'s arguments. Every other key,
and every value this library cannot honour, is reported by name (an error, or
with ``unsupported="warn"`` a warning), never silently ignored.

- ``zero_optimization.stage``: ``zero0``-``zero3``;
  ``overlap_comm``, ``contiguous_gradients``, ``reduce_scatter`` (true): what
  every stage does; ``offload_optimizer``: ``device`` ``cpu`` (``pin_memory``
  accepted) is ``shard.Offload("host")``, ``nvme`` with ``nvme_path`` is
  ``shard.Offload("disk", path=nvme_path)``;
- ``fp16``: ``enabled``, ``initial_scale_power``, ``loss_scale_window``,
  ``hysteresis`` (1 only): ``Precision(float16)`` and a ``LossScale``;
- ``bf16.enabled``: ``Precision(bfloat16)``;
- ``gradient_clipping``: ``clip_norm``;
- ``gradient_accumulation_steps``, ``train_micro_batch_size_per_gpu``,
  ``train_batch_size``: checked against each other and the world size (a step
  with accumulation takes ``shard.MicroBatches``);
- ``optimizer``: ``Adam`` (``adam_w_mode``, default true, as DeepSpeed's) and
  ``AdamW``: ``ops.adamw`` or ``ops.adam``;
- ``scheduler``: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` and
  ``OneCycle`` (with ``cycle_momentum: false``: Adam's ``b1`` is fixed here):
  the same schedule, as the optimizer's ``count -> lr``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops import FusedAdam, adam, adamw
from shard.core._policy import LossScale, Precision
from shard.offload._offload import Offload

__all__ = ["DeepSpeedConfig", "from_deepspeed_config"]

log = logging.getLogger(__name__)
_ALWAYS = ("overlap_comm", "contiguous_gradients", "reduce_scatter")


@dataclass(frozen=True)
class DeepSpeedConfig:
    """A DeepSpeed config's meaning here; ``transform`` builds the ZeRO step."""

    stage: int
    optimizer: FusedAdam
    precision: Precision | None
    loss_scale: LossScale | None
    clip_norm: float | None
    gradient_accumulation_steps: int
    micro_batch_size: int | None
    train_batch_size: int | None
    offload: Offload | None = None

    def transform(self, loss_fn: Any, *, comm: Any, **kwargs: Any) -> Any:
        """``shard.zero{stage}(loss_fn, ...)`` with this config's options. A step
        with ``gradient_accumulation_steps > 1`` takes ``shard.MicroBatches``."""
        from shard._stages import zero0, zero1, zero2, zero3

        if self.train_batch_size is not None and self.micro_batch_size is not None:
            want = self.micro_batch_size * self.gradient_accumulation_steps * comm.world_size
            if want != self.train_batch_size:
                raise ValueError(f"from_deepspeed_config: train_batch_size {self.train_batch_size}"
                                 f" != train_micro_batch_size_per_gpu {self.micro_batch_size} x "
                                 f"gradient_accumulation_steps {self.gradient_accumulation_steps}"
                                 f" x world size {comm.world_size}")
        zero = (zero0, zero1, zero2, zero3)[self.stage]
        return zero(loss_fn, optimizer=self.optimizer, comm=comm, precision=self.precision,
                    clip_norm=self.clip_norm, loss_scale=self.loss_scale,
                    **({"offload": self.offload} if self.offload else {}), **kwargs)


def from_deepspeed_config(config: dict | str | os.PathLike, *,
                          unsupported: str = "error") -> DeepSpeedConfig:
    """Read a DeepSpeed config (a dict, or a JSON file's path).

    Args:
      config: the config.
      unsupported: "error" (default): a ValueError naming every key or value
        that has no meaning here; "warn": log them and go on.

    Example:
      >>> import shard
      >>> cfg = shard.from_deepspeed_config({
      ...     "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
      ...     "gradient_clipping": 1.0,
      ...     "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
      ...     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
      ...                                                  "warmup_max_lr": 3e-4}}})
      >>> cfg.stage, str(cfg.precision.param_dtype), cfg.clip_norm
      (3, 'bfloat16', 1.0)
    """
    if unsupported not in ("error", "warn"):
        raise ValueError(f"from_deepspeed_config: unsupported must be 'error' or 'warn'; got "
                         f"{unsupported!r}")
    if not isinstance(config, dict):
        config = json.loads(Path(config).read_text())
    cfg, bad = dict(config), []

    zero = dict(cfg.pop("zero_optimization", {}) or {})
    stage = zero.pop("stage", 0)
    if stage not in (0, 1, 2, 3):
        bad.append(f"zero_optimization.stage={stage!r}")
        stage = 0
    for key in _ALWAYS:
        if zero.pop(key, True) is not True:
            bad.append(f"zero_optimization.{key}=false (always on here)")
    offload = _offload(dict(zero.pop("offload_optimizer", {}) or {}), stage, bad)
    bad += [f"zero_optimization.{k}" for k in zero]

    precision, loss_scale = None, None
    fp16 = dict(cfg.pop("fp16", {}) or {})
    bf16 = dict(cfg.pop("bf16", {}) or {})
    if fp16.pop("enabled", False):
        precision = Precision(param_dtype="float16", reduce_dtype="float32")
        if fp16.pop("loss_scale", 0):
            bad.append("fp16.loss_scale (a static scale; 0, dynamic, is supported)")
        power = fp16.pop("initial_scale_power", 16)
        window = fp16.pop("loss_scale_window", 1000)
        if fp16.pop("hysteresis", 1) != 1:
            bad.append("fp16.hysteresis (the scale backs off at the first overflow here: 1)")
        loss_scale = LossScale(initial=2.0**power, growth_interval=int(window))
    bad += [f"fp16.{k}" for k in fp16]
    if bf16.pop("enabled", False):
        if precision is not None:
            bad.append("bf16.enabled with fp16.enabled")
        precision = Precision(param_dtype="bfloat16")
    bad += [f"bf16.{k}" for k in bf16]

    clip = cfg.pop("gradient_clipping", 0.0)
    accumulation = int(cfg.pop("gradient_accumulation_steps", 1))
    micro = cfg.pop("train_micro_batch_size_per_gpu", None)
    total = cfg.pop("train_batch_size", None)

    opt_cfg = dict(cfg.pop("optimizer", {}) or {})
    kind = opt_cfg.pop("type", "AdamW")
    params = dict(opt_cfg.pop("params", {}) or {})
    bad += [f"optimizer.{k}" for k in opt_cfg]
    lr = params.pop("lr", 1e-3)
    b1, b2 = params.pop("betas", (0.9, 0.999))
    eps = params.pop("eps", 1e-8)
    wd = params.pop("weight_decay", 0.0)
    decoupled = params.pop("adam_w_mode", True)
    params.pop("torch_adam", None)  # which implementation: the fused kernel either way
    bad += [f"optimizer.params.{k}" for k in params]
    if str(kind).lower() not in ("adam", "adamw"):
        bad.append(f"optimizer.type={kind!r} (Adam and AdamW are supported)")

    sched = dict(cfg.pop("scheduler", {}) or {})
    schedule: Callable[[int], float] | float = lr
    if sched:
        schedule = _schedule(sched, lr, bad)
    bad += list(cfg)
    if bad:
        text = (f"from_deepspeed_config: not supported here: {', '.join(bad)}; remove them "
                "(or pass unsupported='warn' to go on without them)")
        if unsupported == "error":
            raise ValueError(text)
        log.warning(text)
    make = adamw if (str(kind).lower() == "adamw" or decoupled) else adam
    return DeepSpeedConfig(stage=stage, optimizer=make(schedule, b1, b2, eps, wd),
                           precision=precision, loss_scale=loss_scale,
                           clip_norm=float(clip) if clip else None,
                           gradient_accumulation_steps=accumulation, micro_batch_size=micro,
                           train_batch_size=total, offload=offload)


def _offload(cfg: dict, stage: int, bad: list[str]) -> Offload | None:
    """``zero_optimization.offload_optimizer`` as a :class:`shard.Offload`."""
    device = cfg.pop("device", "none")
    cfg.pop("pin_memory", None)  # host buffers are what they are here
    path = cfg.pop("nvme_path", None)
    bad += [f"zero_optimization.offload_optimizer.{k}" for k in cfg]
    if device in ("none", None):
        return None
    if stage == 0:
        bad.append("zero_optimization.offload_optimizer at stage 0 (stages 1-3 offload)")
        return None
    if device == "cpu":
        return Offload("host")
    if device == "nvme" and path:
        return Offload("disk", path=path)
    bad.append(f"zero_optimization.offload_optimizer.device={device!r} (cpu, or nvme with "
               "nvme_path)")
    return None


def _schedule(sched: dict, lr: float, bad: list[str]) -> Callable[[int], float]:
    """DeepSpeed's schedule as ``count -> lr``. DeepSpeed sets the rate for the
    first update at construction (iteration -1) and steps the scheduler after
    each update, so update ``count`` uses iteration ``count - 1``."""
    kind = sched.pop("type", None)
    p = dict(sched.pop("params", {}) or {})
    bad += [f"scheduler.{k}" for k in sched]
    if kind == "OneCycle":
        return _one_cycle(p, bad)
    lo = p.pop("warmup_min_lr", 0.0)
    hi = p.pop("warmup_max_lr", lr if kind == "WarmupLR" else 0.001)
    warmup = max(2, int(p.pop("warmup_num_steps", 1000)))
    linear = p.pop("warmup_type", "log") == "linear"
    total = p.pop("total_num_steps", None)
    min_ratio, cos_min = p.pop("warmup_min_ratio", 0.0), p.pop("cos_min_ratio", 1e-4)
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        bad.append(f"scheduler.type={kind!r} (WarmupLR, WarmupDecayLR, WarmupCosineLR and "
                   "OneCycle are supported)")
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and total is None:
        bad.append(f"scheduler.params.total_num_steps (required by {kind})")
        total = warmup
    bad += [f"scheduler.params.{k}" for k in p]

    def warm(it: int) -> float:
        return it / warmup if linear else math.log(it + 1) / math.log(warmup)

    def lr_at(count: int) -> float:
        it = count - 1
        if kind == "WarmupCosineLR":
            if it < 0:
                return 0.0
            if it < warmup:
                return lr * (min_ratio + warm(it) * (1.0 - min_ratio))
            progress = min(1.0, (it - warmup + 1) / max(1, total - warmup))
            ratio = (1 + math.cos(math.pi * progress)) / 2
            return lr * max(0.0, cos_min + (1.0 - cos_min) * ratio)
        if it < 0:
            return lo
        if it < warmup:
            gamma = warm(it)
        elif kind == "WarmupDecayLR":
            gamma = max(0.0, (total - it) / max(1.0, total - warmup))
        else:
            gamma = 1.0
        return lo + (hi - lo) * gamma

    return lr_at


def _one_cycle(p: dict, bad: list[str]) -> Callable[[int], float]:
    """DeepSpeed's ``OneCycle`` learning rate: up from ``cycle_min_lr`` to
    ``cycle_max_lr`` over ``cycle_first_step_size`` iterations, down over the
    second half cycle (optionally in stairs), then ``cycle_min_lr / (1 +
    decay_lr_rate * n / decay_step_size)``. Update ``count`` uses iteration
    ``count - 1``, as in :func:`_schedule`."""
    if p.pop("cycle_momentum", True):
        bad.append("scheduler.params.cycle_momentum (OneCycle momentum cycling; Adam's b1 is "
                   "fixed here: set it false)")
    for key in ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate"):
        p.pop(key, None)
    if "cycle_min_lr" not in p or "cycle_max_lr" not in p:
        bad.append("scheduler.params.cycle_min_lr and cycle_max_lr (required by OneCycle)")
    lo, hi = float(p.pop("cycle_min_lr", 0.0)), float(p.pop("cycle_max_lr", 0.0))
    decay_rate = float(p.pop("decay_lr_rate", 0.0))
    first = float(p.pop("cycle_first_step_size", 2000))
    second = p.pop("cycle_second_step_size", None)
    second = first if second is None else float(second)
    first_stairs = int(p.pop("cycle_first_stair_count", 0))
    second_stairs = p.pop("cycle_second_stair_count", None)
    second_stairs = first_stairs if second_stairs is None else int(second_stairs)
    decay_size = float(p.pop("decay_step_size", 0))
    if first <= 0 or second < 0:
        bad.append("scheduler.params.cycle_first_step_size > 0 and cycle_second_step_size >= 0"
                   " (OneCycle)")
        first, second = 1.0, 0.0
    bad += [f"scheduler.params.{k}" for k in p]
    total = first + second
    ratio = first / total

    def scale(batch: int) -> float:
        x = 1.0 + batch / total - math.floor(1 + batch / total)
        if x <= ratio:
            factor, stairs = x / ratio, first_stairs
        else:
            factor, stairs = (x - 1) / (ratio - 1), second_stairs
        if stairs > 0:
            pos = batch % total
            pos = pos * stairs / first if pos <= first else (total - pos) * stairs / second
            factor = math.floor(pos) / stairs
        return factor

    def lr_at(count: int) -> float:
        it = count - 1
        if it < 0:
            return lo
        if it < total:
            return lo + (hi - lo) * scale(it + 1)
        if math.isclose(decay_size, 0) or math.isclose(decay_rate, 0):
            return lo
        return lo / (1 + decay_rate * (it - total + 1) / decay_size)

    return lr_at
