"""DeepSpeed's learning-rate schedules as ``count -> lr`` callables: ``WarmupLR``,
``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest`` (see
:func:`shard.from_deepspeed_config`; :func:`shard.lr_range_test` runs the
last as a test)."""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["schedule"]


def schedule(sched: dict, lr: float, bad: list[str]) -> Callable[[int], float]:
    """DeepSpeed's schedule as ``count -> lr``. DeepSpeed sets the rate for the
    first update at construction (iteration -1) and steps the scheduler after
    each update, so update ``count`` uses iteration ``count - 1``."""
    kind = sched.pop("type", None)
    p = dict(sched.pop("params", {}) or {})
    bad += [f"scheduler.{k}" for k in sched]
    if kind == "OneCycle":
        return _one_cycle(p, bad)
    if kind == "LRRangeTest":
        return _range_test(p, bad)
    lo = p.pop("warmup_min_lr", 0.0)
    hi = p.pop("warmup_max_lr", lr if kind == "WarmupLR" else 0.001)
    warmup = max(2, int(p.pop("warmup_num_steps", 1000)))
    linear = p.pop("warmup_type", "log") == "linear"
    total = p.pop("total_num_steps", None)
    min_ratio, cos_min = p.pop("warmup_min_ratio", 0.0), p.pop("cos_min_ratio", 1e-4)
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        bad.append(f"scheduler.type={kind!r} (WarmupLR, WarmupDecayLR, WarmupCosineLR, "
                   "OneCycle and LRRangeTest are supported)")
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


def _range_test(p: dict, bad: list[str]) -> Callable[[int], float]:
    """DeepSpeed's ``LRRangeTest``: ``lr_range_test_min_lr * (1 +
    lr_range_test_step_rate * interval)``, ``interval`` the iterations over
    ``lr_range_test_step_size`` (floored with ``lr_range_test_staircase``),
    DeepSpeed's defaults 1e-3, 1.0, 2000 and false. It sets ``min_lr`` at
    construction (iteration -1) and steps after each update, so update
    ``count`` has interval ``count / step_size``."""
    lo = float(p.pop("lr_range_test_min_lr", 1e-3))
    size = float(p.pop("lr_range_test_step_size", 2000))
    rate = float(p.pop("lr_range_test_step_rate", 1.0))
    stairs = bool(p.pop("lr_range_test_staircase", False))
    if not (lo > 0 and size > 0 and rate >= 0):
        bad.append("scheduler.params.lr_range_test_min_lr > 0, lr_range_test_step_size > 0 "
                   "and lr_range_test_step_rate >= 0 (LRRangeTest)")
    bad += [f"scheduler.params.{k}" for k in p]

    def lr_at(count: int) -> float:
        interval = count / size
        return lo * (1 + rate * (math.floor(interval) if stairs else interval))

    return lr_at


def _one_cycle(p: dict, bad: list[str]) -> Callable[[int], float]:
    """DeepSpeed's ``OneCycle`` learning rate: up from ``cycle_min_lr`` to
    ``cycle_max_lr`` over ``cycle_first_step_size`` iterations, down over the
    second half cycle (optionally in stairs), then ``cycle_min_lr / (1 +
    decay_lr_rate * n / decay_step_size)``. Update ``count`` uses iteration
    ``count - 1``, as in :func:`schedule`."""
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
