"""A torch module's buffers and tied names beside its ZeRO state.

[Note: torch buffers]
Buffers (BatchNorm's running statistics, say) are not trained, so they are not
in the params pytree: every rank's module keeps its own. With
``broadcast_buffers=True`` (the default, as DDP's) rank 0's buffers are
broadcast to every rank before each micro-batch's forward, one collective per
dtype, so the ranks agree: what every rank's forward sees, and what a
checkpoint keeps, are rank 0's statistics, as under DDP.

Checkpoints: a state made from a torch module knows its module
(``StateMeta.module_state``), so ``shard.save`` writes rank 0's buffers and the
module's tied parameter names beside the params; ``shard.load`` writes the
buffers back into the step's module; and ``python -m shard.checkpoint
consolidate`` writes params, every tied name and the buffers, which
``load_state_dict(strict=True)`` takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from types import ModuleType

    import torch
    from torch import Tensor
    from torch import dtype as TorchDtype  # in sync(), torch names a local variable

    from ops import Communicator

__all__ = ["ModuleBuffers"]


class ModuleBuffers:
    """The buffers and tied names of the module a ``TorchLoss`` trains (see the
    Note). ``broadcast``: rank 0's buffers to every rank before each forward,
    over ``comm`` once the step's ``init`` has given it (``TorchLoss.claim``)."""

    def __init__(self, module: torch.nn.Module, *, broadcast: bool) -> None:
        self.module, self.broadcast = module, broadcast
        self.comm: Communicator | None = None

    def buffers(self) -> dict[str, torch.Tensor]:
        """The module's persistent buffers by state_dict key (tensors, live)."""
        params = {id(p) for p in self.module.parameters()}
        return {k: v for k, v in self.module.state_dict(keep_vars=True).items()
                if id(v) not in params}

    def tied_names(self) -> dict[str, str]:
        """``{alias: name}`` for every parameter reachable under a second name (a
        head tied to the embedding); params hold it under ``name`` only."""
        canonical = {id(p): n for n, p in self.module.named_parameters()}
        return {n: canonical[id(p)]
                for n, p in self.module.named_parameters(remove_duplicate=False)
                if canonical[id(p)] != n}

    def module_state(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """This rank's buffers as host arrays (copies), and the tied names."""
        out = {}
        for key, buf in self.buffers().items():
            host = buf.detach().to("cpu")
            if host.dtype.is_floating_point and host.dtype not in (_torch().float32,
                                                                   _torch().float64):
                host = host.float()  # numpy has no bfloat16: the checkpoint keeps float32
            out[key] = host.numpy().copy()
        return out, self.tied_names()

    def load(self, values: dict[str, np.ndarray], where: str) -> None:
        """Write a checkpoint's buffers into the module (after checking them all)."""
        mine = self.buffers()
        missing, extra = sorted(set(mine) - set(values)), sorted(set(values) - set(mine))
        if missing or extra:
            raise ValueError(f"{where}: the checkpoint's buffers do not match the module's: "
                             f"missing {missing[:5]}, unexpected {extra[:5]}")
        for key, buf in mine.items():
            if tuple(values[key].shape) != tuple(buf.shape):
                raise ValueError(f"{where}: buffer {key} has shape {tuple(values[key].shape)} "
                                 f"in the checkpoint but {tuple(buf.shape)} in the module")
        torch = _torch()
        with torch.no_grad():
            for key, buf in mine.items():
                buf.copy_(torch.from_numpy(np.array(values[key], order="C")))

    def sync(self) -> None:
        """Rank 0's buffers on every rank (see the Note): one broadcast per dtype."""
        comm = self.comm
        if not self.broadcast or comm is None or comm.world_size == 1:
            return
        import ops

        torch = _torch()
        groups: dict[TorchDtype, list[Tensor]] = {}
        for buf in self.buffers().values():
            if buf.numel():
                groups.setdefault(buf.dtype, []).append(buf)
        with torch.no_grad():
            for dtype, bufs in groups.items():
                flat = torch.cat([b.detach().reshape(-1) for b in bufs])
                if dtype == torch.bool:
                    flat = flat.to(torch.uint8)
                flat = torch.as_tensor(ops.broadcast(comm, flat, src=0))
                offset = 0
                for b in bufs:
                    n = b.numel()
                    b.copy_(flat[offset:offset + n].reshape(b.shape).to(b.device, dtype))
                    offset += n


def _torch() -> ModuleType:
    import torch

    return torch
