"""Tensor parallelism on a torch module by module name: :func:`parallelize`.

[Note: torch tensor parallelism]
``parallelize(model, mesh, plan)`` does what torch's ``parallelize_module``
does with ``ColwiseParallel`` / ``RowwiseParallel``, and Hugging Face's
``tp_plan``, without DTensor: each planned module keeps this model rank's
slice of its weights (as plain parameters, so :func:`functional` and the ZeRO
transforms see ordinary tensors) and runs Megatron's conjugate collectives
around its own computation (see [Note: tensor-parallel collectives] in
``shard/tensor_parallel/_jax.py``), as torch autograd functions:

=========================  ==================  =============================
style                      weight split        forward
=========================  ==================  =============================
``colwise``                out features        ``f(x) @ W_r^T + b_r``
``colwise_gather_output``  out features        the above, all-gathered
``rowwise``                in features         ``g(x_r @ W_r^T) + b``
``embedding_rowwise``      vocabulary rows     ``g(lookup of the ids held)``
=========================  ==================  =============================

(f: identity forward, all-reduce backward; g: the reverse.) The plan maps
``fnmatch`` patterns of module names to styles, as Hugging Face writes them
(``{"model.layers.*.self_attn.q_proj": "colwise", ...}``); a model's own
``_tp_plan`` is the default. A weight tied between two planned modules (an
embedding shared with the output head) is sliced once and stays tied, which
needs the two styles to split it along the same dimension (they do for
``embedding_rowwise`` and ``colwise_gather_output``).

The module's parameters are its slices from then on: ``functional`` gives
those, and a step built with ``tensor_parallel=`` keeps them as they are at
``init``.
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Mapping
from typing import Any

from ops import Communicator
from shard import Mesh, TensorParallel

__all__ = ["STYLES", "parallelize"]

STYLES = ("colwise", "colwise_gather_output", "rowwise", "embedding_rowwise")
_ALIASES = {"colwise_rep": "colwise_gather_output"}


def _reduced(comm: Communicator, t: Any) -> Any:
    """The sum of every model rank's ``t`` (host memory; 16-bit in float32)."""
    import torch

    wide = t.detach().to(torch.float32 if t.dtype in (torch.float16, torch.bfloat16)
                         else t.dtype).contiguous().clone()
    comm.all_reduce_(wide.numpy().reshape(-1), "sum")
    return wide.to(t.dtype)


def _gathered(comm: Communicator, t: Any) -> Any:
    """Every model rank's ``t`` concatenated along the last dimension."""
    import torch

    x = t.detach().contiguous()
    out = torch.empty((comm.world_size, *x.shape), dtype=x.dtype)

    def flat(a: Any) -> Any:  # numpy has no bfloat16: its bits move as int16
        return (a.view(torch.int16) if a.dtype == torch.bfloat16 else a).view(-1).numpy()

    comm.all_gather_into(flat(out), flat(x))
    # (T, ..., n) -> (..., T, n) -> (..., T n): one copy, in runs of n elements
    return out.movedim(0, -2).reshape(*x.shape[:-1], comm.world_size * x.shape[-1])


def _functions() -> tuple[Any, Any, Any]:
    import torch

    class Copy(torch.autograd.Function):  # f
        @staticmethod
        def forward(ctx: Any, x: Any, comm: Communicator) -> Any:
            ctx.comm = comm
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return _reduced(ctx.comm, g), None

    class Reduce(torch.autograd.Function):  # g
        @staticmethod
        def forward(ctx: Any, x: Any, comm: Communicator) -> Any:
            return _reduced(comm, x)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g, None

    class Gather(torch.autograd.Function):  # all-gather forward, own slice backward
        @staticmethod
        def forward(ctx: Any, x: Any, comm: Communicator) -> Any:
            ctx.comm, ctx.n = comm, x.shape[-1]
            return _gathered(comm, x)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            r = ctx.comm.rank
            return g[..., r * ctx.n:(r + 1) * ctx.n].contiguous(), None

    return Copy, Reduce, Gather


def parallelize(module: Any, mesh: Mesh | Communicator, plan: Mapping[str, str] | None = None,
                *, axis: str = "model") -> TensorParallel:
    """Split ``module``'s planned layers over the model ranks, in place (see
    [Note: torch tensor parallelism]).

    Args:
      module: this rank's ``torch.nn.Module`` on the CPU (thread ranks: each
        its own copy), with the whole weights (the same on every rank).
      mesh: a :class:`shard.Mesh` with axis ``axis``, or the model ranks'
        communicator.
      plan: ``{module name pattern: style}`` (styles: ``colwise``,
        ``colwise_gather_output``, ``rowwise``, ``embedding_rowwise``);
        default: the model's Hugging Face ``_tp_plan``.

    Returns:
      The :class:`shard.TensorParallel` for the step's ``tensor_parallel=``,
      with a spec per parameter name.

    Example::

        mesh = shard.Mesh(comm, {"data": 2, "model": 2})
        tp = interop.torch.parallelize(model, mesh)  # a Hugging Face model's own plan
        params, loss = interop.torch.functional(model, loss=lambda m, b: m(**b).loss)
        step = shard.zero3(loss, optimizer=ops.adamw(1e-3), comm=mesh["data"],
                           tensor_parallel=tp)
        state = step.init(params)
    """
    import torch
    from jax.sharding import PartitionSpec as P

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"parallelize: expected a torch.nn.Module; got {type(module).__name__}")
    if getattr(module, "_zeroshard_tensor_parallel", None) is not None:
        raise ValueError("parallelize: this module is split already")
    if plan is None:
        plan = getattr(module, "_tp_plan", None)
        if not plan:
            raise ValueError(f"parallelize: {type(module).__name__} has no Hugging Face "
                             "_tp_plan; give plan={'*.q_proj': 'colwise', ...}")
    if any(p.device.type != "cpu" for p in module.parameters()):
        raise NotImplementedError("parallelize: tensor parallelism runs torch modules on the "
                                  "CPU (its collectives are host collectives)")
    styles = {}
    for pattern, style in plan.items():
        style = _ALIASES.get(style, style)
        if style not in STYLES:
            raise ValueError(f"parallelize: plan[{pattern!r}] is {style!r}; the styles are "
                             f"{list(STYLES)}")
        styles[pattern] = style
    tp = TensorParallel(mesh, axis=axis)
    comm, rank, size = tp.comm, tp.rank, tp.size
    Copy, Reduce, Gather = _functions()
    split: dict[int, tuple[int, Any]] = {}  # id(whole parameter) -> (dim, slice parameter)
    dims: dict[str, int] = {}
    matched = set()

    def cut(owner: Any, name: str, where: str, dim: int) -> None:
        p = getattr(owner, name)
        if id(p) in split:  # tied: sliced once
            if split[id(p)][0] != dim:
                raise ValueError(f"parallelize: {where}.{name} is tied to a weight split along "
                                 f"dimension {split[id(p)][0]}; its style splits {dim}")
            setattr(owner, name, split[id(p)][1])
            return
        if p.shape[dim] % size:
            raise ValueError(f"parallelize: {where}.{name} has {p.shape[dim]} along dimension "
                             f"{dim}, which does not divide over {size} model ranks")
        n = p.shape[dim] // size
        part = torch.nn.Parameter(p.detach().narrow(dim, rank * n, n).clone(),
                                  requires_grad=p.requires_grad)
        split[id(p)] = (dim, part)
        setattr(owner, name, part)

    for name, sub in module.named_modules():
        style = next((s for pat, s in styles.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is None:
            continue
        matched.add(name)
        want = torch.nn.Embedding if style == "embedding_rowwise" else torch.nn.Linear
        if type(sub) is not want:
            raise TypeError(f"parallelize: {name} is a {type(sub).__name__}; style {style!r} "
                            f"takes a torch.nn.{want.__name__}")
        if style == "rowwise":
            cut(sub, "weight", name, 1)
        else:
            cut(sub, "weight", name, 0)
            if style != "embedding_rowwise" and sub.bias is not None:
                cut(sub, "bias", name, 0)
        sub.forward = types.MethodType(_forward(style, comm, rank, Copy, Reduce, Gather), sub)
    unused = [p for p in styles if not any(fnmatch.fnmatchcase(m, p) for m in matched)]
    if unused:
        raise ValueError(f"parallelize: plan pattern {unused[0]!r} matches no module of "
                         f"{type(module).__name__}")
    for pname, p in module.named_parameters():
        for d, part in split.values():
            if p is part:
                dims[pname] = d
    specs = {pname: (P(*([None] * dims[pname]), axis) if pname in dims else None)
             for pname, _ in module.named_parameters()}
    tp.specs = specs
    module._zeroshard_tensor_parallel = tp
    return tp


def _forward(style: str, comm: Communicator, rank: int, Copy: Any, Reduce: Any,
             Gather: Any) -> Any:
    import torch.nn.functional as F

    if style in ("colwise", "colwise_gather_output"):
        gather = style == "colwise_gather_output"

        def colwise(self: Any, x: Any) -> Any:
            y = F.linear(Copy.apply(x, comm), self.weight, self.bias)
            return Gather.apply(y, comm) if gather else y
        return colwise
    if style == "rowwise":
        def rowwise(self: Any, x: Any) -> Any:
            y = Reduce.apply(F.linear(x, self.weight), comm)
            return y if self.bias is None else y + self.bias
        return rowwise

    def embedding(self: Any, ids: Any) -> Any:
        n = self.weight.shape[0]
        local = ids - rank * n
        inside = (local >= 0) & (local < n)
        pad = self.padding_idx
        pad = pad - rank * n if pad is not None and 0 <= pad - rank * n < n else None
        rows = F.embedding(local.clamp(0, n - 1), self.weight, pad, self.max_norm,
                           self.norm_type, self.scale_grad_by_freq, self.sparse)
        return Reduce.apply(rows * inside.unsqueeze(-1).to(rows.dtype), comm)
    return embedding

