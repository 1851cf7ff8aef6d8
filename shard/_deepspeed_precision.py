"""A DeepSpeed config's precision and reduction keys (``fp16``, ``bf16``,
``communication_data_type``, ``data_types``, ``gradient_allreduce_op``) as a
:class:`~shard.Precision`, a :class:`~shard.LossScale` and the gradient divide
factor, for :func:`shard.from_deepspeed_config` (``_deepspeed.py`` lists what
each key means here)."""

from __future__ import annotations

from shard.core._policy import LossScale, Precision

__all__ = ["allreduce_op", "precision_of"]


def allreduce_op(cfg: dict, stage: int, bad: list[str]) -> float | None:
    """``gradient_allreduce_op``: the gradient divide factor (None: the mean)."""
    op = cfg.pop("gradient_allreduce_op", "mean")
    op = op.lower() if isinstance(op, str) else op
    if op == "mean":
        return None
    if op != "sum":
        bad.append(f"gradient_allreduce_op={op!r} (mean or sum)")
    elif stage == 3:
        bad.append("gradient_allreduce_op='sum' at stage 3 (DeepSpeed refuses it too)")
    else:
        return 1.0
    return None


def precision_of(cfg: dict, bad: list[str],
               tuning: list[str]) -> tuple[Precision | None, LossScale | None]:
    """``fp16``, ``bf16``, ``communication_data_type`` and ``data_types``."""
    param, reduce, loss_scale = None, None, None
    fp16 = dict(cfg.pop("fp16", {}) or {})
    bf16 = dict(cfg.pop("bf16", {}) or {})
    if fp16.pop("enabled", False):
        param, reduce = "float16", "float32"
        static = fp16.pop("loss_scale", 0)
        power = fp16.pop("initial_scale_power", 16)
        window = fp16.pop("loss_scale_window", 1000)
        hysteresis = fp16.pop("hysteresis", 2)  # DeepSpeed's defaults
        consecutive = fp16.pop("consecutive_hysteresis", False)
        minimum = float(fp16.pop("min_loss_scale", 1.0))
        if fp16.pop("fp16_master_weights_and_grads", False):
            bad.append("fp16.fp16_master_weights_and_grads (masters are float32 here)")
        try:
            loss_scale = (LossScale.static(float(static)) if static else
                          LossScale(initial=2.0**power, growth_interval=int(window),
                                    minimum=minimum, hysteresis=hysteresis,
                                    consecutive_hysteresis=bool(consecutive),
                                    rule="deepspeed"))
        except (ValueError, TypeError) as e:
            bad.append(f"fp16 ({e})")
    else:  # disabled: its settings mean nothing
        fp16.clear()
    bad += [f"fp16.{k}" for k in fp16]
    if bf16.pop("enabled", False):
        if param is not None:
            bad.append("bf16.enabled with fp16.enabled")
        param, reduce = "bfloat16", None
        if "immediate_grad_update" in bf16:
            tuning.append(f"bf16.immediate_grad_update={bf16.pop('immediate_grad_update')}")
    else:
        bf16.clear()
    bad += [f"bf16.{k}" for k in bf16]
    types = dict(cfg.pop("data_types", {}) or {})
    accum = types.pop("grad_accum_dtype", None)
    bad += [f"data_types.{k}" for k in types]
    for key, dtype in (("data_types.grad_accum_dtype", accum),
                       ("communication_data_type", cfg.pop("communication_data_type", None))):
        if dtype is None:
            continue
        if str(dtype) not in ("fp32", "fp16", "bf16"):
            bad.append(f"{key}={dtype!r} (fp32, fp16 or bf16)")
        else:
            reduce = dtype
    if param is None and reduce is None:
        return None, loss_scale
    return Precision(param_dtype=param, reduce_dtype=reduce), loss_scale
