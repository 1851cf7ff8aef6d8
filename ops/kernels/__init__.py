"""Single-source CUDA/CPU kernels: the sources, their builds and drivers.

Every ``*.cu`` here is both the CUDA source CuPy compiles and, through
``shim_cpu.h``, the C source of the CPU build the tests run.

- ``_table.py``: every ``__global__`` entry point and its parameters;
- ``_build.py``: the sources and the CPU build cache;
- ``_cpu.py``: the CPU driver (ctypes); ``_cuda.py``: the CUDA driver (CuPy);
- ``_emulate.py``: the CUDA kernels run on the CPU exactly as launched (the
  stand-in device's kernels);
- ``_dtypes.py``: the dtypes numpy does not name (bf16).

It imports nothing else of :mod:`ops`.
"""
