"""A step's gradients reduced over the ranks into the shards the optimizer reads.

- ``_reduce.py``: :class:`GradReducer`, each unit's gradients reduce-scattered
  (or all-reduced) as soon as they are complete ([Note: ZeRO-3 schedule] in
  ``shard/step/_runtime.py``), ZeRO++'s quantized reduce-scatter included;
  :class:`GradBuffers`, the shards the step keeps across steps;
  :class:`CopyPlans`, the run tables of a layout's unit copies;
- ``_compressed.py``: the 1-bit family's reductions (1-bit Adam, 0/1 Adam)
  and the buffers they keep across steps.

It may import :mod:`shard.core`, :mod:`shard.monitor` and :mod:`ops`.
"""
