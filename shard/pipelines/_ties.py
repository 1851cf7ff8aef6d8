"""Weights tied across pipeline stages (``shard.pipeline(..., tied=...)``).

[Note: tied weights]
``tied=[[(0, "wte"), (11, "w_out")]]`` says that layer 0's ``params["wte"]``
and layer 11's ``params["w_out"]`` are one weight (an embedding shared with
the output head). As DeepSpeed's ``TiedLayerSpec`` and Megatron do, every stage
that uses a tied weight keeps its own copy, and the copies stay equal:

- they start equal (``pipe.params`` refuses copies that differ);
- after a step's backward, each copy's gradient is replaced by the sum of
  every use's gradient: the members on a stage are summed there, then summed
  over the data index's stages (an all-reduce on the pipe communicator, to
  which stages without the weight add zeros), so every copy gets the gradient
  the single weight would;
- so every copy takes the same optimizer update (the same fused kernel on the
  same values);
- the gradient norm (for clipping and the finite check) counts the weight
  once: only its first member's copy enters the norm.

The trajectory is that of the model with one shared weight. With
``stages=1`` the same option ties weights of an unpipelined ``Layered`` model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ops import Communicator
from ops.device._dlpack import host_copy

if TYPE_CHECKING:
    from shard.core._protocol import GradSink

__all__ = ["TiedReducer", "resolve_ties"]


@dataclass(frozen=True)
class Tie:
    """One tie group as this stage sees it."""

    here: tuple[tuple[int, int], ...]  # (unit, leaf within the unit) of each member here
    shape: tuple[int, ...]
    dtype: np.dtype
    skip: tuple[int, ...]  # leaves (of the stage's layout) left out of the norm


# tied: Any, the user's argument as given (pairs may be lists), checked here
def check_ties(tied: Any, layers: int) -> list[list[tuple[int, str]]]:
    """The ``tied=`` argument as lists of (layer, key), refused by name when malformed."""
    groups = []
    for g in tied or ():
        members = [tuple(m) for m in g]
        if len(members) < 2 or any(len(m) != 2 or not isinstance(m[0], int)
                                   or not 0 <= m[0] < layers for m in members):
            raise ValueError(f"pipeline: each tied group lists two or more (layer, key) pairs "
                             f"with layers in [0, {layers}); got {g!r}")
        groups.append(sorted(members, key=lambda m: m[0]))
    seen = [m for g in groups for m in g]
    if len(set(seen)) != len(seen):
        raise ValueError(f"pipeline: a (layer, key) appears in two tied groups: {tied!r}")
    return groups


def resolve_ties(groups: list[list[tuple[int, str]]], params: list[object],
                 layers: range) -> list[Tie]:
    """Where each group's members sit in this stage's units, checking that the
    tied arrays exist, agree in shape and dtype, and start equal."""
    import jax

    first_leaf = {}  # this stage's layers: where each one's leaves start in the stage layout
    n = 0
    for i in layers:
        first_leaf[i] = n
        n += len(jax.tree_util.tree_leaves(params[i]))
    out = []
    for g in groups:
        arrays = []
        for layer, key in g:
            tree = params[layer]
            if not isinstance(tree, dict) or key not in tree or len(
                    jax.tree_util.tree_leaves(tree[key])) != 1:
                raise ValueError(f"pipeline: tied member (layer {layer}, {key!r}) is not one "
                                 f"array of params[{layer}]")
            arrays.append(host_copy(tree[key]))  # explicit where it is on a device
        a = arrays[0]
        for (layer, key), b in zip(g[1:], arrays[1:], strict=True):
            if b.shape != a.shape or b.dtype != a.dtype or not np.array_equal(a, b):
                raise ValueError(f"pipeline: tied weights must start equal: (layer {layer}, "
                                 f"{key!r}) is {b.dtype}{list(b.shape)}, (layer {g[0][0]}, "
                                 f"{g[0][1]!r}) {a.dtype}{list(a.shape)}"
                                 + (" with other values" if b.shape == a.shape else ""))
        here, skip = [], []
        for j, (layer, key) in enumerate(g):
            if layer not in first_leaf:
                continue
            paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params[layer])[0]]
            within = next(k for k, p in enumerate(paths) if getattr(p[0], "key", None) == key)
            here.append((layers.index(layer), within))
            if j:  # a copy: the group's first member stands for it in the norm
                skip.append(first_leaf[layer] + within)
        out.append(Tie(tuple(here), a.shape, a.dtype, tuple(skip)))
    return out


class TiedReducer:
    """Collects a stage's unit gradients, sums each tie group's (see the Note),
    then hands everything to the step's reducer in the order it came."""

    def __init__(self, ties: list[Tie], pipe: Communicator) -> None:
        self.ties, self.pipe = ties, pipe
        self.added: list[tuple[int, list[Any]]] = []

    def add(self, u: int, grads: list[object]) -> None:
        self.added.append((u, list(grads)))

    def flush(self, reducer: GradSink) -> None:
        at = {u: grads for u, grads in self.added}
        for tie in self.ties:  # in group order on every stage of the data index
            total = np.zeros(tie.shape, tie.dtype)
            for u, i in tie.here:
                g = at[u][i]
                if g is not None:  # an explicit copy where the gradient is on a device
                    total += host_copy(g).reshape(tie.shape)
            self.pipe.all_reduce_(total.reshape(-1), "sum")
            for k, (u, i) in enumerate(tie.here):
                at[u][i] = total if k == 0 else total.copy()
        for u, grads in self.added:
            reducer.add(u, grads)
