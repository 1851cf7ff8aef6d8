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
be one floating tensor.

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

from collections.abc import Callable, Sequence
from typing import Any

from interop._torch_units import _torch_dtype
from ops._dlpack import to_native, torch_view
from shard._profile import timed

__all__ = ["TorchLayered", "layered"]


def layered(layers: Sequence[Any], *, loss: Callable[[Any, Any], Any],
            inputs: Callable[[Any], Any] | None = None) -> tuple[list[dict[str, Any]],
                                                                  TorchLayered]:
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

    Example:
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
    named: list[dict[str, Any]] = []
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
        named.append(own)
    devices = {p.device for own in named for p in own.values()}
    if len(devices) > 1:
        raise ValueError(f"layered: the parameters are on {sorted(map(str, devices))}; move "
                         "every layer to one device first")
    params = [{name: to_native(p.data)[0] for name, p in own.items()} for own in named]
    return params, TorchLayered(layers, loss, inputs, named)


def _first_input(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return batch[0]
    raise TypeError(f"layered: the batch is a {type(batch).__name__}; the first layer takes "
                    "batch[0] of a tuple or list batch, or pass inputs=lambda batch: ...")


class TorchLayered:
    """The loss object :func:`layered` returns: a ``run_units`` loss for the ZeRO
    transforms and a ``stage`` for ``shard.pipeline``."""

    def __init__(self, layers: list[Any], loss: Callable[[Any, Any], Any],
                 inputs: Callable[[Any], Any] | None, named: list[dict[str, Any]]) -> None:
        self.layers, self.loss, self.named = layers, loss, named
        self.inputs = inputs or _first_input
        self.cast_forward_inputs = True  # Precision's; the step sets it
        self._rank: int | None = None

    def claim(self, comm: Any) -> None:
        """Bind this object to ``comm``'s rank (see ``TorchLoss.claim``)."""
        if self._rank is not None and self._rank != comm.rank:
            raise ValueError(
                f"interop.torch.layered: this loss object belongs to rank {self._rank}, and "
                f"rank {comm.rank} uses it too; every rank needs its own modules: "
                "interop.torch.layered(copy.deepcopy(layers), ...) inside the function each "
                "rank runs")
        self._rank = comm.rank

    def stage(self, units: Any, layers: Sequence[int], *,
              checkpointing: bool = False) -> TorchStage:
        """The runner of ``layers`` (indices into ``self.layers``; unit ``u`` of
        ``units`` is layer ``layers[u]``) for one step."""
        return TorchStage(self, units, list(layers), checkpointing)

    def run_units(self, units: Any, reducer: Any, batch: Any, scale: float) -> Any:
        """One micro-batch through every layer (the ZeRO step's unit protocol)."""
        stage = self.stage(units, range(len(self.layers)))
        loss = stage.forward(0, None, batch)
        stage.backward(0, scale)
        stage.finish(reducer)
        return loss

    def value_and_grad(self, params: list[dict[str, Any]], batch: Any,
                       loss_scale: float = 1.0) -> tuple[Any, list[dict[str, Any]]]:
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

    def loss_units(self, units: Any, batch: Any) -> Any:
        """The loss in eval mode, forward only, unit by unit (``step.evaluate``)."""
        modes = [m.training for m in self.layers]
        try:
            for m in self.layers:
                m.eval()
            stage = self.stage(units, range(len(self.layers)), checkpointing=True)
            return stage.forward(0, None, batch)
        finally:
            for m, mode in zip(self.layers, modes, strict=True):
                m.train(mode)

    def layer_times(self, batch: Any, repeats: int = 3) -> list[float]:
        """Each module's forward and backward time in seconds on ``batch`` (the
        median of ``repeats`` after a warm-up run), for
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
            times.append(sorted(runs[1:])[len(runs[1:]) // 2])
            with torch.no_grad():
                x = m(x)
        return times

    def _forward(self, x: Any) -> Any:
        for m in self.layers:
            x = m(x)
        return x

    def _input(self, batch: Any, dtype: Any = None) -> Any:
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


class TorchStage:
    """One step of a run of consecutive layers over micro-batches (see the Note):
    ``forward(k, x, batch)``, ``backward(k, ct)`` in any order a schedule gives,
    then ``finish(reducer)``."""

    def __init__(self, owner: TorchLayered, units: Any, layers: list[int],
                 checkpointing: bool) -> None:
        self.owner, self.units, self.layers = owner, units, layers
        subtrees = units.layout.treedef.children()
        self.params = [subtrees[u].flatten_up_to(owner.named[i]) for u, i in enumerate(layers)]
        self.gathering = units.stage == 3
        self.recompute = checkpointing or self.gathering
        self.first, self.last = layers[0] == 0, layers[-1] == len(owner.layers) - 1
        self.saved: dict[int, Any] = {}
        self.grads: list[list[Any] | None] = [None] * len(layers)
        self.forward_passes = 0
        self.dtype = _torch_dtype(units.local[0].dtype if self.gathering
                                  else units.full[0].dtype)  # the compute dtype
        for u in range(len(layers)):  # stages 0-2: whole params, bound for the step
            if self.gathering:
                self._unbind(u)  # what the module held before (its first step)
            else:
                self._bind(u, units.get(u))

    # -- the schedule's calls -------------------------------------------------------
    def forward(self, k: int, x: Any, batch: Any) -> Any:
        """Micro-batch ``k``'s forward from ``x`` (a received array; None on the
        first stage): the output to send on, or the loss on the last stage."""
        import torch

        x = None if self.first else self._tensor(x)
        n = len(self.layers)
        if not self.recompute:
            if x is not None:
                x.requires_grad_(True)
            h = self._input_of(batch) if self.first else x
            with timed("forward"):
                for u in range(n):
                    h = self._module(u)(h)
                    self.forward_passes += 1
                out = self.owner.loss(h, batch) if self.last else h
            self.saved[k] = (x, out, batch)
            return out.detach() if self.last else self._message(out)
        kept = []
        h = self._input_of(batch) if self.first else x
        with torch.no_grad():
            for u in range(n):
                if self.gathering:
                    self._bind(u, self.units.get(u, range(u + 1, n)))
                kept.append((h, _rng_state(h)))
                with timed("forward"):
                    h = self._module(u)(h)
                self.forward_passes += 1
                if self.gathering:
                    self._unbind(u)
            out = self.owner.loss(h, batch) if self.last else h
        self.saved[k] = (kept, batch)
        return out.detach() if self.last else self._message(out)

    def backward(self, k: int, ct: Any) -> Any:
        """Micro-batch ``k``'s backward from ``ct`` (the loss's cotangent, a
        number, on the last stage; a received array elsewhere): the input's
        gradient to send back, or None on the first stage."""
        import torch

        if not self.recompute:
            x, out, _ = self.saved.pop(k)
            with timed("backward"):
                torch.autograd.backward(out, self._cotangent(ct, out))
            return None if x is None else self._message(x.grad)
        kept, batch = self.saved.pop(k)
        n = len(self.layers)
        g = ct
        for u in reversed(range(n)):
            if self.gathering:
                self._bind(u, self.units.get(u, range(u - 1, -1, -1)))
            h, rng = kept[u]
            h = h.detach()
            if h.is_floating_point() and not (self.first and u == 0):
                h.requires_grad_(True)
            with torch.enable_grad(), _restored(rng), timed("backward"):
                y = self._module(u)(h)
                if self.last and u == n - 1:
                    y = self.owner.loss(y, batch)
                torch.autograd.backward(y, self._cotangent(g, y))
            self.forward_passes += 1
            self._take_grads(u)
            if self.gathering:
                self._unbind(u)
            g = h.grad
        return None if self.first else self._message(g)

    def finish(self, reducer: Any) -> None:
        """Hand each unit's gradients (summed over the micro-batches) to the reducer."""
        for u in reversed(range(len(self.layers))):
            if not self.recompute:
                self._take_grads(u)
            reducer.add(u, self.grads[u])
            self.grads[u] = None

    # -- helpers ------------------------------------------------------------------
    def _module(self, u: int) -> Any:
        return self.owner.layers[self.layers[u]]

    def _input_of(self, batch: Any) -> Any:
        return self.owner._input(batch, self.dtype)

    def _tensor(self, x: Any) -> Any:
        device = self.params[0][0].device
        return torch_view(x).to(device)

    def _message(self, t: Any) -> Any:
        import torch

        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"pipeline: layer {self.layers[-1]} returns "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}"
                            "; a stage passes one floating tensor to the next")
        return t.detach()

    def _cotangent(self, ct: Any, like: Any) -> Any:
        import torch

        if isinstance(ct, (int, float)):
            return torch.tensor(ct, dtype=like.dtype, device=like.device)
        if isinstance(ct, torch.Tensor):
            return ct
        return self._tensor(ct)

    def _take_grads(self, u: int) -> None:
        """Add unit ``u``'s parameter gradients into its sum and clear them."""
        grads = []
        for p in self.params[u]:
            grads.append(p.grad)
            p.grad = None
        acc = self.grads[u]
        self.grads[u] = grads if acc is None else [
            g if a is None else (a if g is None else a + g) for a, g in zip(acc, grads,
                                                                              strict=True)]

    def _bind(self, u: int, leaves: list[Any]) -> None:
        with timed("library"):
            for p, leaf in zip(self.params[u], leaves, strict=True):
                p.data = torch_view(leaf)

    def _unbind(self, u: int) -> None:
        import torch

        with timed("library"):
            for p in self.params[u]:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _rng_state(x: Any) -> Any:
    """The RNG state a unit's forward starts from (CPU, and the GPU's if ``x`` is
    on one), to draw the same dropout masks when it is recomputed."""
    import torch

    cuda = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
    return torch.get_rng_state(), cuda, x.device


class _restored:
    """Run with a saved RNG state, then put the current one back."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def __enter__(self) -> None:
        import torch

        cpu, cuda, device = self.state
        self.before = _rng_state(torch.empty(0, device=device))
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)

    def __exit__(self, *exc: Any) -> None:
        import torch

        cpu, cuda, device = self.before
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
