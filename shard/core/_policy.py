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
    """Dynamic loss scaling for float16 (as torch.amp.GradScaler).

    The loss is multiplied by ``scale`` before the backward pass and the
    gradients unscaled inside the fused optimizer. A step whose gradients hold
    an inf or nan is skipped (params, moments and step count unchanged) and the
    scale is multiplied by ``backoff``, down to ``minimum`` (DeepSpeed's
    ``min_loss_scale``); after ``growth_interval`` good steps in a row it is
    multiplied by ``growth``.
    """

    initial: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 2000
    minimum: float = 0.0

    def __post_init__(self) -> None:
        if not (self.initial > 0 and self.growth >= 1 and 0 < self.backoff < 1
                and self.growth_interval >= 1 and 0 <= self.minimum <= self.initial):
            raise ValueError(f"LossScale: need initial > 0, growth >= 1, 0 < backoff < 1, "
                             f"growth_interval >= 1, 0 <= minimum <= initial; got {self}")

    def update(self, scale: float, good_steps: int, finite: bool) -> tuple[float, int]:
        """The (scale, good_steps) after a step whose grads were finite or not."""
        if not finite:
            return max(scale * self.backoff, self.minimum), 0
        if good_steps + 1 >= self.growth_interval:
            return scale * self.growth, 0
        return scale, good_steps + 1
