"""The ZeRO step: :class:`~shard.ZeroStep` and the parts it calls.

- ``_step.py``: the step, stages 0-3 as one code path ([Note: non-finite
  gradients]); it holds its configuration and calls the parts below;
- ``_config.py``: :class:`ZeroOptions`, the options a step takes (written once),
  and :class:`StepConfig`, those checked and frozen with the step's ranks;
- ``_plan.py``: the :class:`Plan` that ``init`` and ``shard.load`` derive from
  the params (layouts, dtypes, device), carried by every state;
- ``_init.py``: ``init`` and ``init_from``, unit by unit (whole params, a
  meta-device module's shapes, or a JAX init function);
- ``_checks.py``: what a step checks before it changes anything;
- ``_grads.py``: the gradient phase, each micro-batch's loss and gradients,
  and the loss alone at a state's params (``evaluate``);
- ``_runtime.py``: units' full params gathered and their gradients reduced
  ([Note: ZeRO-3 schedule]); ``reduction/``: the gradients' reduction into
  the shards the optimizer reads (the 1-bit family's too); ``_ordered.py``:
  the same reduction, the norm and the loss in an order fixed by the data
  (``invariant_shards=``, [Note: the same bits at any world size]);
  ``_traced.py``: a JAX loss cut into one segment per unit, so stage 3 runs
  it unit by unit ([Note: traced units]); ``_cut.py``: its program traced
  and cut;
- ``_update.py``: the gradients' norm, the fused optimizer and the new
  compute params ([Note: missing gradients]);
- ``_frozen.py``: which leaves train, their runs and their packed moments
  ([Note: frozen leaves]).

It may import :mod:`shard.offload`, :mod:`shard.core`, :mod:`shard.monitor`
and :mod:`ops`.
"""
