"""Sums in a fixed order: the same bits on any number of ranks.

[Note: ordered sums]
Floating-point addition is commutative (``a + b`` and ``b + a`` are the same
bits) but not associative, so a sum's bits depend on its parenthesisation: a
ring all-reduce's on the ring's starting points, a local accumulation's on how
many terms each rank held. Here a sum of ``T`` terms, where rank ``r`` of
``W`` holds terms ``r * G`` to ``r * G + G - 1`` (``T = G * W``, both powers
of two), is always the perfect binary tree over the terms in order:

- on a rank, :class:`TreeSum` adds its ``G`` terms as they come, pairing
  equal subtrees as a binary counter does, which ends in the tree's subtree
  over those terms (``log2 G + 1`` partial sums live at most);
- across ranks, :func:`tree_reduce_scatter` pairs rank ``r`` with ``r ^ d``
  for ``d = 1, 2, 4, ...`` (recursive halving): each round adds two sibling
  subtrees, so after ``log2 W`` rounds rank ``r`` holds segment ``r`` of the
  whole tree, having sent ``(W - 1) / W`` of the buffer, as a ring does;
  :func:`tree_all_reduce` is the same pairing over whole buffers (recursive
  doubling, ``log2 W`` buffers sent).

Each element's sum is then one expression, ``((x0 + x1) + (x2 + x3)) + ...``,
whichever ``W`` divides ``T``: a run on one rank and on eight give the same
bits. The two ranks of a pair compute ``mine + theirs`` and ``theirs + mine``,
the same bits by commutativity.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ops._types import Array
from ops.comm._base import Communicator
from ops.device._device import device_of

__all__ = ["TreeSum", "tree_all_reduce", "tree_reduce_scatter"]

_A = TypeVar("_A", bound=Array)
_TAG = 7919  # the ordered collectives' point-to-point messages


def _check_power_of_two(where: str, what: str, n: int) -> None:
    """A ValueError naming ``what`` unless ``n`` is a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"{where}: {what} must be a power of two for a fixed summation "
                         f"tree; got {n}")


class TreeSum:
    """Terms added one at a time (arrays of one shape, each handed over: the
    sum is built in them), summed as the perfect binary tree over them in
    order (see [Note: ordered sums]). ``release(x)`` takes back each term
    whose value was added into another."""

    def __init__(self, release: Any = None) -> None:
        self._stack: list[tuple[int, Any]] = []  # (level, the subtree's sum)
        self._release = release
        self.count = 0

    def add(self, x: object) -> None:
        level = 0
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            left += x
            if self._release is not None:
                self._release(x)
            x, level = left, level + 1
        self._stack.append((level, x))
        self.count += 1

    def total(self) -> Any:
        """The sum; a ValueError unless a power of two of terms was added."""
        if len(self._stack) != 1:
            raise ValueError(f"TreeSum: {self.count} terms do not make one perfect tree (a "
                             "power of two is needed)")
        return self._stack[0][1]


def tree_reduce_scatter(comm: Communicator, out: _A, x: Array) -> _A:
    """Rank ``r``'s segment of the ranks' sum of ``x`` (``world_size``
    equal segments, ``out`` one of them), summed in the fixed tree of [Note:
    ordered sums]. ``x`` is overwritten (it holds the partial sums)."""
    w, r = comm.world_size, comm.rank
    _check_power_of_two("tree_reduce_scatter", "the number of ranks", w)
    if x.size != out.size * w:
        raise ValueError(f"tree_reduce_scatter: the input has {x.size} elements; "
                         f"{w} ranks x the output's {out.size} = {out.size * w} needed")
    rows = x.reshape(w, out.size)
    device = device_of(x)
    d = 1
    while d < w:
        p = r ^ d
        keep = rows[r % (2 * d)::2 * d]  # segments j = r (mod 2d): this rank's after the round
        give = rows[p % (2 * d)::2 * d]
        send = device.empty(give.size, x.dtype)
        send.reshape(give.shape)[...] = give
        got = device.empty(keep.size, x.dtype)
        work = comm.isend(send, p, tag=_TAG)
        comm.recv_(got, p, tag=_TAG)
        work.wait()
        keep += got.reshape(keep.shape)
        d *= 2
    out[...] = rows[r]
    return out


def tree_all_reduce(comm: Communicator, x: Any) -> Any:
    """The ranks' sum of ``x``, in place, summed in the fixed tree of [Note:
    ordered sums] (the same bits on every rank)."""
    w, r = comm.world_size, comm.rank
    _check_power_of_two("tree_all_reduce", "the number of ranks", w)
    flat = x.reshape(-1)
    # None on one rank, where the loop does not run
    got: Any = device_of(x).empty(flat.size, x.dtype) if w > 1 else None
    d = 1
    while d < w:
        work = comm.isend(flat, r ^ d, tag=_TAG)
        comm.recv_(got, r ^ d, tag=_TAG)
        work.wait()
        flat += got
        d *= 2
    return x
