"""Whole parameters back into a torch module, and its whole ``state_dict``, from a
ZeRO state: :func:`load_state` and :func:`state_dict`.

[Note: torch dtypes]
A module keeps its parameters' dtype outside a step, as under FSDP2's
``MixedPrecisionPolicy``, which casts for the forward only. Within a step
the parameters are bound to the step's compute params; where mixed precision
made those another dtype (bf16 compute for a float32 module), the step leaves
each parameter an empty tensor of its own dtype afterwards, as stage 3 leaves
its sharded ones: the module then refuses to run outside a step and says
how to get its trained params back (``load_state``, in its own dtype, with
the masters' values), instead of computing in bf16 or exporting bf16
weights. Without mixed precision, stages 0-2 (and stage 3 on one rank) leave
the module bound to the state's own buffers, usable as it is.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ops.device._device import device_of_or_none
from ops.device._dlpack import to_native, torch_view

if TYPE_CHECKING:
    import torch

    from ops import Communicator
    from shard import TrainState

__all__ = ["load_state", "remember_dtypes", "state_dict"]

# Each module's parameter dtypes when functional() took it: mixed precision binds
# the parameters to the step's compute-dtype buffers, and exports go back to these.
_DTYPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_dtypes(module: torch.nn.Module) -> None:
    """Keep ``module``'s parameter dtypes, as :func:`functional` found them."""
    _DTYPES.setdefault(module, {name: p.dtype for name, p in module.named_parameters()})


def _dtype_of(module: torch.nn.Module, name: str, now: torch.dtype) -> torch.dtype:
    return _DTYPES.get(module, {}).get(name, now)


def load_state(module: torch.nn.Module, state_or_params: TrainState | Mapping[str, object], *,
               comm: Communicator | None = None) -> torch.nn.Module:
    """Write whole parameters back into ``module`` (for evaluation or export).

    Args:
      module: the module :func:`functional` was made from (or one like it).
      state_or_params: a TrainState (gathered with ``comm``, a collective) or
        a ``{name: array}`` dict of whole parameters (e.g. ``shard.gather``'s).
      comm: this rank's communicator, when a TrainState is given.

    Returns:
      The module, its parameters overwritten in place (copies, in the dtype
      each had when :func:`functional` took the module: float32 after bf16
      training of a float32 model, the masters' values).
    """
    import torch

    from shard import TrainState, gather

    params: Any = state_or_params  # {name: array} once a TrainState is gathered
    if isinstance(state_or_params, TrainState):
        if comm is None:
            raise ValueError("load_state: gathering a TrainState needs comm=")
        params = gather(state_or_params, comm)
    named = dict(module.named_parameters())
    missing = sorted(set(named) - set(params))
    if missing:
        raise KeyError(f"load_state: no values for {missing[:5]}")
    with torch.no_grad():
        for name, p in named.items():
            src = _as_tensor(params[name])
            if tuple(src.shape) != tuple(p.shape) and p.numel() > 0:
                raise ValueError(f"load_state: {name} has shape {tuple(src.shape)}, the module "
                                 f"{tuple(p.shape)}")
            p.data = src.to(device=p.device, dtype=_dtype_of(module, name, p.dtype), copy=True)
    return module


def state_dict(module: torch.nn.Module, state_or_params: TrainState | Mapping[str, object], *,
               comm: Communicator | None = None) -> dict[str, torch.Tensor]:
    """The module's whole ``state_dict`` from a ZeRO state, for ``torch.save`` or
    ``load_state_dict(..., strict=True)``.

    Every parameter appears under each of its names (a head tied to the
    embedding too), in the dtype it had when :func:`functional` took the
    module (so bf16 training of a float32 model exports the float32 masters,
    as ``python -m shard.checkpoint consolidate`` does); buffers (BatchNorm's running
    statistics, say) are rank 0's, broadcast, so every rank returns the same
    dict, as DDP's ``broadcast_buffers`` keeps them.

    Args:
      module: the module :func:`functional` was made from.
      state_or_params: a TrainState (gathered with ``comm``: a collective) or
        a ``{name: array}`` dict of whole parameters.
      comm: this rank's communicator (needed for a TrainState; with a dict,
        buffers are broadcast only when it is given).
    """
    import torch

    import ops
    from shard import TrainState, gather

    params: Any = state_or_params  # {name: array} once a TrainState is gathered
    if isinstance(state_or_params, TrainState):
        if comm is None:
            raise ValueError("state_dict: gathering a TrainState needs comm=")
        params = gather(state_or_params, comm)
    canonical = {id(p): name for name, p in module.named_parameters()}
    every_name = dict(module.named_parameters(remove_duplicate=False))
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if key in every_name:
            name = canonical[id(every_name[key])]
            if name not in params:
                raise KeyError(f"state_dict: no value for parameter {name}")
            out[key] = _as_tensor(params[name]).to(
                device=value.device, dtype=_dtype_of(module, name, value.dtype), copy=True)
            continue
        buf = value.detach().clone()
        if comm is not None and comm.world_size > 1:
            buf = torch.as_tensor(ops.broadcast(comm, buf, src=0)).to(value.device)
        out[key] = buf
    return out


def _as_tensor(x: Any) -> torch.Tensor:
    """A torch tensor over an array of any device (numbers and lists copied)."""
    import torch

    if device_of_or_none(x) is not None:
        return torch_view(x)
    if hasattr(x, "__dlpack__"):
        return torch_view(to_native(x)[0])
    return torch.as_tensor(np.asarray(x, np.float32))
