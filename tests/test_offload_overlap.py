"""``Offload("host", overlap=True)``: the host tier's update during the backward
(see [Note: overlapped offload]) follows the unoffloaded trajectory bit for bit,
drops its work when a gradient is not finite or a thread fails, and starts
before the backward ends."""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
import pytest

import ops
import shard
from ops.device._device import HOST
from ops.testing import STANDIN
from shard.offload._offloader import Offloader, check_offload_device
from shard.step.reduction._reduce import GradReducer
from tests import zero_models as M
from tests.test_offload import assert_same, gpu_refuses, trajectory

OVERLAP = shard.Offload("host", overlap=True)
BF16 = dict(precision=shard.Precision(param_dtype="bf16", reduce_dtype="float32"),
            loss_scale=shard.LossScale(initial=2.0**8))
ZERO = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_overlapped_offload_is_bit_identical(stage, world):
    want = ops.spawn(lambda c: trajectory(c, stage, **BF16), world)
    got = ops.spawn(lambda c: trajectory(c, stage, offload=OVERLAP, **BF16), world)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("world", [1, 3])
def test_overlapped_offload_on_the_device_stand_in(device, stage, world):
    if gpu_refuses(device, OVERLAP, lambda: ops.spawn(
            lambda c: trajectory(c, stage, offload=OVERLAP, device=device, **BF16), world)):
        return
    want = ops.spawn(lambda c: trajectory(c, stage, device=device, **BF16), world)
    got = ops.spawn(lambda c: trajectory(c, stage, offload=OVERLAP, device=device, **BF16),
                    world)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    state = got[0][2]
    assert all(isinstance(b, np.ndarray) for b in state.master + state.exp_avg)


def test_on_a_gpu_what_raced_there_is_refused_before_anything_is_built():
    """[Note: offload on a GPU]: the Offloader, which init builds first, refuses
    overlap=True and params='host' on a CUDA device, naming the option and the
    tier that runs there; the stand-in and the host run them."""
    gpu = dataclasses.replace(STANDIN, name="cupy")

    def build(off, device):
        return Offloader(off, name="zero3", stage=3, layout=None, device=device,
                         master_dtype=np.float32, compute_dtype=np.float32, rank=0,
                         optimizer=None, clip_norm=None)

    for off, what in ((OVERLAP, r"Offload\(overlap=True\)"),
                      (shard.Offload("disk", path="x", params="host"),
                       r"Offload\(params='host'\)")):
        with pytest.raises(NotImplementedError, match=what + " on a CUDA device is refused"):
            build(off, gpu)
        check_offload_device("zero3", off, STANDIN)
        check_offload_device("zero3", off, HOST)
    with pytest.raises(NotImplementedError, match=r"Offload\('disk'\) without it"):
        build(shard.Offload("disk", path="x", params="host"), gpu)
    check_offload_device("zero3", shard.Offload("host"), gpu)  # the plain tiers run there


def test_zero3_params_on_the_host_overlapped(device):
    off = shard.Offload("host", params="host", overlap=True)
    if gpu_refuses(device, off, lambda: ops.spawn(
            lambda c: trajectory(c, 3, offload=off, device=device, **BF16), 3)):
        return
    want = ops.spawn(lambda c: trajectory(c, 3, device=device, **BF16), 3)
    got = ops.spawn(lambda c: trajectory(c, 3, offload=off, device=device, **BF16), 3)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


def _run(comm, stage, batches, offload=None, loss_fn=M.loss, **kw):
    step = ZERO[stage](loss_fn, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm,
                       offload=offload, options=shard.ZeroOptions(**kw))
    state = step.init(M.init_params())
    out = []
    for b in batches:
        state, m = step(state, b if isinstance(b, shard.MicroBatches) else
                        shard.split_batch(b, rank=comm.rank, world_size=comm.world_size))
        out.append((bool(m["skipped"]), float(m["loss"])))
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(shard.gather(state, comm))], out


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_overlapped(stage):
    """With micro-batches the last one's reduction is added to the shard on the
    copier thread."""
    def micro(comm):
        return [shard.MicroBatches([shard.split_batch(b, rank=comm.rank, world_size=2)
                                    for b in M.batches(3, seed=s)]) for s in range(3)]

    want = ops.spawn(lambda c: _run(c, stage, micro(c)), 2)
    got = ops.spawn(lambda c: _run(c, stage, micro(c), offload=OVERLAP), 2)
    for (gp, gm), (wp, wm) in zip(got, want, strict=True):
        for a, b in zip(gp, wp, strict=True):
            np.testing.assert_array_equal(a, b)
        assert gm == wm


@pytest.mark.parametrize("stage", [1, 3])
def test_a_non_finite_step_drops_the_overlapped_update(stage):
    """A nan in one rank's data at step 2: every rank's early units were already
    updated into the spare set, and the step must drop them."""
    batches = M.batches(4)
    batches[2]["x"][-1, 0] = np.nan  # the last rank's share only
    want = ops.spawn(lambda c: _run(c, stage, batches), 3)
    got = ops.spawn(lambda c: _run(c, stage, batches, offload=OVERLAP), 3)
    for (gp, gm), (wp, wm) in zip(got, want, strict=True):
        assert [s for s, _ in gm] == [False, False, True, False]
        for a, b in zip(gp, wp, strict=True):
            np.testing.assert_array_equal(a, b)
        assert [x for _, x in gm if np.isfinite(x)] == [x for _, x in wm if np.isfinite(x)]


def test_units_update_before_the_backward_ends(monkeypatch):
    """A Layered loss at stage 3: when the reducer's finish() is called (the
    backward is over), every unit without replicated leaves (which finish()
    all-reduces) has been handed to the copier and updater threads."""
    seen = []
    finish = GradReducer.finish

    def spy(self):
        if self.on_final is not None:
            seen.append((len(self.on_final.__self__.handed),
                         sum(not u.replicated_size for u in self.layout.units)))
        return finish(self)

    monkeypatch.setattr(GradReducer, "finish", spy)
    ops.spawn(lambda c: _run(c, 3, M.batches(2), offload=OVERLAP, loss_fn=M.LAYERED), 2)
    assert len(seen) == 4 and all(n == want > 0 for n, want in seen), seen


def test_a_failing_update_leaves_the_state_unchanged():
    def run(comm):
        optimizer = ops.adamw(M.LR)
        calls, armed = [], []

        def failing(*a, **k):  # the second unit's update of the second step fails
            if armed:
                calls.append(1)
                if len(calls) == 2:
                    raise MemoryError("planted")
            return optimizer.apply(*a, **k)

        step = shard.zero3(M.loss, optimizer=optimizer._replace(apply=failing), comm=comm,
                           offload=OVERLAP)
        state = step.init(M.init_params())
        b = shard.split_batch(M.batches(1)[0], rank=comm.rank, world_size=1)
        state, _ = step(state, b)
        before = [np.array(x) for x in state.master + state.exp_avg + state.exp_avg_sq]
        armed.append(True)
        with pytest.raises(RuntimeError, match="overlapped offload update failed") as e:
            step(state, b)
        assert isinstance(e.value.__cause__, MemoryError)
        after = [np.array(x) for x in state.master + state.exp_avg + state.exp_avg_sq]
        for a, b_ in zip(after, before, strict=True):
            np.testing.assert_array_equal(a, b_)
        assert [t.name for t in threading.enumerate()
                if t.name.startswith("zeroshard-offload")] == []

    ops.spawn(run, 1)


def test_overlap_is_refused_with_clipping_and_the_disk_tier(tmp_path):
    comm = ops.spawn(lambda c: c, 1)[0]
    with pytest.raises(ValueError, match="clip_norm"):
        shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm, offload=OVERLAP, clip_norm=1.0)
    with pytest.raises(ValueError, match="overlap=True is for optimizer='host'"):
        shard.Offload("disk", path=tmp_path, overlap=True)
    with pytest.raises(TypeError, match="overlap must be True or False"):
        shard.Offload("host", overlap="yes")


@pytest.mark.parametrize("params", [None, "host"])
def test_estimate_memory_counts_the_spare_set(device, params):
    off = shard.Offload("host", params=params, overlap=True)

    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm, offload=off,
                           options=shard.ZeroOptions(**BF16))
        from ops.testing import to_device
        state = step.init(to_device(M.init_params(), device))
        b = shard.split_batch(M.batches(1)[0], rank=comm.rank, world_size=2)
        state, _ = step(state, b)
        return state.tiers(), step._offloader.spare.nbytes()

    if gpu_refuses(device, off, lambda: ops.spawn(run, 2)):
        return
    tiers, spare = ops.spawn(run, 2)[0]
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    M.init_params())
    est = shard.estimate_memory(shapes, stage=3, world_size=2, policy=BF16["precision"],
                                offload=off)
    assert est["on_host"] == tiers["host"] + spare
    assert spare == (est["params"] + est["optimizer"] +
                     (est["compute_params"] if params == "host" else 0))


@pytest.mark.parametrize("stage", [2, 3])
def test_host_state_keeps_no_staging_buffers_it_does_not_need(tmp_path, stage):
    """CPU state crosses no bus: no gradient staging; at stage 3 the new params go
    straight into the compute shards (the 2.2B-param disk-tier run's memory)."""
    def run(comm):
        step = ZERO[stage](M.loss, optimizer=ops.adamw(M.LR), comm=comm,
                           offload=shard.Offload("disk", path=tmp_path, chunk_mb=1),
                           options=shard.ZeroOptions(**BF16))
        state = step.init(M.init_params())
        step(state, shard.split_batch(M.batches(1)[0], rank=comm.rank, world_size=1))
        return step._offloader.host_staging

    staging = ops.spawn(run, 1)[0]
    assert staging.grads == []
    assert (staging.out == []) == (stage == 3)
