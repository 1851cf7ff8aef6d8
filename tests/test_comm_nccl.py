"""The NCCL backend's argument handling (pointers, element counts, dtype and op
codes), run without a GPU against a stand-in with NCCL's semantics
(tests/nccl_standin.py), over the device stand-in's arrays (whose
``.data.ptr`` is host memory)."""

from __future__ import annotations

import numpy as np
import pytest

import ops
from ops.comm._nccl import check_distinct_devices
from ops.device._arrays import BF16
from ops.testing import STANDIN, xp
from tests.nccl_standin import run_ranks

nccl = pytest.importorskip("cupy.cuda.nccl")

def _run(world, body):
    return run_ranks(world, body, nccl)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16, np.float16],
                         ids=["f32", "f64", "bf16", "f16"])
def test_collectives_through_the_nccl_entry_points(world, dtype):
    k = 7
    xs = [np.arange(k * world, dtype=np.float64).astype(dtype) + r for r in range(world)]

    def body(comm):
        x = xp.asarray(xs[comm.rank])
        gathered = comm.allocate(k * world * world, dtype)
        comm.all_gather_into(gathered, x)
        scattered = xp.zeros(k, dtype)
        comm.reduce_scatter_into(scattered, x, "mean")
        summed = x.copy()
        comm.all_reduce_(summed, "sum")
        bcast = x.copy()
        comm.broadcast_(bcast, src=world - 1)
        swapped = comm.allocate(k * world, dtype)
        comm.all_to_all_into(swapped, x)
        return tuple(a.get() for a in (gathered, scattered, summed, bcast, swapped))

    results, comms = _run(world, body)
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for r, (gathered, scattered, summed, bcast, swapped) in enumerate(results):
        np.testing.assert_array_equal(swapped, np.concatenate([x[r * k:(r + 1) * k] for x in xs]))
        np.testing.assert_array_equal(gathered, np.concatenate(xs))
        np.testing.assert_allclose(scattered.astype(np.float64),
                                   (total / world)[r * k:(r + 1) * k], rtol=1e-2)
        np.testing.assert_allclose(summed.astype(np.float64), total, rtol=1e-2)
        np.testing.assert_array_equal(bcast, xs[-1])
    calls = comms[0].comm.calls
    if world == 1:  # one rank sends nothing: the results above are its inputs
        assert calls == []
        return
    peers = [p for p in range(world) if p != 0]
    assert [c[0] for c in calls] == ["allGather", "reduceScatter", "allReduce", "broadcast",
                                     *["send"] * len(peers), *["recv"] * len(peers)]
    assert [c[1] for c in calls] == [k * world, k, k * world, k * world,
                                     *[k] * 2 * len(peers)]  # element counts
    assert [c[3] for c in calls[4:]] == peers * 2  # a send and a receive per peer


def test_unsupported_dtype_and_non_contiguous_buffers_are_refused():
    def body(comm):
        with pytest.raises(TypeError, match="NCCL cannot move dtype complex64"):
            comm.all_reduce_(xp.zeros(4, np.complex64))
        with pytest.raises(ValueError, match="C-contiguous"):
            comm.all_gather_into(xp.zeros(4, np.float32), xp.zeros(8, np.float32)[::2])
        return True

    assert _run(1, body)[0] == [True]


def test_host_arrays_are_refused_before_nccl_sees_a_pointer():
    def body(comm):
        with pytest.raises(TypeError, match=r"nccl backend moves GPU memory.*numpy array"):
            comm.all_reduce_(np.zeros(4, np.float32))
        with pytest.raises(TypeError, match=r"all_gather on rank 0.*numpy array"):
            comm.all_gather_into(xp.zeros(4, np.float32), np.zeros(4, np.float32))
        return comm.comm.calls

    assert _run(1, body)[0] == [[]]  # nothing reached NCCL


def test_two_ranks_on_one_gpu_are_named():
    check_distinct_devices(["a/0", "a/1", "b/0", "b/1"])
    with pytest.raises(RuntimeError, match=r"ranks \[1, 3\] on GPU 1 of host a"):
        check_distinct_devices(["a/0", "a/1", "b/0", "a/1"])


def test_point_to_point_and_split_through_the_nccl_entry_points():
    def body(comm):
        r, w = comm.rank, comm.world_size
        x = STANDIN.from_host(np.full(5, r, np.float32))
        out = STANDIN.empty(5, np.float32)
        if r % 2 == 0:
            comm.send(x, (r + 1) % w, tag=2)
            comm.recv_(out, (r - 1) % w, tag=2)
        else:
            comm.recv_(out, (r - 1) % w, tag=2)
            comm.send(x, (r + 1) % w, tag=2)
        sub = comm.split(r % 2)
        g = STANDIN.empty(sub.world_size, np.int64)
        sub.all_gather_into(g, STANDIN.from_host(np.array([r], np.int64)))
        mismatch = None
        if r == 0:
            comm.send(STANDIN.from_host(np.zeros(3, np.float32)), 1, tag=7)
        elif r == 1:
            try:
                comm.recv_(STANDIN.empty(3, np.float32), 0, tag=8)
            except ops.CollectiveError as e:
                mismatch = str(e)
        return float(STANDIN.to_host(out)[0]), sub.rank, STANDIN.to_host(g).tolist(), mismatch

    results, comms = _run(4, body)
    assert [res[0] for res in results] == [3.0, 0.0, 1.0, 2.0]
    assert [res[1:3] for res in results] == [(0, [0, 2]), (0, [1, 3]), (1, [0, 2]), (1, [1, 3])]
    assert "tag 7" in results[1][3] and "with tag 8" in results[1][3]
    assert ("send", 3, 4, 1) in comms[0].comm.calls  # the header: 3 int64s (NCCL_INT64 = 4)


def test_two_ranks_sending_to_each_other_at_once_complete_as_one_group():
    """Each rank's isend and the receive after it go out as one NCCL group, so
    with sends that wait for their receive (as a GPU's may) neither waits on
    the other; the stand-in records the group's order."""
    def body(comm):
        peer = 1 - comm.rank
        x = STANDIN.from_host(np.full(4, comm.rank + 1, np.float32))
        out = STANDIN.empty(4, np.float32)
        sent = comm.isend(x, peer, tag=3)
        comm.recv_(out, peer, tag=3)
        sent.wait()
        comm.barrier()  # a collective after: nothing left queued
        return STANDIN.to_host(out).tolist(), comm._queued

    results, comms = run_ranks(2, body, nccl, rendezvous=True)
    assert [r[0] for r in results] == [[2.0] * 4, [1.0] * 4]
    assert all(r[1] == [] for r in results)
    kinds = [c[0] for c in comms[0].comm.calls]
    assert kinds[:4] == ["send", "send", "recv", "recv"]  # header and payload, each way


def test_all_to_all_is_one_group_with_sends_that_wait_for_their_receive():
    """Every peer's send and receive in one NCCL group: with sends held until
    received (as a GPU's may be), three ranks exchange without waiting on each
    other's sends."""
    def body(comm):
        x = STANDIN.from_host(np.arange(6, dtype=np.float32) + 10 * comm.rank)
        out = STANDIN.empty(6, np.float32)
        comm.all_to_all_into(out, x)
        return STANDIN.to_host(out).tolist()

    results, _ = run_ranks(3, body, nccl, rendezvous=True)
    for r, got in enumerate(results):
        assert got == [float(10 * s + 2 * r + i) for s in range(3) for i in range(2)]
