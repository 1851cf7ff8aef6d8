"""``zero3(..., reshard_after_forward=L)`` (FSDP2's argument, ZeRO++'s hpZ; see
[Note: secondary shards]): the same trajectory as flat ZeRO-3, bit for bit,
and single-process AdamW's; each unit's gather crosses nodes once a step, the
rest stay inside the node."""

from __future__ import annotations

import copy
import threading

import jax
import numpy as np
import pytest

import ops
import shard
from ops.comm._base import Communicator
from tests import zero_models as M
from tests.harness import assert_rank_slices, run_steps


@pytest.fixture
def gathers(monkeypatch):
    """Every all-gather the ranks start: (group size, bytes received) each."""
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()
    original = Communicator.all_gather_async

    def record(self, out, x):
        with lock:
            seen.append((self.world_size, out.nbytes))
        return original(self, out, x)

    monkeypatch.setattr(Communicator, "all_gather_async", record)
    return seen


def train(comm, loss_fn, data, micro=1, **kw):
    step = shard.zero3(loss_fn, optimizer=adamw(), comm=comm, options=shard.ZeroOptions(**kw))
    state, metrics = run_steps(step, M.init_params(), data, comm, micro=micro)
    return step, state, [m["loss"] for m in metrics]


def adamw():
    return ops.adamw(M.LR, weight_decay=M.WD)


@pytest.mark.parametrize("world,per_node,micro", [(4, 2, 1), (6, 3, 2), (6, 2, 1), (3, 1, 2)])
def test_secondary_shards_train_as_flat_zero3_bit_for_bit(world, per_node, micro):
    data = M.batches(4)
    want, want_losses, _ = M.reference(4)

    def run(comm):
        _, flat, flat_losses = train(comm, M.LAYERED, data, micro)
        step, state, losses = train(comm, M.LAYERED, data, micro,
                                    reshard_after_forward=per_node)
        assert step.reshard_after_forward == per_node
        assert losses == flat_losses
        for a, b in zip(state.master, flat.master, strict=True):
            np.testing.assert_array_equal(a, b)
        assert_rank_slices(state.params, want, comm.rank, world)
        return losses

    losses = ops.spawn(run, world)[0]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def test_each_unit_crosses_nodes_once_a_step_and_its_other_gathers_stay_inside(gathers):
    """6 ranks as 2 nodes of 3: the flat step gathers each unit over all 6
    ranks in the forward and again in the backward (and once per micro-batch);
    with secondary shards a unit is gathered once over its 2 counterparts (one
    per node) and every gather of the whole unit is over the node's 3 ranks."""
    data, world, per_node = M.batches(2), 6, 3

    def run(comm, **kw):
        train(comm, M.LAYERED, data, 2, **kw)

    ops.spawn(run, world)
    flat = [g for g in gathers if g[0] == world]
    gathers.clear()
    ops.spawn(lambda c: run(c, reshard_after_forward=per_node), world)
    units, steps = 2, len(data)
    node = [g for g in gathers if g[0] == world // per_node]
    local = [g for g in gathers if g[0] == per_node]
    # the split into the mesh's axes gathers colors over all 6 ranks: nothing else may
    assert sum(n for size, n in gathers if size == world) <= world * world * 8
    assert len(node) == world * units * steps  # once per unit and step
    assert len(local) == len(flat)  # where the flat step gathered
    assert sorted(n for _, n in local) == sorted(n for _, n in flat)
    # bytes received from other nodes: the flat gather's (W - L) of W sections,
    # the first hop's (W/L - 1) of W/L
    # (a unit's gather: 1/L of the flat one's, for each unit)
    nodes = world // per_node
    assert ({n * (nodes - 1) // nodes * per_node for _, n in node}
            == {n * (world - per_node) // world for _, n in flat})
    # in the step: 1/L of that, once where the flat step gathers a unit 3 or 4 times (the
    # last unit stays gathered from its forward to its backward)
    across = sum(n * (nodes - 1) // nodes for _, n in node)
    across_flat = sum(n * (world - per_node) // world for _, n in flat)
    assert across * per_node * 3 <= across_flat


def test_torch_module_trains_as_flat_zero3_bit_for_bit():
    torch = pytest.importorskip("torch")
    from interop.torch import functional

    torch.manual_seed(0)  # built once: thread ranks share torch's RNG
    net0 = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))

    data = M.batches(3)

    def mse(net, b):
        return torch.nn.functional.mse_loss(net(torch.as_tensor(b["x"])), torch.as_tensor(b["y"]))

    def run(comm, **kw):
        net = copy.deepcopy(net0)
        params, loss_fn = functional(net, loss=mse, units=[net[0], net[2]])
        step = shard.zero3(loss_fn, optimizer=adamw(), comm=comm, options=shard.ZeroOptions(**kw))
        state = step.init(params)
        losses = []
        for b in data:
            state, m = step(state, shard.split_batch(b, rank=comm.rank, world_size=4))
            losses.append(m["loss"])
        return losses, np.concatenate(state.master)

    flat = ops.spawn(run, 4)
    hpz = ops.spawn(lambda c: run(c, reshard_after_forward=2), 4)
    for (a, x), (b, y) in zip(flat, hpz, strict=True):
        assert a == b
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["threads", "nccl"])
def test_device_state_trains_as_flat_zero3_bit_for_bit(backend):
    """On the device stand-in, over thread ranks and over the NCCL backend (its
    sub-communicators against the NCCL stand-in, whose sums may round in
    another order than the threads': the host run is the reference to 1e-6)."""
    from ops.device._device import device_of
    from ops.testing import STANDIN

    data = M.batches(3)

    def run(comm, device, **kw):
        step = shard.zero3(M.LAYERED, optimizer=adamw(), comm=comm,
                           options=shard.ZeroOptions(**kw))
        params = M.init_params()
        if device is not None:
            params = jax.tree.map(device.asarray, params)
        state = step.init(params)
        for b in data:
            state, _ = step(state, shard.split_batch(b, rank=comm.rank, world_size=4))
        if "offload" in kw:
            return [np.asarray(x) for x in state.master]
        assert {device_of(x) for x in state.master} == {device or ops.HOST}
        return [STANDIN.to_host(x) if device is not None else x for x in state.master]

    def both(comm):
        flat, hpz = run(comm, STANDIN), run(comm, STANDIN, reshard_after_forward=2)
        if backend == "threads":  # the compute shards in host memory, copied over to gather
            off = run(comm, STANDIN, reshard_after_forward=2,
                      offload=shard.Offload("host", params="host"))
            for x, y in zip(off, flat, strict=True):
                np.testing.assert_array_equal(x, y)
        return flat, hpz

    host = ops.spawn(lambda c: run(c, None), 4)
    if backend == "threads":
        device = ops.spawn(both, 4)
    else:
        from tests.nccl_standin import run_ranks

        device, _ = run_ranks(4, both, pytest.importorskip("cupy.cuda.nccl"), rendezvous=True)
    for want, (flat, hpz) in zip(host, device, strict=True):
        for w, x, y in zip(want, flat, hpz, strict=True):
            np.testing.assert_array_equal(y, x)
            np.testing.assert_allclose(y, w, rtol=1e-6, atol=1e-7)


def test_bad_values_are_refused_by_name():
    def run(comm):
        with pytest.raises(ValueError, match=r"reshard_after_forward=3 must divide the data "
                                             r"ranks 4"):
            shard.zero3(M.loss, optimizer=adamw(), comm=comm,
                        options=shard.ZeroOptions(reshard_after_forward=3))
        with pytest.raises(ValueError, match="reshard_after_forward is stage 3's"):
            shard.zero2(M.loss, optimizer=adamw(), comm=comm,
                        options=shard.ZeroOptions(reshard_after_forward=2))
        with pytest.raises(TypeError, match="reshard_after_forward must be True, False or an "
                                            "int"):
            shard.zero3(M.loss, optimizer=adamw(), comm=comm,
                        options=shard.ZeroOptions(reshard_after_forward="node"))
        mesh = shard.Mesh(comm, {"replicate": 2, "shard": 2})
        with pytest.raises(NotImplementedError, match=r"does not compose with a 'replicate' axis"):
            shard.zero3(M.loss, optimizer=adamw(), mesh=mesh,
                        options=shard.ZeroOptions(reshard_after_forward=1))
        # the defaults and the whole world are flat ZeRO-3
        for value in (True, 4):
            step = shard.zero3(M.loss, optimizer=adamw(), comm=comm,
                               options=shard.ZeroOptions(reshard_after_forward=value))
            assert step.config.topology.secondary is None

    ops.spawn(run, 4)
