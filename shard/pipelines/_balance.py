"""Laying a pipeline's layers out over its stages: by parameter count, or by
measured time (:func:`balance_by_time`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shard.core.losses._layered import Layered

__all__ = ["balance_by_time"]


# loss: Any, a Layered or a loss with layer_times (mypy cannot tie which to the branch below)
def balance_by_time(loss: Any, params: list[object], batch: object, stages: int, *,
                    repeats: int = 3) -> list[int]:
    """Layers per stage for ``pipeline(balance=...)``, from each layer's measured
    forward and backward time on ``batch`` (one process, the whole params; the
    fastest of ``repeats`` runs after a warm-up one, as ``timeit`` advises:
    other work on the machine only ever adds time), so that the slowest stage,
    which sets the pipeline's pace, is as fast as it can be. ``loss``: a
    ``shard.Layered`` or ``interop.torch.layered``'s loss (whose modules hold
    their params)."""
    if len(params) != len(loss.layers):
        raise ValueError(f"balance_by_time: {len(loss.layers)} layers but {len(params)} "
                         "entries in params")
    if loss.layer_times is not None:
        times = loss.layer_times(batch, repeats)
    else:
        times = _jax_layer_times(loss, params, batch, repeats)
    return _balanced([max(1, round(1e6 * t)) for t in times], stages)


def _jax_layer_times(loss: Layered, params: list[object], batch: object,
                     repeats: int) -> list[float]:
    import time

    import jax
    import jax.numpy as jnp

    fwd, bwd = loss.compiled()
    times = []
    carry = None
    for f, b, p in zip(fwd, bwd, params, strict=True):
        runs = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(p, carry, batch))
            jax.block_until_ready(b(p, carry, batch, jnp.ones_like(out)))
            runs.append(time.perf_counter() - t0)
        times.append(min(runs[1:]))  # the run least disturbed by other work
        carry = out
    return times


def _size(tree: object) -> int:
    import jax

    return sum(math.prod(x.shape) if hasattr(x, "shape") else int(np.size(x))
               for x in jax.tree_util.tree_leaves(tree))  # device arrays: their .shape


def _balanced(sizes: list[int], p: int) -> list[int]:
    """Contiguous runs of ``sizes`` into ``p`` parts minimising the largest sum."""
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # the smallest feasible bound on a part's sum
        mid = (lo + hi) // 2
        parts, acc = 1, 0
        for s in sizes:
            if acc + s > mid:
                parts, acc = parts + 1, 0
            acc += s
        if parts <= p:
            hi = mid
        else:
            lo = mid + 1
    counts: list[int] = []
    run, acc = 0, 0
    for i, s in enumerate(sizes):  # close a run at the bound, or to leave a layer a stage
        if run and (acc + s > lo or len(sizes) - i <= p - len(counts) - 1):
            counts.append(run)
            run, acc = 0, 0
        run, acc = run + 1, acc + s
    return [*counts, run]
