"""What the unit-by-unit hooks of ``_units.py`` work out once per layout
(:class:`_Plan`) and track during one micro-batch (:class:`_Step`), the views
of the state's own buffers a unit stays bound to (:class:`_Persistent`), and
the reference a saved gathered parameter becomes (:class:`_ParamRef`); see
[Note: torch ZeRO-3] in ``_adapter.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ops._types import tree_util
from ops.device._dlpack import torch_view

if TYPE_CHECKING:
    import torch

    from interop.torch._units import UnitHooks
    from ops._types import Array
    from shard.core._layout import Layout
    from shard.step._runtime import Units
    from shard.step.reduction._reduce import GradReducer

__all__ = ["_ParamRef", "_Persistent", "_Plan", "_Step"]


class _Persistent:
    """Unit ``u``'s parameters bound to the state's own buffer ``flat``: torch
    views of its leaves, their data pointers, and views of the reducer's
    ``bucket`` as their ``.grad`` where it has the params' dtype, laid out by
    the gradients' layout ``grads`` (None for a frozen parameter, which has no
    place there; see [Note: frozen leaves])."""

    def __init__(self, hooks: UnitHooks, u: int, flat: Array, bucket: Array | None,
                 grads: Layout) -> None:
        self.flat, self.bucket = flat, bucket
        names = hooks.current.members[u]
        self.params = [hooks.named[name] for name in names]
        _, self.views = hooks.views_of(u, flat)
        self.ptrs = [v.data_ptr() for v in self.views]
        self.grads: list[torch.Tensor | None] | None = None
        if bucket is not None and bucket.dtype == flat.dtype:
            base = torch_view(bucket)
            leaves = [grads.leaves[j] for j in grads.units[u].leaves]
            self.grads = [base[leaf.offset:leaf.offset + leaf.size].view(leaf.shape)
                          if leaf.local_size else None for leaf in leaves]


class _Plan:
    """Unit indices by key, the units in forward order, each unit's param names,
    its leaves' spans (start, end, shape) in its flat buffer, and its params
    with the 0-size tensors they hold while unbound."""

    def __init__(self, hooks: UnitHooks, layout: Layout, full_layout: Layout) -> None:
        self.layout = layout
        self.index = {u.name: i for i, u in enumerate(layout.units)}
        names = [path[0].key for path, _ in tree_util().tree_flatten_with_path(
            layout.treedef.unflatten(list(range(len(layout.leaves)))))[0]]
        self.members = {i: [names[j] for j in u.leaves] for i, u in enumerate(layout.units)}
        self.order = [self.index[key] for key, _ in hooks.unit_modules if key in self.index]
        leaves = full_layout.leaves
        self.spans = {i: [(leaves[j].offset, leaves[j].offset + leaves[j].size, leaves[j].shape)
                          for j in u.leaves] for i, u in enumerate(full_layout.units)}
        self.empties = {i: [(hooks.named[n], hooks.empty(hooks.named[n])) for n in names]
                        for i, names in self.members.items()}
        self.frozen = frozenset(n for n, p in hooks.named.items() if not p.requires_grad)
        self.leaf_index = {name: j for j, name in enumerate(names)}  # in the layout's order


class _Step:
    """What :meth:`TorchLoss.run_units` tracks during one micro-batch."""

    def __init__(self, units: Units, reducer: GradReducer, plan: _Plan) -> None:
        self.units, self.reducer = units, reducer
        self.index, self.order, self.members = plan.index, plan.order, plan.members
        self.spans, self.empties = plan.spans, plan.empties
        self.leaf_index = plan.leaf_index
        self.phase = "forward"
        self.gathering = True  # stage 3: units are gathered and freed; else bound throughout
        self.kept: int | None = None  # the unit that ran last in the forward, still bound
        # the trainable params awaiting a gradient; frozen ones get none (see [Note: frozen
        # leaves]), and a unit of frozen params alone is reduced (zeros) after the backward
        self.pending = {i: set(m) - plan.frozen for i, m in plan.members.items()}
        # The units with frozen params, with their place in the forward order (the root unit
        # has none: it stays bound for the step). Their backward may still need the frozen
        # params after the last trainable one's gradient is in (a LoRA layer's base weight,
        # for its input's gradient): they are released once the gradient reaches a unit
        # before them (past), not when their gradients are complete.
        self.with_frozen = [(i, self.order.index(i)) for i, m in plan.members.items()
                            if set(m) & plan.frozen and i in self.order]
        self.lingers = {i for i, _ in self.with_frozen}
        self.past: set[int] = set()
        self.reduced: set[int] = set()  # units whose gradients are complete
        # Every rank starts the reductions in one order, whatever its forward touched: the
        # backward's (the forward's reversed, then the rest), each once the units before
        # it have started; a unit complete early waits in ready with its gradients.
        self.canon = self.order[::-1] + [i for i in plan.members if i not in self.order]
        self.ready: dict[int, Any] = {}
        self.issued = 0
        self.bound: dict[int, torch.Tensor] = {}  # gathered units bound now: the flat torch tensor
        self.bucketed: set[int] = set()  # units whose .grad are views of the reducer's buffer


class _ParamRef(tuple):
    """A saved tensor that is (a view of) a gathered unit's parameters: (unit,
    shape, stride, offset in the unit's flat buffer), re-gathered when the
    backward needs it."""

    __slots__ = ()
