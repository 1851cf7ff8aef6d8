"""Communicators and the functional collectives over them.

One interface ([Note: collective semantics], [Note: point-to-point]) and three
backends: threads as ranks in one process ([Note: thread collectives]), gloo
processes under torchrun ([Note: gloo algorithms]) and NCCL on GPUs.

- ``_base.py``: :class:`~ops.Communicator`, :class:`~ops.Work`, the errors;
- ``_threads.py``, ``_gloo.py``, ``_nccl.py``: the backends; ``_thread_runs.py``:
  the threads backend's copies and sums, whole or in parts; ``_spawn.py``:
  :func:`~ops.spawn`, thread ranks running a function;
- ``_world.py``: :func:`~ops.init_from_env`, the communicator torchrun's
  environment describes;
- ``_collectives.py``: :func:`~ops.all_gather`, :func:`~ops.reduce_scatter`,
  :func:`~ops.all_reduce`, :func:`~ops.all_to_all`, :func:`~ops.broadcast`;
- ``_ordered.py``: sums in a fixed binary tree, the same bits on any number
  of ranks ([Note: ordered sums]);
- ``_xla.py``: collectives that a JAX program calls with the rank as an
  operand ([Note: one program for a group's ranks]); ``_programs.py``: one
  compile of a program for every rank and object that traces it.

It may import :mod:`ops.device` and :mod:`ops.kernels`; the public names are
:mod:`ops`'s.
"""
