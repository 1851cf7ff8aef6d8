"""Communicators from the environment torchrun sets up."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable

from ops._types import Array
from ops.comm._base import Communicator, Pending
from ops.device._device import device_of

__all__ = ["RoutedCommunicator", "init_from_env"]

log = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_from_env(backend: str | None = None, *, timeout: float = 300.0) -> Communicator:
    """This process's communicator under ``torchrun``.

    Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (set by torchrun, on one
    node or many) and initialises torch.distributed. The backend follows the
    data, as torch's default ``cuda:nccl,cpu:gloo``: on a machine where CuPy
    sees a GPU, host (numpy) buffers go over gloo and GPU buffers over NCCL
    (created at the first GPU collective, on the GPU ``LOCAL_RANK`` names); on
    other machines everything goes over gloo.

    On a GPU machine it also places JAX as torchrun's ranks place torch: a
    process's JAX sees only the GPU ``LOCAL_RANK`` names, and where more
    processes than GPUs run on a node (so several share one) JAX allocates on
    demand instead of taking 75% of the GPU at start, which would leave the
    next process out of memory. Both need JAX's backend not yet started; a
    warning says when it already was, or where ``XLA_PYTHON_CLIENT_PREALLOCATE``
    is set by the user, their setting stands.

    Args:
      backend: None (follow the data), ``"gloo"`` or ``"nccl"`` (one only).
      timeout: seconds any collective may take before it raises.

    Raises:
      RuntimeError: not started by torchrun (names the missing variables).
    """
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: {', '.join(missing)} not set; start the script with "
                           "torchrun --nproc-per-node N script.py (or use ops.spawn for thread "
                           "ranks in one process)")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"init_from_env: backend must be None, 'gloo' or 'nccl'; got "
                         f"{backend!r}")
    import torch.distributed as dist

    if (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        log.warning("init_from_env: a restarted worker on the store torchrun's agent shares with "
                    "its workers may read the previous attempt's addresses and fail to connect "
                    "(pytorch/pytorch#135712); for runs with --max-restarts, launch torchrun "
                    "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    if not dist.is_initialized():
        # gloo carries the store and the CPU-side synchronisation for NCCL too.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    from ops.comm._gloo import GlooCommunicator
    from ops.comm._nccl import NcclCommunicator

    if backend != "gloo" and _gpu_available():  # pragma: no cover - needs a GPU
        _place_jax()
    if backend == "nccl":
        return NcclCommunicator.from_process_group(timeout=timeout)
    gloo = GlooCommunicator(timeout=timeout)
    if backend == "gloo" or not _gpu_available():
        return gloo
    return RoutedCommunicator(  # pragma: no cover - needs a GPU
        gloo, lambda: NcclCommunicator.from_process_group(timeout=timeout))


class RoutedCommunicator(Communicator):
    """Host buffers to one communicator, device buffers to another (made on first use).

    Its own buffers (``allocate`` without a device) are host buffers: nothing
    touches the GPU until a device buffer does.

    Every rank routes by the same rule, so the collectives each backend sees are
    in the same order on every rank. The device communicator's creation is
    itself a collective, so it happens at the first device collective, which
    every rank reaches in step.
    """

    def __init__(self, host: Communicator, make_device: Callable[[], Communicator]) -> None:
        super().__init__(host.rank, host.world_size, host.timeout)
        self.backend = f"{host.backend}+device"
        self._host, self._make_device = host, make_device
        self._device_comm: Communicator | None = None

    def _on_device(self) -> Communicator:
        if self._device_comm is None:
            self._device_comm = self._make_device()
        return self._device_comm

    def _for(self, buf: Array) -> Communicator:
        return self._host if device_of(buf).host else self._on_device()

    def unchecked(self) -> Communicator:
        host = self._host.unchecked()
        if host is self._host:
            return self
        if getattr(self, "_unchecked", None) is None:  # one, as the host side keeps one
            self._unchecked = RoutedCommunicator(host, self._on_device)
        return self._unchecked

    def _all_gather(self, out: Array, x: Array) -> None:
        self._for(x)._all_gather(out, x)

    def _reduce_scatter(self, out: Array, x: Array, op: str) -> None:
        self._for(x)._reduce_scatter(out, x, op)

    def _all_to_all(self, out: Array, x: Array) -> None:
        self._for(x)._all_to_all(out, x)

    def _all_reduce(self, x: Array, op: str) -> None:
        self._for(x)._all_reduce(x, op)

    def _broadcast(self, x: Array, src: int) -> None:
        self._for(x)._broadcast(x, src)

    def _barrier(self) -> None:
        self._host._barrier()

    def _send(self, x: Array, dst: int, tag: int) -> None:
        self._for(x)._send(x, dst, tag)

    def _isend(self, x: Array, dst: int, tag: int) -> Pending:
        return self._for(x)._isend(x, dst, tag)

    def _recv(self, out: Array, src: int, tag: int) -> None:
        self._for(out)._recv(out, src, tag)

    def _prepost_recv(self, out: Array, src: int, tag: int) -> Pending:
        return self._for(out)._prepost_recv(out, src, tag)

    def split(self, color: int) -> Communicator:
        """The host side's sub-communicator. Its device buffers are refused: the
        parent's NCCL communicator is made lazily, and splitting it then would
        be a collective that only one sub-group reaches."""
        name = self.backend

        def no_device() -> Communicator:
            raise NotImplementedError(f"split: a sub-communicator of the {name} backend moves "
                                      "host buffers only; use init_from_env(backend='nccl') "
                                      "for device buffers")

        return RoutedCommunicator(self._host.split(color), no_device)


def jax_gpu_placement(local_rank: int, local_world: int, gpus: int) -> tuple[str, bool]:
    """The GPU a process's JAX should see (``jax_cuda_visible_devices``) and
    whether it may preallocate, for local rank ``local_rank`` of ``local_world``
    processes on a node with ``gpus`` GPUs."""
    if gpus < 1 or not 0 <= local_rank < max(local_world, 1):
        raise ValueError(f"jax_gpu_placement: local rank {local_rank} of {local_world} on "
                         f"{gpus} GPU(s)")
    return str(local_rank % gpus), local_world <= gpus


def _place_jax() -> None:  # pragma: no cover - needs a GPU
    import cupy
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        log.warning("init_from_env: JAX started before init_from_env, so it sees every GPU "
                    "and may preallocate on them; call init_from_env first")
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    visible, preallocate = jax_gpu_placement(local, local_world,
                                             cupy.cuda.runtime.getDeviceCount())
    jax.config.update("jax_cuda_visible_devices", visible)
    if not preallocate and "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def _gpu_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:  # a broken driver installation: no usable GPU
        return False
