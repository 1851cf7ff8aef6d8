"""Shared fixtures. Multi-rank tests run ranks as threads in this process."""

from __future__ import annotations

import os

# Four JAX CPU devices for the mesh tests; on a GPU, XLA's deterministic
# reductions, so that two runs of one trajectory can be compared bit for bit.
# Must precede the first jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 "
                                   "--xla_gpu_deterministic_ops=true")

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def emulated_cuda():
    """The CUDA driver with numpy arrays and kernels emulated on the CPU."""
    from ops.kernels._cuda import CudaDriver
    from ops.kernels._emulate import EmulatedModule

    return CudaDriver(np, EmulatedModule, sm_count=2)


def gpu_present() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.is_available())


# The ZeRO step on device state: the strict stand-in always, a real GPU when
# there is one (see [Note: devices] in ops/device/_device.py).
DEVICES = ["standin"] + (["cupy"] if gpu_present() else [])

# Tests that mean the CPU pin JAX to it: on a GPU machine JAX would otherwise
# run the references there (TF32 matmuls by default). Losses over GPU state
# still run on the GPU: JAX computes where its committed inputs live.
import jax  # noqa: E402

jax.config.update("jax_default_device", jax.devices("cpu")[0])
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(params=DEVICES)
def device(request):
    """A device :class:`ops.Device` other than the host's."""
    if request.param == "standin":
        from ops.testing import STANDIN

        return STANDIN
    from ops.device._device import cupy_device

    return cupy_device()
