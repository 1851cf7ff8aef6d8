"""The run-copy kernels (``ops/kernels/copy.cu``) against numpy, on the CPU build
and as the CUDA kernel emulated on the stand-in, and the layout's run tables
against the per-leaf copies they replace."""

from __future__ import annotations

import numpy as np
import pytest

from ops import dequantize_blocks, quantize_blocks
from ops.device._arrays import BF16
from ops.device._device import HOST, cupy_device
from ops.device._runs import Runs, contiguous_on, copy_runs, dequantize_runs
from ops.testing import DEVICE_OPS, STANDIN
from shard.core._layout import make_layout
from shard.core._specs import Replicate, Shard
from tests.conftest import gpu_present

# The CPU build, the CUDA kernel emulated on the stand-in, and the CUDA kernel on
# a GPU where there is one.
DEVICES = {"host": HOST, "standin": STANDIN} | ({"cupy": cupy_device()} if gpu_present() else {})


def random_runs(rng, n_src: int, n_dst: int, count: int):
    lengths = rng.integers(0, 40, count)
    src = [int(rng.integers(0, n_src - n)) for n in lengths]
    dst = np.cumsum([0, *lengths])[:-1] + rng.integers(0, 3, count).cumsum()
    return src, dst.tolist(), lengths.tolist()


@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16, np.float16])
def test_runs_copy_what_numpy_copies(device, dtype, rng):
    dev = DEVICES[device]
    src_host = rng.standard_normal(500).astype(dtype)
    src, dst, lengths = random_runs(rng, 500, 2000, 30)
    want = np.full(2000, 7, dtype)
    for s, d, n in zip(src, dst, lengths, strict=True):
        want[d:d + n] = src_host[s:s + n]
    out = dev.asarray(np.full(2000, 7, dtype))
    runs = Runs(src, dst, lengths)
    copy_runs(out, runs, runs.table(dev), device=dev, src=dev.asarray(src_host))
    got = dev.to_host(out) if not dev.host else out
    assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()


@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
def test_runs_from_separate_tensors_widen_to_float32_and_absent_ones_write_zeros(device, dtype,
                                                                                  rng):
    dev = DEVICES[device]
    tensors = [dev.asarray(rng.standard_normal(n).astype(dtype)) for n in (5, 0, 17, 9)]
    present = [True, False, True, True]
    # each tensor whole, then a run of zeros; byte offsets into the tensors
    src, dst, lengths, which, at = [], [], [], [], 0
    for j, t in enumerate(tensors):
        src += [0, 0]
        dst += [at, at + t.size]
        lengths += [t.size, 3]
        which += [j, -1]
        at += t.size + 3
    runs = Runs(src, dst, lengths, tensor=which)
    addresses = np.array([contiguous_on(t, dev)[0] if p else 0
                          for t, p in zip(tensors, present, strict=True)], np.int64)
    out = dev.asarray(np.full(at, 5, np.float32))
    copy_runs(out, runs, runs.with_addresses(addresses, dev), device=dev, src_dtype=dtype)
    got = dev.to_host(out) if not dev.host else out
    want = np.concatenate([np.concatenate([(dev.to_host(t) if not dev.host else t).astype(
        np.float32) if p else np.zeros(t.size, np.float32), np.zeros(3, np.float32)])
        for t, p in zip(tensors, present, strict=True)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("device", sorted(DEVICES))
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("section", [1, 300, 513])
def test_runs_dequantized_as_copied_are_dequantize_blocks_then_a_copy(device, dtype, section,
                                                                      rng):
    """qwZ's fused copy-out: 3 ranks' int8 sections, each with its scales from
    its start, read through random runs: the bits of ops.dequantize_blocks
    then copy_runs, in one launch."""
    dev, world = DEVICES[device], 3
    xs = [(rng.standard_normal(section) * 10.0 ** rng.integers(-2, 2, section)).astype(
        np.float32) for _ in range(world)]
    q = np.concatenate([quantize_blocks(x)[0] for x in xs])
    scales = np.concatenate([quantize_blocks(x)[1] for x in xs])
    blocks = scales.size // world
    plain = np.concatenate([dequantize_blocks(q[r * section:(r + 1) * section],
                                              scales[r * blocks:(r + 1) * blocks], dtype)
                            for r in range(world)])
    total = world * section
    lengths = rng.integers(0, min(40, total) + 1, 40)
    src = [int(rng.integers(0, total - n + 1)) for n in lengths]
    dst = (np.cumsum([0, *lengths])[:-1] + rng.integers(0, 3, 40).cumsum()).tolist()
    runs = Runs(src, dst, lengths.tolist())
    want = np.full(dst[-1] + 50, 7, dtype)
    copy_runs(want, runs, runs.table(HOST), device=HOST, src=plain)
    out = dev.asarray(np.full(want.size, 7, dtype))
    DEVICE_OPS.reset()
    dequantize_runs(out, runs, runs.table(dev), q=dev.asarray(q), scales=dev.asarray(scales),
                    section=section, device=dev)
    if device == "standin":
        assert DEVICE_OPS.snapshot()["kernel"] == 1
    got = dev.to_host(out) if not dev.host else out
    assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()


def test_one_launch_however_many_runs():
    src = STANDIN.asarray(np.arange(100, dtype=np.float32))
    out = STANDIN.empty(100, np.float32)
    for count in (1, 10, 50):
        runs = Runs(list(range(count)), list(range(count)), [1] * count)
        table = runs.table(STANDIN)
        DEVICE_OPS.reset()
        copy_runs(out, runs, table, device=STANDIN, src=src)
        assert DEVICE_OPS.snapshot()["kernel"] == 1


def test_a_pair_of_dtypes_without_a_kernel_is_refused():
    runs = Runs([0], [0], [2])
    with pytest.raises(TypeError, match="no kernel copies float16 into"):
        copy_runs(np.zeros(2, BF16), runs, runs.table(HOST), device=HOST,
                  src=np.ones(2, np.float16))


SHAPES = {"w": (7, 3), "b": (5,), "s": (), "e": (0, 4), "r": (3, 2)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_run_tables_move_what_the_per_leaf_copies_move(world, rng):
    """Copy-out and gradient copy-in of a unit, with sizes no world divides, a
    scalar, an empty leaf and a replicated one, against the per-leaf copies."""
    full = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    specs = {k: Replicate() if k == "r" else Shard(0) for k in SHAPES}
    layout = make_layout({"u": full}, {"u": specs}, world_size=world)
    one = make_layout({"u": full}, {"u": specs}, world_size=1)
    unit = layout.units[0]
    leaves = layout.treedef.flatten_up_to({"u": full})
    # copy-out: a gathered (W, S) buffer and this rank's unit buffer
    gathered = rng.standard_normal(unit.sharded_size * world).astype(np.float32)
    local = rng.standard_normal(unit.local_size).astype(np.float32)
    want = np.zeros(one.units[0].local_size, np.float32)
    for i, dst in zip(unit.leaves, one.local_views([want]), strict=True):
        dst[...] = layout.gathered_leaf(layout.leaves[i], gathered, local)
    got = np.zeros_like(want)
    sharded, replicated = layout.gather_runs(0, one)
    copy_runs(got, sharded, sharded.table(HOST), device=HOST, src=gathered)
    copy_runs(got, replicated, replicated.table(HOST), device=HOST, src=local)
    np.testing.assert_array_equal(got, want)
    # copy-in of the sharded leaves' gradients, padding rows zero
    want = np.full(unit.sharded_size * world, 9, np.float32)
    spare = np.zeros(unit.replicated_size, np.float32)
    for i, g in zip(unit.leaves, leaves, strict=True):
        if layout.leaves[i].sharded:
            layout.pack_grad(layout.leaves[i], g, want, spare)
    got = np.full_like(want, 9)
    runs = layout.grad_runs(0, 4)
    addresses = np.array([g.ctypes.data for g in leaves], np.int64)
    copy_runs(got, runs, runs.with_addresses(addresses, HOST), device=HOST,
              src_dtype=np.float32)
    np.testing.assert_array_equal(got, want)
