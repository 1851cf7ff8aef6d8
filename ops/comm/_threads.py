"""Threads backend: N ranks in one process, one thread and communicator each.

For notebooks and fast tests. See [Note: thread collectives]. Buffers may
live on any device (see [Note: devices]): copies and sums go through the
buffers' own array module, so thread ranks share one GPU as they share the
host.

[Note: thread collectives]
A collective is one rendezvous, with no thread of its own. Each rank, when
it issues its k-th collective of the group, deposits its arguments in round k
and goes on (an async call returns at once); the rank that arrives last runs
the collective for every rank (every copy and sum, ranks added in rank order)
and completes each rank's handle. So no rank waits unless it asks for a
result that is not there yet, nothing wakes a thread per collective, and no
rank can reuse a buffer another still reads (every read is done before any
handle completes). The arguments are checked to agree across ranks before
anything moves. A rank that fails, returns early or never arrives fails the
others' pending and later collectives at once, naming it.

A collective of at least :data:`SHARE_BYTES` (the ranks' inputs together) is
split into parts that write disjoint outputs: an all-gather's or
reduce-scatter's one rank's output each, an all-reduce's one range of the
elements each. The last rank to arrive runs parts until none is left, and
a rank already waiting on its handle runs parts too, so ranks that wait copy
and sum at once (numpy releases the GIL for both). Every handle still
completes only when every part is done, and a part that fails fails every
rank's collective. On 2 cores, 2 ranks (``python benchmarks/collectives.py
threads``, two runs each): a 16 MiB all-gather 5.1-5.2 GB/s of bus bandwidth
against 2.0-2.7 run by one rank, a reduce-scatter 6.7-7.0 against 1.6-1.8
(its sections are summed into the outputs directly, one pass, where the
three passes of a copy, an add and a copy-out had been). Below the
threshold the last rank runs it all: waking a rank costs more than the
copies save; so does it where an output overlaps an input (in place). A
rank's wait on such a collective (a step's ``all_gather_wait`` and
``reduce_wait``) includes the parts it ran.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from typing import cast

from ops._types import Array
from ops.comm._base import (
    CollectiveError,
    CollectiveTimeout,
    Communicator,
    PeerFailed,
    Work,
    _inside,
    _issued,
)
from ops.comm._thread_runs import PARTS, RUN, apart
from ops.device._device import device_of

__all__ = ["DEFAULT_TIMEOUT", "SHARE_BYTES", "ThreadCommunicator", "ThreadGroup"]

DEFAULT_TIMEOUT = 300.0
SHARE_BYTES = 1 << 20  # see [Note: thread collectives]


class ThreadGroup:
    """State shared by the ranks of one in-process group."""

    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {world_size}")
        self.world_size, self.timeout = world_size, timeout
        self._rounds: dict[int, _Round] = {}  # collectives some rank has entered
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
        self._split: tuple[int, list[int]] = (0, [])  # (the split that made it, its ranks there)

    def communicators(self) -> list[ThreadCommunicator]:
        return [ThreadCommunicator(self, r) for r in range(self.world_size)]

    def fail(self, rank: int, exc: BaseException) -> None:
        """Record the first failure and fail every rank's pending collectives and
        receives, here and in the groups split from (or containing) this one."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = (rank, exc)
            rounds, self._rounds = list(self._rounds.values()), {}
        for pending in rounds:
            for r, slot in enumerate(pending.slots):
                if slot is not None:
                    _settle(slot.future, self._peer_failed(r, slot.name))
            if pending.ready is not None:  # its handles keep it: not the ranks' buffers
                pending.slots = [None] * len(pending.slots)
                pending.ready.set()
        with self._mail_cv:
            self._mail_cv.notify_all()
        for child, members in list(self._children.values()):
            child.fail(members.index(rank) if rank in members else -1, exc)
        if self._parent is not None:
            self._parent.fail(-1, exc)

    def _peer_failed(self, rank: int, name: str) -> PeerFailed:
        r, exc = self.failure or (-1, None)
        who = "the caller of ops.spawn" if r < 0 else f"rank {r}"
        return PeerFailed(f"{name} on rank {rank} cannot complete: {who} failed "
                          f"({type(exc).__name__}: {exc})")

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

    def arrive(self, rank: int, name: str, meta: tuple, args: tuple,
               run: Callable[[list[tuple]], None]) -> tuple[cf.Future, int, _Round | None]:
        """Enter this rank's next collective with its ``args``; the last rank to
        arrive checks that every rank's ``meta`` agrees and calls ``run`` with
        every rank's args, in rank order, or runs a large one's parts with the
        ranks that wait on it (see [Note: thread collectives]). Returns the
        handle's future, the collective's number and, for one run in parts,
        its round."""
        future: cf.Future = cf.Future()
        with self._lock:
            gone = sorted(self._returned - {rank})
            k = self._entered[rank]
            self._entered[rank] += 1
            failed = self.failure is not None
            pending = entered = None
            if not gone and not failed:
                pending = entered = self._rounds.get(k)
                if pending is None:
                    pending = entered = self._rounds[k] = _Round(
                        self.world_size, _shared(meta, self.world_size))
                pending.slots[rank] = _Slot(name, meta, args, future)
                pending.arrived += 1
                if pending.arrived == self.world_size:
                    del self._rounds[k]
                    pending.run = run
                else:
                    pending = None
        if gone:
            err = PeerFailed(f"{name} on rank {rank} cannot complete: rank(s) {gone} already "
                             "returned from their function")
            self.fail(rank, err)
            raise err
        if failed:
            raise self._peer_failed(rank, name)
        if pending is not None:
            self._complete(pending, rank)
        return future, k, entered if entered is not None and entered.ready is not None else None

    def _complete(self, done: _Round, rank: int) -> None:
        slots = cast(list[_Slot], done.slots)  # every rank's, filled before completion
        metas = [slot.meta for slot in slots]
        args = [slot.args for slot in slots]
        err: BaseException | None = None
        if any(m != metas[0] for m in metas):
            detail = "; ".join(f"rank {r}: {m[0]}" + ("" if m[1] is None else
                                                       f"{(m[1], str(m[2]), *m[3:])}")
                               for r, m in enumerate(metas))
            err = CollectiveError(f"{slots[rank].name}: ranks called collectives that do not "
                                  "match (collective (size, dtype, argument, device)): "
                                  f"{detail}; every rank must make the same calls in the same "
                                  "order (save and load included)")
        elif done.ready is not None and apart(args):  # in parts, with the ranks waiting
            try:
                done.parts = PARTS[slots[rank].name](args)
            except Exception as exc:
                err = _failed(slots[rank].name, exc)
            else:
                done.left = len(done.parts)
                done.ready.set()
                self.run_parts(done, rank)
                return
        else:
            try:
                _inside(cast(Callable, done.run), args)
            except Exception as exc:  # a backend error: every rank's collective fails
                err = _failed(slots[rank].name, exc)
        self._settle(done, rank, err)

    def run_parts(self, done: _Round, rank: int) -> None:
        """Run parts of a collective that every rank has entered until none is
        left; whoever finishes the last part completes every rank's handle."""
        parts = done.parts
        while True:
            with self._lock:
                i = done.claimed
                if i >= len(parts):
                    return
                done.claimed += 1
            try:
                _inside(parts[i])
            except BaseException as exc:  # a backend error: every rank's collective fails
                # (the slots stay until the last part is done, this one included)
                done.error = done.error or _failed(cast(_Slot, done.slots[rank]).name, exc)
                if not isinstance(exc, Exception):
                    raise
            finally:
                with self._lock:
                    done.left -= 1
                    last = done.left == 0
                if last:
                    self._settle(done, rank, done.error)

    def _settle(self, done: _Round, rank: int, err: BaseException | None) -> None:
        for slot in cast(list[_Slot], done.slots):
            _settle(slot.future, err)
        if done.ready is not None:  # its handles keep the round: not the ranks' buffers
            done.slots, done.parts = [], []
            done.ready.set()
        if err is not None:
            self.fail(rank, err)

    def behind(self, k: int) -> list[int]:
        """The ranks that have not entered collective number ``k``."""
        with self._lock:
            return [r for r in range(self.world_size) if self._entered[r] <= k]

    # -- point-to-point (see [Note: point-to-point]) ------------------------------
    def post(self, src: int, dst: int, tag: int, meta: tuple, value: Array) -> None:
        with self._mail_cv:
            self._mail[src, dst, tag].append((meta, value))
            self._mail_cv.notify_all()

    def take(self, rank: int, src: int, tag: int, meta: tuple) -> Array:
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

    def _meta(self, name: str, x: Array | None, arg: object = None) -> tuple:
        if x is None:
            return (name, None, None, arg, None)
        # the dtype itself, not its name: str(dtype) shows in a step's profile
        return (name, x.size, x.dtype, arg, device_of(x).name)

    # The blocking primitives enter the round and wait for it; the async calls
    # (Communicator._submit) enter it and return the handle.
    def _all_gather(self, out: Array, x: Array) -> None:
        self._start("all_gather", out, x).wait()

    def _reduce_scatter(self, out: Array, x: Array, op: str) -> None:
        self._start("reduce_scatter", out, x, op).wait()

    def _all_to_all(self, out: Array, x: Array) -> None:
        self._start("all_to_all", out, x).wait()

    def _all_reduce(self, x: Array, op: str) -> None:
        self._start("all_reduce", x, x, op).wait()

    def _broadcast(self, x: Array, src: int) -> None:
        self._start("broadcast", x, x, src).wait()

    def _barrier(self) -> None:
        self._start("barrier", None, None).wait()

    def _submit(self, name: str, fn: Callable[..., None], out: Array | None,
                *args: object) -> Work:
        if name == "all_reduce":  # (x, op): x is its output
            args = (out, *args)
        _issued()
        work = _inside(self._start, name, out, *args)
        with self._lock:
            self._pending.append(work._future)
        work._future.add_done_callback(self._forget)
        return work

    def _start(self, name: str, out: Array | None, x: Array | None, arg: object = None) -> Work:
        future, k, entered = self.group.arrive(self.rank, name, self._meta(name, x, arg),
                                               (out, x, arg), RUN[name])
        return _RoundWork(future, name, self.timeout, self.rank, out, self.group, k, entered)

    def _send(self, x: Array, dst: int, tag: int) -> None:
        self.group.post(self.rank, dst, tag, self._meta("p2p", x), x.copy())

    def _recv(self, out: Array, src: int, tag: int) -> None:
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
                child._parent, child._split = parent, (self._splits, members)
                parent._children[key] = (child, members)
            child = parent._children[key][0]
            failure = parent.failure
        if failure is not None:  # failed before this group was made: so is the group
            child.fail(-1, failure[1])
        return ThreadCommunicator(child, members.index(self.rank))


def lineage(group: ThreadGroup, rank: int) -> tuple[ThreadGroup, tuple[int, ...], int]:
    """Where rank ``rank`` of ``group`` comes from: the root group that the
    splits began at, which splits made ``group`` (the same for every color of
    a split: its siblings share it) and the rank's rank in the root."""
    splits: list[int] = []
    while group._parent is not None:
        number, members = group._split
        splits.append(number)
        rank, group = members[rank], group._parent
    return group, tuple(reversed(splits)), rank


class _RoundWork(Work):
    """The handle of a thread collective: a rank still missing when it times out
    is named, and every rank's collectives fail."""

    def __init__(self, future: cf.Future, name: str, timeout: float, rank: int, out: Array | None,
                 group: ThreadGroup, k: int, entered: _Round | None = None) -> None:
        super().__init__(future, name, timeout, rank, out)
        self._group, self._k, self._round = group, k, entered

    def wait(self) -> Array | None:
        timeout, entered = self._timeout, self._round
        if entered is not None and not self._future.done():
            deadline = time.monotonic() + timeout
            if cast(threading.Event, entered.ready).wait(timeout) and entered.parts:
                self._group.run_parts(entered, self._rank)  # its parts (see the Note)
            self._round = None
            timeout = max(deadline - time.monotonic(), 0.0)
        try:
            self._future.result(timeout=timeout)
            return self._out
        except cf.TimeoutError:
            err = CollectiveTimeout(
                f"{self._name} on rank {self._rank} did not complete within {self._timeout:g} "
                f"s: rank(s) {self._group.behind(self._k) or 'unknown'} never reached it"
                + (_NATIVE_THREAD if isinstance(threading.current_thread(),
                                                threading._DummyThread) else ""))
            self._group.fail(self._rank, err)
            raise err from None


# A rank that waits on a thread Python did not start may be inside a JAX
# program, on one of XLA's own threads (see [Note: one program for a group's
# ranks] in ops/comm/_xla.py).
_NATIVE_THREAD = (
    "; this rank waits on a thread that Python did not start, such as one of XLA's running "
    "a JAX program's collective: if so and every rank does call it, the ranks behind may "
    "have found no XLA thread to run on (XLA's CPU runtime has one a core unless the NPROC "
    "environment variable sets the count before JAX starts): set NPROC to at least the "
    "number of thread ranks, or run ranks as processes (torchrun)")


class _Slot:
    __slots__ = ("args", "future", "meta", "name")

    def __init__(self, name: str, meta: tuple, args: tuple, future: cf.Future) -> None:
        self.name, self.meta, self.args, self.future = name, meta, args, future


class _Round:
    """One collective: each rank's slot as it arrives and what runs it; for one
    run in parts (see [Note: thread collectives]), the parts, how many are
    claimed and left, the first error, and ``ready``, set once the ranks
    waiting on it may run parts or it is complete (None for the others)."""

    __slots__ = ("arrived", "claimed", "error", "left", "parts", "ready", "run", "slots")

    def __init__(self, world_size: int, shared: bool) -> None:
        self.slots: list[_Slot | None] = [None] * world_size
        self.arrived = 0
        self.run: Callable[[list[tuple]], None] | None = None
        self.ready: threading.Event | None = None
        if shared:
            self.ready = threading.Event()
            self.parts: list[Callable[[], None]] = []
            self.claimed = 0
            self.left = 0
            self.error: BaseException | None = None


def _shared(meta: tuple, world_size: int) -> bool:
    """Whether a collective (its ``_meta``) runs in parts (see [Note: thread collectives])."""
    return meta[0] in PARTS and bool(meta[1]) and \
        meta[1] * meta[2].itemsize * world_size >= SHARE_BYTES


def _failed(name: str, exc: BaseException) -> CollectiveError:
    err = CollectiveError(f"{name} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def _settle(future: cf.Future, err: BaseException | None) -> None:
    if future.done():
        return
    if err is None:
        future.set_result(None)
    else:
        future.set_exception(err)
