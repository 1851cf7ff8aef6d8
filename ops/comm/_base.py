"""The communicator interface shared by every backend.

[Note: collective semantics]
Buffers are flat (1-D, C-contiguous) arrays: numpy on gloo, cupy on NCCL, and
any device's on thread ranks (see [Note: devices]); the caller allocates
outputs. For a world of size W and a
per-rank chunk of k elements:

- ``all_gather_into(out, x)``: x has k elements, out W*k; out[r*k:(r+1)*k] is
  rank r's x, on every rank.
- ``reduce_scatter_into(out, x, op)``: x has W*k elements, out k; out is this
  rank's chunk of the elementwise sum (or mean) of every rank's x. Ranks are
  added in rank order where the backend controls the order, so results are
  reproducible.
- ``all_to_all_into(out, x)``: x and out have W*k elements; out[r*k:(r+1)*k]
  is rank r's x[me*k:(me+1)*k], ``me`` this rank (the transpose of the ranks'
  sections: ZeRO++'s quantized gradient reduction sends each rank its
  sections so). ``out`` must not overlap ``x``.
- ``all_reduce_(x, op)`` and ``broadcast_(x, src)`` work in place.

[Note: point-to-point]
``send(x, dst, tag=)`` and ``recv_(out, src, tag=)`` move one flat buffer
between two ranks; messages from one rank to another with one tag arrive in
the order they were sent (NCCL has no tags: a pair's messages arrive in the
order sent, and a receive whose tag is not the next message's raises).
``send`` returns once the message is handed over: on thread ranks at once (it
is copied), on gloo once the transport took it, on NCCL once it was received
(large gloo messages may wait for the matching ``recv_`` too, so a pair of
ranks must not both send first). ``recv_`` checks the size and dtype before any payload
moves (a mismatch raises :class:`CollectiveError` naming both), waits at most
``timeout``, and fails at once when the sender failed or returned (threads)
or its process is gone (gloo). ``split(color)`` (a collective) gives the
communicator of the ranks that passed the same color, ranked in their order
here: a device mesh's data-parallel and pipeline groups.

Every rank must issue the same collectives in the same order. On one rank a
collective sends nothing: its result is its input (copied where the output is
another buffer). Async variants
return a :class:`Work`; a blocking call first waits for this communicator's
outstanding async work, so the order seen by the peers is the order of calls.
Every wait is bounded by ``timeout``: a peer that died or never arrived raises
:class:`CollectiveError` naming the collective, this rank and the bound.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ops._types import Array
from ops.device._device import HOST, Device, aligned_empty, device_of

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

__all__ = ["CollectiveError", "CollectiveTimeout", "Communicator", "PeerFailed", "Work",
           "aligned_empty"]

OPS = ("sum", "mean")

_thread = threading.local()
_A = TypeVar("_A", bound=Array)


def in_collective() -> bool:
    """Whether this thread is inside a backend's collective (whose own copies a
    device-operation count leaves out: the collective is one operation)."""
    return getattr(_thread, "depth", 0) > 0


def collectives_issued() -> int:
    """How many collectives this thread has issued (blocking and async), for
    counting a step's device operations."""
    return getattr(_thread, "issued", 0)


def _issued() -> None:
    _thread.issued = collectives_issued() + 1


def _inside(fn: Any, *args: object) -> Any:
    """Run a backend primitive marked as inside a collective."""
    _thread.depth = getattr(_thread, "depth", 0) + 1
    try:
        return fn(*args)
    finally:
        _thread.depth -= 1


class CollectiveError(RuntimeError):
    """A collective failed: mismatched arguments across ranks, or a backend error."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the communicator's timeout."""


class PeerFailed(CollectiveError):
    """Another rank failed, so this rank's collective can never complete."""


class Pending(Protocol):
    """A send or receive under way (:class:`Work`, or a backend's own handle):
    ``wait()`` returns its buffer once it is done."""

    def wait(self) -> Array | None: ...


class Work:
    """Handle of an async collective; ``wait()`` returns its output buffer.

    The handle (not the communicator) keeps the output alive: drop the handle
    after waiting and the buffer's lifetime is the caller's alone.
    """

    def __init__(self, future: cf.Future, name: str, timeout: float, rank: int,
                 out: Array | None = None) -> None:
        self._future, self._name, self._timeout, self._rank = future, name, timeout, rank
        self._out = out

    def wait(self) -> Array | None:
        try:
            self._future.result(timeout=self._timeout)
            return self._out
        except cf.TimeoutError:
            raise CollectiveTimeout(f"{self._name} on rank {self._rank} did not complete within "
                                    f"{self._timeout:g} s") from None

    def is_completed(self) -> bool:
        return self._future.done()


class Communicator(abc.ABC):
    """One rank's view of a group of ranks (see [Note: collective semantics]).

    Attributes:
      rank: this rank, in ``[0, world_size)``.
      world_size: the number of ranks.
      timeout: seconds any collective may take before it raises.
      backend: ``"threads"``, ``"gloo"`` or ``"nccl"``.
    """

    backend: str = ""
    #: True: moves host (numpy) memory only; False: device memory only; None: any.
    host_memory: bool | None = None

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}); got {rank}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds; got {timeout!r}")
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self._executor: cf.ThreadPoolExecutor | None = None
        self._pending: list[cf.Future] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    # -- the backend's blocking primitives ---------------------------------
    @abc.abstractmethod
    def _all_gather(self, out: Array, x: Array) -> None: ...

    @abc.abstractmethod
    def _reduce_scatter(self, out: Array, x: Array, op: str) -> None: ...

    @abc.abstractmethod
    def _all_reduce(self, x: Array, op: str) -> None: ...

    @abc.abstractmethod
    def _broadcast(self, x: Array, src: int) -> None: ...

    @abc.abstractmethod
    def _barrier(self) -> None: ...

    def _all_to_all(self, out: Array, x: Array) -> None:
        raise NotImplementedError(f"all_to_all: the {self.backend} backend has none")

    def allocate(self, n: int, dtype: DTypeLike, *, device: Device | None = None) -> Array:
        """A flat buffer on ``device`` (default: the backend's own memory: 64-byte
        aligned host memory, or the GPU for NCCL)."""
        return (device or self.device).empty(n, dtype)

    @property
    def device(self) -> Device:
        """Where this backend's buffers live by default."""
        return HOST

    def unchecked(self) -> Communicator:
        """This rank's communicator without per-call cross-rank argument checks.

        For callers that verified once that every rank issues the same
        collectives (the ZeRO transforms check their layout at ``init``).
        Backends whose checks cost nothing return ``self``.
        """
        return self

    # -- the public calls ---------------------------------------------------
    def all_gather_into(self, out: _A, x: Array) -> _A:
        self._check_sizes("all_gather", out.size, x.size * self.world_size, out, x)
        self._drain()
        if self.world_size == 1:
            return self._alone(out, x)
        _issued()
        _inside(self._all_gather, out, x)
        return out

    def reduce_scatter_into(self, out: _A, x: Array, op: str = "sum") -> _A:
        self._check_op("reduce_scatter", op)
        self._check_sizes("reduce_scatter", x.size, out.size * self.world_size, out, x)
        self._drain()
        if self.world_size == 1:
            return self._alone(out, x)
        _issued()
        _inside(self._reduce_scatter, out, x, op)
        return out

    def all_to_all_into(self, out: _A, x: Array) -> _A:
        self._check_all_to_all(out, x)
        self._drain()
        if self.world_size == 1:
            return self._alone(out, x)
        _issued()
        _inside(self._all_to_all, out, x)
        return out

    def all_reduce_(self, x: _A, op: str = "sum") -> _A:
        self._check_op("all_reduce", op)
        self._check_memory("all_reduce", x)
        self._drain()
        if self.world_size == 1:
            return x
        _issued()
        _inside(self._all_reduce, x, op)
        return x

    def broadcast_(self, x: _A, src: int = 0) -> _A:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src must be in [0, {self.world_size}); got {src}")
        self._check_memory("broadcast", x)
        self._drain()
        if self.world_size == 1:
            return x
        _issued()
        _inside(self._broadcast, x, src)
        return x

    def barrier(self) -> None:
        self._drain()
        self._barrier()

    def send(self, x: Array, dst: int, *, tag: int = 0) -> None:
        """Send ``x`` to rank ``dst`` (see [Note: point-to-point])."""
        self._check_p2p("send", x, dst, tag)
        self._drain()
        self._send(x, dst, tag)

    def isend(self, x: Array, dst: int, *, tag: int = 0) -> Pending:
        """Start sending ``x`` to ``dst``; ``wait()`` on the handle before reusing
        ``x`` (see [Note: point-to-point]). Sends that must not wait for their
        receiver (two ranks sending to each other at once) use this."""
        self._check_p2p("send", x, dst, tag)
        self._drain()
        return self._isend(x, dst, tag)

    def _isend(self, x: Array, dst: int, tag: int) -> Pending:
        self._send(x, dst, tag)  # buffered backends: done at once
        return self._done("send", x)

    def recv_(self, out: _A, src: int, *, tag: int = 0) -> _A:
        """Receive rank ``src``'s message into ``out`` (see [Note: point-to-point])."""
        self._check_p2p("recv", out, src, tag)
        self._drain()
        self._recv(out, src, tag)
        return out

    def _prepost_recv(self, out: Array, src: int, tag: int) -> Pending:
        """Start receiving a message whose size is known to be ``out``'s; ``wait()``
        returns ``out`` once it has arrived. Only for a size that cannot differ
        (gloo aborts the process on a larger message than a posted buffer): the
        pipeline's messages after a step's first, whose sender refuses another
        shape. Here: a receive deferred to ``wait()``; gloo posts it at once, so
        the transfer runs while this rank computes."""
        self._check_p2p("recv", out, src, tag)
        comm = self

        class Deferred:
            def wait(self) -> Array:
                return comm.recv_(out, src, tag=tag)

        return Deferred()

    def split(self, color: int) -> Communicator:
        """The communicator of the ranks that pass the same ``color`` (a collective;
        see [Note: point-to-point])."""
        raise NotImplementedError(f"split: the {self.backend} backend has no sub-communicators")

    def _send(self, x: Array, dst: int, tag: int) -> None:
        raise NotImplementedError(f"send: the {self.backend} backend has no point-to-point")

    def _recv(self, out: Array, src: int, tag: int) -> None:
        raise NotImplementedError(f"recv: the {self.backend} backend has no point-to-point")

    def _check_p2p(self, name: str, buf: Array, peer: int, tag: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"{name} on rank {self.rank}: the peer must be another rank in "
                             f"[0, {self.world_size}); got {peer}")
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 2**20:
            raise ValueError(f"{name}: tag must be an int in [0, 2**20); got {tag!r}")
        self._check_memory(name, buf)
        if not buf.flags.c_contiguous:
            raise ValueError(f"{name}: the buffer must be C-contiguous")

    def _colors(self, color: int) -> list[int]:
        """Every rank's color, by rank (for ``split``)."""
        import numpy as np

        if isinstance(color, bool) or not isinstance(color, int) or color < 0:
            raise ValueError(f"split: color must be an int >= 0; got {color!r}")
        mine = np.array([color], np.int64)
        every = np.empty(self.world_size, np.int64)
        if self.host_memory is False:
            device = self.device
            out = device.empty(self.world_size, np.int64)
            self.all_gather_into(out, device.from_host(mine))
            every = device.to_host(out)
        else:
            self.all_gather_into(every, mine)
        return [int(c) for c in every]

    def all_gather_async(self, out: Array, x: Array) -> Work:
        self._check_sizes("all_gather", out.size, x.size * self.world_size, out, x)
        if self.world_size == 1:
            return self._done("all_gather", self.all_gather_into(out, x))
        return self._submit("all_gather", self._all_gather, out, x)

    def reduce_scatter_async(self, out: Array, x: Array, op: str = "sum") -> Work:
        self._check_op("reduce_scatter", op)
        self._check_sizes("reduce_scatter", x.size, out.size * self.world_size, out, x)
        if self.world_size == 1:
            return self._done("reduce_scatter", self.reduce_scatter_into(out, x, op))
        return self._submit("reduce_scatter", self._reduce_scatter, out, x, op)

    def all_to_all_async(self, out: Array, x: Array) -> Work:
        self._check_all_to_all(out, x)
        if self.world_size == 1:
            return self._done("all_to_all", self.all_to_all_into(out, x))
        return self._submit("all_to_all", self._all_to_all, out, x)

    def all_reduce_async(self, x: Array, op: str = "sum") -> Work:
        self._check_op("all_reduce", op)
        self._check_memory("all_reduce", x)
        if self.world_size == 1:
            return self._done("all_reduce", self.all_reduce_(x, op))
        return self._submit("all_reduce", self._all_reduce, x, op)

    def close(self) -> None:
        """Wait for outstanding work and stop this rank's async worker."""
        if self._executor is not None:
            self._drain()
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- helpers --------------------------------------------------------------
    @staticmethod
    def _alone(out: _A, x: Array) -> _A:
        """A collective over one rank: its result is its input (a sum or mean of
        one), copied where the output is another buffer; nothing is sent."""
        if out is not x:
            device_of(out).xp.copyto(out, x)
        return out

    def _done(self, name: str, out: Array) -> Work:
        """A handle to work already complete."""
        done: cf.Future = cf.Future()
        done.set_result(None)
        return Work(done, name, self.timeout, self.rank, out)

    def _submit(self, name: str, fn: Callable[..., None], out: Array | None,
                *args: object) -> Work:
        with self._lock:
            if self._executor is None:
                self._executor = cf.ThreadPoolExecutor(
                    1, thread_name_prefix=f"zeroshard-{self.backend}-rank{self.rank}")
            _issued()
            future = self._executor.submit(_inside, fn, out, *args)
            self._pending.append(future)
        future.add_done_callback(self._forget)
        return Work(future, name, self.timeout, self.rank, out)

    def _forget(self, future: cf.Future) -> None:
        with self._lock:
            if future in self._pending and future.exception() is None:
                self._pending.remove(future)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            Work(future, "an earlier async collective", self.timeout, self.rank).wait()

    def _check_dtype(self, name: str, buf: Array) -> None:  # noqa: B027 (most move any)
        """Refuse a dtype this backend cannot move, before anything is sent (on one
        rank too, where nothing is)."""

    def _check_memory(self, name: str, buf: Array) -> None:
        self._check_dtype(name, buf)
        if self.host_memory is None:
            return
        device = device_of(buf)
        if device.host != self.host_memory:
            where = "host (numpy)" if self.host_memory else "GPU"
            raise TypeError(f"{name} on rank {self.rank}: the {self.backend} backend moves "
                            f"{where} memory, and this buffer is a {device.name} array; "
                            + ("use NCCL for GPU arrays (ops.init_from_env() picks it on GPU "
                               "machines)" if self.host_memory else
                               "copy host arrays to the GPU first, or use gloo for CPU state"))

    def _check_op(self, name: str, op: str) -> None:
        if op not in OPS:
            raise ValueError(f"{name}: op must be one of {OPS}; got {op!r}")

    def _check_all_to_all(self, out: Array, x: Array) -> None:
        self._check_sizes("all_to_all", out.size, x.size, out, x)
        if x.size % self.world_size:
            raise ValueError(f"all_to_all on rank {self.rank}: {x.size} elements do not split "
                             f"into {self.world_size} equal sections")
        if out is x:
            raise ValueError("all_to_all: out must be another buffer than x")

    def _check_sizes(self, name: str, got: int, want: int, out: Array, x: Array) -> None:
        if got != want:
            raise ValueError(f"{name} on rank {self.rank}: with world_size={self.world_size}, "
                             f"input of {x.size} and output of {out.size} elements do not fit")
        if out.dtype != x.dtype:
            raise TypeError(f"{name}: output dtype {out.dtype} differs from input dtype {x.dtype}")
        self._check_memory(name, x)
        self._check_memory(name, out)
        for label, buf in (("output", out), ("input", x)):
            if not buf.flags.c_contiguous:
                raise ValueError(f"{name}: the {label} buffer must be C-contiguous")
