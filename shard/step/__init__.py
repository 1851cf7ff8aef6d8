"""The ZeRO step: :class:`~shard.ZeroStep` and the phases it calls.

- ``_step.py``: the step, stages 0-3 as one code path ([Note: non-finite
  gradients]);
- ``_checks.py``: what a step checks before it changes anything;
- ``_runtime.py``: units' full params gathered and their gradients reduced
  ([Note: ZeRO-3 schedule]); ``_reduce.py``: the gradients' reduction into
  the shards the optimizer reads;
- ``_update.py``: the gradients' norm, the fused optimizer and the new
  compute params;
- ``_eval.py``: the loss at a state's params, with no update.

It may import :mod:`shard.offload`, :mod:`shard.core`, :mod:`shard.monitor`
and :mod:`ops`.
"""
