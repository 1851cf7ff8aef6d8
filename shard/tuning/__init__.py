"""Tuning a run before it starts: :func:`~shard.lr_range_test`, the
learning-rate range test.

- ``_lr_range.py``: the range test ([Note: the learning-rate range test]).

It may import :mod:`shard.core` and :mod:`ops`.
"""
