"""0/1 Adam: its schedule, the optimizer (:func:`zero_one_adam`) and the local
steps after the variance freezes (:class:`LocalSteps`).

[Note: 0/1 Adam]
0/1 Adam (Lu et al. 2022; DeepSpeed's ``ZeroOneAdam``) is Adam without bias
correction whose variance ``v`` is updated on fewer and fewer steps and whose
ranks talk less and less. Number the updates ``n = 1, 2, ...``.

Until ``var_freeze_step`` (phase one), update ``n`` *updates the variance*
when ``n`` is a multiple of the current interval ``I`` (1 at first; after
every ``var_update_scaler`` such updates it doubles): its gradients are
reduced exactly and ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``.
Every other update of phase one sends its gradients through the 1-bit
compressed all-reduce (:func:`ops._onebit.compressed_all_reduce`, with error
feedback) and updates ``m`` with that mean, ``v`` held. Each update then
moves ``p -= lr (m / (sqrt(v) + eps) + weight_decay p)``.

After ``var_freeze_step`` (phase two) ``v`` stays as it is and each rank
takes *local steps* on its own gradient, with no communication: ``m_i = b1
m_i + (1 - b1) g_i`` and the update above on its own params ``p_i``. Update
``n`` synchronises when ``n`` is a multiple of the local interval ``H`` (1
at first; doubled after every ``local_step_scaler`` updates of phase two, up
to ``local_step_clipper``): the ranks average ``d_i = (p_i - p_0) (sqrt(v) +
eps)``, the way each moved since the last synchronisation ``p_0`` in the
gradient's units, through the compressed all-reduce; then every rank sets
``m = -d / L`` (``L``: the learning rates summed since ``p_0``) and ``p =
p_0 + d / (sqrt(v) + eps)``, the same bits on every rank. With ``H = 1`` a
step sends one compressed all-reduce and nothing else: no gradients, no
params.

In a ZeRO 1-2 step (``shard.zero1``/``zero2`` on more than one rank) phase one
keeps every moment sharded, its compressed updates each rank's section of the
mean gradient. Phase two cannot: a local step moves every element of the
rank's own params, so each rank holds whole its params, their value at the
last synchronisation, its momentum and the frozen variance, all float32, and
the worker error (:class:`LocalSteps`): 20 bytes a parameter, as DeepSpeed's
0/1 Adam (which shards none of it) holds. The state's masters and moments are
those of the last synchronisation, written there; the rank's compute params
are its local ones. So a checkpoint, ``shard.gather`` and a resume see the
last synchronisation: the local steps since are dropped (the update count
keeps them), as the error buffers are, which DeepSpeed resets on a load and
at the freeze too.

As with 1-bit Adam, ``clip_norm=`` clips the reduced gradient of the
variance's updates and each rank's own where it is compressed or taken
locally, and a loss scale's overflow skips the step on every rank (the
step's one all-reduce carries each rank's sum of squares).

DeepSpeed counts its first call, which only sets up buffers, as a step, so
its ``n`` runs one ahead of ours; its schedule is the same in its own count.
On one rank nothing is exchanged: the update is Adam's without bias
correction with ``v`` updated on the schedule's steps and held after
``var_freeze_step``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ops._adam import fused_adam_multi
from ops._onebit import compressed_all_reduce
from ops._optim import (
    AdamState,
    FusedOptimizer,
    Schedule,
    ZeroOne,
    _adam_hyper,
    _adam_init,
    _adam_out,
    _flat_update,
    _optax_update,
    _rate,
)
from ops._types import Array
from ops.comm._base import Communicator
from ops.device._device import device_of

__all__ = ["LocalSteps", "local_interval", "synchronises", "updates_variance",
           "zero_one_adam"]


def updates_variance(spec: ZeroOne, n: int) -> bool:
    """Whether update ``n`` (from 1) updates the variance, its gradients
    reduced exactly (see [Note: 0/1 Adam])."""
    if n > spec.var_freeze_step:
        return False
    last, interval = 0, 1  # the interval's last variance update, and the interval
    while True:
        first = (last // interval + 1) * interval
        end = first + (spec.var_update_scaler - 1) * interval
        if n <= end:
            return n % interval == 0
        last, interval = end, interval * 2


def local_interval(spec: ZeroOne, n: int) -> int:
    """The local steps' interval ``H`` at update ``n`` of phase two."""
    doublings = (n - spec.var_freeze_step - 1) // spec.local_step_scaler
    if doublings >= spec.local_step_clipper.bit_length():
        return spec.local_step_clipper
    return min(spec.local_step_clipper, 1 << doublings)


def synchronises(spec: ZeroOne, n: int) -> bool:
    """Whether update ``n`` of phase two ends with the ranks' synchronisation."""
    return n % local_interval(spec, n) == 0


def _positive_int(fn: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{fn}: {name} must be an int >= 1; got {value!r}")
    return int(value)


def zero_one_adam(learning_rate: float | Schedule, var_freeze_step: int = 100000,
                  var_update_scaler: int = 16, local_step_scaler: int = 32678,
                  local_step_clipper: int = 16, b1: float = 0.9, b2: float = 0.999,
                  eps: float = 1e-8, weight_decay: float = 0.0) -> FusedOptimizer:
    """0/1 Adam (DeepSpeed's ``ZeroOneAdam``; see [Note: 0/1 Adam]).

    Adam without bias correction whose variance is updated on exponentially
    spaced updates until ``var_freeze_step``, then held. Under
    ``shard.zero1``/``zero2`` on more than one rank, the other updates of that
    phase send their gradients 1-bit compressed, and after it the ranks take
    local steps and synchronise every ``H`` updates through one compressed
    all-reduce; ``metrics["grad_norm"]`` is then the root mean square over
    ranks of each rank's own gradient norm. On its own (one process) it is
    the same update with this rank's gradient and nothing exchanged.

    Args:
      learning_rate: a float >= 0, or a schedule ``count -> lr``.
      var_freeze_step: the updates whose schedule may update the variance
        (DeepSpeed's ``var_freeze_step``), an int >= 1.
      var_update_scaler: the variance updates between doublings of their
        interval (the paper's kappa), an int >= 1.
      local_step_scaler: the updates after ``var_freeze_step`` between
        doublings of the local steps' interval, an int >= 1.
      local_step_clipper: the largest local steps' interval (the paper's H),
        an int >= 1.
      b1: in [0, 1), the momentum's.
      b2: in [0, 1), the variance's.
      eps: >= 0, added to ``sqrt(v)``.
      weight_decay: >= 0, decoupled.

    Examples:
      >>> import numpy as np, ops
      >>> opt = ops.zero_one_adam(1e-3, var_freeze_step=4, var_update_scaler=2)
      >>> params = {"w": np.ones(2, np.float32)}
      >>> state = opt.init(params)
      >>> for _ in range(6):  # the variance updated at updates 1, 2 and 4 only
      ...     params, state = opt.apply({"w": np.ones(2, np.float32)}, state, params)
      >>> int(state.count), round(float(state.nu["w"][0]), 6)  # 1 - 0.999 ** 3
      (6, 0.002997)
    """
    fn = "zero_one_adam"
    lr_at = _rate(fn, learning_rate)
    b1, b2, eps, weight_decay = _adam_hyper(fn, b1, b2, eps, weight_decay)
    spec = ZeroOne(_positive_int(fn, "var_freeze_step", var_freeze_step),
                   _positive_int(fn, "var_update_scaler", var_update_scaler),
                   _positive_int(fn, "local_step_scaler", local_step_scaler),
                   _positive_int(fn, "local_step_clipper", local_step_clipper), b1, eps,
                   weight_decay)

    def run(grads: object, state: AdamState, params: object, donate: bool, grad_scale: float | None,
            grad_sumsq: Array | None, max_norm: float | None, copies: object,
            finite: bool | None = None) -> tuple[object, AdamState]:
        count = int(state.count)
        flat = _flat_update(grads, state, params, copies, grad_sumsq, finite)
        if flat is None:
            return params, state  # overflow: nothing changes, the step is not counted
        leaves, treedef, g, m, v, c = flat
        betas = (b1, b2) if updates_variance(spec, count + 1) else (b1, 1.0)  # 1: v held
        out = fused_adam_multi(leaves, g, m, v, step=count + 1, lr=lr_at(count), betas=betas,
                               eps=eps, weight_decay=weight_decay, decoupled=True,
                               grad_scale=grad_scale, grad_sumsq=grad_sumsq, max_norm=max_norm,
                               param_copies=c, donate=donate, bias_correction=False)
        return _adam_out(treedef, out, count)

    update = _optax_update(fn, "for weight decay", run)

    def apply(grads: object, state: AdamState, params: object, *, grad_scale: float | None = None,
              grad_sumsq: Array | None = None, max_norm: float | None = None,
              param_copies: object = None, finite: bool | None = None,
              read_from: object = None) -> tuple[object, AdamState]:
        """Update params and moments in place (both donated), as ``ops.adamw``'s
        ``apply``."""
        if read_from is not None:
            raise NotImplementedError(f"{fn}: read_from= (offloaded state) is not supported")
        return run(grads, state, params, True, grad_scale, grad_sumsq, max_norm, param_copies,
                   finite)

    return FusedOptimizer(_adam_init, update, apply, lr_at, onebit=spec)


class LocalSteps:
    """One rank's part of 0/1 Adam after ``var_freeze_step`` (see [Note: 0/1
    Adam]), over flat float32 vectors, one per unit: the first ``sharded[u]``
    elements in W equal sections (exchanged compressed), the rest whole on
    every rank (exchanged exactly).

    Args:
      spec: the optimizer's :class:`~ops._optim.ZeroOne`.
      comm: the data ranks.
      params, exp_avg, exp_avg_sq: per unit, the whole vectors at the last
        synchronisation, the same on every rank; kept, not copied.
      sharded: per unit, the elements exchanged compressed (a multiple of W).
    """

    def __init__(self, spec: ZeroOne, comm: Communicator, params: list[Any],
                 exp_avg: list[Any], exp_avg_sq: list[Any], sharded: list[int]) -> None:
        w = comm.world_size
        if any(n % w for n in sharded):
            raise ValueError(f"LocalSteps: the compressed parts {sharded} must be multiples of "
                             f"the {w} ranks")
        self.spec, self.comm, self.sharded = spec, comm, sharded
        self.params, self.exp_avg, self.exp_avg_sq = params, exp_avg, exp_avg_sq
        self.start = [p.copy() for p in params]
        xp = device_of(params[0]).xp if params else np
        self.worker = [xp.zeros(n, dtype=np.float32) for n in sharded]
        self.server = [xp.zeros(n // w, dtype=np.float32) for n in sharded]
        self.rates = 0.0  # the learning rates summed since the last synchronisation

    def local(self, grads: list[Array], lr: float) -> None:
        """A local step on this rank's mean gradients (per unit, whole)."""
        s = self.spec
        fused_adam_multi(self.params, grads, self.exp_avg, self.exp_avg_sq, step=1, lr=lr,
                         betas=(s.b1, 1.0), eps=s.eps, weight_decay=s.weight_decay,
                         decoupled=True, bias_correction=False)
        self.rates += lr

    def synchronise(self) -> None:
        """The ranks agree on the momentum and the params (a collective)."""
        eps = np.float32(self.spec.eps)
        for u, (p, m, v, p0) in enumerate(zip(self.params, self.exp_avg, self.exp_avg_sq,
                                              self.start, strict=True)):
            xp, k = device_of(p).xp, self.sharded[u]
            root = xp.sqrt(v)
            root += eps
            d = p - p0
            d *= root  # the way this rank moved, in the gradient's units
            if k:
                compressed_all_reduce(self.comm, d[:k], self.worker[u], self.server[u])
            if d.size > k:
                self.comm.all_reduce_(d[k:], "mean")
            if self.rates > 0:
                m[...] = d * np.float32(-1.0 / self.rates)
            else:  # no rate since the last synchronisation: no way moved; the momenta's mean
                self.comm.all_reduce_(m, "mean")
            d /= root
            d += p0
            p[...] = d
            p0[...] = d
        self.rates = 0.0
