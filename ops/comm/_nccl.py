"""NCCL backend: cupy.cuda.nccl on GPUs, one process per GPU under torchrun.

The NCCL unique id is made on rank 0 and shared through torch.distributed's
TCPStore. Collectives run on this communicator's own CuPy stream, ordered after
the work already queued on the caller's current stream (an event), and the
caller's stream waits for them in turn: no host synchronisation per call. A
blocking wait polls for completion and aborts the NCCL communicator when the
timeout passes, so a dead peer surfaces as an error instead of a hang.
"""

from __future__ import annotations

import os
import socket
import time
import types
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ops._types import Array
from ops.comm._base import CollectiveError, CollectiveTimeout, Communicator, Pending
from ops.device._arrays import BF16
from ops.device._device import Device, cupy_device

_A = TypeVar("_A", bound=Array)

__all__ = ["NCCL_DTYPES", "NcclCommunicator", "check_distinct_devices"]

# numpy dtype -> cupy.cuda.nccl datatype name (resolved lazily: cupy is optional).
NCCL_DTYPES = {
    np.dtype(np.float32): "NCCL_FLOAT32", np.dtype(np.float64): "NCCL_FLOAT64",
    np.dtype(np.float16): "NCCL_FLOAT16", BF16: "NCCL_BFLOAT16",
    np.dtype(np.int32): "NCCL_INT32", np.dtype(np.int64): "NCCL_INT64",
    np.dtype(np.uint8): "NCCL_UINT8", np.dtype(np.int8): "NCCL_INT8",
}
_UID_KEY = "zeroshard/nccl_unique_id"
_DEVICE_KEY = "zeroshard/nccl_device"


def check_distinct_devices(devices: list[str]) -> None:
    """Raise, naming the ranks and the GPU, if two ranks would share one GPU.

    ``devices[r]`` is rank r's ``"host/gpu index"``.
    """
    seen: dict[str, list[int]] = {}
    for rank, device in enumerate(devices):
        seen.setdefault(device, []).append(rank)
    shared = {d: ranks for d, ranks in seen.items() if len(ranks) > 1}
    if shared:
        detail = "; ".join(f"ranks {ranks} on GPU {d.split('/')[-1]} of host "
                           f"{d.rsplit('/', 1)[0]}" for d, ranks in shared.items())
        raise RuntimeError(f"NCCL needs one GPU per rank, but {detail}; start one process per "
                           "GPU (torchrun --nproc-per-node = GPUs per node), or run several "
                           "ranks on one GPU as threads (ops.spawn)")


def _set_torch_device(index: int) -> None:  # pragma: no cover - needs a GPU
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(index)


def _ptr(a: Any) -> int:  # a CuPy array (untyped): .data.ptr is not in ops.Array
    return a.data.ptr  # a device array's address (host arrays were refused before)


class NcclCommunicator(Communicator):
    """One GPU's rank in an NCCL communicator.

    Args:
      rank, world_size: this rank and the number of ranks.
      comm: a ``cupy.cuda.nccl.NcclCommunicator`` (or an object with its
        methods and NCCL semantics, for testing).
      nccl: the module with the NCCL constants (``cupy.cuda.nccl``).
      stream: the CuPy stream collectives run on, or None (tests).
      timeout: seconds a blocking wait may take before the communicator aborts.
      device: where its buffers live (default: CuPy's current GPU).
    """

    backend = "nccl"
    host_memory = False

    def __init__(self, rank: int, world_size: int, *, comm: Any, nccl: types.ModuleType,
                 stream: Any = None,
                 timeout: float = 300.0, device: Device | None = None) -> None:
        super().__init__(rank, world_size, timeout)
        self.comm, self._nccl, self.stream = comm, nccl, stream
        self._device = device
        self._queued: list[tuple[Array, Array, int]] = []  # sends not yet issued (header, x, dst)

    @property
    def device(self) -> Device:
        return self._device or cupy_device()

    @classmethod
    def from_process_group(cls, *, timeout: float = 300.0) -> NcclCommunicator:  # pragma: no cover
        """Create the communicator of every rank of torch.distributed's default group.

        Each process takes the GPU ``LOCAL_RANK`` names (as torchrun sets it), for
        CuPy and torch alike. Two ranks on one GPU fail here, naming them: NCCL
        itself would fail later with ``NCCL_ERROR_INVALID_USAGE`` and no cause.
        """
        import cupy
        import torch.distributed as dist
        from cupy.cuda import nccl

        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= local < count:
            raise RuntimeError(f"NCCL rank {rank}: LOCAL_RANK={local}, but this machine has "
                               f"{count} GPU(s); start at most {count} processes per node, or "
                               "run several ranks on one GPU as threads (ops.spawn)")
        cupy.cuda.Device(local).use()
        _set_torch_device(local)
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_DEVICE_KEY}/{rank}", f"{socket.gethostname()}/{local}")
        check_distinct_devices([store.get(f"{_DEVICE_KEY}/{r}").decode() for r in range(world)])
        if rank == 0:
            store.set(_UID_KEY, nccl.get_unique_id())  # 128 bytes
        comm = nccl.NcclCommunicator(world, store.get(_UID_KEY), rank)
        return cls(rank, world, comm=comm, nccl=nccl, stream=cupy.cuda.Stream(non_blocking=True),
                   timeout=timeout)

    # -- argument handling, testable without a GPU ---------------------------
    def dtype_of(self, name: str, a: Array) -> int:
        key = NCCL_DTYPES.get(np.dtype(a.dtype))
        if key is None:
            raise TypeError(f"{name}: NCCL cannot move dtype {a.dtype}; supported: "
                            f"{', '.join(str(d) for d in NCCL_DTYPES)}")
        return getattr(self._nccl, key)

    def _check_dtype(self, name: str, buf: Array) -> None:
        self.dtype_of(name, buf)

    def _op(self, op: str) -> int:
        return self._nccl.NCCL_AVG if op == "mean" else self._nccl.NCCL_SUM

    def _stream_ptr(self) -> int:
        return 0 if self.stream is None else self.stream.ptr

    def _launch(self, name: str, fn: Callable[..., object], *args: object) -> None:
        if self.stream is None:
            fn(*args, 0)
            return
        import cupy  # pragma: no cover - needs a GPU

        ready = cupy.cuda.get_current_stream().record()  # pragma: no cover
        self.stream.wait_event(ready)  # pragma: no cover
        fn(*args, self.stream.ptr)  # pragma: no cover
        cupy.cuda.get_current_stream().wait_event(self.stream.record())  # pragma: no cover

    def _all_gather(self, out: Array, x: Array) -> None:
        self._launch("all_gather", self.comm.allGather, _ptr(x), _ptr(out), x.size,
                     self.dtype_of("all_gather", x))

    def _reduce_scatter(self, out: Array, x: Array, op: str) -> None:
        self._launch("reduce_scatter", self.comm.reduceScatter, _ptr(x), _ptr(out), out.size,
                     self.dtype_of("reduce_scatter", x), self._op(op))

    def _all_to_all(self, out: Array, x: Array) -> None:
        """One NCCL group of a send and a receive per peer (as torch's
        all_to_all_single on NCCL); this rank's own section is a copy."""
        k, dtype = x.size // self.world_size, self.dtype_of("all_to_all", x)
        peers = [p for p in range(self.world_size) if p != self.rank]
        self._nccl.groupStart()
        try:
            for p in peers:
                self._launch("all_to_all", self.comm.send, _ptr(x[p * k:(p + 1) * k]), k, dtype, p)
            for p in peers:
                self._launch("all_to_all", self.comm.recv, _ptr(out[p * k:(p + 1) * k]), k, dtype,
                             p)
        finally:
            self._nccl.groupEnd()
        me = slice(self.rank * k, (self.rank + 1) * k)
        self.device.xp.copyto(out[me], x[me])

    def _all_reduce(self, x: Array, op: str) -> None:
        self._launch("all_reduce", self.comm.allReduce, _ptr(x), _ptr(x), x.size,
                     self.dtype_of("all_reduce", x), self._op(op))

    def _broadcast(self, x: Array, src: int) -> None:
        self._launch("broadcast", self.comm.broadcast, _ptr(x), _ptr(x), x.size,
                     self.dtype_of("broadcast", x), src)

    def _barrier(self) -> None:
        flag = self.allocate(1, np.float32)
        flag[...] = 0
        self._all_reduce(flag, "sum")
        self.synchronize("barrier")

    # -- point-to-point (see [Note: point-to-point]) ----------------------------
    # NCCL has no tags and delivers a pair's messages in order, so the header
    # (size, dtype, tag) that precedes each payload also catches a receive
    # posted for another message than the next one (checked once both have
    # arrived: they go in one group, since a header received alone would leave
    # a payload sent in the sender's group waiting on a receive outside it).
    #
    # A GPU's NCCL may hold a send until its receive is posted, so two ranks
    # that send to each other and then receive (a pipeline's 1F1B steady state:
    # an activation one way, a gradient the other) would each wait on the
    # other's send. Sends are therefore queued and issued together with the
    # next receive in one NCCL group (ncclGroupStart/End, as torch's
    # batch_isend_irecv), whose operations progress together; any other call
    # (a collective, a blocking send, waiting on a send) issues them first.
    def _header(self, x: Array, tag: int) -> Array:
        return self.device.from_host(np.array(
            [x.size, zlib.crc32(str(x.dtype).encode()), tag], np.int64))

    def _isend(self, x: Array, dst: int, tag: int) -> Pending:
        self._queued.append((self._header(x, tag), x, dst))
        comm = self

        class Queued:
            def wait(self) -> Array:
                comm._flush()
                return x

        return Queued()

    def _send(self, x: Array, dst: int, tag: int) -> None:
        self._queued.append((self._header(x, tag), x, dst))
        self._flush()

    def _flush(self, src: int | None = None, *recvs: Array) -> None:
        """Issue the queued sends, and receives into ``recvs`` from ``src``, as
        one group; then wait for them."""
        queued, self._queued = self._queued, []
        if not queued and not recvs:
            return
        self._nccl.groupStart()
        try:
            for header, x, dst in queued:
                for buf in (header, x):
                    self._launch("send", self.comm.send, _ptr(buf), buf.size,
                                 self.dtype_of("send", buf), dst)
            for out in recvs:
                self._launch("recv", self.comm.recv, _ptr(out), out.size,
                             self.dtype_of("recv", out), src)
        finally:
            self._nccl.groupEnd()
        peers = sorted({dst for _, _, dst in queued} | ({src} if recvs and src is not None
                                                         else set()))
        self.synchronize(f"send/recv with rank(s) {peers}")

    def _drain(self) -> None:
        super()._drain()
        self._flush()

    def isend(self, x: Array, dst: int, *, tag: int = 0) -> Pending:
        self._check_p2p("send", x, dst, tag)
        super()._drain()  # queued sends stay queued: one more joins them
        return self._isend(x, dst, tag)

    def recv_(self, out: _A, src: int, *, tag: int = 0) -> _A:
        self._check_p2p("recv", out, src, tag)
        super()._drain()  # the queued sends go with the receive, in its group
        self._recv(out, src, tag)
        return out

    def _recv(self, out: Array, src: int, tag: int) -> None:
        header = self.allocate(3, np.int64)
        self._flush(src, header, out)  # header and payload in the group: see above
        n, d, t = (int(v) for v in self.device.to_host(header))
        if n != out.size or d != zlib.crc32(str(out.dtype).encode()) or t != tag:
            raise CollectiveError(f"recv on rank {self.rank}: the next message from rank {src} "
                                  f"has {n} elements, tag {t}, dtype checksum {d}, but the "
                                  f"receive is for {out.size} elements of {out.dtype} with tag "
                                  f"{tag} (NCCL delivers a pair's messages in order)")

    def split(self, color: int) -> NcclCommunicator:
        colors = self._colors(color)
        members = [r for r, c in enumerate(colors) if c == color]
        sub = self.comm.commSplit(color, self.rank)
        return NcclCommunicator(members.index(self.rank), len(members), comm=sub,
                                nccl=self._nccl, stream=self.stream, timeout=self.timeout,
                                device=self._device)

    def synchronize(self, name: str = "collective") -> None:
        """Block until this communicator's stream is idle, at most ``timeout`` s."""
        if self.stream is None:
            return
        deadline = time.monotonic() + self.timeout  # pragma: no cover - needs a GPU
        while not self.stream.done:  # pragma: no cover
            if time.monotonic() > deadline:
                self.comm.abort()
                raise CollectiveTimeout(f"{name} on rank {self.rank} did not complete within "
                                        f"{self.timeout:g} s; the NCCL communicator was aborted")
            time.sleep(1e-4)
