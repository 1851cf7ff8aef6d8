"""gloo backend: torch.distributed on CPUs, one process per rank, started by torchrun.

numpy buffers cross into torch zero-copy (bf16 through an int16 view).

[Note: gloo algorithms]
gloo's own all_gather_into_tensor / reduce_scatter_tensor are slow for large
messages (its reduce-scatter has long been an all-reduce underneath, moving
twice the data it must). This backend instead posts one isend/irecv per peer
and lets gloo's pair transports run them concurrently:
- all-gather: each rank sends its chunk to every peer and receives theirs
  straight into the output: (W-1)/W of the output crosses per rank, the floor.
- reduce-scatter: each rank sends peer p its p-th chunk and receives the peers'
  copies of its own chunk, then adds the W chunks locally in rank order (so the
  result is deterministic): again (W-1)/W of the input crosses per rank.
Measured with ``benchmarks/collectives.py`` (2 processes, 4 KiB to 256 MiB),
the pairwise forms were as fast or faster than the built-ins at every size, so
``SMALL_BYTES`` (below which the built-ins would be used) is 0; the
``small_bytes`` argument lets the benchmark force either algorithm.

[Note: argument checks across processes]
gloo aborts the whole process (std::terminate in a transport thread, nothing a
caller can catch) when a rank receives more bytes than it posted, and silently
delivers garbage when it receives fewer. So, with ``check=True`` (the default),
every collective carries a 32-byte header (collective, size, dtype, argument)
to each peer on a tag of its own, and a rank posts a payload receive only after
the peer's header matched its own; otherwise it raises :class:`CollectiveError`
naming every rank's arguments. In the pairwise algorithms the header is sent
just ahead of the payload on the same connection, so checking costs no extra
round trip; before gloo's built-in all-reduce and broadcast it costs one.
"""

from __future__ import annotations

import datetime
import types
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ops._types import Array
from ops.comm._base import CollectiveError, CollectiveTimeout, Communicator, PeerFailed
from ops.device._dlpack import torch_view

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed import Work as TorchWork

_T = TypeVar("_T")

__all__ = ["GlooCommunicator"]

SMALL_BYTES = 0
_CODES = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "broadcast": 4, "p2p": 5,
          "all_to_all": 6}
_NAMES = {v: k for k, v in _CODES.items()}
_HEADER_TAG = 0x5A53  # headers travel on their own tag, never matched with payloads
_P2P_TAG = 0x100000  # point-to-point tag t: payload on _P2P_TAG + 2t, header on + 2t + 1
_DTYPE_NAMES = {zlib.crc32(n.encode()): n for n in (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8",
    "uint16", "uint32", "uint64", "bool")}


class GlooCommunicator(Communicator):
    """This process's rank in a torch.distributed gloo process group.

    Args:
      group: a gloo process group, or None for the default group (which must
        have been initialised, e.g. by :func:`ops.init_from_env`).
      timeout: seconds before a collective raises; should match the timeout the
        process group was created with (gloo enforces that one).
      check: verify before each collective that every rank passes the same
        size, dtype and arguments (see [Note: argument checks across processes]).
      small_bytes: per-rank chunk size below which gloo's built-in collectives
        are used (see [Note: gloo algorithms]).
    """

    backend = "gloo"
    host_memory = True

    def __init__(self, group: ProcessGroup | None = None, *, timeout: float = 300.0,
                 check: bool = True, small_bytes: int = SMALL_BYTES) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("GlooCommunicator needs torch.distributed initialised: use "
                               "ops.init_from_env() under torchrun")
        self._dist, self.group, self.check, self.small_bytes = dist, group, check, small_bytes
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout)
        self._peers = [dist.get_global_rank(group, r) if group is not None else r
                       for r in range(self.world_size)]

    def unchecked(self) -> GlooCommunicator:
        if not self.check:
            return self
        if getattr(self, "_unchecked", None) is None:
            self._unchecked = GlooCommunicator(self.group, timeout=self.timeout, check=False,
                                               small_bytes=self.small_bytes)
        return self._unchecked

    def _run(self, name: str, fn: Callable[..., _T], *args: object) -> _T:
        try:
            return fn(*args)
        except RuntimeError as e:
            text = str(e)
            if "imed out" in text or "Timeout" in text:
                raise CollectiveTimeout(f"{name} on rank {self.rank} did not complete within "
                                        f"{self.timeout:g} s: {text}") from e
            if any(s in text for s in ("onnection", "closed", "reset", "peer")):
                raise PeerFailed(f"{name} on rank {self.rank} failed: a peer process is gone "
                                 f"({text})") from e
            raise CollectiveError(f"{name} on rank {self.rank} failed: {text}") from e

    def _header(self, name: str, x: Array, arg: int) -> torch.Tensor:
        import torch

        return torch.tensor([_CODES[name], x.size, zlib.crc32(str(x.dtype).encode()), arg],
                            dtype=torch.int64)

    def _post_headers(self, name: str, x: Array, arg: int
                      ) -> tuple[torch.Tensor, list[TorchWork], list[TorchWork]]:
        """Send this rank's header to every peer; post receives for theirs."""
        import torch

        dist, mine = self._dist, self._header(name, x, arg)
        rows = torch.empty((self.world_size, 4), dtype=torch.int64)
        rows[self.rank] = mine
        peers = [p for p in range(self.world_size) if p != self.rank]
        sends = [dist.isend(mine, self._peers[p], group=self.group, tag=_HEADER_TAG)
                 for p in peers]
        recvs = [dist.irecv(rows[p], self._peers[p], group=self.group, tag=_HEADER_TAG)
                 for p in peers]
        return rows, sends, recvs

    def _verify(self, name: str, rows: torch.Tensor, recvs: list[TorchWork]) -> None:
        for w in recvs:
            w.wait()
        table = rows.tolist()
        if any(row != table[0] for row in table):
            detail = "; ".join(f"rank {r}: {_NAMES.get(c, '?')} of {n} elements of "
                               f"{_DTYPE_NAMES.get(d, d)}, argument {a}"
                               for r, (c, n, d, a) in enumerate(table))
            raise CollectiveError(f"{name} on rank {self.rank}: ranks called collectives that do "
                                  f"not match: {detail}")

    def _checked(self, name: str, x: Array, arg: int, payload: Callable[[], object]) -> None:
        """Run a built-in collective after a header round (see the Note)."""
        if self.check and self.world_size > 1:
            rows, sends, recvs = self._post_headers(name, x, arg)
            self._run(name, self._verify, name, rows, recvs)
            self._run(name, lambda: [w.wait() for w in sends])
        self._run(name, payload)

    def _pairwise(self, name: str, x: Array, arg: int, sends: list[tuple[int, torch.Tensor]],
                  recvs: list[tuple[int, torch.Tensor]]) -> None:
        """isend/irecv with every peer at once, headers ahead of payloads."""
        dist = self._dist
        works: list[TorchWork] = []
        if self.check:
            rows, works, header_recvs = self._post_headers(name, x, arg)
        works += [dist.isend(t, self._peers[p], group=self.group) for p, t in sends]
        if self.check:
            self._verify(name, rows, header_recvs)
        works += [dist.irecv(t, self._peers[p], group=self.group) for p, t in recvs]
        for w in works:
            w.wait()

    def _all_gather(self, out: Array, x: Array) -> None:
        o, t, k = torch_view(out), torch_view(x), x.size
        if x.nbytes < self.small_bytes or self.world_size == 1:
            self._checked("all_gather", x, 0, lambda: _single(
                self._dist, "all_gather")(o, t, self.group))
            return
        o[self.rank * k:(self.rank + 1) * k].copy_(t)
        peers = [p for p in range(self.world_size) if p != self.rank]
        self._run("all_gather", self._pairwise, "all_gather", x, 0, [(p, t) for p in peers],
                  [(p, o[p * k:(p + 1) * k]) for p in peers])

    def _reduce_scatter(self, out: Array, x: Array, op: str) -> None:
        import torch

        o, t, k, w = torch_view(out), torch_view(x), out.size, self.world_size
        arg = int(op == "mean")
        if x.nbytes < self.small_bytes * w or w == 1:
            self._checked("reduce_scatter", x, arg, lambda: _single(self._dist, "reduce_scatter")(
                o, t, self._dist.ReduceOp.SUM, self.group))
        else:
            peers = [p for p in range(w) if p != self.rank]
            staging = torch.empty((w, k), dtype=t.dtype)
            self._run("reduce_scatter", self._pairwise, "reduce_scatter", x, arg,
                      [(p, t[p * k:(p + 1) * k]) for p in peers], [(p, staging[p]) for p in peers])
            staging[self.rank].copy_(t[self.rank * k:(self.rank + 1) * k])
            o.copy_(staging[0])
            for r in range(1, w):  # rank order: deterministic
                o.add_(staging[r])
        if op == "mean":
            o.div_(w)

    def _all_to_all(self, out: Array, x: Array) -> None:
        o, t, k = torch_view(out), torch_view(x), x.size // self.world_size
        me = slice(self.rank * k, (self.rank + 1) * k)
        o[me].copy_(t[me])
        peers = [p for p in range(self.world_size) if p != self.rank]
        self._run("all_to_all", self._pairwise, "all_to_all", x, 0,
                  [(p, t[p * k:(p + 1) * k]) for p in peers],
                  [(p, o[p * k:(p + 1) * k]) for p in peers])

    def _all_reduce(self, x: Array, op: str) -> None:
        t = torch_view(x.reshape(-1))
        self._checked("all_reduce", x, int(op == "mean"),
                      lambda: self._dist.all_reduce(t, self._dist.ReduceOp.SUM, self.group))
        if op == "mean":
            t.div_(self.world_size)

    def _broadcast(self, x: Array, src: int) -> None:
        t = torch_view(x.reshape(-1))
        self._checked("broadcast", x, src,
                      lambda: self._dist.broadcast(t, self._peers[src], self.group))

    def _barrier(self) -> None:
        self._run("barrier", self._dist.monitored_barrier, self.group,
                  datetime.timedelta(seconds=self.timeout))

    def _send(self, x: Array, dst: int, tag: int) -> None:
        self._isend(x, dst, tag).wait()

    def _isend(self, x: Array, dst: int, tag: int) -> _Sending:
        """A header (size, dtype, tag), then the payload (see [Note: point-to-point])."""
        dist, peer = self._dist, self._peers[dst]
        works = [dist.isend(self._header("p2p", x, tag), peer, group=self.group,
                            tag=_P2P_TAG + 2 * tag + 1),
                 dist.isend(torch_view(x.reshape(-1)), peer, group=self.group,
                            tag=_P2P_TAG + 2 * tag)]
        return _Sending(self, f"send to rank {dst}", works, x)

    def _recv(self, out: Array, src: int, tag: int) -> None:
        import torch

        dist, peer = self._dist, self._peers[src]
        header = torch.empty(4, dtype=torch.int64)
        self._run(f"recv from rank {src}", lambda: dist.irecv(
            header, peer, group=self.group, tag=_P2P_TAG + 2 * tag + 1).wait())
        self._check_header(header, out, src, tag)
        self._run(f"recv from rank {src}", lambda: dist.irecv(
            torch_view(out.reshape(-1)), peer, group=self.group, tag=_P2P_TAG + 2 * tag).wait())

    def _prepost_recv(self, out: Array, src: int, tag: int) -> _Receiving:
        import torch

        self._check_p2p("recv", out, src, tag)
        self._drain()
        dist, peer = self._dist, self._peers[src]
        header = torch.empty(4, dtype=torch.int64)
        works = [dist.irecv(header, peer, group=self.group, tag=_P2P_TAG + 2 * tag + 1),
                 dist.irecv(torch_view(out.reshape(-1)), peer, group=self.group,
                            tag=_P2P_TAG + 2 * tag)]
        return _Receiving(self, src, tag, header, works, out)

    def _check_header(self, header: torch.Tensor, out: Array, src: int, tag: int) -> None:
        _, n, d, _ = header.tolist()
        if n != out.size or d != zlib.crc32(str(out.dtype).encode()):
            raise CollectiveError(f"recv on rank {self.rank}: rank {src} sent {n} elements of "
                                  f"{_DTYPE_NAMES.get(d, d)} with tag {tag}, but the receive is "
                                  f"for {out.size} elements of {out.dtype}")

    def split(self, color: int) -> GlooCommunicator:
        colors = self._colors(color)
        members = [self._peers[r] for r, c in enumerate(colors) if c == color]
        group = self._dist.new_group(members, timeout=datetime.timedelta(seconds=self.timeout),
                                     backend="gloo", use_local_synchronization=True)
        return GlooCommunicator(group, timeout=self.timeout, check=self.check,
                                small_bytes=self.small_bytes)


def _single(dist: types.ModuleType, name: str) -> Callable[..., object]:
    """``all_gather_single`` / ``reduce_scatter_single`` (torch 2.13 deprecates the
    ``*_into_tensor`` / ``*_tensor`` names), or the older names where torch (2.11)
    has only those; the arguments are the same."""
    new = getattr(dist, f"{name}_single", None)
    if new is not None:
        return new
    return getattr(dist, "all_gather_into_tensor" if name == "all_gather" else
                   "reduce_scatter_tensor")


class _Receiving:
    """A posted gloo receive (``GlooCommunicator._prepost_recv``)."""

    def __init__(self, comm: GlooCommunicator, src: int, tag: int, header: torch.Tensor,
                 works: list[TorchWork], out: Array) -> None:
        self._comm, self._src, self._tag, self._header = comm, src, tag, header
        self._works, self._out = works, out

    def wait(self) -> Array:
        name = f"recv from rank {self._src}"
        self._comm._run(name, self._works[0].wait)
        self._comm._check_header(self._header, self._out, self._src, self._tag)
        self._comm._run(name, self._works[1].wait)
        return self._out


class _Sending:
    """A gloo send in flight; ``wait()`` raises as a collective would."""

    def __init__(self, comm: GlooCommunicator, name: str, works: list[TorchWork],
                 buf: Array) -> None:
        self._comm, self._name, self._works, self._buf = comm, name, works, buf

    def wait(self) -> Array:
        self._comm._run(self._name, lambda: [w.wait() for w in self._works])
        return self._buf
