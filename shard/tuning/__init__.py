"""Tuning a run before it starts: :func:`~shard.lr_range_test`, the
learning-rate range test, and :func:`~shard.autotune`, a ZeRO configuration
chosen by trial.

- ``_lr_range.py``: the range test ([Note: the learning-rate range test]);
- ``_autotune.py``: the configuration's trials ([Note: autotuning]).

It may import the rest of :mod:`shard` (the transforms, the data loader) and
:mod:`ops`.
"""
