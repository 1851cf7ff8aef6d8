"""ZeRO++'s qgZ: a reduce-scatter whose sections cross the wire as int8
(ops._quant.reduce_scatter_quantized, [Note: quantized gradient reduction]),
flat and in two hops, against a numpy model of the algorithm, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import ops
import shard
from ops._quant import reduce_scatter_quantized
from shard.step.reduction import _reduce
from tests import zero_models as M
from tests.test_offload import assert_same, trajectory
from tests.test_offload_overlap import OVERLAP
from tests.test_offload_overlap import _run as _run_overlapped
from tests.test_quantized_gather import _loss, _train

BLOCK = 256


def _quantized(section, bits=8):
    """numpy's model of quantize_blocks then dequantize_blocks to float32."""
    top = np.float32(127 if bits == 8 else 7)
    back = np.empty(section.size, np.float32)
    for lo in range(0, section.size, BLOCK):
        x = section[lo:lo + BLOCK].astype(np.float32)
        amax = np.abs(x).max()
        inv = top / amax if amax > 0 else np.float32(0)
        q = np.clip(np.rint(x * inv), -top, top)
        back[lo:lo + BLOCK] = q.astype(np.float32) * (amax / top)
    return back


def _flat_model(xs, me, k, bits=8):
    """Rank ``me``'s sum: its own section exact, every other rank's quantized,
    added in rank order in float32."""
    total = None
    for r, x in enumerate(xs):
        part = x[me * k:(me + 1) * k]
        part = part.astype(np.float32) if r == me else _quantized(part, bits)
        total = part if total is None else total + part
    return total


def _two_hop_model(xs, me, k, per_node, bits=8):
    """The node's exact reduce-scatter by place, then the flat model across nodes."""
    nodes = len(xs) // per_node
    node, place = divmod(me, per_node)
    sums = []
    for m in range(nodes):  # node m's partial sums at this place: its ranks in order
        mine = [xs[m * per_node + p] for p in range(per_node)]
        sections = [np.concatenate([x[(n * per_node + place) * k:(n * per_node + place + 1) * k]
                                    for n in range(nodes)]) for x in mine]
        acc = sections[0].copy()
        for s in sections[1:]:
            acc += s
        sums.append(acc)
    return _flat_model(sums, node, k, bits)


def _inputs(world, k, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(world * k) * 10.0 ** rng.integers(-3, 2, world * k))
            .astype(np.float32) for _ in range(world)]


def _run(world, k, per_node=None, device=None, bits=8):
    xs = _inputs(world, k)

    def rank(comm):
        hierarchy = None
        if per_node is not None:
            hierarchy = (comm.split(comm.rank // per_node), comm.split(comm.rank % per_node))
        x = xs[comm.rank] if device is None else device.from_host(xs[comm.rank])
        out = (np.empty(k, np.float32) if device is None else device.empty(k, np.float32))
        got = reduce_scatter_quantized(comm, out, x, hierarchy=hierarchy, bits=bits).wait()
        assert got is out
        return got if device is None else device.to_host(got)

    return xs, ops.spawn(rank, world)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [0, 5, 300])
def test_the_flat_form_is_the_numpy_model_bit_for_bit(world, k, bits):
    xs, outs = _run(world, k, bits=bits)
    for me, out in enumerate(outs):
        np.testing.assert_array_equal(out, _flat_model(xs, me, k, bits))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("world", "per_node"), [(4, 2), (6, 2), (6, 3)])
def test_two_hops_are_the_numpy_model_bit_for_bit(world, per_node, bits):
    k = 301  # odd: int4's last byte holds one value
    xs, outs = _run(world, k, per_node, bits=bits)
    for me, out in enumerate(outs):
        np.testing.assert_array_equal(out, _two_hop_model(xs, me, k, per_node, bits))


@pytest.mark.parametrize("bits", [8, 4])
def test_on_the_device_the_same_bits_as_on_the_host(bits, device):
    _, host = _run(3, 300, bits=bits)
    _, on_device = _run(3, 300, device=device, bits=bits)
    for h, d in zip(host, on_device, strict=True):
        np.testing.assert_array_equal(h, d)


@pytest.mark.parametrize("bits", [8, 4])
def test_each_sum_is_within_the_other_ranks_half_scales_of_the_exact_one(bits):
    world, k = 4, 700
    xs, outs = _run(world, k, bits=bits)
    for me, out in enumerate(outs):
        exact = np.sum([x[me * k:(me + 1) * k].astype(np.float64) for x in xs], axis=0)
        bound = np.zeros(k)
        for r, x in enumerate(xs):
            if r != me:
                section = x[me * k:(me + 1) * k]
                for lo in range(0, k, BLOCK):
                    top = 127 if bits == 8 else 7
                    bound[lo:lo + BLOCK] += np.abs(section[lo:lo + BLOCK]).max() / top / 2
        err = np.abs(out.astype(np.float64) - exact)
        assert (err <= bound * (1 + 1e-5) + 1e-6 * np.abs(exact)).all()
        assert err.max() > 0  # the quantized sections are not exact


@pytest.mark.parametrize("bits", [8, 4])
def test_what_crosses_the_wire_is_int8_values_and_a_scale_per_block(bits):
    """The sections another rank receives are int8 (int4: two a byte) and
    float32 scales: about a quarter (an eighth) of the exact reduce-scatter's
    float32 bytes."""
    world, k, sent = 3, 1000, []

    class Counting:
        def __init__(self, comm):
            self._comm, self.world_size, self.rank = comm, comm.world_size, comm.rank

        def all_to_all_async(self, out, x):
            sent.append((self.rank, x.dtype, x.nbytes))
            return self._comm.all_to_all_async(out, x)

    xs = _inputs(world, k)
    ops.spawn(lambda comm: reduce_scatter_quantized(
        Counting(comm), np.empty(k, np.float32), xs[comm.rank], bits=bits).wait(), world)
    mine = sorted((dtype.name, n) for r, dtype, n in sent if r == 0)
    values = world * k * bits // 8
    assert mine == [("float32", world * 4 * 4),  # 4 blocks of 256
                    ("int8" if bits == 8 else "uint8", values)]
    exact = (world - 1) * k * 4  # bytes rank 0 sends in a float32 reduce-scatter
    assert (world - 1) * (k * bits // 8 + 4 * 4) / exact < (0.27 if bits == 8 else 0.14)


def test_bad_arguments_are_refused_before_anything_moves():
    def rank(comm):
        with pytest.raises(ValueError, match="do not fit"):
            reduce_scatter_quantized(comm, np.empty(3, np.float32), np.ones(7, np.float32))
        with pytest.raises(TypeError, match="out must have dtype float32"):
            reduce_scatter_quantized(comm, np.empty(3, np.float16), np.ones(6, np.float32))
        with pytest.raises(TypeError, match="x must have dtype"):
            reduce_scatter_quantized(comm, np.empty(3, np.float64), np.ones(6, np.float64))
        with pytest.raises(ValueError, match="bits must be 8 or 4"):
            reduce_scatter_quantized(comm, np.empty(3, np.float32), np.ones(6, np.float32),
                                     bits=1)
        return True

    assert all(ops.spawn(rank, 2))


# -- in the ZeRO step: quantized_gradients= (DeepSpeed's zero_quantized_gradients) ----------

@pytest.mark.parametrize(("stage", "bits"), [(1, True), (2, True), (3, True), (3, 4)])
def test_training_with_quantized_gradients_follows_the_exact_run(stage, bits):
    zero = (None, shard.zero1, shard.zero2, shard.zero3)[stage]
    exact = shard.spawn(lambda c: _train(c, zero), 3)
    quantized = shard.spawn(lambda c: _train(c, zero, quantized_gradients=bits), 3)
    coarse = 1 if bits is True else 3  # int4's scales are 127 / 7 times int8's
    for (losses, params), (want_losses, want) in zip(quantized, exact, strict=True):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-2 * coarse)
        for a, b in zip(params, want, strict=True):
            for key in a:  # Adam moves a near-zero gradient of another sign by lr a step
                assert np.abs(a[key] - b[key]).mean() < 2e-3 * coarse, key
                assert np.abs(a[key] - b[key]).max() <= 6 * 1e-2 * 1.01, key
        assert not np.array_equal(params[0]["w"], want[0]["w"])
    assert all(q[0] == quantized[0][0] for q in quantized)  # every rank, the same losses


def test_with_secondary_shards_only_the_hop_across_nodes_is_quantized():
    """hpZ's groups of 2 of 4 ranks: the gradients are summed exactly inside each
    group and quantized across groups (all-to-alls on the 'node' communicator
    only), and the run follows the exact one."""

    calls = []
    real = _reduce.reduce_scatter_quantized

    def spy(comm, out, x, *, hierarchy=None, bits=8):
        calls.append(hierarchy is not None and hierarchy[1].world_size == 2 and bits == 8)
        return real(comm, out, x, hierarchy=hierarchy, bits=bits)

    _reduce.reduce_scatter_quantized = spy
    try:
        both = shard.spawn(lambda c: _train(c, shard.zero3, steps=3, quantized_gradients=True,
                                            quantized_weights=True, reshard_after_forward=2), 4)
    finally:
        _reduce.reduce_scatter_quantized = real
    exact = shard.spawn(lambda c: _train(c, shard.zero3, steps=3), 4)
    assert calls and all(calls)
    for (losses, params), (want_losses, want) in zip(both, exact, strict=True):
        np.testing.assert_allclose(losses, want_losses, rtol=2e-2)
        assert np.abs(params[0]["w"] - want[0]["w"]).mean() < 2e-3


def test_what_quantized_gradients_do_not_compose_with_is_refused_by_name():
    def run(comm):
        errors = []
        for zero, kw in ((shard.zero0, {}), (shard.zero3, {"invariant_shards": 4}),
                         (shard.zero2, {"quantized_gradients": 2})):
            kw = {"quantized_gradients": True, **kw}
            try:
                zero(_loss, optimizer=ops.adamw(1e-2), comm=comm, options=shard.ZeroOptions(**kw))
            except (TypeError, ValueError, NotImplementedError) as e:
                errors.append((type(e).__name__, str(e)))
        mesh = shard.Mesh(comm, {"replicate": 2, "shard": 2})
        try:
            shard.zero3(_loss, optimizer=ops.adamw(1e-2), mesh=mesh,
                        options=shard.ZeroOptions(quantized_gradients=True))
        except NotImplementedError as e:
            errors.append((type(e).__name__, str(e)))
        return errors

    errors = shard.spawn(run, 4)[0]
    assert [t for t, _ in errors] == ["ValueError", "NotImplementedError", "TypeError",
                                      "NotImplementedError"]
    assert all("quantized_gradients" in m for _, m in errors)
    assert "invariant_shards" in errors[1][1] and "replicate" in errors[3][1]


def test_deepspeeds_zero_quantized_gradients_maps_onto_the_option():
    base = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW",
                                                                "params": {"lr": 1e-3}}}
    for stage in (1, 2, 3):
        cfg = shard.from_deepspeed_config({**base, "zero_optimization": {
            "stage": stage, "zero_quantized_gradients": True}})
        assert cfg.quantized_gradients is True
    with pytest.raises(ValueError, match="zero_quantized_gradients=true at stage 0"):
        shard.from_deepspeed_config({**base, "zero_optimization": {
            "stage": 0, "zero_quantized_gradients": True}})


@pytest.mark.parametrize("stage", [1, 3])
def test_quantized_gradients_on_the_device_are_the_hosts_bit_for_bit(device, stage):
    """The device path (the stand-in's emulated kernels, or CuPy's) quantizes,
    sends and sums the same bits as the host's; on a GPU, from the GPU's
    gradients, far closer to the host's than the exact run is."""
    host = ops.spawn(lambda c: trajectory(c, stage, quantized_gradients=True), 3)
    on_device = ops.spawn(lambda c: trajectory(c, stage, device=device,
                                               quantized_gradients=True), 3)
    exact = ops.spawn(lambda c: trajectory(c, stage), 3)
    for d, h, e in zip(on_device, host, exact, strict=True):
        if device.name == "standin":
            assert_same(d, h)
        else:  # on a GPU, JAX computes the gradients there, rounding as the GPU does
            for a, b, c in zip(d[0], h[0], e[0], strict=True):
                assert np.abs(a - b).max() <= 1e-2 * np.abs(b - c).max()
        assert d[1] != e[1]  # and they are not the exact run's


@pytest.mark.parametrize("stage", [2, 3])
def test_overlapped_offload_and_micro_batches_with_quantized_gradients(stage):
    """Offload(overlap=True) hands each unit's quantized reduction to its copier
    thread; with micro-batches every one's reduction is quantized and summed:
    the trajectory is the unoffloaded quantized one, bit for bit."""
    def micro(comm):
        return [shard.MicroBatches([shard.split_batch(b, rank=comm.rank, world_size=2)
                                    for b in M.batches(3, seed=s)]) for s in range(3)]

    want = ops.spawn(lambda c: _run_overlapped(c, stage, micro(c), quantized_gradients=True), 2)
    got = ops.spawn(lambda c: _run_overlapped(c, stage, micro(c), offload=OVERLAP,
                                              quantized_gradients=True), 2)
    exact = ops.spawn(lambda c: _run_overlapped(c, stage, micro(c)), 2)
    for (gp, gm), (wp, wm), (ep, _) in zip(got, want, exact, strict=True):
        for a, b in zip(gp, wp, strict=True):
            np.testing.assert_array_equal(a, b)
        assert gm == wm
        assert any(not np.array_equal(a, b) for a, b in zip(gp, ep, strict=True))
