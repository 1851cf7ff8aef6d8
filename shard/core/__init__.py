"""The nouns of ZeRO: specs, layouts, training state, policies and losses.

- ``_specs.py``: :class:`~shard.Shard`, :class:`~shard.Replicate` and their
  ``PartitionSpec`` forms, and how a tensor-parallel leaf is cut along its model
  axis, in one piece or in packed blocks ([Note: packed splits]);
- ``_layout.py``: which leaf lives where in each rank's flat unit buffers
  ([Note: unit buffers]);
- ``_state.py``: :class:`~shard.TrainState`, one rank's state as a pytree
  ([Note: TrainState]);
- ``_optim.py``: the step's optimizer on a rank's shards, a fused optimizer or
  an optax transformation ([Note: optax on shards]); ``_parts.py``: an optax
  transformation's parts, LAMB's and Adafactor's per-leaf reductions over the
  ranks, and the probe of whether the other parts act element by element;
- ``_mesh.py``: :class:`~shard.Mesh`, a named grid of ranks with a communicator
  per axis ([Note: named mesh]);
- ``_policy.py``: :class:`~shard.Precision` and :class:`~shard.LossScale`;
- ``_protocol.py``: what a step reads from a loss, ``LossProvider`` ([Note: the
  loss protocol]); ``losses/``: the losses the transforms accept (a JAX
  function, :class:`~shard.Layered`);
  ``_data_rank.py``: what a JAX loss knows of its data rank, a random key per
  data rank, step and micro-batch ([Note: per-rank keys]) and the data ranks as
  a named axis for ``jax.lax.pmean`` ([Note: the data axis in the loss]);
- ``_gather.py``: whole params from shards, and batches cut into parts;
- ``_paths.py``: params known by their shapes (from a checkpoint's leaf paths, or
  meta-device tensors).

It may import :mod:`shard.monitor` and :mod:`ops`.
"""
