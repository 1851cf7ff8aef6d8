"""Driving a torch module unit by unit: the hooks behind [Note: torch ZeRO-3].

:class:`UnitHooks`, which ``interop.torch.TorchLoss`` holds, runs one
micro-batch with each unit's params bound only while needed: the wrapped unit
forwards, the saved-tensor hooks that keep references instead of gathered
params, the gradient hooks that re-gather a unit for its backward and hand its
gradients to the reducer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from interop.torch._unit_state import _ParamRef, _Persistent, _Plan, _Step
from ops.device._dlpack import torch_view
from shard.monitor._profile import timed

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch.utils.hooks import RemovableHandle

    from ops import Communicator
    from ops._types import Array
    from shard.step._runtime import Units
    from shard.step.reduction._reduce import GradReducer

__all__ = ["ROOT", "UnitHooks", "check_owner", "rank_dependent", "torch_dtype"]

ROOT = "<root>"


def check_owner(owner: int | None, comm: Communicator, name: str, remedy: str) -> int:
    """The rank a torch loss object serves, once ``comm``'s rank claims it: a
    module is one rank's, so thread ranks sharing one object are refused before
    they train on each other's parameters."""
    if owner is not None and owner != comm.rank:
        raise ValueError(f"{name}: this loss object belongs to rank {owner}, and rank "
                         f"{comm.rank} uses it too; every rank needs its own {remedy}")
    return comm.rank


class UnitHooks:
    """The hooks that bind a module's parameters unit by unit (see [Note: torch
    ZeRO-3]).

    Args:
      module: the root module.
      named: its parameters by name (the params' keys).
      unit_of: each parameter's unit key.
      unit_modules: ``(unit key, module)`` in forward order.
      dtype: the parameters' own torch dtype (what an unbound parameter holds
        after a step in another compute dtype; see [Note: torch dtypes]).
      activation_checkpointing: recompute each unit's forward in the backward.
    """

    def __init__(self, module: torch.nn.Module, named: dict[str, torch.nn.Parameter],
                 unit_of: dict[str, str], unit_modules: list[tuple[str, torch.nn.Module]], *,
                 dtype: torch.dtype,
                 activation_checkpointing: bool) -> None:
        self.module, self.named, self.unit_of = module, named, unit_of
        self.unit_modules, self.dtype = unit_modules, dtype
        self.activation_checkpointing = activation_checkpointing
        self.active: _Step | None = None  # set while run runs
        # whether the last run left the module's parameters unbound (stage 3's
        # gathered units) or in another dtype than their own
        self.unbound = False
        # the leaves (indices in the layout's order) of the trainable parameters that got no
        # gradient in the last micro-batch (see [Note: missing gradients])
        self.missing: frozenset[int] = frozenset()
        self._installed = False
        self._plan_cache: _Plan | None = None
        self._empties: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._kept: dict[int, _Persistent] = {}  # units bound to the state's own buffers
        self._grad_hooks: list[RemovableHandle] = []  # see _track_grads

    # The micro-batch running now, as the hooks read it (they run inside run
    # alone): a plain attribute, read per saved tensor in the backward.
    _current: _Step

    @property
    def current(self) -> _Step:
        """The micro-batch running now (inside :meth:`run`)."""
        return self._current

    def run(self, units: Units, reducer: GradReducer,
            loss: Callable[[], tuple[torch.Tensor, object]], loss_scale: float, *,
            other_dtype: bool) -> tuple[torch.Tensor, Any]:
        """One micro-batch, unit by unit (see [Note: torch ZeRO-3]): ``loss()``'s
        ``(loss, aux)``. Where the state's own buffers are the whole params
        (stages 0-2, and stage 3 on one rank) they stay bound, and each unit's
        gradients still go to the reducer as soon as they are complete, so
        their reduction overlaps the backward. ``other_dtype``: the step
        computes in another dtype than the parameters' own."""
        plan = self._plan(units)
        self.active = self._current = a = _Step(units, reducer, plan)
        index, members = a.index, a.members
        a.gathering = not units.persistent
        self._track_grads(True)  # which parameters got a gradient (see [Note: missing gradients])
        root = index.get(ROOT)
        try:
            if not a.gathering:
                for u in members:
                    self._bind_persistent(u)
            elif root is not None:
                self._bind(root, units.flat(root, pinned=True))
            with timed("forward"):
                out, aux = loss()
            a.phase = "backward"
            a.kept = None
            with timed("backward"):
                (out * loss_scale).backward()
            missing = []  # trainable parameters the loss did not use: no gradient
            for u, names in a.pending.items():  # units not reduced yet: those, or frozen ones
                if u not in a.reduced:
                    missing += [a.leaf_index[name] for name in names]
                    self._reduce(u)
            self.missing = frozenset(missing)
        finally:
            for pairs in a.empties.values():
                for p, empty in pairs:
                    if a.gathering:  # the module keeps the state's buffers otherwise
                        p.data = empty
                    elif other_dtype:  # see [Note: torch dtypes]
                        p.data = self.empty(p, self.dtype)
                    p.grad = None
            self.active = None
            del self._current  # holds the step's units and reducer
            self.unbound = a.gathering or other_dtype
        return out, aux

    def _plan(self, units: Units) -> _Plan:
        """What a step needs to know of the units: worked out once per layout."""
        cached = self._plan_cache
        if cached is None or cached.layout is not units.layout:
            cached = self._plan_cache = _Plan(self, units.layout, units.full_layout)
        return cached

    def install(self, before_forward: Callable[..., object]) -> None:
        """Wrap each unit's forward, and hook ``before_forward`` before the
        root module's (once)."""
        if self._installed:
            return
        for key, m in self.unit_modules:
            if not any(self.unit_of.get(n) == key for n in self.named):
                continue
            forward = m.forward

            def wrapped(*args: object, _key: str = key,
                        _forward: Callable[..., object] = forward, **kw: Any) -> object:
                if self.active is None or not self.active.gathering:
                    return _forward(*args, **kw)
                if self.activation_checkpointing:
                    from torch.utils.checkpoint import checkpoint

                    return checkpoint(self._run_recomputed, _key, _forward, *args,
                                      use_reentrant=False, **kw)
                return self._run_unit(_key, _forward, *args, **kw)

            m.forward = wrapped
        self.module.register_forward_pre_hook(before_forward, with_kwargs=True)
        self._installed = True

    def _track_grads(self, on: bool) -> None:
        """Install (or remove) the per-parameter hooks that hand each unit's
        gradients over as soon as they are complete. Needed where that starts
        work (a reduction, or the overlapped offload's update) or frees the
        unit; on one rank with nothing to start, the gradients are handed over
        after the backward and autograd calls no hook per parameter."""
        if on == bool(self._grad_hooks):
            return
        if on:
            self._grad_hooks = [p.register_post_accumulate_grad_hook(self._grad_hook(name))
                                for name, p in self.named.items() if p.requires_grad]
        else:
            for handle in self._grad_hooks:
                handle.remove()
            self._grad_hooks = []

    def _gather(self, u: int) -> None:
        """Gather and bind unit ``u``, starting the gather of the unit after it in
        this phase's order."""
        a = self._current
        pos = a.order.index(u)
        upcoming = a.order[pos + 1:] if a.phase == "forward" else a.order[:pos][::-1]
        self._bind(u, a.units.flat(u, upcoming))

    def _run_unit(self, key: str, forward: Callable[..., object], *args: object,
                  **kw: object) -> object:
        """A unit's forward with its gathered params saved for the backward as
        references, not tensors (see the Note)."""
        import torch

        a = self._current
        u = a.index[key]
        if a.kept is not None and a.kept != u:
            self._unbind(a.kept)  # before this unit's copy-out: the two-unit bound
        a.kept = u
        if u not in a.bound:
            self._gather(u)
        base = a.bound[u]
        ptr, dtype, start = base.untyped_storage().data_ptr(), base.dtype, base.storage_offset()

        def pack(t: torch.Tensor) -> torch.Tensor | _ParamRef:
            if t.dtype is not dtype or not t.numel() or t.untyped_storage().data_ptr() != ptr:
                return t
            return _ParamRef((u, tuple(t.shape), t.stride(), t.storage_offset() - start))

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            with timed("forward"):
                out = forward(*args, **kw)
        # Stays bound until the next unit starts: the last unit of the forward is
        # the first of the backward, and is not gathered twice in a row.
        hooked = [t for t in _tensors(out) if t.requires_grad]
        if hooked:
            torch.autograd.graph.register_multi_grad_hook(
                hooked, lambda _grads, u=u: self._before_backward(u), mode="any")
        return out

    def _unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is not _ParamRef:
            return saved
        a = self._current
        u, shape, stride, offset = saved
        if u not in a.bound:  # not announced by its outputs' gradient hook
            self._gather(u)
        base = a.bound[u]
        return base.as_strided(shape, stride, base.storage_offset() + offset)

    def _before_backward(self, u: int) -> None:
        """The gradient reached unit ``u``'s outputs: gather it for its backward."""
        a = self.active
        if a is None:
            return
        if a.with_frozen:  # units with frozen params later in the forward are done with
            pos = a.order.index(u)
            for v, at in a.with_frozen:
                if at > pos:
                    a.past.add(v)
                    if v in a.bound and not a.pending[v]:
                        self._unbind(v)
        if not a.pending[u]:
            return
        if u not in a.bound:
            self._gather(u)
            return
        pos = a.order.index(u)  # still bound from the forward: prefetch the unit before it
        with timed("library"):
            a.units.prefetch_after(a.order[:pos][::-1])

    def _run_recomputed(self, key: str, forward: Callable[..., object], *args: object,
                        **kw: object) -> object:
        """A unit's forward under activation checkpointing: the backward recomputes
        it, gathering the unit again."""
        a = self._current
        u = a.index[key]
        if u not in a.bound:
            self._gather(u)
        with timed(a.phase):
            out = forward(*args, **kw)
        if a.phase == "forward":  # recomputing: unbound once its gradients are in
            self._unbind(u)
        return out

    def _bind(self, u: int, flat: Array) -> None:
        """Bind unit ``u``'s parameters to views of its freshly gathered flat
        buffer: one DLPack exchange for the unit, torch views for its leaves."""
        with timed("library"):
            a = self._current
            base, leaves = self.views_of(u, flat)
            a.bound[u] = base
            for (p, _), leaf in zip(a.empties[u], leaves, strict=True):
                p.data = leaf

    def _bind_persistent(self, u: int) -> None:
        """Bind unit ``u``'s parameters (and, where the reducer lets the module sum
        its gradients in place, their ``.grad``) to views of the state's own
        buffers. The views are made once and kept while the buffers are the
        same objects; binding checks one pointer per parameter."""
        a = self._current
        flat, bucket = a.units.flat(u), a.reducer.bucket(u)
        kept = self._kept.get(u)
        if kept is None or kept.flat is not flat or kept.bucket is not bucket:
            with timed("library"):
                kept = self._kept[u] = _Persistent(self, u, flat, bucket, a.reducer.layout)
        for p, view, ptr in zip(kept.params, kept.views, kept.ptrs, strict=True):
            if p.data_ptr() != ptr:
                p.data = view
        if kept.grads is not None:  # cleared after each step, as zero_grad would
            for p, g in zip(kept.params, kept.grads, strict=True):
                p.grad = g
            a.bucketed.add(u)

    def views_of(self, u: int, flat: Array) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A torch tensor over unit ``u``'s flat buffer, and its leaves' views."""
        base = torch_view(flat)
        return base, [base[a:b].view(shape) for a, b, shape in self._current.spans[u]]

    def _unbind(self, u: int) -> None:
        with timed("library"):
            if self._current.bound.pop(u, None) is None:
                return
            for p, empty in self._current.empties[u]:
                p.data = empty

    def empty(self, p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A 0-size tensor of ``p``'s dtype (or ``dtype``) and device (one per
        kind, shared)."""
        import torch

        key = (dtype or p.dtype, p.device)
        if key not in self._empties:
            self._empties[key] = torch.empty(0, dtype=key[0], device=p.device)
        return self._empties[key]

    def _grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        """Parameter ``name``'s post-accumulate-grad hook: the unit's gradients go
        to the reducer once its last parameter's has arrived."""

        unit_of = self.unit_of

        def ready(_param: torch.Tensor) -> None:
            a = self.active
            if a is None:
                return
            u = a.index[unit_of[name]]
            pending = a.pending[u]
            pending.discard(name)
            if not pending:
                self._reduce(u)

        return ready

    def _reduce(self, u: int) -> None:
        """Unit ``u``'s gradients are complete: take them and release the unit;
        its reduction starts in the units' fixed order (see [Note: torch
        ZeRO-3])."""
        a = self._current
        with timed("library"):
            a.pending[u] = set()
            a.reduced.add(u)
            if u in a.bucketed:  # summed in place by autograd, into the reducer's buffer
                a.ready[u] = None
            else:
                grads = []  # torch tensors, viewed on the step's device by the reducer; None: 0
                for name in a.members[u]:
                    p = self.named[name]
                    grads.append(p.grad)
                    p.grad = None
                a.ready[u] = grads
            while a.issued < len(a.canon) and a.canon[a.issued] in a.ready:
                v = a.canon[a.issued]
                grads = a.ready.pop(v)
                if v in a.bucketed:
                    a.reducer.added(v)
                else:
                    a.reducer.add(v, grads)
                a.issued += 1
        if a.gathering and a.index.get(ROOT) != u and (u in a.past or u not in a.lingers):
            self._unbind(u)


def rank_dependent(modules: Iterable[tuple[str, torch.nn.Module]]) -> str | None:
    """The first of ``modules`` (``(name, module)`` pairs) in training mode whose
    results depend on the batches it saw in order, besides its gradients:
    running statistics (batch norm) or random draws from torch's generator
    (dropout), named; None if there is none."""
    import torch

    for name, m in modules:
        if not m.training:
            continue
        if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
            return f"the running statistics of {name or 'the module'} ({type(m).__name__})"
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return (f"the random draws of {name or 'the module'} ({type(m).__name__}, from "
                    "torch's generator; put it in eval mode or p=0)")
    return None


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy (or CuPy, or ml_dtypes) dtype."""
    import torch

    name = str(dtype)
    return getattr(torch, name)


def _tensors(out: object) -> list[torch.Tensor]:
    """The tensors in a unit's output (a tensor, or tuples, lists and dicts of them)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _tensors(x)]
    if isinstance(out, dict):
        return [t for x in out.values() for t in _tensors(x)]
    return []
