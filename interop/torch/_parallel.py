"""Tensor parallelism on a torch module by module name: :func:`parallelize`.

[Note: torch tensor parallelism]
``parallelize(model, mesh, plan)`` does what torch's ``parallelize_module``
does with ``ColwiseParallel`` / ``RowwiseParallel``, and Hugging Face's
``tp_plan``, without DTensor: each planned module keeps this model rank's
slice of its weights (as plain parameters, so :func:`functional` and the ZeRO
transforms see ordinary tensors) and runs Megatron's conjugate collectives
around its own computation (see [Note: tensor-parallel collectives] in
``shard/tensor_parallel/_megatron.py``), as torch autograd functions:

=========================  ==================  =============================
style                      weight split        forward
=========================  ==================  =============================
``colwise``                out features        ``f(x) @ W_r^T + b_r``
``colwise_gather_output``  out features        the above, all-gathered
``packed_colwise``         out features, each  ``f(x) @ W_r^T + b_r``
                           packed block
``rowwise``                in features         ``g(x_r @ W_r^T) + b``
``embedding_rowwise``      vocabulary rows     ``g(lookup of the ids held)``
=========================  ==================  =============================

(f: identity forward, all-reduce backward; g: the reverse; each collective on
the model ranks' communicator, which takes the module's tensors as they are:
CPU tensors on threads and gloo, GPU tensors through DLPack on NCCL.) The plan maps
``fnmatch`` patterns of module names to styles, as Hugging Face writes them
(``{"model.layers.*.self_attn.q_proj": "colwise", ...}``); a model's own
``_tp_plan`` is the default. ``packed_colwise`` is for a fused projection whose
out features are equal blocks end to end (a fused gate-up projection: two, as
Hugging Face's style; a fused query-key-value projection: write
``("packed_colwise", 3)``): each block is split on its own, so a rank's output
is its part of every block, in order (see [Note: packed splits] in
``shard/core/_specs.py``); the module's forward takes it apart as before if it
splits by thirds and counts heads from the width it gets (``chunk(3, -1)``,
``view(b, t, -1, head_dim)``). A weight tied between two planned modules (an
embedding shared with the output head) is sliced once and stays tied, which
needs the two styles to split it along the same dimension (they do for
``embedding_rowwise`` and ``colwise_gather_output``).

The module's parameters are its slices from then on: ``functional`` gives
those, and a step built on the mesh keeps them as they are at ``init``. A
list of modules (``interop.torch.layered``'s layers, a pipeline's stages) is
split by one call, with one plan whose patterns name modules
inside a layer; the specs are then one dict per layer. ``layered`` refuses
layers split apart from one another (a model split whole and cut into layers
afterwards has layers the plan never saw, such as a new output head).
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ops import Communicator
from shard import Mesh, Packed, TensorParallel
from shard.core._specs import Split, take_split

if TYPE_CHECKING:
    import torch
    from jax.sharding import PartitionSpec
    from torch.autograd.function import FunctionCtx

    from ops._types import Array

__all__ = ["STYLES", "parallelize"]

STYLES = ("colwise", "colwise_gather_output", "packed_colwise", "rowwise", "embedding_rowwise")
_ALIASES = {"colwise_rep": "colwise_gather_output"}


def _style(pattern: str, entry: str | tuple[str, int]) -> tuple[str, int]:
    """A plan entry as (style, packed blocks)."""
    style, blocks = entry if isinstance(entry, tuple) and len(entry) == 2 else (entry, None)
    style = _ALIASES.get(style, style)
    if style not in STYLES:
        raise ValueError(f"parallelize: plan[{pattern!r}] is {entry!r}; the styles are "
                         f"{list(STYLES)}, and ('packed_colwise', blocks)")
    if blocks is not None and style != "packed_colwise":
        raise ValueError(f"parallelize: plan[{pattern!r}] is {entry!r}; only 'packed_colwise' "
                         "takes a number of blocks")
    if blocks is None:
        blocks = 2 if style == "packed_colwise" else 1
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"parallelize: plan[{pattern!r}] packs {blocks!r} blocks; give an "
                         "int >= 1")
    return style, blocks


def _flat(comm: Communicator, t: torch.Tensor) -> Array:
    """A flat view of the contiguous tensor ``t`` for ``comm``: numpy for a host
    backend, the communicator's device array for NCCL (zero-copy, DLPack)."""
    import torch

    t = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).view(-1)  # bf16's bits
    return t.numpy() if comm.host_memory is not False else comm.device.asarray(t)


def _reduced(comm: Communicator, t: torch.Tensor) -> torch.Tensor:
    """The sum of every model rank's ``t`` (16-bit in float32)."""
    import torch

    wide = t.detach().to(torch.float32 if t.dtype in (torch.float16, torch.bfloat16)
                         else t.dtype).contiguous().clone()
    comm.all_reduce_(_flat(comm, wide), "sum")
    return wide.to(t.dtype)


def _gathered(comm: Communicator, t: torch.Tensor) -> torch.Tensor:
    """Every model rank's ``t`` concatenated along the last dimension."""
    import torch

    x = t.detach().contiguous()
    out = torch.empty((comm.world_size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather_into(_flat(comm, out), _flat(comm, x))
    # (T, ..., n) -> (..., T, n) -> (..., T n): one copy, in runs of n elements
    return out.movedim(0, -2).reshape(*x.shape[:-1], comm.world_size * x.shape[-1])


def _functions() -> tuple[type[torch.autograd.Function], type[torch.autograd.Function],
                          type[torch.autograd.Function]]:
    import torch

    class Copy(torch.autograd.Function):  # f
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
            ctx.comm = comm
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            return _reduced(ctx.comm, g), None

    class Reduce(torch.autograd.Function):  # g
        @staticmethod
        def forward(ctx: FunctionCtx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
            return _reduced(comm, x)

        @staticmethod
        def backward(ctx: FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            return g, None

    class Gather(torch.autograd.Function):  # all-gather forward, own slice backward
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
            ctx.comm, ctx.n = comm, x.shape[-1]
            return _gathered(comm, x)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            r = ctx.comm.rank
            return g[..., r * ctx.n:(r + 1) * ctx.n].contiguous(), None

    return Copy, Reduce, Gather


def parallelize(module: Any, mesh: Mesh | Communicator,
                plan: Mapping[str, str | tuple[str, int]] | None = None,
                *, axis: str = "model") -> TensorParallel:
    """Split ``module``'s planned layers over the model ranks, in place (see
    [Note: torch tensor parallelism]).

    Args:
      module: this rank's ``torch.nn.Module`` (thread ranks: each its own
        copy), with the whole weights (the same on every rank), where the
        model ranks' communicator moves tensors (the CPU for threads and gloo,
        the GPU for NCCL); or a
        list of modules, ``interop.torch.layered``'s layers (each pattern then
        names modules within a layer, and must match in one of them at least).
      mesh: a :class:`shard.Mesh` with axis ``axis``, or the model ranks'
        communicator.
      plan: ``{module name pattern: style}`` (styles: ``colwise``,
        ``colwise_gather_output``, ``packed_colwise`` or ``("packed_colwise",
        blocks)``, ``rowwise``, ``embedding_rowwise``); default: the model's
        Hugging Face ``_tp_plan``.

    Returns:
      The :class:`shard.TensorParallel` (the step reads it from the loss), with a
      spec per parameter name (for a list: a list of those, one per
      layer, which also fits a pipeline stage's layers).

    Example::

        mesh = shard.Mesh(comm, {"data": 2, "model": 2})
        tp = interop.torch.parallelize(model, mesh)  # a Hugging Face model's own plan
        params, loss = interop.torch.functional(model, loss=lambda m, b: m(**b).loss)
        step = shard.zero3(loss, optimizer=ops.adamw(1e-3), mesh=mesh)
        state = step.init(params)
    """
    import torch

    layers = isinstance(module, (list, tuple))
    modules = list(module) if layers else [module]
    tp = TensorParallel(mesh, axis=axis)
    model = tp.comm
    if model is None:
        raise TypeError("parallelize: mesh must be a shard.Mesh with a 'model' axis or an "
                        f"ops.Communicator; got {mesh!r} (a number of ranks describes a split "
                        "without running one)")
    _check_modules(modules, layers, model)
    if plan is None:
        plan = _default_plan(module, layers)
    styles = {pattern: _style(pattern, entry) for pattern, entry in plan.items()}
    rank, size = tp.rank, tp.size
    Copy, Reduce, Gather = _functions()
    cut = _Splitter(rank, size)
    matched: set[str] = set()  # patterns
    for i, m in enumerate(modules):
        for name, sub in m.named_modules():
            pattern = next((pat for pat in styles if fnmatch.fnmatchcase(name, pat)), None)
            if pattern is None:
                continue
            matched.add(pattern)
            style, blocks = styles[pattern]
            where = f"layers[{i}].{name}" if layers else name
            want = torch.nn.Embedding if style == "embedding_rowwise" else torch.nn.Linear
            if type(sub) is not want:
                raise TypeError(f"parallelize: {where} is a {type(sub).__name__}; style "
                                f"{style!r} takes a torch.nn.{want.__name__}")
            if style == "rowwise":
                cut(sub, "weight", where, Split(1))
            else:
                cut(sub, "weight", where, Split(0, blocks))
                if style != "embedding_rowwise" and sub.bias is not None:
                    cut(sub, "bias", where, Split(0, blocks))
            setattr(sub, "forward", types.MethodType(  # noqa: B010 (a module's own forward)
                _forward(style, model, rank, Copy, Reduce, Gather), sub))
            setattr(sub, "_zeroshard_tensor_parallel", tp)  # noqa: B010
    unused = [p for p in styles if p not in matched]
    if unused:
        of = "the layers" if layers else type(module).__name__
        raise ValueError(f"parallelize: plan pattern {unused[0]!r} matches no module of {of}")
    how = {id(part): s for s, part in cut.split.values()}
    specs = [{pname: _spec(how.get(id(p)), axis) for pname, p in m.named_parameters()}
             for m in modules]
    tp.specs = specs if layers else specs[0]
    for m in modules:
        m._zeroshard_tensor_parallel = tp
    return tp


def _check_modules(modules: list[Any], layers: bool, model: Communicator) -> None:
    """Each module a torch module, not split yet, with its parameters where the
    model ranks' communicator moves tensors."""
    import torch

    place = "cpu" if model.host_memory is not False else model.device.torch_device
    for i, m in enumerate(modules):
        where = f"layers[{i}]" if layers else "module"
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"parallelize: {where} is a {type(m).__name__}, not a "
                            "torch.nn.Module")
        if getattr(m, "_zeroshard_tensor_parallel", None) is not None:
            raise ValueError(f"parallelize: this {where} is split already")
        if any(p.device.type != place for p in m.parameters()):
            raise ValueError(f"parallelize: the {where}'s parameters are on "
                             f"{sorted({p.device.type for p in m.parameters()})}; the model "
                             f"ranks' {model.backend} communicator moves {place} tensors")


def _default_plan(module: Any, layers: bool) -> Mapping[str, str | tuple[str, int]]:
    """A Hugging Face model's own ``_tp_plan``; an error naming what to give otherwise."""
    plan = None if layers else getattr(module, "_tp_plan", None)
    if not plan:
        what = "a list of layers" if layers else f"{type(module).__name__} has no Hugging " \
            "Face _tp_plan"
        raise ValueError(f"parallelize: {what}; give plan={{'*.q_proj': 'colwise', ...}}")
    return plan


class _Splitter:
    """Replaces a module's parameter by this model rank's slice of it (a
    parameter tied to one sliced already takes the same slice)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        # id(whole parameter) -> (split, slice)
        self.split: dict[int, tuple[Split, torch.nn.Parameter]] = {}

    def __call__(self, owner: torch.nn.Module, name: str, where: str, how: Split) -> None:
        import torch

        p = getattr(owner, name)
        if id(p) in self.split:  # tied: sliced once
            if self.split[id(p)][0] != how:
                raise ValueError(f"parallelize: {where}.{name} is tied to a weight split "
                                 f"{self.split[id(p)][0]}; its style splits {how}")
            setattr(owner, name, self.split[id(p)][1])
            return
        dim, blocks = how
        if p.shape[dim] % (blocks * self.size):
            each = f" in each of {blocks} packed blocks" if blocks > 1 else ""
            raise ValueError(f"parallelize: {where}.{name} has {p.shape[dim] // blocks} along "
                             f"dimension {dim}{each}, which does not divide over {self.size} "
                             "model ranks")
        part = torch.nn.Parameter(take_split(p.detach(), how, self.rank, self.size).clone(),
                                  requires_grad=p.requires_grad)
        self.split[id(p)] = (how, part)
        setattr(owner, name, part)


def _spec(how: Split | None, axis: str) -> PartitionSpec | Packed | None:
    from jax.sharding import PartitionSpec as P

    if how is None:
        return None
    spec = P(*([None] * how.dim), axis)
    return spec if how.blocks == 1 else Packed(spec, how.blocks)


def _forward(style: str, comm: Communicator, rank: int, Copy: type[torch.autograd.Function],
             Reduce: type[torch.autograd.Function],
             Gather: type[torch.autograd.Function]) -> Callable[..., torch.Tensor]:
    import torch.nn.functional as F

    if style in ("colwise", "colwise_gather_output", "packed_colwise"):
        gather = style == "colwise_gather_output"

        def colwise(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
            y = F.linear(Copy.apply(x, comm), self.weight, self.bias)
            return Gather.apply(y, comm) if gather else y
        return colwise
    if style == "rowwise":
        def rowwise(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
            y = Reduce.apply(F.linear(x, self.weight), comm)
            return y if self.bias is None else y + self.bias
        return rowwise

    def embedding(self: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        n = self.weight.shape[0]
        local = ids - rank * n
        inside = (local >= 0) & (local < n)
        pad = self.padding_idx
        pad = pad - rank * n if pad is not None and 0 <= pad - rank * n < n else None
        rows = F.embedding(local.clamp(0, n - 1), self.weight, pad, self.max_norm,
                           self.norm_type, self.scale_grad_by_freq, self.sparse)
        return Reduce.apply(rows * inside.unsqueeze(-1).to(rows.dtype), comm)
    return embedding

