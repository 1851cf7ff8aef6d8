"""A torch model as a chain of modules, one ZeRO unit (and pipeline layer) each:
:func:`layered`.

[Note: torch layers]
``params, loss = interop.torch.layered([embed, *blocks, head], loss=fn)`` is
the torch form of ``shard.Layered``: ``params`` is a list with one
``{name: array}`` dict per module (arrays over the module's own parameter
memory), and ``loss`` trains with every ZeRO transform, alone or as
``shard.pipeline(loss, ...)``'s stages. The first module takes
``inputs(batch)`` (default ``batch[0]``, DeepSpeed's ``(inputs, labels)``),
each next one the tensor the one before returned, and ``fn(output, batch)``
turns the last output into the loss. Between pipeline stages the output must
be one floating tensor. Modules with state in buffers (BatchNorm's running
statistics) are refused: ``interop.torch.functional`` syncs and checkpoints
buffers, and this does not.

A stage (the whole model when not pipelined) runs its micro-batches in one of
two ways:

- graph: the params are bound for the step (stages 0-2) and each micro-batch's
  forward keeps its autograd graph until its backward;
- recompute: each unit's forward runs under ``no_grad`` keeping only the
  unit's input (and the RNG state, so dropout draws the same mask again); the
  backward runs the unit's forward again with autograd, then its backward.
  This is activation checkpointing (``activation_checkpointing=True``), and
  what ZeRO-3 always does here: a unit is gathered for its forward, released,
  and gathered again for its backward, so no autograd state points at
  gathered memory between the two and at most the units being computed and
  prefetched are whole.

Either way a unit's gradients are summed over the micro-batches and handed to
the ZeRO step's reducer once, after the last backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from interop.torch._stage import TorchStage
from interop.torch._units import check_owner, rank_dependent
from ops.device._dlpack import to_native, torch_view
from shard.core._protocol import LossProvider
from shard.monitor._profile import timed

if TYPE_CHECKING:
    import torch

    from ops import Communicator
    from ops._types import Array
    from shard.step._runtime import Units
    from shard.step.reduction._reduce import GradReducer

__all__ = ["TorchLayered", "layered"]


def layered(
    layers: Sequence[torch.nn.Module] | torch.nn.Sequential | torch.nn.ModuleList, *,
    loss: Callable[[object, object], torch.Tensor],
    inputs: Callable[[object], object] | None = None,
) -> tuple[list[dict[str, Array]], TorchLayered]:
    """A chain of torch modules as per-module params and a loss object (see
    [Note: torch layers]).

    Args:
      layers: the modules in order (a list, or an ``nn.Sequential`` /
        ``nn.ModuleList`` whose children are taken); each is one ZeRO unit
        and one pipeline layer. One rank's: thread ranks build or
        ``copy.deepcopy`` their own.
      loss: ``loss(output, batch) -> scalar tensor`` from the last module's
        output.
      inputs: ``inputs(batch)``, the first module's input (default
        ``batch[0]``); numpy arrays become tensors.

    Returns:
      ``(params, loss_object)``: params is a list with one ``{name: array}``
      per module, sharing memory with its parameters.

    Examples:
      >>> import copy, torch, ops, shard, interop.torch as it
      >>> net = [torch.nn.Linear(4, 8), torch.nn.Sequential(torch.nn.Tanh(),
      ...                                                  torch.nn.Linear(8, 1))]
      >>> def run(comm):
      ...     params, loss = it.layered(copy.deepcopy(net),
      ...                               loss=lambda out, b: (out - b[1]).pow(2).mean())
      ...     step = shard.zero3(loss, optimizer=ops.adamw(1e-2), comm=comm)
      ...     state, metrics = step(step.init(params), (torch.ones(2, 4), torch.zeros(2, 1)))
      ...     return metrics["skipped"]
      >>> ops.spawn(run, 2)
      [False, False]
    """
    import torch

    if isinstance(layers, (torch.nn.Sequential, torch.nn.ModuleList)):
        layers = list(layers.children())
    layers = list(layers)
    if not layers:
        raise ValueError("layered: layers is empty")
    owner: dict[int, int] = {}
    named: list[dict[str, torch.nn.Parameter]] = []
    for i, m in enumerate(layers):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"layered: layers[{i}] is a {type(m).__name__}, not a "
                            "torch.nn.Module")
        own = dict(m.named_parameters())
        for name, p in own.items():
            if id(p) in owner:
                raise ValueError(f"layered: layers[{i}].{name} is also a parameter of "
                                 f"layers[{owner[id(p)]}]; a parameter shared between layers "
                                 "is not supported here (interop.torch.functional keeps such "
                                 "ties in its root unit)")
            owner[id(p)] = i
        if not own:
            raise ValueError(f"layered: layers[{i}] ({type(m).__name__}) has no parameters; "
                             "fold parameter-free modules into a neighbour")
        kept = [name for name, _ in m.named_buffers()
                if name.rsplit(".", 1)[-1] not in _non_persistent(m, name)]
        if kept:
            raise ValueError(f"layered: layers[{i}] has state in buffers ({', '.join(kept)}), "
                             "which layered neither syncs across ranks nor checkpoints; train "
                             "it with interop.torch.functional, which does both")
        named.append(own)
    devices = {p.device for own in named for p in own.values()}
    if len(devices) > 1:
        raise ValueError(f"layered: the parameters are on {sorted(map(str, devices))}; move "
                         "every layer to one device first")
    splits = {id(tp): tp for m in layers for sub in m.modules()
              if (tp := getattr(sub, "_zeroshard_tensor_parallel", None)) is not None}
    if len(splits) > 1 or (splits and any(getattr(m, "_zeroshard_tensor_parallel", None)
                                          is None for m in layers)):
        raise ValueError("layered: some layers are split by interop.torch.parallelize and "
                         "others are not, or by different calls; split the list of layers "
                         "with one interop.torch.parallelize(layers, mesh, plan)")
    params = [{name: to_native(p.data)[0] for name, p in own.items()} for own in named]
    out = TorchLayered(layers, loss, inputs, named)
    out.tensor_parallel = next(iter(splits.values()), None)  # see [Note: torch tensor parallelism]
    return params, out


def _non_persistent(module: torch.nn.Module, name: str) -> set[str]:
    """The non-persistent buffer names of the submodule that owns ``name``
    (a causal mask, say: not state, so not refused)."""
    owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    return set(getattr(owner, "_non_persistent_buffers_set", ()))


def _first_input(batch: object) -> object:
    if isinstance(batch, (tuple, list)):
        return batch[0]
    raise TypeError(f"layered: the batch is a {type(batch).__name__}; the first layer takes "
                    "batch[0] of a tuple or list batch, or pass inputs=lambda batch: ...")


class TorchLayered(LossProvider):
    """The loss object :func:`layered` returns: a ``run_units`` loss for the ZeRO
    transforms and a ``make_stage`` for ``shard.pipeline`` (see [Note: the loss
    protocol])."""

    def __init__(self, layers: list[torch.nn.Module],
                 loss: Callable[[object, object], torch.Tensor],
                 inputs: Callable[[object], object] | None,
                 named: list[dict[str, torch.nn.Parameter]]) -> None:
        self.layers, self.loss, self.named = layers, loss, named
        self.inputs = inputs or _first_input
        self.cast_forward_inputs = True  # Precision's, inside a step's call (configured)
        self._rank: int | None = None

    @contextlib.contextmanager
    def configured(self, *, has_aux: bool, cast_forward_inputs: bool) -> Iterator[None]:
        """One step's call: its precision policy's ``cast_forward_inputs`` (the
        first layer casts its floating input to the compute dtype), restored
        after."""
        before, self.cast_forward_inputs = self.cast_forward_inputs, cast_forward_inputs
        try:
            yield
        finally:
            self.cast_forward_inputs = before

    def layout_dependent(self) -> str | None:
        """A layer's running statistics or dropout (see ``rank_dependent``)."""
        return rank_dependent((f"layer {i}{'.' + n if n else ''}", m)
                              for i, layer in enumerate(self.layers)
                              for n, m in layer.named_modules())

    def claim(self, comm: Communicator) -> None:
        """Bind this object to ``comm``'s rank (see ``TorchLoss.claim``)."""
        self._rank = check_owner(self._rank, comm, "interop.torch.layered",
                                 "modules: interop.torch.layered(copy.deepcopy(layers), ...) "
                                 "inside the function each rank runs")

    def make_stage(self, units: Units, layers: Sequence[int], *,
              checkpointing: bool = False) -> TorchStage:
        """The runner of ``layers`` (indices into ``self.layers``; unit ``u`` of
        ``units`` is layer ``layers[u]``) for one step."""
        return TorchStage(self, units, list(layers), checkpointing)

    def run_units(self, units: Units, reducer: GradReducer, batch: object,
                  scale: float) -> torch.Tensor:
        """One micro-batch through every layer (the ZeRO step's unit protocol)."""
        stage = self.make_stage(units, range(len(self.layers)))
        loss = stage.forward(0, None, batch)
        stage.backward(0, scale)
        stage.finish(reducer)
        return loss

    def value_and_grad(
        self, params: list[dict[str, Array]], batch: object, loss_scale: float = 1.0
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """Loss and gradients (of ``loss_scale * loss``) at whole ``params``."""
        import torch

        for own, values in zip(self.named, params, strict=True):
            for name, p in own.items():
                p.data, p.grad = torch_view(values[name]), None
        with timed("forward"):
            dtype = next(iter(self.named[0].values())).dtype
            out = self.loss(self._forward(self._input(batch, dtype)), batch)
        with timed("backward"):
            (out * loss_scale).backward()
        grads = [{name: p.grad if p.grad is not None else torch.zeros_like(p)
                  for name, p in own.items()} for own in self.named]
        for own in self.named:
            for p in own.values():
                p.grad = None
        return out.detach(), grads

    def loss_units(self, units: Units, batch: object) -> torch.Tensor:
        """The loss in eval mode, forward only, unit by unit (``step.evaluate``)."""
        with self.evaluating():
            stage = self.make_stage(units, range(len(self.layers)), checkpointing=True)
            return stage.forward(0, None, batch)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Every module in eval mode (no dropout), then back to its own mode."""
        modes = [m.training for m in self.layers]
        try:
            for m in self.layers:
                m.eval()
            yield
        finally:
            for m, mode in zip(self.layers, modes, strict=True):
                m.train(mode)

    def layer_times(self, batch: object, repeats: int = 3) -> list[float]:
        """Each module's forward and backward time in seconds on ``batch`` (the
        fastest of ``repeats`` after a warm-up run), for
        ``shard.balance_by_time``; the modules' gradients are left cleared."""
        import time

        import torch

        x = self._input(batch)
        times = []
        for m in self.layers:
            runs = []
            for _ in range(repeats + 1):
                h = x.detach().requires_grad_(x.is_floating_point())
                t0 = time.perf_counter()
                out = m(h)
                out.backward(torch.ones_like(out))
                runs.append(time.perf_counter() - t0)
            m.zero_grad(set_to_none=True)
            times.append(min(runs[1:]))  # the run least disturbed by other work
            with torch.no_grad():
                x = m(x)
        return times

    def _forward(self, x: torch.Tensor) -> object:
        for m in self.layers:
            x = m(x)
        return x

    def _input(self, batch: object, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The first layer's input as a tensor on the params' device, floating
        inputs cast to ``dtype`` (the compute dtype) when casting is on."""
        import torch

        x = self.inputs(batch)
        if not isinstance(x, torch.Tensor):
            x = torch_view(to_native(x)[0])
        device = next(iter(self.named[0].values())).device
        x = x.to(device)
        if dtype is not None and self.cast_forward_inputs and x.is_floating_point():
            x = x.to(dtype)
        return x
