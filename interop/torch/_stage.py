"""One pipeline stage (or a whole unpipelined model) of torch modules over a
step's micro-batches: the runner behind [Note: torch layers]
(``interop/torch/_layers.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from interop.torch._units import torch_dtype
from ops.device._dlpack import torch_view
from shard.monitor._profile import timed

if TYPE_CHECKING:
    import torch

    from interop.torch._layers import TorchLayered
    from ops._types import Array

__all__ = ["TorchStage"]


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
        self.grads: list[list[torch.Tensor | None] | None] = [None] * len(layers)
        self.forward_passes = 0
        self.dtype = torch_dtype(units.local[0].dtype if self.gathering
                                  else units.full[0].dtype)  # the compute dtype
        for u in range(len(layers)):  # stages 0-2: whole params, bound for the step
            if self.gathering:
                self._unbind(u)  # what the module held before (its first step)
            else:
                self._bind(u, units.get(u))

    # -- the schedule's calls -------------------------------------------------------
    def forward(self, k: int, x: Any, batch: object) -> torch.Tensor:
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

    def backward(self, k: int, ct: float | Array) -> torch.Tensor | None:
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
        g: float | Array | torch.Tensor | None = ct
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
    def _module(self, u: int) -> torch.nn.Module:
        return self.owner.layers[self.layers[u]]

    def _input_of(self, batch: object) -> torch.Tensor:
        return self.owner._input(batch, self.dtype)

    def _tensor(self, x: Array) -> torch.Tensor:
        device = self.params[0][0].device
        return torch_view(x).to(device)

    def _message(self, t: object) -> torch.Tensor:
        import torch

        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"pipeline: layer {self.layers[-1]} returns "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}"
                            "; a stage passes one floating tensor to the next")
        return t.detach()

    def _cotangent(self, ct: Any, like: torch.Tensor) -> torch.Tensor:
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

    def _bind(self, u: int, leaves: list[Array]) -> None:
        with timed("library"):
            for p, leaf in zip(self.params[u], leaves, strict=True):
                p.data = torch_view(leaf)

    def _unbind(self, u: int) -> None:
        import torch

        with timed("library"):
            for p in self.params[u]:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _rng_state(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.device]:
    """The RNG state a unit's forward starts from (CPU, and the GPU's if ``x`` is
    on one), to draw the same dropout masks when it is recomputed."""
    import torch

    cuda = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
    return torch.get_rng_state(), cuda, x.device


class _restored:
    """Run with a saved RNG state, then put the current one back."""

    def __init__(self, state: tuple[torch.Tensor, torch.Tensor | None, torch.device]) -> None:
        self.state = state

    def __enter__(self) -> None:
        import torch

        cpu, cuda, device = self.state
        self.before = _rng_state(torch.empty(0, device=device))
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)

    def __exit__(self, *exc: object) -> None:
        import torch

        cpu, cuda, device = self.before
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
