"""Megatron's tensor-parallel building blocks as differentiable JAX functions.

[Note: tensor-parallel collectives]
A tensor-parallel layer splits its matrices over the ``model`` ranks; what
joins the pieces is a collective in the forward and its conjugate in the
backward (Megatron-LM, Shoeybi et al. 2019, section 3):

==================  =====================  =========================
function            forward                backward
==================  =====================  =========================
``copy``   (f)      identity               all-reduce
``reduce`` (g)      all-reduce             identity
``gather``          all-gather             this rank's slice
``scatter``         this rank's slice      all-gather
``gather_sequence`` all-gather             reduce-scatter
``reduce_scatter``  reduce-scatter         all-gather
==================  =====================  =========================

Each collective is a ``jax.custom_vjp`` whose forward and backward call the
rank's :class:`ops.Communicator` through an *ordered*
``jax.experimental.io_callback``: JAX keeps the calls in program order and
never drops or duplicates them, so every model rank issues the same
collectives in the same order (the communicator's contract) whatever XLA
schedules around them. They run inside ``jax.jit`` and ``jax.grad`` on thread
ranks and on processes (gloo) alike; at one model rank they are the identity
and no callback is traced. A callback's arrays are host arrays: on a backend
that moves device memory only (NCCL) each collective copies them to the
communicator's device and the result back (``_on_comm``), so a loss can be
tensor-parallel while the ZeRO state lives on GPUs.

The vocabulary-parallel loss never gathers the logits: each rank holds the
logits of its slice of the vocabulary, and the softmax's maximum (an
all-reduce of a max, outside the gradient: the result does not depend on it)
and its two sums (the target's logit and the exponentials, one all-reduce of
both) are the only traffic, ``3 * tokens`` numbers per rank, against
``tokens * vocab`` for the gathered logits. Its gradient is the one autodiff
takes through ``reduce``: ``softmax - onehot`` on each rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import numpy as np

from ops import Communicator
from ops.comm._collectives import to_comm
from ops.comm._xla import host_call, ranks_operand, register

if TYPE_CHECKING:
    import jax

__all__ = ["Collectives"]


class Collectives:
    """The differentiable collectives over one communicator (see the Note).

    The rank is an operand of each collective's callback and of each slice
    (:func:`ops.comm._xla.ranks_operand`), and the callbacks are the group's
    and its siblings', so every rank traces the same program (see [Note: one
    program for a group's ranks] in ``ops/comm/_xla.py``)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm, self.rank, self.size = comm, comm.rank, comm.world_size
        self._fns: dict[str, Callable[..., jax.Array]] = {}
        if self.size > 1:
            self.place = register(comm, self)
            self._build()

    # -- host side: what the callbacks run --------------------------------------
    def _on_comm(self, fn: Callable[..., object], out: np.ndarray, *xs: np.ndarray) -> np.ndarray:
        """``fn(out, *xs)``, a collective, on host arrays (flat, contiguous; ``out``
        may be ``xs[0]``, in place). A backend that moves device memory only
        (NCCL) gets them copied to its device and ``out`` copied back."""
        if self.comm.host_memory is not False:
            fn(out, *xs)
            return out
        staged = [to_comm(self.comm, x) for x in xs]
        there = staged[0] if xs and out is xs[0] else self.comm.allocate(out.size, out.dtype)
        fn(there, *staged)
        return self.comm.device.to_host_into(there, out)

    def stacked(self, x: np.ndarray | jax.Array) -> np.ndarray:
        """Every model rank's ``x`` (host memory), stacked on a new first axis."""
        x = np.ascontiguousarray(x)
        out = np.empty((self.size, *x.shape), x.dtype)
        self._on_comm(self.comm.all_gather_into, out.reshape(-1), x.reshape(-1))
        return out

    def host(self, name: str, x: np.ndarray | jax.Array) -> np.ndarray:
        """The collective ``name`` (``all_gather``, ``reduce_scatter`` or
        ``all_reduce``, a sum) of a host array along its first axis, for
        callbacks made elsewhere (``shard/_pure_program.py``)."""
        if name == "all_gather":
            return _host_all_gather(self, 0, x)
        if name == "reduce_scatter":
            return _host_reduce_scatter(self, 0, x)
        return _host_all_reduce(self, "sum", x)

    # -- device side: ordered callbacks -----------------------------------------
    def ids(self) -> jax.Array:
        """``[rank, who]``: this rank in its group, and in its family's root
        (which finds it from a shared callback), as JAX values (operands of
        the program where one is being shared; see the class)."""
        return ranks_operand(self.place)

    def _call(self, host: Callable[..., np.ndarray], arg: Hashable, x: jax.Array,
              shape: tuple[int, ...], ids: jax.Array) -> jax.Array:
        import jax
        from jax.experimental import io_callback

        return io_callback(host_call(self.place, host, arg),
                           jax.ShapeDtypeStruct(shape, x.dtype), ids[1], x, ordered=True)

    def all_reduce(self, x: jax.Array, op: str = "sum") -> jax.Array:
        """The elementwise ``op`` of every rank's ``x`` (not differentiable: use
        :meth:`reduce` or :meth:`copy` where a gradient flows)."""
        if self.size == 1:
            return x
        return self._all_reduce(x, self.ids(), op)

    def _all_reduce(self, x: jax.Array, ids: jax.Array, op: str = "sum") -> jax.Array:
        return self._call(_host_all_reduce, op, x, x.shape, ids)

    def _all_gather(self, x: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
        shape = list(x.shape)
        shape[axis] *= self.size
        return self._call(_host_all_gather, axis, x, tuple(shape), ids)

    def _reduce_scatter(self, x: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
        if x.shape[axis] % self.size:
            raise ValueError(f"reduce_scatter: dimension {axis} of {tuple(x.shape)} does not "
                             f"divide over {self.size} model ranks")
        shape = list(x.shape)
        shape[axis] //= self.size
        return self._call(_host_reduce_scatter, axis, x, tuple(shape), ids)

    def _slice(self, x: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
        import jax

        if x.shape[axis] % self.size:
            raise ValueError(f"scatter: dimension {axis} of {tuple(x.shape)} does not divide "
                             f"over {self.size} model ranks")
        n = x.shape[axis] // self.size
        return jax.lax.dynamic_slice_in_dim(x, ids[0] * n, n, axis=axis)

    def _build(self) -> None:
        import jax

        # the ranks are an argument, not a closure: a custom_vjp rule must not
        # close over a value of the trace it is called from
        @jax.custom_vjp
        def copy(x: jax.Array, ids: jax.Array) -> jax.Array:
            return x
        copy.defvjp(lambda x, ids: (x, ids), lambda ids, ct: (self._all_reduce(ct, ids), None))

        @jax.custom_vjp
        def reduce(x: jax.Array, ids: jax.Array) -> jax.Array:
            return self._all_reduce(x, ids)
        reduce.defvjp(lambda x, ids: (self._all_reduce(x, ids), None),
                      lambda _, ct: (ct, None))

        def pair(fwd: Callable[[jax.Array, jax.Array, int], jax.Array],
                 bwd: Callable[[jax.Array, jax.Array, int], jax.Array]
                 ) -> Callable[[jax.Array, jax.Array, int], jax.Array]:
            def f(x: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
                return fwd(x, ids, axis)
            f = jax.custom_vjp(f, nondiff_argnums=(2,))
            f.defvjp(lambda x, ids, axis: (fwd(x, ids, axis), ids),
                     lambda axis, ids, ct: (bwd(ct, ids, axis), None))
            return f

        self._fns = {
            "copy": copy, "reduce": reduce,
            "gather": pair(self._all_gather, self._slice),
            "scatter": pair(self._slice, self._all_gather),
            "gather_sequence": pair(self._all_gather, self._reduce_scatter),
            "reduce_scatter": pair(self._reduce_scatter, self._all_gather),
        }

    def _axis(self, x: jax.Array, axis: int) -> int:
        nd = len(x.shape)
        if not -nd <= axis < nd:
            raise ValueError(f"axis {axis} is out of range for an array of shape "
                             f"{tuple(x.shape)}")
        return axis % nd

    def apply(self, name: str, x: jax.Array, axis: int | None = None) -> jax.Array:
        if self.size == 1:
            return x
        fn = self._fns[name]
        if axis is None:
            return fn(x, self.ids())
        return fn(x, self.ids(), self._axis(x, axis))


# The host side of the callbacks, one function each for every group (see
# host_call): ``coll`` is the calling rank's Collectives; ``x`` a host array (a
# numpy array, or a JAX array on the CPU where JAX runs the callback eagerly).
def _host_all_reduce(coll: Collectives, op: str, x: np.ndarray | jax.Array) -> np.ndarray:
    out = np.array(x, copy=True, order="C")
    flat = out.reshape(-1)
    coll._on_comm(lambda o, _: coll.comm.all_reduce_(o, op), flat, flat)
    return out


def _host_all_gather(coll: Collectives, axis: int, x: np.ndarray | jax.Array) -> np.ndarray:
    out = coll.stacked(x)
    # (T, ..., n, ...) -> (..., T, n, ...) -> (..., T n, ...): one copy
    shape = list(out.shape[1:])
    shape[axis] *= coll.size
    return np.moveaxis(out, 0, axis).reshape(shape)


def _host_reduce_scatter(coll: Collectives, axis: int, x: np.ndarray | jax.Array) -> np.ndarray:
    x = np.asarray(x)
    shape = list(x.shape)
    shape[axis:axis + 1] = [coll.size, shape[axis] // coll.size]
    # each rank's chunk along axis contiguous, in rank order: one copy
    chunks = np.ascontiguousarray(np.moveaxis(x.reshape(shape), axis, 0))
    out = np.empty(chunks.shape[1:], x.dtype)
    coll._on_comm(lambda o, c: coll.comm.reduce_scatter_into(o, c, "sum"),
                  out.reshape(-1), chunks.reshape(-1))
    return out
