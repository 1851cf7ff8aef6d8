"""Driving a torch module unit by unit: the hooks behind [Note: torch ZeRO-3].

:class:`UnitHooks` is the part of ``interop.torch.TorchLoss`` that runs one
micro-batch with each unit's params bound only while needed: the wrapped unit
forwards, the saved-tensor hooks that keep references instead of gathered
params, the gradient hooks that re-gather a unit for its backward and hand its
gradients to the reducer.
"""

from __future__ import annotations

from typing import Any

from ops._dlpack import torch_view
from ops._tree import tree_util
from shard._profile import timed

__all__ = ["ROOT", "UnitHooks", "check_owner"]

ROOT = "<root>"


def check_owner(owner: int | None, comm: Any, name: str, remedy: str) -> int:
    """The rank a torch loss object serves, once ``comm``'s rank claims it: a
    module is one rank's, so thread ranks sharing one object are refused before
    they train on each other's parameters."""
    if owner is not None and owner != comm.rank:
        raise ValueError(f"{name}: this loss object belongs to rank {owner}, and rank "
                         f"{comm.rank} uses it too; every rank needs its own {remedy}")
    return comm.rank


class UnitHooks:
    """Stage-3 (and stages 0-2 overlap) machinery of ``TorchLoss``; see the Note."""

    # provided by TorchLoss
    module: Any
    loss: Any
    named: dict[str, Any]
    unit_of: dict[str, str]
    unit_modules: list[tuple[str, Any]]
    activation_checkpointing: bool
    _active: Any
    _installed: bool
    _sharded: bool
    _compute_dtype: Any
    _empties: dict[Any, Any]
    _set_compute_dtype: Any
    _before_forward: Any
    sync_buffers: Any

    def run_units(self, units: Any, reducer: Any, batch: Any, loss_scale: float) -> Any:
        """One micro-batch, unit by unit (see [Note: torch ZeRO-3]). At stages 0-2
        the params stay bound and each unit's gradients still go to the reducer
        as soon as they are complete, so their reduction overlaps the backward."""
        index, order, members = self._plan(units.layout)
        self.sync_buffers()
        self._active = _Step(units, reducer, index, order, members)
        self._active.gathering = units.stage == 3
        self._set_compute_dtype(_torch_dtype(units.local[0].dtype if units.stage == 3
                                             else units.full[0].dtype))
        self._install()
        root = index.get(ROOT)
        try:
            if not self._active.gathering:  # stages 0-2: whole params, bound for the step
                for u in members:
                    self._bind(u, units.get(u))
            elif root is not None:
                self._bind(root, units.get(root, pinned=True))
            with timed("forward"):
                out = self.loss(self.module, batch)
            self._active.phase = "backward"
            self._active.kept = None
            with timed("backward"):
                (out * loss_scale).backward()
            for u, missing in self._active.pending.items():
                if missing:  # parameters the loss did not use: their gradient is zero
                    self._reduce(u)
        finally:
            gathering = self._active.gathering
            for p in self.named.values():
                if gathering:  # the module keeps stages 0-2's params (views of the state)
                    p.data = self._empty(p)
                p.grad = None
            self._active = None
            self._compute_dtype = None
            self._sharded = gathering
        return out.detach()

    def _plan(self, layout: Any) -> tuple[dict[str, int], list[int], dict[int, list[str]]]:
        """Unit indices by key, the units in forward order, and each unit's param
        names: worked out once per layout, not per step."""
        cached = getattr(self, "_plan_cache", None)
        if cached is not None and cached[0] is layout:
            return cached[1]
        index = {u.name: i for i, u in enumerate(layout.units)}
        names = [path[0].key for path, _ in tree_util().tree_flatten_with_path(
            layout.treedef.unflatten(list(range(len(layout.leaves)))))[0]]
        members = {i: [names[j] for j in u.leaves] for i, u in enumerate(layout.units)}
        order = [index[key] for key, _ in self.unit_modules if key in index]
        self._plan_cache = (layout, (index, order, members))
        return index, order, members

    def _install(self) -> None:
        if self._installed:
            return
        for key, m in self.unit_modules:
            if not any(self.unit_of.get(n) == key for n in self.named):
                continue
            forward = m.forward

            def wrapped(*args: Any, _key: str = key, _forward: Any = forward, **kw: Any) -> Any:
                if self._active is None or not self._active.gathering:
                    return _forward(*args, **kw)
                if self.activation_checkpointing:
                    from torch.utils.checkpoint import checkpoint

                    return checkpoint(self._run_recomputed, _key, _forward, *args,
                                      use_reentrant=False, **kw)
                return self._run_unit(_key, _forward, *args, **kw)

            m.forward = wrapped
        for name, p in self.named.items():
            p.register_post_accumulate_grad_hook(lambda p, name=name: self._grad_ready(name))
        self.module.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self._installed = True

    def _gather(self, u: int) -> None:
        """Gather and bind unit ``u``, starting the gather of the unit after it in
        this phase's order."""
        a = self._active
        pos = a.order.index(u)
        upcoming = a.order[pos + 1:] if a.phase == "forward" else a.order[:pos][::-1]
        self._bind(u, a.units.get(u, upcoming))

    def _run_unit(self, key: str, forward: Any, *args: Any, **kw: Any) -> Any:
        """A unit's forward with its gathered params saved for the backward as
        references, not tensors (see the Note)."""
        import torch

        a = self._active
        u = a.index[key]
        if a.kept is not None and a.kept != u:
            self._unbind(a.kept)  # before this unit's copy-out: the two-unit bound
        a.kept = u
        if u not in a.bound:
            self._gather(u)
        storages = {p.untyped_storage().data_ptr(): name for name, p in a.bound[u].items()
                    if p.numel()}

        def pack(t: Any) -> Any:
            name = storages.get(t.untyped_storage().data_ptr()) if t.numel() else None
            if name is None or t.dtype != a.bound[u][name].dtype:
                return t
            return _ParamRef(u, name, tuple(t.shape), t.stride(), t.storage_offset())

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

    def _unpack(self, saved: Any) -> Any:
        if not isinstance(saved, _ParamRef):
            return saved
        a = self._active
        if saved.unit not in a.bound:  # not announced by its outputs' gradient hook
            self._gather(saved.unit)
        base = a.bound[saved.unit][saved.name]
        return base.as_strided(saved.shape, saved.stride, saved.offset)

    def _before_backward(self, u: int) -> None:
        """The gradient reached unit ``u``'s outputs: gather it for its backward."""
        a = self._active
        if a is None or not a.pending[u]:
            return
        if u not in a.bound:
            self._gather(u)
            return
        pos = a.order.index(u)  # still bound from the forward: prefetch the unit before it
        with timed("library"):
            a.units.prefetch_after(a.order[:pos][::-1])

    def _run_recomputed(self, key: str, forward: Any, *args: Any, **kw: Any) -> Any:
        """A unit's forward under activation checkpointing: the backward recomputes
        it, gathering the unit again."""
        a = self._active
        u = a.index[key]
        if u not in a.bound:
            self._gather(u)
        with timed(a.phase):
            out = forward(*args, **kw)
        if a.phase == "forward":  # recomputing: unbound once its gradients are in
            self._unbind(u)
        return out

    def _bind(self, u: int, leaves: list[Any]) -> None:
        with timed("library"):
            bound = self._active.bound[u] = {}
            for name, leaf in zip(self._active.members[u], leaves, strict=True):
                p = self.named[name]
                p.data = bound[name] = torch_view(leaf)

    def _unbind(self, u: int) -> None:
        with timed("library"):
            for name in self._active.bound.pop(u, {}):
                p = self.named[name]
                p.data = self._empty(p)

    def _empty(self, p: Any) -> Any:
        """A 0-size tensor of ``p``'s dtype and device (one per kind, shared)."""
        import torch

        key = (p.dtype, p.device)
        if key not in self._empties:
            self._empties[key] = torch.empty(0, dtype=p.dtype, device=p.device)
        return self._empties[key]

    def _grad_ready(self, name: str) -> None:
        a = self._active
        if a is None:
            return
        u = a.index[self.unit_of[name]]
        a.pending[u].discard(name)
        if not a.pending[u]:
            self._reduce(u)

    def _reduce(self, u: int) -> None:
        a = self._active
        with timed("library"):
            grads = []  # torch tensors, viewed on the step's device by the reducer; None: zero
            for name in a.members[u]:
                p = self.named[name]
                grads.append(p.grad)
                p.grad = None
            a.pending[u] = set()
            a.reducer.add(u, grads)
        if a.gathering and a.index.get(ROOT) != u:
            self._unbind(u)


class _Step:
    """What :meth:`TorchLoss.run_units` tracks during one micro-batch."""

    def __init__(self, units: Any, reducer: Any, index: dict[str, int], order: list[int],
                 members: dict[int, list[str]]) -> None:
        self.units, self.reducer, self.index, self.order = units, reducer, index, order
        self.members = members
        self.phase = "forward"
        self.gathering = True  # stage 3: units are gathered and freed; else bound throughout
        self.kept: int | None = None  # the unit that ran last in the forward, still bound
        self.pending = {i: set(m) for i, m in members.items()}  # params awaiting a gradient
        self.bound: dict[int, dict[str, Any]] = {}  # units bound now: {name: tensor}


class _ParamRef(tuple):
    """A saved tensor that is (a view of) a gathered parameter: (unit, name,
    shape, stride, storage offset), re-gathered when the backward needs it."""

    __slots__ = ()

    def __new__(cls, unit: int, name: str, shape: tuple, stride: tuple, offset: int) -> _ParamRef:
        return super().__new__(cls, (unit, name, shape, stride, offset))

    unit = property(lambda self: self[0])
    name = property(lambda self: self[1])
    shape = property(lambda self: self[2])
    stride = property(lambda self: self[3])
    offset = property(lambda self: self[4])


def _torch_dtype(dtype: Any) -> Any:
    """The torch dtype of a numpy (or CuPy, or ml_dtypes) dtype."""
    import torch

    name = str(dtype)
    return getattr(torch, name)


def _tensors(out: Any) -> list[Any]:
    """The tensors in a unit's output (a tensor, or tuples, lists and dicts of them)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _tensors(x)]
    if isinstance(out, dict):
        return [t for x in out.values() for t in _tensors(x)]
    return []
