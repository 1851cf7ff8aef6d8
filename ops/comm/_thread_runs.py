"""How the threads backend's collectives move data (see [Note: thread
collectives] in ``ops/comm/_threads.py``): each collective run for every
rank at once (:data:`RUN`), or as parts that write disjoint outputs and may run
on several ranks' threads at once (:data:`PARTS`), from every rank's
``(out, x, arg)`` in rank order (see [Note: collective semantics]).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from ops._types import Array
from ops.device._device import device_of

__all__ = ["DIRECT", "PARTS", "RUN", "apart", "gather_into", "overlaps", "reduce_range",
           "sum_into"]

DIRECT = 1 << 16  # elements: a reduce-scatter's section summed into its output directly


def apart(ranks: list[tuple]) -> bool:
    """Whether no rank's output overlaps any rank's input (an all-reduce's: no
    two ranks' buffers overlap), so parts may run at once in any order; where
    one does (in place, as NCCL allows), the last rank runs it in rank order."""
    outs = [out for out, _, _ in ranks]
    xs = [x for _, x, _ in ranks]
    if all(out is x for out, x in zip(outs, xs, strict=True)):  # an all-reduce
        return not any(overlaps(a, b) for i, a in enumerate(xs) for b in xs[i + 1:])
    return not any(overlaps(out, x) for out in outs for x in xs)


def sum_into(out: Array, xs: list[Array], lo: int, hi: int, op: str) -> None:
    """``out`` = the ranks' ``xs[lo:hi]`` summed in rank order (or their mean):
    into ``out`` directly, one pass, unless it is short (then the checks cost
    more than the passes) or overlaps an input."""
    xp = device_of(out).xp
    flat = out.reshape(-1)
    if hi - lo < DIRECT or any(overlaps(out, x) for x in xs):  # summed aside first
        acc = xs[0].reshape(-1)[lo:hi].copy()
        for xr in xs[1:]:
            xp.add(acc, xr.reshape(-1)[lo:hi], out=acc)
    else:
        acc = flat
        if len(xs) == 1:
            xp.copyto(acc, xs[0].reshape(-1)[lo:hi])
        else:
            xp.add(xs[0].reshape(-1)[lo:hi], xs[1].reshape(-1)[lo:hi], out=acc)
        for xr in xs[2:]:
            xp.add(acc, xr.reshape(-1)[lo:hi], out=acc)
    if op == "mean":
        xp.divide(acc, acc.dtype.type(len(xs)), out=acc)
    if acc is not flat:
        xp.copyto(flat, acc)


def overlaps(a: Array, b: Array) -> bool:
    """Whether two arrays' memory may overlap (numpy's bounds check, or their
    address ranges on a device: its arrays here are contiguous buffers)."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.may_share_memory(a, b))
    start_a, start_b = cast(Any, a).data.ptr, cast(Any, b).data.ptr  # CuPy's, the stand-in's
    return start_a < start_b + b.nbytes and start_b < start_a + a.nbytes


def gather_into(out: Array, xs: list[Array]) -> None:
    k = xs[0].size
    xp = device_of(out).xp
    for r, xr in enumerate(xs):
        xp.copyto(out[r * k:(r + 1) * k], xr)


def _run_all_gather(ranks: list[tuple]) -> None:
    xs = [x.reshape(-1) for _, x, _ in ranks]
    for out, _, _ in ranks:
        gather_into(out, xs)


def _parts_all_gather(ranks: list[tuple]) -> list[Callable[[], None]]:
    xs = [x.reshape(-1) for _, x, _ in ranks]
    return [functools.partial(gather_into, out, xs) for out, _, _ in ranks]


def _run_reduce_scatter(ranks: list[tuple]) -> None:
    xs = [x for _, x, _ in ranks]
    for r, (out, _, op) in enumerate(ranks):
        sum_into(out, xs, r * out.size, (r + 1) * out.size, op)


def _parts_reduce_scatter(ranks: list[tuple]) -> list[Callable[[], None]]:
    xs = [x for _, x, _ in ranks]
    return [functools.partial(sum_into, out, xs, r * out.size, (r + 1) * out.size, op)
            for r, (out, _, op) in enumerate(ranks)]


def reduce_range(xs: list[Array], lo: int, hi: int, op: str) -> None:
    """Elements ``[lo, hi)`` of every rank's flat ``x``: their sum (or mean)."""
    total = xs[0][lo:hi].copy()
    xp = device_of(total).xp
    for xr in xs[1:]:
        xp.add(total, xr[lo:hi], out=total)
    if op == "mean":
        xp.divide(total, total.dtype.type(len(xs)), out=total)
    for x in xs:
        device_of(x).xp.copyto(x[lo:hi], total)


def _run_all_reduce(ranks: list[tuple]) -> None:
    xs = [x.reshape(-1) for _, x, _ in ranks]
    reduce_range(xs, 0, xs[0].size, ranks[0][2])


def _parts_all_reduce(ranks: list[tuple]) -> list[Callable[[], None]]:
    xs = [x.reshape(-1) for _, x, _ in ranks]
    cuts = [xs[0].size * p // len(xs) for p in range(len(xs) + 1)]
    return [functools.partial(reduce_range, xs, lo, hi, ranks[0][2])
            for lo, hi in itertools.pairwise(cuts) if hi > lo]


def _run_all_to_all(ranks: list[tuple]) -> None:
    xs = [x.reshape(-1) for _, x, _ in ranks]
    k = xs[0].size // len(ranks)
    for r, (out, _, _) in enumerate(ranks):
        xp = device_of(out).xp
        for s, xs_s in enumerate(xs):
            xp.copyto(out[s * k:(s + 1) * k], xs_s[r * k:(r + 1) * k])


def _run_broadcast(ranks: list[tuple]) -> None:
    src = ranks[0][2]
    for r, (x, _, _) in enumerate(ranks):
        if r != src:
            device_of(x).xp.copyto(x, ranks[src][0])


RUN: dict[str, Callable[[list[tuple]], None]] = {
    "all_gather": _run_all_gather, "reduce_scatter": _run_reduce_scatter,
    "all_reduce": _run_all_reduce, "all_to_all": _run_all_to_all, "broadcast": _run_broadcast,
    "barrier": lambda ranks: None}
# the collectives whose parts may run at once (an all-to-all's outputs may be its inputs)
PARTS: dict[str, Callable[[list[tuple]], list[Callable[[], None]]]] = {
    "all_gather": _parts_all_gather, "reduce_scatter": _parts_reduce_scatter,
    "all_reduce": _parts_all_reduce}
