"""Where a step's time goes: :func:`profile` (DeepSpeed's ``wall_clock_breakdown``).

[Note: step profile]
Inside ``with shard.profile() as prof:`` every ZeRO step on this thread adds
its wall time to ``prof``, split into exclusive categories that sum to the
step's time:

- ``forward`` / ``backward``: the loss's own compute (torch or JAX), with the
  library's work inside it (hooks, gathers) taken out;
- ``compute``: forward and backward together, where they cannot be told apart
  (a monolithic JAX loss is one jitted function, and so is the last segment
  of a traced one: see [Note: traced units]);
- ``all_gather_wait``: time blocked on parameter all-gathers, i.e. the part of
  the communication that compute did not hide;
- ``reduce_wait``: time blocked on gradient reductions, likewise;
- ``pipeline_wait``: a pipeline stage blocked on its neighbours' activations or
  gradients (the bubble, see [Note: pipeline]);
- ``optimizer``: the norm and the fused optimizer kernel;
- ``library``: everything else the step does in Python: copies in and out of
  the flat buffers, binding parameters, hooks, bookkeeping.

Timers are thread-local (thread ranks profile separately) and nest (a
region's time excludes the regions timed inside it). Every step also times
itself alone (:func:`step_breakdown`): ``metrics["time_ms"]`` is that step's
split, and an enclosing ``profile`` block adds it to its totals. The times are
the host's: on a GPU, kernels the host has only queued are not waited for.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["CATEGORIES", "Breakdown", "profile", "step_breakdown", "timed"]

CATEGORIES = ("forward", "backward", "compute", "all_gather_wait", "reduce_wait", "pipeline_wait",
              "optimizer",
              "library")
_local = threading.local()


class Breakdown:
    """Seconds per category over the steps run inside :func:`profile`."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.steps = 0
        self._stack: list[list[float]] = []  # [start, time of timed children]

    def ms_per_step(self) -> dict[str, float]:
        """Milliseconds per step by category (zero steps: all zeros)."""
        n = max(self.steps, 1)
        return {k: 1e3 * v / n for k, v in self.seconds.items()}

    def total_ms(self) -> float:
        return sum(self.ms_per_step().values())

    def split_ms(self) -> dict[str, float]:
        """``{"step": total, category: ms, ...}`` per step, every category."""
        ms = self.ms_per_step()
        return {"step": sum(ms.values()), **ms}

    def table(self) -> str:
        """The non-empty categories as ``ms per step`` and share of the step."""
        ms, total = self.ms_per_step(), self.total_ms() or 1.0
        rows = [f"{'category':<17}{'ms/step':>10}{'share':>8}"]
        rows += [f"{k:<17}{v:>10.1f}{100 * v / total:>7.1f}%" for k, v in ms.items() if v > 0]
        rows.append(f"{'step':<17}{self.total_ms():>10.1f}{100.0:>7.1f}%")
        return "\n".join(rows)

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={v:.1f}" for k, v in self.ms_per_step().items() if v > 0)
        return f"Breakdown({self.steps} steps; ms/step: {parts})"


@contextlib.contextmanager
def profile() -> Iterator[Breakdown]:
    """Time the ZeRO steps this thread runs inside the block, by category.

    Examples:
      >>> import numpy as np, jax.numpy as jnp, ops, shard
      >>> step = shard.zero3(lambda p, b: jnp.sum(p["w"] ** 2), optimizer=ops.adamw(0.1),
      ...                    comm=ops.spawn(lambda c: c, 1)[0])
      >>> state = step.init({"w": np.ones(4, np.float32)})
      >>> with shard.profile() as prof:
      ...     state, _ = step(state, None)
      >>> prof.steps, prof.ms_per_step()["optimizer"] > 0
      (1, True)
    """
    outer = getattr(_local, "breakdown", None)
    _local.breakdown = b = Breakdown()
    try:
        yield b
    finally:
        _local.breakdown = outer


@contextlib.contextmanager
def step_breakdown() -> Iterator[Breakdown]:
    """Time one step alone; on exit its times are added to the enclosing
    :func:`profile`, if any, as if that profile had timed it."""
    outer = getattr(_local, "breakdown", None)
    b = None
    try:
        with profile() as b:
            yield b
    finally:
        if outer is not None and b is not None:
            for k, v in b.seconds.items():
                outer.seconds[k] += v
            outer.steps += b.steps
            if outer._stack:  # a region timed around the step excludes it
                outer._stack[-1][1] += sum(b.seconds.values())


class timed:
    """Add the block's exclusive time to ``category`` of the active profile."""

    __slots__ = ("b", "category", "step")

    def __init__(self, category: str, *, step: bool = False) -> None:
        self.category, self.step = category, step
        self.b: Breakdown | None = None

    def __enter__(self) -> timed:
        b = self.b = getattr(_local, "breakdown", None)
        if b is not None:
            b._stack.append([time.perf_counter(), 0.0])
        return self

    def __exit__(self, *exc: object) -> None:
        b = self.b
        if b is None:
            return
        start, inner = b._stack.pop()
        elapsed = time.perf_counter() - start
        b.seconds[self.category] += elapsed - inner
        if b._stack:
            b._stack[-1][1] += elapsed
        elif self.step:
            b.steps += 1
