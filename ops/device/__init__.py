"""Devices: where an array lives, and moving arrays between frameworks.

- ``_device.py``: :class:`~ops.Device` and :data:`~ops.HOST`, CuPy's device,
  and the registry the stand-in of :mod:`ops.testing` joins ([Note: devices]);
- ``_arrays.py``: array kinds, dtype codes and the kernels' argument checks;
- ``_dlpack.py``: torch, JAX and CuPy arrays in and out through DLPack;
- ``_runs.py``: many runs of elements copied in one kernel launch.

It may import :mod:`ops.kernels` (a device's driver runs its kernels); the
public names are :mod:`ops`'s.
"""
