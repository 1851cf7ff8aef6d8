"""shard.Offload: masters and moments in host memory or in the disk tier follow the
unoffloaded trajectory bit for bit ([Note: offload])."""

from __future__ import annotations

import os
import tracemalloc

import jax
import numpy as np
import pytest

import ops
import shard
from ops.device._device import HOST, device_of_or_none
from ops.testing import to_device
from tests import zero_models as M

ZERO = {1: shard.zero1, 2: shard.zero2, 3: shard.zero3}
BF16 = dict(precision=shard.Precision(param_dtype="bf16", reduce_dtype="float32"),
            clip_norm=0.5, loss_scale=shard.LossScale(initial=2.0**8))


def policy(tier, tmp_path):
    return shard.Offload(tier, path=tmp_path if tier == "disk" else None,
                         **({"chunk_mb": 1} if tier == "disk" else {}))


def trajectory(comm, stage, *, offload=None, device=HOST, steps=4, **kw):
    step = ZERO[stage](M.loss, optimizer=ops.adamw(M.LR, weight_decay=M.WD), comm=comm,
                       offload=offload, options=shard.ZeroOptions(**kw))
    state = step.init(to_device(M.init_params(), device))
    losses = []
    for b in M.batches(steps):
        state, m = step(state, shard.split_batch(b, rank=comm.rank, world_size=comm.world_size))
        losses.append(m["loss"])
    whole = shard.gather(state, comm)
    leaves = [np.asarray(x) if device_of_or_none(x) in (None, HOST) else
              device_of_or_none(x).to_host(x) for x in jax.tree_util.tree_leaves(whole)]
    return leaves, losses, state


def gpu_refuses(device, offload, run) -> bool:
    """On a GPU, what [Note: offload on a GPU] refuses: ``run()`` raises, by
    name; True when so (the test has nothing else to check there)."""
    if device.name != "cupy" or not (offload.overlap or offload.params == "host"):
        return False
    with pytest.raises(NotImplementedError, match="on a CUDA device is refused"):
        run()
    return True


def assert_same(got, want):
    for a, b in zip(got[0], want[0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert got[1] == want[1]


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_offloaded_trajectory_is_bit_identical(tmp_path, tier, stage, world):
    want = ops.spawn(lambda c: trajectory(c, stage), world)
    got = ops.spawn(lambda c: trajectory(c, stage, offload=policy(tier, tmp_path)), world)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    state = got[0][2]
    assert state.meta.offload == tier
    kinds = {type(b).__name__ for b in state.master + state.exp_avg}
    assert kinds == ({"memmap"} if tier == "disk" else {"ndarray"})


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("stage", [2, 3])
def test_mixed_precision_clipping_and_loss_scaling_offloaded(tmp_path, tier, stage):
    want = ops.spawn(lambda c: trajectory(c, stage, steps=5, **BF16), 2)
    got = ops.spawn(lambda c: trajectory(c, stage, offload=policy(tier, tmp_path), steps=5,
                                         **BF16), 2)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_on_the_device_stand_in(device, tmp_path, stage, world):
    """Each tier against the unoffloaded step on the same device: on a GPU, JAX
    computes the gradients there, and offloading must change no bit of what
    follows."""
    want = ops.spawn(lambda c: trajectory(c, stage, device=device), world)
    for tier in ("host", "disk"):
        got = ops.spawn(lambda c, t=tier: trajectory(c, stage, offload=policy(t, tmp_path / t),
                                                     device=device), world)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
        state = got[0][2]
        assert all(device_of_or_none(b) is device for b in state.compute)  # compute stays
        assert all(isinstance(b, np.ndarray) for b in state.master)  # masters on the host


# a frozen weight in each unit, beside trainable leaves (LoRA's shape)
TRAINABLE = [{"w": False, "b": True}, {"w": True, "b": True, "gain": False}]
FROZEN_TIERS = {"host": lambda _: shard.Offload("host"),
                "overlap": lambda _: shard.Offload("host", overlap=True),
                "disk": lambda path: policy("disk", path)}


@pytest.mark.parametrize(("tier", "stage", "world", "kw"), [
    ("host", 1, 2, {}), ("host", 3, 3, {}), ("overlap", 2, 2, {}), ("overlap", 3, 3, {}),
    ("disk", 1, 3, {}), ("disk", 3, 2, {}), ("host", 3, 2, BF16), ("disk", 2, 2, BF16)])
def test_frozen_params_offloaded_follow_the_unoffloaded_trajectory(tmp_path, tier, stage,
                                                                   world, kw):
    """Frozen leaves with every offload tier: the trainable ranges are updated
    from the packed gradient shards, the frozen ones keep their values bit for
    bit, and the trajectory is the unoffloaded one's."""
    want = ops.spawn(lambda c: trajectory(c, stage, trainable=TRAINABLE, **kw), world)
    got = ops.spawn(lambda c: trajectory(c, stage, offload=FROZEN_TIERS[tier](tmp_path),
                                         trainable=TRAINABLE, **kw), world)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    start = jax.tree_util.tree_leaves(M.init_params())
    flags = jax.tree_util.tree_leaves(TRAINABLE)
    for leaf, before, trains in zip(got[0][0], start, flags, strict=True):
        assert np.array_equal(leaf, before) != trains


@pytest.mark.parametrize("tier", ["host", "overlap"])
def test_frozen_params_offloaded_on_the_device_stand_in(device, tmp_path, tier):
    want = ops.spawn(lambda c: trajectory(c, 3, device=device, trainable=TRAINABLE), 2)
    got = ops.spawn(lambda c: trajectory(c, 3, offload=FROZEN_TIERS[tier](tmp_path),
                                         device=device, trainable=TRAINABLE), 2)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)


def test_disk_tier_checkpoints_are_hard_links_and_steps_never_rewrite_them(tmp_path):
    tier = shard.Offload("disk", path=tmp_path / "tier", chunk_mb=1)

    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm, offload=tier)
        state = step.init(M.init_params())
        batches = M.batches(6)
        for b in batches[:3]:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=2))
        shard.save(state, tmp_path / "ck", comm=comm)
        tier_file = next(b.filename for b in state.master if hasattr(b, "filename"))
        linked = os.stat(tier_file).st_ino == os.stat(
            tmp_path / "ck" / f"rank-{comm.rank:05d}.safetensors").st_ino
        for b in batches[3:]:  # new generations; the checkpoint's files untouched
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=2))
        return linked, shard.gather(state, comm)

    results = ops.spawn(run, 2)
    assert all(linked for linked, _ in results)

    def resume(comm, offload):  # at another world size, offloaded or not
        step = shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm, offload=offload)
        state, _ = shard.load(tmp_path / "ck", step, comm=comm, like=M.init_params())
        for b in M.batches(6)[3:]:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=3))
        return shard.gather(state, comm)

    want = jax.tree_util.tree_leaves(results[0][1])
    for offload in (None, shard.Offload("disk", path=tmp_path / "tier2"), shard.Offload()):
        got = jax.tree_util.tree_leaves(ops.spawn(lambda c, o=offload: resume(c, o), 3)[0])
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_every_disk_tier_names_its_files_apart(tmp_path):
    """A tier made after another was collected must not take the other's file
    names: a step's second tier (its load, then its first step) once truncated
    the first's generation file, whose collected maps then removed it."""
    from shard.offload._offload import DiskTier

    names = set()
    for _ in range(20):
        tier = DiskTier(shard.Offload("disk", path=tmp_path), 0, [4], np.float32)
        names.add(tier.new_file().name)
        del tier
    assert len(names) == 20


def test_a_failed_disk_update_leaves_the_previous_generation(tmp_path, monkeypatch):
    tier = shard.Offload("disk", path=tmp_path, chunk_mb=1)
    comm = ops.spawn(lambda c: c, 1)[0]
    step = shard.zero1(M.loss, optimizer=ops.adamw(M.LR), comm=comm, offload=tier)
    state = step.init(M.init_params())
    state, _ = step(state, M.batches(1)[0])
    before = {k: [np.array(b) for b in getattr(state, k)] for k in ("master", "exp_avg")}
    src = next(b.filename for b in state.master if hasattr(b, "filename"))
    real = os.pwrite

    def full_disk(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OSError, match="No space left"):
        step(state, M.batches(2)[1])
    monkeypatch.setattr(os, "pwrite", real)
    files = sorted(p.name for p in (tmp_path / "rank-00000").iterdir())
    assert files == [os.path.basename(src)]  # the partial generation is gone
    for k, bufs in before.items():
        for a, b in zip(getattr(state, k), bufs, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_failing_kernel_mid_stream_stops_the_threads_and_leaves_no_partial_file(tmp_path):
    import threading

    from shard.offload._offload import DiskTier

    tier = DiskTier(shard.Offload("disk", path=tmp_path, chunk_mb=1), 0, [600_000, 5],
                    np.float32)
    src = tier.new_file()
    calls = []

    def kernel(u, lo, hi, p, m, v):
        calls.append(u)
        if len(calls) == 2:
            raise FloatingPointError("kernel failed")

    with pytest.raises(FloatingPointError):
        tier.update(src, kernel)
    assert sorted(p.name for p in tier.dir.iterdir()) == [src.name]
    assert not [t for t in threading.enumerate() if t.name.startswith("zeroshard-disk")]


def test_disk_tier_update_holds_a_few_chunks_not_the_state(tmp_path):
    rng = np.random.default_rng(0)
    params = [{"w": rng.standard_normal((1024, 1024)).astype(np.float32) * 0.02}
              for _ in range(4)]  # 4M params: 48 MiB of masters and moments

    def loss(p, b):
        h = b
        for layer in p:
            h = jax.numpy.tanh(h @ layer["w"])
        return jax.numpy.mean(h ** 2)

    comm = ops.spawn(lambda c: c, 1)[0]
    step = shard.zero3(loss, optimizer=ops.adamw(1e-3), comm=comm,
                       precision=shard.Precision(param_dtype="bf16"),
                       offload=shard.Offload("disk", path=tmp_path, chunk_mb=1))
    state = step.init(params)
    del params
    batch = np.ones((2, 1024), np.float32)
    state, _ = step(state, batch)  # warm (jit)
    tracemalloc.start()
    state, m = step(state, batch)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    state_bytes = 12 * 4 * 1024 * 1024
    # bf16 gradients (8 MiB), one gathered unit and its copy, three 1 MiB chunk sets
    assert peak < state_bytes / 2, peak / 2**20
    assert np.isfinite(m["loss"])


def test_estimate_memory_reports_each_tier_as_the_state_holds_it(tmp_path):
    """With frozen leaves too: the tiers keep their moments (zeros), the
    gradients the trainable leaves' alone."""
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    M.init_params())
    for tier, stage, trainable in [(t, s, m) for t in ("host", "disk") for s in (1, 2, 3)
                                   for m in (None, TRAINABLE)]:
        off = policy(tier, tmp_path)
        est = shard.estimate_memory(shapes, stage=stage, world_size=3, offload=off,
                                    trainable=trainable)

        def held(comm, stage=stage, off=off, trainable=trainable):
            return ZERO[stage](M.loss, optimizer=ops.adamw(M.LR), comm=comm, offload=off,
                               trainable=trainable).init(M.init_params()).tiers()

        got = ops.spawn(held, 3)[0]
        assert got[tier] == est[f"on_{tier}"] == est["params"] + est["optimizer"]
        assert got["device"] == est["compute_params"] > 0, (tier, stage)
        assert est["on_device"] == est["compute_params"] + est["grads"]


def test_bad_offload_arguments_are_refused():
    comm = ops.spawn(lambda c: c, 1)[0]
    with pytest.raises(ValueError, match="stages 1-3"):
        shard.zero0(M.loss, optimizer=ops.adamw(M.LR), comm=comm, offload=shard.Offload())
    with pytest.raises(ValueError, match="needs path="):
        shard.Offload("disk")
    with pytest.raises(ValueError, match="'host' or 'disk'"):
        shard.Offload("nvme")
    with pytest.raises(TypeError, match=r"shard\.Offload"):
        shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm, offload="cpu")


@pytest.mark.multiprocess
def test_offload_benchmark_prints_its_table(tmp_path, run_benchmark):
    out = run_benchmark("offload", "--params", "2e6", "--width", 512, "--steps", 1,
                        "--chunk-mb", 1, "--probe-mb", 16, "--path", tmp_path)
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| mode | step s | optimizer s | disk floor s")
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["ram", "disk"]
    assert "sequential write" in out


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("world", [1, 3])
def test_bf16_steps_on_the_device_give_the_same_bits_run_to_run_offloaded_or_not(
        device, tmp_path, stage, world):
    """In bfloat16, where the overlapped and host-params offload raced on a GPU
    (see [Note: offload on a GPU]): the unoffloaded step gives the same bits run
    to run, and so does each plain tier. On a GPU this tells whether the race
    lies in the bfloat16 step itself."""
    want = ops.spawn(lambda c: trajectory(c, stage, device=device, **BF16), world)
    again = ops.spawn(lambda c: trajectory(c, stage, device=device, **BF16), world)
    for a, w in zip(again, want, strict=True):
        assert_same(a, w)
    for tier in ("host", "disk"):
        got = ops.spawn(lambda c, t=tier: trajectory(
            c, stage, offload=policy(t, tmp_path / t), device=device, **BF16), world)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("world", [1, 3])
def test_zero3_compute_params_on_the_host_too(device, tmp_path, tier, world):
    off = shard.Offload(tier, path=tmp_path if tier == "disk" else None, params="host")
    if gpu_refuses(device, off, lambda: ops.spawn(
            lambda c: trajectory(c, 3, offload=off, device=device, **BF16), world)):
        return
    want = ops.spawn(lambda c: trajectory(c, 3, device=device, **BF16), world)
    got = ops.spawn(lambda c: trajectory(c, 3, offload=off, device=device, **BF16), world)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    state = got[0][2]
    assert all(isinstance(b, np.ndarray) for b in state.compute)  # bf16 shards on the host
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    M.init_params())
    est = shard.estimate_memory(shapes, stage=3, world_size=world, policy=BF16["precision"],
                                offload=off)
    tiers = state.tiers()
    assert tiers == {"device": 0, "host": est["on_host"], "disk": est["on_disk"]}
    assert est["on_device"] == est["grads"]  # what a step adds on the device


def test_params_on_the_host_is_for_stage_3():
    comm = ops.spawn(lambda c: c, 1)[0]
    with pytest.raises(ValueError, match="params='host'\\) is for stage 3"):
        shard.zero2(M.loss, optimizer=ops.adamw(M.LR), comm=comm,
                    offload=shard.Offload(params="host"))
    with pytest.raises(ValueError, match="params must be None or 'host'"):
        shard.Offload(params="disk")
