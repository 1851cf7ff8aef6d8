"""Train a torch ``nn.Module`` with the ZeRO transforms.

``params, loss = interop.torch.functional(model, loss=lambda m, b: ...)`` turns
a module into a params pytree (arrays over the module's own parameter memory:
numpy for a CPU module, CuPy for a CUDA one; named by their state_dict keys) and a loss object whose
``value_and_grad`` runs the module with torch autograd. Hand both to a ZeRO
transform: ``step = shard.zero3(loss, optimizer=..., comm=comm)``,
``state = step.init(params)``.

[Note: torch ZeRO-3]
At stage 3 the loss object drives the module unit by unit. Units are the
module's top-level children, with containers (``ModuleList``, ``Sequential``,
``ModuleDict``) opened up, so a transformer's units are its embeddings, each
block, and its head; or pass ``units=[submodules]``. Parameters that no unit
owns alone (the root's own, and weights tied between units, such as an
embedding shared with the output head) form a root unit that stays gathered
for the whole step, as FSDP2's root group does. Each unit's forward runs under
non-reentrant activation checkpointing with the gather inside it:

- forward: gather the unit (the next unit's all-gather already in flight),
  bind its parameters, run it, unbind; nothing the autograd graph keeps refers
  to the gathered memory, so it is freed when the unit returns;
- backward: autograd recomputes the unit, which gathers it again (the
  previous unit's all-gather in flight), and runs its backward;
- as soon as every parameter of a unit has its gradient (post-accumulate-grad
  hooks), the gradients go to the reduce-scatter and are dropped, and the
  unit's parameters are unbound (autograd checks a gradient against its
  parameter's shape, so they stay bound until then).

Thread ranks on a CUDA module are the exception: torch's autograd engine runs
the backward of every thread on one worker thread per GPU, so a collective
inside one rank's backward would wait forever for ranks queued behind it.
There stage 3 gathers every unit before the forward and reduces after the
backward (correct, without the per-unit memory bound; a warning says so):
processes under torchrun, one GPU each, keep the schedule above.

Gathered leaves are bound as torch tensors over the step's device memory
(DLPack, no copy) and gradients go to the reduce-scatter the same way, so a
CUDA module trains on CuPy state with no host copy (see [Note: devices]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ops._device import device_of_or_none
from ops._dlpack import to_native, torch_view
from ops._tree import tree_util

__all__ = ["TorchLoss", "functional", "load_state"]

log = logging.getLogger(__name__)
ROOT = "<root>"
_CONTAINERS = ("ModuleList", "Sequential", "ModuleDict")


def _default_units(module: Any) -> list[tuple[str, Any]]:
    out = []

    def visit(prefix: str, m: Any) -> None:
        for name, child in m.named_children():
            path = f"{prefix}{name}"
            if type(child).__name__ in _CONTAINERS:
                visit(path + ".", child)
            else:
                out.append((path, child))

    visit("", module)
    return out


def functional(module: Any, *, loss: Callable[[Any, Any], Any],
               units: Sequence[Any] | None = None) -> tuple[dict[str, Any], TorchLoss]:
    """A module's parameters as a pytree, and a loss the ZeRO transforms train.

    Args:
      module: the ``torch.nn.Module`` (one per rank: thread ranks each build
        or ``copy.deepcopy`` their own).
      loss: ``loss(module, batch) -> scalar tensor``; ``batch`` is whatever the
        step is given (torch tensors, numpy arrays...).
      units: the submodules that form ZeRO-3 units, in execution order
        (default: see [Note: torch ZeRO-3]).

    Returns:
      ``(params, loss_object)``: params is ``{state_dict key: array}`` (numpy
      for a CPU module, CuPy for a CUDA one) sharing memory with the
      parameters (tied parameters appear once, under their first name);
      loss_object has ``value_and_grad(params, batch)`` and
      a ``units`` function that groups the params into units.

    Example:
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
    unit_modules = ([(_name_of(module, m), m) for m in units] if units is not None
                    else _default_units(module))
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
    params = {name: to_native(p.data)[0] for name, p in named.items()}
    return params, TorchLoss(module, loss, named, unit_of, unit_modules)


def _name_of(root: Any, sub: Any) -> str:
    for name, m in root.named_modules():
        if m is sub:
            return name
    raise ValueError("functional: units must be submodules of the module")


class TorchLoss:
    """The loss object :func:`functional` returns (see [Note: torch ZeRO-3])."""

    def __init__(self, module: Any, loss: Callable[[Any, Any], Any], named: dict[str, Any],
                 unit_of: dict[str, str], unit_modules: list[tuple[str, Any]]) -> None:
        self.module, self.loss, self.named = module, loss, named
        self.unit_of, self.unit_modules = unit_of, unit_modules
        self._active: Any = None  # the step's (units, reducer) while run_units runs
        self._installed = False
        self._warned = False

    def hooks_usable(self, comm: Any) -> bool:
        """Whether stage 3 may run collectives inside the backward (see the Note)."""
        on_gpu = any(p.device.type == "cuda" for p in self.named.values())
        if on_gpu and comm.world_size > 1 and comm.backend == "threads":
            if not self._warned:
                log.warning("thread ranks on a CUDA module: torch runs every thread's backward "
                            "on one worker thread per GPU, so stage 3 gathers all units for "
                            "the step; run one process per GPU (torchrun) for the per-unit "
                            "memory bound")
                self._warned = True
            return False
        return True

    def units(self, path: tuple) -> str:
        """The unit key of a params leaf (by its key path in the params dict)."""
        return self.unit_of[path[0].key]

    # -- stages 0-2 (and anything with whole params) ------------------------------
    def value_and_grad(self, params: dict[str, Any], batch: Any,
                       loss_scale: float = 1.0) -> tuple[Any, dict[str, Any]]:
        """Loss and gradients (of ``loss_scale * loss``) at ``params``, by autograd:
        a scalar tensor and ``{name: tensor}``, on the module's device."""
        import torch

        for name, p in self.named.items():
            p.data = torch_view(params[name])
            p.grad = None
        out = self.loss(self.module, batch)
        (out * loss_scale).backward()
        grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p))
                 for name, p in self.named.items()}
        for p in self.named.values():
            p.grad = None
        return out.detach(), grads

    # -- stage 3 --------------------------------------------------------------------
    def run_units(self, units: Any, reducer: Any, batch: Any, loss_scale: float) -> Any:
        """One micro-batch at stage 3, unit by unit (see [Note: torch ZeRO-3])."""
        import torch

        layout = units.layout
        index = {u.name: i for i, u in enumerate(layout.units)}
        names = [path[0].key for path, _ in tree_util().tree_flatten_with_path(
            layout.treedef.unflatten(list(range(len(layout.leaves)))))[0]]
        members = {i: [names[j] for j in u.leaves] for i, u in enumerate(layout.units)}
        order = [index[key] for key, _ in self.unit_modules if key in index]
        self._active = {"units": units, "reducer": reducer, "index": index, "order": order,
                        "members": members, "phase": "forward", "pending": {
                            i: set(m) for i, m in members.items()}}
        self._install()
        root = index.get(ROOT)
        try:
            if root is not None:
                self._bind(members[root], units.get(root, pinned=True))
            out = self.loss(self.module, batch)
            self._active["phase"] = "backward"
            (out * loss_scale).backward()
            for u, missing in self._active["pending"].items():
                if missing:  # parameters the loss did not use: their gradient is zero
                    self._reduce(u)
        finally:
            for p in self.named.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None
            self._active = None
        return out.detach()

    def _install(self) -> None:
        if self._installed:
            return
        from torch.utils.checkpoint import checkpoint

        for key, m in self.unit_modules:
            if not any(self.unit_of.get(n) == key for n in self.named):
                continue
            forward = m.forward

            def wrapped(*args: Any, _key: str = key, _forward: Any = forward, **kw: Any) -> Any:
                if self._active is None:
                    return _forward(*args, **kw)
                return checkpoint(self._run_unit, _key, _forward, *args, use_reentrant=False,
                                  **kw)

            m.forward = wrapped
        for name, p in self.named.items():
            p.register_post_accumulate_grad_hook(lambda p, name=name: self._grad_ready(name))
        self._installed = True

    def _run_unit(self, key: str, forward: Any, *args: Any, **kw: Any) -> Any:
        a = self._active
        u = a["index"][key]
        pos = a["order"].index(u)
        upcoming = (a["order"][pos + 1:] if a["phase"] == "forward"
                    else a["order"][:pos][::-1])
        names = a["members"][u]
        self._bind(names, a["units"].get(u, upcoming))
        if a["phase"] == "backward":  # recomputing: unbound once its gradients are in
            return forward(*args, **kw)
        try:
            return forward(*args, **kw)
        finally:
            self._unbind(names)

    def _bind(self, names: list[str], leaves: list[Any]) -> None:
        for name, leaf in zip(names, leaves, strict=True):
            self.named[name].data = torch_view(leaf)

    def _unbind(self, names: list[str]) -> None:
        import torch

        for name in names:
            p = self.named[name]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _grad_ready(self, name: str) -> None:
        a = self._active
        if a is None:
            return
        u = a["index"][self.unit_of[name]]
        a["pending"][u].discard(name)
        if not a["pending"][u]:
            self._reduce(u)

    def _reduce(self, u: int) -> None:
        a = self._active
        grads = []  # torch tensors, viewed on the step's device by the reducer; None is zero
        for name in a["members"][u]:
            p = self.named[name]
            grads.append(p.grad)
            p.grad = None
        a["pending"][u] = set()
        a["reducer"].add(u, grads)
        if a["index"].get(ROOT) != u:
            self._unbind(a["members"][u])


def load_state(module: Any, state_or_params: Any, *, comm: Any = None) -> Any:
    """Write whole parameters back into ``module`` (for evaluation or export).

    Args:
      module: the module :func:`functional` was made from (or one like it).
      state_or_params: a TrainState (gathered with ``comm``, a collective) or
        a ``{name: array}`` dict of whole parameters (e.g. ``shard.gather``'s).
      comm: this rank's communicator, when a TrainState is given.

    Returns:
      The module, its parameters overwritten in place (copies, in their dtype).
    """
    import torch

    from shard import TrainState, gather

    params = state_or_params
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
            p.data = src.to(device=p.device, dtype=p.dtype, copy=True)
    return module


def _as_tensor(x: Any) -> Any:
    """A torch tensor over an array of any device (numbers and lists copied)."""
    import torch

    if device_of_or_none(x) is not None:
        return torch_view(x)
    if hasattr(x, "__dlpack__"):
        return torch_view(to_native(x)[0])
    return torch.as_tensor(np.asarray(x, np.float32))
