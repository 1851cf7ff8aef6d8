"""Pipeline parallelism composed with ZeRO: :func:`shard.pipeline`.

- ``_pipeline.py``: stages over a (data x pipe) mesh, GPipe and 1F1B schedules
  ([Note: pipeline]);
- ``_jax_stage.py``: a :class:`~shard.Layered` loss's layers as one stage;
- ``_ties.py``: weights tied across stages ([Note: tied weights]);
- ``_balance.py``: layers laid out over stages, by size or by measured time.

It may import :mod:`shard.checkpoint`, :mod:`shard.core`,
:mod:`shard.monitor` and :mod:`ops`.
"""
