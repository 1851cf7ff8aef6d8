"""Data for the mesh: :class:`~shard.DataLoader` gives each data rank its part
of every global batch, in an order fixed by the seed and the epoch, and
resumes where a checkpointed run stopped.

- ``_loader.py``: the loader ([Note: the data order]).

It may import :mod:`shard.core` and :mod:`ops`.
"""
