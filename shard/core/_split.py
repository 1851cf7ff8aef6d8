"""A leaf's split over the model ranks: :class:`Split`, a rank's slice and the
join of every rank's slices.

[Note: packed splits]
A tensor-parallel leaf is split along one dimension. Most leaves split in one
run: model rank ``r`` of ``T`` holds rows ``[r n, (r + 1) n)`` of that
dimension. A *packed* leaf is ``blocks`` equal blocks laid end to end along the
dimension, e.g. a fused query-key-value projection ``(3 d, d)`` or a fused
gate-up projection ``(2 f, d)``; each block splits on its own, so rank ``r``
holds rows ``[r n, (r + 1) n)`` of every block, and its slice is the same
blocks, each ``n`` long (its part of the query, of the key and of the value).
Viewing the dimension as ``(blocks, rows per block)`` makes a packed split an
ordinary split of the second axis, which is how both functions below work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Split", "join_split", "joined_stack", "take_split"]


class Split(NamedTuple):
    """A leaf's split: along ``dim``, each of ``blocks`` blocks on its own."""

    dim: int
    blocks: int = 1


def _blocked(shape: Sequence[int], split: Split) -> list[int]:
    shape = list(shape)
    shape[split.dim:split.dim + 1] = [split.blocks, shape[split.dim] // split.blocks]
    return shape


def take_split(x: Any, split: Split, rank: int, size: int) -> Any:
    """Model rank ``rank``'s slice of the whole leaf ``x`` (numpy, JAX or torch;
    a view where the array type allows one)."""
    d, k = split
    n = x.shape[d] // (k * size)
    if k == 1:
        index = [slice(None)] * len(x.shape)
        index[d] = slice(rank * n, (rank + 1) * n)
        return x[tuple(index)]
    index = [slice(None)] * (len(x.shape) + 1)
    index[d + 1] = slice(rank * n, (rank + 1) * n)
    shape = list(x.shape)
    shape[d] = k * n
    return x.reshape(_blocked(x.shape, split))[tuple(index)].reshape(shape)


def join_split(parts: Sequence[np.ndarray], split: Split) -> np.ndarray:
    """The whole leaf from every model rank's slice, in rank order."""
    if split.blocks == 1:
        return np.concatenate(parts, axis=split.dim)
    whole = np.concatenate([np.asarray(p).reshape(_blocked(p.shape, split)) for p in parts],
                           axis=split.dim + 1)
    shape = list(parts[0].shape)
    shape[split.dim] *= len(parts)
    return whole.reshape(shape)


def joined_stack(stacked: np.ndarray, split: Split) -> np.ndarray:
    """:func:`join_split` of ``stacked[r]``, every rank's slice stacked on a
    new first axis (what an all-gather fills), in one copy."""
    size, shape = stacked.shape[0], list(stacked.shape[1:])
    blocked = _blocked(shape, split)  # (T, ..., k, n, ...)
    x = stacked.reshape(size, *blocked)
    x = np.moveaxis(x, 0, split.dim + 1)  # (..., k, T, n, ...)
    shape[split.dim] *= size
    return x.reshape(shape)
