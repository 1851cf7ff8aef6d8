"""The learning-rate range test: :func:`lr_range_test` (Smith's method,
DeepSpeed's ``LRRangeTest``).

[Note: the learning-rate range test]
A few hundred steps whose rate grows from ``min_lr`` to ``max_lr`` (by a
constant factor a step by default; DeepSpeed's linear ``LRRangeTest``,
``min_lr * (1 + step_rate * step / step_size)``, with ``schedule=``), run by a
step the caller builds from that schedule, from a copy of the caller's params
(their state is never touched) with a fresh optimizer state, as the test is
run before training. The loss each step reports is the mean over the ranks, so
every rank sees the same curve and stops at the same step: when the loss
turns non-finite or its running mean exceeds ``diverge`` times the lowest seen.
The suggested rate is where that running mean (of log10 of the loss, against
log10 of the rate) falls fastest, before its minimum: the rate at which the
model learns fastest, as fastai's ``lr_find`` suggests it; an order of
magnitude below the rate of the lowest loss, typically.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shard.core._state import TrainState

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from shard.step._step import ZeroStep

__all__ = ["LRRangeTest", "lr_range_test"]


@dataclass(frozen=True)
class LRRangeTest:
    """A learning-rate range test's curve (see [Note: the learning-rate range
    test]).

    Attributes:
      lrs: the rate of each step run.
      losses: each step's loss (the mean over the ranks).
      smoothed: the running mean of the losses (bias-corrected, as fastai's).
      suggested: the suggested rate: the steepest fall of the smoothed loss
        against log10 of the rate, before its minimum.
      stopped: why the sweep ended: ``"max_lr"``, ``"diverged"`` (the smoothed
        loss above ``diverge`` times its minimum) or ``"non-finite"``.
    """

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    smoothed: tuple[float, ...]
    suggested: float
    stopped: str

    def plot(self, ax: Axes | None = None) -> Axes:
        """The loss against the rate (log scale), the suggested rate marked;
        returns the matplotlib axes."""
        if ax is None:
            import matplotlib.pyplot as plt

            ax = plt.subplots(figsize=(6, 3.5))[1]
        ax.plot(self.lrs, self.losses, alpha=0.35, label="loss")
        ax.plot(self.lrs, self.smoothed, label="running mean")
        ax.axvline(self.suggested, color="k", ls="--", lw=1,
                   label=f"suggested {self.suggested:.2e}")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        ax.legend()
        return ax


def lr_range_test(make_step: Callable[[Callable[[int], float]], ZeroStep], params: object,
                  batches: Iterable[object], *, min_lr: float = 1e-7, max_lr: float = 10.0,
                  steps: int = 100, schedule: Callable[[int], float] | None = None,
                  diverge: float = 4.0, beta: float = 0.98) -> LRRangeTest:
    """Run the learning-rate range test (see [Note: the learning-rate range
    test]); a collective: every rank calls it.

    Args:
      make_step: the ZeRO step for a learning-rate schedule ``count -> lr``,
        e.g. ``lambda lr: shard.zero3(loss, optimizer=ops.adamw(lr), comm=comm)``
        (an optax transformation takes the schedule as its learning rate too).
      params: the params to start from (a pytree, whole on every rank), or a
        :class:`TrainState`, whose params are gathered: it stays as it is.
      batches: this rank's batches (a :class:`shard.DataLoader`, or any
        iterable; restarted when it runs out).
      min_lr: the sweep's first rate.
      max_lr: its last: ``steps`` rates grow geometrically from ``min_lr`` to
        ``max_lr``.
      steps: the sweep's steps.
      schedule: another sweep, ``count -> lr`` (such as DeepSpeed's linear
        ``LRRangeTest``: ``shard.from_deepspeed_config`` makes it the
        optimizer's ``learning_rate``); it runs ``steps`` steps, or until
        ``max_lr``.
      diverge: stop once the smoothed loss exceeds this many times its minimum.
      beta: the running mean's decay.

    Returns:
      An :class:`LRRangeTest`: the curve, the suggested rate, ``plot()``.
    """
    if not (0 < min_lr < max_lr) or not math.isfinite(max_lr):
        raise ValueError(f"lr_range_test: 0 < min_lr < max_lr; got {min_lr}, {max_lr}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 4:
        raise ValueError(f"lr_range_test: steps must be an int >= 4; got {steps!r}")
    if not diverge > 1 or not 0 <= beta < 1:
        raise ValueError(f"lr_range_test: diverge > 1 and 0 <= beta < 1; got {diverge}, {beta}")
    if schedule is None:
        ratio = (max_lr / min_lr) ** (1 / (steps - 1))

        def schedule(count: int) -> float:
            return min_lr * ratio ** count

    step = make_step(schedule)
    if isinstance(params, TrainState):
        from shard.core._gather import gather

        params = gather(params, step.config.comm)
    state = step.init(params)
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    mean, best, stopped = 0.0, math.inf, "max_lr"
    source = _cycle(batches)
    for count in range(steps):
        lr = float(schedule(count))
        if lr > max_lr * (1 + 1e-9):
            break
        state, metrics = step(state, next(source))
        loss = float(metrics["loss"])  # the mean over the ranks: every rank stops alike
        lrs.append(lr)
        losses.append(loss)
        if not math.isfinite(loss):
            smoothed.append(math.nan)
            stopped = "non-finite"
            break
        mean = beta * mean + (1 - beta) * loss
        smoothed.append(mean / (1 - beta ** (count + 1)))
        best = min(best, smoothed[-1])
        if smoothed[-1] > diverge * best:
            stopped = "diverged"
            break
    return LRRangeTest(tuple(lrs), tuple(losses), tuple(smoothed), _suggest(lrs, smoothed),
                       stopped)


def _suggest(lrs: list[float], smoothed: list[float]) -> float:
    """The rate where the smoothed log-loss falls fastest against log10 of the
    rate, before the smoothed loss's minimum."""
    finite = [i for i, s in enumerate(smoothed) if math.isfinite(s) and s > 0]
    if len(finite) < 3:
        return lrs[finite[0]] if finite else lrs[0]
    x = np.log10([lrs[i] for i in finite])
    y = np.log10([smoothed[i] for i in finite])
    end = int(np.argmin(y)) + 1
    if end < 3:
        return float(10 ** x[0])
    slope = np.gradient(y[:end], x[:end])
    return float(10 ** x[int(np.argmin(slope))])


def _cycle(batches: Iterable[object]) -> Iterator[object]:
    """The batches over and over (each pass a fresh ``iter``: a DataLoader's
    next epoch)."""
    for _ in itertools.count():
        empty = True
        for b in batches:
            empty = False
            yield b
        if empty:
            raise ValueError("lr_range_test: batches gave no batch")
