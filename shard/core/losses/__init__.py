"""The losses the ZeRO transforms accept, and how their gradients are taken.

Three forms:
- a JAX function ``loss_fn(params, batch) -> scalar``: gradients by
  ``jax.value_and_grad``. At stage 3 on several ranks its traced program is
  cut into one segment per unit and run as a ``Layered`` loss is (see [Note:
  traced units] in ``shard/step/_traced.py``).
- :class:`~shard.Layered`: a chain of per-unit JAX layers. At
  stage 3 each unit is gathered just before its layer runs and freed after
  (see [Note: ZeRO-3 schedule] in ``shard/step/_runtime.py``).
- a loss object (:class:`~shard.core._protocol.LossProvider`, [Note: the loss
  protocol]; the torch adapter's are), or any object with
  ``value_and_grad(params, batch) -> (loss, grads)``. With dynamic loss scaling
  it is called with ``loss_scale=s`` and must return the gradients of
  ``s * loss``.

The unit-by-unit member (``Layered`` has it; a loss object may too, as the torch
adapter's do, to run stage 3 within the memory bound):
``run_units(units, reducer, batch, scale) -> loss``, where ``units.get(u,
upcoming)`` returns unit ``u``'s full leaves (starting the gathers of
``upcoming``), ``reducer.add(u, grads)`` takes its leaf gradients of ``scale *
loss`` (arrays of the state's device, torch tensors or jax arrays on it, or
None for zero), and the loss is a number or a scalar array.

Modules:
- ``_jax.py``: ``JaxLoss``, a JAX function's jitted, loss-scaled value
  and gradient, shared by every step and thread rank of the function; the
  loss with a model state ([Note: model state]);
- ``_layered.py``: :class:`~shard.Layered`, and one layer compiled over its
  unit's flat params buffer (what the traced units of any JAX loss run as).
"""
