"""Shared fixtures. Multi-rank tests run ranks as threads in this process."""

from __future__ import annotations

import os

# Four JAX CPU devices for the mesh tests; must precede the first jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def emulated_cuda():
    """The CUDA driver with numpy arrays and kernels emulated on the CPU."""
    from ops._cuda import CudaDriver
    from ops._emulate import EmulatedModule

    return CudaDriver(np, EmulatedModule, sm_count=2)
