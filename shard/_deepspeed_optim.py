"""A DeepSpeed config's ``optimizer`` and ``scheduler`` blocks as a fused
optimizer, and its ``zero_optimization.offload_optimizer`` and ``offload_param``
as a :class:`~shard.Offload`, for :func:`shard.from_deepspeed_config`
(``_deepspeed.py`` lists what each key means here). A key or value this
library cannot honour is appended to ``bad`` by name."""

from __future__ import annotations

from dataclasses import replace

from ops import FusedOptimizer, adam, adamw, lamb, lion, onebit_adam, zero_one_adam
from shard._deepspeed_lr import schedule
from shard.offload._offload import Offload

__all__ = ["offload_of", "optimizer_of"]


def optimizer_of(cfg: dict, bad: list[str]) -> FusedOptimizer | None:
    """The ``optimizer`` block (with its ``scheduler``) as a fused optimizer, its
    keys popped from ``cfg``; None without one."""
    if not cfg.get("optimizer"):
        cfg.pop("optimizer", None)
        if cfg.get("scheduler"):
            bad.append("scheduler without an optimizer block (give the optimizer's lr here, "
                       "or schedule the optimizer you pass)")
            cfg.pop("scheduler")
        return None
    opt_cfg = dict(cfg.pop("optimizer", {}) or {})
    raw = opt_cfg.pop("type", "AdamW")
    kind = str(raw).lower()
    params = dict(opt_cfg.pop("params", {}) or {})
    bad += [f"optimizer.{k}" for k in opt_cfg]
    lr = params.pop("lr", 1e-4 if kind == "lion" else 1e-3)
    b1, b2 = params.pop("betas", (0.9, 0.99) if kind == "lion" else (0.9, 0.999))
    wd = params.pop("weight_decay", 0.0)
    if kind != "lion":
        eps = params.pop("eps", 1e-8)
    if kind == "onebitadam":  # DeepSpeed's OnebitAdam defaults; the transport is the comm's
        freeze = params.pop("freeze_step", 100000)
        for key in ("cuda_aware", "comm_backend_name", "bias_correction"):
            params.pop(key, None)  # (OnebitAdam reads no bias_correction either)
    elif kind == "zerooneadam":  # DeepSpeed's ZeroOneAdam defaults
        schedule01 = {key: params.pop(key, default) for key, default in (
            ("var_freeze_step", 100000), ("var_update_scaler", 16),
            ("local_step_scaler", 32678), ("local_step_clipper", 16))}
        for key in ("cuda_aware", "comm_backend_name", "bias_correction", "eps_inside_sqrt"):
            params.pop(key, None)  # (ZeroOneAdam reads neither of the last two)
        for key in ("amsgrad", "max_grad_norm"):  # refused or unread by ZeroOneAdam
            if not params.get(key):
                params.pop(key, None)
    elif kind == "lamb":  # DeepSpeed's FusedLamb defaults
        trust = (params.pop("min_coeff", 0.01), params.pop("max_coeff", 10.0))
        bias_correction = params.pop("bias_correction", True)
        if params.get("max_grad_norm", 0.0) in (0, 0.0):
            params.pop("max_grad_norm", None)
    elif kind != "lion":
        decoupled = params.pop("adam_w_mode", True)
        params.pop("torch_adam", None)  # which implementation: the fused kernel either way
    bad += [f"optimizer.params.{k}" + (" (use gradient_clipping)" if k == "max_grad_norm" else "")
            for k in params]
    if kind not in ("adam", "adamw", "lion", "lamb", "onebitadam", "zerooneadam"):
        bad.append(f"optimizer.type={raw!r} (Adam, AdamW, Lion, Lamb, OneBitAdam and "
                   "ZeroOneAdam are supported)")
    sched = dict(cfg.pop("scheduler", {}) or {})
    rate = schedule(sched, lr, bad) if sched else lr
    if kind == "lion":
        return lion(rate, b1, b2, wd)
    if kind == "onebitadam":
        return onebit_adam(rate, freeze, b1, b2, eps, wd)
    if kind == "zerooneadam":
        return zero_one_adam(rate, b1=b1, b2=b2, eps=eps, weight_decay=wd, **schedule01)
    if kind == "lamb":
        return lamb(rate, b1, b2, eps, weight_decay=wd, trust_clip=trust,
                    bias_correction=bool(bias_correction))
    make = adamw if (kind == "adamw" or decoupled) else adam
    return make(rate, b1, b2, eps, wd)


def offload_of(optimizer: dict, params: dict, stage: int, bad: list[str]) -> Offload | None:
    """``zero_optimization.offload_optimizer`` and ``offload_param`` as a
    :class:`shard.Offload`."""
    device = optimizer.pop("device", "none")
    path = optimizer.pop("nvme_path", None)
    bad += [f"zero_optimization.offload_optimizer.{k}" for k in optimizer]
    on_host = params.pop("device", "none") not in ("none", None)
    bad += [f"zero_optimization.offload_param.{k}" for k in params]
    if on_host and stage != 3:
        bad.append("zero_optimization.offload_param below stage 3 (stages 1-2 keep whole "
                   "params on the device)")
        on_host = False
    if device in ("none", None):
        if on_host:
            bad.append("zero_optimization.offload_param without offload_optimizer (offload "
                       "the optimizer too)")
        return None
    if stage == 0:
        bad.append("zero_optimization.offload_optimizer at stage 0 (stages 1-3 offload)")
        return None
    if device == "cpu":
        off = Offload("host")
    elif device == "nvme" and path:
        off = Offload("disk", path=path)
    else:
        bad.append(f"zero_optimization.offload_optimizer.device={device!r} (cpu, or nvme with "
                   "nvme_path)")
        return None
    return replace(off, params="host") if on_host else off
