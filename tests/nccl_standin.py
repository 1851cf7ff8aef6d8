"""A stand-in for NCCL's communicator (cupy.cuda.nccl's NcclCommunicator
methods) on host memory with threads, over the device stand-in's arrays (whose
``.data.ptr`` is host memory): the NCCL backend's real code runs against it in
the tests. It decodes datatypes from NCCL's own enum values (nccl.h), so a
wrong entry in the backend's dtype table shows as a wrong result."""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from ops.comm._nccl import NcclCommunicator
from ops.device._arrays import BF16
from ops.testing import STANDIN

TIMEOUT = 120  # seconds a rank waits on its peers (a hang fails, slowly on a busy machine)

# ncclDataType_t and ncclRedOp_t values from nccl.h.
NCCL_H_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 4: np.int64, 6: np.float16,
                 7: np.float32, 8: np.float64, 9: BF16}
NCCL_H_OPS = {0: "sum", 4: "avg"}


def view(ptr: int, count: int, datatype: int) -> np.ndarray:
    dtype = np.dtype(NCCL_H_DTYPES[datatype])
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=np.uint8).view(dtype)


_GROUP = threading.local()  # this rank's (thread's) open NCCL group, if any


def _received(taken, rank, peer):
    if not taken.wait(TIMEOUT):
        raise AssertionError(f"stand-in NCCL: rank {rank}'s send to rank {peer} was not "
                             f"received in {TIMEOUT} s (on a GPU: a hang)")


class GroupedNccl:
    """cupy.cuda.nccl's constants, with ncclGroupStart/End for the stand-in: the
    sends of a group complete together with its receives, at groupEnd."""

    def __init__(self, nccl):
        self._nccl = nccl

    def __getattr__(self, name):
        return getattr(self._nccl, name)

    def groupStart(self):  # NCCL's name
        assert getattr(_GROUP, "sends", None) is None, "stand-in NCCL: nested groups"
        _GROUP.sends = []

    def groupEnd(self):
        sends, _GROUP.sends = _GROUP.sends, None
        for taken, rank, peer in sends:
            _received(taken, rank, peer)


class StandInNccl:
    """One rank of an NCCL communicator, simulated on host memory with threads."""

    def __init__(self, shared: dict, rank: int, world: int) -> None:
        self.shared, self.rank, self.world = shared, rank, world
        self.calls: list[tuple] = []

    def _exchange(self, value):
        self.shared["slots"][self.rank] = value
        self.shared["barrier"].wait(TIMEOUT)
        values = list(self.shared["slots"])
        self.shared["barrier"].wait(TIMEOUT)
        return values

    def allGather(self, send, recv, count, datatype, stream):  # NCCL method names
        self.calls.append(("allGather", count, datatype))
        parts = self._exchange(view(send, count, datatype).copy())
        view(recv, count * self.world, datatype)[...] = np.concatenate(parts)

    def reduceScatter(self, send, recv, count, datatype, op, stream):
        self.calls.append(("reduceScatter", count, datatype, op))
        parts = self._exchange(view(send, count * self.world, datatype).astype(np.float64))
        total = np.sum(parts, axis=0)[self.rank * count:(self.rank + 1) * count]
        if NCCL_H_OPS[op] == "avg":
            total /= self.world
        view(recv, count, datatype)[...] = total

    def allReduce(self, send, recv, count, datatype, op, stream):
        self.calls.append(("allReduce", count, datatype, op))
        total = np.sum(self._exchange(view(send, count, datatype).astype(np.float64)), axis=0)
        view(recv, count, datatype)[...] = total / (self.world if NCCL_H_OPS[op] == "avg" else 1)

    def broadcast(self, send, recv, count, datatype, root, stream):
        self.calls.append(("broadcast", count, datatype, root))
        parts = self._exchange(view(send, count, datatype).copy())
        view(recv, count, datatype)[...] = parts[root]

    # point-to-point: per-pair queues of (count, datatype, bytes), in order, as NCCL's.
    # With rendezvous, a send returns only once its receive has taken it, as a
    # GPU's NCCL may hold one: two ranks sending to each other at once then fail
    # here instead of passing on buffered sends.
    def send(self, send, count, datatype, peer, stream):
        self.calls.append(("send", count, datatype, peer))
        taken = threading.Event()
        self.shared["mail"][self.rank, peer].put((count, datatype,
                                                   view(send, count, datatype).copy(), taken))
        if not self.shared["rendezvous"]:
            return
        if getattr(_GROUP, "sends", None) is not None:  # in a group: waited for at its end
            _GROUP.sends.append((taken, self.rank, peer))
        else:
            _received(taken, self.rank, peer)

    def recv(self, recv, count, datatype, peer, stream):
        self.calls.append(("recv", count, datatype, peer))
        got = self.shared["mail"][peer, self.rank].get(timeout=TIMEOUT)
        if got[:2] != (count, datatype):  # NCCL would hang or corrupt: make it loud here
            raise AssertionError(f"stand-in NCCL: posted {count} x {datatype}, got {got[:2]}")
        view(recv, count, datatype)[...] = got[2]
        got[3].set()

    def commSplit(self, color, key):  # collective, as NCCL's
        self.calls.append(("commSplit", color, key))
        colors = self._exchange(color)
        members = [r for r, c in enumerate(colors) if c == color]
        with self.shared["lock"]:
            self.shared["splits"][self.rank] = self.shared["splits"].get(self.rank, 0) + 1
            k = (self.shared["splits"][self.rank], color)
            if k not in self.shared["children"]:
                self.shared["children"][k] = shared_state(len(members),
                                                          self.shared["rendezvous"])
        return StandInNccl(self.shared["children"][k], members.index(self.rank), len(members))


def shared_state(world, rendezvous=False):
    import collections
    import queue

    return {"slots": [None] * world, "barrier": threading.Barrier(world),
            "mail": collections.defaultdict(queue.Queue), "lock": threading.Lock(),
            "splits": {}, "children": {}, "rendezvous": rendezvous}


def run_ranks(world, body, nccl, *, rendezvous=False):
    """``body(comm)`` on ``world`` thread ranks, each an NcclCommunicator over the
    stand-in (``rendezvous``: sends wait for their receive): (results, comms)."""
    shared = shared_state(world, rendezvous)
    comms = [NcclCommunicator(r, world, comm=StandInNccl(shared, r, world),
                              nccl=GroupedNccl(nccl), device=STANDIN) for r in range(world)]
    results, errors = [None] * world, []

    def go(r):
        try:
            results[r] = body(comms[r])
        except Exception as e:  # collected and re-raised below
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, comms
