"""What a torch loss may return: :func:`loss_and_aux`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["loss_and_aux"]


def loss_and_aux(out: object, has_aux: bool, *,
                 training: bool = True) -> tuple[torch.Tensor, Any]:
    """A torch loss's result as ``(loss, aux)``: a scalar tensor, ``(loss, aux)``
    (with ``has_aux=True``), or a mapping with a ``"loss"`` entry, as a Hugging
    Face model's ``ModelOutput`` (its other entries are the aux). Anything else
    is refused here, after the forward and before the state changes, naming
    what the loss returned."""
    import torch

    from shard.core.losses._jax import split_aux

    if isinstance(out, Mapping):
        if out.get("loss") is None:
            raise TypeError(f"the torch loss returned a {type(out).__name__} without a 'loss' "
                            f"entry (keys {list(out)}); return the loss tensor, or pass the "
                            "labels the model needs to compute one")
        loss = out["loss"]
        aux = {k: v for k, v in out.items() if k != "loss"} if has_aux else None
    else:
        loss, aux = split_aux(out, has_aux)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the torch loss must return a scalar torch.Tensor (or (loss, aux), or a "
                        f"dict or ModelOutput with a 'loss' entry); it returned "
                        f"{type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"the torch loss must be a scalar; it returned a tensor of shape "
                         f"{tuple(loss.shape)} (reduce it, e.g. with .mean())")
    if training and not loss.requires_grad:
        raise ValueError("the torch loss does not depend on any parameter that trains (its "
                         "tensor has requires_grad=False): is every parameter frozen, or the "
                         "loss computed under torch.no_grad?")
    return loss, aux
