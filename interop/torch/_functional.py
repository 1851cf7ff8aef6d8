"""``interop.torch.functional``: a module as a params pytree and a
:class:`~interop.torch.TorchLoss` (see [Note: torch ZeRO-3] in ``_adapter.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from interop.torch._adapter import TorchLoss
from interop.torch._blocks import default_units, name_of
from interop.torch._meta import MetaParams
from interop.torch._state_dict import remember_dtypes
from interop.torch._units import ROOT
from ops.device._dlpack import to_native

if TYPE_CHECKING:
    import torch

    from ops._types import Array

__all__ = ["functional"]


def functional(module: torch.nn.Module, *, loss: Callable[[torch.nn.Module, object], object],
               units: Sequence[torch.nn.Module] | None = None,
               activation_checkpointing: bool = False,
               broadcast_buffers: bool = True,
               param_init_fn: Callable[[torch.nn.Module], None] | None = None, seed: int = 0,
               device: torch.device | str | int | None = None,
               ) -> tuple[dict[str, Array] | dict[str, torch.Tensor], TorchLoss]:
    """A module's parameters as a pytree, and a loss the ZeRO transforms train.

    Args:
      module: the ``torch.nn.Module`` (one per rank: thread ranks each build
        or ``copy.deepcopy`` their own).
      loss: ``loss(module, batch) -> scalar tensor``; ``batch`` is whatever the
        step is given (torch tensors, numpy arrays...).
      units: the submodules that form ZeRO-3 units, in execution order
        (default: see [Note: torch ZeRO-3]).
      activation_checkpointing: at stage 3, recompute each unit's forward in
        the backward instead of keeping its activations (less memory, about a
        third more compute), as FSDP2's and DeepSpeed's activation
        checkpointing do.
      broadcast_buffers: give every rank rank 0's buffers (BatchNorm's running
        statistics) before each forward, as DDP does (see [Note: torch
        buffers]); checkpoints keep rank 0's either way.
      param_init_fn: for a module built on the meta device (too large for one
        rank; see [Note: meta-device init]): ``fn(module)`` initialises one
        module's own parameters (and buffers) in place. Default: the model's
        ``_init_weights`` (Hugging Face), else each module's
        ``reset_parameters()``, as FSDP2's meta-device init calls.
      seed: for a meta module, the seed of each unit's initialisation (the
        values depend on it and the units, not on the world size).
      device: for a meta module, the torch device its units are materialised
        on (default ``"cpu"``).

    Returns:
      ``(params, loss_object)``: params is ``{state_dict key: array}`` (numpy
      for a CPU module, CuPy for a CUDA one) sharing memory with the
      parameters (tied parameters appear once, under their first name), or
      for a meta module its meta tensors (shapes, which the step's ``init``
      materialises one unit at a time);
      loss_object has ``value_and_grad(params, batch)`` and
      a ``units`` function that groups the params into units.

    Examples:
      >>> import copy, torch, ops, shard, interop.torch as it
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
      ...                             torch.nn.Linear(8, 1))
      >>> def run(comm):  # thread ranks: each trains its own copy of one model
      ...     params, loss = it.functional(copy.deepcopy(model),
      ...                                  loss=lambda m, b: m(b[0]).pow(2).mean())
      ...     step = shard.zero3(loss, optimizer=ops.adamw(1e-2), comm=comm)
      ...     state = step.init(params)
      ...     state, metrics = step(state, (torch.ones(2, 4),))
      ...     return metrics["skipped"]
      >>> ops.spawn(run, 2)
      [False, False]
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"functional: expected a torch.nn.Module; got {type(module).__name__}")
    named = dict(module.named_parameters())
    if not named:
        raise ValueError("functional: the module has no parameters")
    unit_modules = ([(name_of(module, m), m) for m in units] if units is not None
                    else default_units(module))
    meta = None
    if {p.device.type for p in named.values()} == {"meta"}:
        meta = MetaParams(module, unit_modules, param_init_fn, seed, device)
        named = dict(module.named_parameters())
    elif param_init_fn is not None or device is not None:
        raise ValueError("functional: param_init_fn= and device= are for a module built on "
                         "the meta device; this one's parameters have memory already")
    owners: dict[int, list[str]] = {}
    for key, m in unit_modules:
        for p in m.parameters():
            owners.setdefault(id(p), []).append(key)
    unit_of = {name: (owners[id(p)][0] if len(owners.get(id(p), [])) == 1 else ROOT)
               for name, p in named.items()}
    devices = {p.device for p in named.values()}
    if len(devices) > 1:
        raise ValueError(f"functional: the module's parameters are on {sorted(map(str, devices))}; "
                         "move it to one device first")
    params = (dict(meta.meta) if meta is not None
              else {name: to_native(p.data)[0] for name, p in named.items()})
    remember_dtypes(module)
    fn = TorchLoss(module, loss, named, unit_of, unit_modules,
                   activation_checkpointing=bool(activation_checkpointing),
                   broadcast_buffers=bool(broadcast_buffers), meta=meta,
                   # a module split by parallelize: its params are this model rank's slices
                   tensor_parallel=getattr(module, "_zeroshard_tensor_parallel", None))
    module.register_state_dict_pre_hook(fn._before_state_dict)
    return params, fn
