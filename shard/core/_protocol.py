"""What a ZeRO step asks of a loss object: :class:`LossProvider`.

[Note: the loss protocol]
A step takes a JAX function, a :class:`shard.Layered`, or a loss object: the
torch adapter's (``interop.torch.functional`` and ``layered``), a pipeline
stage (``shard.pipeline``), or a user's own object with
``value_and_grad(params, batch)``. Everything the step reads from a loss is a
member of :class:`LossProvider`, each with a default that means "this loss does
not do that" (a JAX function's answer), so the step reads members and never
asks whether one exists. The library's loss objects subclass it and override
what they do; a plain JAX function is wrapped in ``JaxLoss``, a ``Layered`` is
one, and a user's object that is not is wrapped in :class:`Provided`, which
answers ``value_and_grad`` from it and the defaults for the rest.

What the step hands a loss is explicit too: ``claim(comm)`` at ``init``
(the rank a torch module serves); around each of its calls, ``configured``
with the transform's ``has_aux=`` and the precision policy's
``cast_forward_inputs`` (a context: nothing of the step's options stays on
the loss object afterwards, so two steps may share one and ask differently);
and, per call, the params, the batch, the loss scale, or, unit by unit, the
units and the gradient reducer (``run_units``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import jax
    import numpy as np

    from ops import Communicator, Device
    from ops._types import Array
    from shard.core._layout import Layout

__all__ = ["GradSink", "LossProvider", "Provided", "UnitSource"]


class UnitSource(Protocol):
    """What ``run_units`` reads of the step's units (``shard.step``'s ``Units``):
    each unit's whole params as one flat buffer, and its leaves as views of it."""

    @property
    def full_layout(self) -> Layout: ...

    @property
    def device(self) -> Device: ...

    def flat(self, u: int, upcoming: Sequence[int] = (), *, pinned: bool = False) -> Array: ...

    def leaf_views(self, u: int, flat: Array) -> list[Array]: ...


class GradSink(Protocol):
    """What ``run_units`` hands a unit's gradients to (``shard.step``'s reducers)."""

    # Any: the state's device arrays, torch tensors or jax arrays on it, or None
    def add(self, u: int, grads: list[Any]) -> None: ...


class LossProvider:
    """The members a ZeRO step reads from a loss; each default is a plain JAX
    function's (see [Note: the loss protocol])."""

    # -- the model --------------------------------------------------------------
    #: One entry per layer, for a loss made of layers (``Layered``, a pipeline's).
    #: (Any: a Layered's JAX functions, the torch adapter's modules; each reads its own)
    layers: Sequence[Any] = ()
    #: The model's units (a callable from a leaf's key path to its unit key, as
    #: ``units=``), when the loss knows them (a torch module's modules).
    units: Callable[[tuple], Hashable] | None = None
    #: A torch module split by ``interop.torch.parallelize``: its TensorParallel.
    # Any: a shard.TensorParallel, a layer above this one
    tensor_parallel: Any = None
    #: Whether the loss may return ``(loss, aux)`` (the transforms' ``has_aux``).
    supports_aux: bool = False

    @property
    def frozen(self) -> frozenset[str] | None:
        """Names of the top-level leaves that do not train (``requires_grad=False``)."""
        return None

    @property
    def jax_batch(self) -> bool:
        """Whether the step casts the batch under a precision policy (a JAX batch)."""
        return False

    # -- a pipeline stage --------------------------------------------------------
    #: Leaves (by index) the norm counts elsewhere: copies of a tied weight.
    norm_skip: tuple[int, ...] = ()

    @property
    def norm_comm(self) -> Communicator | None:
        """The communicator over the whole mesh that norms and loss sums span (a
        pipeline stage's), or None."""
        return None

    @property
    def data_axis(self) -> Communicator | None:
        """A pipeline stage's data axis, on which its ZeRO step must run, or None."""
        return None

    # -- gradients the loss did not give (see [Note: missing gradients]) ----------
    #: Whether the loss reports the trainable leaves that got no gradient.
    reports_missing: bool = False
    #: Those leaves (by index) in its last call.
    missing: frozenset[int] = frozenset()

    # -- module state, checkpoints and meta-device init --------------------------
    #: ``() -> (buffers, dtypes)``: a torch module's buffers for a checkpoint.
    module_state: Callable[[], tuple[dict[str, np.ndarray], dict[str, str]]] | None = None
    #: ``(buffers, where) -> None``: a checkpoint's buffers into the module.
    load_buffers: Callable[[dict[str, np.ndarray], str], None] | None = None
    #: ``() -> params of ShapeDtypeStruct``: what a checkpoint must hold.
    params_like: Callable[[], dict[str, jax.ShapeDtypeStruct]] | None = None
    #: ``(paths) -> values``: a meta-device module's units, materialised.
    materialize: Callable[[list[tuple]], list[Any]] | None = None

    @property
    def materialize_device(self) -> Device | None:
        """Where ``materialize`` puts them (an ``ops.Device``), or None."""
        return None

    # -- running -----------------------------------------------------------------
    #: ``(units, reducer, batch, scale) -> loss``: a step unit by unit, each
    #: unit gathered where it is used and its gradient handed to the reducer.
    run_units: Callable[..., object] | None = None
    #: ``(units, batch) -> loss``: the same forward without gradients.
    loss_units: Callable[..., object] | None = None
    #: ``(params, batch) -> loss``: the loss alone, without gradients.
    loss_value: Callable[..., object] | None = None

    # -- FLOPs (see [Note: model FLOPs]) -------------------------------------------
    #: How the step counts the loss's FLOPs: ``"xla"`` (``program_flops``),
    #: ``"torch"`` (torch's FlopCounterMode around its run), or None (not counted).
    counts_flops: str | None = None

    def program_flops(self, params: object, batch: object) -> float:
        """The FLOPs of the loss's value and gradient at ``params`` (arrays or
        ``jax.ShapeDtypeStruct``) and ``batch``, from its compiled program."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled program to count")

    # -- a pipeline's layers (``shard.pipeline`` takes a loss with ``layers``) ----
    #: ``(units, layers, *, checkpointing) -> runner``: a stage of torch
    #: modules (``interop.torch.layered``'s); None runs JAX layers.
    make_stage: Callable[..., Any] | None = None
    #: ``(batch, repeats) -> seconds per layer``: measured by the loss itself.
    layer_times: Callable[..., list[float]] | None = None

    def value_and_grad(self, params: Any, batch: object, loss_scale: float = 1.0) -> Any:
        """``(loss, grads)`` of ``loss_scale * loss`` at the whole ``params``."""
        raise NotImplementedError(f"{type(self).__name__} runs unit by unit (run_units); it "
                                  "has no gradients of whole params in one call")

    def hooks_usable(self, comm: Communicator) -> bool:
        """Whether ``run_units`` may run collectives inside the backward on ``comm``."""
        return True

    def claim(self, comm: Communicator) -> None:
        """Bind the loss to ``comm``'s rank (``init`` calls it); by default nothing."""

    def configured(self, *, has_aux: bool,
                   cast_forward_inputs: bool) -> AbstractContextManager[object]:
        """A context in which the loss runs as one step asks: its ``has_aux``
        (for a loss object that splits ``(loss, aux)`` itself,
        ``supports_aux``) and its precision policy's ``cast_forward_inputs``
        (for a loss that casts its own inputs, a torch module's); by default
        nothing."""
        return nullcontext()

    def layout_dependent(self) -> str | None:
        """What of the loss, besides its gradients, depends on how the batch is
        split over ranks (a torch module's running statistics, or its random
        draws from torch's generator), named; None by default. ``invariant_shards=``
        refuses such a loss."""
        return None

    def evaluating(self) -> AbstractContextManager[object]:
        """A context in which the loss runs in eval mode (a torch module's)."""
        return nullcontext()


class Provided(LossProvider):
    """A user's loss object with ``value_and_grad(params, batch)`` and nothing
    else the step reads: its ``value_and_grad``, the defaults for the rest."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def value_and_grad(self, params: object, batch: object, loss_scale: float | None = None) -> Any:
        """The object's own, given ``loss_scale`` where the step gives one."""
        if loss_scale is None:
            return self.obj.value_and_grad(params, batch)
        return self.obj.value_and_grad(params, batch, loss_scale=loss_scale)
