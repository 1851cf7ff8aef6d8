"""Choosing a ZeRO configuration by trial: :func:`autotune` (DeepSpeed's
autotuner, for one model on the ranks at hand).

[Note: autotuning]
The candidates are every combination of the ZeRO stage, the number of
micro-batches a global batch is cut into (so the micro-batch's rows), host
offload of the optimizer state and, at stage 3, the prefetch depth and the
units (``units=`` candidates), in a fixed order. A candidate whose device
bytes, as ``shard.estimate_memory`` counts them (plus stage 3's live units:
``1 + prefetch`` of the largest), exceed the budget is not run. The others
run ``warmup`` and then ``steps`` steps on the caller's data through a
:class:`shard.DataLoader` (the same rows for every candidate); a trial's
time is the median step time of its slowest rank, and its measured bytes are
the state's on the device plus the step's peak of gathered units, which must
fit the budget too. The fastest trial that fits is chosen; ties go to the
earlier candidate, so every rank chooses the same one. Activations are not
counted: leave room for them in the budget.
"""

from __future__ import annotations

import itertools
import logging
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ops.comm._collectives import all_gather_host
from shard._memory import estimate_memory
from shard._stages import zero0, zero1, zero2, zero3
from shard.core._layout import make_layout
from shard.core._mesh import Mesh
from shard.core._state import _bytes
from shard.data._loader import DataLoader
from shard.offload._offload import Offload
from shard.step._config import ZeroOptions

if TYPE_CHECKING:
    from ops import Communicator
    from shard.core._layout import Units

__all__ = ["Autotuned", "autotune"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Autotuned:
    """What :func:`autotune` chose, and every trial (see [Note: autotuning]).

    Attributes:
      stage: the chosen ZeRO stage.
      options: the chosen :class:`shard.ZeroOptions` (micro-batches, offload,
        prefetch): ``shard.zero{stage}(loss, optimizer=..., comm=...,
        options=result.options)`` builds the step.
      trials: one dict per candidate: ``stage``, ``micro_batches``, ``rows``
        (a micro-batch's, per rank), ``offload``, ``prefetch``, ``estimated``
        and ``measured`` device bytes, ``ms`` (median step time, slowest
        rank; None where it did not run) and ``status``.
    """

    stage: int
    options: ZeroOptions
    trials: tuple[dict[str, Any], ...]

    def table(self) -> str:
        """The trials as a Markdown table, the chosen one marked."""
        rows = ["| stage | micro-batches | rows | offload | prefetch | units | estimated "
                "| measured | ms/step | |", "|---|---|---|---|---|---|---|---|---|---|"]

        def mib(b: int | None) -> str:
            return "-" if b is None else _bytes(b)

        for t in self.trials:
            ms = "-" if t["ms"] is None else f"{t['ms']:.2f}"
            rows.append(f"| {t['stage']} | {t['micro_batches']} | {t['rows']} | "
                        f"{t['offload'] or '-'} | {t['prefetch']} | {t['units']} | "
                        f"{mib(t['estimated'])} | "
                        f"{mib(t['measured'])} | {ms} | {t['status']} |")
        return "\n".join(rows)


# comm: Any, a Communicator or None (the check below that one of mesh and comm is given
# does not narrow it for mypy)
def autotune(loss_fn: object, params: object, data: object, *, optimizer: object, batch_size: int,
             budget: int, mesh: Mesh | None = None, comm: Any = None,
             stages: Sequence[int] = (1, 2, 3), micro_batches: Sequence[int] = (1, 2, 4),
             offload: Sequence[str | None] = (None, "host"), prefetch: Sequence[int] = (1, 2),
             units: Sequence[Units] = (None,), steps: int = 3, warmup: int = 1,
             seed: int = 0) -> Autotuned:
    """Choose the ZeRO stage, micro-batches, offload, prefetch and units that
    train ``loss_fn`` fastest within ``budget`` device bytes per rank, by short
    trials (see [Note: autotuning]); a collective: every rank calls it.

    Args:
      loss_fn: the loss, as ``shard.zero3`` takes it (each trial builds its step).
      params: the whole params (each trial starts from them; they are not changed).
      data: the training data, as :class:`shard.DataLoader` takes it.
      optimizer: the optimizer every trial uses.
      batch_size: the global batch (rows per step over every rank and micro-batch).
      budget: device bytes per rank the state and gathered units may take.
      mesh: the ranks as a :class:`shard.Mesh`, as the transforms take it.
      comm: or one data axis's communicator.
      stages: the ZeRO stages to try.
      micro_batches: the numbers of micro-batches to cut a global batch into.
      offload: None (no offload) and/or ``"host"`` (the optimizer state in
        host memory).
      prefetch: stage 3's prefetch depths.
      units: stage 3's unit groupings, as ``ZeroOptions(units=)`` takes them
        (None, a depth, a function).
      steps: timed steps per trial.
      warmup: untimed steps before them.
      seed: the data order's seed.

    Returns:
      An :class:`Autotuned`; a ValueError when no candidate fits the budget.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ValueError(f"autotune: budget must be bytes > 0; got {budget!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or warmup < 0:
        raise ValueError(f"autotune: steps >= 1 and warmup >= 0; got {steps}, {warmup}")
    if (mesh is None) == (comm is None):
        raise TypeError("autotune: give the ranks as mesh= or comm=, exactly one of them")
    where = {"mesh": mesh} if mesh is not None else {"comm": comm}
    group = mesh.comm if mesh is not None else comm
    ranks = mesh.data_ranks()[1] if mesh is not None else comm.world_size
    trials = []
    for stage, k, off, pre, unit in itertools.product(stages, micro_batches, offload,
                                                      prefetch, range(len(units))):
        if (stage != 3 and (pre != prefetch[0] or unit)) or (stage == 0 and off is not None):
            continue  # prefetch and units are stage 3's; offload is stages 1-3's
        trial: dict[str, Any] = {"stage": stage, "micro_batches": k, "offload": off,
                                 "prefetch": pre, "units": _name(units[unit]),
                                 "estimated": None, "measured": None, "ms": None}
        if batch_size % (k * ranks):
            trials.append({**trial, "rows": "-", "status": "batch does not divide"})
            continue
        trial["rows"] = batch_size // (k * ranks)
        policy = Offload(off) if off else None
        est = estimate_memory(params, stage=stage, world_size=ranks, offload=policy,
                              optimizer=optimizer, units=units[unit])
        need = est.get("on_device", est["total"]) + (
            (1 + pre) * _largest(params, units[unit]) if stage == 3 and ranks > 1 else 0)
        trial["estimated"] = need
        if need > budget:
            trials.append({**trial, "status": "over budget (estimated)"})
            continue
        trial["_units"] = units[unit]
        ms, measured = _trial(loss_fn, params, data, optimizer, stage, k, policy, pre,
                              units[unit], batch_size, where, group, steps, warmup, seed)
        status = "ok" if measured <= budget else "over budget (measured)"
        trials.append({**trial, "ms": ms, "measured": measured, "status": status})
    ok = [t for t in trials if t["status"] == "ok"]
    if not ok:
        raise ValueError(f"autotune: no candidate fits {budget} bytes per rank:\n"
                         + Autotuned(0, ZeroOptions(), tuple(trials)).table())
    best = min(ok, key=lambda t: t["ms"])  # the first of equals: the same on every rank
    best["status"] = "chosen"
    result = Autotuned(best["stage"], ZeroOptions(
        gradient_accumulation_steps=best["micro_batches"], prefetch=best["prefetch"],
        units=best["_units"], offload=Offload(best["offload"]) if best["offload"] else None),
        tuple({k: v for k, v in t.items() if k != "_units"} for t in trials))
    if group.rank == 0:  # result.table() gives it to the caller
        log.info("autotune: the trials (%d ranks, budget %d bytes):\n%s", ranks, budget,
                 result.table())
    return result


def _trial(loss_fn: object, params: object, data: object, optimizer: object, stage: int, k: int,
           offload: Offload | None, prefetch: int, units: Units, batch_size: int,
           where: dict[str, Any], group: Communicator, steps: int, warmup: int,
           seed: int) -> tuple[float, int]:
    """One candidate's median step time (its slowest rank's) and measured
    device bytes (the largest over the ranks)."""
    zero = (zero0, zero1, zero2, zero3)[stage]
    step = zero(loss_fn, optimizer=optimizer, offload=offload, **where,
                options=ZeroOptions(gradient_accumulation_steps=k, prefetch=prefetch,
                                    units=units))
    state = step.init(params)
    loader = DataLoader(data, batch_size, gradient_accumulation_steps=k, seed=seed, prefetch=0,
                        **where)
    times = []
    for i, batch in enumerate(itertools.islice(_forever(loader), warmup + steps)):
        state, metrics = step(state, batch)
        if i >= warmup:
            times.append(metrics["time_ms"]["step"])
    mine = np.array([statistics.median(times),
                     state.tiers()["device"] + step.tracker.peak], np.float64)
    every = all_gather_host(group, mine).reshape(-1, 2)  # NCCL too: via the device
    return float(every[:, 0].max()), int(every[:, 1].max())


def _largest(params: object, units: Units) -> int:
    """The bytes of the largest unit gathered whole."""
    whole = make_layout(params, None, world_size=1, units=units)
    return max(sum(whole.leaves[i].size * np.dtype(whole.leaves[i].dtype).itemsize
                   for i in u.leaves) for u in whole.units)


def _name(units: Units) -> str:
    """A units candidate in the table: None, a depth, or a function's name."""
    return "-" if units is None else str(getattr(units, "__name__", units))


def _forever(loader: DataLoader) -> Iterator[object]:
    while True:
        yield from loader
