"""ZeRO-Offload and ZeRO-Infinity: masters and moments in host memory or on disk.

- ``_offload.py``: :class:`~shard.Offload` and the disk tier ([Note: offload]);
- ``_offloader.py``: the state made in the host or disk tier, and the update there;
- ``_overlap.py``: the host tier's update overlapped with the backward
  ([Note: overlapped offload]).

It may import :mod:`shard.monitor` and :mod:`ops`.
"""
