"""Policies: frozen dataclasses that configure a ZeRO step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ops import BF16

__all__ = ["LossScale", "Precision"]

_FLOATS = {np.dtype(np.float32), np.dtype(np.float16), BF16, np.dtype(np.float64)}


_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32", "fp64": "float64", "double": "float64"}


def _dtype(name: str, value: Any) -> np.dtype | None:
    """A numpy dtype from numpy, JAX or torch dtypes and their names."""
    if value is None:
        return None
    text = str(value)
    if text.startswith("torch."):  # torch.bfloat16 and friends
        value = text[len("torch."):]
    if isinstance(value, str):
        value = _ALIASES.get(value, value)
        if value == "bfloat16":
            return BF16
    try:
        d = np.dtype(value)
    except TypeError:
        raise TypeError(f"Precision: {name} must be a floating dtype (numpy, JAX or torch, or "
                        f"a name such as 'bfloat16'); got {value!r}") from None
    if d not in _FLOATS:
        raise TypeError(f"Precision: {name} must be float64, float32, bfloat16 or float16; "
                        f"got {d}")
    return d


@dataclass(frozen=True)
class Precision:
    """Mixed precision, as FSDP2's ``MixedPrecisionPolicy``.

    Attributes:
      param_dtype: dtype of the parameters the loss sees (and of the all-gathers
        at stage 3); None keeps the params' own dtype. numpy, JAX and torch
        dtypes and names ('bf16', 'bfloat16', 'fp16'...) are accepted.
      reduce_dtype: dtype gradients are reduced in; None uses param_dtype.
        float32 with bfloat16 params sums bf16 gradients in fp32.
      cast_forward_inputs: cast the batch's floating arrays (a JAX loss's
        batch, a torch module's forward inputs) to ``param_dtype`` when it
        differs from the masters', as FSDP2's option of that name; otherwise
        a float32 batch would silently promote the compute to float32.

    The master copy and Adam's moments are float32 whatever these say (float64
    params keep float64 masters for tight tests on the CPU).
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", _dtype("param_dtype", self.param_dtype))
        object.__setattr__(self, "reduce_dtype", _dtype("reduce_dtype", self.reduce_dtype))


@dataclass(frozen=True)
class LossScale:
    """Loss scaling for float16: dynamic (as torch.amp.GradScaler and DeepSpeed's
    ``DynamicLossScaler``) or static.

    The loss is multiplied by ``scale`` before the backward pass and the
    gradients unscaled inside the fused optimizer. A step whose gradients hold
    an inf or nan is skipped (params, moments and step count unchanged) and the
    scale is multiplied by ``backoff``, down to ``minimum`` (DeepSpeed's
    ``min_loss_scale``); after ``growth_interval`` good steps in a row it is
    multiplied by ``growth``.

    DeepSpeed's rules (``rule="deepspeed"``, which
    :func:`shard.from_deepspeed_config` sets): the scale backs off only after
    ``hysteresis`` overflows (each overflow uses one up; the count is refilled
    when the scale grows, or after every good step with
    ``consecutive_hysteresis``), and it grows whenever the good steps since the
    last overflow, before this one, are a positive multiple of
    ``growth_interval``. ``LossScale.static(s)`` keeps ``s`` whatever happens
    (DeepSpeed's ``fp16.loss_scale: s``), still skipping overflowing steps.
    """

    initial: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 2000
    minimum: float = 0.0
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    rule: str = "torch"
    dynamic: bool = True

    def __post_init__(self) -> None:
        if not (self.initial > 0 and self.growth >= 1 and 0 < self.backoff < 1
                and self.growth_interval >= 1 and 0 <= self.minimum <= self.initial):
            raise ValueError(f"LossScale: need initial > 0, growth >= 1, 0 < backoff < 1, "
                             f"growth_interval >= 1, 0 <= minimum <= initial; got {self}")
        if isinstance(self.hysteresis, bool) or not isinstance(self.hysteresis, int) or \
                self.hysteresis < 1:
            raise ValueError(f"LossScale: hysteresis must be an int >= 1; got "
                             f"{self.hysteresis!r}")
        if self.rule not in ("torch", "deepspeed"):
            raise ValueError(f"LossScale: rule must be 'torch' or 'deepspeed'; got {self.rule!r}")
        if self.hysteresis > 1 and self.rule != "deepspeed":
            raise ValueError("LossScale: hysteresis is DeepSpeed's rule: pass rule='deepspeed'")

    @classmethod
    def static(cls, scale: float) -> LossScale:
        """A fixed scale: overflowing steps are skipped, the scale never changes."""
        return cls(initial=float(scale), minimum=0.0, dynamic=False)

    def update(self, scale: float, good_steps: int, finite: bool,
               hysteresis: int | None = None) -> tuple[float, int, int]:
        """The ``(scale, good_steps, hysteresis)`` after a step whose grads were
        finite or not; ``hysteresis`` is the overflows left before the next
        back-off (``self.hysteresis`` when None)."""
        left = self.hysteresis if hysteresis is None else int(hysteresis)
        if not self.dynamic:
            return scale, (good_steps + 1 if finite else 0), left
        if self.rule == "deepspeed":
            return self._deepspeed(scale, good_steps, finite, left)
        if not finite:
            return max(scale * self.backoff, self.minimum), 0, left
        if good_steps + 1 >= self.growth_interval:
            return scale * self.growth, 0, left
        return scale, good_steps + 1, left

    def _deepspeed(self, scale: float, good: int, finite: bool,
                   left: int) -> tuple[float, int, int]:
        """DeepSpeed's ``DynamicLossScaler.update_scale``: ``good`` counts the good
        steps since the last overflow."""
        if not finite:
            if self.hysteresis == 1 or left <= 1:
                return max(scale * self.backoff, self.minimum), 0, left
            return scale, 0, left - 1
        if self.consecutive_hysteresis:
            left = self.hysteresis
        if good > 0 and good % self.growth_interval == 0:
            if not self.consecutive_hysteresis:
                left = self.hysteresis
            scale *= self.growth
        return scale, good + 1, left
