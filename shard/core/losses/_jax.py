"""A JAX function as the step's loss: :class:`JaxLoss` (its jitted, loss-scaled
value and gradient, shared by every step and thread rank of the function),
the checks of what it returns, a loss with a model state ([Note: model
state]), and which of the forms a loss is (:func:`classify`)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from ops.comm._programs import SharedJit
from shard.core._data_rank import unbound_axis
from shard.core._protocol import LossProvider
from shard.core.losses._layered import Layered

__all__ = ["JaxLoss", "classify"]


class JaxLoss(LossProvider):
    """A monolithic JAX loss with a jitted, loss-scaled value_and_grad. With
    ``has_aux`` the function returns ``(loss, aux)``, as for
    ``jax.value_and_grad(..., has_aux=True)``, and so does ``value_and_grad``'s
    loss. :meth:`shared` gives every step of one function the same object, so
    thread ranks and later steps share its compiled programs."""

    @classmethod
    def shared(cls, fn: Callable[..., object], has_aux: bool = False) -> JaxLoss:
        """The one ``JaxLoss`` of ``fn`` (made on first use; a function that
        cannot be weakly referenced gets its own)."""
        with _SHARED_LOCK:
            try:
                by_aux = _SHARED.setdefault(fn, {})
            except TypeError:
                return cls(fn, has_aux)
            if has_aux not in by_aux:
                by_aux[has_aux] = cls(fn, has_aux)
            return by_aux[has_aux]

    @classmethod
    def with_state(cls, fn: Callable[..., object], has_aux: bool = False) -> JaxLoss:
        """The one ``JaxLoss`` of a loss with a model state (see [Note: model
        state]): ``fn(params, batch, model_state)`` seen as a loss of
        ``(batch, model_state)`` whose aux is ``(new_model_state, aux)``."""
        with _SHARED_LOCK:
            try:
                by_kind = _SHARED.setdefault(fn, {})
            except TypeError:
                return cls(_threading_state(fn, has_aux), True)
            key = ("model_state", has_aux)
            if key not in by_kind:
                by_kind[key] = cls(_threading_state(fn, has_aux), True)
            return by_kind[key]

    def __init__(self, fn: Callable[..., object], has_aux: bool = False) -> None:
        import jax

        self.fn, self.has_aux = fn, has_aux

        def scaled(p: object, b: object, s: jax.Array) -> object:
            loss, aux = split_aux(fn(p, b), has_aux)
            check_scalar(loss)
            return (loss * s, aux) if has_aux else loss * s

        # compiled once for every rank and loss object whose program is the same
        # (see [Note: one program for a group's ranks] in ops/comm/_xla.py)
        self._vg_fn = jax.value_and_grad(scaled, has_aux=has_aux)
        self._vg = SharedJit(self._vg_fn)
        # the loss, and with has_aux (loss, aux): for ZeroStep.evaluate
        self.loss_value = SharedJit(lambda p, b: _checked(split_aux(fn(p, b), has_aux),
                                                          has_aux))

    counts_flops = "xla"

    def program_flops(self, params: object, batch: object) -> float:
        """The FLOPs of the jitted value and gradient (see [Note: model FLOPs])."""
        import jax

        from shard.monitor._flops import xla_flops

        return xla_flops(jax.jit(self._vg_fn), params, batch, 1.0)

    def value_and_grad(self, params: object, batch: object,
                       loss_scale: float = 1.0) -> tuple[Any, Any]:
        try:  # no cost on the step's path unless it raises
            out, grads = self._vg(params, batch, loss_scale)
        except NameError as e:
            refused = unbound_axis(e, "the ZeRO step")
            if refused is None:
                raise
            raise refused from e
        if self.has_aux:  # stays jax arrays: no host read
            return (out[0] / loss_scale, out[1]), grads
        return out / loss_scale, grads


def split_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """A loss function's result as ``(loss, aux)`` (aux None without
    ``has_aux``); a TypeError that says which was expected otherwise."""
    pair = isinstance(out, (tuple, list))
    if has_aux and not (pair and len(out) == 2):
        raise TypeError(f"has_aux=True: the loss must return (loss, aux); got "
                        f"{type(out).__name__}")
    if not has_aux and pair:
        raise TypeError(f"the loss returned a {type(out).__name__} of {len(out)}; a loss that "
                        "returns (loss, aux) needs has_aux=True in the transform")
    return (out[0], out[1]) if has_aux else (out, None)


_SHARED: weakref.WeakKeyDictionary[
    Callable[..., object], dict[bool | tuple[str, bool], JaxLoss]] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def _threading_state(fn: Callable[..., object], has_aux: bool) -> Callable[..., object]:
    """[Note: model state]
    A model's non-trainable state (batch-norm statistics) lives in the train
    state (``step.init(params, model_state=...)``, ``state.model_state``).
    The loss then takes it as a third argument and returns the new one:
    ``loss_fn(params, batch, model_state) -> (loss, new_model_state)``, or
    ``(loss, (new_model_state, aux))`` with ``has_aux`` (as a flax or haiku
    loss returns its updated collections through ``value_and_grad``'s aux).
    Inside the step the pair ``(batch, model_state)`` is the loss's batch and
    ``(new_model_state, aux)`` its aux, so every path (a monolithic program,
    the traced units at stage 3, micro-batches) carries it unchanged: each
    micro-batch starts from the state the one before returned. After the
    step every rank holds the mean over the data ranks of its floating-point
    leaves and rank 0's other leaves, so the state stays the same everywhere
    (a running mean averaged so is the running mean of the global batch; a
    running variance is the mean of the ranks' variances). Within a forward
    each rank normalises with its own batch's statistics, as torch's
    ``BatchNorm`` under DDP does; statistics of the global batch inside the
    forward (torch's ``SyncBatchNorm``) are a step's given ``axis_name``,
    which the loss's ``jax.lax.pmean`` reduces over (see [Note: the data axis
    in the loss] in ``shard/core/_data_rank.py``). It is checkpointed beside
    the params."""

    def loss(params: object, batch_and_state: Any) -> object:
        import jax

        batch, model_state = batch_and_state
        # rebuilt here, inside the differentiated function, so that containers
        # that remember the trace that made them (flax nnx Variables) accept
        # the updates the loss makes: nnx.merge(graphdef, params, stats) as written
        model_state = jax.tree_util.tree_map(lambda x: x, model_state)
        out = fn(params, batch, model_state)
        what = "(loss, (new_model_state, aux))" if has_aux else "(loss, new_model_state)"
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"with a model state the loss must return {what}; got "
                            f"{type(out).__name__}")
        value, rest = out
        if not has_aux:
            return value, (rest, None)
        if not (isinstance(rest, (tuple, list)) and len(rest) == 2):
            raise TypeError(f"with a model state and has_aux=True the loss must return {what}")
        return value, (rest[0], rest[1])

    return loss


def _checked(pair: tuple[object, object], has_aux: bool) -> object:
    check_scalar(pair[0])
    return pair if has_aux else pair[0]


def check_scalar(value: object) -> None:
    """A TypeError unless the loss's value is a scalar (before JAX's own, which
    does not say what to do)."""
    shape = getattr(value, "shape", ())
    if tuple(shape) != ():
        raise TypeError(f"the loss must return a scalar; it returned shape {tuple(shape)} "
                        "(reduce it, for example with .mean())")


def classify(loss_fn: object) -> str:
    """'layered', 'provider' or 'jax'; a TypeError for anything else."""
    if isinstance(loss_fn, Layered):
        return "layered"
    if isinstance(loss_fn, LossProvider) or callable(getattr(loss_fn, "value_and_grad", None)):
        return "provider"
    if callable(loss_fn):
        return "jax"
    raise TypeError(f"loss_fn must be a JAX function (params, batch) -> loss, a shard.Layered, or "
                    f"an object with value_and_grad(params, batch); got {type(loss_fn).__name__}")
