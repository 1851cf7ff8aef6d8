"""Threads backend: N ranks in one process, one thread and communicator each.

For notebooks and fast tests. Ranks exchange references through a shared slot
table and two barriers per collective (deposit, read, and a second barrier so
no rank reuses a buffer another is still reading). Buffers may live on any
device (see [Note: devices]): copies and sums go through the buffers' own
array module, so thread ranks share one GPU as they share the host. numpy
releases the GIL in its copies and sums, so the ranks' data movement runs in
parallel.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from ops._comm import (
    CollectiveError,
    CollectiveTimeout,
    Communicator,
    PeerFailed,
)
from ops._device import device_of

__all__ = ["ThreadCommunicator", "ThreadGroup", "spawn"]

DEFAULT_TIMEOUT = 300.0


class ThreadGroup:
    """State shared by the ranks of one in-process group."""

    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {world_size}")
        self.world_size, self.timeout = world_size, timeout
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Any] = [None] * world_size
        self._entered = [0] * world_size  # collectives each rank has entered
        self._returned: set[int] = set()  # ranks whose function has returned
        self._lock = threading.Lock()
        self.failure: tuple[int, BaseException] | None = None
        self._mail: dict[tuple[int, int, int], collections.deque] = \
            collections.defaultdict(collections.deque)
        self._mail_cv = threading.Condition(threading.Lock())
        # sub-groups made by split: (group, its members' ranks here)
        self._children: dict[tuple[int, int], tuple[ThreadGroup, list[int]]] = {}
        self._parent: ThreadGroup | None = None

    def communicators(self) -> list[ThreadCommunicator]:
        return [ThreadCommunicator(self, r) for r in range(self.world_size)]

    def fail(self, rank: int, exc: BaseException) -> None:
        """Record the first failure and wake every rank waiting in a collective or
        a receive, here and in the groups split from (or containing) this one."""
        if self.failure is not None and self._barrier.broken:
            return
        if self.failure is None:
            self.failure = (rank, exc)
        self._barrier.abort()
        with self._mail_cv:
            self._mail_cv.notify_all()
        for child, members in list(self._children.values()):
            child.fail(members.index(rank) if rank in members else -1, exc)
        if self._parent is not None:
            self._parent.fail(-1, exc)

    def returned(self, rank: int) -> None:
        """Rank ``rank``'s function returned: ranks waiting in a collective it never
        entered fail now, naming it, instead of at the timeout."""
        with self._lock:
            self._returned.add(rank)
            ahead = [r for r in range(self.world_size) if self._entered[r] > self._entered[rank]]
        with self._mail_cv:
            self._mail_cv.notify_all()
        for child, members in list(self._children.values()):
            if rank in members:
                child.returned(members.index(rank))
        if ahead:
            self.fail(rank, RankReturned(f"rank {rank} returned from its function while rank(s) "
                                         f"{ahead} wait in a collective it never called"))

    def wait(self, rank: int, name: str) -> None:
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            failure = self.failure
            if failure is not None and failure[0] != rank:
                r, exc = failure
                who = "the caller of ops.spawn" if r < 0 else f"rank {r}"
                raise PeerFailed(f"{name} on rank {rank} cannot complete: {who} failed "
                                 f"({type(exc).__name__}: {exc})") from None
            if failure is None:
                behind = [r for r in range(self.world_size)
                          if self._entered[r] < self._entered[rank]]
                err = CollectiveTimeout(
                    f"{name} on rank {rank} did not complete within {self.timeout:g} s: "
                    f"rank(s) {behind or 'unknown'} never reached it")
                self.fail(rank, err)
                raise err from None
            raise

    def exchange(self, rank: int, name: str, meta: tuple, value: Any) -> list[Any]:
        """Deposit ``value``, wait for every rank, check that all ``meta`` agree.

        Returns every rank's value; they stay valid until :meth:`wait` is called
        again (the second barrier of the collective).
        """
        with self._lock:
            gone = sorted(self._returned - {rank})
            self._entered[rank] += 1
        if gone:
            err = PeerFailed(f"{name} on rank {rank} cannot complete: rank(s) {gone} already "
                             "returned from their function")
            self.fail(rank, err)
            raise err
        if self.failure is not None:  # interrupted, or a peer failed outside a collective
            self.wait(rank, name)
        self._slots[rank] = (meta, value)
        self.wait(rank, name)
        slots = list(self._slots)
        metas = [m for m, _ in slots]
        if any(m != metas[0] for m in metas):
            detail = "; ".join(f"rank {r}: {m[0]}" + ("" if m[1] is None else f"{m[1:]}")
                               for r, m in enumerate(metas))
            err = CollectiveError(f"{name}: ranks called collectives that do not match "
                                  f"(collective (size, dtype, argument, device)): {detail}; "
                                  "every rank must make the same calls in the same order "
                                  "(save and load included)")
            self.fail(rank, err)
            raise err
        return [v for _, v in slots]


    # -- point-to-point (see [Note: point-to-point]) ------------------------------
    def post(self, src: int, dst: int, tag: int, meta: tuple, value: Any) -> None:
        with self._mail_cv:
            self._mail[src, dst, tag].append((meta, value))
            self._mail_cv.notify_all()

    def take(self, rank: int, src: int, tag: int, meta: tuple) -> Any:
        """The next message from ``src`` to ``rank`` with ``tag`` (its meta checked)."""
        deadline = time.monotonic() + self.timeout
        err: BaseException | None = None
        with self._mail_cv:
            box = self._mail[src, rank, tag]
            while not box:
                failure = self.failure
                if failure is not None and failure[0] != rank:
                    r, exc = failure
                    who = "the caller of ops.spawn" if r < 0 else f"rank {r}"
                    err = PeerFailed(f"recv from rank {src} on rank {rank} cannot complete: "
                                     f"{who} failed ({type(exc).__name__}: {exc})")
                elif src in self._returned:
                    err = RankReturned(f"recv on rank {rank}: rank {src} returned from its "
                                       "function without sending the message")
                elif time.monotonic() > deadline:
                    err = CollectiveTimeout(f"recv from rank {src} on rank {rank} did not "
                                            f"complete within {self.timeout:g} s")
                if err is not None:
                    break
                self._mail_cv.wait(min(0.1, max(deadline - time.monotonic(), 0.001)))
            else:
                got, value = box.popleft()
        if err is None and got != meta:
            err = CollectiveError(f"recv on rank {rank}: rank {src} sent {got[1]} elements of "
                                  f"{got[2]} with tag {tag}, but the receive is for {meta[1]} "
                                  f"elements of {meta[2]}")
        if err is not None:
            if not isinstance(err, PeerFailed):
                self.fail(rank, err)
            raise err
        return value


class RankReturned(PeerFailed):
    """A rank's function returned while its peers waited in a collective."""


class ThreadCommunicator(Communicator):
    """One rank of a :class:`ThreadGroup`."""

    backend = "threads"

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        super().__init__(rank, group.world_size, group.timeout)
        self.group = group

    def _meta(self, name: str, x: Any, arg: Any = None) -> tuple:
        if x is None:
            return (name, None, None, arg, None)
        return (name, x.size, str(x.dtype), arg, device_of(x).name)

    def _all_gather(self, out: Any, x: Any) -> None:
        xs = self.group.exchange(self.rank, "all_gather", self._meta("all_gather", x), x)
        xp, k = device_of(out).xp, x.size
        for r, xr in enumerate(xs):
            xp.copyto(out[r * k:(r + 1) * k], xr.reshape(-1))
        self.group.wait(self.rank, "all_gather")

    def _sum_slices(self, xs: list[Any], lo: int, hi: int, op: str) -> Any:
        xp = device_of(xs[0]).xp
        acc = xs[0].reshape(-1)[lo:hi].copy()
        for xr in xs[1:]:
            xp.add(acc, xr.reshape(-1)[lo:hi], out=acc)
        if op == "mean":
            xp.divide(acc, acc.dtype.type(self.world_size), out=acc)
        return acc

    def _reduce_scatter(self, out: Any, x: Any, op: str) -> None:
        meta = self._meta("reduce_scatter", x, op)
        xs = self.group.exchange(self.rank, "reduce_scatter", meta, x)
        k = out.size
        device_of(out).xp.copyto(out, self._sum_slices(xs, self.rank * k, (self.rank + 1) * k,
                                                        op))
        self.group.wait(self.rank, "reduce_scatter")

    def _all_reduce(self, x: Any, op: str) -> None:
        xs = self.group.exchange(self.rank, "all_reduce", self._meta("all_reduce", x, op), x)
        total = self._sum_slices(xs, 0, x.size, op)
        self.group.wait(self.rank, "all_reduce")  # nobody reads x any more
        device_of(x).xp.copyto(x.reshape(-1), total)

    def _broadcast(self, x: Any, src: int) -> None:
        xs = self.group.exchange(self.rank, "broadcast", self._meta("broadcast", x, src), x)
        if self.rank != src:
            device_of(x).xp.copyto(x, xs[src])
        self.group.wait(self.rank, "broadcast")

    def _barrier(self) -> None:
        self.group.exchange(self.rank, "barrier", self._meta("barrier", None), None)
        self.group.wait(self.rank, "barrier")

    def _send(self, x: Any, dst: int, tag: int) -> None:
        self.group.post(self.rank, dst, tag, self._meta("p2p", x), x.copy())

    def _recv(self, out: Any, src: int, tag: int) -> None:
        value = self.group.take(self.rank, src, tag, self._meta("p2p", out))
        device_of(out).xp.copyto(out, value)

    def split(self, color: int) -> ThreadCommunicator:
        colors = self._colors(color)
        members = [r for r, c in enumerate(colors) if c == color]
        self._splits = getattr(self, "_splits", 0) + 1
        parent = self.group
        with parent._lock:
            key = (self._splits, color)
            if key not in parent._children:
                child = ThreadGroup(len(members), parent.timeout)
                child._parent = parent
                parent._children[key] = (child, members)
            child = parent._children[key][0]
        return ThreadCommunicator(child, members.index(self.rank))


def spawn(fn: Callable[..., Any], world_size: int, *args: Any,
          timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Run ``fn(comm, *args)`` on ``world_size`` thread ranks; return results by rank.

    Each rank gets its own :class:`ThreadCommunicator`. If any rank raises, the
    others' pending and future collectives fail at once (:class:`PeerFailed`)
    and the first failure is re-raised here, annotated with its rank.

    Example:
      >>> import numpy as np, ops
      >>> ops.spawn(lambda comm: ops.all_gather(comm, np.array([comm.rank])).tolist(), 3)
      [[0, 1, 2], [0, 1, 2], [0, 1, 2]]
    """
    group = ThreadGroup(world_size, timeout)
    comms = group.communicators()
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = fn(comms[rank], *args)
            comms[rank].close()
            group.returned(rank)
        except BaseException as exc:  # re-raised in the caller below
            errors[rank] = exc
            group.fail(rank, exc)

    threads = [threading.Thread(target=run, args=(r,), name=f"zeroshard-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():  # join in slices: Ctrl-C reaches the main thread at once
                t.join(0.1)
    except KeyboardInterrupt:
        # Every rank fails at its next collective (within one unit's compute);
        # wait for them so nothing keeps running after control returns.
        group.fail(-1, KeyboardInterrupt("interrupted"))
        for t in threads:
            t.join(group.timeout)
        raise
    if errors:
        rank, exc = group.failure if group.failure and group.failure[0] in errors else \
            min(errors.items())
        exc = errors[rank]
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised on rank {rank} of {world_size} in ops.spawn)")
        raise exc
    return results
