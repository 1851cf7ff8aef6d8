"""1-bit Adam: the sign compression with error feedback, the compressed
all-reduce of the momentum, and the optimizer (:func:`onebit_adam`).

[Note: 1-bit Adam]
1-bit Adam (Tang et al. 2021; DeepSpeed's ``OneBitAdam``) runs Adam without
bias correction for ``freeze_step`` steps, then freezes the second moment
``v`` and stops reducing gradients: each rank folds its own gradient into the
momentum, ``m_i = b1 m + (1 - b1) g_i``, and the ranks agree on the mean of
the ``m_i`` through a compressed all-reduce, each of whose two hops sends one
bit per element and a scale. The update is then ``p -= lr (m / (sqrt(v) +
eps) + weight_decay p)`` with the frozen ``v``.

The compressed all-reduce (:func:`compressed_all_reduce`) is DeepSpeed's, in
the reduce-scatter and all-gather shape of ZeRO: each rank adds its *worker
error* to its momentum, compresses every rank's section of it (a bit an
element, 1 for ``>= 0``, and a scale, the root mean square of each group of
256 elements: :func:`sign_compress`), keeps what the compression lost as the
new worker error, and sends each rank its section (an all-to-all). Each rank
averages the W sections it received, in rank order in float32, adds its
*server error*, compresses that the same way, keeps the loss as the new
server error, and the ranks all-gather the compressed sections. Every rank
decompresses the same bits, so all hold the same momentum. DeepSpeed scales
by one root mean square per tensor and section; a scale per 256 elements
loses less for 1/8 bit an element more. A rank sends ``2 (W - 1) (k / 8 +
4 k / 256)`` bytes for sections of ``k`` elements, 1/28 of float32's
all-reduce.

In the compressed phase no rank holds the summed gradient, so a clip
(``clip_norm=``) clips each rank's own before it is folded in, as
DeepSpeed's engine does once its reduction is switched off; a loss scale's
overflow shows in the agreed momentum (every rank's sum of squares), which
skips the step on every rank. Each rank's gradients are summed in float32
there, whatever dtype the exact steps reduce in.

The worker error is as large as the momentum it corrects and differs on every
rank; the server error is one section. Like DeepSpeed, which resets them
when it loads a checkpoint (having found on BERT pre-training that an
occasional reset does not change the convergence), the ZeRO step keeps them
outside the train state and starts them from zero after a resume or a
skipped update; the agreed momentum is the optimizer's ``exp_avg``, sharded
like the other moments.

Every rank decompresses the same momentum, so in a ZeRO 1-2 step every rank
updates its whole params from it alike, as DeepSpeed's 1-bit Adam (which
shards nothing) does, and no params are all-gathered after the warm-up: each
rank keeps the whole params, the frozen variance and the update's scratch in
float32 from ``freeze_step`` on (the first compressed step gathers them
once), 12 bytes a parameter beside the agreed momentum and the worker error
(8 more), and writes its sections into the state's masters and ``exp_avg``.
The compressed all-reduce is then all a step sends.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from ops._adam import fused_adam_multi
from ops._optim import (
    AdamState,
    FusedOptimizer,
    OneBit,
    Schedule,
    _adam_hyper,
    _adam_init,
    _adam_out,
    _flat_update,
    _optax_update,
    _rate,
)
from ops._types import Array
from ops.comm._base import Communicator
from ops.device._arrays import array_kind, check_array, driver_for
from ops.device._device import device_of
from ops.kernels._table import QUANT_GROUP, TABLE

_A = TypeVar("_A", bound=Array)

__all__ = ["compressed_all_reduce", "onebit_adam", "sign_add", "sign_compress"]


def sign_compress(x: Array, error: Array, bits: Array | None = None,
                  scales: Array | None = None) -> tuple[Array, Array]:
    """One bit per element of ``y = x + error``, and a scale per group of 256,
    its root mean square; ``error`` becomes ``y`` minus what the bits and
    scales read back (:func:`sign_add`). The same bits on the CPU and a GPU.

    Args:
      x: float32, flat.
      error: float32 of ``x``'s size, updated in place.
      bits, scales: optional outputs: ``ceil(n / 8)`` uint8 (element ``8i +
        j`` at bit ``j`` of byte ``i``: 1 where ``y >= 0``) and ``ceil(n /
        256)`` float32.

    Returns:
      ``(bits, scales)``.

    Examples:
      >>> import numpy as np, ops._onebit as ob
      >>> err = np.zeros(3, np.float32)
      >>> bits, scales = ob.sign_compress(np.array([3.0, -4.0, 0.0], np.float32), err)
      >>> int(bits[0]), round(float(scales[0]), 4), [round(e, 4) for e in err.tolist()]
      (5, 2.8868, [0.1132, -1.1132, -2.8868])
    """
    n, kind = x.size, array_kind(x)
    check_array("sign_compress", "x", x, dtypes=("f32",), shape=(n,))
    check_array("sign_compress", "error", error, dtypes=("f32",), shape=(n,), writeable=True,
                kind=kind)
    xp = device_of(x).xp
    bits = xp.empty(-(-n // 8), dtype=np.uint8) if bits is None else bits
    scales = xp.empty(-(-n // QUANT_GROUP), dtype=np.float32) if scales is None else scales
    if n:
        driver_for(kind).elementwise(TABLE["zs_sign_compress"], n, (x, error, bits, scales, n))
    return bits, scales


def sign_add(bits: Array, scales: Array, y: _A, weight: float = 1.0) -> _A:
    """``y += sign * (scale * weight)`` for the bits and scales of
    :func:`sign_compress` (``y`` float32, flat, of the compressed size)."""
    check_array("sign_add", "y", y, dtypes=("f32",), writeable=True, kind=array_kind(bits))
    if y.size:
        driver_for(array_kind(y)).elementwise(TABLE["zs_sign_add"], y.size,
                                              (bits, scales, y, y.size, weight))
    return y


def compressed_all_reduce(comm: Communicator, x: _A, worker_error: Array,
                          server_error: Array) -> _A:
    """``x`` becomes every rank's ``x`` averaged through 1-bit compression with
    error feedback, in place (see [Note: 1-bit Adam]); every rank ends with
    the same values.

    Args:
      comm: this rank's communicator (W ranks).
      x: float32, flat, ``W k`` elements: rank r's section is ``x[r k:(r + 1) k]``.
      worker_error: float32 like ``x``, this rank's, updated in place.
      server_error: float32, ``k`` elements, this rank's section's, updated in place.
    """
    w = comm.world_size
    if x.size % w or server_error.size != x.size // w or worker_error.size != x.size:
        raise ValueError(f"compressed_all_reduce on rank {comm.rank}: {x.size} elements over "
                         f"{w} ranks need a worker error of {x.size} and a server error of "
                         f"{x.size // w} (whole sections); got {worker_error.size} and "
                         f"{server_error.size}")
    if w == 1:
        return x
    xp, k = device_of(x).xp, x.size // w
    nb, ng = -(-k // 8), -(-k // QUANT_GROUP)
    bits, scales = xp.empty(w * nb, dtype=np.uint8), xp.empty(w * ng, dtype=np.float32)
    for r in range(w):  # the worker's compression, section by section
        sign_compress(x[r * k:(r + 1) * k], worker_error[r * k:(r + 1) * k],
                      bits[r * nb:(r + 1) * nb], scales[r * ng:(r + 1) * ng])
    got_bits, got_scales = xp.empty(w * nb, dtype=np.uint8), xp.empty(w * ng, np.float32)
    comm.all_to_all_into(got_bits, bits)
    comm.all_to_all_into(got_scales, scales)
    mean = xp.zeros(k, dtype=np.float32)  # the server's: its section's mean, in rank order
    for r in range(w):
        sign_add(got_bits[r * nb:(r + 1) * nb], got_scales[r * ng:(r + 1) * ng], mean, 1.0 / w)
    mine = sign_compress(mean, server_error)
    comm.all_gather_into(bits, mine[0])
    comm.all_gather_into(scales, mine[1])
    x[...] = 0
    for r in range(w):
        sign_add(bits[r * nb:(r + 1) * nb], scales[r * ng:(r + 1) * ng], x[r * k:(r + 1) * k])
    return x


def onebit_adam(learning_rate: float | Schedule, freeze_step: int = 100000, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0) -> FusedOptimizer:
    """1-bit Adam (DeepSpeed's ``OneBitAdam``; see [Note: 1-bit Adam]).

    The first ``freeze_step`` updates are Adam's without bias correction,
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, ``p -= lr (m /
    (sqrt(v) + eps) + weight_decay p)``; after them ``v`` stays as it is.
    Under ``shard.zero1``/``zero2`` on more than one rank, the steps after
    ``freeze_step`` send no gradients and gather no params: the ranks agree
    on the momentum through :func:`compressed_all_reduce` and each updates
    its whole params from it, and the step's ``metrics["grad_norm"]`` is then
    that momentum's norm. On its own (one process) it is the same update with
    this rank's gradient.

    Args:
      learning_rate: a float >= 0, or a schedule ``count -> lr``.
      freeze_step: the updates before the variance freezes (DeepSpeed's
        ``freeze_step``), an int >= 1.
      b1: in [0, 1), the momentum's.
      b2: in [0, 1), the variance's (during the warm-up).
      eps: >= 0, added to ``sqrt(v)``.
      weight_decay: >= 0, decoupled.

    Examples:
      >>> import numpy as np, ops
      >>> opt = ops.onebit_adam(1e-3, freeze_step=2)
      >>> params = {"w": np.ones(3, np.float32)}
      >>> state = opt.init(params)
      >>> for _ in range(3):
      ...     params, state = opt.apply({"w": np.ones(3, np.float32)}, state, params)
      >>> int(state.count), round(float(state.nu["w"][0]), 6)  # 1 - 0.999 ** 2: held
      (3, 0.001999)
    """
    fn = "onebit_adam"
    lr_at = _rate(fn, learning_rate)
    b1, b2, eps, weight_decay = _adam_hyper(fn, b1, b2, eps, weight_decay)
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(f"{fn}: freeze_step must be an int >= 1; got {freeze_step!r}")

    def run(grads: object, state: AdamState, params: object, donate: bool, grad_scale: float | None,
            grad_sumsq: Array | None, max_norm: float | None, copies: object,
            finite: bool | None = None, momentum: bool = False) -> tuple[object, AdamState]:
        count = int(state.count)
        frozen = count >= freeze_step
        if momentum and not frozen:
            raise ValueError(f"{fn}: momentum=True is for the updates after freeze_step "
                             f"({freeze_step}); this is update {count + 1}")
        flat = _flat_update(grads, state, params, copies, grad_sumsq, finite)
        if flat is None:
            return params, state  # overflow: nothing changes, the step is not counted
        leaves, treedef, g, m, v, c = flat
        # after freeze_step v stays (beta2 = 1); with momentum=True the grads are
        # the momentum itself (beta1 = 0), already averaged: no scale, no clip
        betas = ((0.0 if momentum else b1, 1.0) if frozen else (b1, b2))
        out = fused_adam_multi(leaves, g, m, v, step=count + 1, lr=lr_at(count), betas=betas,
                               eps=eps, weight_decay=weight_decay, decoupled=True,
                               grad_scale=None if momentum else grad_scale,
                               grad_sumsq=grad_sumsq, max_norm=None if momentum else max_norm,
                               param_copies=c, donate=donate, bias_correction=False)
        return _adam_out(treedef, out, count)

    update = _optax_update(fn, "for weight decay", run)

    def apply(grads: object, state: AdamState, params: object, *, grad_scale: float | None = None,
              grad_sumsq: Array | None = None, max_norm: float | None = None,
              param_copies: object = None, finite: bool | None = None, read_from: object = None,
              momentum: bool = False) -> tuple[object, AdamState]:
        """Update params and moments in place (both donated), as ``ops.adamw``'s
        ``apply``. ``momentum=True``: after ``freeze_step``, ``grads`` are the
        momentum the ranks agreed on (the ZeRO step's compressed phase)."""
        if read_from is not None:
            raise NotImplementedError(f"{fn}: read_from= (offloaded state) is not supported")
        return run(grads, state, params, True, grad_scale, grad_sumsq, max_norm, param_copies,
                   finite, momentum)

    return FusedOptimizer(_adam_init, update, apply, lr_at, onebit=OneBit(freeze_step, b1))
