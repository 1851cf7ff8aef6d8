"""DLPack bridges (pointers equal), and states in and out of JAX."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import interop
import interop.jax as ij
import ops
import shard
from tests import zero_models as M


@pytest.mark.parametrize("dtype", [np.float32, ops.BF16, np.float16, np.int32])
def test_round_trips_share_memory(dtype):
    a = ops.aligned_empty(64, dtype)
    a[...] = np.arange(64).astype(dtype)
    t = interop.to_torch(a)
    j = interop.to_jax(t)
    back = interop.to_numpy(j)
    assert interop.shares_memory(a, t) and interop.shares_memory(t, j)
    assert interop.shares_memory(j, back) and interop.shares_memory(a, interop.to_jax(a))
    assert interop.shares_memory(interop.to_numpy(t), a)
    np.testing.assert_array_equal(back.astype(np.float64), np.arange(64))
    if dtype == ops.BF16:
        assert t.dtype == torch.bfloat16 and j.dtype == jnp.bfloat16 and back.dtype == ops.BF16


@pytest.mark.parametrize("dtype", [np.float32, ops.BF16, np.float16, np.int32, np.uint8, np.bool_,
                                   np.complex64, np.float64, np.int64])
def test_jax_view_of_host_memory_is_what_from_dlpack_gives(dtype):
    from ops.device._dlpack import jax_view

    a = ops.aligned_empty(24, dtype).reshape(2, 3, 4)
    a[...] = (np.arange(24) % 2).reshape(2, 3, 4).astype(dtype)
    want = jnp.from_dlpack(a.view(np.uint16)) if dtype == ops.BF16 else jnp.from_dlpack(a)
    got = jax_view(a)
    assert got.shape == (2, 3, 4) and got.dtype == (jnp.bfloat16 if dtype == ops.BF16 else
                                                    want.dtype)
    assert got.sharding == want.sharding and got.committed == want.committed
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16) if dtype == ops.BF16 else
                                  np.asarray(got), a.view(np.uint16) if dtype == ops.BF16 else a)
    if dtype not in (ops.BF16, np.float64, np.int64):  # views, not converted copies
        assert interop.shares_memory(a, got)
    unaligned = ops.aligned_empty(17, np.float32)[1:]
    unaligned[...] = np.arange(16)
    np.testing.assert_array_equal(np.asarray(jax_view(unaligned)), np.arange(16))


@pytest.mark.parametrize("private", ["missing", "failing"])
def test_jax_view_takes_from_dlpack_where_jax_has_no_import_of_its_own(monkeypatch, private):
    from jax._src.lib import _jax

    from ops.device import _dlpack

    def other_signature(capsule, device):
        raise TypeError("dlpack_managed_tensor_to_buffer(): incompatible function arguments")

    if private == "missing":
        monkeypatch.delattr(_jax, "dlpack_managed_tensor_to_buffer")
    else:
        monkeypatch.setattr(_jax, "dlpack_managed_tensor_to_buffer", other_signature)
    _dlpack._host_import.cache_clear()
    try:
        assert _dlpack._host_import() is jnp.from_dlpack
    finally:
        monkeypatch.undo()
        _dlpack._host_import.cache_clear()
    np.testing.assert_array_equal(np.asarray(_dlpack.jax_view(np.ones(3, np.float32))), 1)


def test_bridges_refuse_what_cannot_be_shared():
    with pytest.raises(ValueError, match="not C-contiguous"):
        interop.to_torch(np.ones((4, 4), np.float32)[:, ::2])
    assert interop.to_torch(np.ones((4, 4), np.float32)[:, ::2], copy=True).shape == (4, 2)
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        interop.to_torch(ro)
    with pytest.raises(TypeError, match="complex64 has no torch equivalent"):
        interop.to_torch(np.ones(2, np.complex64))
    with pytest.raises(TypeError, match="expected a numpy, torch, jax or cupy array"):
        interop.to_numpy([1, 2])
    with pytest.raises(ValueError, match="not contiguous"):
        interop.to_numpy(torch.ones(4, 4).T)

    class OnGpu:  # what to_numpy reads of a jax array on a GPU
        __module__ = "jaxlib.xla_extension"

        def devices(self):
            return [types.SimpleNamespace(platform="gpu")]

    with pytest.raises(ValueError, match="the jax array is on gpu; use to_cupy"):
        interop.to_numpy(OnGpu())  # as the torch branch refuses a CUDA tensor: no silent copy
    with pytest.raises(TypeError, match="narrow int64 to 32 bits"):
        interop.to_jax(np.ones(4, np.int64))
    assert interop.to_jax(np.ones(4, np.int64), copy=True).dtype == jnp.int32


def test_local_params_of_a_device_state_are_jax_arrays_over_its_shards():
    """On CuPy state (the stand-in here) local_params hands JAX each shard
    through DLPack, as on the host: no implicit copy to the host."""
    from ops.testing import STANDIN, to_device

    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm)
        state = step.init(to_device(M.init_params(), STANDIN))
        local = ij.local_params(state)
        for got, mine in zip(jax.tree.leaves(local), jax.tree.leaves(state.params), strict=True):
            assert isinstance(got, jax.Array)
            np.testing.assert_array_equal(np.asarray(got), STANDIN.to_host(mine))
        return len(jax.tree.leaves(local))

    assert ops.spawn(run, 2) == [len(jax.tree.leaves(M.init_params()))] * 2


def test_a_gathered_state_runs_in_jit_on_a_mesh():
    mesh = ij.mesh(4, backend="cpu")
    specs = [{"w": shard.Shard(0), "b": shard.Shard(0)},
             {"w": shard.Shard(0), "b": shard.Replicate(), "gain": shard.Replicate()}]
    batch = M.batches(1)[0]

    def run(comm):
        step = shard.zero3(M.loss, optimizer=ops.adamw(M.LR), comm=comm, specs=specs)
        state = step.init(M.init_params())
        local = ij.local_params(state)
        np.testing.assert_array_equal(np.asarray(local[1]["b"]), state.params[1]["b"])
        return shard.gather(state, comm)

    full = ops.spawn(run, 4)[0]
    sharded = ij.global_params(full, mesh, specs)
    assert sharded[1]["w"].sharding.spec == jax.sharding.PartitionSpec()  # 5 rows: replicated
    wide = {"w": np.ones((8, 3), np.float32)}
    assert ij.global_params(wide, mesh)["w"].sharding.spec == jax.sharding.PartitionSpec("dp")
    value = jax.jit(M.loss)(sharded, batch)
    np.testing.assert_allclose(float(value), float(M.loss(full, batch)), rtol=1e-6)
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        ij.mesh(64)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_named_sharding_pytree_goes_into_a_state_shard_by_shard(world, monkeypatch):
    """zero3's and pure_zero3's init take each rank's rows of a leaf split over a
    4-device mesh from the device shards that hold them (rows of 2 devices each
    at 4 ranks, spanning devices at 3), never the whole leaf; a leaf split along
    another axis is read whole; the states equal those made from NumPy."""
    import optax
    from jax._src.array import ArrayImpl

    mesh = ij.mesh(4, backend="cpu")
    params = {"wide": np.arange(8 * 3, dtype=np.float32).reshape(8, 3),
              "tall": np.arange(12 * 2, dtype=np.float32).reshape(12, 2),
              "odd": np.arange(5 * 2, dtype=np.float32).reshape(5, 2),
              "cols": np.arange(3 * 8, dtype=np.float32).reshape(3, 8)}
    named = ij.global_params({k: v for k, v in params.items() if k != "cols"}, mesh)
    named["cols"] = jax.device_put(params["cols"], jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(None, "dp")))
    whole = []
    array = ArrayImpl.__array__

    def spy(self, *a, **k):  # a whole copy of a leaf split over the devices
        if len(self.sharding.device_set) > 1 and not self.sharding.is_fully_replicated:
            whole.append(self.shape)
        return array(self, *a, **k)

    monkeypatch.setattr(ArrayImpl, "__array__", spy)

    def loss(p, b):
        return sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(p)) * b

    def run(comm):
        step = shard.zero3(loss, optimizer=ops.adamw(1e-3), comm=comm)
        pure = shard.pure_zero3(loss, optimizer=optax.adam(1e-3), comm=comm)
        return (step.init(named).params, step.init(params).params,
                jax.device_get(pure.init(named).params), jax.device_get(pure.init(params).params))

    for got, want, got_pure, want_pure in ops.spawn(run, world):
        for k in params:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
            np.testing.assert_array_equal(got_pure[k], want_pure[k], err_msg=k)
    assert whole == [(3, 8)] * (2 * world)  # "cols" alone, once per rank and init


@pytest.mark.parametrize("on", ["host", "device"])
def test_named_params_are_built_shard_by_shard_from_the_ranks_states(caplog, on):
    from ops.testing import STANDIN, to_device

    mesh = ij.mesh(4, backend="cpu")
    place = (lambda t: to_device(t, STANDIN)) if on == "device" else (lambda t: t)
    host = STANDIN.to_host if on == "device" else np.asarray
    params = {"wide": np.arange(8 * 3, dtype=np.float32).reshape(8, 3),
              "odd": np.arange(5 * 2, dtype=np.float32).reshape(5, 2),
              "scale": np.float32(2.0)}

    def loss(p, b):
        return jnp.sum(p["wide"]) * p["scale"] + jnp.sum(p["odd"] * b["x"])

    def run(comm):
        step = shard.zero3(loss, optimizer=ops.adamw(1e-3), comm=comm)
        return step.init(place(params)), shard.gather(step.init(place(params)), comm)

    out = ops.spawn(run, 4)
    states = [s for s, _ in out]
    with caplog.at_level("WARNING", logger="interop.jax"):
        named = ij.named_params(states, mesh)  # a device state's shards through DLPack
    assert "['odd'][5, 2]" in caplog.text and "wide" not in caplog.text
    assert named["wide"].sharding.spec == jax.sharding.PartitionSpec("dp")
    for piece in named["wide"].addressable_shards:  # device r holds rank r's rows
        r = list(mesh.devices.flat).index(piece.device)
        np.testing.assert_array_equal(np.asarray(piece.data), host(states[r].params["wide"]))
    for k in params:
        np.testing.assert_array_equal(np.asarray(named[k]), host(out[0][1][k]))
    b = {"x": np.ones((5, 2), np.float32)}
    np.testing.assert_allclose(float(jax.jit(loss)(named, b)), float(loss(params, b)))
    with pytest.raises(ValueError, match="give every rank's state"):
        ij.named_params(states[:2], mesh)
    with caplog.at_level("WARNING", logger="interop.jax"):
        ij.shardings(params, None, mesh)
    assert "shardings: 1 leaves" in caplog.text
