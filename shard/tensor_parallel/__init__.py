"""Tensor (model) parallelism composed with ZeRO: :class:`shard.TensorParallel`.

- ``_parallel.py``: which dimension of each leaf splits over the ``model``
  ranks, the slices of a rank, and Megatron's layers
  ([Note: tensor parallelism with ZeRO]);
- ``_megatron.py``: the differentiable collectives that join the slices inside a
  JAX loss ([Note: tensor-parallel collectives]).

It may import :mod:`shard.core` and :mod:`ops`.
"""
