"""Collectives on the threads backend against numpy (np.split, sums)."""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ops
from ops.device._arrays import BF16

WORLDS = [1, 2, 3, 4, 5]
DTYPES = [np.float32, np.float64, BF16, np.float16]
DT_IDS = ["f32", "f64", "bf16", "f16"]
SIZES = [0, 1, 7, 1_000_003]


def _inputs(world, n, dtype):
    rng = np.random.default_rng(n + world)
    return [rng.standard_normal(n).astype(dtype) for _ in range(world)]


def _tol(dtype):
    return {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-6}.get(np.dtype(dtype), 2e-2)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("n", SIZES)
def test_all_gather(world, dtype, n):
    xs = _inputs(world, n, dtype)
    outs = ops.spawn(lambda comm: ops.all_gather(comm, xs[comm.rank]), world)
    want = np.concatenate(xs)
    for out in outs:
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_scatter(world, dtype, n, op):
    n = n - n % world  # reduce_scatter needs equal chunks; padding is shard's job
    xs = _inputs(world, n, dtype)
    outs = ops.spawn(lambda comm: ops.reduce_scatter(comm, xs[comm.rank], op=op), world)
    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    if op == "mean":
        total = total / world
    for r, (out, want) in enumerate(zip(outs, np.split(total, world), strict=True)):
        assert out.dtype == np.dtype(dtype), r
        np.testing.assert_allclose(out.astype(np.float64), want, rtol=_tol(dtype),
                                   atol=_tol(dtype) * world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", SIZES[:3])
def test_all_to_all(world, n):
    xs = [np.arange(world * n * 2, dtype=np.float32).reshape(world * n, 2) + 1000 * r
          for r in range(world)]
    outs = ops.spawn(lambda comm: ops.all_to_all(comm, xs[comm.rank]), world)
    for r, out in enumerate(outs):
        assert out.shape == (world * n, 2)
        want = np.concatenate([np.split(x, world)[r] for x in xs])
        np.testing.assert_array_equal(out, want)


def test_reduce_scatter_in_a_wider_dtype():
    world, n = 4, 4096
    xs = [np.full(n, 1 + 2.0**-8, BF16) for _ in range(world)]  # 1 + half a bf16 ulp
    outs = ops.spawn(lambda c: ops.reduce_scatter(c, xs[c.rank], dtype=np.float32), world)
    for out in outs:
        assert out.dtype == np.float32 and out.shape == (n // world,)
        np.testing.assert_array_equal(out, np.float32(world * float(xs[0][0])))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_all_reduce_and_broadcast(world, dtype):
    xs = _inputs(world, 1001, dtype)

    def body(comm):
        return (ops.all_reduce(comm, xs[comm.rank]), ops.broadcast(comm, xs[comm.rank],
                                                                   src=world - 1))

    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for summed, bcast in ops.spawn(body, world):
        np.testing.assert_allclose(summed.astype(np.float64), total, rtol=_tol(dtype),
                                   atol=_tol(dtype) * world)
        np.testing.assert_array_equal(bcast, xs[-1])


def test_torch_and_jax_in_and_out():
    def body(comm):
        t = torch.arange(4, dtype=torch.bfloat16) + comm.rank
        j = jnp.arange(4, dtype=jnp.float32) * (comm.rank + 1)
        return ops.all_gather(comm, t), ops.reduce_scatter(comm, j)

    for gathered, scattered in ops.spawn(body, 2):
        assert isinstance(gathered, torch.Tensor) and gathered.dtype == torch.bfloat16
        assert gathered.tolist() == [0, 1, 2, 3, 1, 2, 3, 4]
        assert scattered.dtype == jnp.float32 and scattered.shape == (2,)
    assert [s.tolist() for _, s in ops.spawn(body, 2)] == [[0.0, 3.0], [6.0, 9.0]]


def test_async_overlaps_and_keeps_order():
    world, n = 3, 200_000

    def body(comm):
        x = np.full(n, comm.rank, np.float32)
        out_a, out_b = comm.allocate(n * world, np.float32), comm.allocate(n, np.float32)
        work_a = comm.all_gather_async(out_a, x)
        work_b = comm.reduce_scatter_async(out_b, np.ones(n * world, np.float32))
        busy = float(np.sum(np.arange(100_000)))  # compute while the collectives run
        summed = comm.all_reduce_(np.ones(3, np.float32))  # blocking: waits for a and b first
        assert work_a.is_completed() and work_b.is_completed()
        return work_a.wait(), work_b.wait(), summed, busy

    for gathered, scattered, summed, _ in ops.spawn(body, world):
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(world, dtype=np.float32), n))
        np.testing.assert_array_equal(scattered, np.full(n, world, np.float32))
        np.testing.assert_array_equal(summed, np.full(3, world, np.float32))


def test_a_rank_raising_stops_every_rank_promptly():
    def body(comm):
        if comm.rank == 2:
            raise KeyError("boom on purpose")
        for _ in range(3):
            ops.all_gather(comm, np.ones(4))
        return "unreachable"

    t0 = time.perf_counter()
    with pytest.raises(KeyError, match="boom on purpose") as info:
        ops.spawn(body, 4, timeout=60)
    assert time.perf_counter() - t0 < 5
    if hasattr(info.value, "__notes__"):
        assert "rank 2 of 4" in info.value.__notes__[0]


def test_a_rank_that_never_arrives_times_out_with_a_clear_error():
    def body(comm):
        if comm.rank == 1:
            time.sleep(1.5)  # busy elsewhere: still running, never calls the collective
            return "late"
        return ops.all_reduce(comm, np.ones(2))

    t0 = time.perf_counter()
    with pytest.raises(ops.CollectiveTimeout, match=r"all_reduce on rank 0 did not complete "
                                                    r"within 0.5 s: rank\(s\) \[1\] never"
                       ) as info:
        ops.spawn(body, 2, timeout=0.5)
    assert time.perf_counter() - t0 < 5
    assert "NPROC" not in str(info.value)  # waited on the rank's own thread


def test_a_timeout_on_a_thread_python_did_not_start_names_xla_s_threads():
    """A collective waited on from a native thread (as XLA's threads run a JAX
    program's callbacks) times out with the way out of a starved XLA pool;
    one on the rank's own thread does not mention it (the test above)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    caught: list[BaseException] = []

    @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    def native(_):  # runs on a pthread that Python did not create
        try:
            ops.all_reduce(native.comm, np.ones(2))
        except BaseException as exc:  # handed to the rank below
            caught.append(exc)
        return None

    def body(comm):
        if comm.rank == 1:
            time.sleep(1.5)
            return "late"
        native.comm = comm
        tid = ctypes.c_ulong()
        assert libc.pthread_create(ctypes.byref(tid), None, native, None) == 0
        assert libc.pthread_join(tid, None) == 0
        raise caught[0]

    with pytest.raises(ops.CollectiveTimeout, match=r"rank\(s\) \[1\] never reached it; this "
                                                    r"rank waits on a thread that Python did not "
                                                    r"start, .*: set NPROC to at least"):
        ops.spawn(body, 2, timeout=0.5)


@pytest.mark.parametrize("order", ["returns first", "waits first"])
def test_a_rank_that_returns_early_fails_its_peers_at_once_naming_it(order):
    def body(comm):
        if comm.rank == 1:
            if order == "waits first":
                time.sleep(0.2)  # rank 0 is already waiting in the all_reduce
            return "skipped the collective"
        if order == "returns first":
            time.sleep(0.2)  # rank 1 has returned before rank 0 gets here
        return ops.all_reduce(comm, np.ones(2))

    t0 = time.perf_counter()
    with pytest.raises(ops.PeerFailed, match=r"all_reduce on rank 0 cannot complete: .*rank"
                                             r".*1.* returned"):
        ops.spawn(body, 2, timeout=60)
    assert time.perf_counter() - t0 < 5


def test_mismatched_sizes_or_dtypes_across_ranks_are_reported():
    def sizes(comm):
        return ops.all_gather(comm, np.ones(3 + comm.rank, np.float32))

    with pytest.raises(ops.CollectiveError, match=r"match.*rank 0: all_gather\(3, 'float32'"):
        ops.spawn(sizes, 2)

    def dtypes(comm):
        return ops.all_reduce(comm, np.ones(3, np.float32 if comm.rank else np.float64))

    with pytest.raises(ops.CollectiveError, match=r"float64.*float32"):
        ops.spawn(dtypes, 2)


def test_bad_arguments_are_caught_before_communicating():
    def body(comm):
        with pytest.raises(ValueError, match=r"first dimension \(5\) must divide by world_size=2"):
            ops.reduce_scatter(comm, np.ones(5))
        with pytest.raises(ValueError, match="op must be one of"):
            ops.reduce_scatter(comm, np.ones(4), op="max")
        with pytest.raises(ValueError, match="C-contiguous"):
            ops.all_gather(comm, np.ones(8)[::2])
        with pytest.raises(ValueError, match="src must be in"):
            ops.broadcast(comm, np.ones(2), src=2)
        return True

    assert ops.spawn(body, 2) == [True, True]


def test_ctrl_c_in_spawn_stops_every_rank_and_leaves_no_threads():
    import _thread
    import signal
    import threading

    def forever(comm):
        x = np.ones(1000)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 30:  # a training loop: compute, then a collective
            time.sleep(0.01)
            ops.all_reduce(comm, x)

    before = set(threading.enumerate())
    # Ctrl-C's handler, whatever this process inherited (a background job ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, _thread.interrupt_main).start()
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            ops.spawn(forever, 3, timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - t0 < 5
    assert not [t for t in set(threading.enumerate()) - before
                if t.is_alive() and t.name.startswith("zeroshard-rank")]


def test_a_collective_is_complete_once_the_last_rank_has_issued_it():
    """See [Note: thread collectives]: the last rank to arrive runs the collective
    for every rank, so a handle is complete before anyone waits on it, and no
    thread is started for it."""
    world = 3
    arrived = threading.Barrier(world)

    def body(comm):
        x = np.full(4, comm.rank, np.float32)
        out = comm.allocate(4 * world, np.float32)
        work = comm.all_gather_async(out, x)
        summed = comm.all_reduce_async(np.full(2, comm.rank, np.float32))
        arrived.wait()  # every rank has issued them (outside the communicator)
        done = work.is_completed() and summed.is_completed()
        assert summed.wait().tolist() == [sum(range(world))] * 2
        threads = [t.name for t in threading.enumerate() if t.name.startswith(
            "zeroshard-threads")]  # (the name an executor thread of this backend would have)
        return done, work.wait().tolist(), threads

    for done, gathered, threads in ops.spawn(body, world):
        assert done
        assert gathered == np.repeat(np.arange(world, dtype=np.float32), 4).tolist()
        assert threads == []


@pytest.mark.multiprocess
def test_thread_ranks_share_the_kernels_openmp_threads():
    """Each of W thread ranks runs its host kernels on 1/W of the OpenMP default
    (at least one thread), and the rest of the process keeps the default (see
    [Note: kernel threads of thread ranks]): read in a process whose default is 4."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, numpy as np, ops\n"
            "from ops.kernels._build import load_cpu\n"
            "from ops.kernels._cpu import host_threads\n"
            "def rank(comm):\n"
            "    ops.cast(np.ones(100_000, np.float32), np.float16)\n"  # a host kernel's launch
            "    return load_cpu('copy').omp_get_max_threads()\n"
            "print(json.dumps([ops.spawn(rank, w) for w in (1, 2, 3, 8)] + [host_threads()]))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "4"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == [[4], [2, 2], [1, 1, 1], [1] * 8, 4]


@pytest.mark.parametrize("world", [2, 3])
def test_a_large_collective_runs_in_parts_on_every_rank_waiting_for_it(world, monkeypatch):
    """See [Note: thread collectives]: past SHARE_BYTES, the ranks already
    waiting run parts beside the last to arrive. Each part here waits until
    every rank is inside one, so the collective completes only if each rank
    ran a part (and fails at the barrier's timeout otherwise); the results
    are numpy's, for section sizes no world divides evenly."""
    from ops.comm import _thread_runs, _threads

    n = _threads.SHARE_BYTES // 4 + 7  # float32 elements a rank: over the threshold
    inside = threading.Barrier(world, timeout=30)
    ran: dict[str, set] = {}

    def together(name, fn):
        def part(*args):
            ran.setdefault(name, set()).add(threading.get_ident())
            inside.wait()
            return fn(*args)
        monkeypatch.setattr(_thread_runs, name, part)

    for name in ("gather_into", "sum_into", "reduce_range"):
        together(name, getattr(_thread_runs, name))
    xs = _inputs(world, n * world, np.float32)

    def body(comm):
        x = xs[comm.rank]
        if comm.rank == world - 1:
            time.sleep(0.05)  # the others are waiting by now (or they help once they are)
        gathered = comm.all_gather_async(comm.allocate(n * world * world, np.float32), x).wait()
        if comm.rank == world - 1:
            time.sleep(0.05)
        mine = comm.reduce_scatter_async(comm.allocate(n, np.float32), x, "mean").wait()
        summed = comm.all_reduce_async(x.copy(), "sum").wait()
        return gathered, mine, summed

    total = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for r, (gathered, mine, summed) in enumerate(ops.spawn(body, world)):
        np.testing.assert_array_equal(gathered, np.concatenate(xs))
        np.testing.assert_allclose(mine, total[r * n:(r + 1) * n] / world, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(summed, total, rtol=1e-6, atol=1e-6 * world)
    assert {k: len(v) for k, v in ran.items()} == dict.fromkeys(ran, world) and len(ran) == 3


def test_a_part_that_fails_fails_every_rank_s_collective(monkeypatch):
    """Each rank runs a part (they meet inside), one part raises: every rank's
    handle fails with the cause, and so do the group's later collectives."""
    from ops.comm import _thread_runs, _threads

    n = _threads.SHARE_BYTES // 4
    assert _threads._shared(("all_gather", n, np.dtype(np.float32)), 2)
    inside = threading.Barrier(2, timeout=30)
    gather = _thread_runs.gather_into

    def part(out, xs):
        inside.wait()
        if out[0] == 1:  # rank 1's output, whichever rank runs it
            raise MemoryError("out of device memory")
        gather(out, xs)

    monkeypatch.setattr(_thread_runs, "gather_into", part)

    def body(comm):
        out = comm.allocate(2 * n, np.float32)
        out[0] = comm.rank
        errors = []
        for _ in range(2):
            try:
                comm.all_gather_async(out, np.ones(n, np.float32)).wait()
                errors.append("completed")
            except ops.CollectiveError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        return errors

    for first, later in ops.spawn(body, 2):
        assert first.startswith("CollectiveError: all_gather failed: MemoryError: out of device "
                                "memory"), first
        assert later.startswith("PeerFailed"), later


def test_a_large_collective_in_place_runs_in_rank_order(monkeypatch):
    """An output that overlaps an input (a reduce-scatter into the front of each
    rank's own input, an all-gather into a buffer holding its own section) is
    run by the last rank in rank order, not in parts: numpy's answer. Rank 0's
    section waits (up to 0.5 s) for rank 1's to be written, so parts run at once
    would read rank 1's output where its input was."""
    from ops.comm import _thread_runs, _threads

    world, n = 2, _threads.SHARE_BYTES // 4 + 3
    xs = _inputs(world, n * world, np.float32)
    written = threading.Event()
    sum_into = _thread_runs.sum_into

    def section(out, inputs, lo, hi, op):
        if lo == 0:
            written.wait(0.5)
        sum_into(out, inputs, lo, hi, op)
        if lo:
            written.set()

    monkeypatch.setattr(_thread_runs, "sum_into", section)

    def body(comm):
        x = xs[comm.rank].copy()
        comm.reduce_scatter_into(x[:n], x, "sum")  # rank 1's output is rank 0's section
        buf = np.zeros(n * world, np.float32)
        buf[comm.rank * n:(comm.rank + 1) * n] = xs[comm.rank][:n]
        comm.all_gather_into(buf, buf[comm.rank * n:(comm.rank + 1) * n])
        return x[:n], buf

    total = np.sum(xs, axis=0)
    for r, (mine, gathered) in enumerate(ops.spawn(body, world)):
        np.testing.assert_allclose(mine, total[r * n:(r + 1) * n], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(gathered, np.concatenate([x[:n] for x in xs]))
