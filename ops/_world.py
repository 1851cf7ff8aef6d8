"""Communicators from the environment torchrun sets up."""

from __future__ import annotations

import datetime
import os

from ops._comm import Communicator

__all__ = ["init_from_env"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_from_env(*, backend: str | None = None, timeout: float = 300.0) -> Communicator:
    """This process's communicator under ``torchrun``.

    Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (set by torchrun, on one
    node or many), initialises torch.distributed and returns a gloo
    communicator, or an NCCL one when ``backend="nccl"`` or when CuPy sees a
    GPU (the NCCL unique id travels through torch.distributed's TCPStore).

    Args:
      backend: ``"gloo"``, ``"nccl"`` or None to choose from the machine.
      timeout: seconds any collective may take before it raises.

    Raises:
      RuntimeError: not started by torchrun (names the missing variables).
    """
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: {', '.join(missing)} not set; start the script with "
                           "torchrun --nproc-per-node N script.py (or use ops.spawn for thread "
                           "ranks in one process)")
    if backend is None:
        backend = "nccl" if _gpu_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"init_from_env: backend must be 'gloo' or 'nccl'; got {backend!r}")
    import torch.distributed as dist

    if not dist.is_initialized():
        # gloo carries the store and the CPU-side synchronisation for NCCL too.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    if backend == "nccl":
        from ops._comm_nccl import NcclCommunicator

        return NcclCommunicator.from_process_group(timeout=timeout)
    from ops._comm_gloo import GlooCommunicator

    return GlooCommunicator(timeout=timeout)


def _gpu_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.is_available())
