"""Checkpoints: sharded, atomic, re-shardable, and the tools to read them.

    python -m shard.checkpoint inspect CKPT
    python -m shard.checkpoint consolidate CKPT OUT.safetensors [--optimizer]
    python -m shard.checkpoint orbax CKPT OUT [--optimizer]

:func:`shard.save` (or :func:`shard.async_save`) and :func:`shard.load` write and
read a training state ([Note: checkpoint format]); :func:`consolidate` writes its
full params (and optionally the optimizer's moments) to one safetensors file,
:func:`to_orbax` the same as an orbax checkpoint, and :func:`inspect` says what
a checkpoint holds without loading it.

The package (it may import :mod:`shard.core` and :mod:`ops`):

- ``_checkpoint.py``: the format and :func:`shard.save`;
- ``_async.py``: :func:`shard.async_save`, which writes while training goes on
  ([Note: asynchronous saves]);
- ``_load.py``: manifests read and checked, and :func:`shard.load`, which
  re-shards;
- ``_sources.py``: where a saved leaf's rows are read from (rank files, a
  pipeline's stages, a tensor-parallel checkpoint's parts);
- ``_files.py``: what every part shares, its error and the file checksum;
- ``_module.py``: a torch module's buffers and tied names in a checkpoint;
- ``_tools.py``: :func:`consolidate`, :func:`to_orbax`, :func:`inspect` and the
  command line;
- ``_validate.py``: a checkpoint as untrusted input, checked field by field and
  against its files' headers before anything is read or allocated ([Note:
  untrusted checkpoints]).
"""

from shard.checkpoint._tools import consolidate, inspect, run, to_orbax

__all__ = ["consolidate", "inspect", "run", "to_orbax"]
