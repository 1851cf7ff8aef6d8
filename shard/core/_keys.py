"""Random keys for a JAX loss: one per data rank, step and micro-batch.

[Note: per-rank keys]
Dropout, stochastic depth and other randomness inside a JAX loss want a key
that differs on every data rank (ranks that drew the same masks over
different rows would not be the samples one process of the global batch
draws), on every step and every micro-batch, and that a run resumed from a
checkpoint draws again. ``zero3(loss_fn, ..., key=jax.random.key(0))`` gives
the loss a keyword argument ``key``:

    loss_fn(params, batch, *, key)                 # -> loss
    loss_fn(params, batch, model_state, *, key)    # with a model state

where ``key`` is :func:`step_key` of the given key, the state's step count,
the data rank and the micro-batch: ``fold_in(fold_in(fold_in(key, step),
rank), micro_batch)``. The data rank counts the replicas (HSDP: replica
``r``'s rank ``k`` is ``r * S + k`` for ``S`` ranks a replica); the model
ranks of one data rank see the same batch and get the same key. The key is
configuration, as the learning rate is: the step count is in the state and
its checkpoints, so a run resumed with the same ``key=`` draws the same keys.
A typed key (``jax.random.key``) reaches the loss typed, a raw one
(``jax.random.PRNGKey``) raw; inside the step it travels as its raw data,
beside the batch, so every path (one program, the traced units of stage 3,
micro-batches) carries it unchanged. ``evaluate`` hands the loss the key of
the step's first micro-batch (a loss in eval mode draws nothing).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["check_key", "derived_key", "keyed", "step_key"]


def check_key(name: str, key: Any) -> tuple[np.ndarray, str | None]:
    """``key=``'s raw data (uint32, on the host) and its implementation's name
    (None for a raw key); a TypeError naming ``key=`` for anything else."""
    import jax

    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise TypeError(f"{name}: key= must be one key; got an array of keys of shape "
                            f"{key.shape}")
        return np.asarray(jax.random.key_data(key)), str(jax.random.key_impl(key))
    data = np.asarray(key) if isinstance(key, (jax.Array, np.ndarray)) else None
    if data is None or data.dtype != np.uint32 or data.ndim != 1:
        raise TypeError(f"{name}: key= must be a JAX PRNG key (jax.random.key(0), or a raw "
                        f"jax.random.PRNGKey(0)); got {type(key).__name__}"
                        f"{'' if data is None else f' of dtype {data.dtype}, shape {data.shape}'}")
    return data, None


def step_key(key: Any, *, step: int, rank: int, micro_batch: int = 0) -> Any:
    """The key a step hands its loss (see [Note: per-rank keys]): ``key``
    folded with the step count, the data rank and the micro-batch.

    Example:
      >>> import jax, shard
      >>> k = shard.step_key(jax.random.key(0), step=3, rank=1)
      >>> bool((jax.random.key_data(k) != jax.random.key_data(
      ...     shard.step_key(jax.random.key(0), step=3, rank=0))).any())
      True
    """
    for what, v in (("step", step), ("rank", rank), ("micro_batch", micro_batch)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"step_key: {what} must be an int >= 0; got {v!r}")
    return _fold(key, np.asarray([step, rank, micro_batch], np.uint32))


def derived_key(data: np.ndarray, impl: str | None, *, step: int, rank: int,
                micro_batch: int) -> np.ndarray:
    """:func:`step_key` on raw key data: the derived key's raw data (host)."""
    import jax

    key = data if impl is None else jax.random.wrap_key_data(data, impl=impl)
    out = _fold(key, np.asarray([step, rank, micro_batch], np.uint32))
    return np.asarray(out if impl is None else jax.random.key_data(out))


def _fold(key: Any, values: np.ndarray) -> Any:
    import jax

    global _FOLD
    if _FOLD is None:
        _FOLD = jax.jit(lambda k, v: jax.random.fold_in(jax.random.fold_in(
            jax.random.fold_in(k, v[0]), v[1]), v[2]))
    return _FOLD(key, values)


_FOLD: Any = None


def keyed(fn: Callable[..., Any], impl: str | None) -> Callable[..., Any]:
    """``fn(params, batch, *rest, key=key)`` as a loss of ``(batch, raw key
    data)`` (and ``*rest``: a model state), the key rewrapped as typed where
    ``impl`` names one. One wrapper per ``(fn, impl)``, so the compiled
    programs of the loss are shared (see ``JaxLoss.shared``)."""
    with _LOCK:
        try:
            by_impl = _KEYED.setdefault(fn, {})
        except TypeError:  # cannot be weakly referenced: its own wrapper
            return _wrap(fn, impl)
        if impl not in by_impl:
            by_impl[impl] = _wrap(fn, impl)
        return by_impl[impl]


def _wrap(fn: Callable[..., Any], impl: str | None) -> Callable[..., Any]:
    def loss(params: Any, batch_and_key: Any, *rest: Any) -> Any:
        import jax

        batch, data = batch_and_key
        key = data if impl is None else jax.random.wrap_key_data(data, impl=impl)
        return fn(params, batch, *rest, key=key)

    return loss


_KEYED: weakref.WeakKeyDictionary[Any, dict[str | None, Callable[..., Any]]] = \
    weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
