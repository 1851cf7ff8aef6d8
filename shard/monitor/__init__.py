"""What a run reports: step metrics, where a step's time goes, and loggers.

- ``_metrics.py``: a step's metrics, read from the device only when looked at;
- ``_profile.py``: :func:`~shard.profile` and the timers every phase reports
  to ([Note: step profile]);
- ``_flops.py``: a step's model FLOPs, counted once per batch shape ([Note:
  model FLOPs]);
- ``_loggers.py``: :class:`~shard.CSVLogger` and :class:`~shard.TensorBoardLogger`.

It imports nothing else of :mod:`shard`.
"""
