"""The adapter behind :mod:`interop.torch`: :func:`functional` and the loss
object it returns, :class:`TorchLoss`.

[Note: torch ZeRO-3]
At stage 3 the loss object drives the module unit by unit. Units are the
module's top-level children, with containers (``ModuleList``, ``Sequential``,
``ModuleDict``) opened up, and so is any child that holds the model's
repeated blocks at some depth (the decoder layers a Hugging Face model names
in ``_no_split_modules``, else the children of a ``ModuleList`` or
``Sequential`` that are all of one class). So a transformer's units are its
embeddings, each block, its final norm and its head, wherever the blocks sit
(``LlamaForCausalLM.model.layers.0``, ``GPT2LMHeadModel.transformer.h.0``); or
pass ``units=[submodules]``. Parameters that no unit
owns alone (the root's own, and weights tied between units, such as an
embedding shared with the output head) form a root unit that stays gathered
for the whole step, as FSDP2's root group does. Each unit runs once per
micro-batch, with its gathered params saved for the backward by reference:

- forward: gather the unit (the next units' all-gathers already in flight)
  into one flat buffer, bind its parameters to views of it (one DLPack
  exchange a unit), and run it under ``saved_tensors_hooks`` whose pack hook
  replaces every saved tensor that is (a view of) the unit's gathered
  parameters by a small reference (unit, shape, stride, offset in the flat
  buffer). Nothing autograd keeps then points at the gathered memory, so it
  is freed when the next unit starts (the last unit stays for the backward,
  which begins with it);
- backward: a gradient hook on the unit's outputs gathers it again (the
  previous units' all-gathers in flight) before its backward runs, and the
  unpack hook hands autograd views of the re-gathered parameters (the same
  values, so the gradients are bit for bit those of plain autograd);
- as soon as every parameter of a unit has its gradient (post-accumulate-grad
  hooks), the gradients go to the reduce-scatter and are dropped, and the
  unit's parameters are unbound (autograd checks a gradient against its
  parameter's shape, so they stay bound until then). Every rank starts the
  reductions in one fixed order, the backward's (the units' forward order
  reversed, then the root), a unit complete early waiting for the ones
  before it: so ranks whose forwards took different branches (a
  mixture-of-experts' routing, an early exit) issue the same collectives in
  the same order. A unit some parameters of which got no gradient is
  completed after the backward; those parameters are the loss's ``missing``
  (see [Note: missing gradients]). Frozen parameters
  (``requires_grad=False``) get no hook and no gradient (see [Note: frozen
  leaves]).

So, like FSDP2, a step computes each unit's forward once and keeps its
activations.

Where the state's own buffers are the whole params (stages 0-2; stage 3 on
one rank) nothing is gathered: parameters are bound to views of them, made
once and kept while the buffers are the same (a step checks one pointer a
parameter), with no saved-tensor hooks. Where the gradients' buffers have the
params' layout and dtype (one rank, or stage 0), each ``.grad`` is a view of
them, so autograd sums in place, as DDP's ``gradient_as_bucket_view`` does
(cleared after the step, as ``zero_grad`` would). Gradient hooks tell which
parameters got a gradient in every configuration.

``functional(..., activation_checkpointing=True)`` trades
compute for activation memory instead: each unit's forward runs under
non-reentrant activation checkpointing and is recomputed, gathered again, in
the backward.

Thread ranks on a CUDA module are the exception: torch's autograd engine runs
the backward of every thread on one worker thread per GPU, so a collective
inside one rank's backward would wait forever for ranks queued behind it.
There stage 3 gathers every unit before the forward and reduces after the
backward (correct, without the per-unit memory bound; a warning says so):
processes under torchrun, one GPU each, keep the schedule above.

Gathered leaves are bound as torch tensors over the step's device memory
(DLPack, no copy), and a unit's gradients enter the reduce-scatter's layout
in one launch that reads each where autograd left it (``ops/device/_runs.py``), so
a CUDA module trains on CuPy state with no host copy (see [Note: devices]).

"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from interop.torch._buffers import ModuleBuffers
from interop.torch._meta import MetaParams
from interop.torch._outputs import loss_and_aux
from interop.torch._units import UnitHooks, check_owner, rank_dependent, torch_dtype
from ops.device._dlpack import _torch_device, torch_view
from shard.core._protocol import LossProvider
from shard.monitor._profile import timed

if TYPE_CHECKING:
    import jax
    import torch

    from ops import Communicator, Device
    from ops._types import Array
    from shard import TensorParallel
    from shard.step.reduction._reduce import GradReducer

__all__ = ["TorchLoss"]

log = logging.getLogger("interop.torch")

class TorchLoss(LossProvider):
    """The loss object :func:`functional` returns (see [Note: torch ZeRO-3],
    [Note: torch buffers] and, for what the step reads, [Note: the loss
    protocol]): the module and the user's loss, with the :class:`UnitHooks`
    that bind its parameters unit by unit and the :class:`ModuleBuffers` kept
    beside its state.

    Args:
      module: the root module, ``loss``: ``loss(module, batch)``.
      named: the module's parameters by name; ``unit_of``, ``unit_modules``:
        their units (see :class:`UnitHooks`).
      activation_checkpointing: :func:`functional`'s.
      broadcast_buffers: :func:`functional`'s.
      meta: a module built on the meta device: its :class:`MetaParams`.
      tensor_parallel: the ``shard.TensorParallel`` of a module split by
        ``interop.torch.parallelize`` (the step reads it), or None.
    """

    supports_aux = True  # the loss may return (loss, aux): the transforms' has_aux=True
    counts_flops = "torch"  # see [Note: model FLOPs]
    has_aux = False  # True inside a call of a step built with has_aux=True
    reports_missing = True  # see [Note: missing gradients]

    def __init__(self, module: torch.nn.Module, loss: Callable[[torch.nn.Module, object], object],
                 named: dict[str, torch.nn.Parameter], unit_of: dict[str, str],
                 unit_modules: list[tuple[str, torch.nn.Module]], *,
                 activation_checkpointing: bool = False, broadcast_buffers: bool = True,
                 meta: MetaParams | None = None,
                 tensor_parallel: TensorParallel | None = None) -> None:
        self.module, self.loss, self.named = module, loss, named
        self.unit_of = unit_of
        self._dtype = next(iter(named.values())).dtype  # the module's own param dtype
        self._hooks = UnitHooks(module, named, unit_of, unit_modules, dtype=self._dtype,
                                activation_checkpointing=activation_checkpointing)
        self._buffers = ModuleBuffers(module, broadcast=broadcast_buffers)
        self._meta = meta
        self.tensor_parallel = tensor_parallel
        # the params live in a step's state (a meta module's have no memory yet)
        self._sharded = meta is not None
        self._rank: int | None = None  # the rank this object serves (see claim)
        # set in a step when mixed precision changes it
        self._compute_dtype: torch.dtype | None = None
        self.cast_forward_inputs = True  # Precision's, inside a step's call (configured)
        self._on_gpu = any(p.device.type == "cuda" for p in named.values())
        self._warned = False
        self._like = {name: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
                      for name, p in named.items()}
        # the leaves of the trainable parameters that got no gradient in the last
        # micro-batch (see [Note: missing gradients])
        self.missing: frozenset[int] = frozenset()

    def claim(self, comm: Communicator) -> None:
        """Bind this loss object to ``comm``'s rank (the step's ``init`` calls it): a
        module is one rank's, so thread ranks sharing one object are refused
        before they train on each other's parameters or wait on each other's
        hooks."""
        self._rank = check_owner(self._rank, comm, "interop.torch.functional",
                                 "module and loss: params, loss = interop.torch.functional("
                                 "copy.deepcopy(model), loss=...) inside the function each "
                                 "rank runs")
        self._buffers.comm = comm

    @contextlib.contextmanager
    def configured(self, *, has_aux: bool, cast_forward_inputs: bool) -> Iterator[None]:
        """One step's call: its ``has_aux`` (the loss returns ``(loss, aux)``)
        and its precision policy's ``cast_forward_inputs`` (the module casts
        its floating inputs to the compute dtype in its forward), restored
        after (see [Note: the loss protocol])."""
        before = self.has_aux, self.cast_forward_inputs
        self.has_aux, self.cast_forward_inputs = has_aux, cast_forward_inputs
        try:
            yield
        finally:
            self.has_aux, self.cast_forward_inputs = before

    def layout_dependent(self) -> str | None:
        """A module's running statistics or dropout (see ``rank_dependent``)."""
        return rank_dependent(self.module.named_modules())

    def hooks_usable(self, comm: Communicator) -> bool:
        """Whether stage 3 may run collectives inside the backward (see the Note)."""
        if self._on_gpu and comm.world_size > 1 and comm.backend == "threads":
            if not self._warned:
                log.warning("thread ranks on a CUDA module: torch runs every thread's backward "
                            "on one worker thread per GPU, so stage 3 gathers all units for "
                            "the step; run one process per GPU (torchrun) for the per-unit "
                            "memory bound")
                self._warned = True
            return False
        return True

    @property
    def frozen(self) -> frozenset[str]:
        """The names of the parameters with ``requires_grad=False``: the step keeps
        them as they are (see [Note: frozen leaves])."""
        return frozenset(n for n, p in self.named.items() if not p.requires_grad)

    def params_like(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The params' shapes and dtypes (``jax.ShapeDtypeStruct``), as
        :func:`functional` found them: what a checkpoint loaded into a fresh
        step must hold."""
        import jax

        from ops.device._arrays import BF16

        def dtype(name: str) -> np.dtype:
            return BF16 if name == "bfloat16" else np.dtype(name)

        return {name: jax.ShapeDtypeStruct(shape, dtype(d))
                for name, (shape, d) in self._like.items()}

    def units(self, path: tuple) -> str:
        """The unit key of a params leaf (by its key path in the params dict)."""
        return self.unit_of[path[0].key]

    # -- buffers (see [Note: torch buffers]) --------------------------------------
    def module_state(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """This rank's buffers as host arrays (copies), and the tied names."""
        return self._buffers.module_state()

    def load_buffers(self, values: dict[str, np.ndarray], where: str) -> None:
        """Write a checkpoint's buffers into the module (after checking them all)."""
        self._buffers.load(values, where)

    # -- a module built on the meta device ----------------------------------------
    def materialize(self, paths: list[tuple]) -> list[torch.Tensor]:
        """The whole, freshly initialised values of the params at ``paths`` (one
        unit's, for the step's ``init``; see [Note: meta-device init])."""
        if self._meta is None:
            raise TypeError("materialize: this module was not built on the meta device")
        names = [path[0].key for path in paths]
        return self._meta.materialize(names, {self.unit_of[n] for n in names}, self.named)

    @property
    def materialize_device(self) -> Device | None:
        """Where a meta module's units are materialised, as an ``ops.Device``."""
        if self._meta is None:
            return None
        import torch

        return _torch_device(torch.empty(0, device=self._meta.device))

    # -- stages 0-2 (and anything with whole params) ------------------------------
    def value_and_grad(
        self, params: dict[str, Array], batch: object, loss_scale: float = 1.0
    ) -> tuple[torch.Tensor | tuple[torch.Tensor, Any], dict[str, torch.Tensor]]:
        """Loss and gradients (of ``loss_scale * loss``) at ``params``, by autograd:
        a scalar tensor and ``{name: tensor}``, on the module's device."""
        import torch

        for name, p in self.named.items():
            p.data = torch_view(params[name])
            p.grad = None
        self._buffers.sync()
        self._hooks.install(self._before_forward)
        self._set_compute_dtype(next(iter(self.named.values())).dtype)
        cast = self._compute_dtype is not None
        try:
            with timed("forward"):
                out, aux = self._call_loss(batch)
            with timed("backward"):
                (out * loss_scale).backward()
        finally:
            self._compute_dtype = None
        grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p))
                 for name, p in self.named.items()}
        self.missing = frozenset(j for j, name in enumerate(sorted(self.named))
                                 if self.named[name].grad is None and
                                 self.named[name].requires_grad)
        for p in self.named.values():
            p.grad = None
            if cast:  # see [Note: torch dtypes]
                p.data = self._hooks.empty(p, self._dtype)
        self._sharded = self._sharded or cast
        return ((out.detach(), aux) if self.has_aux else out.detach()), grads

    def loss_value(self, params: dict[str, Array],
                   batch: object) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The loss (with ``has_aux``, ``(loss, aux)``) at ``params`` in eval mode
        under ``torch.no_grad``, with rank 0's buffers (for ``ZeroStep.evaluate``,
        a collective); the module's parameters and mode are restored."""
        import torch

        self._buffers.sync()
        before = {name: p.data for name, p in self.named.items()}
        training = self.module.training
        self._set_compute_dtype(_torch_dtype_of(params))
        try:
            for name, p in self.named.items():
                p.data = torch_view(params[name])
            self.module.eval()
            with torch.no_grad():
                loss, aux = self._call_loss(batch, training=False)
                return (loss.detach(), aux) if self.has_aux else loss.detach()
        finally:
            self._compute_dtype = None
            self.module.train(training)
            for name, p in self.named.items():
                p.data = before[name]

    # -- stage 3 --------------------------------------------------------------------
    def run_units(self, units: Any, reducer: GradReducer, batch: object,
                  loss_scale: float) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """One micro-batch, unit by unit (:meth:`UnitHooks.run`)."""
        self._buffers.sync()
        self._set_compute_dtype(torch_dtype(units.local[0].dtype if units.stage == 3
                                             else units.full[0].dtype))
        self._hooks.install(self._before_forward)
        try:
            out, aux = self._hooks.run(units, reducer, lambda: self._call_loss(batch),
                                       loss_scale, other_dtype=self._compute_dtype is not None)
        finally:
            self._compute_dtype = None
            self._sharded = self._hooks.unbound
            self.missing = self._hooks.missing
        return (out.detach(), aux) if self.has_aux else out.detach()

    def _call_loss(self, batch: object, *, training: bool = True) -> tuple[torch.Tensor, object]:
        """The user's loss on the module: ``(loss, aux)`` (aux None without
        ``has_aux``, which a step built with ``has_aux=True`` sets)."""
        import torch

        loss, aux = loss_and_aux(self.loss(self.module, batch), self.has_aux, training=training)
        if aux is not None:
            aux = torch.utils._pytree.tree_map(
                lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux)
        return loss, aux

    def _set_compute_dtype(self, dtype: torch.dtype) -> None:
        self._compute_dtype = dtype if dtype != self._dtype else None

    def _before_forward(self, module: torch.nn.Module, args: tuple[object, ...],
                        kwargs: dict[str, object]) -> tuple[object, object] | None:
        """The root module's pre-hook: refuse a sharded module outside a step; in a
        step, cast floating inputs to the compute dtype (FSDP2's
        ``cast_forward_inputs``) when mixed precision changed it."""
        dtype = self._compute_dtype
        if dtype is None or not self.cast_forward_inputs:
            if self._hooks.active is None:
                self._check_usable()
            return None
        import torch

        def cast(x: object) -> object:
            if isinstance(x, torch.Tensor):
                return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
            if isinstance(x, (tuple, list)):
                return type(x)(cast(v) for v in x)
            if isinstance(x, dict):
                return {k: cast(v) for k, v in x.items()}
            return x

        return cast(args), cast(kwargs)

    def _check_usable(self, what: str = "run") -> None:
        if self._sharded and any(
                p.numel() == 0 for p in self.named.values()):
            raise RuntimeError(
                f"cannot {what} this module: its parameters live in a ZeRO step's state "
                "(sharded over the ranks at stage 3, or in the step's compute dtype under "
                "mixed precision) and the module holds empty tensors: take the trained "
                "values with interop.torch.state_dict(module, state, comm=comm) (for "
                "torch.save), write them back with interop.torch.load_state(module, state, "
                "comm=comm), evaluate with step.evaluate(state, batch), or train a "
                "copy.deepcopy(model)")

    def _before_state_dict(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        """``module.state_dict()``'s pre-hook: never empty tensors in place of the
        trained values (``keep_vars=True`` is the library's own read of the
        buffers)."""
        if not keep_vars and self._hooks.active is None:
            self._check_usable("take the state_dict of")


def _torch_dtype_of(params: dict[str, Array]) -> torch.dtype:
    return torch_view(next(iter(params.values()))).dtype
