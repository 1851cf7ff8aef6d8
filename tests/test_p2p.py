"""Point-to-point and sub-communicators on thread ranks ([Note: point-to-point])."""

from __future__ import annotations

import time

import numpy as np
import pytest

import ops


def test_messages_arrive_in_order_per_pair_and_tag():
    def run(comm):
        if comm.rank == 0:
            for i in range(3):
                comm.send(np.full(4, i, np.float32), 1, tag=1)
                comm.send(np.full(2, 10 + i, np.int64), 1, tag=2)
            return None
        twos = [comm.recv_(np.empty(2, np.int64), 0, tag=2)[0] for _ in range(3)]
        ones = [comm.recv_(np.empty(4, np.float32), 0, tag=1)[0] for _ in range(3)]
        return twos, ones

    assert ops.spawn(run, 2)[1] == ([10, 11, 12], [0.0, 1.0, 2.0])


def test_send_copies_so_the_buffer_can_be_reused():
    def run(comm):
        buf = np.zeros(3)
        if comm.rank == 0:
            buf[:] = 1
            comm.send(buf, 1)
            buf[:] = 2
            comm.send(buf, 1)
            return None
        return [comm.recv_(np.empty(3), 0).tolist() for _ in range(2)]

    assert ops.spawn(run, 2)[1] == [[1.0] * 3, [2.0] * 3]


def test_a_mismatched_message_fails_both_ranks_naming_it():
    def run(comm):
        if comm.rank == 0:
            comm.send(np.zeros(5, np.float32), 1)
            comm.barrier()
        else:
            comm.recv_(np.empty(5, np.float64), 0)

    with pytest.raises(ops.CollectiveError, match=r"rank 0 sent 5 elements of float32"):
        ops.spawn(run, 2)


def test_a_receive_fails_at_once_when_its_sender_fails_or_returns():
    def fails(comm):
        if comm.rank == 0:
            raise ValueError("boom")
        comm.recv_(np.empty(1), 0)

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom"):
        ops.spawn(fails, 2, timeout=60)

    def returns(comm):
        if comm.rank == 1:
            comm.recv_(np.empty(1), 0)

    with pytest.raises(ops.PeerFailed, match="rank 0 returned from its function"):
        ops.spawn(returns, 2, timeout=60)
    assert time.monotonic() - t0 < 10


def test_a_receive_times_out():
    def run(comm):
        if comm.rank == 1:
            comm.recv_(np.empty(1), 0)
        else:
            time.sleep(2)

    with pytest.raises(ops.CollectiveTimeout, match="recv from rank 0 on rank 1"):
        ops.spawn(run, 2, timeout=0.5)


def test_bad_peers_and_tags_are_refused():
    comm = ops.spawn(lambda c: c, 2)[0]
    for peer in (0, 2, -1):
        with pytest.raises(ValueError, match="peer must be another rank"):
            comm.send(np.zeros(1), peer)
    with pytest.raises(ValueError, match="tag must be"):
        comm.recv_(np.zeros(1), 1, tag=-3)
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.send(np.zeros((4, 4))[:, 0], 1)


def test_split_gives_a_mesh_and_failures_cross_groups():
    def run(comm):  # a 2 (data) x 3 (pipe) mesh over 6 ranks
        data, pipe = comm.split(comm.rank % 3), comm.split(comm.rank // 3)
        return (data.rank, data.world_size, ops.all_gather(data, np.array([comm.rank])).tolist(),
                pipe.rank, pipe.world_size, ops.all_gather(pipe, np.array([comm.rank])).tolist())

    out = ops.spawn(run, 6)
    assert out[4] == (1, 2, [1, 4], 1, 3, [3, 4, 5])
    assert out[0] == (0, 2, [0, 3], 0, 3, [0, 1, 2])

    def fails(comm):
        pipe = comm.split(comm.rank // 2)
        if comm.rank == 3:
            raise RuntimeError("stage failed")
        if comm.rank == 0:  # waits in another group than the failing rank's
            pipe.recv_(np.empty(1), 1)
        else:
            pipe.barrier()

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="stage failed"):
        ops.spawn(fails, 4, timeout=60)
    assert time.monotonic() - t0 < 10


def test_routed_communicator_moves_host_messages_and_splits_for_host_buffers():
    """init_from_env on a GPU machine routes host buffers to gloo and device ones to
    NCCL; its point-to-point and split follow the same routing (here: thread ranks
    for the host side, the device stand-in for device buffers)."""
    from ops.comm._world import RoutedCommunicator
    from ops.testing import STANDIN

    def run(comm):
        device_calls = []
        routed = RoutedCommunicator(comm, lambda: device_calls.append(1) or comm)
        got = None
        if routed.rank < 2:  # both at once: isend must not wait for its receiver
            other = 1 - routed.rank
            work = routed.isend(np.arange(3, dtype=np.float32) + routed.rank, other, tag=5)
            got = routed.recv_(np.empty(3, np.float32), other, tag=5).tolist()
            work.wait()
        sub = routed.split(routed.rank % 2)
        assert sub.world_size == 2 and sub.backend == routed.backend
        total = sub.all_reduce_(np.ones(1), "sum")[0]
        with pytest.raises(NotImplementedError, match="moves host buffers only"):
            sub.all_reduce_(STANDIN.zeros(1, np.float32), "sum")
        return got, total, device_calls

    out = ops.spawn(run, 4)
    assert out[0][0] == [1.0, 2.0, 3.0] and out[1][0] == [0.0, 1.0, 2.0]
    assert [o[1] for o in out] == [2.0] * 4 and all(o[2] == [] for o in out)


def test_jax_sees_its_own_gpu_and_shares_one_without_preallocating():
    """init_from_env's JAX placement on a GPU node: a process sees the GPU its
    local rank names, and where processes outnumber GPUs (several on one) none
    takes 75% of the GPU at start."""
    from ops.comm._world import jax_gpu_placement

    assert [jax_gpu_placement(r, 8, 8) for r in (0, 7)] == [("0", True), ("7", True)]
    assert [jax_gpu_placement(r, 4, 1) for r in range(4)] == [("0", False)] * 4
    assert jax_gpu_placement(3, 4, 2) == ("1", False)
    with pytest.raises(ValueError, match="local rank 4 of 4"):
        jax_gpu_placement(4, 4, 2)
